"""Rollout backends: ``torch`` (reference, here) and ``vllm`` (FP8 engine, ``nemo_fp8.generation.vllm``)."""

from nemo_fp8.generation.interfaces import GenerationBackend, SamplingParams

__all__ = ["GenerationBackend", "SamplingParams", "build_generation_backend"]


def build_generation_backend(backend: str, **kwargs) -> GenerationBackend:
    """Build the backend named by ``policy.generation.backend`` (runs inside its Ray actor).

    Raises:
        ImportError: ``vllm`` where vLLM is not installed (it exists on the GPU host only).
        ValueError: an unknown name.
    """
    if backend == "torch":
        from nemo_fp8.generation.torch_backend import TorchGenerationBackend

        return TorchGenerationBackend(**kwargs)
    if backend == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:  # vLLM itself is imported only inside generation/vllm/
            raise ImportError("policy.generation.backend='vllm' needs vLLM 0.22 (pyproject extra 'vllm', installed on "
                              "the GPU host); valid without it: 'torch' (the reference backend, same FP8 numerics)")
        from nemo_fp8.generation.vllm.backend import VllmGenerationBackend

        kwargs["colocated"] = kwargs.pop("offload_when_idle", True)  # sleep mode between rollouts
        return VllmGenerationBackend(**kwargs)
    raise ValueError(f"policy.generation.backend={backend!r}; valid: 'torch', 'vllm'")
