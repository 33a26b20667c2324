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
loss); :class:`MetricAccumulator` combines them over micro-batches and
data-parallel ranks as :data:`LOSS_METRIC_REDUCTIONS` says and moves them to
the host once per step.
"""

from __future__ import annotations

import math

import torch

from nemo_fp8.algorithms.is_corrections import LOG_RATIO_CLAMP  # defined there: the IS corrections clamp with it too

__all__ = [
    "LOG_RATIO_CLAMP",
    "REDUCTION_KINDS",
    "LOSS_METRIC_REDUCTIONS",
    "MetricAccumulator",
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
# combining per-micro-batch metrics without host syncs
# --------------------------------------------------------------------------- #

#: How a metric combines over micro-batches (and data-parallel ranks):
#:
#: * ``"sum"``: values add (loss terms already normalised by the global batch counts, counts).
#: * ``"token_mean"``: a mean over the micro-batch's valid tokens; combined weighted by its
#:   ``num_valid_tokens``, so the result is the mean over all valid tokens.
#: * ``"seq_mean"``: a mean over the micro-batch's sequences with >= 1 valid token; weighted by
#:   ``num_valid_seqs``.
#: * ``"min"`` / ``"max"``: over micro-batches that have >= 1 valid token (``num_valid_tokens``
#:   > 0); the 0 such a micro-batch reports when it has none is ignored.
REDUCTION_KINDS: tuple[str, ...] = ("sum", "token_mean", "seq_mean", "min", "max")

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

#: Weight (a count metric of the same micro-batch) of each weighted kind.
_WEIGHT_OF: dict[str, str] = {
    "token_mean": "num_valid_tokens",
    "seq_mean": "num_valid_seqs",
    "min": "num_valid_tokens",
    "max": "num_valid_tokens",
}


class MetricAccumulator:
    """Combine per-micro-batch metric tensors over micro-batches and ranks, with no host sync.

    State per metric: a float64 tensor ``[value, weight]`` on the device of the first
    :meth:`add` (``"sum"``: ``[sum, 0]``; means: ``[sum of value * w, sum of w]``; min/max:
    ``[running min/max, sum of w]``, +inf / -inf while no weight was added). Only :meth:`result` reads values
    on the host, all at once. Combining is exact up to float64 rounding, so any split of the
    micro-batches into accumulators, merged, gives the same result as one accumulator over
    all of them.

    Use one accumulator per reporting period (e.g. one optimizer step): ``add`` each
    micro-batch's metrics, ``cpu()`` (or not) and ``merge`` the data-parallel ranks' ones, then
    ``result()``. Picklable (a dict of names and a dict of tensors).

    Args:
        reductions: metric name -> one of :data:`REDUCTION_KINDS`, e.g.
            :data:`LOSS_METRIC_REDUCTIONS` (``ClippedPGLossFn.metric_reductions``).

    Raises:
        ValueError: an unknown reduction kind (naming the metric).
    """

    def __init__(self, reductions: dict[str, str]):
        for name, kind in reductions.items():
            if kind not in REDUCTION_KINDS:
                raise ValueError(f"reductions[{name!r}] = {kind!r}: must be one of {REDUCTION_KINDS}")
        self.reductions: dict[str, str] = dict(reductions)
        self._state: dict[str, torch.Tensor] = {}  # name -> [2] float64

    # -- state helpers (tensor ops only) ------------------------------------------------------ #

    def _device(self) -> torch.device | None:
        for t in self._state.values():
            return t.device
        return None

    @staticmethod
    def _combine(kind: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Combine two ``[value, weight]`` states of one metric (``b``'s weight 0: no effect)."""
        if kind == "min":
            return torch.stack([torch.minimum(a[0], b[0]), a[1] + b[1]])
        if kind == "max":
            return torch.stack([torch.maximum(a[0], b[0]), a[1] + b[1]])
        return a + b

    # -- public API ---------------------------------------------------------------------------- #

    def add(self, metrics: dict[str, torch.Tensor | float]) -> None:
        """Add one micro-batch's metrics (0-dim tensors, any device/float dtype, or numbers).

        No host sync: values are moved to the state's device and combined with tensor ops.
        The weights are ``metrics["num_valid_tokens"]`` / ``metrics["num_valid_seqs"]`` (the
        micro-batch's counts); a metric whose weight is 0 (an all-masked micro-batch) changes
        neither a mean nor a min/max, even if its value is nan/inf. Metrics of
        ``reductions`` missing from ``metrics`` are left unchanged.

        Raises:
            ValueError: a name not in ``reductions``, a non-scalar value, or a weighted
                metric without its weight key in ``metrics``.
        """
        unknown = [k for k in metrics if k not in self.reductions]
        if unknown:
            raise ValueError(f"metrics {unknown} have no reduction (known: {sorted(self.reductions)})")
        device = self._device()
        if device is None:
            first = next((v for v in metrics.values() if isinstance(v, torch.Tensor)), None)
            device = first.device if first is not None else torch.device("cpu")

        def scalar(name: str) -> torch.Tensor:
            v = metrics[name]
            if isinstance(v, torch.Tensor):
                if v.numel() != 1:
                    raise ValueError(f"metric {name!r} must be a scalar, got shape {tuple(v.shape)}")
                v = v.detach().reshape(())
            return torch.as_tensor(v, dtype=torch.float64, device=device)

        weights: dict[str, torch.Tensor] = {}
        for name in metrics:
            kind = self.reductions[name]
            if kind == "sum":
                contrib = torch.stack([scalar(name), torch.zeros((), dtype=torch.float64, device=device)])
            else:
                wkey = _WEIGHT_OF[kind]
                if wkey not in metrics:
                    raise ValueError(f"metric {name!r} ({kind}) needs {wkey!r} in the same metrics dict")
                if wkey not in weights:
                    weights[wkey] = scalar(wkey)
                w = weights[wkey]
                has = w > 0
                v = scalar(name)
                if kind in ("min", "max"):
                    sentinel = math.inf if kind == "min" else -math.inf
                    contrib = torch.stack([torch.where(has, v, torch.full_like(v, sentinel)), w])
                else:
                    contrib = torch.stack([torch.where(has, v * w, torch.zeros_like(v)), w])
            old = self._state.get(name)  # min/max with weight 0 hold their +-inf sentinel
            self._state[name] = contrib if old is None else self._combine(kind, old, contrib)

    def merge(self, other: "MetricAccumulator") -> "MetricAccumulator":
        """A new accumulator holding both ``self``'s and ``other``'s data (neither is changed).

        For data-parallel ranks: gather the ranks' accumulators (``.cpu()`` first if they
        travel by pickle) and fold them with ``merge``. The result lives on ``self``'s device
        (``other``'s states are copied there).

        Raises:
            ValueError: the two accumulators have different ``reductions``.
        """
        if other.reductions != self.reductions:
            raise ValueError("cannot merge MetricAccumulators with different reductions")
        out = MetricAccumulator(self.reductions)
        device = self._device() or other._device()
        for name in self.reductions:
            a, b = self._state.get(name), other._state.get(name)
            if a is None and b is None:
                continue
            if a is None:
                out._state[name] = b.to(device)
            elif b is None:
                out._state[name] = a.clone()
            else:
                out._state[name] = self._combine(self.reductions[name], a, b.to(device))
        return out

    def to(self, device: torch.device | str) -> "MetricAccumulator":
        """A copy with every state on ``device``."""
        out = MetricAccumulator(self.reductions)
        if self._state:  # one stacked copy for all metrics: one transfer, not one per metric
            moved = torch.stack(list(self._state.values())).to(device)
            out._state = dict(zip(self._state, moved.unbind()))
        return out

    def cpu(self) -> "MetricAccumulator":
        """A copy with every state on the CPU (one device->host copy for all metrics)."""
        return self.to("cpu")

    def result(self) -> dict[str, float]:
        """The combined metrics as python floats, read with ONE host transfer.

        Only metrics that were added at least once (here or in a merged accumulator) are
        returned, in ``reductions`` order. ``"sum"``: the sum; means: weighted sum / total
        weight, 0.0 when the total weight is 0; min/max: 0.0 when no micro-batch with weight
        > 0 was added.
        """
        names = [n for n in self.reductions if n in self._state]
        if not names:
            return {}
        values = []
        for name in names:
            kind, st = self.reductions[name], self._state[name]
            value, weight = st[0], st[1]
            if kind == "sum":
                values.append(value)
            else:
                has = weight > 0
                if kind in ("min", "max"):
                    values.append(torch.where(has, value, torch.zeros_like(value)))
                else:
                    values.append(torch.where(has, value / torch.where(has, weight, torch.ones_like(weight)),
                                              torch.zeros_like(value)))
        return dict(zip(names, torch.stack(values).tolist()))

    def __repr__(self) -> str:
        return f"MetricAccumulator({len(self._state)} metrics, reductions={len(self.reductions)})"
