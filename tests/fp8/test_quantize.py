"""FP8 formats and scaled quantization, checked against float64 references.

Error model used by the bounds below (OCP FP8 spec; Micikevicius et al. 2022):
e4m3 has 3 mantissa bits, so round-to-nearest of a *normal* value has relative
error <= 2^-4. After dividing by scale_inv, values below the smallest normal 2^-6
are subnormal with spacing 2^-9, so their absolute error is <= 2^-10 * scale_inv.
Hence for every element: |dequant - x| <= 2^-4 * |x| + 2^-10 * scale_inv.
"""

import math

import pytest
import torch

from nemo_fp8.fp8 import (
    E4M3,
    E5M2,
    cast_to_fp8,
    check_finite,
    compute_scale_inv,
    dequantize,
    dequantize_activation_per_group,
    dequantize_per_channel,
    dequantize_per_tensor,
    dequantize_weight_blockwise,
    get_format,
    quantize_activation_per_group,
    quantize_dequantize,
    quantize_per_channel,
    quantize_per_tensor,
    quantize_weight_blockwise,
)

U = 2.0**-4  # e4m3 unit roundoff (normal values)
SUB = 2.0**-10  # half the e4m3 subnormal spacing, in units of scale_inv


def _expand_block_scales(scale_inv, shape, block):
    s = scale_inv.double().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return s[: shape[0], : shape[1]]


def _all_e4m3_values() -> torch.Tensor:
    """All 254 finite e4m3 values (bit patterns 0..255 minus the two NaNs), as fp32."""
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    vals = bits.view(torch.float8_e4m3fn).float()
    return vals[~torch.isnan(vals)]


# ----------------------------------------------------------------------------- formats


def test_formats_match_torch_finfo():
    assert E4M3.max == torch.finfo(torch.float8_e4m3fn).max == 448.0
    assert E5M2.max == torch.finfo(torch.float8_e5m2).max == 57344.0
    assert get_format("e4m3") is E4M3 and get_format("E5M2") is E5M2


def test_get_format_unknown_lists_valid_names():
    with pytest.raises(ValueError, match=r"e4m3.*e5m2"):
        get_format("e3m4")


def test_cast_to_fp8_saturates_instead_of_nan():
    x = torch.tensor([1000.0, -1e6, 448.0, 3.0])
    assert cast_to_fp8(x, E4M3).float().tolist() == [448.0, -448.0, 448.0, 3.0]
    y = cast_to_fp8(torch.tensor([1e6, -1e9]), E5M2).float()
    assert y.tolist() == [57344.0, -57344.0]


# ----------------------------------------------------------------------------- scales


def test_compute_scale_inv_fp32_and_zero():
    amax = torch.tensor([448.0, 1.0, 0.0, 896.0])
    s = compute_scale_inv(amax, E4M3, "fp32")
    assert s.dtype == torch.float32 and s.shape == amax.shape
    torch.testing.assert_close(s, torch.tensor([1.0, 1.0 / 448.0, 1.0, 2.0]))


def test_compute_scale_inv_pow2_is_smallest_power_of_two_that_fits():
    torch.manual_seed(0)
    amax = torch.cat([torch.rand(1000) * 10.0 ** torch.randint(-20, 20, (1000,)).float(),
                      torch.tensor([448.0, 448.0 * 2**-7, 449.0, 447.99])])
    for fmt in (E4M3, E5M2):
        s = compute_scale_inv(amax, fmt, "pow2").double()
        mantissa, _ = torch.frexp(s)
        assert torch.all(mantissa == 0.5), "pow2 scales must be exact powers of two"
        a = amax.double()
        assert torch.all(a / s <= fmt.max)  # nothing saturates
        assert torch.all(a / (s / 2) > fmt.max)  # and the next smaller power would
    assert compute_scale_inv(torch.tensor([448.0, 449.0]), E4M3, "pow2").tolist() == [1.0, 2.0]


def test_compute_scale_inv_rejects_bad_mode():
    with pytest.raises(ValueError, match="scale_mode"):
        compute_scale_inv(torch.ones(1), E4M3, "e8m0")


def test_check_finite_names_tensor_and_counts():
    x = torch.tensor([1.0, float("nan"), float("inf"), float("-inf")])
    with pytest.raises(ValueError, match=r"my_tensor has 1 NaN and 2 Inf"):
        check_finite(x, "my_tensor")
    check_finite(torch.ones(3), "fine")  # no raise


