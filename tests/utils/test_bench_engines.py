"""``tools/bench_engines.py`` (``bench_rollout.py --engines``) with the torch engines on the CPU: every engine
count runs the same rollout (per-request seeds), each engine reports its tokens, and the table is printed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "tools" / "bench_engines.py"
_spec = importlib.util.spec_from_file_location("bench_engines", _PATH)
be = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(be)


def test_engine_counts_roll_out_the_same_tokens_and_report_each_engine(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "rows.json"
    rows = be.main(["--backend", "torch", "--model", str(tiny_model_dir), "--engines", "1,2", "--prompts", "2",
                    "--samples", "2", "--input-len", "8", "--output-len", "6", "--precision", "bfloat16",
                    "--batch-size", "2", "--torch-threads", "1", "--out", str(out)])
    assert [r["engines"] for r in rows] == [1, 2]
    assert rows[0]["tokens"] == rows[1]["tokens"] > 0 and rows[0]["responses"] == 4  # same seeds: same rollout
    assert sum(rows[1]["engine_tokens"]) == rows[1]["tokens"] and min(rows[1]["engine_tokens"]) > 0
    assert "engines  tp  responses" in capsys.readouterr().out and out.is_file()
    # the one engine also ran the 2-engine share (half the prompts): the ceiling column of the 2-engine row
    assert list(rows[0]["share_tokens_per_s"]) == [2] and rows[0]["share_tokens_per_s"][2] > 0
    assert "share_tokens_per_s" not in rows[1]


def test_one_engine_alone_times_the_shares_it_is_given(tiny_model_dir):
    # --engines 1 --shares 2: the ceiling of a 2-engine row measured by another run (other GPUs busy meanwhile)
    rows = be.main(["--backend", "torch", "--model", str(tiny_model_dir), "--engines", "1", "--shares", "2",
                    "--prompts", "2", "--samples", "2", "--input-len", "8", "--output-len", "6", "--precision",
                    "bfloat16", "--batch-size", "2", "--torch-threads", "1"])
    assert len(rows) == 1 and list(rows[0]["share_tokens_per_s"]) == [2] and rows[0]["share_tokens_per_s"][2] > 0


def test_table_ceiling_is_n_engines_at_one_engines_share_speed():
    rows = [dict(engines=1, tp=1, responses=512, tokens=512000, seconds=32.0, tokens_per_s=16000.0, imbalance=1.0,
                 share_tokens_per_s={"2": 15000.0, "4": 14000.0}),  # read back from JSON: string keys
            dict(engines=2, tp=1, responses=512, tokens=512000, seconds=16.0, tokens_per_s=32000.0, imbalance=1.0),
            dict(engines=4, tp=1, responses=512, tokens=512000, seconds=9.4, tokens_per_s=54400.0, imbalance=1.04)]
    last = be.table(rows).splitlines()[1:]
    assert last[0].split()[-2:] == ["-", "-"]
    assert last[1].split()[-3:] == ["1.00", "1.88", "1.07"]  # x1 2.00 of a 1.88 ceiling (the engine at half load)
    assert last[2].split()[-3:] == ["1.04", "3.50", "0.97"]  # x1 3.40 of 4 x 14000 / 16000
    plan = be.engines_only_plan(4, 2, use_gpu=True)
    assert plan.required() == {"CPU": 4.0, "GPU": 8.0} and plan.num_engines == 4 and plan.policy_slots == []
