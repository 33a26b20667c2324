"""CPU tests of ``tools/bench_train.py``'s pure part: recipe names, the interleaved timer, the table."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "tools" / "bench_train.py"
_spec = importlib.util.spec_from_file_location("bench_train", _PATH)
bt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bt)


def test_parse_recipe():
    assert bt.parse_recipe("bf16") == (None, {})
    assert bt.parse_recipe("hybrid-blockwise+param") == (dict(enabled=True, fp8="hybrid", fp8_recipe="blockwise",
                                                              fp8_param=True), {})
    for bad in ("e5m2-tensorwise", "e4m3-delayed", "e4m3-blockwise+x"):
        with pytest.raises(ValueError, match="--recipes"):
            bt.parse_recipe(bad)


def test_timed_interleaved_rotates_and_takes_medians(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(bt.time, "perf_counter", lambda: clock[0])
    order = []

    def fn(name, seconds):
        def f():
            order.append(name)
            # "b" drifts: slower each call; its median is the middle one of the timed calls
            clock[0] += seconds(sum(1 for x in order if x == name))
        return f

    fns = {"a": fn("a", lambda i: 1.0), "b": fn("b", lambda i: float(i)), "c": fn("c", lambda i: 3.0)}
    out = bt.timed_interleaved(fns, steps=3, warmup=1, sync=lambda: None)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    # b's calls take 1, 2, 3, 4 s; the first is warm-up, the median of 2, 3, 4 is 3
    assert out == {"a": 1.0, "b": 3.0, "c": 3.0}
    with pytest.raises(ValueError, match="steps"):
        bt.timed_interleaved(fns, steps=0, warmup=1, sync=lambda: None)


def test_table_ratios(capsys):
    def row(recipe, raw, fused, step):
        return dict(shape="dense", recipe=recipe, raw_ms=raw, ours_ms=raw * 1.1, fused_ms=fused, te_ms=fused,
                    step_ms=step, tokens=8192, peak_gib=70.0)

    bt.print_table([row("bf16", 220.0, 227.0, 240.0), row("e4m3-tensorwise", 176.0, 181.6, 192.0),
                    dict(shape="dense", recipe="e4m3-blockwise", error="timeout 300s")])
    out = capsys.readouterr().out.splitlines()
    fp8 = out[3].split()
    # step 240/192 = 1.250, fused f+b 227/181.6 = 1.250, raw 220/176 = 1.250
    assert fp8[1] == "e4m3-tensorwise" and fp8[11:14] == ["1.250", "1.250", "1.250"]
    assert "failed: timeout 300s" in out[4]


def test_recipe_overrides():
    fp8, over = bt.parse_recipe("e4m3-blockwise@moe_router_padding_for_quantization=true@moe_router_dtype=fp32")
    assert fp8["fp8_recipe"] == "blockwise"
    assert over == {"override_transformer_config": {"moe_router_padding_for_quantization": True,
                                                    "moe_router_dtype": "fp32"}}
    assert bt.parse_recipe("bf16@moe_router_fusion=1") == (None, {"override_transformer_config": {"moe_router_fusion": 1}})
    # our own megatron_cfg keys go to megatron_cfg, not to TransformerConfig
    assert bt.parse_recipe("bf16@fuse_wgrad_accumulation=false@moe_router_fusion=true") == (
        None, {"fuse_wgrad_accumulation": False, "override_transformer_config": {"moe_router_fusion": True}})
    with pytest.raises(ValueError, match="not @key=value"):
        bt.parse_recipe("bf16@moe_router_fusion")
    with pytest.raises(ValueError, match="the log-prob kernel is --logprob-kernel"):
        bt.parse_recipe("bf16@logprob_kernel=te")


def test_profile_table(capsys):
    import profile_rollout as pr

    prof = pr.summarize([("nvjet_gemm", 3000.0), ("cast_transpose_kernel", 1000.0)], wall_s=0.01, steps=2)
    prof["launches"] = 1234.0
    bt.print_profile([dict(shape="moe", recipe="e4m3-blockwise", profile=prof), dict(shape="moe", recipe="bf16")])
    out = capsys.readouterr().out.splitlines()
    assert out[-1].split()[:4] == ["moe", "e4m3-blockwise", "1.5", "0.0"]  # gemm 1.5 ms/pass, moe 0
    assert out[-1].split()[-4:] == ["2.0", "3.0", "5.0", "1234"]  # gpu, host, wall, launches


def test_bad_recipe_values_fail_before_any_child(monkeypatch, capsys):
    """A megatron_cfg value or a managed TransformerConfig key in ``--recipes`` is refused by the config's own
    validation in the parent, naming the recipe, before any child (GPU) process starts."""
    started = []
    monkeypatch.setattr(bt.subprocess, "run", lambda *a, **k: started.append(a))
    for recipe, why in (("bf16@fuse_wgrad_accumulation=maybe", "valid boolean"),
                        ("e4m3-blockwise@gradient_accumulation_fusion=true", "set by policy.megatron_cfg.fuse_wgrad")):
        monkeypatch.setattr(bt.sys, "argv", ["bench_train.py", "--recipes", recipe])
        with pytest.raises(SystemExit):
            bt.main()
        err = capsys.readouterr().err
        assert f"--recipes {recipe}" in err and why in err
    assert not started


def test_rl_workload_batch_configs_and_table(capsys):
    """``--workload rl``: the rollout-shaped batch, the packed / unpacked configs (8B values) and the ratio table."""
    import argparse

    a = argparse.Namespace(model=None, rl_responses=64, rl_prompt=512, rl_response_min=256, rl_response_max=3072,
                           logprob_kernel="fused", tp=1, rl_train_mb_tokens=4096, warmup=2, steps=5, profile_dir=None)
    batch = bt.rl_batch(a, vocab=1000).validate()
    assert batch.size == 64 and (batch.prompt_lengths == 512).all()
    assert 256 <= int(batch.response_lengths.min()) and int(batch.response_lengths.max()) <= 3072
    packed, plain = bt.rl_policy_cfg(a, "e4m3-blockwise", True), bt.rl_policy_cfg(a, "e4m3-blockwise", False)
    assert packed.sequence_packing.enabled and not plain.sequence_packing.enabled
    assert (packed.sequence_packing.train_mb_tokens, packed.sequence_packing.logprob_mb_tokens) == (4096, 16384)
    assert packed.megatron_cfg.tensor_model_parallel_size == 1 and not packed.megatron_cfg.sequence_parallel
    assert packed.profile.dir is None  # profiled only with --profile-dir, then the call after the timed ones
    a.profile_dir = "prof/dense-bf16-packed"
    assert bt.rl_policy_cfg(a, "bf16", True).profile.model_dump() == dict(
        dir="prof/dense-bf16-packed", train_call=8, micro_batches=6, trace=False)
    a.profile_dir = None
    a.tp, a.rl_train_mb_tokens = 2, 8192  # the 8B configs' layout, the budget of the command line
    wide = bt.rl_policy_cfg(a, "e4m3-blockwise@activation_checkpointing=true", True)
    assert wide.megatron_cfg.tensor_model_parallel_size == 2 and wide.megatron_cfg.sequence_parallel
    assert wide.megatron_cfg.activation_checkpointing and wide.sequence_packing.train_mb_tokens == 8192
    a.tp, a.rl_train_mb_tokens = 1, 4096
    a.rl_response_max = 5000  # a sequence no 4096-token bin holds: refused before any child
    with pytest.raises(ValueError, match="train_mb_tokens"):
        bt.rl_policy_cfg(a, "bf16", True)
    row = dict(shape="dense", logprobs_s=1.0, train_s=3.0, micro_batches=36.0, packing_efficiency=0.97, tokens=8000,
               peak_gib=10.0)
    bt.print_rl_table([{**row, "recipe": "bf16", "packed": False, "step_s": 8.0},
                       {**row, "recipe": "bf16", "packed": True, "step_s": 4.0, "raw_ms": 300.0},
                       {**row, "recipe": "e4m3-blockwise", "packed": True, "step_s": 2.0, "raw_ms": 250.0}])
    lines = capsys.readouterr().out.splitlines()
    # vs bf16 unpacked, vs bf16 packed; then the engine's own ceiling: raw f+b of one packed micro-batch, its ratio
    assert lines[-1].split()[-5:-1] == ["4.000", "2.000", "250.0", "1.200"]
    assert lines[-2].split()[-5:-1] == ["2.000", "1.000", "300.0", "1.000"]
    assert lines[-3].split()[-5:-1] == ["1.000", "0.500", "-", "-"]  # unpacked: no raw column