# ----------------------------------------------------------------------------- blockwise weights


@pytest.mark.parametrize("scale_mode", ["fp32", "pow2"])
@pytest.mark.parametrize("shape", [(1, 1), (127, 129), (256, 384), (300, 200)])
def test_weight_blockwise_roundtrip_error_bound(shape, scale_mode):
    torch.manual_seed(1)
    w = torch.randn(shape, dtype=torch.float64).float() * 0.02
    q, s = quantize_weight_blockwise(w, (128, 128), scale_mode=scale_mode)
    M, N = shape
    assert q.dtype == torch.float8_e4m3fn and q.shape == (M, N)
    assert s.dtype == torch.float32 and s.shape == (math.ceil(M / 128), math.ceil(N / 128))
    deq = dequantize_weight_blockwise(q, s, (128, 128), dtype=torch.float64)
    s_full = _expand_block_scales(s, shape, (128, 128))
    err = (deq - w.double()).abs()
    bound = U * w.double().abs() + SUB * s_full
    assert torch.all(err <= bound * (1 + 1e-6))
    # measured: ~0.026 relative Frobenius error (uniform rounding of 3 mantissa bits);
    # 2^-4 / sqrt(3) = 0.036 would be the RMS if every value sat at the bottom of its binade.
    assert (deq - w.double()).norm() / w.double().norm() < 0.036


def test_weight_blockwise_large_shape():
    """4096 x 11008 (Llama-7B MLP): shapes, scales, and the per-element bound in fp32."""
    torch.manual_seed(2)
    w = torch.randn(4096, 11008) * 0.02
    q, s = quantize_weight_blockwise(w)
    assert q.shape == (4096, 11008) and s.shape == (32, 86)
    deq = dequantize_weight_blockwise(q, s)
    # per-element bound, checked on a 128-wide column strip that includes the ragged last block
    # (11008 = 86 * 128) plus the relative error of the whole matrix (measured 0.026)
    strip = slice(11008 - 256, 11008)
    s_full = s[:, -2:].repeat_interleave(128, 0).repeat_interleave(128, 1)
    err = (deq[:, strip] - w[:, strip]).abs()
    assert bool(torch.all(err <= (U * w[:, strip].abs() + SUB * s_full) * (1 + 1e-5)))
    assert ((deq - w).norm() / w.norm()).item() < 0.03


def test_weight_not_divisible_padding_does_not_change_scales():
    torch.manual_seed(3)
    w = torch.randn(130, 250)
    q, s = quantize_weight_blockwise(w)
    # amax of each (cropped) block, computed independently
    expected = torch.empty(2, 2)
    for i in range(2):
        for j in range(2):
            expected[i, j] = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].abs().max()
    # per_block_cast_to_fp8 on CUDA: amax * fp32(1/448), not amax / 448 (see quantize.py)
    torch.testing.assert_close(s, expected * torch.tensor(1.0 / 448.0), rtol=0, atol=0)


def test_representable_values_roundtrip_bitwise():
    """e4m3 values with amax 448 (fp32 scale exactly 1) and x 2^k (pow2 scale 2^k) are exact."""
    vals = _all_e4m3_values()  # includes +-448, +-0, subnormals
    w = vals[torch.randperm(vals.numel(), generator=torch.Generator().manual_seed(0))]
    w = torch.cat([w, w.flip(0)]).reshape(4, 127)  # one 128x128 block
    assert w.abs().max() == 448.0
    q, s = quantize_weight_blockwise(w, scale_mode="fp32")
    assert s.item() == 1.0
    assert torch.equal(q.view(torch.uint8), w.to(torch.float8_e4m3fn).view(torch.uint8))
    for k in (-20, -3, 5):
        for mode in ("fp32", "pow2"):
            q2, s2 = quantize_weight_blockwise(w * 2.0**k, scale_mode=mode)
            assert s2.item() == 2.0**k
            assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(dequantize_weight_blockwise(q2, s2), w * 2.0**k)


