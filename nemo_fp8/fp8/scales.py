"""FP8 scales (``scale_inv``) from a region's amax, and the input checks the quantizers share.

Convention: ``dequant = q.float() * scale_inv`` (``nemo_fp8.fp8.quantize``). The scale of a region is computed
from its current amax ("current scaling"):

    fp32 mode: scale_inv = amax / fmt.max
    pow2 mode: scale_inv = 2 ** ceil(log2(amax / fmt.max))  (UE8M0 / E8M0 scales)

The weight-block and activation-group quantizers reproduce, bit for bit, the
arithmetic of the vLLM 0.22 code that consumes or mirrors them (sources read from
the vllm-0.22.0 wheel and vllm csrc):

  weights (128x128), `_quantize_2d_blocks` / `weight_block_scale_inv`:
      vLLM `per_block_cast_to_fp8` (vllm/utils/deep_gemm.py, copied from DeepGEMM
      deep_gemm/utils/math.py). vLLM runs it to requantize block-FP8 weights to
      UE8M0 scales in `requant_weight_ue8m0_inplace` (fp8_utils.py, called from
      `deepgemm_post_process_fp8_weight_block` when VLLM_USE_DEEP_GEMM_E8M0 is on)
      and for online block quantization (quantization/online/fp8.py):
          amax = max(block amax in fp32, 1e-4)
          sf   = amax / 448           (on CUDA: amax * fp32(1/448), see below)
          sf   = 2**ceil(log2(sf))    if use_ue8m0
          q    = (x * (1.0 / sf)).to(fp8)   multiply by the fp32 reciprocal
  activations (1x128), `_quantize_last_dim_groups` / `activation_group_scale_inv`:
      vLLM `per_token_group_quant_fp8` (fp8_utils.py) -> CUDA op
      `per_token_group_fp8_quant`, kernel `per_token_group_quant_8bit_kernel`
      (csrc/libtorch_stable/quantization/w8a8/fp8/per_token_group_quant.cu,
      `ComputeGroupScale` + `QuantizeGroup`), which vLLM uses for block-FP8 models
      (`VllmConfig` forces "+quant_fp8" when weights are blocked, so QuantFP8 runs
      forward_cuda, not forward_native):
          amax = max(group amax in fp32, eps = 1e-10)
          y_s  = amax / 448                                  (fp32 division)
          y_s  = exp2f(ceilf(log2f(fmaxf(y_s, 1e-10f))))      if UE8M0
          q    = fp8(clamp(x / y_s, -448, 448))               fp32 division

So a zero or tiny block is not special-cased any more: it gets the floored scale
(1e-4 / 448 for weights, 1e-10 / 448 for activations) and all-zero fp8 values.
Per-tensor and per-channel quantization keep `compute_scale_inv` (no amax floor,
amax == 0 gives scale_inv = 1, division by an fp32 scale).

pow2 scales are exact powers of two, so dividing by them and multiplying by their
reciprocal give the same result; only fp32 mode depends on the choice.
"""

import math
from typing import Literal, Sequence

import torch
import torch.nn.functional as F

from nemo_fp8.fp8.formats import E4M3, FP8_DTYPES, Fp8Format

ScaleMode = Literal["fp32", "pow2"]

