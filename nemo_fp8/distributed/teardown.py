"""Ending a run's Ray processes quickly and completely, also when Ray itself is half gone.

Two cases the graceful path (``group.shutdown()`` then ``ray.shutdown()``) handles badly:

* SIGTERM to the whole process group (``timeout``, ``kill -- -PGID``): had the local Ray's GCS and raylet been in
  the driver's group, they would die with it, and Ray's core worker ends the driver (exit code 1, nothing printed)
  at its next touch of the object store, often before any Python code runs. ``init_ray`` starts them in process
  groups of their own (``cluster.ray_services_in_own_process_group``), and the teardown disconnects from Ray before
  it kills them. A SIGTERM to every process (systemd's default, SLURM) still reaches them; the driver then races
  Ray's exit as before.
* an actor process that died (OOM killer, a crash in a native library): Ray raises
  ``ActorDiedError`` with a long message; the other actors and Ray's agents live on.

``SignalWatchdog`` acts on SIGTERM and Ctrl-C without the main thread, which may be blocked inside Ray's C++
(``ray.get`` on an actor whose raylet is gone never returns to Python). SIGTERM: it gives the main thread
``grace_s`` to clean up and exit (it raises ``Terminated``), and otherwise prints the resume hint, kills the
recorded Ray processes and ends the process with code 143. Ctrl-C: the main
thread cleans up gracefully; a second Ctrl-C, or a cleanup still running ``interrupt_grace_s`` later, kills the
Ray processes and ends the process with code 130 after the resume hint.

Ray's ``sys.excepthook`` reports an uncaught exception to the GCS before printing it; with the GCS gone that
call waits 60 s and Ray then ends the process, message unprinted. ``fast_teardown`` and ``graceful_teardown``
put Python's own hook back once Ray is stopped.

``RayProcesses`` remembers the processes a local Ray started for this driver (its descendants in
``/proc``, with their start times so that a reused pid is never hit) while they can still be found;
the actors' worker processes run in sessions of their own and outlive the raylet, so they are only
reachable through this record. ``fast_teardown`` bounds ``ray.shutdown()`` in time, then kills them.
A reaper process (in a session of its own) gets the same record and kills what is left when the
driver ends, so a ``kill -9`` of the driver leaves no Ray process behind either. Linux only
(``/proc``); elsewhere the record is empty and the teardown is ``ray.shutdown()``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

logger = logging.getLogger(__name__)


def _start_time(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (clock ticks after boot); None when the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])


def descendants(pid: int | None = None) -> dict[int, int]:
    """``{pid: start time}`` of every live descendant of ``pid`` (default: this process), from ``/proc``."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = {}, list(children.get(root, []))
    while todo:
        p = todo.pop()
        if (t := _start_time(p)) is not None:
            out[p] = t
        todo.extend(children.get(p, []))
    return out


# The reaper: a small process in a session of its own that reads "pid start_time" lines from the driver
# and, when its stdin closes (the driver ended, kill -9 included), kills those still alive.
_REAPER = """
import os, signal, sys
def start(pid):
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])
known = {}
for line in sys.stdin:
    pid, t = line.split()
    known[int(pid)] = int(t)
for pid, t in known.items():
    if start(pid) == t:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
"""