def test_pow2_nothing_clips():
    torch.manual_seed(4)
    w = torch.randn(384, 256) * torch.logspace(-6, 3, 384).unsqueeze(1)
    q, s = quantize_weight_blockwise(w, scale_mode="pow2")
    s_full = _expand_block_scales(s, w.shape, (128, 128))
    scaled = w.double() / s_full  # exact: dividing by a power of two
    assert scaled.abs().max() <= 448.0
    assert torch.all(torch.frexp(s)[0] == 0.5)
    # pow2 scales leave headroom: block amax / scale_inv lies in (224, 448]
    block_amax = w.abs().reshape(3, 128, 2, 128).amax(dim=(1, 3)).double()
    ratio = block_amax / s.double()
    assert torch.all((ratio > 224) & (ratio <= 448))


def test_outlier_changes_only_its_block():
    torch.manual_seed(5)
    w = torch.randn(256, 384)
    q0, s0 = quantize_weight_blockwise(w)
    w_out = w.clone()
    w_out[130, 300] = 1e4  # block (1, 2)
    q1, s1 = quantize_weight_blockwise(w_out)
    changed = s1 != s0
    assert changed[1, 2] and changed.sum() == 1
    diff = (q1.view(torch.uint8) != q0.view(torch.uint8)).reshape(2, 128, 3, 128).any(dim=(1, 3))
    assert diff[1, 2] and diff.sum() == 1


