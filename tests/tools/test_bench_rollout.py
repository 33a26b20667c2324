"""CPU tests of ``tools/bench_rollout.py``'s pure part: the engine configs of its precisions and the table."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

_PATH = Path(__file__).resolve().parents[2] / "tools" / "bench_rollout.py"
_spec = importlib.util.spec_from_file_location("bench_rollout", _PATH)
br = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("bench_rollout", br)  # its dataclasses look their module up there
_spec.loader.exec_module(br)


def _engine(act, kv="auto"):
    return {"gpu_memory_utilization": 0.9, "max_num_seqs": 512, "max_num_batched_tokens": 16384,
            "max_model_len": 2320, "kv_cache_dtype": kv, "attn_impl": "FlashAttentionImpl", "fa_version": 3,
            "fp8_query": kv == "fp8", "act_scales": act}


def test_ab_engines_differ_from_ours_in_one_setting():
    from nemo_fp8.generation.vllm.engine_args import build_engine_spec
    from tests.generation.test_vllm_engine_args import DENSE, MOE

    off = {"pass_config": {"fuse_act_quant": False, "fuse_norm_quant": False}}

    def kwargs(precision, shape=DENSE):
        cfg = br.engine_config(precision, 0.9, 2320)
        return br.ab_engine_kwargs(precision, build_engine_spec(cfg, shape).engine_kwargs)

    ours = kwargs("fp8-deepgemm")
    assert ours["compilation_config"] == off and br.engine_config("fp8-deepgemm", 0.9, 2320).pow2_activation_scaling_factors
    # vLLM's fused act/norm-quant kernels: the only change is the dropped compilation config
    fused = kwargs("fp8-deepgemm-fused")
    assert "compilation_config" not in fused and {**fused, "compilation_config": off} == ours
    assert kwargs("fp8-deepgemm-fused-kv")["kv_cache_dtype"] == "fp8" and "compilation_config" not in kwargs("fp8-deepgemm-fused-kv")
    assert br.PRECISIONS["fp8-deepgemm-fused-kv"].linear_baseline == "fp8-deepgemm-fused"
    assert not any(p.vllm_act_quant_fusion for k, p in br.PRECISIONS.items() if "fused" not in k)
    # the Inductor act-quant engine: ours plus custom_ops -quant_fp8, the fusion passes still off
    ind = kwargs("fp8-deepgemm-inductor")
    assert ind["compilation_config"] == {**off, "custom_ops": ["-quant_fp8"]}
    assert {**ind, "compilation_config": off} == ours
    # the router A/B: the MoE routers leave ignored_layers, nothing else changes
    cut, fp8r = kwargs("fp8-cutlass", MOE), kwargs("fp8-cutlass-fp8router", MOE)
    ign = cut["hf_overrides"]["quantization_config"]["ignored_layers"]
    assert "model.layers.0.mlp.gate" in ign
    assert fp8r["hf_overrides"]["quantization_config"]["ignored_layers"] == [n for n in ign if not n.endswith(".mlp.gate")]
    fp8r["hf_overrides"]["quantization_config"]["ignored_layers"] = ign
    assert fp8r == cut
    assert br.engine_config("fp8-cutlass-fp8router", 0.9, 2320) == br.engine_config("fp8-cutlass", 0.9, 2320)


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


@pytest.mark.parametrize("key, other, title, expected", [
    # --rl-unseeded: the RL-like workload again without per-request seeds
    ("rl_unseeded_tok_s", "rl_tok_s", "RL-like without per-request seeds",
     {"bf16": ["10000", "1.250", "1.000"], "fp8-deepgemm": ["12000", "1.364", "1.200"]}),
    # --fixed-seeded: the fixed workload again with a seed per request (the GRPO rollout's default)
    ("fixed_seeded_tok_s", "fixed_tok_s", "fixed workload with a seed per request",
     {"bf16": ["10000", "1.250", "1.000"], "fp8-deepgemm": ["12000", "1.364", "1.200"]}),
], ids=["rl_unseeded", "fixed_seeded"])
def test_seeding_table_gives_the_cost_of_per_request_seeds(capsys, key, other, title, expected):
    """The per-request-seed A/B: each engine's rate, its ratio to the same engine's other run (the same requests,
    seeded the other way) and to BF16's rate of the same kind."""
    a = SimpleNamespace(num_prompts=512, input_len=256, output_len=2048, rl_prompts=32, rl_samples=32, num_layers={})
    base = {"model": "dense", "kv_tokens": 800000, "weight_gib": 15.3, "start_s": 60.0, "fixed_tok_s": 10000.0}
    rows = [{**base, "precision": "bf16", other: 8000.0, key: 10000.0, "engine": _engine("none")},
            {**base, "precision": "fp8-deepgemm", other: 8800.0, key: 12000.0, "engine": _engine("pow2")}]
    br.print_table(rows, a)
    out = capsys.readouterr().out.split(title)[1]
    table = {ln.split()[1]: ln.split()[2:] for ln in out.splitlines() if ln.startswith("dense ")}
    assert table == expected


