"""Reference policy backend: an HF causal LM trained with AdamW, in pure torch.

One instance is one data-parallel rank: with ``policy.data_parallel_size > 1`` the ranks (Ray
actors) join a ``torch.distributed`` group (gloo on CPU, NCCL on CUDA), each trains on its shard
of every global batch and gradients are summed across ranks before the optimizer step, so every
replica takes the same update a single rank would take on the whole global batch.

When ``policy.megatron_cfg.fp8_cfg.enabled`` is set, every FP8-eligible Linear
(``nemo_fp8.fp8.plan_layer_precision``) becomes an ``Fp8TrainingLinear`` that emulates the
TransformerEngine recipe by quantize-dequantize (``tensorwise`` current scaling or
``blockwise`` 1x128 / 128x128; ``e4m3`` everywhere or ``hybrid`` with e5m2 gradients). Master
weights stay in ``policy.precision``. Correct and testable, not fast; runs on CPU or CUDA.
"""

from __future__ import annotations

import copy
import gc
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from nemo_fp8.batch import TrainBatch, to_device
from nemo_fp8.fp8 import Fp8TrainingRecipe, apply_fp8_training, plan_layer_precision
from nemo_fp8.fp8.kv_scales import KvScales
from nemo_fp8.models.hf import DTYPES, attention_mask_for, load_causal_lm, token_logprobs
from nemo_fp8.policy.config import PolicyConfig
from nemo_fp8.policy.interfaces import LossFn
from nemo_fp8.policy.offload import timed_parts
from nemo_fp8.policy.packing import (PackedRows, PackingShape, block_causal_mask, pack_rows, packing_efficiency,
                                     plan_logprobs, plan_train, round_up, unpack)
from nemo_fp8.policy.schedule import scheduled_lr
from nemo_fp8.policy.shared_prefix import pack_shared_prefix, shared_prefix_logprobs, shared_prefix_tokens
from nemo_fp8.policy.spec import PolicySpec
from nemo_fp8.utils.metrics import MetricAccumulator

logger = logging.getLogger(__name__)


def enable_fp8_training(model: nn.Module, cfg: PolicyConfig) -> list[str]:
    """Replace the FP8-eligible Linears of ``model`` by TE-recipe emulations; return their names.

    The layers kept in BF16 and the blockwise scale convention are the rollout's
    (``policy.generation.vllm_cfg.num_{first,last}_layers_in_bf16``,
    ``pow2_weight_scaling_factors``), as in the megatron backend (``policy/megatron/settings.py``).
    """
    fp8_cfg, vcfg = cfg.megatron_cfg.fp8_cfg, cfg.generation.vllm_cfg
    recipe = Fp8TrainingRecipe(fp8=fp8_cfg.fp8, fp8_recipe=fp8_cfg.fp8_recipe,
                               pow2_block_scales=vcfg.pow2_weight_scaling_factors)
    plan = plan_layer_precision(model, vcfg.num_first_layers_in_bf16, vcfg.num_last_layers_in_bf16)
    names = apply_fp8_training(model, plan.fp8_modules, recipe)
    logger.info("fp8 training (%s, %s, %s scales): %d Linear modules emulated", fp8_cfg.fp8, fp8_cfg.fp8_recipe,
                recipe.scale_mode, len(names))
    return names


