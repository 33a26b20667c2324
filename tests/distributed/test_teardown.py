"""Ending a run's processes without Ray's help: the record from /proc, the reaper after a kill -9 of the
driver, the SIGTERM watchdog, naming a dead actor."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nemo_fp8.distributed.teardown import _is_running, _start_time, describe_dead_actor

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="Linux /proc")


def gone_within(pid: int, start: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if _start_time(pid) != start or not _is_running(pid):
            return True
        time.sleep(0.05)
    return False


def test_reaper_kills_what_a_kill_9_driver_left_behind():
    # A "driver" records a child that runs in a session of its own (as Ray's actors do), then dies by kill -9.
    driver = textwrap.dedent("""
        import os, signal, subprocess, sys
        from nemo_fp8.distributed.teardown import RayProcesses
        procs = RayProcesses(reaper=True)
        child = subprocess.Popen(["sleep", "300"], start_new_session=True)
        procs.record()
        print(child.pid, procs.known[child.pid], flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pid, start = map(int, proc.stdout.split())
    assert gone_within(pid, start, 10), "the orphaned child outlived its killed driver"


def test_watchdog_kills_at_once_and_exits_143_when_the_cleanup_hangs():
    # The main thread gets Terminated, then its cleanup hangs (as ray.shutdown() waiting on a dead GCS).
    driver = textwrap.dedent("""
        import subprocess, threading
        from nemo_fp8.distributed.teardown import RayProcesses, SigtermWatchdog
        from nemo_fp8.utils.run_dir import Terminated, raise_on_sigterm
        raise_on_sigterm()
        procs = RayProcesses()
        child = subprocess.Popen(["sleep", "300"], start_new_session=True, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        procs.record()
        SigtermWatchdog(procs, lambda: "continue with --resume", grace_s=1.0).start()
        lock = threading.Lock()
        lock.acquire()
        try:  # the pid line inside the try: a SIGTERM arriving right after it is still this test's case
            print(child.pid, procs.known[child.pid], flush=True)
            lock.acquire()
        except Terminated:
            lock.acquire()  # the cleanup that never ends
    """)
    proc = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    pid, start = map(int, proc.stdout.readline().split())
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143 and time.monotonic() - t0 < 10, err
    assert "continue with --resume" in err
    assert gone_within(pid, start, 5)


def test_dead_actor_is_named():
    msg = ("The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR\n"
           "\tclass_name: PolicyWorker\n\tactor_id: abc123\n\tpid: 4242\n\tip: 10.0.0.1\n")
    err = type("ActorDiedError", (Exception,), {"actor_id": "abc123"})(msg)
    assert describe_dead_actor(err, {"abc123": "PolicyWorker rank 1"}).startswith("PolicyWorker rank 1 (pid 4242)")
    assert describe_dead_actor(err).startswith("PolicyWorker (pid 4242)")