class RayProcesses:
    """The processes a local Ray started for this driver, recorded while they are its descendants.

    Args:
        reaper: also hand each recorded process to a reaper process (``_REAPER``) that kills the ones
            still alive when this driver ends, also by ``kill -9``, which no code in the driver survives.
    """

    def __init__(self, reaper: bool = False) -> None:
        self.known: dict[int, int] = {}
        self._reaper = None
        if reaper and Path("/proc").is_dir():
            self._reaper = subprocess.Popen([sys.executable, "-c", _REAPER], stdin=subprocess.PIPE, text=True,
                                            start_new_session=True)

    def record(self) -> None:
        """Add this process's current descendants (call once the actors run, and again at teardown)."""
        found = {p: t for p, t in descendants().items() if self._reaper is None or p != self._reaper.pid}
        new = {p: t for p, t in found.items() if self.known.get(p) != t}
        self.known.update(found)
        if self._reaper is not None and new:
            try:
                self._reaper.stdin.write("".join(f"{p} {t}\n" for p, t in new.items()))
                self._reaper.stdin.flush()
            except (OSError, ValueError):  # the reaper is gone: the driver's own teardown still runs
                pass

    def close_reaper(self) -> None:
        """Let the reaper finish (it kills what is left of the record, then exits)."""
        if self._reaper is not None:
            reaper, self._reaper = self._reaper, None
            try:
                reaper.stdin.close()
                reaper.wait(timeout=10)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass

    def alive(self) -> list[int]:
        """Recorded pids still running (same start time: not a reused pid)."""
        return [p for p, t in self.known.items() if _start_time(p) == t and _is_running(p)]

    def kill(self, wait_s: float = 5.0) -> list[int]:
        """SIGKILL every recorded process still alive, wait up to ``wait_s`` for them to go; returns the pids
        that were killed."""
        victims = self.alive()
        for p in victims:
            try:
                os.kill(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and self.alive():
            time.sleep(0.05)
        return victims


def _is_running(pid: int) -> bool:
    """Not a zombie (a killed child that its parent has not reaped yet counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def bounded_ray_shutdown(timeout_s: float) -> bool:
    """``ray.shutdown()`` in a daemon thread, waited for at most ``timeout_s`` (it waits on a GCS that may be gone;
    a thread that does not return in time is left behind). Then Python's own ``sys.excepthook`` is put back
    (``restore_excepthook``). Returns whether it returned in time."""
    import ray

    done = threading.Event()

    def _shutdown():
        try:
            ray.shutdown()
        finally:
            done.set()

    threading.Thread(target=_shutdown, daemon=True, name="ray-shutdown").start()
    ok = done.wait(timeout_s)
    if not ok:
        logger.warning("teardown: ray.shutdown() did not return within %.0f s; going on without it", timeout_s)
    restore_excepthook()
    return ok


def restore_excepthook() -> None:
    """Put Python's ``sys.excepthook`` back where Ray's is installed: Ray's reports the exception to the GCS first,
    which, once Ray is torn down, waits 60 s and then ends the process without printing anything."""
    if getattr(sys.excepthook, "__module__", "").startswith("ray."):
        sys.excepthook = sys.__excepthook__


def fast_teardown(procs: RayProcesses, shutdown_timeout_s: float = 5.0) -> None:
    """The end of a run whose actors are not asked to stop (SIGTERM, a failure): ``bounded_ray_shutdown(
    shutdown_timeout_s)``, then kill the recorded Ray processes that outlive it.

    Disconnecting first matters: while this process's core worker is connected, a raylet killed under it makes Ray
    end this process with exit code 1 at the next touch of the object store (``cluster.init_ray``)."""
    procs.record()
    bounded_ray_shutdown(shutdown_timeout_s)
    killed = procs.kill()
    logger.info("teardown: killed %d Ray process(es) left after ray.shutdown()", len(killed))


def graceful_teardown(workers, procs: RayProcesses, timeout_s: float = 5.0) -> None:
    """The end of a run whose actors may still answer (done, or Ctrl-C): ``workers.shutdown(timeout_s)`` (each
    group's shutdown call waits at most ``timeout_s``: an actor busy with an interrupted call is ended anyway),
    ``bounded_ray_shutdown(timeout_s)``, then the Ray processes that outlive it are killed."""
    if workers is not None:
        workers.shutdown(timeout_s)
    bounded_ray_shutdown(timeout_s)
    procs.kill()  # Ray's agents that outlive ray.shutdown()


_FORK_HOOK = False
# Ctrl-C while the main thread forks (the reward's pebble workers, a subprocess): Python runs the at-fork hooks as
# Python code, and a KeyboardInterrupt raised inside one (logging's lock release, say) is printed as "Exception
# ignored", lost, and can leave that lock held. While the main thread forks, the watchdog's SIGINT handler defers
# the interrupt to just after the fork; the forking thread blocks SIGINT until the child has let go of the
# watchdog's pipe, so that one Ctrl-C is never counted twice. SIGTERM's Terminated is deferred the same way
# (_sigterm_deferred_during_fork).
_FORK = {"active": False, "deferred": None}  # deferred: the interrupt to raise after the fork (a class)
_FORK_MASK = threading.local()


def _drop_wakeup_fd() -> None:
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:  # not the main thread: nothing was inherited that Python would write to
        pass


def _restore_sigint_mask() -> None:
    old = getattr(_FORK_MASK, "old", None)
    if old is None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    else:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _before_fork() -> None:
    """Registered after the imports' hooks, so it runs first of the before-fork hooks."""
    _FORK_MASK.old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    if threading.current_thread() is threading.main_thread():
        _FORK["active"] = True


def _end_fork_window() -> None:
    """Unblock Ctrl-C (one that came meanwhile runs the handler now, and is deferred), then end the window. A deferred
    Ctrl-C is raised in the main thread by a helper thread once the hooks are done: raised inside a hook it would be
    lost again."""
    _restore_sigint_mask()
    if _FORK["deferred"]:
        threading.Thread(target=_raise_deferred_interrupt, daemon=True, name="deferred-interrupt").start()
    _FORK["active"] = False  # the last statement: nothing after it can raise inside this hook


def _after_fork_in_parent() -> None:
    """Runs last of the parent's after-fork hooks."""
    if threading.current_thread() is threading.main_thread():
        _end_fork_window()
    else:
        _restore_sigint_mask()


def _raise_deferred_interrupt() -> None:
    """The deferred interrupt (``KeyboardInterrupt``, or ``Terminated`` for SIGTERM) in the main thread once it has
    left the fork, as an asynchronous exception (``PyThreadState_SetAsyncExc``): a signal again would reach the
    watchdog's pipe as a second Ctrl-C."""
    while _FORK["active"]:
        time.sleep(0.001)
    exc, _FORK["deferred"] = _FORK["deferred"] or KeyboardInterrupt, None
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(threading.main_thread().ident),
                                               ctypes.py_object(exc))


def _after_fork_in_child() -> None:
    """The child lets go of the watchdog's pipe before it unblocks Ctrl-C, which it then handles as the parent
    would (after its hooks); a worker of ``ctrl_c_ignoring_context`` ignores it from here on instead (a Ctrl-C
    that came during the fork is dropped with it)."""
    _drop_wakeup_fd()
    _FORK["active"], _FORK["deferred"] = True, None
    _ignore_sigint_in_a_pool_child()  # before the unblock: a Ctrl-C pending from the fork is dropped
    _end_fork_window()


def _ignore_sigint_in_a_pool_child() -> None:
    """A ``ctrl_c_ignoring_context`` worker ignores Ctrl-C from here on. Called by ``_after_fork_in_child`` and,
    in a process without the watchdog's hooks, registered as an after-fork hook of its own."""
    if getattr(_FORK_MASK, "child_ignores_sigint", False):
        signal.signal(signal.SIGINT, signal.SIG_IGN)


_POOL_HOOK = False


def ctrl_c_ignoring_context(method: str | None = None):
    """A ``multiprocessing`` context whose processes ignore Ctrl-C from the fork on, for pool workers whose parent
    owns Ctrl-C and ends them (the reward's ``pebble`` workers, which set ``SIG_IGN`` themselves only once
    ``multiprocessing`` has bootstrapped them: a Ctrl-C to the process group in between killed a worker with a
    ``KeyboardInterrupt`` traceback).

    The fork start method only (the default on Linux): the flag is set in the forking thread around
    ``Process.start`` and read by an after-fork hook in the child, before ``multiprocessing``'s bootstrap runs.
    Other start methods begin a fresh interpreter; their context is returned unchanged.

    Args:
        method: the start method (``multiprocessing.get_context``'s argument; None: the default).

    Returns:
        The context to hand to ``pebble.ProcessPool(context=...)`` or ``multiprocessing``.

    Raises:
        ValueError: an unknown start method (from ``multiprocessing.get_context``).
    """
    import multiprocessing

    global _POOL_HOOK
    ctx = multiprocessing.get_context(method)
    if ctx.get_start_method() != "fork":
        return ctx
    ctx = multiprocessing.get_context("fork")  # the fork context itself, not the default one that names it
    if not _POOL_HOOK:
        os.register_at_fork(after_in_child=_ignore_sigint_in_a_pool_child)
        _POOL_HOOK = True

    class CtrlCIgnoringProcess(ctx.Process):
        def start(self) -> None:
            _FORK_MASK.child_ignores_sigint = True
            try:
                super().start()
            finally:
                _FORK_MASK.child_ignores_sigint = False

    class CtrlCIgnoringContext(type(ctx)):
        Process = CtrlCIgnoringProcess

    return CtrlCIgnoringContext()


def _sigint_during_fork_deferred(signum, frame) -> None:
    """Python's default Ctrl-C (``KeyboardInterrupt``), deferred while the main thread forks."""
    if _FORK["active"]:
        _FORK["deferred"] = _FORK["deferred"] or KeyboardInterrupt
        return
    raise KeyboardInterrupt


def _sigterm_deferred_during_fork(handler: Callable, owner: int) -> Callable:
    """``handler`` (``raise_on_sigterm``'s: it raises ``Terminated``), deferred like Ctrl-C while the main thread of
    process ``owner`` forks: raised inside an at-fork hook, ``Terminated`` would be printed as "Exception ignored"
    and lost, and the run would go on training until the watchdog's grace ran out. A SIGTERM outranks a deferred
    Ctrl-C. In a forked child (another pid) ``handler`` runs as it is."""
    from nemo_fp8.utils.run_dir import Terminated

    def _handler(signum, frame):
        if _FORK["active"] and os.getpid() == owner:
            _FORK["deferred"] = Terminated
            return
        return handler(signum, frame)

    return _handler


def main_thread_at(depth: int = 6) -> str:
    """Where the main thread is now, innermost call first: ``"main thread at file:line in func <- ..."`` (``depth``
    frames), for a cleanup that did not finish in time to say what it was waiting on."""
    import traceback

    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "main thread gone"
    calls = traceback.extract_stack(frame)[::-1][:depth]
    return "main thread at " + " <- ".join(f"{Path(c.filename).name}:{c.lineno} in {c.name}" for c in calls)


class SignalWatchdog:
    """Make sure the process ends soon after SIGTERM (code 143) or Ctrl-C (code 130), even with the main thread
    blocked in Ray.

    SIGTERM: the main thread cleans up (it gets ``Terminated``); if the process still runs ``grace_s`` later, the
    resume hint is printed, the recorded Ray processes are killed and the process exits with 143. Ctrl-C: the
    notice that a second Ctrl-C ends the run at once is printed and the main thread cleans up
    (``absorb_interrupts`` keeps a second Ctrl-C from interrupting that cleanup); a second Ctrl-C, or a process
    still running ``interrupt_grace_s`` later, prints the resume hint, kills the Ray processes and exits with 130.

    Uses ``signal.set_wakeup_fd``: the C-level signal handler writes the signal number to a pipe even while
    the main thread is blocked in native code; a daemon thread reads it. Where Ctrl-C has Python's default handler,
    ``start`` replaces it with one that raises the ``KeyboardInterrupt`` after a fork of the main thread rather than
    inside its at-fork hooks (``_FORK``). A Python handler for SIGTERM must be
    installed (``nemo_fp8.utils.run_dir.raise_on_sigterm``), else nothing is written. Main thread only.

    Args:
        procs: the run's Ray processes.
        hint: returns what to print before a forced exit (the resume hint).
        grace_s: seconds the main thread gets to end the process itself after SIGTERM.
        interrupt_grace_s: seconds it gets after Ctrl-C (a graceful cleanup: the actors are asked to shut down).
    """

    def __init__(self, procs: RayProcesses, hint: Callable[[], str], grace_s: float = 10.0,
                 interrupt_grace_s: float = 20.0):
        self.procs, self.hint, self.grace_s, self.interrupt_grace_s = procs, hint, grace_s, interrupt_grace_s
        self.fired = threading.Event()  # SIGTERM
        self.interrupted = threading.Event()  # Ctrl-C
        self._read_fd = self._write_fd = None
        self._old_fd = -1
        self._old_sigint = None
        self._default_sigint = None  # Python's default handler, where start replaced it
        self._old_sigterm = None  # the SIGTERM handler start wrapped (deferred during a fork)

    def start(self) -> "SignalWatchdog":
        """Start watching (main thread only: ``signal.set_wakeup_fd``)."""
        global _FORK_HOOK
        if not _FORK_HOOK:  # a forked child (the reward's pebble workers) must not write its signals to our pipe
            os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                                after_in_child=_after_fork_in_child)
            _FORK_HOOK = True
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._default_sigint = signal.signal(signal.SIGINT, _sigint_during_fork_deferred)
        term = signal.getsignal(signal.SIGTERM)
        if callable(term):  # raise_on_sigterm's handler
            self._old_sigterm = signal.signal(signal.SIGTERM, _sigterm_deferred_during_fork(term, os.getpid()))
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._old_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, daemon=True, name="signal-watchdog").start()
        return self

    def _watch(self) -> None:
        fd, deadline = self._read_fd, None
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                ready, _, _ = select.select([fd], [], [], wait)
                data = os.read(fd, 64) if ready else None
            except (OSError, ValueError):  # closed by stop()
                return
            if data is None:  # the Ctrl-C countdown ran out
                self._exit(130, f"interrupted (Ctrl-C); cleanup did not finish within {self.interrupt_grace_s:.0f} s "
                                f"({main_thread_at()})")
            if not data:
                return
            if signal.SIGTERM in data:
                break
            for _ in range(data.count(signal.SIGINT)):  # two Ctrl-C may come in one read
                if self.interrupted.is_set():
                    self._exit(130, "interrupted (second Ctrl-C); stopped at once")
                self.interrupted.set()
                deadline = time.monotonic() + self.interrupt_grace_s
                print("interrupted (Ctrl-C): cleaning up; press Ctrl-C again to stop at once", file=sys.stderr,
                      flush=True)
        self.fired.set()  # the main thread disconnects from Ray, then kills (fast_teardown); killing Ray's processes
        time.sleep(self.grace_s)  # from here first would let Ray end the process with code 1 (cluster.init_ray)
        self._exit(143, f"terminated (SIGTERM); cleanup did not finish within {self.grace_s:.0f} s ({main_thread_at()})")

    def _exit(self, code: int, why: str) -> None:
        """Print ``why`` and the resume hint, kill the Ray processes, end the process with ``code`` at once (Ray may
        end a process whose raylet it loses, with code 1: no wait between the kill and the exit; the reaper sees
        that they are gone)."""
        try:
            print(f"{why}; {self.hint()}", file=sys.stderr, flush=True)
            self.procs.kill(wait_s=0.0)
        finally:
            os._exit(code)

    def absorb_interrupts(self) -> None:
        """After the first Ctrl-C (main thread): a second one no longer raises ``KeyboardInterrupt`` in the main
        thread's cleanup; the watchdog ends the process instead. ``stop`` puts the old handler back."""
        if self._write_fd is not None and threading.current_thread() is threading.main_thread():
            self._old_sigint = signal.signal(signal.SIGINT, lambda signum, frame: None)

    def stop(self) -> None:
        """Stop watching. A watchdog that got SIGTERM or Ctrl-C keeps counting down (the exit it guards is under
        way) and keeps the second Ctrl-C's exit."""
        if self.fired.is_set() or self.interrupted.is_set() or self._write_fd is None:
            return
        if self._old_sigint is not None:
            signal.signal(signal.SIGINT, self._old_sigint)
        if self._default_sigint is not None:
            signal.signal(signal.SIGINT, self._default_sigint)
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
        signal.set_wakeup_fd(self._old_fd)
        os.close(self._write_fd)  # the reader sees EOF and returns
        self._write_fd = None


