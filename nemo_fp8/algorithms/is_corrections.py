"""Off-policy importance-sampling (IS) corrections, registered by name (``loss_fn.truncated_importance_sampling_type``).

The rollout engine (the behaviour policy, e.g. an FP8 vLLM) and the trainer give the same tokens different
log-probs (other kernels, FP8 quantisation, ...). A correction turns the per-token log-ratio ``log r_t =
prev_t - gen_t`` (trainer before the update minus rollout engine) into the weights that scale each token's
policy-gradient loss. Each correction is one short function registered with :func:`register_is_correction`
(verl's ``register_policy_loss`` idea); the config's valid names are this registry's keys
(``nemo_fp8.algorithms.config.TRUNCATED_IS_TYPES``), so a new correction is one decorated function here.

Every correction is called by :func:`nemo_fp8.algorithms.loss.importance_sampling_weights` as
``fn(r, log_r, valid, lo, hi) -> (weights, truncated, masked)`` with

* ``log_r``: ``[B, T]`` float32, ``clamp(prev - gen, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)``, exactly 0 at
  masked positions; ``r = exp(log_r)``, ``[B, T]`` float32;
* ``valid``: ``[B, T]`` bool, the response tokens that count;
* ``lo`` / ``hi``: ``truncated_importance_sampling_ratio_min`` / ``truncated_importance_sampling_ratio``
  (floats > 0, or None where the correction allows no bound);

and returns ``weights`` (float32, ``[B, T]`` or broadcastable to it), ``truncated`` and ``masked`` (bool,
broadcastable to ``[B, T]``: tokens whose weight was clamped, tokens whose weight was zeroed). The caller
zeroes masked positions and reduces the statistics. No correction reads a tensor value on the host.

Sources: TIS, Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training",
bounds as NeMo-RL's ``tis``; IcePop token masking, Ling team 2025 (Ring-1T / "IcePop"); the sequence-level variants as NeMo-RL's ``seq-mask-tis`` and
``sequence_level_importance_ratios`` (``nemo_rl/algorithms/loss_functions.py``), after "When Speed Kills
Stability: Demystifying RL Collapse from the Training-Inference Mismatch" (Yao, Liu et al. 2025).

Torch only and no other package module: the config schema reads the registry's names (this module sits in the
import graph's foundation layer, as ``nemo_fp8.policy.packing`` does for the packing algorithms).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

__all__ = ["LOG_RATIO_CLAMP", "ISCorrection", "IS_CORRECTIONS", "register_is_correction"]

#: Log-ratios are clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` before ``exp`` in metrics and importance
#: weights (``exp(20) ~ 4.9e8``, finite in float32), so one badly mismatched token cannot turn a mean into ``inf``.
LOG_RATIO_CLAMP: float = 20.0

CorrectionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[float], Optional[float]],
                        tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class ISCorrection:
    """One registered correction.

    Attributes:
        name: its ``truncated_importance_sampling_type``.
        fn: ``(r, log_r, valid, lo, hi) -> (weights, truncated, masked)`` (module docstring).
        window: True: a keep-window around 1, both bounds required with ``lo < 1 < hi`` (tokens or sequences
            outside are masked); False: optional clamp bounds with ``lo <= hi``.
    """

    name: str
    fn: CorrectionFn
    window: bool


#: name -> :class:`ISCorrection`, in registration order (the order the config lists them in).
IS_CORRECTIONS: dict[str, ISCorrection] = {}


def register_is_correction(name: str, *, window: bool) -> Callable[[CorrectionFn], CorrectionFn]:
    """Decorator: register ``fn`` as the IS correction ``name`` (see :class:`ISCorrection` for ``window``).

    Raises:
        ValueError: ``name`` already registered.
    """

    def add(fn: CorrectionFn) -> CorrectionFn:
        if name in IS_CORRECTIONS:
            raise ValueError(f"IS correction {name!r} is already registered ({IS_CORRECTIONS[name].fn.__qualname__})")
        IS_CORRECTIONS[name] = ISCorrection(name, fn, window)
        return fn

    return add


def _clamp_bounds(raw: torch.Tensor, lo: Optional[float], hi: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(clamp(raw, lo, hi), raw outside [lo, hi])``; a None bound does not clamp (NeMo-RL's ``is_oob_ratio``)."""
    out_of_bounds = torch.zeros_like(raw, dtype=torch.bool)
    if hi is not None:
        out_of_bounds = out_of_bounds | (raw > hi)
    if lo is not None:
        out_of_bounds = out_of_bounds | (raw < lo)
    clamped = raw.clamp(min=lo, max=hi) if (lo is not None or hi is not None) else raw
    return clamped, out_of_bounds


