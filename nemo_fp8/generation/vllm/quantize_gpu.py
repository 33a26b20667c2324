"""Blockwise (128x128) FP8 weight quantization on the GPU, bit-identical to the torch reference.

Neither vLLM nor DeepGEMM ships a kernel for 2-D weight blocks (both have torch-op helpers,
``per_block_cast_to_fp8``, that make several passes), so this is one Triton pass: each program
reads one block once, computes its amax (floored at 1e-4), the scale (``fp32``:
``amax * fp32(1/448)``; ``pow2``: that rounded up to a power of two from its exponent bits,
exact like ``ceil_pow2``), and writes the e4m3 block (``x * fp32(1/s)``, saturated, round to
nearest even) and the fp32 ``scale_inv``: the arithmetic of vLLM's ``per_block_cast_to_fp8``. The oracle is
``nemo_fp8.fp8.quantize.quantize_weight_blockwise`` (GPU test: bit for bit). Without Triton or
CUDA the reference itself runs.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from nemo_fp8.fp8.quantize import quantize_weight_blockwise

try:  # Triton exists wherever CUDA torch does; keep CPU imports working without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


if triton is not None:

    @triton.jit
    def _block_quant_kernel(x_ptr, q_ptr, s_ptr, M, N, stride_xm, stride_qm, Nb, RCP_FP8_MAX,
                            POW2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        # Same arithmetic as quantize_weight_blockwise (vLLM/DeepGEMM per_block_cast_to_fp8):
        # amax floored at 1e-4, sf = amax * fp32(1/448), pow2: sf rounded up to 2^k exactly,
        # q = x * fp32(1/sf) rounded to nearest even.
        amax = tl.maximum(tl.max(tl.max(tl.abs(x), axis=1), axis=0), 1e-4)
        scale = amax * RCP_FP8_MAX
        if POW2:
            bits = scale.to(tl.int32, bitcast=True)
            e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
            scale = (e << 23).to(tl.float32, bitcast=True)
        y = x * tl.math.div_rn(1.0, scale)
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        tl.store(q_ptr + rm[:, None].to(tl.int64) * stride_qm + rn[None, :], y.to(tl.float8e4nv), mask=mask)
        tl.store(s_ptr + pid_m * Nb + pid_n, scale)


def quantize_blockwise_gpu(weight: torch.Tensor, scale_mode: str = "fp32", block: tuple[int, int] = (128, 128),
                           check_finite: bool = False, out: Optional[tuple[torch.Tensor, torch.Tensor]] = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_weight_blockwise`` for 2-D or 3-D (stacked experts) weights, fast on CUDA.

    Args:
        weight: [M, N] or [E, M, N] bf16/fp16/fp32.
        scale_mode: "fp32" or "pow2".
        block: (128, 128) only on the Triton path.
        check_finite: raise on NaN/Inf (one device sync); the refit leaves it to the sender.
        out: (q, scale_inv) to write into (2-D weights only): row-major tensors of the result's shapes and dtypes,
            e.g. views into a packed refit bucket (``packed_in_place``); the Triton kernel writes them directly,
            the reference path copies its result in.

    Returns:
        (q [.., M, N] e4m3, scale_inv [.., ceil(M/128), ceil(N/128)] fp32): ``out`` when given.

    Raises:
        ValueError: an unknown ``scale_mode``, a weight neither 2-D nor 3-D, ``out`` for a 3-D weight or of other
            shapes, dtypes or strides than the result's.
    """
    if scale_mode not in ("fp32", "pow2"):
        raise ValueError(f"scale_mode must be 'fp32' or 'pow2', got {scale_mode!r}")
    if out is not None:
        _check_out(weight, out)
    if weight.dim() == 3:
        qs = [quantize_blockwise_gpu(w, scale_mode, block, check_finite) for w in weight.unbind(0)]
        return torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs])
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D or 3-D, got shape {tuple(weight.shape)}")
    if triton is None or not weight.is_cuda or tuple(block) != (128, 128):
        q, s = quantize_weight_blockwise(weight, block, scale_mode=scale_mode)
        if out is None:
            return q, s
        out[0].copy_(q)
        out[1].copy_(s)
        return out
    if check_finite and not bool(torch.isfinite(weight).all()):
        raise ValueError(f"weight of shape {tuple(weight.shape)} has NaN/Inf; cannot compute FP8 scales")
    x = weight if weight.stride(1) == 1 else weight.contiguous()
    M, N = x.shape
    Mb, Nb = math.ceil(M / 128), math.ceil(N / 128)
    if out is not None:
        q, s = out
    else:
        q = torch.empty((M, N), dtype=torch.float8_e4m3fn, device=x.device)
        s = torch.empty((Mb, Nb), dtype=torch.float32, device=x.device)
    rcp = float(torch.tensor(1.0 / 448.0, dtype=torch.float32))  # fp32(1/448), as the reference
    _block_quant_kernel[(Mb, Nb)](x, q, s, M, N, x.stride(0), q.stride(0), Nb, rcp,
                                  POW2=scale_mode == "pow2", BM=128, BN=128, num_warps=8)
    return q, s


def _check_out(weight: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor]) -> None:
    """``quantize_blockwise_gpu``'s ``out``: a 2-D weight's (q, scale_inv) shapes and dtypes, row-major (the kernel
    writes rows at a stride of their width)."""
    if weight.dim() != 2:
        raise ValueError(f"out is for 2-D weights, got shape {tuple(weight.shape)}")
    M, N = weight.shape
    want = (((M, N), torch.float8_e4m3fn), ((math.ceil(M / 128), math.ceil(N / 128)), torch.float32))
    for t, (shape, dtype) in zip(out, want):
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"out: expected a contiguous {dtype} {list(shape)}, got {t.dtype} {list(t.shape)} "
                             f"(strides {t.stride()})")
