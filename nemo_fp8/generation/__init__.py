"""Rollout backends: ``torch`` (reference, here), ``vllm`` (FP8 engine, ``nemo_fp8.generation.vllm``) and ``sglang``
(FP8 engine, ``nemo_fp8.generation.sglang``)."""

from nemo_fp8.generation.interfaces import GenerationBackend, SamplingParams
from nemo_fp8.generation.spec import GenerationSpec

__all__ = ["GenerationBackend", "GenerationSpec", "SamplingParams", "build_generation_backend"]


def build_generation_backend(spec: GenerationSpec) -> GenerationBackend:
    """Build the backend named by ``spec.backend`` (``policy.generation.backend``; runs inside its Ray actor).

    Raises:
        ImportError: ``vllm`` / ``sglang`` where that engine is not installed (GPU host only).
        ValueError: an unknown backend name.
    """
    if spec.backend == "torch":
        import torch

        from nemo_fp8.generation.torch_backend import TorchGenerationBackend

        return TorchGenerationBackend(spec.model_name, spec.vllm_cfg, spec.device, spec.pad_token_id,
                                      spec.eos_token_id, spec.max_total_sequence_length, batch_size=spec.batch_size,
                                      offload_when_idle=spec.offload_when_idle,
                                      dtype=getattr(torch, spec.reference_dtype))
    if spec.backend == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:  # vLLM itself is imported only inside generation/vllm/
            raise ImportError("policy.generation.backend='vllm' needs vLLM 0.22 (pyproject extra 'vllm', installed on "
                              "the GPU host); valid without it: 'torch' (the reference backend, same FP8 numerics)")
        from nemo_fp8.generation.vllm.backend import VllmGenerationBackend

        return VllmGenerationBackend(spec.model_name, spec.vllm_cfg, spec.pad_token_id, spec.eos_token_id,
                                     spec.max_total_sequence_length, colocated=spec.offload_when_idle,
                                     device=spec.device, batch_size=spec.batch_size,
                                     weight_transfer=spec.weight_transfer or "ipc")
    if spec.backend == "sglang":
        import importlib.util

        if importlib.util.find_spec("sglang") is None:  # SGLang itself is imported only inside generation/sglang/
            raise ImportError("policy.generation.backend='sglang' needs SGLang 0.5.17 (pyproject extra 'sglang', "
                              "staged in a site folder of its own on the GPU host: docs/rollout-engines.md); valid "
                              "without it: 'torch', 'vllm'")
        from nemo_fp8.generation.sglang.backend import SglangGenerationBackend

        # CUDA without an index: buckets are converted on this actor's current GPU, the engine's
        return SglangGenerationBackend(spec.model_name, spec.vllm_cfg, spec.sglang_cfg, spec.pad_token_id,
                                       spec.eos_token_id, spec.max_total_sequence_length,
                                       colocated=spec.offload_when_idle, device=spec.device)
    raise ValueError(f"policy.generation.backend={spec.backend!r}; valid: 'torch', 'vllm', 'sglang'")
