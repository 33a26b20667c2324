"""Step checkpoints: ``<checkpoint_dir>/step_<N>/`` with the policy and the trainer state.

A checkpoint is written to ``step_<N>.tmp`` and renamed when complete, so a crash while saving
never leaves a half checkpoint that ``--resume`` would pick up. The step's metrics row is written
(``before_commit``) after the files and before the rename: a kill before the rename resumes from
the previous checkpoint and ``repair_metrics`` moves the row aside to be written again; a kill after
it finds the row in place. No kill point loses or duplicates a row. Each checkpoint records the run
id that wrote it; only the last ``keep_last_k`` of *this run's* checkpoints are kept, so an
older run's steps are never counted (or deleted) by a newer one.

``verify_checkpoint`` checks a checkpoint's files cheaply (safetensors headers and sizes, the
optimizer archive's directory, the trainer state) before any actor loads it, and names the file
and what is wrong.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import struct
import zipfile
from pathlib import Path
from typing import Any, Callable, Optional

from nemo_fp8.utils.console import FILE_ONLY
from nemo_fp8.utils.run_dir import RunFailed, RunSetupError, write_failure_reason

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RunSetupError):
    """A checkpoint is missing or corrupt; the message names the file and what is wrong."""


class CheckpointWriteError(RunFailed):
    """A checkpoint could not be written (a full disk, a read-only file system); the message names the folder and
    why. The half-written ``step_<N>.tmp`` is removed; the previous checkpoints are untouched."""


class CheckpointManager:
    """Save/find step checkpoints under ``root``; the policy writes into ``<step dir>/policy``.

    Args:
        root: the checkpoint folder.
        keep_last_k: how many of this run's checkpoints to keep.
        run_id: written into each checkpoint's trainer state; pruning only considers checkpoints
            with this id (None: all checkpoints count, the behaviour before run ids).
    """

    def __init__(self, root: str | Path, keep_last_k: int = 2, run_id: str | None = None):
        self.root = Path(root)
        self.keep_last_k = keep_last_k
        self.run_id = run_id

    def steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir())

    def latest(self) -> Path | None:
        steps = self.steps()
        return self.root / f"step_{steps[-1]}" if steps else None

    def resolve(self, name: str) -> Path:
        """The checkpoint ``name`` (``step_N``, ``N`` or a path) for ``--resume-from``.

        Raises:
            CheckpointError: no such checkpoint (lists the ones there are).
        """
        p = Path(name)
        if not p.is_dir():
            p = self.root / (f"step_{name}" if name.isdigit() else name)
        if not p.is_dir():
            have = ", ".join(f"step_{s}" for s in self.steps()) or "none"
            raise CheckpointError(f"--resume-from {name}: no checkpoint {p} (checkpoints under {self.root}: {have})")
        return p

    def run_id_of(self, step: int) -> str | None:
        """The run id recorded in ``step_<step>`` (None: none recorded or unreadable)."""
        try:
            return json.loads((self.root / f"step_{step}" / "trainer_state.json").read_text()).get("run_id")
        except (OSError, ValueError):
            return None

    def remove_partial(self) -> list[Path]:
        """Delete the ``step_<N>.tmp`` folders a save left (killed, or a full disk): never resumable, and on a full
        disk they hold the space the next write needs. Call only while holding the folder's lock. Returns them."""
        if not self.root.is_dir():
            return []
        partial = [p for p in self.root.iterdir() if re.match(r"^step_\d+\.tmp$", p.name) and p.is_dir()]
        for p in partial:
            shutil.rmtree(p, ignore_errors=True)
            logger.warning("removed the partial checkpoint %s (a save that did not finish)", p)
        return partial

    def save(self, step: int, policy, trainer_state: dict[str, Any], config_yaml: str,
             before_commit: Optional[Callable[[], None]] = None,
             extra_files: Optional[dict[str, Callable[[Path], None]]] = None) -> Path:
        """Write policy weights + optimizer and ``trainer_state.json`` for ``step``; prune this run's old ones.

        ``before_commit`` runs once the files are written, just before the rename that makes the
        checkpoint visible (the trainer writes the step's metrics row there; module docstring).
        ``extra_files``: file name -> a writer called with the file's path inside the checkpoint being written
        (asynchronous GRPO's rollouts made ahead); the names are recorded as ``extra_files`` in the trainer state,
        and ``verify_checkpoint`` checks them.

        Raises:
            CheckpointWriteError: the files could not be written (a full disk, a read-only file system: names the
                folder and why, ``write_failure_reason``); ``step_<N>.tmp`` is removed, the earlier checkpoints
                stay. Other errors of the writers are raised as they are, also after removing it.
        """
        final = self.root / f"step_{step}"
        tmp = self.root / f"step_{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir(parents=True)
            policy.save(tmp / "policy")
            for name, write in (extra_files or {}).items():
                write(tmp / name)
            state = {"step": step, **({"run_id": self.run_id} if self.run_id else {}), **trainer_state,
                     **({"extra_files": sorted(extra_files)} if extra_files else {})}
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
            (tmp / "config.yaml").write_text(config_yaml)
        except Exception as e:  # also a Ray worker's error from policy.save (RayTaskError(<the writer's error>))
            reason = write_failure_reason(e, self.root)  # while the partial files still hold the space
            shutil.rmtree(tmp, ignore_errors=True)  # a full disk must not stay full of a checkpoint never used
            if reason is None:
                raise
            raise CheckpointWriteError(
                f"checkpoint step_{step} could not be written to checkpointing.checkpoint_dir={self.root}: "
                f"{reason}; free space there or choose another checkpointing.checkpoint_dir") from None
        if before_commit is not None:
            before_commit()
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        mine = [s for s in self.steps() if self.run_id is None or self.run_id_of(s) == self.run_id]
        for old in mine[: -self.keep_last_k]:
            shutil.rmtree(self.root / f"step_{old}", ignore_errors=True)
        logger.info("checkpoint saved: %s", final, extra=FILE_ONLY)  # per step: console.log; the row has ckpt_s
        return final

    @staticmethod
    def load_trainer_state(path: Path) -> dict[str, Any]:
        """Read ``trainer_state.json`` of a step checkpoint.

        Raises:
            FileNotFoundError: the checkpoint has no trainer state.
        """
        f = Path(path) / "trainer_state.json"
        if not f.is_file():
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no trainer_state.json)")
        return json.loads(f.read_text())


