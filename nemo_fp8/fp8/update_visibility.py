"""How much of a training update an FP8 rollout engine sees.

Between two refits the trainer changes a weight ``w0`` into ``w1``. A BF16 engine runs on ``w1``
rounded to bf16; a block-FP8 engine runs on ``Q(w1)``, the 128x128 block quantization of the same
weight (``quantize_weight_blockwise``, vLLM's own arithmetic). e4m3 keeps 3 mantissa bits against
bf16's 7, so its grid near a value is 16x coarser: an update much smaller than that spacing moves
the FP8 value of only the few elements that cross a rounding boundary, each by a whole grid step.
On average the FP8 view of the update is right (rounding is unbiased over many elements), but it
arrives with rounding noise of about ``sqrt(|update| * spacing)`` per element: part of the
quantization error is drawn afresh at every refit. This module measures that on real weights:
which fraction of the FP8 (and bf16) values an update changes, and how far the update the FP8
engine sees, ``Q(w1) - Q(w0)``, is from the update a bf16 engine sees, ``bf16(w1) - bf16(w0)``.

Pure torch, no engine: it runs on checkpoints on CPU (``tools/fp8_update_visibility.py``).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from nemo_fp8.fp8.formats import E4M3, Fp8Format
from nemo_fp8.fp8.quantize import dequantize_weight_blockwise, quantize_weight_blockwise
from nemo_fp8.fp8.scales import ScaleMode

STAT_KEYS = ("elements", "bf16_changed", "fp8_changed", "update_sq", "error_sq", "dot", "fp8_update_sq")


def update_visibility_sums(
    before: torch.Tensor,
    after: torch.Tensor,
    weight_block_size: Sequence[int] = (128, 128),
    fmt: Fp8Format = E4M3,
    scale_mode: ScaleMode = "fp32",
    name: str = "weight",
) -> dict[str, float]:
    """Sums over one weight's elements (add them across weights, then :func:`visibility_from_sums`).

    Args:
        before, after: [M, N] the same weight at two refits (bf16/fp16/fp32; each is rounded to bf16
            first, as the trainer sends bf16 weights).
        weight_block_size, fmt, scale_mode: the engine's block quantization (``quantize_weight_blockwise``).
        name: used in error messages.

    Returns:
        dict of floats: ``elements``; ``bf16_changed`` / ``fp8_changed`` (elements whose bf16 / dequantized
        FP8 value differs between the two); ``update_sq`` (sum of u^2, u = bf16(after) - bf16(before), the
        update a bf16 engine sees); ``fp8_update_sq`` (sum of v^2, v = Q(after) - Q(before) dequantized, the
        update the FP8 engine sees); ``error_sq`` (sum of (v - u)^2); ``dot`` (sum of u * v). All in fp64.

    Raises:
        ValueError: shapes differ or are not 2-D; NaN/Inf (from the quantizer).
    """
    if before.shape != after.shape or before.dim() != 2:
        raise ValueError(f"{name}: before {tuple(before.shape)} and after {tuple(after.shape)} must be the same 2-D "
                         "[out_features, in_features] shape")
    w0, w1 = before.to(torch.bfloat16), after.to(torch.bfloat16)

    def fp8_view(w: torch.Tensor) -> torch.Tensor:
        q, scale_inv = quantize_weight_blockwise(w, weight_block_size, fmt, scale_mode, name=name)
        return dequantize_weight_blockwise(q, scale_inv, weight_block_size, torch.float32).double()

    q0, q1 = fp8_view(w0), fp8_view(w1)
    u = w1.double() - w0.double()
    v = q1 - q0
    return {"elements": float(u.numel()), "bf16_changed": float((w1 != w0).sum()), "fp8_changed": float((q1 != q0).sum()),
            "update_sq": float((u * u).sum()), "fp8_update_sq": float((v * v).sum()),
            "error_sq": float(((v - u) ** 2).sum()), "dot": float((u * v).sum())}


def visibility_from_sums(s: dict[str, float]) -> dict[str, float]:
    """Ratios from (summed) :func:`update_visibility_sums`.

    Returns:
        dict: ``bf16_changed_frac`` / ``fp8_changed_frac`` (fractions of elements whose value moved);
        ``rel_error`` = ||v - u|| / ||u|| (the FP8 engine's view v of the update against the bf16 view u;
        0 = the same update, 1 = an error as large as the update); ``cosine`` = <u, v> / (||u|| ||v||);
        ``norm_ratio`` = ||v|| / ||u||. The last three are NaN when the update is zero.
    """
    n = s["elements"]
    un, vn = math.sqrt(s["update_sq"]), math.sqrt(s["fp8_update_sq"])
    nan = float("nan")
    return {"bf16_changed_frac": s["bf16_changed"] / n if n else nan,
            "fp8_changed_frac": s["fp8_changed"] / n if n else nan,
            "rel_error": math.sqrt(s["error_sq"]) / un if un > 0 else nan,
            "cosine": s["dot"] / (un * vn) if un > 0 and vn > 0 else nan,
            "norm_ratio": vn / un if un > 0 else nan}
