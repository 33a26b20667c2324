"""Our ``policy`` config -> megatron-core / Megatron-Bridge settings (pure: imports no engine).

One function per megatron-core object, each returning plain keyword arguments, so the mapping
is tested on CPU and the backend (``backend.py``) only passes them on:

* ``provider_overrides`` -> attributes of Megatron-Bridge's ``GPTModelProvider`` (a megatron-core
  ``TransformerConfig``): parallelism (tensor, pipeline with its virtual stages), dtypes, and the FP8 recipe (``fp8``, ``fp8_recipe``,
  ``fp8_param``, ``first_last_layers_bf16`` with the layer counts of the layer-precision policy,
  the same ``policy.generation.vllm_cfg.num_{first,last}_layers_in_bf16`` the rollout uses);
* ``ddp_config_kwargs`` -> ``DistributedDataParallelConfig``;
* ``optimizer_config_kwargs`` -> ``OptimizerConfig``;
* ``scheduler_kwargs`` -> ``OptimizerParamScheduler`` (warm-up, then constant or decaying learning rate);
* ``sequence_pad_multiple`` -> how the micro-batch's sequence length is padded for the recipe;
* ``block_scaling_env`` -> TransformerEngine's scale convention for the blockwise recipe.

The gradient convention follows NeMo-RL's megatron setup: ``calculate_per_token_loss=True``
and ``average_in_collective=False`` make megatron-core *sum* gradients across data-parallel
ranks without dividing by the rank count, because our loss is already normalised by the
global batch's token / sequence counts (``nemo_fp8.algorithms.loss``).
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_fp8.policy.config import PolicyConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def train_dtype(cfg: PolicyConfig) -> torch.dtype:
    """The dtype of the model's compute: fp16 (``megatron_cfg.optimizer.fp16``, with loss scaling),
    else bf16 (``optimizer.bf16`` or ``policy.precision: bfloat16``), else fp32."""
    opt = cfg.megatron_cfg.optimizer
    if opt.fp16:
        return torch.float16
    if opt.bf16 or cfg.precision == "bfloat16":
        return torch.bfloat16
    return torch.float32


def bf16_layer_counts(cfg: PolicyConfig) -> tuple[int, int]:
    """(first, last) decoder layers kept in BF16 in training: the rollout's counts
    (``policy.generation.vllm_cfg.num_{first,last}_layers_in_bf16``), one source for both."""
    v = cfg.generation.vllm_cfg
    return v.num_first_layers_in_bf16, v.num_last_layers_in_bf16


def provider_overrides(cfg: PolicyConfig) -> dict[str, Any]:
    """Attributes to set on the Bridge provider before ``finalize()``.

    FP8 keys follow megatron-core's ``TransformerConfig`` (NeMo-RL sets the same ones from
    ``policy.megatron_cfg.fp8_cfg``); megatron-core applies them per layer itself
    (``get_fp8_context`` / ``is_first_last_bf16_layer`` in ``megatron/core/fp8_utils.py``).
    ``gradient_accumulation_fusion`` is off: for megatron-core's own output layer it needs APEX's
    fused wgrad kernels; the TE layers get TE's fusion after the build instead
    (``megatron_cfg.fuse_wgrad_accumulation``, ``backend.fuse_te_wgrad_accumulation``).
    ``apply_rope_fusion`` and ``bias_activation_fusion`` come from the ``megatron_cfg`` keys of
    those names (NeMo-RL's; on by default, as in Megatron-LM's training arguments).
    ``megatron_cfg.override_transformer_config`` comes last (its keys are none of the ones set here:
    ``nemo_fp8.policy.config.MANAGED_TRANSFORMER_KEYS``).
    """
    m = cfg.megatron_cfg
    dtype = train_dtype(cfg)
    out: dict[str, Any] = dict(
        tensor_model_parallel_size=m.tensor_model_parallel_size,
        pipeline_model_parallel_size=m.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=m.virtual_pipeline_model_parallel_size,
        # pipeline stages exchange each micro-batch's hidden-state shape: packed rows and padded micro-batches
        # keep their own lengths (nemo_fp8.policy.megatron.pipeline)
        variable_seq_lengths=m.pipeline_model_parallel_size > 1,
        context_parallel_size=m.context_parallel_size,
        expert_model_parallel_size=m.expert_model_parallel_size,
        sequence_parallel=m.sequence_parallel and m.tensor_model_parallel_size > 1,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=m.apply_rope_fusion,
        bias_activation_fusion=m.bias_activation_fusion,
        calculate_per_token_loss=True,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        autocast_dtype=dtype,
    )
    if m.activation_checkpointing:
        out.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    f = m.fp8_cfg
    if f.enabled:
        first, last = bf16_layer_counts(cfg)
        out.update(fp8=f.fp8, fp8_recipe=f.fp8_recipe, fp8_param=f.fp8_param,
                   first_last_layers_bf16=bool(first or last),
                   num_layers_at_start_in_bf16=first, num_layers_at_end_in_bf16=last)
    else:
        out.update(fp8=None, fp8_param=False)
    out.update(m.override_transformer_config)  # config validation keeps these off the keys above
    return out


def ddp_config_kwargs(cfg: PolicyConfig) -> dict[str, Any]:
    """``DistributedDataParallelConfig``: gradients summed (not averaged) across ranks, reduced
    in fp32 (unless ``distributed_data_parallel_config.grad_reduce_in_fp32`` is false: the weights'
    dtype), the distributed optimizer when configured, FP8 parameter all-gather with ``fp8_param``.

    NaN gradients stop training (``check_for_nan_in_grad``) except in fp16: there an overflow is
    expected now and then, and the loss scaler handles it (skips the update, lowers the scale),
    as with Megatron-LM's fp16 training."""
    m = cfg.megatron_cfg
    return dict(grad_reduce_in_fp32=m.distributed_data_parallel_config.grad_reduce_in_fp32,
                overlap_grad_reduce=False, overlap_param_gather=False, average_in_collective=False,
                check_for_nan_in_grad=train_dtype(cfg) != torch.float16,
                use_distributed_optimizer=m.optimizer.use_distributed_optimizer,
                fp8_param_gather=m.fp8_cfg.enabled and m.fp8_cfg.fp8_param)


