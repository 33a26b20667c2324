"""vLLM FP8 rollout backend (GPU host only: nothing here imports vLLM at package import).

``init_fp8(vllm_cfg, model_config)`` -> engine arguments (``engine_args``);
``VllmGenerationBackend`` (``backend``); ``send_weights_ipc`` / ``send_weights_nccl`` (``refit``).
"""

from nemo_fp8.generation.vllm.engine_args import Fp8EngineSpec, build_engine_spec, init_fp8

__all__ = ["Fp8EngineSpec", "build_engine_spec", "init_fp8", "VllmGenerationBackend"]


def __getattr__(name):
    if name == "VllmGenerationBackend":
        from nemo_fp8.generation.vllm.backend import VllmGenerationBackend

        return VllmGenerationBackend
    raise AttributeError(name)
