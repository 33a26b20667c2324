"""``policy.generation.sglang_cfg``: the SGLang engine's own knobs, and the rules that tie them to ``vllm_cfg``.

Why two sections. ``vllm_cfg`` holds two kinds of keys. Its *precision* keys (``precision``,
``num_first_layers_in_bf16``, ``num_last_layers_in_bf16``, ``fp8_ignore_patterns``, ``weight_block_size``,
``pow2_weight_scaling_factors``, ``kv_cache_dtype``, ``kv_scale_margin``, ``kv_calibration_max_samples``,
``use_deep_gemm``) say what numerics the rollout has; the trainer reads them too (the torch reference engine, the
FP8 KV calibration of every step, the IS-correction rule, the keys a resume may not change), so an SGLang run reuses
them unchanged: one source, and a YAML switches engine by ``policy.generation.backend`` alone. Its *engine* keys
(``gpu_memory_utilization``, ``tensor_parallel_size``, ``max_model_len``, ``enforce_eager``, ``sleep_level``, ...)
are vLLM's; SGLang's counterparts live here under SGLang's ``ServerArgs`` names, which are the names NeMo-RL's
``sglang_cfg`` uses (``mem_fraction_static``, ``attention_backend``, ``disable_cuda_graph``, ``tp_size``,
``context_length``, ``random_seed``, ``disable_radix_cache``; ``cpu_weight_backup`` is NeMo-RL's
``sglang_server_config.cpu_weight_backup``). A vLLM engine key set away from its default under
``backend: sglang`` is an error naming the key to use instead (``sglang_generation_errors``).

Pure pydantic: imports neither SGLang nor ``nemo_fp8.generation.config`` (which imports this module).
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from nemo_fp8.utils.config import StrictConfig

# vLLM engine keys of vllm_cfg -> what replaces them with SGLang (None: SGLang has no such knob here)
VLLM_ENGINE_KEYS: dict[str, Optional[str]] = {
    "gpu_memory_utilization": "sglang_cfg.mem_fraction_static",
    "kv_cache_memory_bytes": None,
    "tensor_parallel_size": "sglang_cfg.tp_size",
    "max_model_len": "sglang_cfg.context_length",
    "enforce_eager": "sglang_cfg.disable_cuda_graph",
    "sleep_level": "sglang_cfg.cpu_weight_backup",
    "model_runner": None,
    "seed_each_request": "sglang_cfg.enable_deterministic_inference",
    "deep_gemm_warmup": None,
}
# attention backends whose kernels read the k/v scale *tensors* a refit writes (see SglangConfig.attention_backend)
LIVE_KV_SCALE_BACKENDS = ("fa3",)


class SglangConfig(StrictConfig):
    """SGLang engine settings (``sglang.srt.server_args.ServerArgs`` names; module docstring).

    Attributes:
        tp_size: GPUs per engine. 1 only: the refit hands one CUDA IPC payload per tensor-parallel rank from the
            engine actor's GPU, and a multi-GPU SGLang engine's placement and refit have not been built or run.
        mem_fraction_static: share of the GPU's memory for weights and the KV pool (``gpu_memory_utilization``'s
            counterpart).
        attention_backend: ``fa3`` (FlashAttention 3, Hopper; reads the per-layer ``k_scale`` / ``v_scale`` tensors,
            so the scales of each refit take effect), ``flashinfer`` or ``triton`` (both read
            ``RadixAttention.k_scale_float``, a float set once when the model loads: refused with an FP8 KV cache).
        disable_cuda_graph: run eagerly (``enforce_eager``'s counterpart).
        disable_radix_cache: no prefix cache. On, it is flushed after every refit (old weights' KV).
        context_length: the engine's longest sequence; None: ``policy.max_total_sequence_length``.
        random_seed: the engine's seed.
        enable_deterministic_inference: SGLang's deterministic mode; only in it does a request's ``sampling_seed``
            drive its sampling (``SamplingBatchInfo.from_schedule_batch``), so requests are seeded as the torch and
            vLLM engines seed them. Off: the engine's own generator draws the batch's noise.
        cpu_weight_backup: colocated only. False: releasing memory between rollouts discards the weights (nothing
            copied; the loop refits before every wake, as vLLM ``sleep_level: 2``); True: SGLang copies them to host
            memory and back (``enable_weights_cpu_backup``).
        max_running_requests: SGLang's cap on concurrent requests; None: its own.
    """

    tp_size: int = Field(1, ge=1)
    mem_fraction_static: float = Field(0.6, gt=0, lt=1)
    attention_backend: Literal["fa3", "flashinfer", "triton"] = "fa3"
    disable_cuda_graph: bool = False
    disable_radix_cache: bool = False
    context_length: Optional[int] = Field(None, ge=1)
    random_seed: int = 0
    enable_deterministic_inference: bool = False
    cpu_weight_backup: bool = False
    max_running_requests: Optional[int] = Field(None, ge=1)

    def config_errors(self) -> list[str]:
        errs = []
        if self.tp_size != 1:
            errs.append(f"tp_size: {self.tp_size} is not supported (valid: 1): the SGLang refit hands one CUDA IPC "
                        "payload per rank from the engine actor's GPU, and multi-GPU SGLang engines are not built yet")
        return errs


def sglang_generation_errors(sglang_cfg: SglangConfig, vllm_cfg: Any) -> list[str]:
    """Problems of ``policy.generation`` under ``backend: sglang``, keys relative to ``policy.generation``.

    Args:
        sglang_cfg: the section.
        vllm_cfg: the ``VllmConfig`` beside it (its precision keys are reused; module docstring).

    Returns:
        one ``key: problem (valid: ...)`` line per problem: a vLLM engine key away from its default (the SGLang key
        to set instead), power-of-two activation scales (SGLang 0.5.17 has no switch for them on Hopper), an FP8 KV
        cache on an attention backend that reads load-time scales.
    """
    errs = []
    fields = type(vllm_cfg).model_fields
    for key, instead in VLLM_ENGINE_KEYS.items():
        value = getattr(vllm_cfg, key)
        if value != fields[key].default:
            use = f"set {instead}" if instead else "SGLang has no such setting here"
            errs.append(f"vllm_cfg.{key}: {value!r} is a vLLM engine setting, unused with backend 'sglang' ({use}; "
                        f"valid: its default {fields[key].default!r})")
    if vllm_cfg.pow2_activation_scaling_factors:
        errs.append("vllm_cfg.pow2_activation_scaling_factors: true cannot hold in SGLang 0.5.17: its per-token-group "
                    "activation quantizer takes power-of-two scales only on DeepGEMM's UE8M0 path "
                    "(deep_gemm_wrapper.DEEPGEMM_SCALE_UE8M0, Blackwell), with no setting to ask for them "
                    "(valid with backend 'sglang': false)")
    if vllm_cfg.kv_cache_is_fp8 and sglang_cfg.attention_backend not in LIVE_KV_SCALE_BACKENDS:
        errs.append(f"sglang_cfg.attention_backend: {sglang_cfg.attention_backend!r} reads the FP8 KV scales as "
                    "floats fixed when the model loads (RadixAttention.k_scale_float), so the scales each refit sends "
                    f"would not take effect (valid with vllm_cfg.kv_cache_dtype 'fp8': "
                    f"{', '.join(map(repr, LIVE_KV_SCALE_BACKENDS))})")
    return errs
