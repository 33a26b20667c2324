"""Shared fixtures: a tiny model built once per session (no downloads), configs, data paths."""

from __future__ import annotations

import os
import shutil
import subprocess
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


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    """The tiny model's tokenizer."""
    from nemo_fp8.models.hf import load_tokenizer

    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster for one test module: 8 logical CPUs, room for policy ranks and engines side by side."""
    import ray

    from nemo_fp8.distributed.cluster import init_ray

    init_ray(None, num_cpus=8)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def shipped_tiny_model(tmp_path_factory) -> Path:
    """The tiny model with the shipped weights: the same bytes on every machine (a warm start built here, as
    ``tiny_model_dir``, depends on this CPU's kernels), for tests whose numbers must not."""
    from nemo_fp8.models.tiny import TinyModelSpec, build_tiny_model, find_shipped_weights

    assert find_shipped_weights(TinyModelSpec()) is not None, "the default tiny model's weights must ship"
    return build_tiny_model(tmp_path_factory.mktemp("models") / "shipped", TinyModelSpec())


@pytest.fixture
def tiny_cfg(tiny_model_dir, tmp_path):
    """The shipped tiny FP8 config pointed at the session model and a temporary output folder, dynamic
    sampling off (the session model's groups mostly score alike: it would drop them and train nothing), in the
    dtypes of the GPU engines' path: an fp32 trainer and a bf16 reference engine (the shipped CPU default's
    float64 is pinned by the golden run, the config tests and the main-job tests)."""
    from nemo_fp8.config import load_config

    def make(*overrides: str, config: str = "grpo_math_tiny_fp8.yaml"):
        return load_config(REPO / "examples" / "configs" / config, [
            f"policy.model_name={tiny_model_dir}", "policy.tiny_model.build_if_missing=false",
            f"logger.log_dir={tmp_path / 'logs'}", f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
            "logger.tensorboard_enabled=false", "grpo.use_dynamic_sampling=false", "policy.precision=float32",
            "policy.generation.reference_dtype=bfloat16", *overrides])

    return make


class Tmpfs:
    """Small tmpfs mounts for tests of full disks and read-only folders (root ignores permission bits, but not a
    full or read-only file system). Each mount is undone after the test."""

    def __init__(self, root: Path):
        self.root, self.mounted = root, []

    def mount(self, name: str, size_mb: float, readonly: bool = False) -> Path:
        """Mount a tmpfs of ``size_mb`` MiB at ``<tmp_path>/<name>``; skips the test, with the reason, where
        mounting is not allowed (not root, no CAP_SYS_ADMIN, no ``mount``)."""
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        opts = f"size={int(size_mb * 1024)}k" + (",ro" if readonly else "")
        why = "no mount command" if shutil.which("mount") is None else None
        if why is None:
            proc = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True,
                                  text=True)
            why = (proc.stderr.strip() or f"mount exited with {proc.returncode}") if proc.returncode else None
        if why:
            pytest.skip(f"needs a tmpfs mount (a real full or read-only file system), not allowed here: {why}")
        self.mounted.append(path)
        return path

    def resize(self, path: Path, size_mb: float) -> None:
        """Give a mounted tmpfs a new size (``mount -o remount``)."""
        subprocess.run(["mount", "-o", f"remount,size={int(size_mb * 1024)}k", str(path)], check=True)

    def unmount_all(self) -> None:
        for path in reversed(self.mounted):
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
        self.mounted = []


def fill_disk(folder: Path) -> None:
    """Write ``folder/filler`` until the file system is full (ENOSPC)."""
    import errno

    with open(folder / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e


@pytest.fixture
def tmpfs(tmp_path):
    """``Tmpfs`` under the test's ``tmp_path``; skips where tmpfs cannot be mounted."""
    mounts = Tmpfs(tmp_path)
    yield mounts
    mounts.unmount_all()


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped, with the reason, where torch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU host)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
