"""Clipped policy-gradient loss with off-policy importance-sampling correction.

Conventions (shared by ``loss.py``, ``advantages.py`` and ``metrics.py``):

* Every per-token tensor is ``[B, T]`` float32 (other float dtypes are cast to
  float32 for the computation), ``B`` sequences by ``T`` positions, aligned so
  that index ``t`` holds the log-prob of token ``t`` given tokens ``< t``.
* ``token_mask`` ``[B, T]`` (float or bool): 1.0 for response tokens that count
  in the loss, 0.0 for prompt and padding. It is read as a boolean (nonzero =
  valid); values at masked positions never affect results or gradients, even
  if they are inf or nan, because masked positions are replaced with 0 via
  ``torch.where`` before any arithmetic.
* ``logprobs``: current trainer log-probs (the only input with grad).
* ``prev_logprobs``: the trainer's log-probs of the same tokens before the
  update (the PPO "old" policy). Always detached here.
* ``generation_logprobs``: the rollout engine's log-probs (the behaviour
  policy that actually sampled the tokens, e.g. an FP8 vLLM). Detached.
* ``reference_logprobs``: the frozen reference policy's log-probs. Detached.
* ``advantages``: ``[B]`` (one per sequence, broadcast over tokens) or
  ``[B, T]``. Detached.

Key names follow NeMo-RL's ``ClippedPGLossConfig``
(``nemo_rl/algorithms/loss_functions.py``, repo NVIDIA-NeMo/RL). Formulas:

* PPO clipped surrogate: Schulman et al. 2017, https://arxiv.org/abs/1707.06347
* Decoupled clip range ("clip-higher"): DAPO, Yu et al. 2025,
  https://arxiv.org/abs/2503.14476
* Dual clip: Ye et al. 2020, https://arxiv.org/abs/1912.09729
* k3 KL estimator: Schulman 2020, http://joschu.net/blog/kl-approx.html; its
  score-function factor ``exp(logprobs - logprobs.detach())`` as NeMo-RL's
  ``ClippedPGLossFn`` / ``calculate_kl`` (``nemo_rl/algorithms/utils.py``),
  after Tang & Munos 2025, https://arxiv.org/abs/2506.09477
* Importance-sampling corrections (TIS, Yao et al. 2025; IcePop, Ling team
  2025; the sequence-level ``seq-mask-tis`` / ``seq-tis`` of NeMo-RL, after
  Yao, Liu et al. 2025): one registered function each in
  :mod:`nemo_fp8.algorithms.is_corrections`, with its formula and source.

No host syncs: :func:`clipped_pg_loss` and :func:`importance_sampling_weights`
never read a tensor value on the host (no ``.item()``, ``float(t)``,
``bool(t)``, ``if t ...:``, ``.tolist()``, boolean-mask indexing), so on a GPU
a micro-batch's loss is queued without stalling the CPU. Their metrics are
0-dim float32 tensors on the device; combine them over micro-batches and
ranks with :class:`nemo_fp8.utils.metrics.MetricAccumulator` (one host
transfer per step). ``tests/algorithms/test_loss.py`` checks this with
:func:`nemo_fp8.utils.host_sync.count_host_syncs`.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from nemo_fp8.algorithms.config import TRUNCATED_IS_TYPES, ClippedPGLossConfig  # the YAML section loss_fn
from nemo_fp8.algorithms.is_corrections import IS_CORRECTIONS, LOG_RATIO_CLAMP, register_is_correction
from nemo_fp8.algorithms.metrics import LOSS_METRIC_REDUCTIONS, masked_mean

__all__ = [
    "ClippedPGLossConfig",
    "TRUNCATED_IS_TYPES",
    "IS_CORRECTIONS",
    "register_is_correction",
    "LOSS_METRIC_REDUCTIONS",
    "importance_sampling_weights",
    "clipped_pg_loss",
    "ClippedPGLossFn",
]

# --------------------------------------------------------------------------- #
# helpers (none of them reads a tensor value on the host)
# --------------------------------------------------------------------------- #


def _check_bt(name: str, t: object, shape: torch.Size | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t)}")
    if shape is None:
        if t.dim() != 2:
            raise ValueError(f"{name} must be [B, T], got shape {tuple(t.shape)}")
    elif t.shape != shape:
        raise ValueError(
            f"{name} shape {tuple(t.shape)} does not match logprobs shape [B, T]={tuple(shape)}"
        )


def _zero_masked(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """float32 copy of ``x`` with masked positions set to exactly 0 (grad-safe)."""
    return torch.where(valid, x.float(), torch.zeros((), dtype=torch.float32, device=x.device))


def _metric(x: torch.Tensor) -> torch.Tensor:
    """A metric value: 0-dim float32, detached, on ``x``'s device."""
    return x.detach().reshape(()).to(torch.float32)


