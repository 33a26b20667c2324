"""SGLang rollout backend (``policy.generation.backend: sglang``; GPU host only: nothing here imports SGLang at
package import, and ``engine_hooks`` is imported inside the engine's own process).

``build_engine_spec(vllm_cfg, sglang_cfg, model_config)`` -> ``sglang.Engine`` arguments (``engine_args``);
``SglangGenerationBackend`` (``backend``); flattened buckets, KV-scale rules and the completeness check (``refit``);
the requests into the engine (``transport``); the section ``policy.generation.sglang_cfg`` (``config``).
"""

from nemo_fp8.generation.sglang.config import SglangConfig

__all__ = ["SglangConfig", "SglangGenerationBackend"]


def __getattr__(name):
    if name == "SglangGenerationBackend":
        from nemo_fp8.generation.sglang.backend import SglangGenerationBackend

        return SglangGenerationBackend
    raise AttributeError(name)
