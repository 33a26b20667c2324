"""Helpers on the Megatron-core model that TransformerEngine builds: unwrapping the DDP / Float16Module layers,
TE's fused weight-gradient accumulation, and marking the next forward as the first micro-batch (a fresh FP8
weight cache). Imported by ``nemo_fp8.policy.megatron.backend`` on the GPU host only.
"""

from __future__ import annotations

import torch


def fuse_te_wgrad_accumulation(model: torch.nn.Module, enabled: bool = True) -> int:
    """Make every TransformerEngine module of ``model`` accumulate its weight gradient into the
    parameter's ``main_grad`` inside the wgrad GEMM (TE's ``fuse_wgrad_accumulation``); ``enabled``
    false switches them back to a separate ``.grad`` (the GPU test compares the two paths).

    Without it each TE wgrad GEMM writes a bf16 ``param.grad`` and megatron-core's DDP hook adds it
    to the fp32 ``main_grad`` in a separate kernel (its cost and this fusion's gain: docs/performance.md,
    ``bench-train-dense`` suite); with it the GEMM's epilogue
    accumulates in the buffer's dtype (``out=main_grad, accumulate=True``), TE sets
    ``grad_added_to_main_grad`` and the hook skips the add (``megatron/core/distributed/
    distributed_data_parallel.py``). megatron-core ties this option to ``gradient_accumulation_fusion``,
    which also switches its own (non-TE) output layer to APEX's ``fused_weight_gradient_mlp_cuda``
    and fails at construction where APEX is not installed (``tensor_parallel/layers.py``); so the
    model is built with that flag off and the TE modules, which need no APEX, get it here. TE reads
    the attribute at every forward (``module/linear.py``, ``layernorm_linear.py``,
    ``layernorm_mlp.py``, ``grouped_linear.py``).

    Args:
        model: the DDP-wrapped model: every parameter has the ``main_grad`` view of the grad buffer.

    Returns:
        The number of TE modules switched.
    """
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    n = 0
    for module in model.modules():
        if isinstance(module, TransformerEngineBaseModule) and hasattr(module, "fuse_wgrad_accumulation"):
            module.fuse_wgrad_accumulation = enabled
            n += 1
    return n


def unwrap(model):
    """DDP(Float16Module(GPTModel)) -> GPTModel."""
    while hasattr(model, "module"):
        model = model.module
    return model


def requantize_fp8_weights(model) -> None:
    """Make the next forward quantize every FP8 weight afresh (then reuse it for the following micro-batches).

    TransformerEngine caches each Linear's FP8 weight and refreshes the cache only on a "first micro-batch";
    megatron-core's pipeline schedules mark it once per global batch (``MegatronModule.set_is_first_microbatch``,
    a no-op without FP8). This backend calls the model itself, so it marks it before every pass whose weights may
    have changed since the cache was filled: each global batch of ``train_shard``, each log-prob and calibration
    pass. Unmarked, every forward after a module's first reused that first FP8 weight (an optimizer step did not
    reach the FP8 forward; the colocated offload clears the cache once per GRPO step, which hid it in runs of one
    update per step).
    """
    gpt = unwrap(model)
    if hasattr(gpt, "set_is_first_microbatch"):
        gpt.set_is_first_microbatch()