def actor_names(workers) -> dict[str, str]:
    """``{actor id (hex): "PolicyWorker rank r" | "GenerationWorker engine i (node <ip>, CPU)"}`` for a
    ``trainer.Workers``'s Ray actors (empty for backends that run in this process, or no workers)."""
    names = {}
    for r, w in enumerate(getattr(getattr(workers, "policy", None), "workers", None) or []):
        names[w._actor_id.hex()] = f"PolicyWorker rank {r}"
    generation = getattr(workers, "generation", None)
    engines = getattr(generation, "workers", None) or []
    labels = getattr(generation, "labels", None) or [f"engine {i}" for i in range(len(engines))]
    for w, label in zip(engines, labels):
        if hasattr(w, "_actor_id"):
            names[w._actor_id.hex()] = f"GenerationWorker {label}"
    return names


def describe_failure(err: BaseException, names: dict[str, str] | None = None) -> tuple[str, bool]:
    """One line naming what ended a run, and whether its traceback helps (an unexpected error, not a dead process
    or a full disk).

    ``RayActorError``: the actor that died (``describe_dead_actor``). ``RunFailed`` (``EngineError``, a
    checkpoint that could not be written, the reward scorer's error): its class (a subclass) and its own message,
    which names the part. ``RayTaskError``: the actor that raised and its exception. Anything else: its type and
    message.
    """
    import ray

    from nemo_fp8.utils.run_dir import RunFailed

    if isinstance(err, ray.exceptions.RayActorError):
        return f"the Ray worker {describe_dead_actor(err, names)} died", False
    if isinstance(err, RunFailed):
        cause = err.__cause__
        known = cause is None or isinstance(cause, (OSError, ray.exceptions.RayActorError))  # died, full disk
        return (str(err) if type(err) is RunFailed else f"{type(err).__name__}: {err}"), not known
    if isinstance(err, ray.exceptions.RayTaskError):
        cause = getattr(err, "cause", None) or err
        actor_id, title = re.search(r"actor_id=([0-9a-f]+)", str(err)), re.search(r"ray::(\w+)", str(err))
        actor = (names or {}).get(actor_id.group(1) if actor_id else "") or (title.group(1) if title else "?")
        return f"the Ray worker {actor} raised {type(cause).__name__}: {first_line(cause)}", True
    return f"{type(err).__name__}: {first_line(err)}", True


def first_line(err: BaseException) -> str:
    """The first non-empty line of ``str(err)`` (Ray's errors run over many lines), at most 300 characters."""
    return next((line.strip() for line in str(err).splitlines() if line.strip()), "")[:300]


def describe_dead_actor(err: BaseException, names: dict[str, str] | None = None) -> str:
    """Which actor a ``RayActorError`` is about (``PolicyWorker rank 0 (pid 123)``), from ``names`` (see
    ``actor_names``) or Ray's message, and the first line of Ray's reason."""
    text = str(err)
    cls = re.search(r"class_name:\s*(\S+)", text)
    pid = re.search(r"\bpid:\s*(\d+)", text)
    actor_id = getattr(err, "actor_id", None)
    name = (names or {}).get(actor_id or "") or (cls.group(1) if cls else f"actor {actor_id or '?'}")
    name += f" (pid {pid.group(1)})" if pid else ""
    reason = next((line.strip() for line in text.splitlines()
                   if line.strip() and not re.match(r"\s*(class_name|actor_id|pid|name|namespace|ip):", line)
                   and "The actor is dead" not in line and "died unexpectedly" not in line), "")
    return f"{name}{' (' + reason[:200] + ')' if reason else ''}"
