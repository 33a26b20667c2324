"""Run ownership of the log and checkpoint folders: run id, config hash, lock, ownership marker.

A run owns its folders for its whole life:

* ``run.json`` (the ownership marker) holds the run id, the hash of the resolved config, the host,
  pid and start time; a resumed run keeps the id and records each resume.
* ``.lock`` is held with ``flock`` while the run is alive (the kernel drops it when the process
  dies, ``kill -9`` included) and names the holder's pid, host and run id, so a second run on the
  same folder stops at once naming the first.
* a fresh run into a folder that holds another run's checkpoints or metrics stops, and says to
  pass ``--resume``, choose a new folder, or ``--overwrite``.
"""

from __future__ import annotations

import datetime as _dt
import errno
import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import socket
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MARKER = "run.json"
LOCK = ".lock"


class RunSetupError(RuntimeError):
    """A run cannot start as asked (folders, checkpoints, data, model, resources); the message says
    what is wrong, naming the file, key or process, and what to do."""


def new_run_id() -> str:
    """A fresh run id: UTC time plus 6 random hex digits, e.g. ``20250101-120000-a1b2c3``."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def config_hash(config_yaml: str) -> str:
    """First 12 hex digits of the SHA-256 of the resolved config YAML."""
    return hashlib.sha256(config_yaml.encode()).hexdigest()[:12]


def read_marker(folder: str | Path) -> dict[str, Any] | None:
    """The ownership marker of ``folder`` (None when absent or unreadable)."""
    f = Path(folder) / MARKER
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError):
        return None


def os_error_reason(err: BaseException) -> str:
    """Why a file could not be written, for a user: ``the disk is full`` (ENOSPC, EDQUOT), ``the file system is
    read-only`` (EROFS), else the error's own text. ``err`` may be a Ray task error wrapping an ``OSError``."""
    cause = getattr(err, "cause", None) if isinstance(getattr(err, "cause", None), OSError) else err
    code = getattr(cause, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT):
        return f"the disk is full ([Errno {code}] {os.strerror(code)})"
    if code == errno.EROFS:
        return f"the file system is read-only ([Errno {code}] {os.strerror(code)})"
    return f"{type(cause).__name__}: {cause}"


FULL_BELOW_BYTES = 16 * 2**20


def write_failure_reason(err: BaseException, folder: str | Path) -> str | None:
    """Why writing under ``folder`` failed, when it is the file system's fault; None for other errors.

    Writers report a full disk in their own ways: an ``OSError`` (ENOSPC), safetensors' ``SafetensorError``
    ("No space left on device (os error 28)"), torch's ``RuntimeError`` ("unexpected pos ..."), each maybe
    wrapped by Ray. So besides the error, the free space is asked: less than ``FULL_BELOW_BYTES`` left after a
    failed write is a full disk. Call before the partial files are removed (they hold the space).
    """
    cause = getattr(err, "cause", None) or err
    if isinstance(cause, OSError):
        return os_error_reason(cause)
    text = (str(cause).splitlines() or [""])[0][:200]
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        free = None
    if "No space left on device" in text or "os error 28" in text or (free is not None and free < FULL_BELOW_BYTES):
        left = f"{free / 2**20:.1f} MiB left; " if free is not None else ""
        return f"the disk is full ({left}{type(cause).__name__}: {text})"
    return None


