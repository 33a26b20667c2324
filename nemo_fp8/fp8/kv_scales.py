"""FP8 KV-cache (and attention) scales: per-layer q/k/v amax -> per-tensor e4m3 scales.

With ``kv_cache_dtype="fp8"`` the engine stores K and V (and, with FlashAttention 3 on Hopper,
also quantizes Q) as e4m3 with one static fp32 scale per layer and tensor, where
``x_fp8 = round(x / scale)`` and ``x ~= x_fp8 * scale``. vLLM computes such scales once, from
the first batch, and never again (``calculate_kv_scales``); in RL the weights change every step,
so the scales must follow them: the policy measures the amax of q, k and v (post-RoPE, post
q/k-norm, exactly what attention consumes) on the step's data, and the refit carries the
scales with the weights, tagged with the step they belong to.

Scale formula (per tensor current scaling, as TransformerEngine's ``Float8CurrentScaling``):
``scale = max(amax, eps) * margin / 448`` with ``margin >= 1`` head-room for values the
calibration batch did not see; ``margin = 1`` maps the observed amax exactly to e4m3's max.

Names follow vLLM's checkpoint format for FP8 attention scales:
``model.layers.{i}.self_attn.{q,k,v}_scale`` (fp32 scalars), which vLLM 0.22 loads into
``Attention._q_scale`` / ``_k_scale`` / ``_v_scale`` during a (layerwise) weight reload.
``fake_quantize_static`` is what the engine does to q, k and v with those scales; the torch
reference engine applies it in attention (``nemo_fp8.models.hf.fp8_kv_attention``) so CPU runs
see the same mismatch. Pure torch; imports no engine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor

from nemo_fp8.fp8.formats import E4M3, cast_to_fp8

KV_SCALE_NAME = "model.layers.{layer}.self_attn.{kind}_scale"
_KV_SCALE_RE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([qkv])_scale$")
AMAX_EPS = 1e-12  # an all-zero tensor still gets a positive scale


def fake_quantize_static(x: Tensor, scale: Tensor) -> Tensor:
    """``x`` through e4m3 with one static per-tensor scale and back: ``fp8(x / scale) * scale``.

    What an FP8 KV cache (and FlashAttention 3's FP8 q) does to attention inputs in vLLM:
    ``x / scale`` in fp32, saturated to +-448 and rounded to nearest even (vLLM's
    ``scaled_convert`` with ``__NV_SATFINITE``), dequantized with the same scale. Idempotent for
    a fixed scale, so re-quantizing cached values is harmless.

    Args:
        x: any float tensor (e.g. [B, H, T, D] keys), any device.
        scale: 0-dim or 1-element float32 tensor, > 0.

    Returns:
        Tensor of x's shape and dtype.
    """
    s = scale.to(device=x.device, dtype=torch.float32).reshape(())
    return (cast_to_fp8(x.float() / s).float() * s).to(x.dtype)


def is_kv_scale_name(name: str) -> bool:
    """True for ``model.layers.{i}.self_attn.{q,k,v}_scale``."""
    return _KV_SCALE_RE.match(name) is not None


def parse_kv_scale_name(name: str) -> tuple[int, str]:
    """``(layer index, 'q'|'k'|'v')`` of a KV-scale tensor name.

    Raises:
        ValueError: ``name`` is not of the form ``model.layers.{i}.self_attn.{q,k,v}_scale``.
    """
    m = _KV_SCALE_RE.match(name)
    if m is None:
        raise ValueError(f"{name!r} is not a KV scale name (model.layers.<i>.self_attn.<q|k|v>_scale)")
    return int(m.group(1)), m.group(2)


def calibration_rows(num_rows: int, max_samples: int | None) -> Tensor:
    """The rows of a step's batch that the KV calibration forward reads.

    All of them when ``max_samples`` is None or not smaller than ``num_rows``; else ``max_samples`` rows
    evenly spaced over the batch (row ``floor(i * num_rows / max_samples)``), so a batch laid out prompt
    group by prompt group keeps members of every group while ``max_samples`` >= the number of groups.
    NeMo-RL caps its calibration the same way (``calibrate_qkv_fp8_scales(max_calib_samples=256)``):
    a per-layer amax settles on far fewer tokens than a training batch holds.

    Args:
        num_rows: rows in the batch (>= 0).
        max_samples: the cap (>= 1), or None.

    Returns:
        [n] int64 row indices, strictly increasing, n = min(num_rows, max_samples).

    Raises:
        ValueError: ``max_samples`` < 1 or ``num_rows`` < 0.
    """
    if num_rows < 0 or (max_samples is not None and max_samples < 1):
        raise ValueError(f"calibration_rows: num_rows must be >= 0 and max_samples >= 1 or None, got {num_rows}, "
                         f"{max_samples}")
    if max_samples is None or max_samples >= num_rows:
        return torch.arange(num_rows)
    return torch.div(torch.arange(max_samples) * num_rows, max_samples, rounding_mode="floor")


@dataclass(frozen=True)
class KvScales:
    """Per-layer e4m3 scales of q, k and v for one policy version.

    Attributes:
        step: the GRPO step whose weights these scales were measured on (0: initial weights).
        q_scale, k_scale, v_scale: [num_layers] float32 (CPU), ``amax * margin / 448``.
        q_amax, k_amax, v_amax: [num_layers] float32, the measured amax (for metrics).
    """

    step: int
    q_scale: Tensor
    k_scale: Tensor
    v_scale: Tensor
    q_amax: Tensor
    k_amax: Tensor
    v_amax: Tensor

    @property
    def num_layers(self) -> int:
        return int(self.q_scale.numel())

    @classmethod
    def from_amax(cls, q_amax: Tensor, k_amax: Tensor, v_amax: Tensor, step: int, margin: float = 1.0) -> "KvScales":
        """Scales from per-layer amax ([num_layers] each): ``max(amax, eps) * margin / 448``.

        Raises:
            ValueError: shapes differ, an amax is negative or not finite, or ``margin < 1``.
        """
        if margin < 1.0:
            raise ValueError(f"margin must be >= 1 (head-room above the observed amax), got {margin}")
        amax = [torch.as_tensor(a, dtype=torch.float32).detach().cpu().reshape(-1) for a in (q_amax, k_amax, v_amax)]
        if not amax[0].shape == amax[1].shape == amax[2].shape:
            raise ValueError(f"q/k/v amax must have one value per layer each, got shapes "
                             f"{[tuple(a.shape) for a in amax]}")
        for kind, a in zip("qkv", amax):
            if not torch.isfinite(a).all() or (a < 0).any():
                raise ValueError(f"{kind}_amax must be finite and >= 0, got {a.tolist()}")
        q, k, v = (a.clamp(min=AMAX_EPS) * margin / E4M3.max for a in amax)
        return cls(step, q, k, v, *amax)

    def named_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """``(model.layers.{i}.self_attn.{q,k,v}_scale, 0-dim float32)`` for every layer."""
        for i in range(self.num_layers):
            for kind, t in (("q", self.q_scale), ("k", self.k_scale), ("v", self.v_scale)):
                yield KV_SCALE_NAME.format(layer=i, kind=kind), t[i].clone()

    def metrics(self) -> dict[str, float]:
        """The scales for logging (python floats): per layer and their range over layers.

        Keys: ``kv_scales/layer_{i}/{q,k,v}_scale`` for every layer ``i`` (what the refit sends,
        exactly), and ``kv_scales/{q,k,v}_scale_{min,max}`` over layers.
        """
        out = {}
        for kind, t in (("q", self.q_scale), ("k", self.k_scale), ("v", self.v_scale)):
            out[f"kv_scales/{kind}_scale_min"] = float(t.min())
            out[f"kv_scales/{kind}_scale_max"] = float(t.max())
        for i in range(self.num_layers):
            for kind, t in (("q", self.q_scale), ("k", self.k_scale), ("v", self.v_scale)):
                out[f"kv_scales/layer_{i}/{kind}_scale"] = float(t[i])
        return out