@register_is_correction("tis", window=False)
def tis(r: torch.Tensor, log_r: torch.Tensor, valid: torch.Tensor, lo: Optional[float], hi: Optional[float]):
    """Token-level truncated IS (Yao et al. 2025; bounds as NeMo-RL's ``tis``): ``w_t = clamp(r_t, lo, hi)``.

    ``lo = None``: no lower bound (NeMo-RL: 0); ``hi = None``: no upper bound. Truncated: ``r_t`` outside
    ``[lo, hi]``. Nothing is masked. Shapes: ``[B, T]`` in, ``[B, T]`` out.
    """
    weights, truncated = _clamp_bounds(r, lo, hi)
    return weights, truncated, torch.zeros_like(valid)


@register_is_correction("icepop", window=True)
def icepop(r: torch.Tensor, log_r: torch.Tensor, valid: torch.Tensor, lo: Optional[float], hi: Optional[float]):
    """IcePop token masking (Ling team 2025): ``w_t = r_t`` if ``lo <= r_t <= hi`` else 0 (the token is masked).

    Shapes: ``[B, T]`` in, ``[B, T]`` out.
    """
    keep = (r >= lo) & (r <= hi)
    return torch.where(keep, r, torch.zeros_like(r)), torch.zeros_like(valid), ~keep


@register_is_correction("seq-mask-tis", window=True)
def seq_mask_tis(r: torch.Tensor, log_r: torch.Tensor, valid: torch.Tensor, lo: Optional[float],
                 hi: Optional[float]):
    """Sequence-level masked IS (NeMo-RL's ``seq-mask-tis``; Yao, Liu et al. 2025).

    Per sequence the geometric-mean ratio ``g = exp(mean_t log r_t)`` over its valid tokens ([B]); a sequence
    with ``g`` outside ``[lo, hi]`` gets weight 0 on all its tokens (masked); a kept sequence keeps the raw,
    **non-truncated** token weights ``w_t = r_t`` (as NeMo-RL: ``hi`` bounds ``g``, typically ~1.002, so it is
    not reused as a token cap). Shapes: ``[B, T]`` in; weights ``[B, T]``, masked ``[B, T]``.
    """
    seq_sum = torch.where(valid, log_r, torch.zeros((), dtype=log_r.dtype, device=log_r.device)).sum(dim=-1)
    g = torch.exp(seq_sum / valid.sum(dim=-1).clamp(min=1).to(seq_sum.dtype))  # [B]; 1 for an empty row
    keep_seq = (g >= lo) & (g <= hi)
    return r * keep_seq.unsqueeze(-1).float(), torch.zeros_like(valid), (~keep_seq).unsqueeze(-1).expand_as(valid)


@register_is_correction("seq-tis", window=False)
def seq_tis(r: torch.Tensor, log_r: torch.Tensor, valid: torch.Tensor, lo: Optional[float], hi: Optional[float]):
    """Sequence-level truncated IS: one weight per sequence, ``w = clamp(exp(clamp(sum_t log r_t, -20, 20)), lo,
    hi)``, broadcast to its tokens.

    The sequence-level IS weight of NeMo-RL's ``sequence_level_importance_ratios``, clamped to ``[lo, hi]`` by the
    same ``tis`` rule (None: no bound). Truncated: every token of a clamped sequence. Shapes: ``[B, T]`` in;
    weights and truncated ``[B, T]`` (expanded views of ``[B, 1]``).
    """
    seq_log_r = torch.where(valid, log_r, torch.zeros_like(log_r)).sum(dim=-1)
    raw = torch.exp(seq_log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).unsqueeze(-1)  # [B, 1]
    weights, truncated = _clamp_bounds(raw, lo, hi)
    return weights.expand_as(r), truncated.expand_as(valid), torch.zeros_like(valid)
