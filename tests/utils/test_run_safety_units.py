"""Run ownership, checkpoints, metrics repair, resume diffs and YAML errors, without a model or Ray."""

import json
import os
import signal
import socket
import struct
import threading
import time
from pathlib import Path

import pytest

from nemo_fp8.config import ConfigError, config_diff, load_config, resume_changes
from nemo_fp8.utils.checkpoint import CheckpointError, CheckpointManager, verify_checkpoint
from nemo_fp8.utils.logger import read_metrics, repair_metrics
from nemo_fp8.utils.run_dir import (FolderLock, RunSetupError, Terminated, claim_fresh, raise_on_sigterm,
                                    read_marker, write_marker)

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "configs" / "grpo_math_tiny_fp8.yaml"


def cfg_for(tmp_path, *overrides):
    return load_config(CONFIG, [f"policy.model_name={tmp_path / 'model'}", f"logger.log_dir={tmp_path / 'logs'}",
                                f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}", *overrides])


class FakePolicy:
    def save(self, path):
        model = Path(path) / "model"
        model.mkdir(parents=True)
        header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
        (model / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
        import torch

        torch.save({"optimizer": {}, "num_updates": 0}, Path(path) / "optimizer.pt")


# ----------------------------------------------------------------------------- locks and ownership
def test_second_run_on_same_folder_is_refused_naming_pid_and_host(tmp_path):
    with FolderLock(tmp_path / "logs", "run-a"):
        with pytest.raises(RunSetupError) as e:
            FolderLock(tmp_path / "logs", "run-b").acquire()
        msg = str(e.value)
        assert f"pid {os.getpid()}" in msg and socket.gethostname() in msg and "run-a" in msg
    FolderLock(tmp_path / "logs", "run-b").acquire().release()  # free again once the first ends


def test_fresh_run_into_reused_folder_is_refused_and_overwrite_moves_metrics_aside(tmp_path):
    logs, ckpt = tmp_path / "logs", tmp_path / "ckpt"
    (ckpt / "step_7").mkdir(parents=True)
    logs.mkdir()
    (logs / "metrics.jsonl").write_text('{"step": 1}\n')
    write_marker(logs, "old-run", "h", resumed=False)
    with pytest.raises(RunSetupError, match=r"step_7.*--resume.*--overwrite"):
        claim_fresh(logs, ckpt, overwrite=False)
    claim_fresh(logs, ckpt, overwrite=True)
    assert not (ckpt / "step_7").exists() and not (logs / "metrics.jsonl").exists()
    assert (logs / "metrics.old-run.jsonl").read_text() == '{"step": 1}\n'
    claim_fresh(logs, ckpt, overwrite=False)  # only a marker left: nothing to mix with


def test_marker_records_run_id_hash_and_resumes(tmp_path):
    write_marker(tmp_path, "r1", "abc", resumed=False)
    write_marker(tmp_path, "r1", "def", resumed=True)
    m = read_marker(tmp_path)
    assert m["run_id"] == "r1" and m["config_hash"] == "def" and m["resumes"][0]["config_hash"] == "def"


def test_keep_last_k_counts_only_this_runs_checkpoints(tmp_path):
    old = CheckpointManager(tmp_path, keep_last_k=2, run_id="old")
    for s in (50, 60):
        old.save(s, FakePolicy(), {}, "a: 1\n")
    new = CheckpointManager(tmp_path, keep_last_k=2, run_id="new")
    for s in (1, 2, 3):
        new.save(s, FakePolicy(), {}, "a: 1\n")
    assert new.steps() == [2, 3, 50, 60]  # the new run's own step_3 survives; old ones untouched
    assert new.run_id_of(3) == "new"


# ----------------------------------------------------------------------------- corrupt checkpoints
@pytest.mark.parametrize("damage, expect", [
    (lambda c: (c / "policy/model/model.safetensors").write_bytes(
        (c / "policy/model/model.safetensors").read_bytes()[:-4]), r"model\.safetensors: truncated"),
    (lambda c: (c / "policy/optimizer.pt").write_bytes((c / "policy/optimizer.pt").read_bytes()[:20]),
     r"optimizer\.pt: truncated"),
    (lambda c: (c / "trainer_state.json").write_text('{"step": 2, "datal'), r"trainer_state\.json: not valid JSON"),
])
def test_corrupt_checkpoint_names_file_and_previous_step(tmp_path, damage, expect):
    m = CheckpointManager(tmp_path, keep_last_k=5, run_id="r")
    for s in (1, 2):
        m.save(s, FakePolicy(), {"dataloader": {}}, "a: 1\n")
    assert verify_checkpoint(tmp_path / "step_2")["step"] == 2
    damage(tmp_path / "step_2")
    with pytest.raises(CheckpointError, match=expect) as e:
        verify_checkpoint(tmp_path / "step_2")
    assert "--resume-from step_1" in str(e.value)
    assert m.resolve("step_1") == tmp_path / "step_1" and m.resolve("1") == tmp_path / "step_1"
    with pytest.raises(CheckpointError, match="step_1, step_2"):
        m.resolve("step_9")


def test_resume_advice_names_only_a_checkpoint_that_loads(tmp_path):
    """Every checkpoint's config.yaml deleted: the advice was ``--resume-from step_2`` without a look at step_2.
    It now names the newest older checkpoint that passes the same checks, or says that none does."""
    m = CheckpointManager(tmp_path, keep_last_k=5, run_id="r")
    for s in (1, 2, 3):
        m.save(s, FakePolicy(), {"dataloader": {}}, "a: 1\n")
    (tmp_path / "step_3" / "config.yaml").unlink()
    (tmp_path / "step_2" / "config.yaml").write_text("a: [1,\n")  # present, not YAML
    with pytest.raises(CheckpointError) as e:
        verify_checkpoint(tmp_path / "step_3")
    msg = str(e.value)
    assert msg.startswith(f"checkpoint {tmp_path / 'step_3'} is corrupt: {tmp_path / 'step_3' / 'config.yaml'}: "
                          "missing; resume from the previous sound one with --resume-from step_1 (newer ones are "
                          f"corrupt too: step_2: {tmp_path / 'step_2' / 'config.yaml'}: unreadable ("), msg
    (tmp_path / "step_1" / "config.yaml").unlink()
    with pytest.raises(CheckpointError) as e:
        verify_checkpoint(tmp_path / "step_3")
    msg = str(e.value)
    assert "--resume-from" not in msg and "; no older checkpoint is sound either (step_2: " in msg, msg
    assert f"step_1: {tmp_path / 'step_1' / 'config.yaml'}: missing): none to resume from; start a fresh run" in msg
    (tmp_path / "step_1" / "config.yaml").write_text("a: 1\n")
    (tmp_path / "step_1" / "trainer_state.json").write_text('{"step": 1}')  # the resume reads its loader state
    with pytest.raises(CheckpointError, match=r"step_1: .*trainer_state\.json: no 'dataloader' state\)"):
        verify_checkpoint(tmp_path / "step_3")


def test_resume_with_every_config_yaml_deleted_names_no_checkpoint(tmp_path):
    """The ``--resume`` path itself (``prepare_run_dirs``), before any model or Ray."""
    from nemo_fp8.config import config_to_yaml
    from nemo_fp8.trainer import prepare_run_dirs

    cfg = cfg_for(tmp_path)
    m = CheckpointManager(tmp_path / "ckpt", keep_last_k=5, run_id="r")
    for s in (1, 2, 3):
        m.save(s, FakePolicy(), {"dataloader": {}}, config_to_yaml(cfg))
        (tmp_path / "ckpt" / f"step_{s}" / "config.yaml").unlink()
    write_marker(tmp_path / "ckpt", "r", "h", resumed=False)
    with pytest.raises(CheckpointError) as e:
        prepare_run_dirs(cfg, config_to_yaml(cfg), resume=True)
    msg = str(e.value)
    assert "--resume-from" not in msg and "no older checkpoint is sound either (step_2: " in msg, msg


# ----------------------------------------------------------------------------- metrics
def test_partial_last_metrics_line_is_repaired_and_rows_moved_not_lost(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n{"step": 3, "train/rew')
    assert [r["step"] for r in read_metrics(f)] == [0, 1, 2]  # the plot reads past the partial line
    assert repair_metrics(f, resume_step=2) == 1
    assert [r["step"] for r in read_metrics(f)] == [0, 1, 2]
    assert f.read_text().endswith("}\n")
    assert "train/rew" in (tmp_path / "metrics.superseded.jsonl").read_text()


# ----------------------------------------------------------------------------- resume diffs, YAML
def test_resume_diff_lists_every_changed_key_and_stops_on_frozen_ones(tmp_path):
    from nemo_fp8.config import config_to_yaml

    old = config_to_yaml(cfg_for(tmp_path))
    changes = resume_changes(old, cfg_for(tmp_path, "policy.optimizer.lr=1e-4", "policy.optimizer.weight_decay=0.1",
                                          "grpo.max_num_steps=50"), checkpoint_step=3)
    assert set(changes) == {"policy.optimizer.lr", "policy.optimizer.weight_decay", "grpo.max_num_steps"}
    assert changes["policy.optimizer.lr"] == (3e-5, 1e-4)
    with pytest.raises(ConfigError) as e:
        resume_changes(old, cfg_for(tmp_path, "policy.generation.vllm_cfg.precision=bfloat16", "data.seed=3",
                                    "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=2",
                                    "policy.train_global_batch_size=64", "policy.train_micro_batch_size=64",
                                    "policy.logprob_batch_size=64"), checkpoint_step=3)
    msg = str(e.value)
    for key in ("policy.generation.vllm_cfg.precision", "data.seed", "grpo.num_generations_per_prompt",
                "grpo.max_num_steps: 2 is below the checkpoint's step 3"):
        assert key in msg, key
    assert config_diff({"a": {"b": 1}}, {"a": {"b": 2, "c": 3}}) == {"a.b": (1, 2), "a.c": (None, 3)}


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo:\n  max_num_steps: 3\n  seed: [1, 2\npolicy:\n  model_name: x\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml, line \d+, column \d+: YAML syntax error") as e:
        load_config(bad)
    assert len(str(e.value).splitlines()) == 1


# ----------------------------------------------------------------------------- signals, messages
def test_sigterm_becomes_terminated():
    old = signal.getsignal(signal.SIGTERM)
    try:
        raise_on_sigterm()
        with pytest.raises(Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
    finally:
        signal.signal(signal.SIGTERM, old)


def test_a_forked_child_ends_quietly_on_sigterm(tmp_path):
    """A process forked after raise_on_sigterm (the reward's pebble worker) inherits the handler: SIGTERM to the
    process group must end it as SIGTERM's default does (killed by signal 15, no Terminated traceback), while the
    parent still gets Terminated."""
    import multiprocessing

    old = signal.getsignal(signal.SIGTERM)
    err = tmp_path / "child.err"
    try:
        raise_on_sigterm()
        ready = multiprocessing.get_context("fork").Event()

        def child():
            os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT), 2)
            ready.set()
            time.sleep(30)

        proc = multiprocessing.get_context("fork").Process(target=child)
        proc.start()
        assert ready.wait(10)
        os.kill(proc.pid, signal.SIGTERM)
        proc.join(10)
        assert proc.exitcode == -signal.SIGTERM, err.read_text()
        assert "Traceback" not in err.read_text()
        with pytest.raises(Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
    finally:
        signal.signal(signal.SIGTERM, old)


def test_interrupt_hint_is_accurate(tmp_path):
    from nemo_fp8.trainer import interrupt_hint

    off = cfg_for(tmp_path, "checkpointing.enabled=false")
    assert "checkpointing is off" in interrupt_hint(off, CheckpointManager(tmp_path / "ckpt"), "r")
    on = cfg_for(tmp_path)
    m = CheckpointManager(tmp_path / "ckpt", run_id="r")
    assert "no checkpoint written yet" in interrupt_hint(on, m, "r")
    m.save(1, FakePolicy(), {}, "a: 1\n")
    assert "step_1; continue with --resume" in interrupt_hint(on, m, "r")


def test_concurrent_tiny_model_builds_wait_for_the_first(tmp_path, monkeypatch):
    import fcntl

    import nemo_fp8.models.tiny as tiny
    from nemo_fp8.trainer import ensure_model

    monkeypatch.setattr(tiny, "build_tiny_model", lambda *a, **k: pytest.fail("built twice"))
    cfg = cfg_for(tmp_path, "policy.tiny_model.build_if_missing=true")
    model = tmp_path / "model"
    with open(tmp_path / "model.build.lock", "a") as lock:  # "the other run" is building
        fcntl.flock(lock, fcntl.LOCK_EX)
        t = threading.Thread(target=ensure_model, args=(cfg,))
        t.start()
        time.sleep(0.5)
        assert t.is_alive()  # waiting, not crashing
        model.mkdir()
        (model / "config.json").write_text("{}")
    t.join(10)
    assert not t.is_alive()


# ----------------------------------------------------------------------------- preflight
def test_preflight_resources_and_model_path(tmp_path):
    from nemo_fp8.preflight import PreflightError, preflight, required_resources

    cfg = cfg_for(tmp_path, "cluster.num_cpus=1", "policy.device=cpu", "policy.tiny_model.build_if_missing=false")
    assert required_resources(cfg) == {"CPU": 2.0, "GPU": 0.0}
    with pytest.raises(PreflightError) as e:
        preflight(cfg)
    msg = str(e.value)
    assert "cluster.num_cpus: the actors need 2 CPUs" in msg and "has 1" in msg
    assert "policy.model_name" in msg and "build_if_missing" in msg
