"""The preflight catches the inputs a run cannot use, all at once and before any model build or Ray: bad
data rows anywhere in the file, model paths that are files, foreign folders or truncated weights, a hub id
that cannot be resolved, policy.device=cuda without a GPU."""

import json
import struct
from pathlib import Path

import pytest
import torch

from nemo_fp8.config import load_config
from nemo_fp8.preflight import PreflightError, check_data, check_model, preflight, with_local_model

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "configs" / "grpo_math_tiny_fp8.yaml"


def cfg_for(tmp_path, *overrides):
    return load_config(CONFIG, [f"logger.log_dir={tmp_path / 'logs'}",
                                f"checkpointing.checkpoint_dir={tmp_path / 'ck'}", "policy.device=cpu", *overrides])


def write_checkpoint(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    return folder


def test_a_bad_row_deep_in_the_data_file_is_a_preflight_error(tmp_path):
    rows = [json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) for i in range(300)]
    rows[199] = json.dumps({"question": "q"})  # line 200 lacks 'answer'
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    cfg = cfg_for(tmp_path, "data.dataset=gsm8k", f"data.train_path={tmp_path / 'train.jsonl'}")
    errs = check_data(cfg)
    assert len(errs) == 1 and errs[0].startswith("data.train_path:") and "line 200" in errs[0], errs


def test_model_paths_the_run_cannot_use(tmp_path):
    good = write_checkpoint(tmp_path / "good")
    assert check_model(cfg_for(tmp_path, f"policy.model_name={good}")) == []
    (tmp_path / "weights.safetensors").write_bytes(b"x")
    errs = check_model(cfg_for(tmp_path, f"policy.model_name={tmp_path / 'weights.safetensors'}"))
    assert len(errs) == 1 and "is a file" in errs[0], errs
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "readme.txt").write_text("hi")
    errs = check_model(cfg_for(tmp_path, f"policy.model_name={foreign}", "policy.tiny_model.build_if_missing=true"))
    assert len(errs) == 1 and "not empty but has no config.json" in errs[0], errs
    empty = tmp_path / "empty"
    empty.mkdir()
    assert check_model(cfg_for(tmp_path, f"policy.model_name={empty}", "policy.tiny_model.build_if_missing=true")) == []
    st = good / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-5])
    errs = check_model(cfg_for(tmp_path, f"policy.model_name={good}"))
    assert len(errs) == 1 and f"{st}: truncated" in errs[0], errs


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_cuda_without_a_gpu_is_one_collected_preflight_error(tmp_path):
    cfg = cfg_for(tmp_path, f"policy.model_name={tmp_path / 'none'}", "policy.device=cuda",
                  "policy.tiny_model.build_if_missing=false")
    with pytest.raises(PreflightError) as e:  # was a RuntimeError raised inside the preflight
        preflight(cfg)
    msg = str(e.value)
    assert "policy.device: 'cuda' needs a CUDA GPU" in msg and "policy.model_name" in msg, msg


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """An HF hub cache laid out as huggingface_hub writes it, offline."""
    from huggingface_hub import constants

    from nemo_fp8.models.hub import resolve_hub_model

    cache = tmp_path / "hub"
    rev = "0123456789abcdef0123456789abcdef01234567"
    write_checkpoint(cache / "models--my-org--tiny-model" / "snapshots" / rev)
    (cache / "models--my-org--tiny-model" / "refs").mkdir()
    (cache / "models--my-org--tiny-model" / "refs" / "main").write_text(rev)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    resolve_hub_model.cache_clear()
    yield cache / "models--my-org--tiny-model" / "snapshots" / rev
    resolve_hub_model.cache_clear()


def test_hub_id_resolves_through_the_cache(tmp_path, fake_hub, monkeypatch):
    monkeypatch.chdir(tmp_path)  # "my-org/tiny-model" is not a local path here
    cfg = cfg_for(tmp_path, "policy.model_name=my-org/tiny-model", "policy.tiny_model.build_if_missing=false")
    assert check_model(cfg) == []
    local = with_local_model(cfg)
    assert Path(local.policy.model_name) == fake_hub and cfg.policy.model_name == "my-org/tiny-model"
    errs = check_model(cfg_for(tmp_path, "policy.model_name=my-org/no-such-model",
                               "policy.tiny_model.build_if_missing=false"))
    assert len(errs) == 1 and "'my-org/no-such-model'" in errs[0] and "could not be fetched" in errs[0], errs


