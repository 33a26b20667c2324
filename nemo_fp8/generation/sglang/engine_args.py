"""``vllm_cfg`` (precision) + ``sglang_cfg`` (engine) -> ``sglang.Engine`` keyword arguments (pure: imports no SGLang).

What the FP8 engine needs, and where SGLang 0.5.17 reads it:

* ``quantization="fp8"`` and ``json_model_override_args='{"quantization_config": {...}}'``: the engine starts from
  the BF16 checkpoint's config with an FP8 *block* quantization config laid over it (``ModelConfig`` applies the
  override to the HF config; ``Fp8Config.from_config`` in ``srt/layers/quantization/fp8.py`` then reads
  ``quant_method: fp8`` as an FP8-serialized checkpoint, ``weight_block_size: [128, 128]``, ``activation_scheme:
  dynamic``, ``ignored_layers``). Every non-ignored Linear is then ``Fp8LinearMethod`` with an e4m3 ``weight`` and an
  fp32 ``weight_scale_inv`` per 128x128 block, activations quantized per 1x128 group at run time. SGLang 0.5.17
  cannot block-quantize BF16 weights itself (``Fp8Config`` raises "The block-wise quantization only supports
  fp8-serialized checkpoint"), so the weights are quantized by this project's quantizer on the trainer side and sent
  in that format (verl's way). ``ignored_layers`` come from the layer-precision policy (``plan_layer_precision``), the
  same list the vLLM engine gets: first/last BF16 layers, ``fp8_ignore_patterns``, routers, ``lm_head``.
* ``load_format="dummy"``: the serialized-FP8 config makes the parameters e4m3, which the BF16 checkpoint cannot
  fill; the first refit (the backend's initial load) brings the real weights, quantized.
* ``kv_cache_dtype``: ``vllm_cfg.kv_cache_dtype`` ``fp8`` -> ``"fp8_e4m3"`` (per-layer ``k_scale`` / ``v_scale``
  parameters, ``srt/layers/quantization/kv_cache.py``), ``auto`` -> ``"auto"``.
* ``fp8_gemm_runner_backend``: ``use_deep_gemm`` -> ``"deep_gemm"``, else ``"triton"`` (``dispatch_w8a8_block_fp8_
  linear``; on Hopper ``"cutlass"`` is refused by SGLang 0.5.17, so Triton is the non-DeepGEMM block GEMM).
* ``enable_memory_saver`` (colocated): ``release_memory_occupation`` / ``resume_memory_occupation`` work;
  ``enable_weights_cpu_backup`` = ``sglang_cfg.cpu_weight_backup``.
* ``custom_weight_loader``: the functions of ``engine_hooks`` that ``update_weights_from_tensor`` may run inside the
  engine's scheduler process (a device sync after each bucket; the read-back of KV scales, parameter addresses and
  memory), SGLang's only way to run this project's code next to the model
  (``WeightUpdater.update_weights_from_tensor``).
* ``skip_tokenizer_init``, ``sampling_backend="pytorch"`` (the sampling of ``top_p=1``/no ``top_k`` requests is
  ``sampling_from_probs_torch`` on either backend; no FlashInfer needed for it), ``dtype="bfloat16"``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from nemo_fp8.generation.sglang.config import SglangConfig

SYNC_HOOK = "nemo_fp8.generation.sglang.engine_hooks.synchronize"
READBACK_HOOK = "nemo_fp8.generation.sglang.engine_hooks.read_engine_state"
KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8_e4m3"}
FA3_MAX_HEAD_DIM = 256  # FlashAttention 3 applies the FP8 KV scales only up to this head size (flashattention_backend)
BLOCK = 128
# SGLang fuses these HF shards into one Linear (qkv_proj, gate_up_proj): each shard's rows must fill whole blocks
_FUSED_SHARDS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
# Fp8Config adds the layers this variable names to ignored_layers; the refit plan would not know them
IGNORED_LAYERS_ENV = "SGLANG_FP8_IGNORED_LAYERS"


@dataclass
class SglangEngineSpec:
    """What ``build_engine_spec`` returns.

    Attributes:
        engine_kwargs: keyword arguments of ``sglang.srt.entrypoints.engine.Engine`` (``ServerArgs`` fields).
        refit_plan: ``RefitPlan`` (which HF tensors become e4m3 + ``weight_scale_inv``; the names a refit must hold).
        fp8_modules: HF names of the Linear modules that run in FP8.
        ignored_layers: the ``quantization_config["ignored_layers"]`` sent (empty for a BF16 engine).
        num_layers: decoder layers (the KV scales a refit must carry: ``k``/``v`` of each).
        head_dim: attention head size.
    """

    engine_kwargs: dict[str, Any]
    refit_plan: Any
    fp8_modules: list[str] = field(default_factory=list)
    ignored_layers: list[str] = field(default_factory=list)
    num_layers: int = 0
    head_dim: int = 0


def quantization_config(vllm_cfg: Any, ignored_layers: list[str]) -> Optional[dict[str, Any]]:
    """The FP8 block ``quantization_config`` laid over the BF16 model's config (None for ``precision: bfloat16``).

    Keys as an FP8 block checkpoint writes them (DeepSeek-V3 / Qwen3-FP8 ``config.json``; verl's
    ``build_sglang_fp8_quant_config``): ``quant_method: fp8``, ``fmt: e4m3``, ``activation_scheme: dynamic``,
    ``weight_block_size``, ``ignored_layers`` (HF names; SGLang also matches them with and without ``model.``).
    """
    if vllm_cfg.precision != "fp8":
        return None
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(vllm_cfg.weight_block_size), "ignored_layers": list(ignored_layers)}


def block_shape_errors(model: Any, fp8_modules: list[str], fp8_expert_containers: set[str]) -> list[str]:
    """FP8 layers SGLang would refuse at start: a shard of a fused Linear (q/k/v, gate/up) whose rows do not fill
    whole 128-row blocks (``Fp8LinearMethod.validate_block_quant_shapes``: "Weight output_partition_size ... is not
    divisible by weight quantization block_n"), or FP8 experts whose intermediate size does not
    (``Fp8MoEMethod.create_weights``).

    Args:
        model: the HF model on the meta device (``meta_model``).
        fp8_modules: HF Linear names that run in FP8; fp8_expert_containers: ``...mlp.experts`` that do.

    Returns:
        one line per offending layer kind (first module named), keys under ``vllm_cfg``.
    """
    modules = dict(model.named_modules())
    bad: dict[str, str] = {}
    for name in fp8_modules:
        leaf = name.rpartition(".")[2]
        rows = getattr(modules.get(name), "out_features", None)
        if leaf in _FUSED_SHARDS and rows is not None and rows % BLOCK:
            bad.setdefault(leaf, f"{name} has {rows} output rows")
    params = dict(model.named_parameters())
    for container in sorted(fp8_expert_containers):
        gate_up = params.get(f"{container}.gate_up_proj")
        if gate_up is not None and (gate_up.shape[1] // 2) % BLOCK:
            bad.setdefault("experts", f"{container} has intermediate size {gate_up.shape[1] // 2}")
    return [f"vllm_cfg.precision: 'fp8' needs every FP8 {kind} of SGLang's fused layers to fill whole {BLOCK}-row "
            f"blocks, but {why}; keep those layers in BF16 (vllm_cfg.fp8_ignore_patterns) or use precision "
            "'bfloat16'" for kind, why in bad.items()]


def _engine_kwargs(vllm_cfg: Any, sglang_cfg: SglangConfig, model_path: Optional[str], qc: Optional[dict],
                   colocated: bool, context_length: int) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "skip_tokenizer_init": True,
        "load_format": "dummy",
        "dtype": "bfloat16",
        "kv_cache_dtype": KV_CACHE_DTYPES[vllm_cfg.kv_cache_dtype],
        "tp_size": sglang_cfg.tp_size,
        "mem_fraction_static": sglang_cfg.mem_fraction_static,
        "attention_backend": sglang_cfg.attention_backend,
        "sampling_backend": "pytorch",
        "disable_cuda_graph": sglang_cfg.disable_cuda_graph,
        "disable_radix_cache": sglang_cfg.disable_radix_cache,
        "context_length": context_length,
        "random_seed": sglang_cfg.random_seed,
        "enable_deterministic_inference": sglang_cfg.enable_deterministic_inference,
        "enable_memory_saver": bool(colocated),
        "enable_weights_cpu_backup": bool(colocated and sglang_cfg.cpu_weight_backup),
        "custom_weight_loader": [SYNC_HOOK, READBACK_HOOK],
        "weight_version": "-1",  # the policy version SGLang tags outputs with; each refit sets its own
        "log_level": "error",
    }
    if model_path is not None:
        kw["model_path"] = str(model_path)
    if sglang_cfg.max_running_requests is not None:
        kw["max_running_requests"] = sglang_cfg.max_running_requests
    if qc is not None:
        kw["quantization"] = "fp8"
        kw["json_model_override_args"] = json.dumps({"quantization_config": qc})
        kw["fp8_gemm_runner_backend"] = "deep_gemm" if vllm_cfg.use_deep_gemm else "triton"
    return kw


def build_engine_spec(vllm_cfg: Any, sglang_cfg: SglangConfig, model_config: Any, model_path: Optional[str] = None,
                      *, colocated: bool = True, max_total_sequence_length: int = 4096,
                      extra: Optional[dict[str, Any]] = None) -> SglangEngineSpec:
    """Pure mapping of the two sections and the model to ``SglangEngineSpec`` (module docstring).

    Args:
        vllm_cfg: ``policy.generation.vllm_cfg`` (its precision keys).
        sglang_cfg: ``policy.generation.sglang_cfg``.
        model_config: an HF config, a dict with ``model_type``, or a local checkpoint folder.
        model_path: the checkpoint folder SGLang reads the config from (``model_path``).
        colocated: the engine releases its memory between rollouts (``enable_memory_saver``).
        max_total_sequence_length: the context length when ``sglang_cfg.context_length`` is None.
        extra: further ``Engine`` keyword arguments (tests, benchmarks), applied last.

    Raises:
        ValueError: every problem at once: the sections' own rules, ``sglang_generation_errors``, FP8 layers SGLang
            would refuse (``block_shape_errors``), an FP8 KV cache with heads larger than FA3 scales
            (``FA3_MAX_HEAD_DIM``), or ``SGLANG_FP8_IGNORED_LAYERS`` set in this process's environment.
    """
    from nemo_fp8.generation.sglang.config import sglang_generation_errors
    from nemo_fp8.generation.vllm.refit import build_refit_plan, meta_model

    errs = list(vllm_cfg.config_errors()) + list(sglang_cfg.config_errors())
    errs += sglang_generation_errors(sglang_cfg, vllm_cfg)
    if os.environ.get(IGNORED_LAYERS_ENV):
        errs.append(f"{IGNORED_LAYERS_ENV}={os.environ[IGNORED_LAYERS_ENV]!r} is set: SGLang would keep more layers in "
                    "BF16 than the refit quantizes; unset it and use vllm_cfg.fp8_ignore_patterns")
    plan, ignored = build_refit_plan(vllm_cfg, model_config)
    model = meta_model(model_config)
    cfg = model.config
    num_layers = int(cfg.num_hidden_layers)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    if vllm_cfg.precision == "fp8":
        errs += block_shape_errors(model, sorted(plan.fp8_modules), plan.fp8_expert_containers)
    else:  # a BF16 engine: nothing quantized, no ignored layers
        plan.fp8_modules, plan.fp8_expert_containers, ignored = set(), set(), []
    if vllm_cfg.kv_cache_is_fp8 and head_dim > FA3_MAX_HEAD_DIM:
        errs.append(f"vllm_cfg.kv_cache_dtype: 'fp8' with head_dim {head_dim}: SGLang's FA3 applies the KV scales only "
                    f"up to {FA3_MAX_HEAD_DIM} (valid for this model: 'auto')")
    if errs:
        raise ValueError("SGLang engine config: " + "; ".join(errs))
    context = sglang_cfg.context_length or max_total_sequence_length
    kw = _engine_kwargs(vllm_cfg, sglang_cfg, model_path, quantization_config(vllm_cfg, ignored), colocated, context)
    kw.update(extra or {})
    return SglangEngineSpec(kw, plan, sorted(plan.fp8_modules), list(ignored), num_layers, head_dim)
