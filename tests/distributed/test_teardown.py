"""Ending a run's processes without Ray's help: the record from /proc, the reaper after a kill -9 of the
driver, the SIGTERM and Ctrl-C watchdog, Ray's excepthook, naming a dead actor."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nemo_fp8.distributed.teardown import _is_running, _start_time, describe_dead_actor

from tests.signals import sigint_default

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


def test_watchdog_kills_and_exits_143_when_the_cleanup_hangs():
    # The main thread gets Terminated, then its cleanup hangs (as ray.shutdown() waiting on a dead GCS).
    driver = textwrap.dedent("""
        import subprocess, threading
        from nemo_fp8.distributed.teardown import RayProcesses, SignalWatchdog
        from nemo_fp8.utils.run_dir import Terminated, raise_on_sigterm
        raise_on_sigterm()
        procs = RayProcesses()
        child = subprocess.Popen(["sleep", "300"], start_new_session=True, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        procs.record()
        SignalWatchdog(procs, lambda: "continue with --resume", grace_s=1.0).start()
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


# The main thread gets KeyboardInterrupt, then its graceful cleanup hangs (as a shutdown call queued behind the
# interrupted step's call on an actor).
CTRL_C_DRIVER = textwrap.dedent("""
    import subprocess, threading
    from nemo_fp8.distributed.teardown import RayProcesses, SignalWatchdog
    procs = RayProcesses()
    child = subprocess.Popen(["sleep", "300"], start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    procs.record()
    watchdog = SignalWatchdog(procs, lambda: "continue with --resume", interrupt_grace_s=GRACE).start()
    lock = threading.Lock()
    lock.acquire()
    try:
        print(child.pid, procs.known[child.pid], flush=True)
        lock.acquire()
    except KeyboardInterrupt:
        watchdog.absorb_interrupts()
        print("cleanup", flush=True)
        lock.acquire()  # the cleanup that never ends
""")


def start_ctrl_c_driver(grace_s: float):
    proc = subprocess.Popen([sys.executable, "-c", CTRL_C_DRIVER.replace("GRACE", str(grace_s))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    pid, start = map(int, proc.stdout.readline().split())
    proc.send_signal(signal.SIGINT)
    assert proc.stdout.readline().strip() == "cleanup"
    return proc, pid, start


def test_second_ctrl_c_ends_a_hanging_cleanup_at_once_with_130():
    proc, pid, start = start_ctrl_c_driver(grace_s=300)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and time.monotonic() - t0 < 5, err
    assert "press Ctrl-C again to stop at once" in err and "second Ctrl-C" in err, err
    assert "continue with --resume" in err and "Traceback" not in err, err
    assert gone_within(pid, start, 5)


def test_ctrl_c_watchdog_ends_a_hanging_cleanup_after_its_grace():
    proc, pid, start = start_ctrl_c_driver(grace_s=2)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and time.monotonic() - t0 < 10, err
    assert "cleanup did not finish within 2 s" in err and "continue with --resume" in err, err
    assert "(main thread at <string>:17 in <module>)" in err, err  # where it hung: the cleanup's lock.acquire()
    assert gone_within(pid, start, 5)


# Ctrl-C while the main thread forks: in the parent and in the child, the signal comes inside an at-fork hook that
# runs in the fork's window (as logging's lock release does), registered before the watchdog's hooks as an
# import's would be.
def fork_driver_prelude(sig: str) -> str:
    """Driver code: logging on, ``hook()`` raising ``sig`` (``SIGINT``, ``SIGTERM``) with bytecode after it (a
    handler that runs then runs inside the hook), ``wait_for_signal()`` (5 s)."""
    return textwrap.dedent(f"""
        import logging, os, signal, sys, time
        logging.basicConfig(level=logging.INFO, format="%(message)s")

        def hook():
            signal.raise_signal(signal.{sig})
            for _ in range(1000):
                pass

        def wait_for_signal():
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                time.sleep(0.01)
    """)


FORK_DRIVER = fork_driver_prelude("SIGINT") + textwrap.dedent("""
    os.register_at_fork(after_in_parent=hook, after_in_child=hook)
    from nemo_fp8.distributed.teardown import RayProcesses, SignalWatchdog
    SignalWatchdog(RayProcesses(), lambda: "continue with --resume", interrupt_grace_s=60).start()
    pid = None
    try:
        pid = os.fork()
        if pid == 0:
            try:
                wait_for_signal()
                os._exit(1)
            except KeyboardInterrupt:
                os._exit(7)
        wait_for_signal()
        print("not interrupted", flush=True)
    except KeyboardInterrupt:
        print("interrupted after the fork", flush=True)
    print("child exit", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
    logging.getLogger("driver").info("logging still works")  # its lock was released by its own at-fork hook
    time.sleep(0.5)  # the watchdog reads its pipe
""")


def test_ctrl_c_during_a_fork_is_raised_after_it_once():
    """The KeyboardInterrupt is neither lost in the hook (Python prints "Exception ignored" with a traceback and
    drops it) nor counted twice by the watchdog (the child's own Ctrl-C never reaches the parent's pipe): in both
    processes it reaches the main thread's own code right after the fork."""
    proc = subprocess.run([sys.executable, "-c", FORK_DRIVER], capture_output=True, text=True, timeout=60,
                          preexec_fn=sigint_default, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["interrupted after the fork", "child exit 7"], (proc.stdout, proc.stderr)
    assert "logging still works" in proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    assert proc.stderr.count("press Ctrl-C again to stop at once") == 1 and "second Ctrl-C" not in proc.stderr


# SIGTERM while the main thread forks: an after-fork hook in the parent raises it (as a reward worker's fork under
# a SIGTERM to the group). Terminated must reach the main thread's code, not be lost in the hook.
SIGTERM_FORK_DRIVER = fork_driver_prelude("SIGTERM") + textwrap.dedent("""
    from nemo_fp8.utils.run_dir import Terminated, raise_on_sigterm
    os.register_at_fork(after_in_parent=hook)
    raise_on_sigterm()
    from nemo_fp8.distributed.teardown import RayProcesses, SignalWatchdog
    watchdog = SignalWatchdog(RayProcesses(), lambda: "continue with --resume", grace_s=30).start()
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        wait_for_signal()
        print("not terminated", flush=True)
    except Terminated:
        print("terminated after the fork", watchdog.fired.wait(5), flush=True)
    logging.info("logging still works")
""")


def test_sigterm_during_a_fork_is_raised_after_it():
    proc = subprocess.run([sys.executable, "-c", SIGTERM_FORK_DRIVER], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["terminated after the fork True"], (proc.stdout, proc.stderr)
    assert "logging still works" in proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr


# Ctrl-C while the reward's pool forks a worker: once inside the fork's window (an at-fork hook registered before
# the watchdog's) and once inside multiprocessing's bootstrap, before pebble's worker sets SIG_IGN itself.
POOL_FORK_DRIVER = textwrap.dedent("""
    import multiprocessing.util, os, signal
    from nemo_fp8.distributed.teardown import RayProcesses, SignalWatchdog
    from nemo_fp8.rewards import MathRewardScorer

    os.register_at_fork(after_in_child=lambda: signal.raise_signal(signal.SIGINT))

    class Bootstrap:
        pass

    bootstrap = Bootstrap()  # the registry holds it weakly
    multiprocessing.util.register_after_fork(bootstrap, lambda _: signal.raise_signal(signal.SIGINT))
    SignalWatchdog(RayProcesses(), lambda: "continue with --resume", interrupt_grace_s=60).start()
    with MathRewardScorer(num_workers=2, timeout_s=30) as scorer:  # answers that need math-verify: the pool
        print(scorer([r"\\boxed{\\frac{1}{2}}", r"\\boxed{x+1}", r"\\boxed{2^3}"], ["0.5", "1+x", "8"]), flush=True)
        print(scorer.pop_stats()["num_errors"], flush=True)
""")


def test_the_reward_pools_workers_ignore_a_ctrl_c_that_comes_while_they_start():
    """A worker that got Ctrl-C before pebble's own SIG_IGN died with a traceback (the parent owns Ctrl-C and
    stops its workers): each worker here gets two, and every answer is still scored."""
    proc = subprocess.run([sys.executable, "-c", POOL_FORK_DRIVER], capture_output=True, text=True, timeout=120,
                          preexec_fn=sigint_default, env={**os.environ, "PYTHONPATH": str(REPO)},
                          start_new_session=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[1.0, 1.0, 1.0]", "0.0"], (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    assert "interrupted" not in proc.stderr, proc.stderr  # the children's Ctrl-C is their own


def test_a_ctrl_c_ignoring_context_is_the_fork_context_with_its_own_process():
    import multiprocessing

    from nemo_fp8.distributed.teardown import ctrl_c_ignoring_context

    ctx = ctrl_c_ignoring_context("fork")
    assert ctx.get_start_method() == "fork" and ctx.Process is not multiprocessing.get_context("fork").Process
    assert ctrl_c_ignoring_context("spawn") is multiprocessing.get_context("spawn")
    with pytest.raises(ValueError):
        ctrl_c_ignoring_context("no-such-method")


def test_rays_excepthook_is_replaced_once_ray_is_torn_down():
    # Ray's hook reports an uncaught exception to the GCS before printing it: with the GCS gone that waits 60 s
    # and Ray then ends the process, the error unprinted.
    driver = textwrap.dedent("""
        import sys
        import ray
        from nemo_fp8.distributed.teardown import bounded_ray_shutdown
        assert sys.excepthook.__module__.startswith("ray."), sys.excepthook
        bounded_ray_shutdown(5.0)
        print(sys.excepthook is sys.__excepthook__)
    """)
    proc = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr[-2000:]


def test_failures_are_named_in_one_line():
    import ray

    from nemo_fp8.generation.group import EngineError
    from nemo_fp8.distributed.teardown import describe_failure
    from nemo_fp8.utils.checkpoint import CheckpointWriteError

    try:
        raise EngineError("generate: engine 1 (node 10.0.0.1, CPU) died: GenerationWorker (pid 7)") \
            from ray.exceptions.RayActorError()
    except EngineError as e:
        assert describe_failure(e) == ("EngineError: generate: engine 1 (node 10.0.0.1, CPU) died: "
                                       "GenerationWorker (pid 7)", False)
    try:
        raise CheckpointWriteError("checkpoint step_2: the disk is full") from OSError(28, "No space left")
    except CheckpointWriteError as e:
        assert describe_failure(e) == ("CheckpointWriteError: checkpoint step_2: the disk is full", False)
    assert describe_failure(ValueError("bad\nmore")) == ("ValueError: bad", True)


def test_a_local_rays_services_lead_process_groups_of_their_own():
    # A SIGTERM to the driver's process group must not reach the raylet: with it gone, Ray's core worker ends the
    # driver with exit code 1 at its next touch of the object store, before the resume hint is printed.
    driver = textwrap.dedent("""
        import os
        import ray
        from ray._private import services
        from nemo_fp8.distributed.cluster import init_ray
        from nemo_fp8.distributed.teardown import RayProcesses, descendants, fast_teardown
        base = services.ConsolePopen
        init_ray(None, 1)
        assert services.ConsolePopen is base, services.ConsolePopen
        names = {p: open(f"/proc/{p}/cmdline", "rb").read().split(b"\\0")[0].rsplit(b"/", 1)[-1].decode()
                 for p in descendants(os.getpid())}
        services_ = {p: n for p, n in names.items() if n in ("gcs_server", "raylet")}
        assert sorted(services_.values()) == ["gcs_server", "raylet"], names
        print(sum(os.getpgid(p) == os.getpgid(0) for p in services_), flush=True)
        procs = RayProcesses()
        procs.record()
        fast_teardown(procs)
        print(len(procs.alive()), flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["0", "0"], (proc.stdout, proc.stderr[-2000:])
