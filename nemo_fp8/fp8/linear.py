"""Block-scaled FP8 W8A8 linear layer for inference (the rollout side).

`w8a8_block_linear` reproduces, in plain torch, the numerics of vLLM's
block-scaled FP8 GEMM (`apply_w8a8_block_fp8_linear` in
vllm/model_executor/layers/quantization/utils/fp8_utils.py, backed by DeepGEMM /
CUTLASS / Triton `w8a8_block_fp8_matmul`), the scheme of the DeepSeek-V3 report
(arXiv:2412.19437, Sec. 3.3):

  1. activations x [M, K] are quantized on the fly in 1 x bk groups along K
     (`per_token_group_quant_fp8`), giving x_q [M, K] and x_s [M, Kb];
  2. the weight is stored quantized in bn x bk blocks: w_q [N, K], w_s [Nb, Kb];
  3. for each K block b the kernel computes the FP8 x FP8 partial dot products
     with fp32 accumulation and multiplies them by x_s[m, b] * w_s[n // bn, b]
     (DeepGEMM "promotes" each 128-wide partial sum to fp32 CUDA-core registers
     and applies the scales there), then sums over b in fp32.

The GPU kernels accumulate each 128-element partial product in tensor-core
accumulators of limited precision (about 14 bits on H800 per the DeepSeek-V3 report,
which is why it promotes to fp32 every 128 elements); here the partial products are
fp32 bmm results, so this reference is at least as accurate as the kernels and
differs from them far below the FP8 quantization error.

float64 activations (the CPU runs that must be the same on every CPU type) take another route to the same
values: both operands are dequantized exactly in float64 (an e4m3 value times an fp32 scale needs 28 of
float64's 53 mantissa bits) and multiplied in one float64 GEMM. The sum then differs from the blockwise
one only by float64 rounding (about 1e-16 relative), as every other float64 op of those runs does, and
costs one plain GEMM instead of a [Kb, M, N] batch of partial products.
"""

import math
from typing import Sequence

import torch
import torch.nn as nn

from nemo_fp8.fp8.formats import E4M3, FP8_DTYPES
from nemo_fp8.fp8.quantize import (_quantize_last_dim_groups, dequantize_activation_per_group,
                                   dequantize_weight_blockwise, quantize_weight_blockwise)
from nemo_fp8.fp8.scales import ScaleMode, _block_size, _check_high_precision, _check_scale_mode

# Upper bound on the fp32 elements of the [Kb, rows, N] partial-product buffer;
# larger inputs are processed in row chunks to bound memory (128 MiB).
_MAX_PARTIAL_ELEMENTS = 1 << 25


