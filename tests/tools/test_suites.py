"""CPU tests of the GPU suites' framework (tests/test_suites): every suite parses, sources common.sh and checks its
metrics; common.sh's check_runs names runs by folder and fails the suite on a failed check."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SUITES = sorted((REPO / "tests" / "test_suites" / "llm").glob("*.sh"))


def test_there_are_suites():
    assert len(SUITES) >= 10


@pytest.mark.parametrize("suite", SUITES, ids=lambda p: p.stem)
def test_suite_parses_and_uses_the_framework(suite):
    text = suite.read_text()
    assert subprocess.run(["bash", "-n", str(suite)], capture_output=True).returncode == 0
    assert f"suite_init {suite.stem}" in text  # the suite's output folder is named after it
    assert text.splitlines()[1].startswith("# "), "a suite starts with what it reproduces"
    # a suite ends in a verdict: pytest's exit status, metric checks, or the profiler's own status, in its own text
    # or in a shared body it sources beside common.sh (the mission suites' mission.sh)
    libs = re.findall(r'source "\$\(dirname "\$0"\)/\.\./([\w-]+\.sh)"', text)
    assert "common.sh" in libs
    code = [ln for ln in text.splitlines() if not ln.startswith("#")]
    verdict = "\n".join(code + [(suite.parents[1] / lib).read_text() for lib in libs if lib != "common.sh"])
    assert any(k in verdict for k in ("check_runs", "check ", "check_metrics.py", "run_gpu_pytest", "PIPESTATUS"))


def _suite_shell(out: Path, body: str) -> subprocess.CompletedProcess:
    script = f'PYTHON={sys.executable}; source tests/test_suites/common.sh; OUT={out}; {body}'
    return subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True)


def test_check_runs_names_runs_by_folder_and_fails_on_a_failed_check(tmp_path):
    for name, kl in [("bf16", 1e-4), ("fp8+tis", 6e-4)]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(
            "\n".join(json.dumps({"step": s, "mismatch/gen_kl_error": kl, "timing/step": 2.0}) for s in (1, 2, 3)))
    ok = _suite_shell(tmp_path, "check_runs 'count(fp8_tis:timing/step) >= 3' "
                                "'ratio(mean(fp8_tis:mismatch/gen_kl_error), mean(bf16:mismatch/gen_kl_error)) > 5'")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "2/2 checks passed" in ok.stdout and (tmp_path / "checks.md").is_file()
    bad = _suite_shell(tmp_path, "check bf16 'max(mismatch/gen_kl_error) < 1e-5'")
    assert bad.returncode == 1 and "| FAIL |" in bad.stdout
    assert (tmp_path / "bf16" / "checks.md").is_file()


def test_report_runs_writes_the_side_by_side_table(tmp_path):
    for name, step_s in [("bf16", 4.0), ("fp8", 3.0)]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(json.dumps(
            {"step": s, "train/reward_mean": 0.5, "timing/step": step_s, "timing/generation": 1.0,
             "timing/kv_calibration": 0.25, "perf/rollout_tokens_per_s": 1000.0}) for s in (1, 2, 3)))
    res = _suite_shell(tmp_path, "report_runs")
    assert res.returncode == 0, res.stdout + res.stderr
    table = (tmp_path / "report.md").read_text()
    assert "| fp8 | 3 | 1.00 |" in table and "| 0.75 |" in table  # fp8's step / bf16's
    # other s: the step outside generation, refit, log-probs and training (here all of it but generation)
    assert "| fp8 | 3 | 1.00 | 0.00 | 0.00 | 0.00 | 2.00 | 3.00 |" in table
    assert "| 2 | 1.00 | 0.00 | 0.00 | 0.00 | 3.00 | 4.00 |" in table  # bf16's step row
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _suite_shell(empty, "report_runs").returncode == 1


def test_report_runs_adds_kv_capacity_and_peak_gpu_and_host_memory(tmp_path):
    """``$OUT/gpu_mem_<run>.csv`` (nvidia-smi) and ``$OUT/host_mem_<run>.jsonl`` (``sample_host_memory``) beside a
    run's folder give its memory row, with the engines' KV capacity and the trainer's peak; a run without them gets
    "-"; a host log without ``host/used_gib`` or a third file of another kind is refused."""
    for name, kv in [("bf16", 181_552.0), ("fp8kv", 445_856.0)]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(json.dumps(
            {"step": s, "train/reward_mean": 0.0, "timing/step": 2.0, "generation/kv_capacity_tokens": kv,
             "memory/train_peak_allocated_gib": 100.0 + s, "memory/train_peak_reserved_gib": 110.0,
             **({"memory/beside_engine_reserved_gib": 80.0 + s} if name == "fp8kv" else {})}) for s in (1, 2)))
    (tmp_path / "gpu_mem_fp8kv.csv").write_text("timestamp, index, memory.used [MiB]\nt, 0, 133120 MiB\n")
    (tmp_path / "host_mem_fp8kv.jsonl").write_text(
        "".join(json.dumps({"step": i, "host/used_gib": g}) + "\n" for i, g in enumerate([40.0, 71.25, 60.0], 1)))
    res = _suite_shell(tmp_path, "report_runs")
    assert res.returncode == 0, res.stdout + res.stderr
    table = (tmp_path / "report.md").read_text()
    assert "| fp8kv | 445,856 | 2.46 | 102.0 | 110.0 | 82.0 | 130.0 | 71.2 |" in table
    assert "| bf16 | 181,552 | 1.00 | 102.0 | 110.0 | - | - | - |" in table
    (tmp_path / "host_mem_fp8kv.jsonl").write_text('{"step": 1}\n')
    res = _suite_shell(tmp_path, "report_runs")
    assert res.returncode == 2 and "no host/used_gib row" in res.stderr
    res = subprocess.run([sys.executable, "tools/mission_report.py", f"x={tmp_path / 'bf16'},notes.txt"], cwd=REPO,
                         capture_output=True, text=True)
    assert res.returncode == 2 and "at most one nvidia-smi .csv and one host memory .jsonl" in res.stderr
