"""Rollout backends: ``torch`` (reference, here) and ``vllm`` (FP8 engine, a later issue)."""

from nemo_fp8.generation.interfaces import GenerationBackend, SamplingParams

__all__ = ["GenerationBackend", "SamplingParams", "build_generation_backend"]


def build_generation_backend(backend: str, **kwargs) -> GenerationBackend:
    """Build the backend named by ``policy.generation.backend`` (runs inside its Ray actor).

    Raises:
        NotImplementedError: ``vllm``, which is not part of this build yet.
        ValueError: an unknown name.
    """
    if backend == "torch":
        from nemo_fp8.generation.torch_backend import TorchGenerationBackend

        return TorchGenerationBackend(**kwargs)
    if backend == "vllm":
        raise NotImplementedError("policy.generation.backend='vllm': the vLLM FP8 engine is not in this build yet; "
                                  "valid now: 'torch' (the reference backend, same FP8 numerics)")
    raise ValueError(f"policy.generation.backend={backend!r}; valid: 'torch', 'vllm'")
