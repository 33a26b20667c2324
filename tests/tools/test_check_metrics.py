"""CPU tests of ``tools/check_metrics.py``: series, slices, functions, runs, the table and the exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import check_metrics as cm

TOOL = Path(__file__).resolve().parents[2] / "tools" / "check_metrics.py"


def _write(d: Path, rows: list[dict]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{partial")
    return d


@pytest.fixture
def runs(tmp_path):
    fp8 = _write(tmp_path / "fp8", [{"step": s, "timing/step": t, "val/accuracy": a}
                                     for s, t, a in [(1, 30.0, 0.1), (2, 10.0, 0.2), (3, 12.0, 0.4)]]
                 + [{"step": 3, "perf/rollout_tokens_per_s": 900.0}])
    bf16 = _write(tmp_path / "bf16", [{"step": s, "timing/step": t} for s, t in [(1, 40.0), (2, 20.0), (3, 20.0)]])
    return {"fp8": cm.read_rows(fp8), "bf16": cm.read_rows(bf16)}, fp8, bf16


def test_series_slices_and_functions(runs):
    r, _, _ = runs
    assert cm.evaluate("mean(timing/step[1:]) == 11", r, "fp8") == (True, "11 ; 11")
    assert cm.evaluate("first(timing/step) > 29", r, "fp8")[0]
    assert cm.evaluate("last(val/accuracy) == 0.4", r, "fp8")[0]
    assert cm.evaluate("count(timing/step) == 3", r, "fp8")[0]  # the row without timing/step is not a value
    assert cm.evaluate("timing/step[-1] == 12", r, "fp8")[0]
    assert cm.evaluate("max(timing/step) - min(timing/step) == 20", r, "fp8")[0]
    assert cm.evaluate("median(val/accuracy) == 0.2 and sum(val/accuracy) > 0.69", r, "fp8")[0]
    assert cm.evaluate("std(timing/step[1:]) == 1", r, "fp8")[0]
    assert not cm.evaluate("mean(timing/step) < 10", r, "fp8")[0]


def test_ratio_across_named_runs(runs):
    r, _, _ = runs
    passed, shown = cm.evaluate("ratio(mean(fp8:timing/step[1:]), mean(bf16:timing/step[1:])) < 0.6", r)
    assert passed and shown == "0.55 ; 0.6"
    assert not cm.evaluate("ratio(mean(fp8:timing/step[1:]), mean(bf16:timing/step[1:])) < 0.5", r)[0]


@pytest.mark.parametrize("check, message", [
    ("mean(timing/nope) < 1", "no metric 'timing/nope' (same section: timing/step"),
    ("mean(gpu:timing/step) < 1", "unknown run 'gpu'"),
    ("mean(timing/step < ", "does not parse"),
    ("__import__('os') == 1", "can be called"),
    ("mean(timing/step[5:]) > 0", "empty series"),
    ("foo < 1", "unknown name 'foo'"),
    ("(timing/step).real > 1", "Attribute is not allowed"),
])
def test_bad_checks_are_errors_not_passes(runs, check, message):
    r, _, _ = runs
    with pytest.raises(cm.CheckError) as e:
        cm.evaluate(check, r, "fp8")
    assert message in str(e.value)


def test_cli_table_and_exit_codes(runs, tmp_path):
    _, fp8, bf16 = runs

    def cli(*args):
        return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True)

    ok = cli(str(fp8), "mean(timing/step[1:]) < 40", "--by", "", "last(perf/rollout_tokens_per_s) > 500",
             "--out", str(tmp_path / "t.md"))
    assert ok.returncode == 0, ok.stderr
    assert "| `mean(timing/step[1:]) < 40` | 11 ; 40 | PASS |" in ok.stdout and "2/2 checks passed" in ok.stdout
    assert (tmp_path / "t.md").read_text().startswith("| check | value(s) | result |")
    fail = cli("--run", f"fp8={fp8}", "--run", f"bf16={bf16}",
               "ratio(mean(fp8:timing/step), mean(bf16:timing/step)) < 0.5", "count(bf16:timing/step) == 3")
    assert fail.returncode == 1 and "| FAIL |" in fail.stdout and "1/2 checks passed" in fail.stdout
    bad = cli(str(tmp_path / "missing"), "count(timing/step) > 0")
    assert bad.returncode == 2 and "no metrics file" in bad.stderr
    assert cli(str(fp8)).returncode == 2  # no checks
    assert cli("--run", "a b=x", "count(timing/step) > 0").returncode == 2


def test_missing_fails_makes_an_absent_run_or_metric_a_fail_row(runs, tmp_path):
    """A suite run on a share of its arms: the checks on absent arms fail in the table, the rest still count; a
    check that does not parse stays an error."""
    r, fp8, _ = runs
    rows, ok = cm.check_all(["count(timing/step) == 3", "last(fp8kv_tis/seeds) >= 3", "count(other:timing/step) > 0"],
                            r, "fp8", missing_fails=True)
    assert not ok and [x[2] for x in rows] == ["PASS", "FAIL", "FAIL"]
    assert rows[1][1].startswith("missing: run 'fp8' has no metric 'fp8kv_tis/seeds'")
    assert rows[2][1].startswith("missing: unknown run 'other'")
    with pytest.raises(cm.CheckError, match="has no metric"):
        cm.check_all(["last(fp8kv_tis/seeds) >= 3"], r, "fp8")
    with pytest.raises(cm.CheckError, match="does not parse"):
        cm.check_all(["mean(timing/step < "], r, "fp8", missing_fails=True)
    out = subprocess.run([sys.executable, str(TOOL), str(fp8), "count(timing/step) == 3", "last(x/seeds) >= 3",
                          "--missing-fails"], capture_output=True, text=True)
    assert out.returncode == 1 and "1/2 checks passed" in out.stdout and "missing: run 'run' has no metric" in out.stdout


def test_benchmark_rows_by_field(tmp_path):
    rows = [{"model": "dense", "precision": "bf16", "fixed_tok_s": 100.0},
            {"model": "dense", "precision": "fp8-deepgemm", "fixed_tok_s": 150.0}]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(rows))
    runs = {"run": cm.read_rows(path, ("precision",))}
    assert cm.evaluate("ratio(fp8-deepgemm/fixed_tok_s[0], bf16/fixed_tok_s[0]) >= 1.5", runs, "run")[0]
    assert cm.read_rows(path, ("model", "precision"))[0]["dense.bf16/fixed_tok_s"] == 100.0
    with pytest.raises(cm.CheckError, match="--by"):
        cm.read_rows(path)
    with pytest.raises(cm.CheckError, match="--by"):
        cm.read_rows(path, ("engine",))