def test_a_hub_id_offline_is_an_error_not_a_tiny_model_build(tmp_path, fake_hub, monkeypatch):
    # The shipped configs set build_if_missing; a hub id on the command line used to become a local folder
    # "Qwen/Qwen3-0.6B" with the 1.8M-parameter tiny model in it, trained with one INFO line.
    monkeypatch.chdir(tmp_path)
    cfg = cfg_for(tmp_path, "policy.model_name=Qwen/Qwen3-0.6B", "policy.tiny_model.build_if_missing=true")
    assert cfg.policy.model_name == "Qwen/Qwen3-0.6B"  # left a hub id, not made a local path
    errs = check_model(cfg)
    assert len(errs) == 1 and "'Qwen/Qwen3-0.6B'" in errs[0] and "could not be fetched" in errs[0], errs
    assert "contains 'tiny'" in errs[0]  # says where build_if_missing does build
    assert not (tmp_path / "Qwen").exists()
    # a cached hub model with 'tiny' in its name, and a missing local folder named for the tiny model
    cached = cfg_for(tmp_path, "policy.model_name=my-org/tiny-model", "policy.tiny_model.build_if_missing=false")
    assert check_model(cached) == []
    target = cfg_for(tmp_path, "policy.model_name=models/tiny-qwen3-arith", "policy.tiny_model.build_if_missing=true")
    assert Path(target.policy.model_name) == tmp_path / "models" / "tiny-qwen3-arith"
    assert check_model(target) == []


def test_a_huge_trajectory_age_is_a_preflight_warning_with_the_buffers_memory(tmp_path, caplog):
    """``max_trajectory_age_steps=1000000`` was accepted without a word. The buffer holds age + 1 steps (at most
    grpo.max_num_steps of them are made); the warning says how stale a rollout may get and the driver memory, before
    the model build."""
    import logging

    from nemo_fp8.preflight import async_age_warning

    on = ["grpo.async_grpo.enabled=true", "policy.generation.colocated.enabled=false", "cluster.num_cpus=8",
          f"policy.model_name={tmp_path / 'model'}", "policy.tiny_model.build_if_missing=true",
          "grpo.use_dynamic_sampling=false"]
    cfg = cfg_for(tmp_path, *on, "grpo.async_grpo.max_trajectory_age_steps=1000000")
    # the tiny recipe: 60 steps of 16 prompts x 8 samples, prompts of <= 48 tokens + 6 new tokens
    line = ("grpo.async_grpo.max_trajectory_age_steps: 1000000 lets a rollout train up to 1000000 steps after the "
            "weights that made it, and the trajectory buffer hold up to 1000001 steps of rollouts: with "
            "grpo.max_num_steps=60, at most 60 steps x 128 rollouts x 54 tokens x 24 bytes = 9.5 MiB in the driver "
            "process (valid: >= 1; NeMo-RL's guide uses 1, and this warning comes above 8)")
    assert async_age_warning(cfg) == line
    with caplog.at_level(logging.WARNING, logger="nemo_fp8.preflight"):
        preflight(cfg)
    assert f"preflight: {line}" in caplog.messages
    assert not (tmp_path / "model").exists()  # before the model build
    steps = cfg_for(tmp_path, *on, "grpo.async_grpo.max_trajectory_age_steps=20", "grpo.max_num_steps=5",
                    "grpo.use_dynamic_sampling=true", "grpo.dynamic_sampling_max_gen_batches=3")
    assert "at most 5 steps x 3 generation rounds (dynamic sampling) x " in async_age_warning(steps)
    assert async_age_warning(cfg_for(tmp_path, *on, "grpo.async_grpo.max_trajectory_age_steps=8")) is None
    assert async_age_warning(cfg_for(tmp_path, "grpo.async_grpo.max_trajectory_age_steps=1000000")) is None  # sync
