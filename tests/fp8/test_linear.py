"""Block-scaled W8A8 linear (vLLM / DeepGEMM numerics) against float64 references.

Bounds asserted (measured with these seeds, see the comments at each assert):
  - vs the float64 product of the dequantized operands, dequant(x_q) @ dequant(w_q).T:
    relative error <= 1e-5 (measured 3e-8..1.4e-7); only fp32 accumulation differs.
  - vs the float64 product of the unquantized operands: relative Frobenius error
    <= 0.045 (measured 0.035..0.038). Each operand carries ~0.026 relative RMS
    e4m3 rounding error (3 mantissa bits), independent between x and w, so the
    product carries about sqrt(2) * 0.026 = 0.037. Per element we also assert the
    worst-case bound |err| <= (2u + u^2) (|x| @ |w|.T) + subnormal slack, u = 2^-4.
"""

import math

import pytest
import torch

from nemo_fp8.fp8 import (
    Fp8BlockLinear,
    dequantize_activation_per_group,
    dequantize_weight_blockwise,
    quantize_activation_per_group,
    quantize_weight_blockwise,
    w8a8_block_linear,
)

U = 2.0**-4


def _reference_loop(x, qweight, w_s, block, scale_mode):
    """The kernel's definition, one K block at a time, in float64."""
    bn, bk = block
    N, K = qweight.shape
    x_q, x_s = quantize_activation_per_group(x, bk, scale_mode=scale_mode)
    out = torch.zeros(x.shape[0], N, dtype=torch.float64)
    for b in range(math.ceil(K / bk)):
        ks = slice(b * bk, min(K, (b + 1) * bk))
        partial = x_q[:, ks].double() @ qweight[:, ks].double().t()  # [M, N]
        w_scale = w_s[:, b].double().repeat_interleave(bn)[:N]  # [N]
        out += partial * x_s[:, b : b + 1].double() * w_scale
    return out


@pytest.mark.parametrize("scale_mode", ["fp32", "pow2"])
@pytest.mark.parametrize(
    "M,N,K",
    [(64, 256, 512), (33, 200, 300), (1, 1, 1), (5, 72, 129), (512, 384, 1024)],
)
def test_w8a8_matches_dequantized_reference_and_bound(M, N, K, scale_mode):
    torch.manual_seed(M + N + K)
    x = torch.randn(M, K)
    w = torch.randn(N, K) / math.sqrt(K)
    qw, w_s = quantize_weight_blockwise(w, scale_mode=scale_mode)
    y = w8a8_block_linear(x, qw, w_s, act_scale_mode=scale_mode)
    assert y.shape == (M, N) and y.dtype == torch.float32

    # 1) same operands, float64 math: only fp32 accumulation differs (measured <= 1.4e-7)
    x_q, x_s = quantize_activation_per_group(x, 128, scale_mode=scale_mode)
    x_dq = dequantize_activation_per_group(x_q, x_s, 128, dtype=torch.float64)
    w_dq = dequantize_weight_blockwise(qw, w_s, dtype=torch.float64)
    ref_dq = x_dq @ w_dq.t()
    scale = (x_dq.abs() @ w_dq.abs().t()).max()
    assert (y.double() - ref_dq).abs().max() <= 1e-5 * scale
    torch.testing.assert_close(y.double(), _reference_loop(x, qw, w_s, (128, 128), scale_mode), rtol=1e-5, atol=1e-5 * scale)

    # 2) against the unquantized product
    ref = x.double() @ w.double().t()
    abs_prod = x.double().abs() @ w.double().abs().t()
    xs_max = x_s.double().max()
    ws_max = w_s.double().max()
    slack = 2.0**-10 * (xs_max * w.double().abs().sum(1) + ws_max * x.double().abs().sum(1, keepdim=True)) * 1.1
    assert torch.all((y.double() - ref).abs() <= (2 * U + U * U) * abs_prod + slack + 1e-6 * scale)
    if M * N >= 1000:  # Frobenius statistic needs enough elements
        rel = ((y.double() - ref).norm() / ref.norm()).item()
        assert rel < 0.045, rel  # measured 0.035..0.038


@pytest.mark.parametrize("M,N,K", [(33, 200, 300), (5, 72, 129), (64, 256, 512)])
def test_w8a8_float64_is_the_blockwise_sum_to_float64_rounding(M, N, K):
    """float64 activations take one float64 GEMM of the exactly dequantized operands; it equals the kernel's
    blockwise definition up to float64 rounding, through the function and through the module's weight cache."""
    torch.manual_seed(M * N + K)
    x = torch.randn(M, K, dtype=torch.float64)
    w = torch.randn(N, K) / math.sqrt(K)
    b = torch.randn(N, dtype=torch.float64)
    qw, w_s = quantize_weight_blockwise(w)
    ref = _reference_loop(x, qw, w_s, (128, 128), "fp32") + b
    y = w8a8_block_linear(x, qw, w_s, b)
    assert y.dtype == torch.float64
    scale = (x.abs() @ w.double().abs().t()).max()
    assert (y - ref).abs().max() <= 1e-13 * scale
    lin = torch.nn.Linear(K, N, bias=True, dtype=torch.float64)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    mod = Fp8BlockLinear.from_linear(lin)
    torch.testing.assert_close(mod(x), y, rtol=0, atol=0)
    # the cache follows the activations' dtype: float32 input takes the fp32 blockwise path again
    y32 = mod(x.float())
    assert y32.dtype == torch.float32 and (y32.double() - y).abs().max() <= 1e-5 * scale