def w8a8_block_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    weight_block_size: Sequence[int] = (128, 128),
    act_scale_mode: ScaleMode = "fp32",
    out_dtype: torch.dtype | None = None,
    prepared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """y = x @ W.T + bias with FP8 block-scaled W and dynamically quantized x.

    Numerics of vLLM `apply_w8a8_block_fp8_linear` / DeepGEMM (see module docstring):
    x is quantized per 1 x bk group along K (bk = weight_block_size[1]), each K block
    contributes (x_q[:, b] @ w_q[:, b].T) * x_s[:, b] * w_s[n // bn, b], and the
    contributions are summed in fp32 (float64 x: one float64 GEMM, see the module docstring). K and N
    need not be multiples of the block size (K is zero-padded; scales are cropped to N).

    Args:
        x: [..., K] bf16/fp16/fp32 activations.
        qweight: [N, K] float8_e4m3fn (or e5m2).
        weight_scale_inv: [ceil(N/bn), ceil(K/bk)] float32 dequantization scales.
        bias: [N] or None; added in fp32 before the cast to out_dtype.
        weight_block_size: (bn, bk) = rows x cols of one weight block.
        act_scale_mode: "fp32" or "pow2" scales for the activation groups.
        out_dtype: output dtype; defaults to x.dtype.
        prepared: ``prepare_weight(qweight, weight_scale_inv, weight_block_size, x.dtype)`` computed earlier
            (the same values, kept by ``Fp8BlockLinear`` between refits); None computes it here.

    Returns:
        [..., N] tensor of out_dtype.

    Raises:
        ValueError: wrong dtypes/shapes (the message names both shapes).

    NaN/Inf in x are not checked (that would cost a device sync per layer); they
    propagate to the output as they do in vLLM's kernels. Activations are always
    quantized to e4m3, as in vLLM's block FP8 path.
    """
    _check_scale_mode(act_scale_mode)
    bn, bk = _block_size(weight_block_size)
    if qweight.dtype not in FP8_DTYPES or qweight.dim() != 2:
        raise ValueError(
            f"qweight must be a 2-D fp8 tensor [N, K], got dtype {qweight.dtype} and shape "
            f"{tuple(qweight.shape)} (was the module cast with .to(dtype)?)"
        )
    N, K = qweight.shape
    if x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"x shape {tuple(x.shape)} does not match qweight shape {(N, K)}: last dim must be {K}")
    Nb, Kb = math.ceil(N / bn), math.ceil(K / bk)
    if tuple(weight_scale_inv.shape) != (Nb, Kb):
        raise ValueError(
            f"weight_scale_inv shape {tuple(weight_scale_inv.shape)} does not match qweight "
            f"shape {(N, K)} with weight_block_size {(bn, bk)}; expected {(Nb, Kb)}"
        )
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"bias shape {tuple(bias.shape)} does not match out_features {N}")
    _check_high_precision(x, "x")
    out_dtype = out_dtype or x.dtype
    lead_shape = x.shape[:-1]

    # 1. dynamic per-token-group activation quantization (1 x bk groups along K)
    x2 = x.reshape(-1, K)  # [M, K]
    x_q, x_s = _quantize_last_dim_groups(x2, bk, E4M3, act_scale_mode)  # [M, K], [M, Kb]

    # 2. the weight as the matmul takes it: fp32 K blocks, or dequantized in float64 (module docstring)
    if prepared is None:
        prepared = prepare_weight(qweight, weight_scale_inv, (bn, bk), x.dtype)
    if x.dtype == torch.float64:
        out = _dequantized_matmul(x_q, x_s, prepared, bias, bk)
    else:
        w_blocks, w_s = prepared
        out = _block_scaled_matmul(x_q, x_s, w_blocks, w_s, bias, bk)
    return out.to(out_dtype).reshape(*lead_shape, N)


def prepare_weight(qweight: torch.Tensor, weight_scale_inv: torch.Tensor, weight_block_size: tuple[int, int],
                   x_dtype: torch.dtype):
    """The FP8 weight laid out for ``w8a8_block_linear`` with activations of ``x_dtype``: a pure function of the
    weight and its scales, which ``Fp8BlockLinear`` keeps between refits.

    Returns:
        float64 activations: the dequantized weight [N, K] float64 (exact: e4m3 value x fp32 scale);
        otherwise ``(w_blocks [Kb, bk, N] fp32, w_s [Kb, N] fp32)`` (``_weight_blocks``).
    """
    if x_dtype != torch.float64:
        return _weight_blocks(qweight, weight_scale_inv, weight_block_size)
    return dequantize_weight_blockwise(qweight, weight_scale_inv, weight_block_size, dtype=torch.float64)  # [N, K]


def _dequantized_matmul(x_q: torch.Tensor, x_s: torch.Tensor, w_deq: torch.Tensor, bias: torch.Tensor | None,
                        bk: int) -> torch.Tensor:
    """(x_q * x_s) @ w_deq.T (+ bias) in float64 -> [M, N]; x_q [M, K] fp8, x_s [M, Kb], w_deq [N, K] float64."""
    x_deq = dequantize_activation_per_group(x_q, x_s, bk, dtype=torch.float64)  # [M, K], exact
    out = x_deq @ w_deq.t()  # [M, N]
    return out + bias.double() if bias is not None else out