@dataclass
class ShardTrainResult:
    """One rank's part of ``train``: per global batch, its metric accumulator, the grad norm and the learning rate.

    ``reduce_train_results`` merges the ranks' results (``MetricAccumulator.merge``) and
    averages over global batches.
    """

    accumulators: list[MetricAccumulator]
    grad_norms: list[float]
    lrs: list[float] = field(default_factory=list)  # the learning rate of each global batch's update
    micro_batches: list[int] = field(default_factory=list)  # this rank's micro-batches per global batch
    real_tokens: list[int] = field(default_factory=list)  # per global batch: prompt + response tokens
    padded_tokens: list[int] = field(default_factory=list)  # per global batch: tokens the model computed
    memory: dict[str, float] = field(default_factory=dict)  # this rank's GPU memory over the call (``CudaMemoryWindow``)

    def add_tokens(self, shape: Optional[PackingShape], lengths: list[int], gb_rows: list[list[int]],
                   row_multiple: int = 1, shared_prefix_of: Optional[Callable[[list[int]], tuple[int, int]]] = None
                   ) -> None:
        """Record one global batch's micro-batch count, real tokens and computed tokens: with sequence packing
        (``shape``: ``PolicySpec.train_packing``) each packed row's padded length, else rows x the micro-batch's
        width rounded up to ``row_multiple`` (the megatron backend's recipe multiple). ``lengths``: CPU prompt +
        response lengths of the shard's rows (no device read). ``shared_prefix_of`` (``policy.shared_prefix_forward``:
        a micro-batch's rows -> its (real, computed) tokens, ``shared_prefix.shared_prefix_tokens``) counts the
        packed layout that forward computes instead, each prompt once."""
        real = padded = 0
        for rows in gb_rows:
            if shared_prefix_of is not None:
                r, c = shared_prefix_of(rows)
                real, padded = real + r, padded + c
                continue
            lens = [lengths[i] for i in rows]
            real += sum(lens)
            if shape is not None:
                padded += shape.row_tokens(lens)
            else:
                padded += len(rows) * round_up(max(lens), row_multiple)
        self.micro_batches.append(len(gb_rows))
        self.real_tokens.append(real)
        self.padded_tokens.append(padded)


def _shared_prefix_counter(batch: TrainBatch) -> Callable[[list[int]], tuple[int, int]]:
    """Rows of ``batch`` -> (real, computed) tokens of their shared-prefix packing (``shared_prefix_tokens``)."""
    ids, p_lens, r_lens = batch.token_ids.cpu(), batch.prompt_lengths.tolist(), batch.response_lengths.tolist()
    return lambda rows: shared_prefix_tokens(ids[rows], [p_lens[i] for i in rows], [r_lens[i] for i in rows])


def reduce_train_results(results: list[ShardTrainResult]) -> dict[str, float]:
    """Metrics of ``train``: each global batch reduced once over ranks and micro-batches, then averaged; the ranks'
    ``memory`` figures (``memory/train_*``) as the largest over ranks.

    Raises:
        ValueError: ranks that saw different numbers of global batches.
    """
    n = {len(r.accumulators) for r in results}
    if len(n) != 1:
        raise ValueError(f"reduce_train_results: ranks saw different numbers of global batches: {sorted(n)}")
    history = []
    for g in range(n.pop()):
        acc = results[0].accumulators[g]
        for r in results[1:]:
            acc = acc.merge(r.accumulators[g])
        history.append({**acc.result(), "grad_norm": results[0].grad_norms[g],
                        **({"lr": results[0].lrs[g]} if results[0].lrs else {}),
                        **_packing_metrics(results, g)})
    out = {k: sum(h[k] for h in history) / len(history) for k in history[0]} if history else {}
    for k in sorted({k for r in results for k in r.memory}):  # the fullest rank's (the one that runs out first)
        out[k] = max(r.memory[k] for r in results if k in r.memory)
    return out


def _packing_metrics(results: list[ShardTrainResult], g: int) -> dict[str, float]:
    """``micro_batches`` (global batch ``g``'s micro-batches, summed over data-parallel ranks) and
    ``packing_efficiency`` (real tokens / tokens computed, over all ranks), where the ranks reported them."""
    if not all(len(r.micro_batches) > g for r in results):
        return {}
    return {"micro_batches": float(sum(r.micro_batches[g] for r in results)),
            "packing_efficiency": packing_efficiency(sum(r.real_tokens[g] for r in results),
                                                     sum(r.padded_tokens[g] for r in results))}


