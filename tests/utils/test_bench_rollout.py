"""CPU tests of ``tools/bench_rollout.py``'s pure part: the engine configs of its precisions and the table."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

_PATH = Path(__file__).resolve().parents[2] / "tools" / "bench_rollout.py"
_spec = importlib.util.spec_from_file_location("bench_rollout", _PATH)
br = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("bench_rollout", br)  # its dataclasses look their module up there
_spec.loader.exec_module(br)


def _engine(act, kv="auto"):
    return {"gpu_memory_utilization": 0.9, "max_num_seqs": 512, "max_num_batched_tokens": 16384,
            "max_model_len": 2320, "kv_cache_dtype": kv, "attn_impl": "FlashAttentionImpl", "fa_version": 3,
            "fp8_query": kv == "fp8", "act_scales": act}


def test_deepgemm_engines_differ_only_in_vllms_fused_act_quant():
    from nemo_fp8.generation.vllm.engine_args import build_engine_spec

    dense = {"model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512}
    ours, fused = (br.engine_config(p, 0.9, 2320) for p in ("fp8-deepgemm", "fp8-deepgemm-fused"))
    assert ours == fused and ours.pow2_activation_scaling_factors and ours.use_deep_gemm
    assert "compilation_config" in build_engine_spec(ours, dense).engine_kwargs  # dropped for -fused by engine_spec
    assert br.PRECISIONS["fp8-deepgemm-fused"].vllm_act_quant_fusion
    fused_kv = br.PRECISIONS["fp8-deepgemm-fused-kv"]
    assert fused_kv.vllm_act_quant_fusion and fused_kv.kv_cache_dtype == "fp8" and fused_kv.linear_baseline == "fp8-deepgemm-fused"
    assert not any(p.vllm_act_quant_fusion for k, p in br.PRECISIONS.items() if not k.startswith("fp8-deepgemm-fused"))


def test_table_ratios_and_live_activation_scales(capsys):
    a = SimpleNamespace(num_prompts=512, input_len=256, output_len=2048, rl_prompts=32, rl_samples=32, num_layers={})
    rows = [
        {"model": "dense", "precision": "bf16", "fixed_tok_s": 10000.0, "rl_tok_s": 8000.0, "kv_tokens": 800000,
         "weight_gib": 15.3, "start_s": 60.0, "engine": _engine("none")},
        {"model": "dense", "precision": "fp8-deepgemm", "fixed_tok_s": 11500.0, "rl_tok_s": 8000.0,
         "kv_tokens": 840000, "weight_gib": 8.8, "start_s": 65.0, "engine": _engine("pow2")},
        {"model": "dense", "precision": "fp8-deepgemm-fused", "fixed_tok_s": 12000.0, "rl_tok_s": 8800.0,
         "kv_tokens": 840000, "weight_gib": 8.8, "start_s": 65.0, "engine": _engine("mixed")},
        {"model": "dense", "precision": "fp8-deepgemm-kv", "fixed_tok_s": 16100.0, "rl_tok_s": 8400.0,
         "kv_tokens": 1680000, "weight_gib": 8.8, "start_s": 70.0, "engine": _engine("pow2", "fp8")},
    ]
    br.print_table(rows, a)
    out = capsys.readouterr().out
    lines = {ln.split()[1]: ln for ln in out.splitlines() if ln.startswith("dense ")}
    assert "like-for-like" in out and "NOT like-for-like" not in out
    assert lines["fp8-deepgemm"].split()[2:4] == ["11500", "1.150"] and "act=pow2" in lines["fp8-deepgemm"]
    assert lines["fp8-deepgemm-fused"].split()[2:4] == ["12000", "1.200"] and "act=mixed" in lines["fp8-deepgemm-fused"]
    kv = lines["fp8-deepgemm-kv"].split()
    assert kv[2:5] == ["16100", "1.610", "1.400"] and kv[8:11] == ["1680000", "2.100", "2.000"]  # x bf16, x fp8-deepgemm