SCALE_MODES = ("fp32", "pow2")


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
    """Dequantization scales from absolute maxima, for per-tensor / per-channel scaling.

    Weight blocks and activation groups use `weight_block_scale_inv` and
    `activation_group_scale_inv` (vLLM's amax floors and arithmetic) instead.

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


# vLLM 0.22 constants (see the module docstring for their sources).
WEIGHT_BLOCK_AMAX_FLOOR = 1e-4
"""per_block_cast_to_fp8: `x_view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)`."""
ACTIVATION_GROUP_AMAX_FLOOR = 1e-10
"""per_token_group_quant_fp8(eps=1e-10): `float local_absmax = eps;` in ComputeGroupScale."""
ACTIVATION_GROUP_UE8M0_SCALE_FLOOR = 1e-10
"""ComputeGroupScale (UE8M0): `exp2f(ceilf(log2f(fmaxf(fabsf(y_s), 1e-10f))))`."""


def ceil_pow2(x: torch.Tensor) -> torch.Tensor:
    """2 ** ceil(log2(x)) computed exactly from the float32 bits of x.

    Same as DeepGEMM `ceil_to_ue8m0` (deep_gemm/utils/math.py: biased exponent plus
    one if the mantissa is non-zero) and the bit trick of vLLM's UE8M0 CUDA kernels
    (per_token_group_quant.cu, `per_token_group_quant_8bit_packed_register_kernel`),
    without DeepGEMM's clamp of the exponent to [2^-126, 2^127]. vLLM's
    `_ceil_to_ue8m0` (utils/deep_gemm.py, `torch.pow(2, ceil(log2(x)))`) and the
    `exp2f(ceilf(log2f(y)))` of ComputeGroupScale agree with it except when x lies
    within about one float32 ulp above a power of two, where a rounded log2 gives
    the power itself; a scale amax / fmt.max with amax from bf16/fp16 values is
    either a power of two or far from one (8 or 11 significant bits), so for such
    inputs all of them agree.

    Args:
        x: float tensor of positive values, any shape (read as float32).

    Returns:
        float32 tensor of x's shape, each an exact power of two >= x. Non-finite
        values are returned unchanged (NaN/Inf propagate).
    """
    x = x.float()
    m, e = torch.frexp(x)  # x = m * 2^e, m in [0.5, 1)
    k = e - (m == 0.5).to(e.dtype)  # x == 2^(e-1) exactly -> keep it, else round up
    out = torch.ldexp(torch.ones_like(x), k)
    return torch.where(torch.isfinite(x), out, x)


def _fp32_reciprocal_of(value: float, like: torch.Tensor) -> torch.Tensor:
    """fp32 1/value as a 0-dim tensor: what PyTorch CUDA uses for `t / value`.

    PyTorch's CUDA true division by a (CPU) scalar multiplies by the fp32 reciprocal
    (aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu), and torch.compile (Inductor)
    lowers division by a constant to multiplication by its reciprocal. On CPU,
    `t / value` divides. Using the reciprocal explicitly gives the CUDA result on
    every device.
    """
    one = torch.ones((), dtype=torch.float32, device=like.device)
    return one / torch.full((), value, dtype=torch.float32, device=like.device)


def weight_block_scale_inv(
    amax: torch.Tensor, fmt: Fp8Format = E4M3, scale_mode: ScaleMode = "fp32"
) -> torch.Tensor:
    """Scales of 2-D weight blocks, as vLLM `per_block_cast_to_fp8` computes them.

    Source: vllm/utils/deep_gemm.py `per_block_cast_to_fp8` (vLLM 0.22; a copy of
    DeepGEMM deep_gemm/utils/math.py `per_block_cast_to_fp8`):
        x_amax = x_view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
        sf = x_amax / fp8_max
        sf = _ceil_to_ue8m0(sf) if use_ue8m0 else sf
    `x_amax / fp8_max` divides a CUDA tensor by a Python float, which PyTorch
    (eager and Inductor) computes as x_amax * fp32(1 / fp8_max); we do the same on
    every device (on a CPU, the literal code would divide and differ in the last bit
    for about half of the amax values). pow2 uses the exact `ceil_pow2`.

    Args:
        amax: non-negative block absolute maxima, any shape (read as float32).
        fmt: target FP8 format (fmt.max plays vLLM's fp8_max).
        scale_mode: "fp32" or "pow2" (vLLM use_ue8m0=True).

    Returns:
        float32 tensor of amax's shape; >= 1e-4 / fmt.max (rounded), so an all-zero
        block gets fp32(1e-4) * fp32(1/448) in fp32 mode and 2^-22 in pow2 mode (e4m3).

    Raises:
        ValueError: on an unknown scale_mode.
    """
    _check_scale_mode(scale_mode)
    amax = amax.float().clamp_min(WEIGHT_BLOCK_AMAX_FLOOR)
    sf = amax * _fp32_reciprocal_of(fmt.max, amax)
    return ceil_pow2(sf) if scale_mode == "pow2" else sf


def activation_group_scale_inv(
    amax: torch.Tensor, fmt: Fp8Format = E4M3, scale_mode: ScaleMode = "fp32"
) -> torch.Tensor:
    """Scales of 1 x G activation groups, as vLLM's CUDA per-token-group quantizer.

    Source: vLLM 0.22 `per_token_group_quant_fp8` (fp8_utils.py, eps=1e-10) ->
    `torch.ops._C.per_token_group_fp8_quant` -> per_token_group_quant.cu
    `ComputeGroupScale`:
        float local_absmax = eps;   ... fmaxf(local_absmax, fabsf(x)) ...
        float y_s = local_absmax / max_8bit;                 // fp32 division
        if (SCALE_UE8M0) y_s = exp2f(ceilf(log2f(fmaxf(fabsf(y_s), 1e-10f))));
    Here the division is float32 tensor / float32 tensor (IEEE round to nearest on
    CPU and CUDA). Not followed: the Triton fallback `_per_token_group_quant_fp8`
    (non-CUDA or non-contiguous input), which computes `_absmax * (1.0 / fp8_max)`,
    and QuantFP8.forward_native (`_quantize_group_native`), which floors the scale
    at 1 / (448 * 512) instead of the amax at eps.

    Args:
        amax: non-negative group absolute maxima, any shape (read as float32).
        fmt: target FP8 format (fmt.max plays vLLM's max_8bit).
        scale_mode: "fp32" or "pow2" (vLLM use_ue8m0=True).

    Returns:
        float32 tensor of amax's shape. An all-zero group gets fp32(1e-10) / 448 in
        fp32 mode and 2^-33 (= ceil_pow2(fp32(1e-10))) in pow2 mode.

    Raises:
        ValueError: on an unknown scale_mode.
    """
    _check_scale_mode(scale_mode)
    amax = amax.float().clamp_min(ACTIVATION_GROUP_AMAX_FLOOR)
    y_s = amax / torch.full((), fmt.max, dtype=torch.float32, device=amax.device)
    if scale_mode == "pow2":
        y_s = ceil_pow2(y_s.clamp_min(ACTIVATION_GROUP_UE8M0_SCALE_FLOOR))
    return y_s
