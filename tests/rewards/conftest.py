"""Fixtures for reward tests: the shared GSM8K data folder."""

import os
from pathlib import Path

import pytest


def shared_data_dir() -> Path:
    """Return ``$NEMO_FP8_SHARED_DATA`` or ``<repo>/../shared/data``."""
    env = os.environ.get("NEMO_FP8_SHARED_DATA")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "data"


@pytest.fixture(scope="session")
def gsm8k_dir() -> Path:
    path = shared_data_dir() / "gsm8k"
    if not (path / "test.jsonl").is_file():
        pytest.skip(f"GSM8K data not found at {path} (set NEMO_FP8_SHARED_DATA to the shared data folder)")
    return path