def test_w8a8_bias_out_dtype_and_leading_dims():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 256).bfloat16()
    w = torch.randn(64, 256) * 0.05
    b = torch.randn(64)
    qw, w_s = quantize_weight_blockwise(w)
    y = w8a8_block_linear(x, qw, w_s, b)
    assert y.shape == (2, 3, 64) and y.dtype == torch.bfloat16
    y32 = w8a8_block_linear(x, qw, w_s, b, out_dtype=torch.float32)
    nobias = w8a8_block_linear(x, qw, w_s, None, out_dtype=torch.float32)
    torch.testing.assert_close(y32 - nobias, b.expand_as(y32), rtol=0, atol=1e-6)
    torch.testing.assert_close(y.float(), y32, rtol=2**-8, atol=1e-2)
    # flattening leading dims does not change anything
    flat = w8a8_block_linear(x.reshape(6, 256), qw, w_s, b, out_dtype=torch.float32)
    assert torch.equal(flat.reshape(2, 3, 64), y32)


def test_w8a8_rows_are_independent_and_chunking_is_exact(monkeypatch):
    """Per-token scales: a row's output does not depend on other rows (also across chunks)."""
    import nemo_fp8.fp8.linear as linear_mod

    torch.manual_seed(1)
    x = torch.randn(50, 384)
    qw, w_s = quantize_weight_blockwise(torch.randn(96, 384))
    full = w8a8_block_linear(x, qw, w_s)
    monkeypatch.setattr(linear_mod, "_MAX_PARTIAL_ELEMENTS", 3 * 96 * 7)  # 7-row chunks
    chunked = w8a8_block_linear(x, qw, w_s)
    # BLAS may order the 128-term sums differently for other row counts: fp32 rounding only
    torch.testing.assert_close(chunked, full, rtol=1e-6, atol=1e-5)
    x2 = x.clone()
    x2[10] *= 1000.0
    y2 = w8a8_block_linear(x2, qw, w_s)
    rows = torch.arange(50) != 10
    torch.testing.assert_close(y2[rows], full[rows], rtol=1e-6, atol=1e-5)


def test_w8a8_shape_errors_name_both_shapes():
    qw, w_s = quantize_weight_blockwise(torch.randn(64, 256))
    with pytest.raises(ValueError, match=r"\(3, 100\).*\(64, 256\)"):
        w8a8_block_linear(torch.randn(3, 100), qw, w_s)
    with pytest.raises(ValueError, match="weight_scale_inv"):
        w8a8_block_linear(torch.randn(3, 256), qw, w_s[:, :1])
    with pytest.raises(ValueError, match="fp8"):
        w8a8_block_linear(torch.randn(3, 256), qw.float(), w_s)
    with pytest.raises(ValueError, match="bias"):
        w8a8_block_linear(torch.randn(3, 256), qw, w_s, torch.zeros(65))


# ----------------------------------------------------------------------------- module


def test_fp8_block_linear_from_linear_matches_functional():
    torch.manual_seed(2)
    lin = torch.nn.Linear(300, 200).bfloat16()
    fl = Fp8BlockLinear.from_linear(lin)
    assert fl.weight.dtype == torch.float8_e4m3fn and fl.weight.shape == (200, 300)
    assert fl.weight_scale_inv.dtype == torch.float32 and fl.weight_scale_inv.shape == (2, 3)
    assert fl.bias.dtype == torch.bfloat16
    assert set(fl.state_dict()) == {"weight", "weight_scale_inv", "bias"}
    assert "weight_block_size=[128, 128]" in repr(fl)
    x = torch.randn(7, 300).bfloat16()
    y = fl(x)
    qw, w_s = quantize_weight_blockwise(lin.weight)
    assert torch.equal(fl.weight.view(torch.uint8), qw.view(torch.uint8))
    assert torch.equal(y, w8a8_block_linear(x, qw, w_s, lin.bias))
    ref = lin(x).float()
    assert ((y.float() - ref).norm() / ref.norm()).item() < 0.06  # e4m3 x2 plus bf16 output rounding


def test_load_weight_is_in_place_and_matches_fresh_quantization():
    torch.manual_seed(3)
    lin = torch.nn.Linear(256, 130, bias=False)
    fl = Fp8BlockLinear.from_linear(lin, weight_scale_mode="pow2")
    ptr_w, ptr_s = fl.weight.data_ptr(), fl.weight_scale_inv.data_ptr()
    old_bits = fl.weight.view(torch.uint8).clone()

    new_w = torch.randn(130, 256) * 3
    fl.load_weight(new_w)
    assert fl.weight.data_ptr() == ptr_w and fl.weight_scale_inv.data_ptr() == ptr_s
    qw, w_s = quantize_weight_blockwise(new_w, scale_mode="pow2")
    assert torch.equal(fl.weight.view(torch.uint8), qw.view(torch.uint8))
    assert torch.equal(fl.weight_scale_inv, w_s)
    assert not torch.equal(fl.weight.view(torch.uint8), old_bits)

    with pytest.raises(ValueError, match=r"\(256, 130\).*\(130, 256\)"):
        fl.load_weight(torch.randn(256, 130))
    with pytest.raises(ValueError, match="bias=False"):
        fl.load_bias(torch.zeros(130))
    with pytest.raises(ValueError, match="weight"):
        fl.load_weight(torch.full((130, 256), float("nan")))


def test_load_bias_in_place():
    fl = Fp8BlockLinear(16, 8, bias=True, dtype=torch.float32)
    ptr = fl.bias.data_ptr()
    fl.load_bias(torch.arange(8.0))
    assert fl.bias.data_ptr() == ptr and fl.bias.tolist() == list(map(float, range(8)))
    with pytest.raises(ValueError, match=r"\(9,\)"):
        fl.load_bias(torch.zeros(9))