def scoring_model(model, reference_model, reference: bool):
    """The model ``get_logprobs`` scores with: ``reference_model`` when ``reference`` (the frozen initial weights of
    the KL penalty), else ``model`` (shared by every policy backend).

    Raises:
        ValueError: ``reference=True`` without a reference model.
    """
    chosen = reference_model if reference else model
    if chosen is None:
        raise ValueError("get_logprobs(reference=True): no reference model (loss_fn.reference_policy_kl_penalty is 0)")
    return chosen


def row_index(rows: list[int]) -> slice | Tensor:
    """``rows`` as an index for ``TrainBatch.select``: a slice (a view, no copy) when they are consecutive."""
    if rows and rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, dtype=torch.long)


def logprob_micro_batches(spec: PolicySpec, batch: TrainBatch) -> list[list[int]]:
    """Micro-batches (row indices) of ``get_logprobs`` / ``calibrate_kv_scales``: ``logprob_batch_size``
    consecutive rows, or with sequence packing the rows packed into bins of ``logprob_mb_tokens``
    (``spec.logprob_packing``)."""
    if spec.logprob_packing is None:
        size = spec.cfg.logprob_batch_size
        return [list(range(i, min(i + size, batch.size))) for i in range(0, batch.size, size)]
    plan = plan_logprobs(batch.sequence_lengths(), 1, spec.logprob_packing)[0]
    return [[plan.rows[i] for i in mb] for mb in plan.micro_batches[0]]


def micro_batches_on(batch: TrainBatch, micro_batches: list[list[int]], device: torch.device,
                     lengths: Sequence[int]) -> Iterator[tuple[TrainBatch, list[int]]]:
    """Each micro-batch (row indices into ``batch``) trimmed to its longest row and sent to ``device`` through
    pinned memory (``TrainBatch.to(non_blocking=True)``), with its rows' prompt + response lengths as host ints
    (``lengths``: the whole batch's, read from the host once by the caller)."""
    for rows in micro_batches:
        lens = [lengths[i] for i in rows]
        yield batch.select(row_index(rows)).trimmed(max(lens)).to(device, non_blocking=True), lens


def pack_micro_batch(shape: PackingShape, mb: TrainBatch, lengths: Optional[Sequence[int]] = None) -> PackedRows:
    """``mb``'s rows as one THD row, as both policy backends pack a micro-batch: each sequence padded to the train
    packing ``shape``'s ``seq_multiple`` (``sequence_length_round`` and the parallel layout's multiple), the row to
    its ``total_multiple`` (the FP8 recipe's token multiple; ``PolicySpec.train_packing``), or to a fixed size
    (``shape.fixed_sizes``). ``lengths``: the rows' prompt + response lengths as host ints; None reads them from
    ``mb`` (a host sync on a GPU: the micro-batch loops pass them, ``micro_batches_on``)."""
    if lengths is None:
        lengths = mb.sequence_lengths()
    return pack_rows(mb.token_ids, lengths, shape.seq_multiple, shape.total_multiple, fixed_sizes=shape.fixed_sizes)


def batched_logprobs(score, batch: TrainBatch, micro_batches: list[list[int]], device: torch.device) -> Tensor:
    """[B, T] float32 on the CPU: ``score(micro_batch, lengths) -> [b, t]`` over ``micro_batches`` (row
    indices, ``logprob_micro_batches``) as ``micro_batches_on`` gives them; 0 past each micro-batch's width.

    The results gather on ``device`` and come back to the host once: no host sync per micro-batch."""
    out = torch.zeros(batch.token_ids.shape, dtype=torch.float32, device=device)
    lengths = batch.sequence_lengths()
    for rows, (mb, lens) in zip(micro_batches, micro_batches_on(batch, micro_batches, device, lengths)):
        idx = row_index(rows)
        out[idx if isinstance(idx, slice) else to_device(idx, device, non_blocking=True), :max(lens)] = \
            score(mb, lens).float()
    return out.cpu()


