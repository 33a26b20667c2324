"""Sequence packing: micro-batches by token budget (``policy.sequence_packing``), torch only.

A GRPO batch holds sequences of very different lengths. Micro-batches of a fixed number of rows,
each padded to its longest row, waste compute on padding and give FP8 GEMMs too few tokens to pay
for their quantization. Packing instead concatenates whole sequences into *bins* of at most
``train_mb_tokens`` (``logprob_mb_tokens`` for log-probs) tokens and runs each bin as one row in
THD layout: attention never crosses a sequence boundary (``cu_seqlens``, a block-diagonal causal
mask), positions restart at 0 for every sequence. NeMo-RL's ``sequence_packing``
(``nemo_rl/data/packing/algorithms.py``, ``nemo_rl/models/megatron/data.py``
``_pack_sequences_for_megatron``) and verl's ``seqlen_balancing.py`` do the same.

What lives here (pure functions, shared by both policy backends and ``PolicyGroup``):

* ``pack_bins``: bin packing (first-fit decreasing, first-fit shuffle, modified first-fit
  decreasing after Johnson & Garey 1985), the bin count raised to a multiple of the data-parallel
  size as NeMo-RL's ``SequencePacker._adjust_bin_count`` does;
* ``balance_bins``: bins to data-parallel ranks, every rank the same number, token counts balanced
  (greedy largest-first into the lightest rank with room: verl's ``get_seqlen_balanced_partitions``
  idea with its ``equal_size`` constraint, by LPT instead of Karmarkar-Karp);
* ``plan_train`` / ``plan_logprobs``: the micro-batches of a batch (row indices), per rank;
* ``pack_rows``: rows of a right-padded ``[B, T]`` micro-batch -> one packed row: token ids,
  position ids, ``cu_seqlens`` (int32, real and padded); ``unpack`` the other way;
* ``block_causal_mask``: the attention mask the torch backend gives the HF model.

Padding (``PackingShape``): each sequence is padded to ``seq_multiple`` = lcm(``sequence_length_round``,
the parallel layout's factor: the tensor-parallel size with sequence parallelism, x ``2 * cp`` with
context parallelism), and the packed row to ``total_multiple`` = the FP8 recipe's token multiple x
that factor. TransformerEngine's FP8 GEMMs need the token dimension divisible by 16 (per-tensor
scaling: e4m3 tensorwise / delayed, TE's ``assert_dim_for_fp8_exec``), 128 for blockwise
``Float8BlockScaling`` (the cuBLAS 128-element scale blocks) and 32 for MXFP8; the numbers
NeMo-RL's ``_get_pack_sequence_parameters_for_megatron`` uses. Only the packed row's total reaches
a GEMM, so only the total needs the recipe's multiple. The last sequence's segment absorbs the
row's padding (NeMo-RL's convention): every padding token sits after the real tokens of some
sequence, so with causal attention real tokens never see it.

Fixed shapes (``PackingShape.fixed_sizes``, for CUDA graphs, which replay kernels on tensors of the shapes they
were captured with): every packed row is padded to the smallest of a few fixed token counts that holds it
(``train_mb_tokens`` and ``logprob_mb_tokens``), and its ``cu_seqlens`` to the number of segments a row of that
size can hold (``size // seq_multiple``), the extra entries repeating the last offset: zero-length sequences at the
end, which TransformerEngine's THD attention skips (megatron-core's own RL packing,
``megatron/rl/sequence_packing_utils.py``, pads its bins for CUDA graphs the same way). ``max_seqlen`` is then the
row's size, a constant. The padding counts as computed tokens in the packing efficiency.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from nemo_fp8.batch import to_device

ALGORITHMS = ("modified_first_fit_decreasing", "first_fit_decreasing", "first_fit_shuffle")

# Token multiple of TransformerEngine's FP8 GEMMs per recipe (see the module docstring)
FP8_TOKEN_MULTIPLE = {"tensorwise": 16, "delayed": 16, "blockwise": 128, "mxfp8": 32}


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (>= 1)."""
    return -(-n // multiple) * multiple


def parallel_token_factor(tensor_parallel_size: int = 1, sequence_parallel: bool = False,
                          context_parallel_size: int = 1) -> int:
    """Multiple each sequence's length must have to split over the parallel layout: the tensor-parallel
    size with sequence parallelism (the sequence dimension is scattered over its ranks), times
    ``2 * context_parallel_size`` with context parallelism (megatron-core's load-balanced halves).
    NeMo-RL ``_get_pack_sequence_parameters_for_megatron``'s ``minimum_pad_factor``."""
    f = 1
    if context_parallel_size > 1:
        f *= 2 * context_parallel_size
    if sequence_parallel and tensor_parallel_size > 1:
        f *= tensor_parallel_size
    return f


@dataclass(frozen=True)
class PackingShape:
    """How a bin is laid out: each sequence padded to ``seq_multiple`` tokens, the packed row to
    ``total_multiple`` (a multiple of ``seq_multiple``'s parallel factor), bins of at most
    ``capacity`` tokens (padded lengths; ``capacity`` a multiple of ``total_multiple``); each data-parallel rank
    gets a multiple of ``bins_multiple`` bins per global batch (the pipeline size under megatron-core's interleaved
    schedule, ``nemo_fp8.policy.megatron.pipeline.interleaving_error``; else 1)."""

    capacity: int
    seq_multiple: int = 1
    total_multiple: int = 1
    algorithm: str = "modified_first_fit_decreasing"
    bins_multiple: int = 1
    fixed_sizes: tuple[int, ...] = ()  # empty: each row as long as it needs; else the row sizes (module docstring)

    def padded_length(self, n: int) -> int:
        """Tokens sequence of length ``n`` takes in a bin."""
        return round_up(max(int(n), 1), self.seq_multiple)

    def row_tokens(self, lengths: Sequence[int]) -> int:
        """Tokens of the packed row of sequences of ``lengths`` (what the model computes; ``row_size``)."""
        return row_size(sum(self.padded_length(n) for n in lengths), self.total_multiple, self.fixed_sizes)


def row_size(padded_sum: int, total_multiple: int = 1, fixed_sizes: Sequence[int] = ()) -> int:
    """Tokens of a packed row whose sequences take ``padded_sum`` tokens: rounded up to ``total_multiple``, or, with
    ``fixed_sizes``, the smallest of them that holds it.

    Raises:
        ValueError: no fixed size holds the row (a bin larger than the budgets it was packed for).
    """
    total = round_up(padded_sum, total_multiple)
    if not fixed_sizes:
        return total
    fits = [s for s in fixed_sizes if s >= total]
    if not fits:
        raise ValueError(f"sequence packing: a row of {total} tokens is larger than every fixed row size "
                         f"{sorted(fixed_sizes)} (sequence_packing.train_mb_tokens / logprob_mb_tokens)")
    return min(fits)


def packing_shape(capacity: int, algorithm: str, sequence_length_round: int = 1, fp8_recipe: Optional[str] = None,
                  tensor_parallel_size: int = 1, sequence_parallel: bool = False,
                  context_parallel_size: int = 1, bins_multiple: int = 1,
                  fixed_sizes: Sequence[int] = ()) -> PackingShape:
    """The ``PackingShape`` of a policy layout (see the module docstring for the multiples).

    Args:
        capacity: tokens per bin (``train_mb_tokens`` or ``logprob_mb_tokens``).
        algorithm: one of ``ALGORITHMS``.
        sequence_length_round: each sequence's length is rounded up to a multiple of it.
        fp8_recipe: None without FP8 training, else a key of ``FP8_TOKEN_MULTIPLE``.
        bins_multiple: bins per rank a multiple of it (``PackingShape``).
        fixed_sizes: the fixed row sizes (empty: none; the module docstring), each a multiple of the row
            multiple like ``capacity``.

    Raises:
        ValueError: an unknown algorithm or recipe, or ``capacity`` or a fixed size not a multiple of the
            row multiple (the config reports it first, naming the key).
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"sequence_packing.algorithm: {algorithm!r} is not one of {ALGORITHMS}")
    if fp8_recipe is not None and fp8_recipe not in FP8_TOKEN_MULTIPLE:
        raise ValueError(f"fp8_recipe {fp8_recipe!r}: valid {sorted(FP8_TOKEN_MULTIPLE)}")
    par = parallel_token_factor(tensor_parallel_size, sequence_parallel, context_parallel_size)
    total = (FP8_TOKEN_MULTIPLE[fp8_recipe] if fp8_recipe else 1) * par
    seq = math.lcm(max(int(sequence_length_round), 1), par)
    for size in (capacity, *fixed_sizes):
        if size % total or size % seq:
            raise ValueError(f"sequence packing: a budget of {size} tokens is not a multiple of "
                             f"{math.lcm(total, seq)} (FP8 recipe {fp8_recipe}, parallel factor {par}, "
                             f"sequence_length_round {sequence_length_round})")
    return PackingShape(capacity, seq, total, algorithm, max(int(bins_multiple), 1),
                        tuple(sorted({int(s) for s in fixed_sizes})))


# ----------------------------------------------------------------------------- bin packing
def _first_fit(items: list[tuple[int, int]], capacity: int) -> list[list[int]]:
    """First fit in the given order: each (index, size) into the first open bin with room, else a new bin."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for idx, size in items:
        for b, load in enumerate(loads):
            if size <= capacity - load:
                bins[b].append(idx)
                loads[b] += size
                break
        else:
            bins.append([idx])
            loads.append(size)
    return bins


def _modified_first_fit_decreasing(items: list[tuple[int, int]], capacity: int) -> list[list[int]]:
    """Johnson & Garey (1985) MFFD as NeMo-RL's ``ModifiedFirstFitDecreasingPacker``: large items
    (> C/2) open bins, one medium item (C/3, C/2] joins each, pairs of small items (C/6, C/3] fill
    bins without a medium one, the rest go first-fit largest first, leftovers by first-fit decreasing."""
    large = sorted([it for it in items if it[1] > capacity / 2], key=lambda x: -x[1])
    medium = sorted([it for it in items if capacity / 3 < it[1] <= capacity / 2], key=lambda x: -x[1])
    small = sorted([it for it in items if capacity / 6 < it[1] <= capacity / 3], key=lambda x: x[1])
    tiny = [it for it in items if it[1] <= capacity / 6]
    bins = [[it] for it in large]
    for b in bins:
        room = capacity - sum(s for _, s in b)
        for i, (_, s) in enumerate(medium):
            if s <= room:
                b.append(medium.pop(i))
                break
    for b in reversed(bins):
        if any(capacity / 3 < s <= capacity / 2 for _, s in b) or len(small) < 2:
            continue
        room = capacity - sum(s for _, s in b)
        if small[0][1] + small[1][1] > room:
            continue
        first = small.pop(0)
        for j in range(len(small) - 1, -1, -1):  # the largest small item that fits beside the first
            if small[j][1] <= room - first[1]:
                b.extend([first, small.pop(j)])
                break
        else:
            small.insert(0, first)
    rest = sorted(medium + small + tiny, key=lambda x: -x[1])
    for b in bins:
        while rest:
            room = capacity - sum(s for _, s in b)
            pick = next((i for i, (_, s) in enumerate(rest) if s <= room), None)
            if pick is None:
                break
            b.append(rest.pop(pick))
    return [[i for i, _ in b] for b in bins] + _first_fit(rest, capacity)


def _split_to_count(bins: list[list[int]], target: int) -> list[list[int]]:
    """Raise the number of bins to ``target`` by moving one item at a time out of the bins with the
    most items (NeMo-RL ``_adjust_bin_count``): no bin grows, so none exceeds the capacity."""
    bins = [list(b) for b in bins]
    while len(bins) < target:
        src = max(range(len(bins)), key=lambda i: len(bins[i]))
        if len(bins[src]) < 2:
            raise ValueError(f"cannot make {target} non-empty bins out of {sum(map(len, bins))} sequences")
        bins.append([bins[src].pop()])
    return bins


def pack_bins(lengths: Sequence[int], capacity: int, algorithm: str = "modified_first_fit_decreasing",
              min_bins: int = 1, bin_multiple: int = 1, seed: int = 0) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins whose lengths sum to at most ``capacity``.

    Args:
        lengths: tokens each sequence takes in a bin (already padded, ``PackingShape.padded_length``).
        capacity: tokens per bin.
        algorithm: ``first_fit_decreasing`` (longest first, each into the first bin with room),
            ``first_fit_shuffle`` (the same in a seeded random order) or
            ``modified_first_fit_decreasing`` (Johnson & Garey 1985; NeMo-RL's default).
        min_bins, bin_multiple: at least ``min_bins`` bins and a multiple of ``bin_multiple`` (the
            data-parallel size), made by splitting bins (NeMo-RL's ``min_bin_count`` /
            ``bin_count_multiple``); fewer sequences than bins needed is an error.
        seed: the shuffle's seed.

    Returns:
        Bins, each a non-empty list of indices in ascending order; every index exactly once.

    Raises:
        ValueError: a length above ``capacity`` or below 1, an unknown algorithm, or too few
            sequences for the bin count.
    """
    lengths = [int(n) for n in lengths]
    too_long = [n for n in lengths if n > capacity]
    if too_long:
        raise ValueError(f"sequence packing: a sequence of {max(too_long)} tokens exceeds the budget of {capacity} "
                         "(policy.sequence_packing.train_mb_tokens / logprob_mb_tokens)")
    if any(n < 1 for n in lengths):
        raise ValueError("sequence packing: lengths must be >= 1")
    items = list(enumerate(lengths))
    if algorithm == "first_fit_decreasing":
        bins = _first_fit(sorted(items, key=lambda x: -x[1]), capacity)
    elif algorithm == "first_fit_shuffle":
        random.Random(seed).shuffle(items)
        bins = _first_fit(items, capacity)
    elif algorithm == "modified_first_fit_decreasing":
        bins = _modified_first_fit_decreasing(items, capacity)
    else:
        raise ValueError(f"sequence_packing.algorithm: {algorithm!r} is not one of {ALGORITHMS}")
    target = max(len(bins), min_bins)
    target = round_up(target, max(bin_multiple, 1))
    if target > len(lengths):
        raise ValueError(f"sequence packing: {len(lengths)} sequences cannot fill {target} bins "
                         f"(at least {min_bins}, a multiple of {bin_multiple}: one per data-parallel rank)")
    return [sorted(b) for b in _split_to_count(bins, target)]


def balance_bins(bin_tokens: Sequence[int], parts: int) -> list[list[int]]:
    """Bins -> ``parts`` groups of equal size with balanced token sums.

    Largest bin first into the group with the fewest tokens among those not yet full (LPT with
    verl's ``equal_size`` constraint; verl's ``get_seqlen_balanced_partitions`` uses Karmarkar-Karp).

    Args:
        bin_tokens: tokens of each bin; ``len(bin_tokens)`` a multiple of ``parts``.

    Returns:
        ``parts`` lists of bin indices, each in ascending order (the packer's order).

    Raises:
        ValueError: the bin count is not a multiple of ``parts``.
    """
    if parts < 1 or len(bin_tokens) % parts:
        raise ValueError(f"balance_bins: {len(bin_tokens)} bins do not split evenly over {parts} ranks")
    per = len(bin_tokens) // parts
    groups: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for b in sorted(range(len(bin_tokens)), key=lambda i: (-bin_tokens[i], i)):
        r = min((r for r in range(parts) if len(groups[r]) < per), key=lambda r: (load[r], r))
        groups[r].append(b)
        load[r] += int(bin_tokens[b])
    return [sorted(g) for g in groups]


@dataclass
class RankPlan:
    """One data-parallel rank's part of a batch: ``rows`` (indices into the batch) form its shard, in
    order; ``micro_batches[g]`` lists global batch ``g``'s micro-batches as indices into the shard."""

    rows: list[int]
    micro_batches: list[list[list[int]]]


def plan_train(lengths: Sequence[int], global_batch_size: int, dp_size: int, shape: PackingShape,
               seed: int = 0) -> list[RankPlan]:
    """Micro-batches of ``train`` for every data-parallel rank: per global batch, its sequences packed
    into bins of ``shape.capacity`` tokens (a multiple of ``dp_size x shape.bins_multiple`` bins), the bins
    balanced over the ranks (``balance_bins``): every rank runs the same number of micro-batches.

    Args:
        lengths: [N] real tokens (prompt + response) of each row; ``N`` a multiple of
            ``global_batch_size``.

    Raises:
        ValueError: ``N`` not a multiple of ``global_batch_size``; see ``pack_bins``.
    """
    n = len(lengths)
    if n % global_batch_size:
        raise ValueError(f"train: {n} rows is not a multiple of policy.train_global_batch_size={global_batch_size}")
    plans = [RankPlan([], []) for _ in range(dp_size)]
    for g in range(0, n, global_batch_size):
        padded = [shape.padded_length(x) for x in lengths[g:g + global_batch_size]]
        per = dp_size * shape.bins_multiple
        bins = pack_bins(padded, shape.capacity, shape.algorithm, min_bins=per, bin_multiple=per, seed=seed + g)
        for plan, group in zip(plans, balance_bins([sum(padded[i] for i in b) for b in bins], dp_size)):
            mbs = []
            for b in group:
                mbs.append(list(range(len(plan.rows), len(plan.rows) + len(bins[b]))))
                plan.rows.extend(g + i for i in bins[b])
            plan.micro_batches.append(mbs)
    return plans


def plan_logprobs(lengths: Sequence[int], dp_size: int, shape: PackingShape) -> list[RankPlan]:
    """Micro-batches of ``get_logprobs`` (one "global batch": the whole batch) for every rank, as
    ``plan_train`` with the whole batch as one global batch; ranks with no row get an empty plan
    when there are fewer rows than ranks."""
    if not lengths:
        return [RankPlan([], [[]]) for _ in range(dp_size)]
    parts = min(dp_size, len(lengths))
    plans = plan_train(lengths, len(lengths), parts, shape)
    return plans + [RankPlan([], [[]]) for _ in range(dp_size - parts)]


# ----------------------------------------------------------------------------- THD layout
@dataclass
class PackedRows:
    """Rows of a micro-batch as one packed row (THD: ``[1, T_total]``).

    Attributes:
        token_ids: [1, T_total] int64; sequence ``i``'s tokens at ``cu_seqlens_padded[i]`` onwards,
            then pad tokens up to ``cu_seqlens_padded[i + 1]``.
        position_ids: [1, T_total] int64, restarting at 0 at every ``cu_seqlens_padded[i]``.
        cu_seqlens: [n + 1] int32, cumulative real lengths (0 first); with fixed sizes [T_total // seq_multiple
            + 1], the last entry repeated (zero-length sequences).
        cu_seqlens_padded: [n + 1] int32, cumulative padded lengths; the last is ``T_total`` (fixed sizes: as
            ``cu_seqlens``).
        max_seqlen: longest padded segment (megatron-core's ``max_seqlen_q/kv``); with fixed sizes ``T_total``.
        lengths: [n] int64 real lengths (CPU).
        offsets: ``cu_seqlens_padded`` on the host, so that ``unpack`` and ``real_token_mask`` never
            read the device tensor back (a host sync per micro-batch).
    """

    token_ids: Tensor
    position_ids: Tensor
    cu_seqlens: Tensor
    cu_seqlens_padded: Tensor
    max_seqlen: int
    lengths: Tensor
    offsets: tuple[int, ...]

    @property
    def real_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def total_tokens(self) -> int:
        return self.token_ids.shape[1]


def pack_rows(token_ids: Tensor, lengths: Tensor | Sequence[int], seq_multiple: int = 1, total_multiple: int = 1,
              pad_token_id: int = 0, fixed_sizes: Sequence[int] = ()) -> PackedRows:
    """Right-padded rows -> one packed row (see ``PackedRows`` and the module docstring).

    The layout is computed on the host from ``lengths``; on a GPU the token copies are kernels on the
    current stream and the offsets go up through pinned memory (``to_device``), so packing a
    micro-batch whose ``lengths`` are host values never waits for the GPU.

    Args:
        token_ids: [B, T] int64, row ``i``'s first ``lengths[i]`` tokens are real.
        lengths: [B] ints: a list, or an int64 tensor (read on the host once: pass host values to
            avoid a device read).
        seq_multiple: each sequence padded to a multiple of it.
        total_multiple: the packed row padded to a multiple of it (the last segment grows).
        pad_token_id: the id of padding tokens.
        fixed_sizes: fixed row sizes (``row_size``): the row padded to the smallest that holds it, ``cu_seqlens``
            and ``cu_seqlens_padded`` to ``size // seq_multiple + 1`` entries (the last offset repeated: zero-length
            sequences), ``max_seqlen`` the size; empty: the row as long as it needs.

    Raises:
        ValueError: shapes that do not match, a length outside ``[1, T]``, or a row no fixed size holds.
    """
    lens = [int(x) for x in (lengths.tolist() if isinstance(lengths, Tensor) else lengths)]
    if token_ids.dim() != 2 or len(lens) != token_ids.shape[0]:
        raise ValueError(f"pack_rows: token_ids must be [B, T] and lengths [B]; got {tuple(token_ids.shape)}, "
                         f"{len(lens)} lengths")
    if any(x < 1 or x > token_ids.shape[1] for x in lens):
        raise ValueError(f"pack_rows: lengths {lens} must lie in [1, {token_ids.shape[1]}]")
    padded = [round_up(x, seq_multiple) for x in lens]
    total = row_size(sum(padded), total_multiple, fixed_sizes)
    padded[-1] += total - sum(padded)
    dev = token_ids.device
    starts = [0]
    for p in padded:
        starts.append(starts[-1] + p)
    ids = torch.full((total,), pad_token_id, dtype=token_ids.dtype, device=dev)
    for i, x in enumerate(lens):
        ids[starts[i]:starts[i] + x] = token_ids[i, :x]
    pos = to_device(torch.cat([torch.arange(p) for p in padded]), dev, non_blocking=True)
    cu_real, cu_pad = [0] + list(_cumsum(lens)), list(starts)
    if fixed_sizes:  # a constant number of segments for the row's size: zero-length ones at the end
        extra = total // seq_multiple + 1 - len(cu_pad)
        cu_real, cu_pad = cu_real + [cu_real[-1]] * extra, cu_pad + [cu_pad[-1]] * extra
    cu = to_device(torch.tensor(cu_real, dtype=torch.int32), dev, non_blocking=True)
    cu_padded = to_device(torch.tensor(cu_pad, dtype=torch.int32), dev, non_blocking=True)
    return PackedRows(ids[None], pos[None], cu, cu_padded, total if fixed_sizes else max(padded),
                      torch.tensor(lens, dtype=torch.long), tuple(starts))


def _cumsum(xs: Sequence[int]):
    s = 0
    for x in xs:
        s += x
        yield s


def unpack(values: Tensor, packed: PackedRows, width: int) -> Tensor:
    """Per-token values of the packed row back to the rows' layout.

    Args:
        values: [T_total, ...] or [1, T_total, ...] (e.g. log-probs aligned with ``token_ids``).
        packed: what ``pack_rows`` returned.
        width: T of the output.

    Returns:
        [B, width, ...] with row ``i``'s first ``lengths[i]`` positions filled, 0 elsewhere;
        differentiable in ``values``.
    """
    if values.dim() >= 2 and values.shape[0] == 1 and values.shape[1] == packed.total_tokens:
        values = values[0]
    rows = [torch.nn.functional.pad(values[s:s + int(n)], (0, 0) * (values.dim() - 1) + (0, width - int(n)))
            for s, n in zip(packed.offsets, packed.lengths.tolist())]
    return torch.stack(rows)


def real_token_mask(packed: PackedRows) -> Tensor:
    """[T_total] bool on the packed row's device: True on the sequences' real tokens, False on padding."""
    mask = torch.zeros(packed.total_tokens, dtype=torch.bool, device=packed.token_ids.device)
    for s, n in zip(packed.offsets, packed.lengths.tolist()):
        mask[s:s + int(n)] = True
    return mask


def block_causal_mask(cu_seqlens_padded: Tensor, total: int) -> Tensor:
    """[total, total] bool, True where query ``q`` may attend key ``k``: same segment and ``k <= q``.

    Segments are ``[cu_seqlens_padded[i], cu_seqlens_padded[i + 1])``; the torch backend passes
    ``mask[None, None]`` to the HF model as its 4-D attention mask."""
    seg = torch.repeat_interleave(torch.arange(cu_seqlens_padded.numel() - 1, device=cu_seqlens_padded.device),
                                  (cu_seqlens_padded[1:] - cu_seqlens_padded[:-1]).long())  # [total]
    if seg.numel() != total:
        raise ValueError(f"block_causal_mask: segments cover {seg.numel()} tokens, expected {total}")
    causal = torch.ones(total, total, dtype=torch.bool, device=seg.device).tril()
    return causal & (seg[:, None] == seg[None, :])


def packing_efficiency(real_tokens: int, padded_tokens: int) -> float:
    """Real tokens / tokens computed (1.0: no padding); 0 when nothing was computed."""
    return real_tokens / padded_tokens if padded_tokens else 0.0
