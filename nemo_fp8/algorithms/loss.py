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
* k3 KL estimator: Schulman 2020, http://joschu.net/blog/kl-approx.html
* Truncated importance sampling (TIS): Yao et al. 2025, "Your Efficient RL
  Framework Secretly Brings You Off-Policy RL Training"
* IcePop token masking: Ling team 2025 (Ring-1T / "IcePop")
* Sequence-level masked IS ("seq-mask-tis"): "When Speed Kills Stability:
  Demystifying RL Collapse from the Training-Inference Mismatch" (Yao, Liu
  et al. 2025), as implemented in NeMo-RL.
"""

from __future__ import annotations

import math

import torch

from nemo_fp8.algorithms.config import TRUNCATED_IS_TYPES, ClippedPGLossConfig  # the YAML section loss_fn
from nemo_fp8.algorithms.metrics import LOG_RATIO_CLAMP, masked_mean

__all__ = [
    "ClippedPGLossConfig",
    "TRUNCATED_IS_TYPES",
    "importance_sampling_weights",
    "clipped_pg_loss",
]

# --------------------------------------------------------------------------- #
# helpers
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


def _resolve_denominator(
    name: str, given: float | torch.Tensor | None, local_count: int
) -> float:
    """Normaliser for a micro-batch sum: ``given`` (global) or this batch's count.

    Returns a strictly positive float; when the count is 0 (nothing valid
    anywhere) returns 1.0 so that a sum of zeros stays 0 instead of 0/0.
    """
    if given is None:
        denom = float(local_count)
    else:
        denom = float(given.item() if isinstance(given, torch.Tensor) else given)
        if not math.isfinite(denom) or denom < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {given!r}")
        if denom + 1e-6 < local_count:
            raise ValueError(
                f"{name}={denom} is smaller than this batch's own count {local_count}; "
                "it must be the count over the whole global batch"
            )
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
) -> tuple[torch.Tensor, dict[str, float]]:
    """Off-policy correction weights ``pi_train / pi_gen`` (truncated or masked).

    The rollout engine (behaviour policy, ``generation_logprobs``) differs
    from the trainer (``prev_logprobs``, same weights but different kernels,
    FP8 quantisation, ...). Per token ``log r_t = clamp(prev_t - gen_t, -20,
    20)`` (``LOG_RATIO_CLAMP``; NeMo-RL instead maps inf to 0) and ``r_t =
    exp(log r_t)``; valid tokens only:

    * ``"tis"`` (Yao et al. 2025): ``w_t = min(r_t, C)``; ``C = None`` means
      no truncation. "Truncated" tokens: ``r_t > C``.
    * ``"icepop"`` (Ling team 2025): ``w_t = r_t`` if ``lo <= r_t <= hi``
      else 0 (token masked).
    * ``"seq-mask-tis"`` (NeMo-RL): per sequence the geometric-mean ratio
      ``g = exp(mean_t log r_t)`` over its valid tokens; a sequence with
      ``g`` outside ``[lo, hi]`` gets weight 0 on all its tokens; a kept
      sequence keeps the raw, **non-truncated** token weights ``w_t = r_t``
      (as NeMo-RL: there ``hi`` is the bound on ``g``, typically ~1.002, so
      it is not reused as a token cap).
    * ``"seq-tis"``: one weight per sequence, ``w = min(exp(clamp(sum_t
      log r_t, -20, 20)), C)``, broadcast to its valid tokens (the
      sequence-level IS weight of NeMo-RL's
      ``sequence_level_importance_ratios``, truncated like TIS).

    When ``cfg.use_importance_sampling_correction`` is False the weights are
    1 on valid tokens (the stats then describe those unit weights).

    Args:
        prev_logprobs: [B, T] float, trainer log-probs before the update.
        generation_logprobs: [B, T] float, rollout-engine log-probs.
        token_mask: [B, T] bool/float, nonzero = valid.
        cfg: the loss config.

    Returns:
        weights: [B, T] float32, detached (no grad_fn), 0 outside the mask.
        stats: python floats, means over valid tokens (sequences for
            ``is_frac_seqs_masked``, over sequences with >= 1 valid token);
            all 0.0 when nothing is valid:
            ``is_weight_mean``, ``is_weight_min``, ``is_weight_max``,
            ``is_frac_tokens_truncated`` (weight capped at C or zeroed),
            ``is_frac_tokens_masked`` (weight zeroed by icepop/seq-mask-tis),
            ``is_frac_seqs_masked`` (sequences whose every valid token was
            zeroed).

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
        r = torch.exp(log_r)
        kind = cfg.truncated_importance_sampling_type
        hi = cfg.truncated_importance_sampling_ratio
        lo = cfg.truncated_importance_sampling_ratio_min
        if kind == "tis":
            weights = r if hi is None else r.clamp(max=hi)
            if hi is not None:
                truncated = r > hi
        elif kind == "icepop":
            keep = (r >= lo) & (r <= hi)
            weights = torch.where(keep, r, torch.zeros_like(r))
            masked = ~keep
        elif kind == "seq-mask-tis":
            g = torch.exp(masked_mean(log_r, valid, dim=-1))  # [B]
            keep_seq = (g >= lo) & (g <= hi)
            weights = r * keep_seq.unsqueeze(-1).float()
            masked = (~keep_seq).unsqueeze(-1).expand_as(valid)
        elif kind == "seq-tis":
            seq_log_r = torch.where(valid, log_r, torch.zeros_like(log_r)).sum(dim=-1)
            seq_w = torch.exp(seq_log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # [B]
            if hi is not None:
                truncated = (seq_w > hi).unsqueeze(-1).expand_as(valid)
                seq_w = seq_w.clamp(max=hi)
            weights = seq_w.unsqueeze(-1).expand_as(r)
        else:  # pragma: no cover - guarded by ClippedPGLossConfig
            raise ValueError(f"unknown truncated_importance_sampling_type {kind!r}")
        masked = masked & valid
        truncated = (truncated | masked) & valid
        weights = torch.where(valid, weights, torch.zeros_like(weights))

    weights = weights.float().contiguous()
    n_valid = int(valid.sum().item())
    seq_valid = valid.any(dim=-1)
    if n_valid > 0:
        vw = weights[valid]
        w_min, w_max = vw.min().item(), vw.max().item()
        seq_all_masked = (masked | ~valid).all(dim=-1) & seq_valid
    else:
        w_min = w_max = 0.0
        seq_all_masked = torch.zeros_like(seq_valid)
    stats = {
        "is_weight_mean": masked_mean(weights, valid).item(),
        "is_weight_min": float(w_min),
        "is_weight_max": float(w_max),
        "is_frac_tokens_truncated": masked_mean(truncated.float(), valid).item(),
        "is_frac_tokens_masked": masked_mean(masked.float(), valid).item(),
        "is_frac_seqs_masked": masked_mean(seq_all_masked.float(), seq_valid).item(),
    }
    return weights, stats


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
) -> tuple[torch.Tensor, dict[str, float]]:
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
    * KL penalty: ``kl = k3(reference_logprobs - logprobs)`` per token
      (Schulman 2020; ``exp(x) - 1 - x``, clamped by
      ``kl_input_clamp_value``/``kl_output_clamp_value``), added as
      ``beta * agg(kl)``. Not importance weighted.

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
            (>= this batch's count).
        global_valid_seqs: number of sequences with >= 1 valid token in the
            global batch (>= this batch's count).

    Returns:
        loss: scalar float32 tensor.
        metrics (python floats):
            ``loss``, ``pg_loss``, ``kl_penalty`` -- this batch's
            contribution to the global loss (normalised like the loss, so
            they sum over micro-batches); ``kl_penalty`` is the aggregated
            k3 KL *before* multiplying by beta (as NeMo-RL reports it), 0.0
            without ``reference_logprobs``;
            ``clip_fraction`` (valid tokens where the PPO clipped branch
            was strictly larger, i.e. active), ``dual_clip_fraction``,
            ``approx_kl`` (mean k3 with log ratio ``prev - logprobs``: the
            estimate of KL(current || prev)), ``ratio_mean``, ``ratio_min``,
            ``ratio_max``, ``num_valid_tokens``, ``num_valid_seqs`` and the
            IS stats of :func:`importance_sampling_weights` -- these are
            plain means over this batch's valid tokens (0.0 when none).

    Raises:
        ValueError: shape mismatches (naming the tensors and shapes), a
            missing ``reference_logprobs`` with beta > 0, or global counts
            that are negative or smaller than this batch's.
    """
    if not isinstance(cfg, ClippedPGLossConfig):
        raise TypeError(f"cfg must be a ClippedPGLossConfig, got {type(cfg)}")
    _check_bt("logprobs", logprobs)
    shape = logprobs.shape
    _check_bt("prev_logprobs", prev_logprobs, shape)
    _check_bt("generation_logprobs", generation_logprobs, shape)
    _check_bt("token_mask", token_mask, shape)
    if reference_logprobs is not None:
        _check_bt("reference_logprobs", reference_logprobs, shape)
    if not isinstance(advantages, torch.Tensor):
        raise TypeError(f"advantages must be a torch.Tensor, got {type(advantages)}")
    if advantages.shape == shape[:1]:
        advantages = advantages.unsqueeze(-1).expand(shape)
    elif advantages.shape != shape:
        raise ValueError(
            f"advantages shape {tuple(advantages.shape)} must be [B]={tuple(shape[:1])} "
            f"or [B, T]={tuple(shape)} (logprobs shape)"
        )
    beta = float(cfg.reference_policy_kl_penalty)
    if beta > 0 and reference_logprobs is None:
        raise ValueError(
            f"reference_logprobs is required when reference_policy_kl_penalty={beta} > 0"
        )

    valid = token_mask != 0
    seq_valid = valid.any(dim=-1)
    n_tok = int(valid.sum().item())
    n_seq = int(seq_valid.sum().item())

    lp = _zero_masked(logprobs, valid)  # grad flows only at valid positions
    prev = _zero_masked(prev_logprobs.detach(), valid)
    adv = _zero_masked(advantages.detach(), valid)

    # PPO clipped surrogate (+ clip-higher, dual clip).
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

    is_w, is_stats = importance_sampling_weights(prev_logprobs, generation_logprobs, token_mask, cfg)
    pg = torch.where(valid, is_w * pg, torch.zeros_like(pg))

    # KL to the reference policy (k3 with log ratio = reference - current).
    kl_tok = None
    if reference_logprobs is not None:
        ref = _zero_masked(reference_logprobs.detach(), valid)
        kl_tok = _k3(ref - lp, cfg.kl_input_clamp_value, cfg.kl_output_clamp_value)
        kl_tok = torch.where(valid, kl_tok, torch.zeros_like(kl_tok))

    if cfg.token_level_loss:
        denom = _resolve_denominator("global_valid_tokens", global_valid_tokens, n_tok)

        def agg(x: torch.Tensor) -> torch.Tensor:
            return x.sum() / denom

    else:
        denom = _resolve_denominator("global_valid_seqs", global_valid_seqs, n_seq)
        tok_per_seq = valid.sum(dim=-1).clamp(min=1).float()

        def agg(x: torch.Tensor) -> torch.Tensor:
            return (x.sum(dim=-1) / tok_per_seq).sum() / denom

    pg_loss = agg(pg)
    if kl_tok is not None:
        kl_value = agg(kl_tok)
        loss = pg_loss + beta * kl_value if beta > 0 else pg_loss
    else:
        kl_value = torch.zeros((), dtype=torch.float32)
        loss = pg_loss

    with torch.no_grad():
        ratio_d = ratio.detach()
        if n_tok > 0:
            vr = ratio_d[valid]
            r_min, r_max = vr.min().item(), vr.max().item()
        else:
            r_min = r_max = 0.0
        approx_kl = masked_mean(_k3(prev - lp.detach(), None, None), valid)
        metrics = {
            "loss": loss.detach().item(),
            "pg_loss": pg_loss.detach().item(),
            "kl_penalty": kl_value.detach().item(),
            "clip_fraction": masked_mean(clip_active.float(), valid).item(),
            "dual_clip_fraction": masked_mean(dual_active.float(), valid).item(),
            "approx_kl": approx_kl.item(),
            "ratio_mean": masked_mean(ratio_d, valid).item(),
            "ratio_min": float(r_min),
            "ratio_max": float(r_max),
            "num_valid_tokens": float(n_tok),
            "num_valid_seqs": float(n_seq),
            **is_stats,
        }
    return loss, metrics


class ClippedPGLossFn:
    """``clipped_pg_loss`` bound to a config, in the ``LossFn`` form policy backends call.

    Picklable (crosses into Ray actors). ``__call__(logprobs [B, T], batch, global_valid_tokens,
    global_valid_seqs)`` reads ``prev_logprobs``, ``generation_logprobs``, ``advantages`` and
    ``reference_logprobs`` from the ``nemo_fp8.batch.TrainBatch``.
    """

    def __init__(self, cfg: ClippedPGLossConfig):
        self.cfg = cfg

    def __call__(self, logprobs: torch.Tensor, batch, global_valid_tokens: float, global_valid_seqs: float):
        if batch.prev_logprobs is None:
            raise ValueError("ClippedPGLossFn: batch.prev_logprobs is None; run policy.get_logprobs first")
        ref = batch.reference_logprobs if self.cfg.reference_policy_kl_penalty > 0 else None
        if self.cfg.reference_policy_kl_penalty > 0 and ref is None:
            raise ValueError("ClippedPGLossFn: reference_policy_kl_penalty > 0 needs batch.reference_logprobs")
        return clipped_pg_loss(logprobs, batch.prev_logprobs, batch.generation_logprobs, batch.advantages,
                               batch.token_mask.to(logprobs.device), self.cfg, reference_logprobs=ref,
                               global_valid_tokens=global_valid_tokens, global_valid_seqs=global_valid_seqs)