def test_all_zero_block_gets_floored_scale():
    """vLLM per_block_cast_to_fp8 floors the block amax at 1e-4 (was: special case scale 1)."""
    w = torch.randn(256, 256)
    w[:128, 128:] = 0.0
    expected = {"fp32": (torch.tensor(1e-4) * torch.tensor(1.0 / 448.0)).item(), "pow2": 2.0**-22}
    for mode in ("fp32", "pow2"):
        q, s = quantize_weight_blockwise(w, scale_mode=mode)
        assert s[0, 1].item() == expected[mode]
        assert torch.all(q[:128, 128:].float() == 0)
    q, s = quantize_weight_blockwise(torch.zeros(3, 5))
    assert s.tolist() == [[expected["fp32"]]] and torch.all(q.float() == 0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_inputs_raise_with_name(bad):
    x = torch.randn(4, 256)
    x[2, 7] = bad
    with pytest.raises(ValueError, match="layers.3.mlp.up_proj.weight"):
        quantize_weight_blockwise(x, name="layers.3.mlp.up_proj.weight")
    with pytest.raises(ValueError, match="hidden_states"):
        quantize_activation_per_group(x, name="hidden_states")
    with pytest.raises(ValueError, match="t_name"):
        quantize_per_tensor(x, name="t_name")
    with pytest.raises(ValueError, match="c_name"):
        quantize_per_channel(x, name="c_name")
    with pytest.raises(ValueError, match="qdq_name"):
        quantize_dequantize(x, "group", name="qdq_name")


def test_weight_blockwise_rejects_bad_inputs():
    with pytest.raises(ValueError, match="2-D"):
        quantize_weight_blockwise(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="dtype"):
        quantize_weight_blockwise(torch.ones(2, 2).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="weight_block_size"):
        quantize_weight_blockwise(torch.ones(2, 2), (0, 128))
    q, s = quantize_weight_blockwise(torch.ones(200, 200))
    with pytest.raises(ValueError, match="expected"):
        dequantize_weight_blockwise(q, s[:1])


def test_weight_blockwise_bf16_input_and_block_size():
    torch.manual_seed(6)
    w = torch.randn(64, 96).bfloat16()
    q, s = quantize_weight_blockwise(w, (32, 64))
    assert s.shape == (2, 2)
    deq = dequantize_weight_blockwise(q, s, (32, 64), dtype=torch.float64)
    s_full = _expand_block_scales(s, w.shape, (32, 64))
    assert torch.all((deq - w.double()).abs() <= (U * w.double().abs() + SUB * s_full) * (1 + 1e-6))


# ----------------------------------------------------------------------------- activations


@pytest.mark.parametrize("shape,group", [((3, 5, 300), 128), ((7, 256), 128), ((1, 1), 128), ((4, 100), 32)])
def test_activation_groups_roundtrip(shape, group):
    torch.manual_seed(7)
    x = torch.randn(shape) * 3
    q, s = quantize_activation_per_group(x, group)
    G = math.ceil(shape[-1] / group)
    assert q.shape == x.shape and q.dtype == torch.float8_e4m3fn
    assert s.shape == (*shape[:-1], G) and s.dtype == torch.float32
    deq = dequantize_activation_per_group(q, s, group, dtype=torch.float64)
    s_full = s.double().repeat_interleave(group, -1)[..., : shape[-1]]
    assert torch.all((deq - x.double()).abs() <= (U * x.double().abs() + SUB * s_full) * (1 + 1e-6))
    # each group's scale is its own amax / 448
    xp = torch.nn.functional.pad(x, (0, G * group - shape[-1])).reshape(*shape[:-1], G, group)
    torch.testing.assert_close(s, xp.abs().amax(-1) / 448.0, rtol=0, atol=0)


def test_activation_outlier_isolated_to_its_group():
    torch.manual_seed(8)
    x = torch.randn(4, 512)
    q0, s0 = quantize_activation_per_group(x)
    x[1, 200] = 5e3  # row 1, group 1
    q1, s1 = quantize_activation_per_group(x)
    assert (s1 != s0).nonzero().tolist() == [[1, 1]]
    diff = (q1.view(torch.uint8) != q0.view(torch.uint8)).reshape(4, 4, 128).any(-1)
    assert diff.nonzero().tolist() == [[1, 1]]


# ----------------------------------------------------------------------------- tensor / channel


def test_per_tensor_and_per_channel():
    torch.manual_seed(9)
    x = torch.randn(16, 64) * torch.logspace(-5, 1, 16).unsqueeze(1)
    x[3] = 0.0
    q, s = quantize_per_tensor(x)
    assert s.shape == () and s.item() == pytest.approx(x.abs().max().item() / 448.0)
    deq = dequantize_per_tensor(q, s, dtype=torch.float64)
    assert torch.all((deq - x.double()).abs() <= U * x.double().abs() + SUB * s.double() + 1e-12)

    qc, sc = quantize_per_channel(x)
    assert sc.shape == (16, 1) and sc[3].item() == 1.0
    torch.testing.assert_close(sc[:, 0][sc[:, 0] != 1], (x.abs().amax(1) / 448.0)[x.abs().amax(1) > 0])
    deqc = dequantize_per_channel(qc, sc, dtype=torch.float64)
    assert torch.all((deqc - x.double()).abs() <= U * x.double().abs() + SUB * sc.double() + 1e-12)
    # rows 6 orders of magnitude apart: per tensor, row 0 (|x| ~ 1e-5, scaled to
    # ~1.5e-4 < 2^-10) flushes to zero; per channel it keeps ~2.6% relative error.
    row0 = x[0].double()
    assert (deq[0] - row0).norm() / row0.norm() > 0.99
    assert (deqc[0] - row0).norm() / row0.norm() < 0.05
    torch.testing.assert_close(dequantize(qc, sc), deqc.float())
    with pytest.raises(ValueError, match="broadcast"):
        dequantize(qc, torch.ones(3, 1))


# ----------------------------------------------------------------------------- fake quant


@pytest.mark.parametrize("granularity", ["tensor", "channel", "group", "block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_dequantize_matches_explicit_path(granularity, dtype):
    torch.manual_seed(10)
    x = (torch.randn(130, 300) * 2).to(dtype)
    y = quantize_dequantize(x, granularity)
    assert y.dtype == dtype and y.shape == x.shape
    if granularity == "tensor":
        ref = dequantize_per_tensor(*quantize_per_tensor(x))
    elif granularity == "channel":
        ref = dequantize_per_channel(*quantize_per_channel(x))
    elif granularity == "group":
        ref = dequantize_activation_per_group(*quantize_activation_per_group(x))
    else:
        ref = dequantize_weight_blockwise(*quantize_weight_blockwise(x))
    assert torch.equal(y, ref.to(dtype))
    assert not torch.equal(y, x)  # it really quantized


def test_quantize_dequantize_rejects_unknown_granularity():
    with pytest.raises(ValueError, match="granularity"):
        quantize_dequantize(torch.ones(4, 4), "row")


# ----------------------------------------------------------------------------- vLLM 0.22 bit-exactness
#
# Reference transcriptions of the quantizers vLLM 0.22 runs on the tensors we hand it.


def _ref_ceil_to_ue8m0(x: torch.Tensor) -> torch.Tensor:
    """DeepGEMM deep_gemm/utils/math.py `ceil_to_ue8m0` (bundled in vllm/third_party/deep_gemm)."""
    bits = x.abs().float().view(torch.int)
    exp = ((bits >> 23) & 0xFF) + (bits & 0x7FFFFF).bool().int()
    return (exp.clamp(1, 254) << 23).view(torch.float)


def _ref_per_block_cast_to_fp8(x, block_size=(128, 128), use_ue8m0=False):
    """vllm/utils/deep_gemm.py `per_block_cast_to_fp8` (vLLM 0.22), line by line.

    One change: `x_amax / fp8_max` is written `x_amax * (1.0 / fp8_max)`, which is what
    PyTorch computes for a CUDA tensor divided by a Python float (BinaryDivTrueKernel.cu;
    Inductor lowers division by a constant the same way), so this CPU transcription gives
    the GPU's bits. `_ceil_to_ue8m0` is torch.pow(2.0, torch.ceil(torch.log2(x.abs()))).
    """
    fp8_dtype = torch.float8_e4m3fn
    m, n = x.shape
    block_m, block_n = block_size
    align = lambda a, b: -(-a // b) * b  # noqa: E731
    x_padded = torch.zeros((align(m, block_m), align(n, block_n)), dtype=x.dtype)
    x_padded[:m, :n] = x
    x_view = x_padded.view(-1, block_m, x_padded.size(1) // block_n, block_n)
    x_amax = x_view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    fp8_max = torch.finfo(fp8_dtype).max
    sf = x_amax * torch.tensor(1.0 / fp8_max, dtype=torch.float32)
    sf = torch.pow(2.0, torch.ceil(torch.log2(sf.abs()))) if use_ue8m0 else sf
    x_scaled = (x_view * (1.0 / sf)).to(fp8_dtype)
    return x_scaled.view_as(x_padded)[:m, :n].contiguous(), sf.view(x_view.size(0), x_view.size(2))


def _ref_per_token_group_quant(x, group_size=128, eps=1e-10, use_ue8m0=False):
    """vLLM 0.22 per_token_group_quant.cu `per_token_group_quant_8bit_kernel` (the CUDA path of
    fp8_utils.per_token_group_quant_fp8), element for element in float32:

        float local_absmax = eps;  local_absmax = fmaxf(local_absmax, fabsf((float)x));
        float y_s = local_absmax / max_8bit;
        if (SCALE_UE8M0) y_s = exp2f(ceilf(log2f(fmaxf(fabsf(y_s), 1e-10f))));
        q = __nv_fp8_e4m3(fminf(fmaxf((float)x / y_s, min_8bit), max_8bit));  // RNE, satfinite
    """
    xf = x.float().view(*x.shape[:-1], -1, group_size)
    eps32 = torch.tensor(eps, dtype=torch.float32)
    absmax = torch.maximum(xf.abs().amax(-1), eps32)
    y_s = absmax / torch.tensor(448.0)
    if use_ue8m0:
        y_s = torch.exp2(torch.ceil(torch.log2(torch.maximum(y_s.abs(), torch.tensor(1e-10, dtype=torch.float32)))))
    q = (xf / y_s.unsqueeze(-1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(x.shape), y_s


def _bits(q):
    return q.view(torch.uint8)


def _weights_for_bitexact():
    torch.manual_seed(11)
    w = torch.randn(384, 640) * torch.logspace(-7, 2, 384).unsqueeze(1)
    w[:128, 128:256] = 0.0  # zero block
    w[128:256, :128] *= 1e-6  # tiny block, amax < 1e-4
    w[256:, 512:] = torch.tensor(3.1875)  # constant block: x / sf exactly representable
    return w


@pytest.mark.parametrize("scale_mode", ["fp32", "pow2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weight_blockwise_bitexact_with_per_block_cast_to_fp8(scale_mode, dtype):
    w = _weights_for_bitexact().to(dtype)
    q, s = quantize_weight_blockwise(w, scale_mode=scale_mode)
    q_ref, s_ref = _ref_per_block_cast_to_fp8(w, use_ue8m0=scale_mode == "pow2")
    assert torch.equal(s, s_ref)
    assert torch.equal(_bits(q), _bits(q_ref))
    # tiny block: the 1e-4 floor sets the scale, not the block's own amax
    assert s[1, 0].item() == s[0, 1].item() and w[128:256, :128].abs().max() < 1e-4


def test_weight_pow2_scale_matches_deepgemm_bit_ceil_and_requant_is_stable():
    """pow2 weights survive vLLM's UE8M0 requantization (requant_weight_ue8m0_inplace):
    dequantize with our scales, per_block_cast_to_fp8(use_ue8m0=True), same values back."""
    w = _weights_for_bitexact().bfloat16()
    q, s = quantize_weight_blockwise(w, scale_mode="pow2")
    amax = torch.nn.functional.pad(w.float(), (0, 0, 0, 0)).abs().reshape(3, 128, 5, 128).amax(dim=(1, 3))
    assert torch.equal(s, _ref_ceil_to_ue8m0(amax.clamp(1e-4) * torch.tensor(1.0 / 448.0)))
    w_dq = dequantize_weight_blockwise(q, s)
    q2, s2 = _ref_per_block_cast_to_fp8(w_dq, use_ue8m0=True)
    assert torch.equal(dequantize_weight_blockwise(q2, s2), w_dq)


@pytest.mark.parametrize("scale_mode", ["fp32", "pow2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_activation_groups_bitexact_with_vllm_cuda_kernel(scale_mode, dtype):
    torch.manual_seed(12)
    x = torch.randn(6, 512) * torch.logspace(-14, 3, 6).unsqueeze(1)
    x[0, :128] = 0.0  # zero group
    x[1, 128:256] = 3e-11  # tiny group: amax below eps = 1e-10
    x = x.to(dtype)
    q, s = quantize_activation_per_group(x, 128, scale_mode=scale_mode)
    q_ref, s_ref = _ref_per_token_group_quant(x, 128, use_ue8m0=scale_mode == "pow2")
    assert torch.equal(s, s_ref)
    assert torch.equal(_bits(q), _bits(q_ref))
    zero_scale = {"fp32": (torch.tensor(1e-10) / torch.tensor(448.0)).item(), "pow2": 2.0**-33}[scale_mode]
    assert s[0, 0].item() == zero_scale and torch.all(q[0, :128].float() == 0)
    if dtype == torch.float32:  # tiny group uses the eps floor (bf16/fp16 round 3e-11 differently)
        assert s[1, 1].item() == zero_scale


def test_activation_exact_midpoints_divide_not_multiply():
    """bf16 values with x / y_s exactly on an e4m3 midpoint: vLLM's kernel divides (ties to even);
    multiplying by fp32(1 / y_s) moves them off the midpoint and rounds some the other way."""
    vals = torch.arange(0x3C00, 0x4400, dtype=torch.int16).view(torch.bfloat16)  # [2^-7, 2^8)
    amax = torch.tensor(276.0, dtype=torch.bfloat16)  # y_s = 276 / 448 is not a power of two
    n = vals.numel()
    x = torch.cat([vals, amax.expand((-n) % 128 + 128)]).reshape(-1, 128)
    x[:, -1] = amax  # every group has amax 276
    q, s = quantize_activation_per_group(x)
    q_ref, s_ref = _ref_per_token_group_quant(x)
    assert torch.equal(s, s_ref) and torch.equal(_bits(q), _bits(q_ref))
    q_mul = (x.float() * (1.0 / s.unsqueeze(-1).repeat_interleave(128, -1))).to(torch.float8_e4m3fn)
    assert (_bits(q_mul) != _bits(q)).sum() > 0  # the test does exercise the difference


def test_weight_scale_multiplies_by_reciprocal():
    """fp32 weight scales: amax * fp32(1/448) (PyTorch CUDA / Inductor), which differs from
    amax / 448 in the last bit for about half of the bf16 amax values."""
    amax = torch.arange(0x3F80, 0x4000, dtype=torch.int16).view(torch.bfloat16)  # all mantissas
    w = torch.zeros(128, 128 * amax.numel(), dtype=torch.bfloat16)
    w[0] = amax.repeat_interleave(128)
    _, s = quantize_weight_blockwise(w)
    a = amax.float()
    assert torch.equal(s[0], a * torch.tensor(1.0 / 448.0))
    assert (s[0] != a / 448.0).sum() > 0