def row_micro_batches(size: int, global_batch_size: int, micro_batch_size: int) -> list[list[list[int]]]:
    """Micro-batches without packing: per global batch of ``global_batch_size`` rows, consecutive runs of
    ``micro_batch_size`` rows (row indices into the batch).

    Raises:
        ValueError: ``size`` not a multiple of ``global_batch_size``.
    """
    if size % global_batch_size != 0:
        raise ValueError(f"train: batch of {size} rows is not a multiple of policy.train_global_batch_size"
                         f" / data_parallel_size = {global_batch_size}")
    return [[list(range(m, min(m + micro_batch_size, g + global_batch_size)))
             for m in range(g, g + global_batch_size, micro_batch_size)] for g in range(0, size, global_batch_size)]


def train_micro_batches(spec: PolicySpec, batch: TrainBatch,
                        dp_size: int) -> tuple[TrainBatch, list[list[list[int]]]]:
    """(rows in training order, micro-batches per global batch as row indices) of one rank's shard.

    Without sequence packing: the rows as given, ``train_micro_batch_size`` rows per micro-batch.
    With it: each global batch's rows packed into bins of ``train_mb_tokens`` (``spec.train_packing``;
    ``packing.plan_train`` on this shard alone; ``PolicyGroup`` plans all ranks together and passes its plan)."""
    gbs = spec.global_batch_size // dp_size
    if spec.train_packing is None:
        return batch, row_micro_batches(batch.size, gbs, spec.cfg.train_micro_batch_size)
    lengths = batch.sequence_lengths()
    plan = plan_train(lengths, gbs, 1, spec.train_packing)[0]
    return batch.select(torch.tensor(plan.rows, dtype=torch.long)), plan.micro_batches


def global_batches(batch: TrainBatch, micro_batches: list[list[list[int]]], device: torch.device,
                   dp_size: int = 1, dp_group=None
                   ) -> Iterator[tuple[Tensor, Tensor, Iterator[tuple[TrainBatch, list[int]]]]]:
    """Split one rank's shard into global batches: per global batch, its valid token and sequence
    counts summed over the data-parallel ranks (0-dim tensors on ``device``, at least 1) and its
    micro-batches with their rows' lengths (``micro_batches_on``). Shared by both policy backends.

    Args:
        batch: this rank's rows of every global batch.
        micro_batches: per global batch, its micro-batches as row indices into ``batch``
            (``row_micro_batches``, or a packing plan); every row exactly once.

    Raises:
        ValueError: the batch fails ``TrainBatch.validate`` or the micro-batches do not cover its rows once.
    """
    batch.validate()
    covered = sorted(i for gb in micro_batches for mb in gb for i in mb)
    if covered != list(range(batch.size)):
        raise ValueError(f"train: the micro-batches cover rows {covered[:8]}... of a batch of {batch.size} rows; "
                         "each row must be in exactly one")
    lengths = batch.sequence_lengths()  # CPU lengths, read once
    for gb_rows in micro_batches:
        mask = batch.select(row_index([i for mb in gb_rows for i in mb])).token_mask
        counts = to_device(torch.stack([mask.sum(), (mask.sum(1) > 0).sum().float()]), device, non_blocking=True)
        if dp_size > 1:
            torch.distributed.all_reduce(counts, group=dp_group)
        n_tokens, n_seqs = counts.clamp(min=1.0).unbind()
        yield n_tokens, n_seqs, micro_batches_on(batch, gb_rows, device, lengths)


