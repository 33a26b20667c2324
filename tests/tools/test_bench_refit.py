"""tools/bench_refit.py on CPU: the run's own workers (Ray actors, torch backends) refit again and again; one row per
refit with its timers, bytes and the engine's version."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench_refit import main, refit_rows, row_line, summary
from nemo_fp8.trainer import start_workers

TINY_FP8 = str(Path(__file__).resolve().parents[2] / "examples" / "configs" / "grpo_math_tiny_fp8.yaml")


def test_every_refit_is_a_row_with_its_parts_and_bytes(ray_cluster, tiny_cfg, tok):
    workers = start_workers(tiny_cfg("policy.weight_sync.bucket_size_mb=0.25"), tok)
    try:
        rows = refit_rows(workers, 3)
        assert workers.generation.weight_version().weights == 2  # versions 0, 1, 2: the last one is held
    finally:
        workers.shutdown()
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["refit/num_buckets"] > 4 and r["refit/gbytes"] > 0  # every refit sends the whole model
        assert r["timing/refit/transfer"] > 0 and r["timing/engine_wake"] >= 0
        assert r["timing/refit_total"] == pytest.approx(r["timing/refit"] + r["timing/engine_wake"]
                                                       + r["timing/engine_sleep"])
        assert "memory/device_used_gib" not in r  # a CPU run reads no GPU
    text = summary(rows)
    assert text.startswith("over refits 2-3 (mean s):") and "x the floor" in text
    assert row_line(rows[0]).startswith(f"refit 1: {rows[0]['timing/refit_total']:.3f} s (")
    with pytest.raises(ValueError, match="--refits must be >= 1"):
        refit_rows(workers, 0)


def test_the_summary_gives_the_device_memory_growth():
    rows = [{"step": 1, "timing/refit": 1.0, "memory/device_used_gib": 100.0},
            {"step": 2, "timing/refit": 0.5, "memory/device_used_gib": 100.25},
            {"step": 3, "timing/refit": 0.7, "memory/device_used_gib": 100.5}]
    text = summary(rows)
    assert "refit                               0.600" in text  # the mean of refits 2-3: the first is warm-up
    assert "after refit 1: 100.00 GiB, after refit 3: 100.50 GiB (+0.50)" in text


def test_the_command_writes_metrics_check_metrics_reads(ray_cluster, tiny_model_dir, tmp_path, capsys):
    from check_metrics import main as check

    out = tmp_path / "bench"
    rc = main(["--config", TINY_FP8, "--refits", "2", "--out", str(out),
               f"policy.model_name={tiny_model_dir}", "policy.tiny_model.build_if_missing=false",
               f"logger.log_dir={tmp_path / 'logs'}", f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}"])
    assert rc == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert "refit 2:" in capsys.readouterr().out
    assert check([str(out), "count(timing/refit_total) == 2", "mean(timing/refit_total[1:]) < 60"]) == 0


def test_a_bad_config_stops_before_any_worker(capsys):
    assert main(["--config", TINY_FP8, "--refits", "1",
                 "policy.weight_sync.method=carrier-pigeon"]) == 2
    assert "policy.weight_sync.method" in capsys.readouterr().err
