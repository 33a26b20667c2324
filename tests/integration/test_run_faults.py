"""The main job when a part of it fails mid-run: a generation engine killed (one of one, one of two), a disk
that fills while a checkpoint is written, the log folder removed, the reward scorer raising, Ctrl-C right after a
checkpoint. Each must
end within 15 s of the fault with one line naming what failed and how to continue, leave no Ray process behind,
and leave a state that ``--resume`` continues."""

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.integration.test_run_signals import assert_none_left, resume_finishes, start_job, wait_for_checkpoint

pytestmark = pytest.mark.slow


def error_line(err: str) -> str:
    return next((x for x in err.splitlines() if x.startswith("error: ")), err[-2000:])


def log_lines(err: str, n: int = 40) -> str:
    """The run's stderr without its progress bars, last ``n`` lines: what a failed check shows in full (pytest cuts
    a long non-string message short)."""
    lines = [x for x in err.replace("\r", "\n").splitlines() if x.strip() and "%|" not in x]
    return "\n".join(lines[-n:])


def cpu_ticks(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    utime, stime = stat[stat.rindex(")") + 2:].split()[11:13]
    return int(utime) + int(stime)


def wait_busy(proc, pid: int, timeout=60.0) -> None:
    """Until ``pid`` burns CPU (an engine generating), so the kill lands inside a call to it."""
    deadline, last = time.monotonic() + timeout, cpu_ticks(pid)
    while time.monotonic() < deadline:
        time.sleep(0.1)
        assert proc.poll() is None and Path(f"/proc/{pid}").exists(), proc.communicate()[1][-3000:]
        now = cpu_ticks(pid)
        if now - last >= 5:
            return
        last = now


@pytest.mark.parametrize("dp", [1, 2])
def test_a_killed_engine_is_named_and_the_run_ends_within_15_s(tiny_model_dir, tmp_path, dp):
    # bins of 4 rows (one prompt's samples): every engine gets some of a step's 16 rows
    layout = [f"policy.data_parallel_size={dp}", f"policy.train_micro_batch_size={16 // dp}", f"cluster.num_cpus={2 * dp}",
              "policy.generation_batch_size=4"]
    proc = start_job(tiny_model_dir, tmp_path, "grpo.max_num_steps=500", *layout)
    procs = wait_for_checkpoint(proc, tmp_path, timeout=400)
    engines = [p for p in procs if b"ray::GenerationWorker" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(engines) == dp, engines
    victim = engines[-1]
    wait_busy(proc, victim)
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=120)
    elapsed = time.monotonic() - t0
    line = error_line(err)
    assert proc.returncode == 1 and elapsed < 15, (proc.returncode, elapsed, err[-3000:])
    # An EngineError when the kill lands in a call to the engines, a dead GenerationWorker when in the refit
    assert re.search(r"engine [0-9]+ \(node .*\bdied\b", line) and f"pid {victim}" in line, line
    assert "continue with --resume" in line and "Traceback" not in err, err[-3000:]
    assert_none_left(procs)
    resume_finishes(tiny_model_dir, tmp_path, *layout)


def test_a_full_disk_while_checkpointing_is_named_and_resume_continues(tiny_model_dir, tmp_path, tmpfs):
    ckpt = tmpfs.mount("ckpt", 64)  # step_1 (~44 MB: float64 weights and Adam state) fits, step_2 beside it does not
    proc = start_job(tiny_model_dir, tmp_path, "grpo.max_num_steps=50")
    procs = wait_for_checkpoint(proc, tmp_path)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=120)
    elapsed = time.monotonic() - t0
    step_s = json.loads((tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()[0])["timing/step"]
    line = error_line(err)
    assert proc.returncode == 1, err[-3000:]
    assert elapsed < 15 + 2 * step_s, (elapsed, step_s, err[-3000:])  # the fault comes with step 2's checkpoint
    assert f"checkpointing.checkpoint_dir={ckpt}: the disk is full" in line and "step_2" in line, line
    assert "last checkpoint: " in line and "continue with --resume" in line and "Traceback" not in err, err[-3000:]
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) == ["step_1"]  # no step_2.tmp
    assert_none_left(procs)
    # Space freed; then a save killed mid-write left a partial checkpoint that filled the disk again: --resume
    # removes it before writing anything.
    tmpfs.resize(ckpt, 320)
    from tests.conftest import fill_disk

    (ckpt / "step_9.tmp").mkdir()
    fill_disk(ckpt / "step_9.tmp")
    resume_finishes(tiny_model_dir, tmp_path)
    assert not (ckpt / "step_9.tmp").exists()


