"""The main job under a cluster's signals: SIGTERM to the whole process group (``timeout``, SLURM, systemd) and
a Ray worker killed under it. Both must end within seconds, say how to continue, leave no process behind,
and leave a state that ``--resume`` continues."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_fp8.distributed.teardown import descendants
from tests.integration.test_run_safety import CONFIG, SCRIPT, SMALL

from tests.signals import sigint_default

pytestmark = pytest.mark.slow


def start_job(model_dir, out: Path, *args, driver: str | None = None) -> subprocess.Popen:
    """The main job in a session of its own; ``driver``: Python code run with ``-c`` instead, the script and
    arguments in its ``sys.argv[1:]`` (to inject a fault, then run the script)."""
    cmd = [sys.executable, *(["-c", driver] if driver else []), str(SCRIPT), "--config", str(CONFIG),
           f"policy.model_name={model_dir}",
           "policy.tiny_model.build_if_missing=false", f"logger.log_dir={out / 'logs'}",
           f"checkpointing.checkpoint_dir={out / 'ckpt'}", *SMALL, "checkpointing.save_period=1", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            cwd=Path(SCRIPT).parents[1], env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            preexec_fn=sigint_default)


def wait_for_checkpoint(proc, out: Path, timeout=240) -> dict[int, int]:
    """Wait until step_1 is saved; return the job's processes (Ray's included) at that moment."""
    t0 = time.monotonic()
    while not (out / "ckpt" / "step_1").is_dir():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() - t0 < timeout, "no checkpoint in time"
        time.sleep(0.2)
    return {proc.pid: 0, **descendants(proc.pid)}


def assert_none_left(procs: dict[int, int], within_s=10.0):
    from nemo_fp8.distributed.teardown import _is_running, _start_time

    deadline = time.monotonic() + within_s
    alive = procs
    while time.monotonic() < deadline:
        alive = {p: t for p, t in procs.items() if t and _start_time(p) == t and _is_running(p)}
        if not alive:
            return
        time.sleep(0.2)
    names = {p: Path(f"/proc/{p}/cmdline").read_bytes()[:80] for p in alive if Path(f"/proc/{p}/cmdline").exists()}
    pytest.fail(f"processes left behind: {names}")


#: The metrics of a step that depend only on the weights, the data and the seeds (not on time or the host).
LEARNING_KEYS = ("train/", "loss/", "mismatch/", "reward/")
_STRAIGHT: dict[tuple, dict] = {}


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]


def straight_row(model_dir, root: Path, step: int, *args) -> dict:
    """Step ``step``'s metrics row of an uninterrupted run with ``args`` (run once per process and arguments)."""
    key = (str(model_dir), step, args)
    if key not in _STRAIGHT:
        out = root / f"straight-{len(_STRAIGHT)}"
        proc = start_job(model_dir, out, f"grpo.max_num_steps={step}", *args)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        _STRAIGHT[key] = _rows(out)[-1]
    return _STRAIGHT[key]


def resume_finishes(model_dir, out: Path, *args):
    """``--resume`` from the newest checkpoint runs one more step, and that step is bit for bit the step an
    uninterrupted run takes (the float64 CPU job is deterministic: same weights, optimizer state, data, seeds)."""
    last = max(int(p.name.split("_")[1]) for p in (out / "ckpt").glob("step_*") if p.name[5:].isdigit())
    proc = start_job(model_dir, out, "--resume", f"grpo.max_num_steps={last + 1}", *args)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    rows = _rows(out)
    assert [r["step"] for r in rows] == list(range(1, last + 2)), [r["step"] for r in rows]
    straight = straight_row(model_dir, out.parent / "straight-runs", last + 1, *args)
    learning = lambda row: {k: v for k, v in row.items() if k.startswith(LEARNING_KEYS)}  # noqa: E731
    assert learning(rows[-1]) == learning(straight), {k: (v, straight.get(k)) for k, v in learning(rows[-1]).items()
                                                      if v != straight.get(k)}


def test_sigterm_to_the_process_group_exits_143_at_once_and_resumes(tiny_model_dir, tmp_path):
    proc = start_job(tiny_model_dir, tmp_path, "grpo.max_num_steps=50")
    procs = wait_for_checkpoint(proc, tmp_path)
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 143, err[-3000:]
    assert elapsed < 20, (elapsed, err[-3000:])
    assert "continue with --resume" in err and "Traceback" not in err, err[-3000:]
    assert_none_left(procs)
    resume_finishes(tiny_model_dir, tmp_path)


def test_a_killed_ray_worker_is_named_with_the_resume_hint(tiny_model_dir, tmp_path):
    proc = start_job(tiny_model_dir, tmp_path, "grpo.max_num_steps=50")
    procs = wait_for_checkpoint(proc, tmp_path)
    worker = next(p for p in procs if b"ray::PolicyWorker" in Path(f"/proc/{p}/cmdline").read_bytes())
    os.kill(worker, signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-3000:]
    line = next((x for x in err.splitlines() if x.startswith("error: ")), err[-2000:])
    assert line.startswith("error: the Ray worker PolicyWorker rank 0") and "continue with --resume" in line, line
    assert "Traceback" not in err, err[-3000:]
    assert_none_left(procs)


def test_kill_9_of_the_driver_leaves_no_ray_process_behind(tiny_model_dir, tmp_path):
    proc = start_job(tiny_model_dir, tmp_path, "grpo.max_num_steps=50")
    procs = wait_for_checkpoint(proc, tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert_none_left({p: t for p, t in procs.items() if p != proc.pid}, within_s=20)