class TorchPolicyBackend:
    """``PolicyBackend`` in pure torch (see the module docstring); one data-parallel rank.

    Args:
        spec: the rank's ``PolicySpec`` (``spec.cfg``: model, precision, batch sizes, optimizer, fp8_cfg;
            ``spec.device``, ``spec.temperature``: logits are divided by it before log-softmax;
            ``spec.keep_reference``: a frozen copy of the initial weights for the KL penalty; the packing shapes).
        dp_rank, dp_size: this rank and the number of data-parallel ranks.
        dist_init_method: ``tcp://host:port`` of rank 0, required when ``dp_size > 1``.
    """

    def __init__(self, spec: PolicySpec, dp_rank: int = 0, dp_size: int = 1, dist_init_method: Optional[str] = None):
        cfg, device, keep_reference = spec.cfg, spec.device, spec.keep_reference
        self.spec, self.cfg, self.device, self.temperature = spec, cfg, device, spec.temperature
        self.dp_rank, self.dp_size = dp_rank, dp_size
        if dp_size > 1:
            if dist_init_method is None:
                raise ValueError("TorchPolicyBackend: dp_size > 1 needs dist_init_method (tcp://host:port of rank 0)")
            torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                                 init_method=dist_init_method, rank=dp_rank, world_size=dp_size)
        self.model = load_causal_lm(cfg.model_name, DTYPES[cfg.precision], device)
        self.reference = copy.deepcopy(self.model).eval().requires_grad_(False) if keep_reference else None
        self.fp8_modules = enable_fp8_training(self.model, cfg) \
            if cfg.megatron_cfg.fp8_cfg.enabled else []
        opt = cfg.optimizer
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=opt.lr, weight_decay=opt.weight_decay,
                                           betas=tuple(opt.betas), eps=opt.eps)
        self.num_updates = 0
        self._offloaded: set[str] = set()  # "optimizer", "model": what offload_* moved to host memory

    # ----------------------------------------------------------------------- log-probs
    def _forward_logprobs(self, model: nn.Module, mb: TrainBatch, lengths: Optional[Sequence[int]] = None) -> Tensor:
        """[b, t] float32 log-probs of ``mb``'s responses (on the device), 0 elsewhere; with sequence packing
        the rows run as one packed row (``_forward_packed``; ``lengths`` as in ``pack_micro_batch``), with
        ``policy.shared_prefix_forward`` one row per distinct prompt (``_forward_shared_prefix``)."""
        if self.spec.train_packing is not None:
            return self._forward_packed(model, mb, lengths)
        if self.cfg.shared_prefix_forward:
            return self._forward_shared_prefix(model, mb)
        ids = mb.token_ids.to(self.device)
        attn = attention_mask_for(mb.prompt_lengths, mb.response_lengths, ids.shape[1]).to(self.device)
        logits = model(input_ids=ids, attention_mask=attn).logits  # [B, T, V]
        lp = token_logprobs(logits, ids, self.temperature)  # [B, T]
        return lp * mb.token_mask.to(self.device)

    def _forward_packed(self, model: nn.Module, mb: TrainBatch, lengths: Optional[Sequence[int]] = None) -> Tensor:
        """The packed forward: ``[1, T_total]`` tokens with positions restarting per sequence and a
        block-diagonal causal mask (``packing.block_causal_mask``, the HF model's 4-D attention mask), the
        CPU twin of the megatron backend's THD forward; log-probs unpacked to ``mb``'s ``[b, t]`` layout.
        A segment's first log-prob (scored from the previous segment) falls on a prompt token: masked."""
        packed = pack_micro_batch(self.spec.train_packing, mb, lengths)
        ids = packed.token_ids.to(self.device)
        mask = block_causal_mask(packed.cu_seqlens_padded.to(self.device), packed.total_tokens)
        logits = model(input_ids=ids, attention_mask=mask[None, None], position_ids=packed.position_ids.to(self.device)
                       ).logits  # [1, T_total, V]
        lp = unpack(token_logprobs(logits, ids, self.temperature)[0], packed, mb.token_ids.shape[1])  # [b, t]
        return lp * mb.token_mask.to(self.device)

    def _forward_shared_prefix(self, model: nn.Module, mb: TrainBatch) -> Tensor:
        """The shared-prefix forward (``nemo_fp8.policy.shared_prefix``): the rows with equal prompts run as one
        row ``[prompt, response_1, ...]`` with positions restarting per response and a mask that keeps responses
        apart; log-probs gathered back to ``mb``'s ``[b, t]`` layout. The grouping reads ``mb``'s token ids on the
        host (one device read per micro-batch on a GPU)."""
        packed = pack_shared_prefix(mb.token_ids.cpu(), mb.prompt_lengths.tolist(), mb.response_lengths.tolist()
                                    ).to(self.device)
        logits = model(input_ids=packed.token_ids, attention_mask=packed.attention_mask,
                       position_ids=packed.position_ids).logits  # [G, L, V]
        return shared_prefix_logprobs(logits, packed, tuple(mb.token_ids.shape), self.temperature)

    @torch.no_grad()
    def get_logprobs(self, batch: TrainBatch, reference: bool = False) -> Tensor:
        """[B, T] float32 (CPU) log-probs of ``batch``'s responses; 0 elsewhere.

        Raises:
            ValueError: ``reference=True`` without a reference model.
        """
        self.prepare_for_training()
        model = scoring_model(self.model, self.reference, reference)
        was_training = model.training
        model.eval()
        out = batched_logprobs(lambda mb, lengths: self._forward_logprobs(model, mb, lengths), batch,
                               logprob_micro_batches(self.spec, batch), self.device)
        model.train(was_training)
        return out

    # ----------------------------------------------------------------------- training
    def train(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step per ``train_global_batch_size`` rows of ``batch`` (single rank).

        Metrics: each global batch reduced once (``MetricAccumulator``), then averaged over
        global batches; ``loss`` is the global batch's loss. See ``train_shard``.
        """
        return reduce_train_results([self.train_shard(batch, loss_fn)])

    def train_shard(self, batch: TrainBatch, loss_fn: LossFn,
                    micro_batches: Optional[list[list[list[int]]]] = None) -> ShardTrainResult:
        """This rank's part of ``train``: ``batch`` holds, in order, its ``gbs / dp_size`` rows
        of every global batch; or, with ``micro_batches`` (``PolicyGroup``'s packing plan: per global
        batch, its micro-batches as row indices into ``batch``), the rows that plan names.
        Without a plan, ``train_micro_batches`` makes one (packed with ``policy.sequence_packing``).

        The loss of each micro-batch is normalised by the valid token / sequence counts of its
        whole global batch (summed across ranks), and gradients are summed across ranks, so the
        update equals one rank's on the whole global batch. No host sync per micro-batch: metrics
        stay tensors until the end of each global batch.

        Raises:
            ValueError: the batch fails ``TrainBatch.validate`` or its size is not a multiple
                of ``train_global_batch_size / dp_size``.
            FloatingPointError: a non-finite gradient norm.
        """
        self.prepare_for_training()
        self.model.train()
        result = ShardTrainResult([], [])
        if micro_batches is None:
            batch, micro_batches = train_micro_batches(self.spec, batch, self.dp_size)
        lengths = batch.sequence_lengths()
        # with the shared-prefix forward, the packed layout's tokens (as _forward_shared_prefix computes them)
        shared_prefix_of = _shared_prefix_counter(batch) if self.cfg.shared_prefix_forward else None
        for gb_rows, (n_tokens, n_seqs, mbs) in zip(micro_batches,
                                                     global_batches(batch, micro_batches, self.device, self.dp_size)):
            result.add_tokens(self.spec.train_packing, lengths, gb_rows, shared_prefix_of=shared_prefix_of)
            self.optimizer.zero_grad(set_to_none=True)
            acc = MetricAccumulator(loss_fn.metric_reductions)
            for mb, mb_lengths in mbs:  # on the device: moved once, used twice
                logprobs = self._forward_logprobs(self.model, mb, mb_lengths)
                loss, metrics = loss_fn(logprobs, mb, n_tokens, n_seqs)
                loss.backward()
                acc.add(metrics)
            self._all_reduce_grads()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm))
            if not math.isfinite(grad_norm):
                raise FloatingPointError(f"train: non-finite gradient norm {grad_norm} at update {self.num_updates}")
            self._set_lr()
            self.optimizer.step()
            self.num_updates += 1
            result.accumulators.append(acc.cpu())
            result.grad_norms.append(grad_norm)
            result.lrs.append(self.optimizer.param_groups[0]["lr"])
        return result

    def _all_reduce_grads(self) -> None:
        """Sum gradients across data-parallel ranks (one flat buffer per dtype)."""
        if self.dp_size == 1:
            return
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        for dtype in {g.dtype for g in grads}:
            group = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in group])
            torch.distributed.all_reduce(flat)
            offset = 0
            for g in group:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    # ----------------------------------------------------------------------- FP8 KV calibration
    @torch.no_grad()
    def calibrate_kv_scales(self, batch: TrainBatch, step: int, margin: float = 1.0) -> KvScales:
        """Per-layer amax of q, k and v over ``batch``'s real tokens -> e4m3 KV scales.

        q and k are measured as attention consumes them (after q/k-norm and RoPE): the forward
        runs with an attention function that records them (``transformers.AttentionInterface``)
        and then computes SDPA. Across data-parallel ranks the amax is the max over ranks. Always the unshared
        forward, also with ``policy.shared_prefix_forward`` (the recorder finds real tokens through the 2-D
        padding mask; a prompt's q, k, v are the same in each of its rows, so the amax would not change).

        Raises:
            ValueError: the model's attention layers do not expose ``layer_idx``.
        """
        from nemo_fp8.models.hf import record_qkv_amax

        self.prepare_for_training()
        was_training = self.model.training
        self.model.eval()
        n_layers = int(self.model.config.num_hidden_layers)
        amax = torch.zeros(3, n_layers, dtype=torch.float32, device=self.device)  # [q|k|v, L]
        step_rows = self.cfg.logprob_batch_size
        for i in range(0, batch.size, step_rows):
            mb = batch.select(slice(i, i + step_rows)).trimmed()
            ids = mb.token_ids.to(self.device)
            attn = attention_mask_for(mb.prompt_lengths, mb.response_lengths, ids.shape[1]).to(self.device)
            with record_qkv_amax(self.model, attn, amax):
                self.model(input_ids=ids, attention_mask=attn)
        self.model.train(was_training)
        if self.dp_size > 1:
            torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX)
        return KvScales.from_amax(amax[0], amax[1], amax[2], step=step, margin=margin)

    # ----------------------------------------------------------------------- weights and lifecycle
    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """(HF name, detached tensor) for every weight, in ``state_dict`` order (no copies).

        Streams from wherever the weights are: it runs between ``offload_before_refit`` and
        ``offload_after_refit`` and must not bring the offloaded optimizer state back.
        """
        for name, t in self.model.state_dict().items():
            if t.is_floating_point() and not name.endswith("inv_freq"):
                yield name, t.detach()

    def prepare_for_training(self) -> None:
        """Bring back to the device whatever ``offload_*`` moved to host memory."""
        if "model" in self._offloaded:
            self.model.to(self.device)
            if self.reference is not None:
                self.reference.to(self.device)
        if "optimizer" in self._offloaded:
            _move_optimizer_state(self.optimizer, self.device)
        self._offloaded.clear()

    def offload_before_refit(self) -> None:
        """Colocated on a GPU: optimizer state to host memory before the engine takes weights."""
        if self.device.type == "cuda" and "optimizer" not in self._offloaded:
            _move_optimizer_state(self.optimizer, torch.device("cpu"))
            self._offloaded.add("optimizer")
            torch.cuda.empty_cache()

    def release_cached_memory(self, gc_generation: int = 2) -> dict[str, float]:
        """Colocated on a GPU without offloading: ``gc.collect(gc_generation)`` and the allocator's free cached
        blocks back to the device; the seconds of each part (none on CPU)."""
        if self.device.type != "cuda":
            return {}
        return timed_parts((("gc", lambda: gc.collect(gc_generation)), ("empty_cache", torch.cuda.empty_cache)))

    def cuda_memory_gib(self) -> dict[str, float]:
        from nemo_fp8.utils.memory import cuda_memory_gib

        return cuda_memory_gib(self.device)

    def offload_after_refit(self) -> None:
        """Colocated on a GPU: the weights to host memory too, so the engine can wake."""
        if self.device.type == "cuda" and "model" not in self._offloaded:
            self.model.to("cpu")
            if self.reference is not None:
                self.reference.to("cpu")
            self._offloaded.add("model")
            torch.cuda.empty_cache()

    def shutdown(self) -> None:
        """Leave the data-parallel group and drop the model."""
        if self.dp_size > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        self.model = self.reference = None  # type: ignore[assignment]

    def save(self, path: str | Path) -> None:
        """Save model (HF ``save_pretrained``, safetensors) and optimizer state under ``path``
        (data-parallel rank 0 writes; the replicas are identical)."""
        if self.dp_rank != 0:
            return
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.prepare_for_training()
        self.model.save_pretrained(path / "model")
        torch.save({"optimizer": self.optimizer.state_dict(), "num_updates": self.num_updates}, path / "optimizer.pt")

    def load(self, path: str | Path) -> None:
        """Load what ``save`` wrote (weights in place, then optimizer state; the learning rate and
        weight decay stay those of ``cfg.optimizer``, so a resumed run applies changed values).

        Raises:
            FileNotFoundError: ``path`` lacks ``model/`` or ``optimizer.pt``.
            ValueError: weights missing, or a checkpoint of pipeline stages (``torch_pipeline``).
        """
        from safetensors.torch import load_file

        self.prepare_for_training()
        path = Path(path)
        files = sorted((path / "model").glob("*.safetensors"))
        if not files or not (path / "optimizer.pt").is_file():
            raise FileNotFoundError(f"policy checkpoint {path} needs model/*.safetensors and optimizer.pt")
        state = {}
        for f in files:
            state.update(load_file(str(f), device=str(self.device)))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.endswith("inv_freq") and m != "lm_head.weight"]
        if missing or unexpected:
            raise ValueError(f"policy checkpoint {path}: missing {missing[:5]}, unexpected {unexpected[:5]}")
        extra = torch.load(path / "optimizer.pt", map_location=self.device, weights_only=True)
        if int(extra.get("pipeline_stages", 1)) != 1:  # written by torch_pipeline: stage 0's state only
            raise ValueError(f"policy checkpoint {path}: optimizer state of {extra['pipeline_stages']} pipeline "
                             "stages; resume with the same policy.megatron_cfg.pipeline_model_parallel_size")
        self.optimizer.load_state_dict(extra["optimizer"])
        for group in self.optimizer.param_groups:  # the config's values win over the checkpoint's
            group["weight_decay"] = self.cfg.optimizer.weight_decay
        self.num_updates = int(extra["num_updates"])
        self._set_lr()  # the config's schedule at the checkpoint's update count

    def _set_lr(self) -> None:
        """The learning rate of the next update: ``policy.optimizer``'s warm-up, then ``lr`` or its decay (the
        megatron backend's schedule, ``nemo_fp8.policy.schedule``)."""
        opt = self.cfg.optimizer
        lr = scheduled_lr(self.num_updates, opt.lr, warmup_steps=opt.lr_warmup_steps, init_lr=opt.lr_warmup_init,
                          decay_style=opt.lr_decay_style, decay_steps=opt.lr_decay_steps, min_lr=opt.min_lr,
                          wsd_decay_steps=opt.wsd_decay_steps, wsd_decay_style=opt.lr_wsd_decay_style)
        for group in self.optimizer.param_groups:
            group["lr"] = lr


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for k, v in state.items():
            if isinstance(v, Tensor):
                state[k] = v.to(device)
