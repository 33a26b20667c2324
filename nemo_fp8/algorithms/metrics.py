"""Masked reductions and training/inference mismatch metrics.

Tensor conventions are those of :mod:`nemo_fp8.algorithms.loss` (per-token
tensors are ``[B, T]`` float32, ``token_mask`` is 1.0 on response tokens that
count and 0.0 elsewhere, ``prev_logprobs`` are the trainer's log-probs before
the update and ``generation_logprobs`` the rollout engine's).

Masks are read as booleans: any nonzero entry is a valid position.  Masked
reductions select with ``torch.where`` rather than multiplying by the mask, so
an ``inf``/``nan`` at a masked position never leaks into the result (``0 *
inf`` would be ``nan``) and never produces a ``nan`` gradient.

The mismatch metrics follow NeMo-RL's ``ClippedPGLossFn``
(``nemo_rl/algorithms/loss_functions.py``), which logs them as
``gen_kl_error``, ``policy_kl_error``, ``js_divergence_error`` and
``token_mult_prob_error``; they measure how far the rollout engine (e.g. an FP8
vLLM) is from the trainer on the *same* weights.

Per-micro-batch loss metrics are 0-dim device tensors (no host sync in the
loss); :class:`nemo_fp8.utils.metrics.MetricAccumulator` combines them over
micro-batches and data-parallel ranks as :data:`LOSS_METRIC_REDUCTIONS` says and
moves them to the host once per step.
"""

from __future__ import annotations

import math

import torch

from nemo_fp8.algorithms.is_corrections import LOG_RATIO_CLAMP  # defined there: the IS corrections clamp with it too

__all__ = [
    "LOG_RATIO_CLAMP",
    "LOSS_METRIC_REDUCTIONS",
    "masked_sum",
    "masked_mean",
    "mismatch_metrics",
]


def _check_mask(x: torch.Tensor, mask: torch.Tensor, x_name: str = "x") -> torch.Tensor:
    """Return ``mask`` as a bool tensor broadcast to ``x.shape``; raise on mismatch."""
    if not isinstance(x, torch.Tensor) or not isinstance(mask, torch.Tensor):
        raise TypeError(f"{x_name} and mask must be torch.Tensor, got {type(x)} and {type(mask)}")
    try:
        shape = torch.broadcast_shapes(x.shape, mask.shape)
    except RuntimeError as e:
        raise ValueError(
            f"mask shape {tuple(mask.shape)} does not broadcast to {x_name} shape {tuple(x.shape)}"
        ) from e
    if shape != x.shape:
        raise ValueError(
            f"mask shape {tuple(mask.shape)} broadcasts {x_name} shape {tuple(x.shape)} "
            f"up to {tuple(shape)}; the mask may not add dimensions"
        )
    return (mask != 0).expand(x.shape)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over positions where ``mask`` is nonzero.

    Args:
        x: any shape, floating point.
        mask: same shape as ``x`` (or broadcastable to it without adding
            dimensions); bool or float, nonzero = keep.
        dim: dimension to reduce; ``None`` reduces everything to a scalar.

    Returns:
        ``x``'s dtype; scalar when ``dim is None`` else ``x.shape`` without
        ``dim``. An all-zero mask gives ``0``. Differentiable w.r.t. ``x``
        (masked positions get gradient exactly 0, even if they hold inf/nan).
    """
    m = _check_mask(x, mask)
    selected = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
    if dim is None:
        return selected.sum()
    return selected.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is nonzero.

    Args:
        x: any shape, floating point.
        mask: same shape as ``x`` (or broadcastable without adding dims);
            bool or float, nonzero = keep (mask values are not used as weights).
        dim: dimension to reduce; ``None`` reduces everything to a scalar.

    Returns:
        ``x``'s dtype; scalar when ``dim is None`` else ``x.shape`` without
        ``dim``. Where the mask selects nothing the result is exactly ``0``
        (never NaN), with zero gradient.
    """
    m = _check_mask(x, mask)
    total = masked_sum(x, m, dim=dim)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return total / count.clamp(min=1).to(total.dtype)


def _check_same_shape(**tensors: torch.Tensor) -> None:
    items = list(tensors.items())
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t)}")
    first_name, first = items[0]
    if first.dim() != 2:
        raise ValueError(f"{first_name} must be [B, T], got shape {tuple(first.shape)}")
    for name, t in items[1:]:
        if t.shape != first.shape:
            raise ValueError(
                f"{name} shape {tuple(t.shape)} does not match {first_name} shape {tuple(first.shape)}"
            )


