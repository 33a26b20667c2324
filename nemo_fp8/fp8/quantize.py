"""Scaled FP8 quantization at tensor, channel, 1xG group and 2-D block granularity.

Convention (vLLM / DeepSeek-V3 checkpoints / TransformerEngine): every quantized
tensor `q` (fp8) comes with a float32 `scale_inv`, and

    dequant = q.float() * scale_inv          (broadcast over the scaled region)
    q       = saturate_cast(x / scale_inv)   (round to nearest even, clamp to +-fmt.max)

Granularities (DeepSeek-V3 technical report, arXiv:2412.19437, Sec. 3.3.1):
  - weights: 128x128 blocks  -> scale_inv [ceil(M/128), ceil(N/128)]
  - activations: 1x128 groups along the last (contraction) dim
                             -> scale_inv [..., ceil(K/128)]
  - per tensor: one scale (TE Float8CurrentScaling); per channel: one scale per row.

Scales, their amax floors and the vLLM arithmetic they reproduce bit for bit: ``nemo_fp8.fp8.scales``.
"""

import math
from typing import Literal, Sequence

import torch

from nemo_fp8.fp8.formats import E4M3, Fp8Format, cast_to_fp8
from nemo_fp8.fp8.scales import (ScaleMode, _block_size, _check_high_precision, _check_positive_int, _check_scale_mode,
                                 _pad_to_multiple, activation_group_scale_inv, check_finite, compute_scale_inv,
                                 weight_block_scale_inv)

Granularity = Literal["tensor", "channel", "group", "block"]

GRANULARITIES = ("tensor", "channel", "group", "block")


def _quantize_last_dim_groups(
    x: torch.Tensor, group_size: int, fmt: Fp8Format, scale_mode: ScaleMode
) -> tuple[torch.Tensor, torch.Tensor]:
    """1 x group_size quantization along the last dim, no input validation.

    vLLM per_token_group_quant.cu `QuantizeGroup`:
    `fminf(fmaxf(static_cast<float>(src) / y_s, min_8bit), max_8bit)` then the
    round-to-nearest-even (satfinite) cast: x in float32 divided by the float32
    scale, not multiplied by its reciprocal. Scales: `activation_group_scale_inv`.
    Partial last groups are zero-padded for the amax (vLLM requires K % group_size
    == 0).
    """
    K = x.shape[-1]
    xp = _pad_to_multiple(x.float(), -1, group_size)  # [..., Kp]
    xg = xp.unflatten(-1, (-1, group_size))  # [..., G, group_size]
    amax = xg.abs().amax(dim=-1)  # [..., G]
    scale_inv = activation_group_scale_inv(amax, fmt, scale_mode)  # [..., G]
    q = cast_to_fp8(xg / scale_inv.unsqueeze(-1), fmt)  # [..., G, group_size]
    q = q.flatten(-2)[..., :K].contiguous()  # [..., K]
    return q, scale_inv


def _quantize_2d_blocks(
    x: torch.Tensor, bm: int, bn: int, fmt: Fp8Format, scale_mode: ScaleMode
) -> tuple[torch.Tensor, torch.Tensor]:
    """bm x bn block quantization of a 2-D tensor, no input validation.

    vLLM/DeepGEMM `per_block_cast_to_fp8`: `(x_view * (1.0 / sf)).to(fp8)`, i.e. x
    (promoted to float32) times the float32 reciprocal of the scale, rounded to
    nearest even. The clamp of cast_to_fp8 never triggers here (|x| * (1/sf) rounds
    to at most 448). Scales: `weight_block_scale_inv`. Shapes that are not block
    multiples are zero-padded, as in per_block_cast_to_fp8.
    """
    M, N = x.shape
    xp = _pad_to_multiple(_pad_to_multiple(x.float(), 0, bm), 1, bn)  # [Mp, Np]
    Mb, Nb = xp.shape[0] // bm, xp.shape[1] // bn
    xb = xp.view(Mb, bm, Nb, bn)  # [Mb, bm, Nb, bn]
    amax = xb.abs().amax(dim=(1, 3))  # [Mb, Nb]
    scale_inv = weight_block_scale_inv(amax, fmt, scale_mode)  # [Mb, Nb]
    q = cast_to_fp8(xb * torch.reciprocal(scale_inv)[:, None, :, None], fmt)  # [Mb, bm, Nb, bn]
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

    Bit-exact numerics of vLLM/DeepGEMM `per_block_cast_to_fp8` (vllm/utils/
    deep_gemm.py), the quantizer vLLM 0.22 itself applies to block weights (UE8M0
    requantization `requant_weight_ue8m0_inplace`, online fp8): block amax floored
    at 1e-4, scale_inv = amax * fp32(1/fmt.max) (pow2: 2^ceil(log2(that))),
    q = fp8(x * fp32(1/scale_inv)). So pow2 weights handed to vLLM with
    VLLM_USE_DEEP_GEMM_E8M0 requantize to the same dequantized values. An all-zero
    block gets scale_inv = fp32(1e-4) * fp32(1/448) (pow2: 2^-22) and zeros. See
    `weight_block_scale_inv`.

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
        [M, N] tensor of `dtype` (product computed in float32, or in float64 for float64: exact there).

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
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    qp = _pad_to_multiple(_pad_to_multiple(qweight.to(acc), 0, bm), 1, bn)  # [Mp, Np]
    out = qp.view(Mb, bm, Nb, bn) * scale_inv.to(acc)[:, None, :, None]  # [Mb, bm, Nb, bn]
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

    Bit-exact numerics of vLLM 0.22 `per_token_group_quant_fp8` (fp8_utils.py, eps
    1e-10) as run by its CUDA kernel (per_token_group_quant.cu, ComputeGroupScale /
    QuantizeGroup): amax floored at 1e-10, scale_inv = amax / fmt.max (fp32
    division; pow2: 2^ceil(log2(max(that, 1e-10)))), q = fp8(x / scale_inv) with a
    true fp32 division. An all-zero group gets scale_inv = fp32(1e-10) / fmt.max
    (pow2: 2^-33) and zeros. See `activation_group_scale_inv`.

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
        [..., K] tensor of `dtype` (product computed in float32, or in float64 for float64: exact there).

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
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    qg = _pad_to_multiple(q.to(acc), -1, group_size).unflatten(-1, (-1, group_size))  # [..., G, group_size]
    return (qg * scale_inv.to(acc).unsqueeze(-1)).flatten(-2)[..., :K].to(dtype)  # [..., K]


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
