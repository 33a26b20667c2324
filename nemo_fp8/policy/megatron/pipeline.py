"""Pipeline parallelism in the megatron backend: megatron-core's schedules run the micro-batches.

With ``policy.megatron_cfg.pipeline_model_parallel_size`` = P > 1 every rank holds the decoder layers of its stage
(megatron-core's even split, ``get_transformer_layer_offset``), the first stage also the embedding and the last the
final norm and output layer; Megatron-Bridge's ``get_model`` builds one model chunk per virtual stage
(``virtual_pipeline_model_parallel_size``: V chunks, layers dealt round robin, megatron-core's interleaved schedule).
``get_forward_backward_func`` picks the schedule (1F1B, or interleaved 1F1B with V > 1); ``run_micro_batches`` gives
it one forward step per micro-batch and, for the last stage, the function that turns the logits into log-probs or a
loss. Hidden states travel between stages with their shapes (``TransformerConfig.variable_seq_lengths``): packed rows
and padded micro-batches keep the sizes they have without PP, no padding to one fixed length.

The loss: each micro-batch's loss is already normalised by its global batch's token / sequence counts (as without
PP); the 3-tuple the loss function returns with ``calculate_per_token_loss=True`` keeps megatron-core from dividing it
again (``forward_step_calc_loss``), and the backend finalises the gradients itself (``finalize_model_grads`` without
a token count: the data-parallel reduction, the layer-norm gradients of sequence parallelism, the tied embedding's
gradient between the first and last stage). fp16's loss scale reaches the last stage's backward through
``config.grad_scale_func`` (Megatron-LM's training loop sets it the same way).

The first / last N decoder layers kept in BF16 (``num_layers_at_{start,end}_in_bf16``) are global layer numbers:
megatron-core's ``is_first_last_bf16_layer`` reads each layer's global ``layer_number``, so every stage keeps the
right ones in BF16 whatever its offset.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Sequence

import torch


def interleaving_error(num_microbatches: int, pp_size: int, vpp_size: int | None) -> str | None:
    """Why megatron-core's interleaved schedule cannot run ``num_microbatches`` micro-batches, or None.

    megatron-core 0.18 (``forward_backward_pipelining_with_interleaving``) runs micro-batches in groups of
    ``microbatch_group_size_per_vp_stage`` (default: the pipeline size P) and refuses fewer than P micro-batches, or
    a last group of 1..P-1: the count must be a multiple of P."""
    if not vpp_size or vpp_size == 1 or pp_size == 1:
        return None
    if num_microbatches < pp_size or num_microbatches % pp_size:
        return (f"{num_microbatches} micro-batches on a data-parallel rank; the interleaved schedule "
                f"(policy.megatron_cfg.virtual_pipeline_model_parallel_size={vpp_size}) needs a multiple of "
                f"pipeline_model_parallel_size={pp_size}: give each rank more micro-batches (a smaller "
                "train_micro_batch_size or sequence_packing.train_mb_tokens, a larger train_global_batch_size) "
                "or set virtual_pipeline_model_parallel_size: null")
    return None


def run_micro_batches(chunks: list, micro_batches: Sequence, forward: Callable, on_logits: Callable,
                      forward_only: bool, pp_size: int, vpp_size: int | None) -> None:
    """Run ``micro_batches`` through the pipeline with megatron-core's schedule (forward, and backward unless
    ``forward_only``).

    Args:
        chunks: this rank's model chunks (DDP-wrapped; one per virtual stage).
        micro_batches: ``(micro_batch, lengths)`` pairs, the same on every stage of the replica.
        forward: ``forward(chunk, micro_batch, lengths) -> (output, ids)``: the chunk's forward (on a stage after the
            first, megatron-core has set its input tensor: the ids are read only by the first stage's embedding);
            ``output`` is the logits ``[B, T, V / tp]`` on the last stage, the hidden states elsewhere.
        on_logits: ``on_logits(index, micro_batch, lengths, ids, logits) -> Tensor``: on the last stage, the
            micro-batch's loss (a 0-dim tensor; backward runs from it) or, with ``forward_only``, anything
            (log-probs are kept by the callable itself).
        pp_size, vpp_size: ``pipeline_model_parallel_size``, ``virtual_pipeline_model_parallel_size``.

    Raises:
        ValueError: an interleaved schedule with a number of micro-batches it cannot run (``interleaving_error``).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    items = list(micro_batches)
    error = interleaving_error(len(items), pp_size, vpp_size)
    if error:
        raise ValueError(error)
    device = torch.device("cuda", torch.cuda.current_device())
    one = torch.ones((), dtype=torch.int, device=device)

    def loss_func(index, mb, lengths, ids, logits):
        loss = on_logits(index, mb, lengths, ids, logits)
        if forward_only:
            loss = torch.zeros((), device=device)
        return loss, one, {}  # 3 values: calculate_per_token_loss keeps the loss as it is (module docstring)

    def forward_step(data_iterator, model):
        index, (mb, lengths) = next(data_iterator)
        output, ids = forward(model, mb, lengths)
        return output, partial(loss_func, index, mb, lengths, ids)

    iterators = [iter(list(enumerate(items))) for _ in chunks]  # every chunk walks the same micro-batches
    seq_length = max((mb.token_ids.shape[1] for mb, _ in items), default=1)
    rows = max((mb.token_ids.shape[0] for mb, _ in items), default=1)
    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(items),
        seq_length=seq_length, micro_batch_size=rows, forward_only=forward_only)