@torch.no_grad()
def mismatch_metrics(
    prev_logprobs: torch.Tensor,
    generation_logprobs: torch.Tensor,
    token_mask: torch.Tensor,
) -> dict[str, float]:
    """Training-vs-rollout log-prob mismatch metrics over valid tokens.

    Samples (the response tokens) are drawn from the rollout engine ``gen``;
    ``train`` is the trainer's distribution at the same weights. With
    ``log r = clamp(prev - gen, -20, 20)`` per token (``LOG_RATIO_CLAMP``) and
    ``r = exp(log r)``; all means below are over valid tokens (pooled across
    the batch, each token counts once) unless stated otherwise:

    * ``gen_kl_error``: k3 estimator (Schulman 2020, "Approximating KL
      divergence") of KL(gen || train): ``mean(r - 1 - log r)``. Same as NeMo-RL
      (``calculate_kl(logprobs=gen, logprobs_reference=prev)``, k3).
    * ``policy_kl_error``: NeMo-RL's definition, i.e. k3 with the ratio the
      other way round: ``mean(1/r - 1 + log r)`` (``calculate_kl(logprobs=prev,
      logprobs_reference=gen)``). Note the samples come from gen, not train,
      so this is a symmetric-ish mismatch score rather than an unbiased
      estimate of KL(train || gen).
    * ``policy_kl_error_is``: the importance-weighted, unbiased estimate of
      KL(train || gen) from gen samples: ``mean(r * log r)``
      (``E_gen[r log r] = E_train[log r]``). Can be negative on a finite batch.
    * ``js_divergence_error``: NeMo-RL's per-token surrogate for the
      Jensen-Shannon divergence. With ``log m = log(0.5 e^prev + 0.5 e^gen)``
      and ``k3(a) = e^a - a - 1``: ``mean(0.5 k3(prev - log m) + 0.5 k3(gen -
      log m))``. ``log m`` is computed with ``logaddexp`` (stable).
    * ``token_mult_prob_error``: ``mean(exp(|gen - prev|))`` pooled over all
      valid tokens (NeMo-RL averages over all tokens of the micro-batch, not
      per sequence first). 1.0 means a perfect match.
    * ``log_ppl_diff``: ``mean_seq(mean_t gen) - mean_seq(mean_t prev)``,
      i.e. ``log_ppl(train) - log_ppl(gen)`` averaged over sequences with at
      least one valid token (each sequence counts once; the per-sequence
      log-perplexity is minus the token-mean log-prob). Positive means the
      trainer finds the sampled text less likely than the rollout engine did.
      Not in NeMo-RL's loss; defined here.
    * ``chi2_token``: ``mean((r - 1)^2)``, the per-token chi-square
      divergence estimate (variance of the token IS weight).
    * ``num_valid_tokens``: number of valid tokens (for weighting across
      micro-batches).

    Args:
        prev_logprobs: [B, T] float, trainer log-probs (detached internally).
        generation_logprobs: [B, T] float, rollout-engine log-probs.
        token_mask: [B, T] bool or float, nonzero = valid response token.

    Returns:
        dict of python floats; every metric is ``0.0`` when no token is valid.
        Values at masked positions (even inf/nan) do not affect the result.

    Raises:
        ValueError: on shape mismatch.
    """
    _check_same_shape(
        prev_logprobs=prev_logprobs,
        generation_logprobs=generation_logprobs,
        token_mask=token_mask,
    )
    valid = token_mask != 0
    zero = torch.zeros((), dtype=torch.float32, device=prev_logprobs.device)
    prev = torch.where(valid, prev_logprobs.detach().float(), zero)
    gen = torch.where(valid, generation_logprobs.detach().float(), zero)

    log_r = (prev - gen).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    r = torch.exp(log_r)

    gen_kl = r - 1.0 - log_r
    policy_kl = torch.exp(-log_r) - 1.0 + log_r
    policy_kl_is = r * log_r

    log_m = torch.logaddexp(prev, gen) - math.log(2.0)
    a_train = (prev - log_m).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    a_gen = (gen - log_m).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    js = 0.5 * (torch.exp(a_train) - a_train - 1.0) + 0.5 * (torch.exp(a_gen) - a_gen - 1.0)

    mult_prob = torch.exp(log_r.abs())
    chi2 = (r - 1.0).square()

    seq_valid = valid.any(dim=-1)
    seq_gen = masked_mean(gen, valid, dim=-1)
    seq_prev = masked_mean(prev, valid, dim=-1)
    log_ppl_diff = masked_mean(seq_gen - seq_prev, seq_valid)

    return {
        "gen_kl_error": masked_mean(gen_kl, valid).item(),
        "policy_kl_error": masked_mean(policy_kl, valid).item(),
        "policy_kl_error_is": masked_mean(policy_kl_is, valid).item(),
        "js_divergence_error": masked_mean(js, valid).item(),
        "token_mult_prob_error": masked_mean(mult_prob, valid).item(),
        "log_ppl_diff": log_ppl_diff.item(),
        "chi2_token": masked_mean(chi2, valid).item(),
        "num_valid_tokens": float(valid.sum().item()),
    }


# --------------------------------------------------------------------------- #
# how the loss's metrics combine (nemo_fp8.utils.metrics.MetricAccumulator)
# --------------------------------------------------------------------------- #

#: Every metric ``nemo_fp8.algorithms.loss.clipped_pg_loss`` returns -> its reduction kind.
LOSS_METRIC_REDUCTIONS: dict[str, str] = {
    "loss": "sum",
    "pg_loss": "sum",
    "kl_penalty": "sum",
    "num_valid_tokens": "sum",
    "num_valid_seqs": "sum",
    "clip_fraction": "token_mean",
    "dual_clip_fraction": "token_mean",
    "approx_kl": "token_mean",
    "ratio_mean": "token_mean",
    "ratio_min": "min",
    "ratio_max": "max",
    "is_weight_mean": "token_mean",
    "is_weight_min": "min",
    "is_weight_max": "max",
    "is_frac_tokens_truncated": "token_mean",
    "is_frac_tokens_masked": "token_mean",
    "is_frac_seqs_masked": "seq_mean",
}
