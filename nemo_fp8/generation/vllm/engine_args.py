"""``VllmConfig`` -> vLLM engine arguments and environment (pure logic: imports no vLLM).

What the FP8 engine needs, and where each piece comes from:

* ``hf_overrides={"quantization_config": {...}}``: vLLM 0.22 builds every Linear of a BF16
  model as ``Fp8LinearMethod`` (e4m3 ``weight`` + fp32 ``weight_scale_inv`` per 128x128 block)
  when the model config carries an FP8 block quantization config. ``ignored_layers`` come from
  our layer-precision policy (``nemo_fp8.fp8.plan_layer_precision``), so
  ``num_first/last_layers_in_bf16``, routers, ``lm_head`` and user patterns stay BF16 in the
  engine exactly as in the torch reference.
* ``load_format="dummy"``: the engine starts with random weights; the first refit brings the
  policy's (so no checkpoint is read twice, and FP8 weights are always *our* quantization).
* ``weight_transfer_config``: ``ipc`` (trainer on the same GPU) or ``nccl`` (elsewhere).
* ``tensor_parallel_size`` and, above 1, ``distributed_executor_backend="mp"``: vLLM's
  multiprocessing executor, one worker process per GPU, spawned from the process that builds the
  engine (the trainer's engine actor) and inheriting its ``CUDA_VISIBLE_DEVICES``. vLLM 0.22 would
  otherwise pick its Ray executor inside a Ray placement group (``ParallelConfig.__post_init__``)
  and ask Ray for GPUs the trainer's placement group already holds.
* ``logprobs_mode="processed_logprobs"``: log-probs of the distribution actually sampled.
* ``compilation_config={"pass_config": {"fuse_act_quant": False, "fuse_norm_quant": False}}`` in
  every compiled FP8 engine. vLLM 0.22's compile passes otherwise replace SiLU-and-mul + group quant and
  RMSNorm + group quant (the inputs of gate/up, down and q/k/v) with fused CUDA kernels
  (``silu_and_mul_per_block_quant``, ``rms_norm_per_block_quant``) that (a) compute fp32 scales whatever
  the quantizer's ``use_ue8m0`` says (their replacements in
  ``compilation/passes/fusion/{act_quant_fusion,rms_quant_fusion}.py`` carry no E8M0 flag), so with
  ``pow2_activation_scaling_factors`` only ``o_proj``'s input would get power-of-two scales, and (b) were
  slower than what replaces them here (Inductor's SiLU / RMSNorm kernels + vLLM's
  ``per_token_group_quant`` CUDA op): the decode-step profile is in docs/performance.md
  (``profile-rollout`` suite). ``live_activation_scales`` says which format an engine really uses.
* ``worker_extension_cls``: ``Fp8WorkerExtension``, imported in every worker process before the
  model is built; importing its module applies the patch table (``patches.py``): from
  ``worker_extension`` those of every engine, from ``worker_extension_fp8`` (FP8 engines) the FP8
  ones too. The engine argument, not the environment, says which.
* ``additional_config={"nemo_fp8": {...}}`` (``engine_additional_config``): vLLM's own slot for
  settings of extensions, carried in ``VllmConfig`` to every engine process (and into its compile
  cache hash). ``pow2_activation_scales`` there is read by the patch that makes vLLM's
  per-token-group activation quantizer honour ``pow2_activation_scaling_factors``.
* Environment (set before the engine spawns its processes, inherited by them): vLLM's own switches
  only, ``VLLM_USE_DEEP_GEMM`` (``use_deep_gemm``; with it ``VLLM_DEEP_GEMM_WARMUP``, ``deep_gemm_warmup``),
  ``VLLM_USE_DEEP_GEMM_E8M0``
  (= ``pow2_weight_scaling_factors``: one scale convention end to end), ``VLLM_USE_V2_MODEL_RUNNER``
  and ``VLLM_ALLOW_INSECURE_SERIALIZATION``: vLLM reads these from the environment and has no
  engine argument for them. No nemo_fp8 setting travels through the environment.

Scale-convention rules (``scale_convention_errors``): DeepGEMM with E8M0 requantizes every
weight to power-of-two scales after loading and casts activation scales to powers of two, so
``use_deep_gemm`` + ``pow2_weight_scaling_factors`` needs ``pow2_activation_scaling_factors``;
``pow2_weight_scaling_factors: false`` means fp32 scales everywhere, so E8M0 is switched off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from nemo_fp8.generation.config import SUPPORTED_TENSOR_PARALLEL_SIZES, VllmConfig
from nemo_fp8.generation.vllm.patches import ENGINE_SETTINGS_KEY  # pure python: imports no vLLM

WORKER_EXTENSION_CLS = "nemo_fp8.generation.vllm.worker_extension.Fp8WorkerExtension"
FP8_WORKER_EXTENSION_CLS = "nemo_fp8.generation.vllm.worker_extension_fp8.Fp8WorkerExtension"
WEIGHT_TRANSFER_BACKENDS = ("ipc", "nccl")


@dataclass
class Fp8EngineSpec:
    """What ``init_fp8`` returns: ``vllm.LLM(**engine_kwargs)`` after ``os.environ.update(env)``.

    Attributes:
        engine_kwargs: keyword arguments of ``vllm.LLM`` / ``EngineArgs``.
        env: vLLM's environment switches every engine process must see (already applied by
            ``init_fp8`` unless ``apply_env=False``); nemo_fp8's own settings travel in
            ``engine_kwargs["additional_config"]``.
        fp8_modules: HF names of the Linear modules that run in FP8 (the refit quantizes
            ``<module>.weight`` of exactly these).
        ignored_layers: vLLM ``ignored_layers`` (high-precision modules).
        refit_plan: ``RefitPlan`` (what the refit quantizes, which names a full refit holds).
    """

    engine_kwargs: dict[str, Any]
    env: dict[str, str]
    fp8_modules: list[str] = field(default_factory=list)
    ignored_layers: list[str] = field(default_factory=list)
    refit_plan: Any = None


def scale_convention_errors(cfg: VllmConfig) -> list[str]:
    """Mixes of scale conventions the engine would not honour (empty list: consistent)."""
    errs = []
    if cfg.precision != "fp8":
        return errs
    if cfg.use_deep_gemm and cfg.pow2_weight_scaling_factors and not cfg.pow2_activation_scaling_factors:
        errs.append("vllm_cfg: use_deep_gemm with pow2_weight_scaling_factors turns on DeepGEMM's E8M0 path, which "
                    "uses power-of-two activation scales; set pow2_activation_scaling_factors: true (or "
                    "pow2_weight_scaling_factors: false for fp32 scales everywhere with E8M0 off)")
    return errs


def engine_additional_config(cfg: VllmConfig) -> dict[str, Any]:
    """vLLM ``additional_config`` for ``cfg``: nemo_fp8's settings under ``patches.ENGINE_SETTINGS_KEY``.

    ``precision`` (``"bfloat16"`` | ``"fp8"``) and ``pow2_activation_scales`` (bool: the dynamic per-token-group
    activation quantizers of an FP8 engine use power-of-two scales; False in a BF16 engine, which has none).
    JSON values only: vLLM hashes the dict into its compile cache key.
    """
    return {ENGINE_SETTINGS_KEY: {"precision": cfg.precision,
                                  "pow2_activation_scales": cfg.precision == "fp8" and cfg.pow2_activation_scaling_factors}}


def engine_env(cfg: VllmConfig) -> dict[str, str]:
    """vLLM's environment switches of every engine process for ``cfg`` (always explicit, never vLLM's defaults)."""
    env = {
        "VLLM_USE_DEEP_GEMM": "1" if cfg.use_deep_gemm else "0",
        # one scale convention end to end: E8M0 (pow2) scales in vLLM iff pow2 in our quantizer
        "VLLM_USE_DEEP_GEMM_E8M0": "1" if (cfg.use_deep_gemm and cfg.pow2_weight_scaling_factors) else "0",
        # CUDA IPC handles (rebuild_cuda_tensor args hold torch types) cross LLM.update_weights -> engine core
        # through vLLM's msgpack encoder, which needs its pickle fallback for them
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    }
    if cfg.use_deep_gemm:  # which kernels DeepGEMM compiles at start-up (vLLM's default: relax)
        env["VLLM_DEEP_GEMM_WARMUP"] = cfg.deep_gemm_warmup
    if cfg.model_runner != "auto":  # auto: vLLM decides per model (V2 for unquantized Qwen3 only, in 0.22)
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if cfg.model_runner == "v2" else "0"
    return env


def compilation_config(cfg: VllmConfig) -> Optional[dict[str, Any]]:
    """vLLM ``compilation_config`` for ``cfg`` (None: vLLM's defaults).

    A compiled FP8 engine (``precision: fp8``, not ``enforce_eager``) gets vLLM's activation-quant fusion
    passes off: their fused kernels write fp32 scales only (so ``pow2_activation_scaling_factors`` would not
    hold at the gate/up, down and q/k/v inputs) and are slower than the unfused path (module
    docstring). BF16 and eager engines run no such pass: None.
    """
    if cfg.precision != "fp8" or cfg.enforce_eager:
        return None
    return {"pass_config": {"fuse_act_quant": False, "fuse_norm_quant": False}}


def live_activation_scales(act_ue8m0: list[bool], compiled: bool, fuse_act_quant: bool,
                           fuse_norm_quant: bool) -> str:
    """The activation scale format an engine's FP8 linears really get: ``"pow2"``, ``"fp32"``, ``"mixed"``
    or ``"none"`` (no FP8 linear).

    Args:
        act_ue8m0: the distinct ``use_ue8m0`` values of the engine's dynamic per-token-group quantizers
            (``QuantFP8``).
        compiled: the engine runs vLLM's own compile pipeline (``CompilationMode.VLLM_COMPILE``), where the
            fusion passes run.
        fuse_act_quant, fuse_norm_quant: the live ``pass_config`` flags.

    A compiled engine with either fusion on computes fp32 scales at the fused sites (gate/up, down, q/k/v
    inputs) whatever ``use_ue8m0`` says, so power-of-two quantizers there give ``"mixed"``.
    """
    flags = set(act_ue8m0)
    if not flags:
        return "none"
    if flags == {False}:
        return "fp32"
    if flags == {True} and not (compiled and (fuse_act_quant or fuse_norm_quant)):
        return "pow2"
    return "mixed"


def quantization_config(cfg: VllmConfig, ignored_layers: list[str]) -> Optional[dict[str, Any]]:
    """The ``quantization_config`` override for ``cfg`` (None for bfloat16)."""
    if cfg.precision != "fp8":
        return None
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": list(cfg.weight_block_size),
        "ignored_layers": list(ignored_layers),
    }


def build_engine_spec(cfg: VllmConfig, model_config: Any, model_path: Optional[str] = None, *,
                      weight_transfer: str = "ipc", colocated: bool = True, seed: int = 0,
                      load_format: str = "dummy", extra: Optional[dict[str, Any]] = None) -> Fp8EngineSpec:
    """Pure mapping ``cfg`` -> ``Fp8EngineSpec`` (see the module docstring).

    Raises:
        ValueError: invalid config (all problems listed at once).
    """
    errs = list(cfg.config_errors()) + scale_convention_errors(cfg)
    if weight_transfer not in WEIGHT_TRANSFER_BACKENDS:
        errs.append(f"weight_transfer: {weight_transfer!r}; valid: {list(WEIGHT_TRANSFER_BACKENDS)}")
    if cfg.tensor_parallel_size not in SUPPORTED_TENSOR_PARALLEL_SIZES:
        errs.append(f"tensor_parallel_size: {cfg.tensor_parallel_size}; valid: "
                    f"{', '.join(map(str, SUPPORTED_TENSOR_PARALLEL_SIZES))}")
    if errs:
        raise ValueError("vLLM engine config: " + "; ".join(errs))
    from nemo_fp8.generation.vllm.refit import build_refit_plan

    refit_plan, ignored = build_refit_plan(cfg, model_config)
    if cfg.precision != "fp8":  # bf16 engine: nothing quantized, no ignored layers
        refit_plan.fp8_modules, refit_plan.fp8_expert_containers, ignored = set(), set(), []
    kwargs: dict[str, Any] = {
        "dtype": "bfloat16",
        "load_format": load_format,
        "skip_tokenizer_init": True,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
        "enforce_eager": cfg.enforce_eager,
        "kv_cache_dtype": cfg.kv_cache_dtype,
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": FP8_WORKER_EXTENSION_CLS if cfg.precision == "fp8" else WORKER_EXTENSION_CLS,
        "additional_config": engine_additional_config(cfg),
        "weight_transfer_config": {"backend": weight_transfer},
        "enable_sleep_mode": bool(colocated),
        "enable_prefix_caching": False,
        "seed": seed,
    }
    if cfg.tensor_parallel_size > 1:  # one worker process per GPU inside this process's GPUs (module docstring)
        kwargs["distributed_executor_backend"] = "mp"
    if model_path is not None:
        kwargs["model"] = str(model_path)
    if cfg.max_model_len is not None:
        kwargs["max_model_len"] = cfg.max_model_len
    if cfg.kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = cfg.kv_cache_memory_bytes
    qc = quantization_config(cfg, ignored)
    if qc is not None:
        kwargs["hf_overrides"] = {"quantization_config": qc}
    cc = compilation_config(cfg)
    if cc is not None:
        kwargs["compilation_config"] = cc
    if extra:
        kwargs.update(extra)
    return Fp8EngineSpec(kwargs, engine_env(cfg), sorted(refit_plan.fp8_modules), list(ignored), refit_plan)


def init_fp8(vllm_cfg: VllmConfig, model_config: Any, model_path: Optional[str] = None, *,
             apply_env: bool = True, check_patches: bool = True, **kwargs) -> Fp8EngineSpec:
    """Engine arguments for the FP8 rollout engine, with every engine process prepared.

    Sets vLLM's environment switches (``engine_env``) in this process, which vLLM's engine and worker
    processes inherit, and - when vLLM is importable - checks the patch table against the
    installed vLLM (clear error on an untested version). The worker extension applies the
    patches inside each worker at import. Returns ``Fp8EngineSpec``; build the engine with
    ``vllm.LLM(**spec.engine_kwargs)``.

    Raises:
        ValueError: invalid config; RuntimeError: installed vLLM not covered by the patch table.
    """
    spec = build_engine_spec(vllm_cfg, model_config, model_path, **kwargs)
    if apply_env:
        os.environ.update(spec.env)
    if check_patches and vllm_cfg.precision == "fp8":
        from nemo_fp8.generation.vllm import patches

        patches.check_installed_vllm()
    return spec
