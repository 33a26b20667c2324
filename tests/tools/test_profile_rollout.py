"""CPU tests of ``tools/profile_rollout.py``'s pure part: kernel categories, per-step sums, the table."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "tools" / "profile_rollout.py"
_spec = importlib.util.spec_from_file_location("profile_rollout", _PATH)
pr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pr)


@pytest.mark.parametrize("name, want", [
    ("void cutlass::device_kernel<cutlass_3x_gemm_fp8_blockwise_sm90>", "gemm"),
    ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTT", "gemm"),
    ("deep_gemm::sm90_fp8_gemm_1d2d_impl<128, 128>", "gemm"),
    ("void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits>", "attention"),
    ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16>", "attention"),
    ("_per_token_group_quant_fp8", "quant"),
    ("void vllm::rms_norm_static_fp8_quant_kernel<c10::BFloat16>", "quant"),  # fused norm + quant: quant
    ("void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>", "norm_act"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm_act"),
    # Inductor's group quantizer fused into SiLU (custom_ops -quant_fp8), named after the GEMM op it feeds
    ("triton_red_fused__to_copy_abs_ceil_clamp_div_exp2_fp8_gemm_nt_op_log2_max_mul_silu_slice_s", "quant"),
    ("triton_poi_fused__to_copy_ceil_clamp_div_exp2_fp8_gemm_nt_op_log2_mul_silu_slice_squeeze_t", "quant"),
    ("void vllm::act_and_mul_kernel<silu_kernel>", "norm_act"),
    ("void vllm::rotary_embedding_kernel<c10::BFloat16, true>", "norm_act"),
    ("fused_moe_kernel", "moe"),
    ("deep_gemm::sm90_m_grouped_fp8_gemm_contiguous", "moe"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>", "sampler"),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>", "sampler"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "other"),
    # TransformerEngine's training kernels (tools/bench_train.py --profile)
    ("void transformer_engine::detail::cast_transpose_kernel<8, 4, __nv_bfloat16>", "quant"),
    ("void transformer_engine::block_scaled_1d_cast_transpose_kernel<...>", "quant"),
    ("void transformer_engine::amax_kernel<4, float>", "quant"),
    ("void moe_permute_row_map(int const*, int*, int, int, int)", "moe"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "attention"),
])
def test_kernels_fall_in_their_category(name, want):
    assert pr.categorize(name) == want


def test_summary_is_per_step_milliseconds_and_host_is_the_uncovered_wall_time():
    kernels = [("nvjet_gemm_a", 4000.0), ("flash_fwd", 1000.0), ("_per_token_group_quant_fp8", 500.0),
               ("memcpy_like", 500.0)]
    s = pr.summarize(kernels, wall_s=0.010, steps=2)  # 6 ms of kernels in 10 ms over 2 steps
    assert s["gemm"] == pytest.approx(2.0) and s["attention"] == pytest.approx(0.5)
    assert s["quant"] == pytest.approx(0.25) and s["other"] == pytest.approx(0.25) and s["moe"] == 0.0
    assert s["gpu"] == pytest.approx(3.0) and s["wall"] == pytest.approx(5.0) and s["host"] == pytest.approx(2.0)
    assert s["top"][0] == ["nvjet_gemm_a", "gemm", pytest.approx(2.0)]
    assert pr.summarize([("k", 9e6)], wall_s=1.0, steps=1)["host"] == 0.0  # overlapping streams: never negative
    with pytest.raises(ValueError, match="steps"):
        pr.summarize(kernels, 1.0, 0)


def test_table_gives_each_category_its_ratio_to_bf16_and_shows_failures():
    bf16 = pr.summarize([("nvjet_gemm", 8000.0), ("flash_fwd", 2000.0)], 0.012, 1)
    fp8 = pr.summarize([("cutlass_gemm_fp8", 5000.0), ("flash_fwd", 2000.0), ("_per_token_group_quant_fp8", 600.0)],
                       0.0096, 1)
    rows = [{"precision": "bf16", "profile": bf16}, {"precision": "fp8-cutlass", "profile": fp8},
            {"precision": "fp8-deepgemm", "error": "RuntimeError: engine failed"}]
    table = pr.format_table(rows)
    line = {ln.split()[0]: ln.split()[1:] for ln in table.splitlines()[1:] if ln and not ln.startswith("fp8-")}
    assert float(line["gemm"][0]) == pytest.approx(8.0) and float(line["gemm"][2]) == pytest.approx(5 / 8, abs=1e-3)
    assert math.isnan(float(line["quant"][2]))  # BF16 has no activation quantization: no ratio
    assert float(line["host"][2]) == pytest.approx(2.0 / 2.0, abs=1e-3)
    assert "fp8-deepgemm: RuntimeError: engine failed" in table