def test_a_log_dir_removed_mid_run_is_named_within_15_s(tiny_model_dir, tmp_path):
    import shutil

    proc = start_job(tiny_model_dir, tmp_path, "grpo.max_num_steps=50")
    procs = wait_for_checkpoint(proc, tmp_path)
    step_s = json.loads((tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()[0])["timing/step"]
    shutil.rmtree(tmp_path / "logs")  # the next step's row cannot be written
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=120)
    elapsed = time.monotonic() - t0
    line = error_line(err)
    assert proc.returncode == 1 and elapsed < 15 + 2 * step_s, (proc.returncode, elapsed, step_s, err[-3000:])
    assert f"the metrics file {tmp_path / 'logs' / 'metrics.jsonl'} (logger.log_dir) could not be written" in line
    assert "[Errno 2] No such file or directory" in line, line
    assert "last checkpoint: " in line and "continue with --resume" in line and "Traceback" not in err, err[-3000:]
    assert_none_left(procs)


SCORER_FAILS = """
import runpy, sys, time
from nemo_fp8.rewards import MathRewardScorer
calls, score = [0], MathRewardScorer.__call__
def failing(self, responses, ground_truths):
    calls[0] += 1
    if calls[0] == 2:  # step 2's rollout, after step 1's checkpoint
        print(f"SCORER RAISES AT {time.time()}", file=sys.stderr, flush=True)
        raise ValueError("the verifier broke")
    return score(self, responses, ground_truths)
MathRewardScorer.__call__ = failing
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_the_reward_scorers_error_is_named_and_resume_continues(tiny_model_dir, tmp_path):
    proc = start_job(tiny_model_dir, tmp_path, "grpo.max_num_steps=50", driver=SCORER_FAILS)
    procs = wait_for_checkpoint(proc, tmp_path)
    _, err = proc.communicate(timeout=120)
    ended = time.time()
    raised = float(re.search(r"SCORER RAISES AT ([0-9.]+)", err).group(1))
    line = error_line(err)
    assert proc.returncode == 1 and ended - raised < 15, (proc.returncode, ended - raised, err[-3000:])
    assert "the reward scorer (MathRewardScorer, env.math) raised ValueError: the verifier broke" in line, line
    assert "last checkpoint: " in line and "step_1; continue with --resume" in line, line
    assert_none_left(procs)
    resume_finishes(tiny_model_dir, tmp_path)


@pytest.mark.parametrize("to_group", [True, False])
def test_ctrl_c_right_after_a_checkpoint_ends_within_15_s(tiny_model_dir, tmp_path, to_group):
    proc = start_job(tiny_model_dir, tmp_path, "grpo.max_num_steps=50")
    procs = wait_for_checkpoint(proc, tmp_path)
    t0 = time.monotonic()
    (os.killpg if to_group else os.kill)(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 130 and elapsed < 15, f"exit {proc.returncode} after {elapsed:.1f} s\n{log_lines(err)}"
    assert "press Ctrl-C again to stop at once" in err and "continue with --resume" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert_none_left(procs)
    resume_finishes(tiny_model_dir, tmp_path)


def test_second_ctrl_c_ends_the_run_at_once(tiny_model_dir, tmp_path):
    proc = start_job(tiny_model_dir, tmp_path, "grpo.max_num_steps=50")
    procs = wait_for_checkpoint(proc, tmp_path)
    os.kill(proc.pid, signal.SIGINT)
    time.sleep(0.3)
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and time.monotonic() - t0 < 5, err[-3000:]
    assert "continue with --resume" in err, err[-3000:]
    assert_none_left(procs)