def check_safetensors(f: Path) -> str | None:
    """What is wrong with a safetensors file (None: header parses, the data it declares is there)."""
    size = f.stat().st_size
    if size < 8:
        return f"truncated ({size} bytes, no header)"
    with f.open("rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        if n > 100 * 2**20:
            return f"unreadable header (declares {n} bytes)"
        if n > size - 8:
            return f"truncated (header of {n} bytes, file has {size})"
        try:
            header = json.loads(fh.read(n))
        except ValueError as e:
            return f"unreadable header ({e})"
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        return f"truncated (tensors need {8 + n + end} bytes, file has {size})"
    return None


def checkpoint_problems(path: Path) -> tuple[list[str], dict[str, Any]]:
    """What keeps the step checkpoint ``path`` from loading, one line per file (empty: sound), and its trainer state
    (``{}`` when unreadable). See ``verify_checkpoint`` for what is checked."""
    from omegaconf import DictConfig, OmegaConf

    path = Path(path)
    problems: list[str] = []
    state: dict[str, Any] = {}
    ts = path / "trainer_state.json"
    try:
        state = json.loads(ts.read_text())
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            problems.append(f"{ts}: no integer 'step'")
        elif not isinstance(state.get("dataloader"), dict):
            problems.append(f"{ts}: no 'dataloader' state")
    except FileNotFoundError:
        problems.append(f"{ts}: missing")
    except OSError as e:
        problems.append(f"{ts}: unreadable ({e})")
    except ValueError as e:  # not UTF-8, not JSON
        problems.append(f"{ts}: not valid JSON ({e})")
    cfg = path / "config.yaml"
    try:
        if not isinstance(OmegaConf.create(cfg.read_text()), DictConfig):
            problems.append(f"{cfg}: not a mapping of config sections")
    except FileNotFoundError:
        problems.append(f"{cfg}: missing")
    except Exception as e:  # unreadable, not UTF-8, not YAML (yaml's and OmegaConf's errors have no common base)
        problems.append(f"{cfg}: unreadable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
    model_files = sorted((path / "policy" / "model").glob("*.safetensors"))
    if not model_files:
        problems.append(f"{path / 'policy' / 'model'}: no *.safetensors weights")
    for f in model_files:
        if (why := check_safetensors(f)) is not None:
            problems.append(f"{f}: {why}")
    opt = path / "policy" / "optimizer.pt"
    if not opt.is_file():
        problems.append(f"{opt}: missing")
    extra = [path / n for n in state.get("extra_files", [])] if isinstance(state, dict) else []
    for f in extra:
        if not f.is_file():
            problems.append(f"{f}: missing")
    torch_files = [opt] * opt.is_file() + sorted((path / "policy").glob("optimizer_pp*.pt"))  # + pipeline stages'
    for f in torch_files + [f for f in extra if f.suffix == ".pt" and f.is_file()]:
        try:
            with zipfile.ZipFile(f) as z:
                z.namelist()
        except (zipfile.BadZipFile, OSError) as e:
            problems.append(f"{f}: truncated or not a torch archive ({e})")
    return problems, state


def older_checkpoint_hint(path: Path) -> str:
    """``"; resume from the previous sound one with --resume-from step_M"``: the newest checkpoint beside ``path`` and
    older than it that ``checkpoint_problems`` finds sound; else a line saying there is none (naming each older one
    and its first problem)."""
    m = _STEP_DIR.match(path.name)
    older = [s for s in CheckpointManager(path.parent).steps() if m and s < int(m.group(1))]
    unsound = []
    for s in reversed(older):
        problems, _ = checkpoint_problems(path.parent / f"step_{s}")
        if not problems:
            skipped = f" (newer ones are corrupt too: {'; '.join(unsound)})" if unsound else ""
            return f"; resume from the previous sound one with --resume-from step_{s}{skipped}"
        unsound.append(f"step_{s}: {problems[0]}" + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""))
    if not older:
        return "; there is no older checkpoint to resume from"
    return ("; no older checkpoint is sound either (" + "; ".join(unsound) + "): none to resume from; start a fresh "
            "run (--overwrite, or a new checkpointing.checkpoint_dir)")


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check the files of a step checkpoint without loading the weights; return its trainer state.

    Checks ``trainer_state.json`` (JSON with ``step`` and the ``dataloader`` state), ``config.yaml`` (readable, a
    YAML mapping), every ``policy/model/*.safetensors`` (header and size), ``policy/optimizer.pt`` (zip
    directory; the torch backend's pipeline stages' ``policy/optimizer_pp{p}.pt`` too) and the trainer state's
    ``extra_files`` (present; a ``.pt`` one: its zip directory).

    Raises:
        CheckpointError: names the file and what is wrong, with the hint to resume from the newest older
            checkpoint that passes the same checks (``--resume-from step_M``), or that none does.
    """
    path = Path(path)
    problems, state = checkpoint_problems(path)
    if problems:
        raise CheckpointError(f"checkpoint {path} is corrupt: " + "; ".join(problems) + older_checkpoint_hint(path))
    return state