def test_runner_variants_differ_from_their_engine_only_in_the_runner():
    from nemo_fp8.generation.vllm.engine_args import build_engine_spec
    from tests.generation.test_vllm_engine_args import DENSE

    for pinned, default, runner in [("bf16-v1", "bf16", "v1"), ("fp8-deepgemm-v2", "fp8-deepgemm", "v2"),
                                    ("fp8-deepgemm-kv-v2", "fp8-deepgemm-kv", "v2")]:
        cfg, base = br.engine_config(pinned, 0.9, 2320), br.engine_config(default, 0.9, 2320)
        assert cfg.model_runner == runner and base.model_runner == "auto"
        assert cfg.model_copy(update={"model_runner": "auto"}) == base
        spec, base_spec = build_engine_spec(cfg, DENSE), build_engine_spec(base, DENSE)
        assert spec.engine_kwargs == base_spec.engine_kwargs
        assert spec.env == {**base_spec.env, "VLLM_USE_V2_MODEL_RUNNER": "1" if runner == "v2" else "0"}
    assert br.PRECISIONS["fp8-deepgemm-kv-v2"].linear_baseline == "fp8-deepgemm-v2"  # x fp8: the same runner


def test_runner_table_compares_each_pinned_engine_with_vllms_choice(capsys):
    a = SimpleNamespace(num_prompts=128, input_len=160, output_len=1024, rl_prompts=0, rl_samples=32, num_layers={})
    base = {"model": "dense", "kv_tokens": 500000, "weight_gib": 8.8, "start_s": 60.0}
    rows = [{**base, "precision": "bf16", "fixed_tok_s": 12500.0, "fixed_seeded_tok_s": 12500.0,
             "engine": {**_engine("none"), "model_runner": "v2"}},
            {**base, "precision": "fp8-deepgemm", "fixed_tok_s": 15000.0, "fixed_seeded_tok_s": 14000.0,
             "engine": {**_engine("pow2"), "model_runner": "v1"}},
            {**base, "precision": "fp8-deepgemm-v2", "fixed_tok_s": 16500.0, "fixed_seeded_tok_s": 16800.0,
             "engine": {**_engine("pow2"), "model_runner": "v2"}}]
    br.print_table(rows, a)
    out = capsys.readouterr().out
    assert "runner=v1" in out and "runner=v2" in out
    table = [ln.split() for ln in out.split("model runner")[1].split("\n\n")[0].splitlines() if ln.startswith("dense ")]
    assert table == [["dense", "fp8-deepgemm-v2", "v2", "fp8-deepgemm", "v1", "1.100", "1.200"]]


def test_refit_table_tells_a_packed_mismatch_from_the_engines_own_repeatability(capsys):
    row = {"model": "dense", "precision": "bf16", "refit_tensors": 399, "refit_s": 0.40, "refit_updates": 50,
           "refit_packed_s": 0.30, "refit_packed_updates": 50, "refit_bucket_mb": 256.0}
    br.print_refit_table([{**row, "refit_packed_same_tokens": False, "refit_repeat_same_tokens": False},
                          {**row, "precision": "fp8-deepgemm-v2", "refit_packed_same_tokens": True,
                           "refit_repeat_same_tokens": True},
                          {"model": "dense", "precision": "fp8-deepgemm-kv-v2", "refit_error": "boom"}])
    out = capsys.readouterr().out
    assert "same tokens repeats agree" in out and "ERROR 'boom'" in out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("dense ") and "ERROR" not in ln]
    assert rows == [["dense", "bf16", "399", "0.400", "50", "0.300", "50", "0.750", "False", "False"],
                    ["dense", "fp8-deepgemm-v2", "399", "0.400", "50", "0.300", "50", "0.750", "True", "True"]]
