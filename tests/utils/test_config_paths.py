"""Config paths do not depend on the working directory: a YAML's relative paths are read against its
repository, an override's against the working directory; NEMO_FP8_SHARED_DATA names the shared data."""

import os
from pathlib import Path

import pytest

from nemo_fp8.config import ConfigError, config_to_yaml, load_config, resume_changes

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "examples" / "configs"


def test_yaml_paths_resolve_against_the_repository_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(CONFIGS / "grpo_math_tiny_fp8.yaml", ["data.val_path=val.jsonl"])
    assert cfg.policy.model_name == str(REPO / "models" / "tiny-qwen3-arith")  # not a second model in tmp_path
    assert cfg.logger.log_dir == str(REPO / "logs" / "grpo_math_tiny_fp8")
    assert cfg.checkpointing.checkpoint_dir == str(REPO / "results" / "grpo_math_tiny_fp8")
    assert cfg.data.val_path == str(tmp_path / "val.jsonl")  # typed on the command line: the working directory
    hub = load_config(CONFIGS / "grpo_math_8B_megatron.yaml")
    assert hub.policy.model_name == "meta-llama/Llama-3.1-8B-Instruct"  # a hub id stays one


def test_shared_data_location_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("NEMO_FP8_SHARED_DATA", str(tmp_path / "shared"))
    cfg = load_config(CONFIGS / "grpo_math_gsm8k_tiny_fp8.yaml")
    assert cfg.data.train_path == str(tmp_path / "shared" / "gsm8k" / "train.jsonl")
    monkeypatch.delenv("NEMO_FP8_SHARED_DATA")
    cfg = load_config(CONFIGS / "grpo_math_gsm8k_tiny_fp8.yaml")
    assert cfg.data.train_path == os.path.normpath(REPO / ".." / "shared" / "data" / "gsm8k" / "train.jsonl")


def test_resume_with_the_model_folder_written_absolute_is_no_change(tmp_path, monkeypatch):
    (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "models" / "m" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    relative = load_config(CONFIGS / "grpo_math_tiny_fp8.yaml", ["policy.model_name=models/m"])
    absolute = load_config(CONFIGS / "grpo_math_tiny_fp8.yaml", [f"policy.model_name={tmp_path / 'models' / 'm'}"])
    assert relative.policy.model_name == absolute.policy.model_name
    saved = config_to_yaml(relative).replace(str(tmp_path / "models" / "m"), "models/m")  # an older checkpoint
    assert "policy.model_name" not in resume_changes(saved, absolute, checkpoint_step=1)


def test_profiling_is_config_resolved_like_the_other_folders_and_may_change_on_resume(tmp_path, monkeypatch):
    """``policy.profile`` is part of the resolved config (so of ``config.yaml`` and the resume diff), not the
    environment: a change on resume is allowed and listed, and a bad value is a config error naming the key."""
    monkeypatch.chdir(tmp_path)
    plain = load_config(CONFIGS / "grpo_math_tiny_fp8.yaml")
    assert plain.policy.profile.dir is None and "profile:" in config_to_yaml(plain)
    profiled = load_config(CONFIGS / "grpo_math_tiny_fp8.yaml",
                           ["policy.profile.dir=prof", "policy.profile.train_call=5", "policy.profile.trace=true"])
    assert profiled.policy.profile.dir == str(tmp_path / "prof")  # typed on the command line: the working directory
    changes = resume_changes(config_to_yaml(plain), profiled, checkpoint_step=1)
    assert changes == {"policy.profile.dir": (None, str(tmp_path / "prof")), "policy.profile.train_call": (3, 5),
                       "policy.profile.trace": (False, True)}
    with pytest.raises(ConfigError, match="policy.profile.micro_batches"):
        load_config(CONFIGS / "grpo_math_tiny_fp8.yaml", ["policy.profile.micro_batches=0"])


@pytest.mark.parametrize("text", ["- grpo\n- policy\n", "3\n"])
def test_a_yaml_whose_top_level_is_not_a_mapping_is_a_config_error(tmp_path, text):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(ConfigError, match=r"bad\.yaml: the top level must be a mapping"):
        load_config(bad)


def test_overwrite_moves_old_tensorboard_events_aside(tmp_path):
    from nemo_fp8.utils.run_dir import claim_fresh, write_marker

    logs = tmp_path / "logs"
    (logs / "tensorboard").mkdir(parents=True)
    (logs / "tensorboard" / "events.out.tfevents.1.host").write_bytes(b"old")
    (logs / "metrics.jsonl").write_text('{"step": 1}\n')
    write_marker(logs, "old-run", "h", resumed=False)
    claim_fresh(logs, None, overwrite=True)
    assert not (logs / "tensorboard").exists()
    assert (logs / "tensorboard.old-run" / "events.out.tfevents.1.host").read_bytes() == b"old"


def test_a_refused_run_leaves_no_folders_behind(tmp_path, monkeypatch):
    import signal

    from nemo_fp8.preflight import PreflightError
    from nemo_fp8.trainer import run

    cfg = load_config(CONFIGS / "grpo_math_tiny_fp8.yaml", [
        f"logger.log_dir={tmp_path / 'out' / 'logs'}", f"checkpointing.checkpoint_dir={tmp_path / 'out' / 'ckpt'}",
        f"policy.model_name={tmp_path / 'none'}", "policy.tiny_model.build_if_missing=false", "policy.device=cpu"])
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # run() would install its SIGTERM handler in pytest
    with pytest.raises(PreflightError):
        run(cfg)
    assert not (tmp_path / "out" / "logs").exists() and not (tmp_path / "out" / "ckpt").exists()
