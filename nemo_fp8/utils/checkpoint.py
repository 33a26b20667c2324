"""Step checkpoints: ``<checkpoint_dir>/step_<N>/`` with the policy and the trainer state.

A checkpoint is written to ``step_<N>.tmp`` and renamed when complete, so a crash while saving
never leaves a half checkpoint that ``--resume`` would pick up. Only the last ``keep_last_k``
are kept.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointManager:
    """Save/find step checkpoints under ``root``; the policy writes into ``<step dir>/policy``."""

    def __init__(self, root: str | Path, keep_last_k: int = 2):
        self.root = Path(root)
        self.keep_last_k = keep_last_k

    def steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir())

    def latest(self) -> Path | None:
        steps = self.steps()
        return self.root / f"step_{steps[-1]}" if steps else None

    def save(self, step: int, policy, trainer_state: dict[str, Any], config_yaml: str) -> Path:
        """Write policy weights + optimizer and ``trainer_state.json`` for ``step``; prune old ones."""
        final = self.root / f"step_{step}"
        tmp = self.root / f"step_{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        policy.save(tmp / "policy")
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **trainer_state}, indent=2))
        (tmp / "config.yaml").write_text(config_yaml)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in self.steps()[: -self.keep_last_k]:
            shutil.rmtree(self.root / f"step_{old}", ignore_errors=True)
        logger.info("checkpoint saved: %s", final)
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
