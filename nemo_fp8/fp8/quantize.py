"""Scaled FP8 quantization at tensor, channel, 1xG group and 2-D block granularity.

Convention (vLLM / DeepSeek-V3 checkpoints / TransformerEngine): every quantized
tensor `q` (fp8) comes with a float32 `scale_inv`, and

    dequant = q.float() * scale_inv          (broadcast over the scaled region)
    q       = saturate_cast(x / scale_inv)   (round to nearest, clamp to +-fmt.max)

The scale of a region is computed from its current amax ("current scaling"):

    fp32 mode: scale_inv = amax / fmt.max
               (vLLM `per_token_group_quant_fp8`, TE `Float8CurrentScaling`)
    pow2 mode: scale_inv = 2 ** ceil(log2(amax / fmt.max))
               (TE `Float8BlockScaling` default "power_2_scale"; DeepGEMM UE8M0
               scales). Dividing by a power of two is exact, so the only error is
               the fp8 rounding of the mantissa, and nothing saturates.

Granularities (DeepSeek-V3 technical report, arXiv:2412.19437, Sec. 3.3.1):
  - weights: 128x128 blocks  -> scale_inv [ceil(M/128), ceil(N/128)]
  - activations: 1x128 groups along the last (contraction) dim
                             -> scale_inv [..., ceil(K/128)]
  - per tensor: one scale (TE Float8CurrentScaling); per channel: one scale per row.

Shapes that are not multiples of the block size are zero-padded for the amax and
cropped afterwards; zero padding never changes an amax. A region whose amax is 0
gets scale_inv = 1 (its fp8 values are all zero).

All math is done in float32 regardless of the input dtype.
"""

import math
from typing import Literal, Sequence

import torch
import torch.nn.functional as F

from nemo_fp8.fp8.formats import E4M3, FP8_DTYPES, Fp8Format, cast_to_fp8

ScaleMode = Literal["fp32", "pow2"]
Granularity = Literal["tensor", "channel", "group", "block"]

SCALE_MODES = ("fp32", "pow2")
GRANULARITIES = ("tensor", "channel", "group", "block")


# ----------------------------------------------------------------------------- checks


def check_finite(x: torch.Tensor, name: str) -> None:
    """Raise if `x` holds NaN or Inf.

    Args:
        x: any tensor.
        name: the tensor's name, used in the error message.

    Raises:
        ValueError: "<name> has <n> NaN and <m> Inf values ..." when x is not finite.

    Note: this reads a value back from the device (one sync on CUDA).
    """
    if not x.is_floating_point():
        return
    if x.dtype in FP8_DTYPES:
        x = x.float()
    if bool(torch.isfinite(x).all()):
        return
    num_nan = int(torch.isnan(x).sum())
    num_inf = int(torch.isinf(x).sum())
    raise ValueError(
        f"{name} has {num_nan} NaN and {num_inf} Inf values "
        f"(shape {tuple(x.shape)}, dtype {x.dtype}); cannot compute FP8 scales"
    )


def _check_scale_mode(scale_mode: str) -> None:
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")


def _check_high_precision(x: torch.Tensor, name: str) -> None:
    if not x.is_floating_point() or x.dtype in FP8_DTYPES:
        raise ValueError(f"{name} must be a bf16/fp16/fp32 tensor, got dtype {x.dtype}")


