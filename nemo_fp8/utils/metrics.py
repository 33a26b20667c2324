"""Combining per-micro-batch metric tensors over micro-batches and ranks, with no host sync.

Both policy backends accumulate their loss function's metrics (``LossFn.metric_reductions``, e.g.
``nemo_fp8.algorithms.metrics.LOSS_METRIC_REDUCTIONS``) with :class:`MetricAccumulator` and read them on the
host once per global batch.
"""

from __future__ import annotations

import math

import torch

__all__ = ["REDUCTION_KINDS", "MetricAccumulator"]

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
