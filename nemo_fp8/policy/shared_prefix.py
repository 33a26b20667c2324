"""Shared-prefix forward: a prompt's responses scored in one row, the prompt computed once; torch only.

GRPO samples G responses per prompt, and a micro-batch of rows ``[prompt, response_i]`` computes each prompt G
times. Here the rows of a micro-batch whose prompts are equal (same length and token ids: found by content, in any
order, groups of any size, a prompt of its own included) become one packed row
``[prompt, response_1, response_2, ...]``:

* positions: the prompt at ``0 .. p-1``; each response restarts at ``p``, as if it followed the prompt alone;
* attention (``shared_prefix_mask``, a 4-D boolean mask, True = may attend): a prompt token sees the prompt's
  earlier tokens; a response token sees the whole prompt and its own response's earlier tokens, never another
  response (each packed row holds one prompt, so never another prompt either);
* the log-prob of token ``k`` of row ``i``'s response comes from the logits at the previous token's packed
  position; for ``k = 0`` the prompt's last token (``shared_prefix_logprobs``).

Every response token so sees the same keys at the same positions as in its own row: the log-probs are the
unshared forward's up to float rounding (summation order inside attention), and autograd sums the gradients
through the prompt's tokens over the group's responses, as it does over separate rows.

This is the *shared-prefix forward* of Prefix Grouper (Liu et al. 2025, "Prefix Grouper: Efficient GRPO Training
through Shared-Prefix Forward", arXiv 2506.05433; verl's ``actor_rollout_ref.actor.use_prefix_grouper``). Prefix
Grouper splits attention into the prefix's self-attention plus the suffixes' attention over the prefix and
themselves; one masked attention over the packed row computes the same thing. The torch backend turns it on with
``policy.shared_prefix_forward``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Sequence

import torch
from torch import Tensor

PAD_SEGMENT = -1  # segment id of a packed row's padding tokens


def group_by_prompt(token_ids: Tensor, prompt_lengths: Sequence[int]) -> list[list[int]]:
    """Rows grouped by equal prompts (length and token ids), each group in row order, groups in order of their
    first row.

    Args:
        token_ids: [B, T] int64 on the host, row ``i``'s prompt in its first ``prompt_lengths[i]`` columns.
        prompt_lengths: [B] host ints.
    """
    rows = token_ids.tolist()
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompt_lengths):
        groups.setdefault(tuple(rows[i][:p]), []).append(i)  # the tuple's length is the prompt length
    return list(groups.values())


def shared_prefix_mask(segments: Tensor) -> Tensor:
    """[G, 1, L, L] bool attention mask of packed rows, True where query ``q`` may attend key ``k``: ``k <= q``
    and key ``k`` is a prompt token (segment 0) or in the query's own segment.

    Args:
        segments: [G, L] int64: 0 on prompt tokens, ``j + 1`` on the row's ``j``-th response, ``PAD_SEGMENT`` on
            padding (padding sees the prompt and earlier padding, so no query row is empty; no real token sees
            padding).
    """
    length = segments.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segments.device).tril()  # [L, L]
    key_seg, query_seg = segments[:, None, :], segments[:, :, None]  # [G, 1, L], [G, L, 1]
    return (causal & ((key_seg == 0) | (key_seg == query_seg)))[:, None]


@dataclass
class SharedPrefixRows:
    """A micro-batch's rows packed by prompt (module docstring).

    Attributes:
        token_ids: [G, L] int64, packed row ``g``: its prompt, then each of its rows' responses, then padding.
        position_ids: [G, L] int64: prompt ``0 .. p-1``, each response ``p ..``, padding 0.
        attention_mask: [G, 1, L, L] bool (``shared_prefix_mask``).
        score_row, score_col: [N] int64, the micro-batch row and column of each of its N response tokens.
        score_group, score_source: [N] int64, the packed row and position whose logits score that token.
        score_target: [N] int64, the token's id.
        groups: the micro-batch's rows in each packed row (``group_by_prompt``).
    """

    token_ids: Tensor
    position_ids: Tensor
    attention_mask: Tensor
    score_row: Tensor
    score_col: Tensor
    score_group: Tensor
    score_source: Tensor
    score_target: Tensor
    groups: list[list[int]]

    @property
    def computed_tokens(self) -> int:
        """Tokens the model computes (padding included): G x L."""
        return self.token_ids.numel()

    def to(self, device: torch.device | str) -> "SharedPrefixRows":
        """Every tensor on ``device``."""
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if isinstance(getattr(self, f.name), Tensor)})


def pack_shared_prefix(token_ids: Tensor, prompt_lengths: Sequence[int], response_lengths: Sequence[int],
                       pad_token_id: int = 0) -> SharedPrefixRows:
    """Right-padded rows (the ``TrainBatch`` convention) -> one packed row per distinct prompt, on the host.

    Args:
        token_ids: [B, T] int64 on the host; row ``i``: ``prompt_lengths[i]`` prompt tokens, then
            ``response_lengths[i]`` response tokens, then padding.
        prompt_lengths, response_lengths: [B] host ints.
        pad_token_id: the id written into the packed rows' padding.

    Returns:
        ``SharedPrefixRows`` on the host (``.to(device)`` moves it).

    Raises:
        ValueError: shapes that do not match, a prompt shorter than 1 token (its first response token would
            have no logits to come from), or a row longer than ``T``.
    """
    p_lens, r_lens = [int(x) for x in prompt_lengths], [int(x) for x in response_lengths]
    if token_ids.dim() != 2 or not len(p_lens) == len(r_lens) == token_ids.shape[0]:
        raise ValueError(f"pack_shared_prefix: token_ids must be [B, T] with B prompt and response lengths; got "
                         f"{tuple(token_ids.shape)}, {len(p_lens)}, {len(r_lens)}")
    if any(p < 1 or r < 0 or p + r > token_ids.shape[1] for p, r in zip(p_lens, r_lens)):
        raise ValueError(f"pack_shared_prefix: prompt lengths {p_lens} must be >= 1 and prompt + response lengths "
                         f"<= {token_ids.shape[1]} (response lengths {r_lens})")
    groups = group_by_prompt(token_ids, p_lens)
    rows = token_ids.tolist()
    seqs, positions, segments = [], [], []
    score: list[tuple[int, int, int, int, int]] = []  # (row, col, group, source, target)
    for g, members in enumerate(groups):
        p = p_lens[members[0]]
        seq, pos, seg = rows[members[0]][:p], list(range(p)), [0] * p
        for j, i in enumerate(members):
            start, r = len(seq), r_lens[i]
            for k in range(r):  # token k is scored from the prompt's last token (k = 0) or response token k - 1
                score.append((i, p + k, g, p - 1 if k == 0 else start + k - 1, rows[i][p + k]))
            seq += rows[i][p:p + r]
            pos += range(p, p + r)
            seg += [j + 1] * r
        seqs.append(seq)
        positions.append(pos)
        segments.append(seg)
    length = max(map(len, seqs))

    def padded(lists: list[list[int]], value: int) -> Tensor:
        return torch.tensor([x + [value] * (length - len(x)) for x in lists], dtype=torch.long)

    segment_ids = padded(segments, PAD_SEGMENT)
    index = torch.tensor(score, dtype=torch.long).reshape(-1, 5).T  # [5, N]
    return SharedPrefixRows(padded(seqs, pad_token_id), padded(positions, 0), shared_prefix_mask(segment_ids),
                            *index.unbind(0), groups=groups)


def shared_prefix_tokens(token_ids: Tensor, prompt_lengths: Sequence[int],
                         response_lengths: Sequence[int]) -> tuple[int, int]:
    """(real, computed) tokens of the rows' shared-prefix packing (``pack_shared_prefix``), without building it.

    Real: each distinct prompt once plus every response; computed: ``SharedPrefixRows.computed_tokens`` (packed rows
    x the longest, padding included). Their ratio is the layout's ``packing_efficiency``.

    Args:
        token_ids: [B, T] int64 on the host (rows as ``pack_shared_prefix`` takes them).
        prompt_lengths, response_lengths: [B] host ints.
    """
    groups = group_by_prompt(token_ids, prompt_lengths)
    lengths = [int(prompt_lengths[g[0]]) + sum(int(response_lengths[i]) for i in g) for g in groups]
    return sum(lengths), len(lengths) * max(lengths, default=0)


def shared_prefix_logprobs(logits: Tensor, packed: SharedPrefixRows, shape: tuple[int, int],
                           temperature: float = 1.0) -> Tensor:
    """Log-probs of the micro-batch's response tokens from the packed rows' logits, in the rows' layout.

    The same computation as ``nemo_fp8.models.hf.token_logprobs`` (log-softmax of float32 logits / temperature,
    the token's entry), on the logits that score each response token.

    Args:
        logits: [G, L, V] (any float dtype) of ``packed.token_ids``.
        packed: what ``pack_shared_prefix`` returned, on ``logits``' device.
        shape: (B, T) of the micro-batch.
        temperature: > 0, the sampler's.

    Returns:
        [B, T] float32, log p(token_t | tokens_<t) on response columns, 0 elsewhere; differentiable in ``logits``.
    """
    picked = logits[packed.score_group, packed.score_source].float() / temperature  # [N, V]
    logp = torch.log_softmax(picked, dim=-1).gather(-1, packed.score_target[:, None]).squeeze(-1)  # [N]
    out = torch.zeros(shape, dtype=torch.float32, device=logits.device)
    return out.index_put((packed.score_row, packed.score_col), logp)
