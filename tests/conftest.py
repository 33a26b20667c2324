"""Shared fixtures: a tiny model built once per session (no downloads), configs, data paths."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def shared_data_dir() -> Path:
    """``$NEMO_FP8_SHARED_DATA``, else ``<repo>/../shared/data`` (the steering files beside the checkout)."""
    env = os.environ.get("NEMO_FP8_SHARED_DATA")
    return Path(env) if env else REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def gsm8k_dir() -> Path:
    """The real GSM8K folder; tests that need it skip with the reason where it is absent."""
    path = shared_data_dir() / "gsm8k"
    if not (path / "train.jsonl").is_file() or not (path / "test.jsonl").is_file():
        pytest.skip(f"GSM8K data not found at {path} (set NEMO_FP8_SHARED_DATA to the shared data folder)")
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A freshly built tiny Qwen3 checkpoint (short warm start: numerics tests need weights, not skill)."""
    from nemo_fp8.models.tiny import TinyModelSpec, build_tiny_model

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", TinyModelSpec(sft_steps=20, sft_batch_size=32))


@pytest.fixture
def tiny_cfg(tiny_model_dir, tmp_path):
    """The shipped tiny FP8 config pointed at the session model and a temporary output folder, dynamic
    sampling off (the session model's groups mostly score alike: it would drop them and train nothing)."""
    from nemo_fp8.config import load_config

    def make(*overrides: str, config: str = "grpo_math_tiny_fp8.yaml"):
        return load_config(REPO / "examples" / "configs" / config, [
            f"policy.model_name={tiny_model_dir}", "policy.tiny_model.build_if_missing=false",
            f"logger.log_dir={tmp_path / 'logs'}", f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
            "logger.tensorboard_enabled=false", "grpo.use_dynamic_sampling=false", *overrides])

    return make


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped, with the reason, where torch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU host)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