def _check_positive_int(value: int, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{key} must be a positive int, got {value!r}")
    return value


def _block_size(weight_block_size: Sequence[int]) -> tuple[int, int]:
    if len(weight_block_size) != 2:
        raise ValueError(f"weight_block_size must be [rows, cols], got {weight_block_size!r}")
    bm = _check_positive_int(int(weight_block_size[0]), "weight_block_size[0]")
    bn = _check_positive_int(int(weight_block_size[1]), "weight_block_size[1]")
    return bm, bn


def _pad_to_multiple(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """Zero-pad `x` along `dim` to a multiple of `multiple`."""
    pad = (-x.shape[dim]) % multiple
    if pad == 0:
        return x
    dim = dim % x.dim()
    pad_spec = [0, 0] * (x.dim() - 1 - dim) + [0, pad]  # F.pad lists dims last-first
    return F.pad(x, pad_spec)


# ----------------------------------------------------------------------------- scales


def compute_scale_inv(
    amax: torch.Tensor, fmt: Fp8Format = E4M3, scale_mode: ScaleMode = "fp32"
) -> torch.Tensor:
    """Dequantization scales from absolute maxima.

    fp32 mode: scale_inv = amax / fmt.max (vLLM fp8_utils, TE Float8CurrentScaling).
    pow2 mode: scale_inv = 2 ** ceil(log2(amax / fmt.max)), the smallest power of two
        with amax / scale_inv <= fmt.max (TE Float8BlockScaling power_2_scale,
        DeepGEMM UE8M0). Computed exactly with frexp, so no float log2 rounding can
        make a value saturate.
    amax == 0 gives 1.0. Results are clamped below at the smallest normal fp32
    (2^-126) so x / scale_inv can never divide by zero.

    Args:
        amax: float tensor of non-negative absolute maxima, any shape.
        fmt: target FP8 format.
        scale_mode: "fp32" or "pow2".

    Returns:
        float32 tensor, same shape as amax.

    Raises:
        ValueError: on an unknown scale_mode.
    """
    _check_scale_mode(scale_mode)
    amax = amax.float()
    tiny = torch.finfo(torch.float32).tiny  # 2^-126, a power of two
    if scale_mode == "fp32":
        # divide by a tensor, not a Python float: CUDA turns division by a scalar into
        # multiplication by its reciprocal, which can differ from CPU by one ulp
        scale_inv = amax / amax.new_full((), fmt.max)
    else:
        # amax = m * 2^e with m in [0.5, 1); fmt.max = mm * 2^ee with mm in [0.5, 1).
        # amax / 2^k <= fmt.max  <=>  k >= e - ee (if m <= mm) else e - ee + 1.
        mm, ee = math.frexp(fmt.max)
        m, e = torch.frexp(amax)
        k = e - ee + (m > mm).to(e.dtype)
        scale_inv = torch.ldexp(torch.ones_like(amax), k)
    scale_inv = scale_inv.clamp_min(tiny)
    return torch.where(amax > 0, scale_inv, torch.ones_like(scale_inv))


def _quantize_last_dim_groups(
    x: torch.Tensor, group_size: int, fmt: Fp8Format, scale_mode: ScaleMode
) -> tuple[torch.Tensor, torch.Tensor]:
    """1 x group_size quantization along the last dim, no input validation."""
    K = x.shape[-1]
    xp = _pad_to_multiple(x.float(), -1, group_size)  # [..., Kp]
    xg = xp.unflatten(-1, (-1, group_size))  # [..., G, group_size]
    amax = xg.abs().amax(dim=-1)  # [..., G]
    scale_inv = compute_scale_inv(amax, fmt, scale_mode)  # [..., G]
    q = cast_to_fp8(xg / scale_inv.unsqueeze(-1), fmt)  # [..., G, group_size]
    q = q.flatten(-2)[..., :K].contiguous()  # [..., K]
    return q, scale_inv


def _quantize_2d_blocks(
    x: torch.Tensor, bm: int, bn: int, fmt: Fp8Format, scale_mode: ScaleMode
) -> tuple[torch.Tensor, torch.Tensor]:
    """bm x bn block quantization of a 2-D tensor, no input validation."""
    M, N = x.shape
    xp = _pad_to_multiple(_pad_to_multiple(x.float(), 0, bm), 1, bn)  # [Mp, Np]
    Mb, Nb = xp.shape[0] // bm, xp.shape[1] // bn
    xb = xp.view(Mb, bm, Nb, bn)  # [Mb, bm, Nb, bn]
    amax = xb.abs().amax(dim=(1, 3))  # [Mb, Nb]
    scale_inv = compute_scale_inv(amax, fmt, scale_mode)  # [Mb, Nb]
    q = cast_to_fp8(xb / scale_inv[:, None, :, None], fmt)  # [Mb, bm, Nb, bn]
    q = q.view(Mb * bm, Nb * bn)[:M, :N].contiguous()  # [M, N]
    return q, scale_inv


def _quantize_rows(
    x: torch.Tensor, fmt: Fp8Format, scale_mode: ScaleMode, per_row: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor (per_row=False, scale []) or per-row (scale [..., 1]) quantization."""
    xf = x.float()
    if xf.numel() == 0:
        amax = xf.new_zeros((*xf.shape[:-1], 1) if per_row else ())
    elif per_row:
        amax = xf.abs().amax(dim=-1, keepdim=True)  # [..., 1]
    else:
        amax = xf.abs().amax()  # []
    scale_inv = compute_scale_inv(amax, fmt, scale_mode)
    return cast_to_fp8(xf / scale_inv, fmt), scale_inv


# ----------------------------------------------------------------------------- weights


def quantize_weight_blockwise(
    weight: torch.Tensor,
    weight_block_size: Sequence[int] = (128, 128),
    fmt: Fp8Format = E4M3,
    scale_mode: ScaleMode = "fp32",
    name: str = "weight",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight in [bm, bn] blocks (DeepSeek-V3 128x128 weight blocks).

    This is the layout of vLLM's block-scaled FP8 checkpoints
    (`quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}`):
    qweight has the weight's shape and weight_scale_inv[i, j] scales the block
    weight[i*bm:(i+1)*bm, j*bn:(j+1)*bn].

    Args:
        weight: [M, N] bf16/fp16/fp32 (M = out_features, N = in_features).
        weight_block_size: (bm, bn) block shape.
        fmt: FP8 format of the result.
        scale_mode: "fp32" (amax / fmt.max) or "pow2" (power-of-two scales).
        name: used in error messages.

    Returns:
        qweight: [M, N] fmt.dtype.
        scale_inv: [ceil(M/bm), ceil(N/bn)] float32.

    Raises:
        ValueError: weight is not 2-D / not a high-precision float tensor, bad
            weight_block_size or scale_mode, or weight has NaN/Inf (names `name`).
    """
    _check_scale_mode(scale_mode)
    bm, bn = _block_size(weight_block_size)
    if weight.dim() != 2:
        raise ValueError(f"{name} must be 2-D [M, N], got shape {tuple(weight.shape)}")
    _check_high_precision(weight, name)
    check_finite(weight, name)

    return _quantize_2d_blocks(weight, bm, bn, fmt, scale_mode)


def dequantize_weight_blockwise(
    qweight: torch.Tensor,
    scale_inv: torch.Tensor,
    weight_block_size: Sequence[int] = (128, 128),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of quantize_weight_blockwise: qweight * scale_inv of its block.

    Args:
        qweight: [M, N] fp8.
        scale_inv: [ceil(M/bm), ceil(N/bn)] float32.
        weight_block_size: (bm, bn).
        dtype: output dtype.

    Returns:
        [M, N] tensor of `dtype` (product computed in float32).

    Raises:
        ValueError: if scale_inv's shape does not match the blocks of qweight.
    """
    bm, bn = _block_size(weight_block_size)
    if qweight.dim() != 2:
        raise ValueError(f"qweight must be 2-D [M, N], got shape {tuple(qweight.shape)}")
    M, N = qweight.shape
    expected = (math.ceil(M / bm), math.ceil(N / bn))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv shape {tuple(scale_inv.shape)} does not match qweight {(M, N)} "
            f"with weight_block_size {(bm, bn)}; expected {expected}"
        )
    Mb, Nb = expected
    qp = _pad_to_multiple(_pad_to_multiple(qweight.float(), 0, bm), 1, bn)  # [Mp, Np]
    out = qp.view(Mb, bm, Nb, bn) * scale_inv.float()[:, None, :, None]  # [Mb, bm, Nb, bn]
    return out.view(Mb * bm, Nb * bn)[:M, :N].to(dtype)


# ----------------------------------------------------------------------------- activations


def quantize_activation_per_group(
    x: torch.Tensor,
    group_size: int = 128,
    fmt: Fp8Format = E4M3,
    scale_mode: ScaleMode = "fp32",
    name: str = "activation",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize in 1 x group_size groups along the last dim (DeepSeek-V3 1x128 tiles).

    Numerics of vLLM `per_token_group_quant_fp8` (fp8_utils.py) and TE's 1-D block
    quantizer (Float8BlockScaling with block_scaling_dim=1), without vLLM's eps clamp:
    an all-zero group gets scale_inv = 1.

    Args:
        x: [..., K] bf16/fp16/fp32, at least 1-D.
        group_size: elements per group along K.
        fmt: FP8 format.
        scale_mode: "fp32" or "pow2".
        name: used in error messages.

    Returns:
        q: [..., K] fmt.dtype.
        scale_inv: [..., ceil(K/group_size)] float32.

    Raises:
        ValueError: 0-dim input, non-float input, bad group_size/scale_mode, NaN/Inf.
    """
    _check_scale_mode(scale_mode)
    _check_positive_int(group_size, "group_size")
    if x.dim() < 1:
        raise ValueError(f"{name} must have at least one dim [..., K], got a 0-dim tensor")
    _check_high_precision(x, name)
    check_finite(x, name)
    return _quantize_last_dim_groups(x, group_size, fmt, scale_mode)


def dequantize_activation_per_group(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    group_size: int = 128,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of quantize_activation_per_group.

    Args:
        q: [..., K] fp8.
        scale_inv: [..., ceil(K/group_size)] float32.
        group_size: elements per group.
        dtype: output dtype.

    Returns:
        [..., K] tensor of `dtype`.

    Raises:
        ValueError: if scale_inv's shape does not match q.
    """
    _check_positive_int(group_size, "group_size")
    K = q.shape[-1]
    expected = (*q.shape[:-1], math.ceil(K / group_size))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv shape {tuple(scale_inv.shape)} does not match q {tuple(q.shape)} "
            f"with group_size {group_size}; expected {expected}"
        )
    qg = _pad_to_multiple(q.float(), -1, group_size).unflatten(-1, (-1, group_size))  # [..., G, group_size]
    return (qg * scale_inv.float().unsqueeze(-1)).flatten(-2)[..., :K].to(dtype)  # [..., K]


# ----------------------------------------------------------------------------- tensor / channel


def quantize_per_tensor(
    x: torch.Tensor,
    fmt: Fp8Format = E4M3,
    scale_mode: ScaleMode = "fp32",
    name: str = "tensor",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for the whole tensor, from its current amax (TE Float8CurrentScaling).

    Args:
        x: any shape, bf16/fp16/fp32.
        fmt, scale_mode, name: as in quantize_weight_blockwise.

    Returns:
        q: x.shape, fmt.dtype.
        scale_inv: 0-dim float32.

    Raises:
        ValueError: non-float input, bad scale_mode, NaN/Inf.
    """
    _check_scale_mode(scale_mode)
    _check_high_precision(x, name)
    check_finite(x, name)
    return _quantize_rows(x, fmt, scale_mode, per_row=False)


def quantize_per_channel(
    x: torch.Tensor,
    fmt: Fp8Format = E4M3,
    scale_mode: ScaleMode = "fp32",
    name: str = "tensor",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row: per output channel for a weight [N, K], per token for x [M, K].

    Args:
        x: [M, N] (or [..., N]: one scale per index of the leading dims), bf16/fp16/fp32.
        fmt, scale_mode, name: as in quantize_weight_blockwise.

    Returns:
        q: x.shape, fmt.dtype.
        scale_inv: [M, 1] (generally [..., 1]) float32.

    Raises:
        ValueError: 0-dim input, non-float input, bad scale_mode, NaN/Inf.
    """
    _check_scale_mode(scale_mode)
    if x.dim() < 1:
        raise ValueError(f"{name} must have at least one dim, got a 0-dim tensor")
    _check_high_precision(x, name)
    check_finite(x, name)
    return _quantize_rows(x, fmt, scale_mode, per_row=True)


def dequantize(
    q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Generic dequantization q.float() * scale_inv with broadcasting.

    Works for per-tensor (0-dim scale) and per-channel ([M, 1] scale) results. Group
    and block scales do not broadcast; use dequantize_activation_per_group /
    dequantize_weight_blockwise for those.

    Args:
        q: fp8 tensor, any shape.
        scale_inv: float32, broadcastable to q.shape.
        dtype: output dtype.

    Returns:
        q.shape tensor of `dtype`.

    Raises:
        ValueError: if scale_inv does not broadcast to q.shape.
    """
    try:
        shape = torch.broadcast_shapes(q.shape, scale_inv.shape)
    except RuntimeError as err:
        raise ValueError(
            f"scale_inv shape {tuple(scale_inv.shape)} does not broadcast to q {tuple(q.shape)}"
        ) from err
    if shape != q.shape:
        raise ValueError(
            f"scale_inv shape {tuple(scale_inv.shape)} would broadcast q {tuple(q.shape)} "
            f"to {tuple(shape)}"
        )
    return (q.float() * scale_inv.float()).to(dtype)


def dequantize_per_tensor(
    q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of quantize_per_tensor; scale_inv must have one element. See `dequantize`."""
    if scale_inv.numel() != 1:
        raise ValueError(f"per-tensor scale_inv must have 1 element, got shape {tuple(scale_inv.shape)}")
    return dequantize(q, scale_inv.reshape(()), dtype)


def dequantize_per_channel(
    q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of quantize_per_channel; scale_inv is [..., 1]. See `dequantize`."""
    if tuple(scale_inv.shape) != (*q.shape[:-1], 1):
        raise ValueError(
            f"per-channel scale_inv must have shape {(*q.shape[:-1], 1)}, got {tuple(scale_inv.shape)}"
        )
    return dequantize(q, scale_inv, dtype)


# ----------------------------------------------------------------------------- fake quant


def quantize_dequantize(
    x: torch.Tensor,
    granularity: Granularity,
    fmt: Fp8Format = E4M3,
    scale_mode: ScaleMode = "fp32",
    group_size: int = 128,
    weight_block_size: Sequence[int] = (128, 128),
    name: str = "tensor",
    validate: bool = True,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Fake quantization: quantize to FP8 and dequantize straight back.

    Used by the training emulation (training.py). Each granularity calls the
    matching quantize_* function above.

    Args:
        x: "tensor": any shape; "channel"/"group": [..., K]; "block": [M, N].
        granularity: "tensor", "channel" (one scale per row), "group" (1 x group_size
            along the last dim) or "block" (weight_block_size 2-D blocks).
        fmt, scale_mode: as in quantize_weight_blockwise.
        group_size: for "group".
        weight_block_size: for "block".
        name: used in error messages.
        validate: check for NaN/Inf (raises). With False, NaN/Inf propagate into the
            result instead (no device sync) - used for gradients.
        out_dtype: result dtype; defaults to x.dtype.

    Returns:
        Tensor of x.shape and out_dtype (x.dtype by default).

    Raises:
        ValueError: unknown granularity, bad shapes, NaN/Inf when validate=True.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    _check_scale_mode(scale_mode)
    _check_high_precision(x, name)
    out_dtype = out_dtype or x.dtype
    if validate:
        check_finite(x, name)

    if granularity in ("tensor", "channel"):
        if granularity == "channel" and x.dim() < 1:
            raise ValueError(f"{name} must be [..., N] for channel scaling, got a 0-dim tensor")
        q, scale_inv = _quantize_rows(x, fmt, scale_mode, per_row=granularity == "channel")
        return (q.float() * scale_inv).to(out_dtype)
    if granularity == "group":
        _check_positive_int(group_size, "group_size")
        if x.dim() < 1:
            raise ValueError(f"{name} must be [..., K] for group scaling, got a 0-dim tensor")
        q, scale_inv = _quantize_last_dim_groups(x, group_size, fmt, scale_mode)
        return dequantize_activation_per_group(q, scale_inv, group_size, out_dtype)
    # block
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D for block scaling, got shape {tuple(x.shape)}")
    bm, bn = _block_size(weight_block_size)
    q, scale_inv = _quantize_2d_blocks(x, bm, bn, fmt, scale_mode)
    return dequantize_weight_blockwise(q, scale_inv, (bm, bn), out_dtype)