def write_marker(folder: str | Path, run_id: str, cfg_hash: str, resumed: bool, key: str = "") -> None:
    """Write (or, on resume, update) ``run.json`` in ``folder`` atomically.

    Args:
        key: the config key that names ``folder`` (``logger.log_dir``), for the error.

    Raises:
        RunSetupError: the marker could not be written (names the key, the folder and why: a full disk, a
            read-only file system); no partial ``run.json.tmp`` is left.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    old = read_marker(folder) if resumed else None
    marker = old if old and old.get("run_id") == run_id else {"run_id": run_id, "created": now, "resumes": []}
    marker.update(config_hash=cfg_hash, host=socket.gethostname(), pid=os.getpid())
    if resumed:
        marker.setdefault("resumes", []).append({"at": now, "config_hash": cfg_hash, "pid": os.getpid()})
    tmp = folder / f"{MARKER}.tmp"
    try:
        tmp.write_text(json.dumps(marker, indent=2))
        tmp.replace(folder / MARKER)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise RunSetupError(f"{key + ': ' if key else ''}cannot write {folder / MARKER}: {os_error_reason(e)}; "
                            "free space on it or choose another folder") from None


class FolderLock:
    """An exclusive ``flock`` on ``<folder>/.lock``, holding the pid, host and run id of its owner.

    Raises (from :meth:`acquire`):
        RunSetupError: another live process holds the lock (names its pid, host and run id).
    """

    def __init__(self, folder: str | Path, run_id: str):
        self.folder, self.run_id = Path(folder), run_id
        self._fd: int | None = None
        self._created = False

    def acquire(self) -> "FolderLock":
        self._created = not self.folder.exists()
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / LOCK
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
            except ValueError:
                holder = {}
            os.close(fd)
            raise RunSetupError(
                f"{self.folder} is in use by another run (run {holder.get('run_id', '?')}, pid "
                f"{holder.get('pid', '?')} on host {holder.get('host', '?')}, started {holder.get('started', '?')}); "
                "wait for it to finish, stop it, or choose another logger.log_dir / checkpointing.checkpoint_dir"
            ) from None
        info = {"pid": os.getpid(), "host": socket.gethostname(), "run_id": self.run_id,
                "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock (safe to call twice); the lock file stays, its content is stale. A folder this lock
        created and the run left holding only the lock file (a run refused before it wrote anything) is
        removed. A folder removed or made unreadable meanwhile (the run may be ending because of it) is left as
        it is: the lock is still dropped, and nothing is raised over the error that ends the run."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                if self._created and [p.name for p in self.folder.iterdir()] == [LOCK]:
                    (self.folder / LOCK).unlink()
                    self.folder.rmdir()
            except OSError as e:
                logger.warning("releasing the lock of %s: %s", self.folder, os_error_reason(e))
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> "FolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def foreign_contents(log_dir: Path, checkpoint_dir: Path | None) -> list[str]:
    """What a fresh run would mix with: step checkpoints or metrics (a marker alone, left by a run
    that stopped before writing either, is not: the new run takes the folder over)."""
    found = []
    if checkpoint_dir is not None and checkpoint_dir.is_dir():
        steps = sorted(p.name for p in checkpoint_dir.iterdir() if p.name.startswith("step_") and p.is_dir())
        if steps:
            found.append(f"{checkpoint_dir} holds checkpoints {', '.join(steps[-3:])}"
                         + (f" (+{len(steps) - 3} more)" if len(steps) > 3 else ""))
    metrics = log_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append(f"{metrics} holds another run's metrics")
    owner = (read_marker(checkpoint_dir) if checkpoint_dir else None) or read_marker(log_dir)
    if found and owner:
        found[0] = f"run {owner.get('run_id')}: {found[0]}"
    return found


def claim_fresh(log_dir: Path, checkpoint_dir: Path | None, overwrite: bool) -> None:
    """Make sure a fresh run does not mix with an older one in the same folders.

    With ``overwrite``, the older run's step checkpoints are deleted, its ``metrics.jsonl`` is
    moved aside to ``metrics.<old run id>.jsonl`` and its TensorBoard events to
    ``tensorboard.<old run id>/`` (never silently lost, never mixed into the new run's curves).

    Raises:
        RunSetupError: the folders hold another run's checkpoints or metrics and not ``overwrite``.
    """
    found = foreign_contents(log_dir, checkpoint_dir)
    if not found:
        return
    if not overwrite:
        raise RunSetupError("a fresh run would mix with an earlier run: " + "; ".join(found)
                            + ". Pass --resume to continue that run, choose a new logger.log_dir / "
                            "checkpointing.checkpoint_dir, or pass --overwrite to replace it")
    if checkpoint_dir is not None and checkpoint_dir.is_dir():
        for p in checkpoint_dir.iterdir():
            if p.name.startswith("step_") and p.is_dir():
                shutil.rmtree(p)
    metrics = log_dir / "metrics.jsonl"
    if metrics.is_file():
        old = (read_marker(log_dir) or {}).get("run_id", "old")
        aside = log_dir / f"metrics.{old}.jsonl"
        metrics.replace(aside)
        logger.warning("--overwrite: old metrics moved to %s", aside)
    events = log_dir / "tensorboard"
    if events.is_dir():
        aside = log_dir / f"tensorboard.{(read_marker(log_dir) or {}).get('run_id', 'old')}"
        shutil.rmtree(aside, ignore_errors=True)
        events.replace(aside)
        logger.warning("--overwrite: old TensorBoard events moved to %s", aside)
    logger.warning("--overwrite: %s", "; ".join(found) + " (removed)")


class RunFailed(RuntimeError):
    """A run stopped by a failure outside the config (a Ray worker or engine died, a checkpoint could not be
    written, the reward scorer raised); the message names the part that failed and how to continue
    (``--resume``). The entry point exits with code 1."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, turned into an interrupt so the run cleans up as on Ctrl-C."""


def raise_on_sigterm() -> None:
    """Make SIGTERM raise :class:`Terminated` in the main thread (``ray.init`` replaces the handler
    with ``sys.exit``; call this again after it). No-op outside the main thread.

    A process forked from this one (the reward's ``pebble`` workers) inherits the handler; there SIGTERM takes its
    default action instead, ending the child quietly: the parent owns the run's end, and a ``Terminated`` raised in a
    worker still bootstrapping printed a traceback when SIGTERM reached the whole process group."""
    import os
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    owner = os.getpid()

    def _handler(signum, frame):
        if os.getpid() != owner:  # an inherited copy in a forked child
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        raise Terminated()

    signal.signal(signal.SIGTERM, _handler)