def _masked_min_max(x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max of ``x`` over ``valid`` as 0-dim float32 tensors; both 0 when nothing is valid.

    ``torch.where`` with +inf / -inf sentinels, so no boolean-mask indexing (``x[valid]``
    needs a ``nonzero``, i.e. a host sync) and no branch on the count.
    """
    if x.numel() == 0:  # shape only: no sync
        zero = torch.zeros((), dtype=torch.float32, device=x.device)
        return zero, zero.clone()
    x = x.detach().float()
    # a fill kernel; torch.tensor(math.inf, device=...) would copy from the host and wait for the GPU
    inf = torch.full((), math.inf, dtype=torch.float32, device=x.device)
    zero = torch.zeros((), dtype=torch.float32, device=x.device)
    any_valid = valid.any()
    lo = torch.where(any_valid, torch.where(valid, x, inf).amin(), zero)
    hi = torch.where(any_valid, torch.where(valid, x, -inf).amax(), zero)
    return lo, hi


def _resolve_denominator(
    name: str, given: float | torch.Tensor | None, local_count: torch.Tensor
) -> float | torch.Tensor:
    """Normaliser of a micro-batch sum: ``given`` (the global batch's count) or this batch's count.

    No host sync: a python number is checked on the host (finite and >= 0, else
    ``ValueError`` naming ``name``); a tensor (0-dim or one element, on any device; a CPU
    scalar with CUDA logprobs is fine) and the local count are *not* read. In particular
    ``given`` is no longer compared with this batch's own count (that needs the count on the
    host, i.e. a sync per micro-batch): the caller must pass the sum of the micro-batch
    counts over the global batch (and data-parallel ranks). A count of 0 (nothing valid
    anywhere) is replaced by 1, so a sum of zeros stays 0 instead of 0/0.

    Returns:
        a float > 0, or a 0-dim float32 tensor (> 0 whenever ``given`` is >= 0).

    Raises:
        ValueError: a negative / non-finite python number, or a tensor with more than one
            element.
        TypeError: ``given`` neither None, a real number nor a tensor.
    """
    if given is None:
        return local_count.clamp(min=1).to(torch.float32)
    if isinstance(given, torch.Tensor):
        if given.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got shape {tuple(given.shape)}")
        g = given.detach().reshape(()).to(torch.float32)
        return torch.where(g > 0, g, torch.ones((), dtype=torch.float32, device=g.device))
    if isinstance(given, bool) or not isinstance(given, (int, float)):
        raise TypeError(f"{name} must be None, a number or a tensor, got {type(given)}")
    denom = float(given)
    if not math.isfinite(denom) or denom < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {given!r}")
    return denom if denom > 0 else 1.0


# --------------------------------------------------------------------------- #
# importance-sampling weights
# --------------------------------------------------------------------------- #


@torch.no_grad()
def importance_sampling_weights(
    prev_logprobs: torch.Tensor,
    generation_logprobs: torch.Tensor,
    token_mask: torch.Tensor,
    cfg: ClippedPGLossConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Off-policy correction weights ``pi_train / pi_gen`` (truncated or masked), and their statistics.

    The rollout engine (behaviour policy, ``generation_logprobs``) differs from the trainer
    (``prev_logprobs``, same weights but different kernels, FP8 quantisation, ...). Per token ``log r_t =
    clamp(prev_t - gen_t, -20, 20)`` (``LOG_RATIO_CLAMP``; NeMo-RL instead maps inf to 0) and ``r_t =
    exp(log r_t)``, valid tokens only; the correction ``cfg.truncated_importance_sampling_type`` of
    :data:`~nemo_fp8.algorithms.is_corrections.IS_CORRECTIONS` (``tis``, ``icepop``, ``seq-mask-tis``,
    ``seq-tis``: formulas and sources in :mod:`nemo_fp8.algorithms.is_corrections`) turns them into weights,
    with ``lo`` = ``truncated_importance_sampling_ratio_min`` and ``C`` = ``truncated_importance_sampling_ratio``.

    When ``cfg.use_importance_sampling_correction`` is False the weights are 1 on valid tokens (the stats then
    describe those unit weights). No host sync (see the module docstring).

    Args:
        prev_logprobs: [B, T] float, trainer log-probs before the update.
        generation_logprobs: [B, T] float, rollout-engine log-probs.
        token_mask: [B, T] bool/float, nonzero = valid.
        cfg: the loss config.

    Returns:
        weights: [B, T] float32, detached (no grad_fn), 0 outside the mask.
        stats: 0-dim float32 detached tensors on ``prev_logprobs``' device; means over valid tokens (over
            sequences with >= 1 valid token for ``is_frac_seqs_masked``); all 0 when nothing is valid:
            ``is_weight_mean``, ``is_weight_min``, ``is_weight_max``, ``is_frac_tokens_truncated`` (weight
            clamped at C or lo, or zeroed), ``is_frac_tokens_masked`` (weight zeroed by icepop/seq-mask-tis),
            ``is_frac_seqs_masked`` (sequences whose every valid token was zeroed). Reductions across
            micro-batches: :data:`nemo_fp8.algorithms.metrics.LOSS_METRIC_REDUCTIONS`.

    Raises:
        ValueError: shape mismatch.
    """
    _check_bt("prev_logprobs", prev_logprobs)
    _check_bt("generation_logprobs", generation_logprobs, prev_logprobs.shape)
    _check_bt("token_mask", token_mask, prev_logprobs.shape)
    valid = token_mask != 0
    prev = _zero_masked(prev_logprobs.detach(), valid)
    gen = _zero_masked(generation_logprobs.detach(), valid)

    truncated = torch.zeros_like(valid)
    masked = torch.zeros_like(valid)
    if not cfg.use_importance_sampling_correction:
        weights = valid.float()
    else:
        log_r = (prev - gen).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        correction = IS_CORRECTIONS[cfg.truncated_importance_sampling_type]  # a valid name: the config's Literal
        weights, truncated, masked = correction.fn(torch.exp(log_r), log_r, valid,
                                                   cfg.truncated_importance_sampling_ratio_min,
                                                   cfg.truncated_importance_sampling_ratio)
        masked = masked & valid
        truncated = (truncated | masked) & valid
        weights = torch.where(valid, weights, torch.zeros_like(weights))
    weights = weights.float().contiguous()
    return weights, _is_stats(weights, valid, truncated, masked)


def _is_stats(weights: torch.Tensor, valid: torch.Tensor, truncated: torch.Tensor,
              masked: torch.Tensor) -> dict[str, torch.Tensor]:
    """The ``is_*`` metrics of :func:`importance_sampling_weights` ([B, T] float32 weights, [B, T] bool masks)."""
    seq_valid = valid.any(dim=-1)
    seq_all_masked = (masked | ~valid).all(dim=-1) & seq_valid
    w_min, w_max = _masked_min_max(weights, valid)
    return {
        "is_weight_mean": _metric(masked_mean(weights, valid)),
        "is_weight_min": w_min,
        "is_weight_max": w_max,
        "is_frac_tokens_truncated": _metric(masked_mean(truncated.float(), valid)),
        "is_frac_tokens_masked": _metric(masked_mean(masked.float(), valid)),
        "is_frac_seqs_masked": _metric(masked_mean(seq_all_masked.float(), seq_valid)),
    }


# --------------------------------------------------------------------------- #
# the loss
# --------------------------------------------------------------------------- #


def _k3(log_ratio: torch.Tensor, input_clamp: float | None, output_clamp: float | None) -> torch.Tensor:
    """k3 = exp(x) - 1 - x (Schulman 2020), with NeMo-RL's optional clamps."""
    if input_clamp is not None:
        log_ratio = log_ratio.clamp(-input_clamp, input_clamp)
    kl = torch.exp(log_ratio) - 1.0 - log_ratio
    if output_clamp is not None:
        kl = kl.clamp(-output_clamp, output_clamp)
    return kl


def kl_penalty_per_token(
    logprobs: torch.Tensor,
    reference_logprobs: torch.Tensor,
    input_clamp: float | None,
    output_clamp: float | None,
) -> torch.Tensor:
    """Per-token k3 KL(current || reference) penalty with its score-function gradient.

    As NeMo-RL's ``ClippedPGLossFn`` (default ``use_on_policy_kl_approximation=False``)
    calling ``calculate_kl(..., importance_sampling_weights=w)`` in
    ``nemo_rl/algorithms/utils.py``: with ``x = reference - logprobs`` and ``w =
    exp(logprobs - logprobs.detach())`` (``nan``/``inf`` mapped to 0)::

        x_c = clamp(x, -input_clamp, input_clamp)
        w_c = w where x_c == x, else w.detach()    # a clamped token gets no gradient at all
        kl  = clamp(w_c * (exp(x_c) - 1 - x_c), -output_clamp, output_clamp)

    ``w`` is exactly 1 in value, so ``kl`` is the k3 estimate (Schulman 2020), but the
    gradient gains the score-function term of the sampling distribution (the KL samples
    come from the policy being optimised; Tang & Munos 2025,
    https://arxiv.org/abs/2506.09477): per token ``d kl / d logprobs = k3(x) + (1 - e^x) =
    -x = logprobs - reference`` where no clamp is active, 0 where one is. Without ``w`` the
    gradient of k3 alone, ``1 - e^x``, is not the gradient of KL(current || reference).

    Args:
        logprobs: [B, T] float32, current log-probs (with grad).
        reference_logprobs: [B, T] float32, detached.
        input_clamp, output_clamp: NeMo-RL's ``kl_input_clamp_value`` /
            ``kl_output_clamp_value``; None disables.

    Returns:
        [B, T] float32 per-token penalty (not masked).
    """
    w = torch.exp(logprobs - logprobs.detach())
    w = torch.nan_to_num(w, nan=0.0, posinf=0.0, neginf=0.0)
    x = reference_logprobs - logprobs
    if input_clamp is not None:
        x_c = x.clamp(-input_clamp, input_clamp)
        w = torch.where(x == x_c, w, w.detach())
        x = x_c
    kl = w * (torch.exp(x) - 1.0 - x)
    if output_clamp is not None:
        kl = kl.clamp(-output_clamp, output_clamp)
    return kl


def _advantages_bt(advantages: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``advantages`` ([B] or [B, T]) as [B, T] (a [B] one broadcast over tokens).

    Raises:
        TypeError: not a tensor. ValueError: another shape (naming both shapes).
    """
    if not isinstance(advantages, torch.Tensor):
        raise TypeError(f"advantages must be a torch.Tensor, got {type(advantages)}")
    if advantages.shape == shape[:1]:
        return advantages.unsqueeze(-1).expand(shape)
    if advantages.shape != shape:
        raise ValueError(
            f"advantages shape {tuple(advantages.shape)} must be [B]={tuple(shape[:1])} "
            f"or [B, T]={tuple(shape)} (logprobs shape)"
        )
    return advantages


def _check_loss_inputs(logprobs: torch.Tensor, prev_logprobs: torch.Tensor, generation_logprobs: torch.Tensor,
                       advantages: torch.Tensor, token_mask: torch.Tensor, cfg: ClippedPGLossConfig,
                       reference_logprobs: torch.Tensor | None) -> torch.Tensor:
    """The type and shape checks of :func:`clipped_pg_loss` (its Raises), on the host only; returns the
    advantages as [B, T]."""
    if not isinstance(cfg, ClippedPGLossConfig):
        raise TypeError(f"cfg must be a ClippedPGLossConfig, got {type(cfg)}")
    _check_bt("logprobs", logprobs)
    shape = logprobs.shape
    _check_bt("prev_logprobs", prev_logprobs, shape)
    _check_bt("generation_logprobs", generation_logprobs, shape)
    _check_bt("token_mask", token_mask, shape)
    if reference_logprobs is not None:
        _check_bt("reference_logprobs", reference_logprobs, shape)
    advantages = _advantages_bt(advantages, shape)
    beta = float(cfg.reference_policy_kl_penalty)  # a config value: no sync
    if beta > 0 and reference_logprobs is None:
        raise ValueError(
            f"reference_logprobs is required when reference_policy_kl_penalty={beta} > 0"
        )
    return advantages


def _ppo_surrogate(lp: torch.Tensor, prev: torch.Tensor, adv: torch.Tensor, valid: torch.Tensor,
                   cfg: ClippedPGLossConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO clipped surrogate with clip-higher and dual clip (formulas: :func:`clipped_pg_loss`).

    Args:
        lp, prev, adv: [B, T] float32, 0 at masked positions (``lp`` with grad).
        valid: [B, T] bool.
        cfg: ``ratio_clip_min`` / ``ratio_clip_max`` / ``ratio_clip_c``.

    Returns:
        ``(pg, ratio, clip_active, dual_active)``: [B, T] float32 loss (not yet IS-weighted or masked), [B, T]
        float32 ratio ``exp(lp - prev)``, and [B, T] bool masks of valid tokens where the clipped branch was
        strictly larger and where the dual clip capped the loss.
    """
    ratio = torch.exp(lp - prev)
    ratio_clipped = ratio.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio_clipped
    pg = torch.max(loss_unclipped, loss_clipped)
    clip_active = (loss_clipped > loss_unclipped) & valid
    dual_active = torch.zeros_like(valid)
    if cfg.ratio_clip_c is not None:
        loss_dual = -adv * cfg.ratio_clip_c
        dual_active = (adv < 0) & (loss_dual < pg) & valid
        pg = torch.where(adv < 0, torch.min(pg, loss_dual), pg)
    return pg, ratio, clip_active, dual_active


def _aggregator(cfg: ClippedPGLossConfig, valid: torch.Tensor, n_tok: torch.Tensor, n_seq: torch.Tensor,
                global_valid_tokens: float | torch.Tensor | None,
                global_valid_seqs: float | torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``agg``: [B, T] float32 per-token values (0 at masked positions) -> this micro-batch's 0-dim share.

    ``cfg.token_level_loss`` (NeMo-RL's key) picks verl's ``loss_agg_mode`` ``"token-mean"`` (``sum /
    global_valid_tokens``) or ``"seq-mean-token-mean"`` (``sum over sequences of the mean over its valid
    tokens / global_valid_seqs``); each count defaults to this batch's (``_resolve_denominator``).

    Raises:
        ValueError, TypeError: those of ``_resolve_denominator`` for the count it uses.
    """
    if cfg.token_level_loss:
        denom = _resolve_denominator("global_valid_tokens", global_valid_tokens, n_tok)
        return lambda x: x.sum() / denom
    denom = _resolve_denominator("global_valid_seqs", global_valid_seqs, n_seq)
    tok_per_seq = valid.sum(dim=-1).clamp(min=1).float()
    return lambda x: (x.sum(dim=-1) / tok_per_seq).sum() / denom


@torch.no_grad()
def _pg_metrics(lp: torch.Tensor, prev: torch.Tensor, ratio: torch.Tensor, valid: torch.Tensor,
                clip_active: torch.Tensor, dual_active: torch.Tensor) -> dict[str, torch.Tensor]:
    """Clip fractions, ``approx_kl`` and the ratio's mean / min / max over valid tokens ([B, T] inputs; 0-dim
    float32 detached outputs, see :func:`clipped_pg_loss`)."""
    ratio_d = ratio.detach()
    r_min, r_max = _masked_min_max(ratio_d, valid)
    return {
        "clip_fraction": _metric(masked_mean(clip_active.float(), valid)),
        "dual_clip_fraction": _metric(masked_mean(dual_active.float(), valid)),
        "approx_kl": _metric(masked_mean(_k3(prev - lp.detach(), None, None), valid)),
        "ratio_mean": _metric(masked_mean(ratio_d, valid)),
        "ratio_min": r_min,
        "ratio_max": r_max,
    }


def clipped_pg_loss(
    logprobs: torch.Tensor,
    prev_logprobs: torch.Tensor,
    generation_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    token_mask: torch.Tensor,
    cfg: ClippedPGLossConfig,
    reference_logprobs: torch.Tensor | None = None,
    global_valid_tokens: float | torch.Tensor | None = None,
    global_valid_seqs: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO clipped policy-gradient loss with IS correction and KL penalty.

    Per valid token, with ``A`` the advantage, ``r = exp(logprobs -
    prev_logprobs)`` (not clamped, as NeMo-RL), ``eps_low = ratio_clip_min``,
    ``eps_high = ratio_clip_max``:

    * PPO (Schulman 2017) with DAPO clip-higher (Yu 2025):
      ``l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``.
    * Dual clip (Ye 2020), if ``ratio_clip_c = c``: where ``A < 0``,
      ``l = min(l, -A c)`` (the loss is capped, so the gradient is 0 there).
    * IS correction: ``l <- w l`` with ``w`` from
      :func:`importance_sampling_weights` (detached: it scales the gradient,
      never receives one).
    * KL penalty: ``kl`` = :func:`kl_penalty_per_token` (k3 of ``reference -
      logprobs``, Schulman 2020, times NeMo-RL's score-function factor
      ``exp(logprobs - logprobs.detach())``: same value, gradient ``logprobs -
      reference`` per unclamped token), added as ``beta * agg(kl)``. Not
      importance weighted.

    Aggregation ``agg`` (same for the pg and KL terms):

    * token level: ``sum over valid tokens / global_valid_tokens``
      (default: this batch's valid-token count).
    * sequence level: ``sum over sequences of (per-sequence mean over its
      valid tokens) / global_valid_seqs`` (default: this batch's sequences
      with >= 1 valid token; fully masked sequences contribute 0).

    Passing the global counts lets micro-batches of one global batch be
    summed (their losses and gradients add up to the full-batch ones).

    An all-masked batch gives loss exactly 0, still attached to ``logprobs``
    so ``backward()`` works and yields an all-zero gradient (never NaN): the
    normaliser 0 is replaced by 1 over a sum of zeros.

    No host sync: nothing here reads a tensor value on the host (checked by
    ``count_host_syncs`` in the tests), so the global counts are not compared
    with this batch's counts (see ``_resolve_denominator``).

    Args:
        logprobs: [B, T] float, current trainer log-probs (with grad).
        prev_logprobs: [B, T] float, trainer log-probs before the update.
        generation_logprobs: [B, T] float, rollout-engine log-probs.
        advantages: [B] or [B, T] float.
        token_mask: [B, T] bool/float, nonzero = valid.
        cfg: loss configuration.
        reference_logprobs: [B, T] float or None; required when
            ``cfg.reference_policy_kl_penalty > 0``; if given with beta = 0
            the KL is only reported.
        global_valid_tokens: number of valid tokens in the global batch
            (python number or one-element tensor; the sum of the
            micro-batches' counts).
        global_valid_seqs: number of sequences with >= 1 valid token in the
            global batch (same forms).

    Returns:
        loss: 0-dim float32 tensor (with grad).
        metrics: ``dict[str, Tensor]`` of 0-dim float32 detached tensors on
            ``logprobs``' device, one per key of
            :data:`nemo_fp8.algorithms.metrics.LOSS_METRIC_REDUCTIONS`, which
            says how each combines over micro-batches:
            ``loss``, ``pg_loss``, ``kl_penalty`` ("sum") -- this batch's
            contribution to the global loss (normalised like the loss, so
            they sum over micro-batches); ``kl_penalty`` is the aggregated
            k3 KL *before* multiplying by beta (as NeMo-RL reports it), 0
            without ``reference_logprobs``; ``num_valid_tokens``,
            ``num_valid_seqs`` ("sum") this batch's counts;
            ``clip_fraction`` (valid tokens where the PPO clipped branch
            was strictly larger, i.e. active), ``dual_clip_fraction``,
            ``approx_kl`` (mean k3 with log ratio ``prev - logprobs``: the
            estimate of KL(current || prev)), ``ratio_mean`` and the
            token-mean IS stats of :func:`importance_sampling_weights`
            ("token_mean", plain means over this batch's valid tokens, 0
            when none); ``ratio_min`` / ``is_weight_min`` ("min"),
            ``ratio_max`` / ``is_weight_max`` ("max"), 0 when no token is
            valid; ``is_frac_seqs_masked`` ("seq_mean").

    Raises:
        TypeError: ``cfg`` not a ``ClippedPGLossConfig``, non-tensor inputs.
        ValueError: shape mismatches (naming the tensors and shapes), a
            missing ``reference_logprobs`` with beta > 0, or global counts
            given as negative / non-finite numbers or multi-element tensors.
    """
    advantages = _check_loss_inputs(logprobs, prev_logprobs, generation_logprobs, advantages, token_mask, cfg,
                                    reference_logprobs)
    valid = token_mask != 0
    n_tok = valid.sum()  # 0-dim int64 tensors, never read on the host
    n_seq = valid.any(dim=-1).sum()
    lp = _zero_masked(logprobs, valid)  # grad flows only at valid positions
    prev = _zero_masked(prev_logprobs.detach(), valid)
    adv = _zero_masked(advantages.detach(), valid)

    pg, ratio, clip_active, dual_active = _ppo_surrogate(lp, prev, adv, valid, cfg)
    is_w, is_stats = importance_sampling_weights(prev_logprobs, generation_logprobs, token_mask, cfg)
    pg = torch.where(valid, is_w * pg, torch.zeros_like(pg))
    agg = _aggregator(cfg, valid, n_tok, n_seq, global_valid_tokens, global_valid_seqs)
    pg_loss = agg(pg)
    loss, kl_value = pg_loss, torch.zeros((), dtype=torch.float32, device=logprobs.device)
    if reference_logprobs is not None:  # KL to the reference policy: k3 of reference - current, score-function factor
        ref = _zero_masked(reference_logprobs.detach(), valid)
        kl_tok = kl_penalty_per_token(lp, ref, cfg.kl_input_clamp_value, cfg.kl_output_clamp_value)
        kl_value = agg(torch.where(valid, kl_tok, torch.zeros_like(kl_tok)))
        if cfg.reference_policy_kl_penalty > 0:
            loss = pg_loss + float(cfg.reference_policy_kl_penalty) * kl_value
    metrics = {"loss": _metric(loss), "pg_loss": _metric(pg_loss), "kl_penalty": _metric(kl_value),
               **_pg_metrics(lp, prev, ratio, valid, clip_active, dual_active),
               "num_valid_tokens": _metric(n_tok), "num_valid_seqs": _metric(n_seq), **is_stats}
    return loss, metrics


class ClippedPGLossFn:
    """:func:`clipped_pg_loss` bound to a config, in the ``LossFn`` form policy backends call.

    Picklable (crosses into Ray actors; holds only the config).

    Attributes:
        cfg: the :class:`ClippedPGLossConfig`.
        metric_reductions: :data:`~nemo_fp8.algorithms.metrics.LOSS_METRIC_REDUCTIONS`, how
            each returned metric combines over micro-batches; pass it to
            :class:`~nemo_fp8.utils.metrics.MetricAccumulator`.
    """

    def __init__(self, cfg: ClippedPGLossConfig):
        if not isinstance(cfg, ClippedPGLossConfig):
            raise TypeError(f"cfg must be a ClippedPGLossConfig, got {type(cfg)}")
        self.cfg = cfg

    @property
    def metric_reductions(self) -> dict[str, str]:
        """Metric name -> "sum" | "token_mean" | "seq_mean" | "min" | "max" (do not mutate)."""
        return LOSS_METRIC_REDUCTIONS

    def __call__(
        self,
        logprobs: torch.Tensor,
        batch,
        global_valid_tokens: float | torch.Tensor,
        global_valid_seqs: float | torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss of one micro-batch (a ``nemo_fp8.batch.TrainBatch``), no host sync.

        Args:
            logprobs: [B, T] float32, current log-probs of ``batch`` (with grad).
            batch: ``TrainBatch`` with ``prev_logprobs``, ``generation_logprobs``,
                ``advantages`` ([B] or [B, T]), ``token_mask`` and, when beta > 0,
                ``reference_logprobs``; its tensors are used on ``logprobs``' device
                (``token_mask`` is moved there, the others are expected there).
            global_valid_tokens, global_valid_seqs: counts over the whole global batch
                (python numbers or one-element tensors), see :func:`clipped_pg_loss`.

        Returns:
            ``(loss, metrics)`` of :func:`clipped_pg_loss`; metrics are 0-dim float32
            device tensors, to be combined with ``MetricAccumulator(self.metric_reductions)``.

        Raises:
            ValueError: ``batch.prev_logprobs`` missing, or ``reference_logprobs`` missing
                with beta > 0; and those of :func:`clipped_pg_loss`.
        """
        if batch.prev_logprobs is None:
            raise ValueError("ClippedPGLossFn: batch.prev_logprobs is None; run policy.get_logprobs first")
        ref = batch.reference_logprobs if self.cfg.reference_policy_kl_penalty > 0 else None
        if self.cfg.reference_policy_kl_penalty > 0 and ref is None:
            raise ValueError("ClippedPGLossFn: reference_policy_kl_penalty > 0 needs batch.reference_logprobs")
        return clipped_pg_loss(logprobs, batch.prev_logprobs, batch.generation_logprobs, batch.advantages,
                               batch.token_mask.to(logprobs.device), self.cfg, reference_logprobs=ref,
                               global_valid_tokens=global_valid_tokens, global_valid_seqs=global_valid_seqs)
