"""The checkpoint and its metrics row are one commit: a kill at any point of ``grpo_train``'s save, then
``--resume``'s repair, leaves metrics.jsonl with every step exactly once (no Ray, no model)."""

import json
import shutil
import struct
from pathlib import Path

import pytest

import nemo_fp8.algorithms.grpo as grpo
from nemo_fp8.config import load_config
from nemo_fp8.utils.checkpoint import CheckpointManager, verify_checkpoint
from nemo_fp8.utils.logger import MetricsLogger, read_metrics, repair_metrics

REPO = Path(__file__).resolve().parents[2]


class Killed(BaseException):
    """Stands for kill -9 / Ctrl-C at one point of the save."""


class Policy:
    """Writes a real (tiny) safetensors file and optimizer archive; raises ``Killed`` where told."""

    def __init__(self, kill_in_save_at=None):
        self.kill_in_save_at = kill_in_save_at
        self.step = 0

    def save(self, path):
        if self.step == self.kill_in_save_at:
            raise Killed
        import torch

        model = Path(path) / "model"
        model.mkdir(parents=True)
        header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
        (model / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
        torch.save({"optimizer": {}}, Path(path) / "optimizer.pt")


class Loader:
    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}


class KillAfterRow(MetricsLogger):
    def __init__(self, *a, kill_at=None, **k):
        super().__init__(*a, **k)
        self.kill_at = kill_at

    def log(self, step, metrics):
        super().log(step, metrics)
        if step == self.kill_at:
            raise Killed


def _train(cfg, tmp_path, start_step, monkeypatch, policy, logger):
    def fake_step(step, loader, pol, *a, **k):  # the step's work is not under test here, its commit is
        pol.step = step
        loader.n = step
        return {"train/reward_mean": float(step)}

    monkeypatch.setattr(grpo, "grpo_step", fake_step)
    ckpt = CheckpointManager(tmp_path / "ckpt", keep_last_k=1, run_id="r")
    return grpo.grpo_train(cfg, policy, None, None, None, Loader(), [], logger, ckpt, start_step, "a: 1\n", None)


@pytest.mark.parametrize("kill", ["in_weights", "after_row", "after_rename", "in_prune"])
def test_no_kill_point_loses_or_duplicates_a_metrics_row(tmp_path, monkeypatch, kill):
    cfg = load_config(REPO / "examples/configs/grpo_math_tiny_fp8.yaml", [
        f"logger.log_dir={tmp_path / 'logs'}", "logger.tensorboard_enabled=false", "logger.plot_enabled=false",
        "grpo.max_num_steps=4", "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false",
        "checkpointing.save_period=1", "checkpointing.keep_last_k=1"])
    policy = Policy(kill_in_save_at=3 if kill == "in_weights" else None)
    logger = KillAfterRow(cfg.logger, {}, kill_at=3 if kill == "after_row" else None)
    if kill in ("after_rename", "in_prune"):
        real_rename, real_rmtree = Path.rename, shutil.rmtree

        def rename(self, target):
            out = real_rename(self, target)
            if kill == "after_rename" and Path(target).name == "step_3":
                raise Killed
            return out

        def rmtree(path, *a, **k):
            real_rmtree(path, *a, **k)
            if kill == "in_prune" and Path(path).name == "step_2" and (Path(path).parent / "step_3").is_dir():
                raise Killed

        monkeypatch.setattr(Path, "rename", rename)
        monkeypatch.setattr(shutil, "rmtree", rmtree)
    with pytest.raises(Killed):
        _train(cfg, tmp_path, 0, monkeypatch, policy, logger)
    monkeypatch.undo()

    # --resume: the newest complete checkpoint, metrics repaired to it, the rest of the run.
    latest = CheckpointManager(tmp_path / "ckpt").latest()
    start = int(verify_checkpoint(latest)["step"])
    repair_metrics(tmp_path / "logs" / "metrics.jsonl", start)
    _train(cfg, tmp_path, start, monkeypatch, Policy(), MetricsLogger(cfg.logger, {}, resume=True))
    steps = [r["step"] for r in read_metrics(tmp_path / "logs" / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4], (kill, start, steps)
    assert all("timing/checkpoint" in r for r in read_metrics(tmp_path / "logs" / "metrics.jsonl"))