def optimizer_config_kwargs(cfg: PolicyConfig) -> dict[str, Any]:
    """``OptimizerConfig``: Adam (decoupled weight decay) or SGD with fp32 master weights (Adam's moments in
    ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` with the precision-aware optimizer); the
    gradient-norm clip is ``policy.max_grad_norm`` unless ``megatron_cfg.optimizer.clip_grad`` is set;
    fp16 gets dynamic loss scaling (megatron-core's ``DynamicGradScaler``); ``fp8_recipe`` tells the
    optimizer how FP8 parameters are scaled (as Megatron-Bridge sets it from its mixed-precision config);
    ``optimizer_cpu_offload`` / ``optimizer_offload_fraction`` / ``overlap_cpu_optimizer_d2h_h2d`` select
    megatron-core's ``HybridDeviceOptimizer`` (``megatron/core/optimizer/cpu_offloading``)."""
    o = cfg.megatron_cfg.optimizer
    dtype = train_dtype(cfg)
    return dict(optimizer=o.optimizer, lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=_DTYPES[o.params_dtype],
                adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
                clip_grad=o.clip_grad if o.clip_grad is not None else cfg.max_grad_norm,
                use_distributed_optimizer=o.use_distributed_optimizer,
                use_precision_aware_optimizer=o.use_precision_aware_optimizer,
                exp_avg_dtype=_DTYPES[o.exp_avg_dtype], exp_avg_sq_dtype=_DTYPES[o.exp_avg_sq_dtype],
                fp8_recipe=cfg.megatron_cfg.fp8_cfg.fp8_recipe if cfg.megatron_cfg.fp8_cfg.enabled else None,
                loss_scale=None, initial_loss_scale=o.initial_loss_scale,
                optimizer_cpu_offload=o.optimizer_cpu_offload, optimizer_offload_fraction=o.optimizer_offload_fraction,
                overlap_cpu_optimizer_d2h_h2d=o.overlap_cpu_optimizer_d2h_h2d)


def scheduler_kwargs(cfg: PolicyConfig) -> dict[str, Any]:
    """``OptimizerParamScheduler``: a linear warm-up from ``lr_warmup_init`` over ``lr_warmup_steps`` updates (none
    by default), then a constant learning rate or ``lr_decay_style``'s decay to ``min_lr`` at ``lr_decay_steps``
    (``WSD``: over the last ``wsd_decay_steps``), and a constant weight decay (it also applies megatron-core's
    no-weight-decay groups: biases and norms). The torch backend follows the same schedule
    (``nemo_fp8.policy.schedule.scheduled_lr``)."""
    o = cfg.megatron_cfg.optimizer
    constant = o.lr_decay_style == "constant"
    return dict(init_lr=o.lr_warmup_init if o.lr_warmup_steps else o.lr, max_lr=o.lr, min_lr=o.min_lr,
                lr_warmup_steps=o.lr_warmup_steps,
                lr_decay_steps=o.lr_warmup_steps + 1 if constant else o.lr_decay_steps,  # must exceed the warm-up
                lr_decay_style=o.lr_decay_style, wsd_decay_steps=o.wsd_decay_steps,
                lr_wsd_decay_style=o.lr_wsd_decay_style if o.lr_decay_style == "WSD" else None,
                start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=1, wd_incr_style="constant")


def sequence_pad_multiple(cfg: PolicyConfig) -> int:
    """Multiple the micro-batch's sequence length is padded to.

    TransformerEngine's FP8 GEMMs need the token dimension divisible by 16 (tensorwise) or 128
    (blockwise: cuBLAS block size), times the tensor-parallel size with sequence parallelism
    (NeMo-RL ``_get_pack_sequence_parameters_for_megatron``). Padding is right padding with the
    pad token: causal attention keeps real tokens independent of it.
    """
    m = cfg.megatron_cfg
    mult = 1
    if m.fp8_cfg.enabled:
        mult = 128 if m.fp8_cfg.fp8_recipe == "blockwise" else 16
    if m.sequence_parallel and m.tensor_model_parallel_size > 1:
        mult *= m.tensor_model_parallel_size
    return mult


def block_scaling_env(cfg: PolicyConfig) -> dict[str, str]:
    """Environment for TE's ``Float8BlockScaling`` (read when TE is imported): power-of-two
    scales iff ``policy.generation.vllm_cfg.pow2_weight_scaling_factors``, the convention the
    rollout's quantizer and vLLM (DeepGEMM E8M0) use, so trainer and engine agree."""
    pow2 = cfg.generation.vllm_cfg.pow2_weight_scaling_factors
    return {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "0" if pow2 else "1"}