def _weight_blocks(qweight: torch.Tensor, weight_scale_inv: torch.Tensor,
                   weight_block_size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_blocks [Kb, bk, N] fp32, w_s [Kb, N] fp32): the FP8 weight's values (exact in fp32) laid out as K blocks,
    and each block's scale per output row; what ``w8a8_block_linear`` multiplies with, a pure function of the
    weight and its scales (``Fp8BlockLinear`` keeps it between refits)."""
    bn, bk = weight_block_size
    N, K = qweight.shape
    Kb = math.ceil(K / bk)
    w_f = torch.nn.functional.pad(qweight.float(), (0, Kb * bk - K))  # [N, Kp]
    w_blocks = w_f.view(N, Kb, bk).permute(1, 2, 0).contiguous()  # [Kb, bk, N]
    w_s = weight_scale_inv.float().repeat_interleave(bn, dim=0)[:N].t()  # [Kb, N]
    return w_blocks, w_s


def _block_scaled_matmul(x_q: torch.Tensor, x_s: torch.Tensor, w_blocks: torch.Tensor, w_s: torch.Tensor,
                         bias: torch.Tensor | None, bk: int) -> torch.Tensor:
    """sum_b (x_q[:, b] @ w_q[:, b].T) * x_s[:, b] * w_s[b] in fp32 -> [M, N] (``w8a8_block_linear``'s step 3)."""
    acc_dtype = torch.float32
    M, K = x_q.shape
    Kb, _, N = w_blocks.shape
    pad_k = Kb * bk - K
    # 3. per-block partial products, scaled and summed over K blocks
    out = torch.empty(M, N, dtype=acc_dtype, device=x_q.device)  # [M, N]
    rows_per_chunk = max(1, _MAX_PARTIAL_ELEMENTS // max(1, Kb * N))
    for start in range(0, M, rows_per_chunk):
        stop = min(M, start + rows_per_chunk)
        xq_f = torch.nn.functional.pad(x_q[start:stop].to(acc_dtype), (0, pad_k))  # [m, Kp]
        x_blocks = xq_f.view(stop - start, Kb, bk).transpose(0, 1)  # [Kb, m, bk]
        partial = torch.bmm(x_blocks, w_blocks)  # [Kb, m, N]
        partial.mul_(x_s[start:stop].t().unsqueeze(-1).to(acc_dtype))  # * x_s[m, b]      [Kb, m, N]
        partial.mul_(w_s.unsqueeze(1))  # * w_s[n // bn, b]                  [Kb, m, N]
        out[start:stop] = partial.sum(dim=0)  # [m, N]

    if bias is not None:
        out = out + bias.to(acc_dtype)  # [M, N]
    return out


class Fp8BlockLinear(nn.Module):
    """Inference-only drop-in for nn.Linear with a block-scaled FP8 weight.

    State (all buffers, named like vLLM's Fp8LinearMethod so state_dict keys match a
    block-FP8 checkpoint):
        weight: [out_features, in_features] float8_e4m3fn
        weight_scale_inv: [ceil(out/bn), ceil(in/bk)] float32
        bias: [out_features] in the model's compute dtype, or None

    `load_weight` (the RL "refit") re-quantizes a new high-precision weight and
    copies into the existing buffers, so their storage (data_ptr) never changes,
    which matters for CUDA graphs and for engines holding references to the tensors.

    Do not call `.to(dtype)` / `.half()` on this module: like any module, torch would
    cast the fp8 buffers too. Move it with `.to(device)` only.
    """

    #: `load_weight` quantizes this many weight elements (whole 128-row blocks) at a time, so a
    #: refit's temporaries stay a small slice of the weight (256K elements: 1 MiB fp32 each).
    REFIT_CHUNK_ELEMENTS = 1 << 18

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        weight_block_size: Sequence[int] = (128, 128),
        weight_scale_mode: ScaleMode = "fp32",
        act_scale_mode: ScaleMode = "fp32",
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        _check_scale_mode(weight_scale_mode)
        _check_scale_mode(act_scale_mode)
        bn, bk = _block_size(weight_block_size)
        self.in_features = in_features
        self.out_features = out_features
        self.weight_block_size = (bn, bk)
        self.weight_scale_mode = weight_scale_mode
        self.act_scale_mode = act_scale_mode
        scale_shape = (math.ceil(out_features / bn), math.ceil(in_features / bk))
        self.register_buffer(
            "weight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn, device=device)
        )
        self.register_buffer("weight_scale_inv", torch.ones(scale_shape, dtype=torch.float32, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.register_buffer("bias", None)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        weight_block_size: Sequence[int] = (128, 128),
        weight_scale_mode: ScaleMode = "fp32",
        act_scale_mode: ScaleMode = "fp32",
    ) -> "Fp8BlockLinear":
        """Build an Fp8BlockLinear holding the quantized weight (and bias) of `linear`.

        Args:
            linear: nn.Linear with weight [N, K] (any float dtype); its bias dtype
                (else its weight dtype) becomes the bias dtype here.
            weight_block_size, weight_scale_mode, act_scale_mode: see the class.

        Raises:
            ValueError: NaN/Inf in the weight, bad block size or scale modes.
        """
        weight = linear.weight.detach()
        has_bias = linear.bias is not None
        module = cls(
            linear.in_features,
            linear.out_features,
            bias=has_bias,
            weight_block_size=weight_block_size,
            weight_scale_mode=weight_scale_mode,
            act_scale_mode=act_scale_mode,
            dtype=linear.bias.dtype if has_bias else weight.dtype,
            device=weight.device,
        )
        module.load_weight(weight)
        if has_bias:
            module.load_bias(linear.bias.detach())
        return module

    @torch.no_grad()
    def load_weight(self, weight: torch.Tensor) -> None:
        """Refit: quantize `weight` and copy it in place into `weight`/`weight_scale_inv`.

        Args:
            weight: [out_features, in_features] bf16/fp16/fp32, any device.

        Raises:
            ValueError: shape mismatch (names both shapes), NaN/Inf in weight.
        """
        expected = (self.out_features, self.in_features)
        if tuple(weight.shape) != expected:
            raise ValueError(
                f"load_weight: got weight of shape {tuple(weight.shape)}, this layer expects {expected}"
            )
        # Row blocks quantize independently: a few at a time bounds the temporaries of a refit
        # (abs, scaled copy, fp8 cast) to a slice of the weight; the result is bit-identical.
        rows = self.weight_block_size[0] * max(1, self.REFIT_CHUNK_ELEMENTS // (self.weight_block_size[0] * self.in_features))
        for r0 in range(0, self.out_features, rows):
            q, scale_inv = quantize_weight_blockwise(
                weight[r0:r0 + rows].to(self.weight.device),
                self.weight_block_size,
                scale_mode=self.weight_scale_mode,
                name="weight",
            )
            b0 = r0 // self.weight_block_size[0]
            self.weight[r0:r0 + rows].copy_(q)
            self.weight_scale_inv[b0:b0 + scale_inv.shape[0]].copy_(scale_inv)

    @torch.no_grad()
    def load_bias(self, bias: torch.Tensor) -> None:
        """Copy a new bias [out_features] in place (cast to the bias buffer's dtype).

        Raises:
            ValueError: if the layer has no bias or the shape differs.
        """
        if self.bias is None:
            raise ValueError("load_bias: this layer was built with bias=False")
        if tuple(bias.shape) != (self.out_features,):
            raise ValueError(
                f"load_bias: got bias of shape {tuple(bias.shape)}, this layer expects ({self.out_features},)"
            )
        self.bias.copy_(bias)

    def _prepared(self, x_dtype: torch.dtype):
        """The weight as the matmul takes it (``prepare_weight``: fp32 K blocks, or float64 dequantized for float64
        activations), kept until the weight or its scales change.

        Converting the FP8 weight to fp32 on every call was most of an emulated forward's time on CPU; the
        layout is a pure function of the two buffers, so it is rebuilt only when either has been written in
        place (a refit's ``load_weight``, ``copy_`` or ``load_state_dict``: torch's ``_version`` counter) or
        replaced. Costs 4 bytes (float64: 8) per weight element while held.
        """
        key = (self.weight.data_ptr(), self.weight._version, self.weight.device,
               self.weight_scale_inv.data_ptr(), self.weight_scale_inv._version, x_dtype == torch.float64)
        if getattr(self, "_prepared_key", None) != key:
            self._prepared_value = prepare_weight(self.weight, self.weight_scale_inv, self.weight_block_size, x_dtype)
            self._prepared_key = key
        return self._prepared_value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features] in x.dtype."""
        return w8a8_block_linear(
            x,
            self.weight,
            self.weight_scale_inv,
            self.bias,
            self.weight_block_size,
            act_scale_mode=self.act_scale_mode,
            prepared=self._prepared(x.dtype),
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, weight_block_size={list(self.weight_block_size)}, "
            f"weight_scale_mode={self.weight_scale_mode}, act_scale_mode={self.act_scale_mode}"
        )
