"""The main job as a careful user breaks it: reused folders, concurrent runs, resume diffs, corrupt
checkpoints, bad data, bad YAML, too few CPUs. Setup errors must come before the model build / Ray."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_main_job import FAST, REPO, SCRIPT, rows

CONFIG = REPO / "examples" / "configs" / "grpo_math_tiny_fp8.yaml"
SMALL = [*FAST, "grpo.max_val_samples=8", "grpo.val_batch_size=8", "grpo.val_period=0", "grpo.val_at_start=false",
         "grpo.val_at_end=false", "checkpointing.keep_last_k=3", "logger.tensorboard_enabled=false",
         "logger.plot_enabled=false"]


def job(model_dir, out: Path, *args, timeout=300):
    cmd = [sys.executable, str(SCRIPT), "--config", str(CONFIG), f"policy.model_name={model_dir}",
           "policy.tiny_model.build_if_missing=false", f"logger.log_dir={out / 'logs'}",
           f"checkpointing.checkpoint_dir={out / 'ckpt'}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def fails_fast(proc, *needles):
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "ray actor" not in proc.stderr, proc.stderr[-3000:]
    for n in needles:
        assert n in proc.stderr, (n, proc.stderr[-3000:])


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, tmp_path_factory):
    """A 2-step run with checkpoints step_1, step_2 (shared by the tests below; copy before damaging)."""
    out = tmp_path_factory.mktemp("run")
    proc = job(tiny_model_dir, out, *SMALL, "grpo.max_num_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_reused_folder_fresh_run_is_refused(tiny_model_dir, finished_run):
    before = (finished_run / "logs" / "metrics.jsonl").read_text()
    marker = json.loads((finished_run / "ckpt" / "run.json").read_text())
    assert marker["run_id"] and marker["config_hash"]
    assert json.loads((finished_run / "ckpt" / "step_2" / "trainer_state.json").read_text())["run_id"] == \
        marker["run_id"]
    assert [r["step"] for r in rows(finished_run)] == [1, 2]
    assert "reward/num_over_step_budget" in rows(finished_run)[0]
    fails_fast(job(tiny_model_dir, finished_run, *SMALL, "grpo.max_num_steps=1"),
               "would mix with an earlier run", marker["run_id"], "--resume", "--overwrite")
    assert (finished_run / "logs" / "metrics.jsonl").read_text() == before  # nothing deleted


@pytest.mark.slow
def test_resume_refuses_frozen_keys_and_low_max_steps(tiny_model_dir, finished_run):
    fails_fast(job(tiny_model_dir, finished_run, *SMALL, "--resume", "grpo.max_num_steps=1",
                   "policy.generation.vllm_cfg.precision=bfloat16", "data.seed=5"),
               "policy.generation.vllm_cfg.precision: 'fp8' in the checkpoint, 'bfloat16' now", "data.seed",
               "grpo.max_num_steps: 1 is below the checkpoint's step 2")


@pytest.mark.slow
def test_corrupt_newest_checkpoint_is_named_and_resume_from_older_works(tiny_model_dir, finished_run, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(finished_run, out)
    st = next((out / "ckpt" / "step_2" / "policy" / "model").glob("*.safetensors"))
    st.write_bytes(st.read_bytes()[:1000])
    fails_fast(job(tiny_model_dir, out, *SMALL, "grpo.max_num_steps=3", "--resume"),
               f"{st}: truncated", "--resume-from step_1")
    with (out / "logs" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "train/rew')  # a kill while writing
    proc = job(tiny_model_dir, out, *SMALL, "grpo.max_num_steps=2", "--resume-from", "step_1",
               "policy.optimizer.lr=1e-4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "policy.optimizer.lr changed from 3e-05 to 0.0001" in proc.stderr
    assert "resumed from" in proc.stderr and "step_1" in proc.stderr
    assert [r["step"] for r in rows(out)] == [1, 2]  # step 2 redone once, partial line moved aside
    assert len((out / "logs" / "metrics.superseded.jsonl").read_text().splitlines()) == 2


def test_second_run_on_same_folders_stops_at_once(tmp_path):
    from nemo_fp8.utils.run_dir import FolderLock

    with FolderLock(tmp_path / "logs", "first-run"):
        t0 = time.time()
        proc = job(tmp_path / "no-model", tmp_path)
        fails_fast(proc, "in use by another run", "first-run", f"pid {os.getpid()}", socket.gethostname())
        assert time.time() - t0 < 60


@pytest.mark.parametrize("args, needles", [
    (["--resume"], ["--resume: no checkpoint and no run under checkpointing.checkpoint_dir"]),
    (["cluster.num_cpus=1"], ["cluster.num_cpus: the actors need 2 CPUs", "has 1"]),
    (["data.dataset=gsm8k", "data.train_path=/nonexistent/train.jsonl"],
     ["data.train_path: file not found: /nonexistent/train.jsonl"]),
])
def test_setup_errors_before_model_build_and_ray(tmp_path, args, needles):
    proc = job(tmp_path / "model", tmp_path, "policy.tiny_model.build_if_missing=true", *args)
    fails_fast(proc, *needles)
    assert not (tmp_path / "model").exists()  # reported before the model build
    assert not (tmp_path / "logs" / "metrics.jsonl").exists()


def test_bad_row_deep_in_the_data_is_caught_before_model_build_and_ray(tmp_path):
    rows = [json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) for i in range(300)]
    rows[199] = "{not json"
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    proc = job(tmp_path / "model", tmp_path, "policy.tiny_model.build_if_missing=true", "data.dataset=gsm8k",
               f"data.train_path={tmp_path / 'train.jsonl'}")
    fails_fast(proc, "data.train_path:", "line 200")
    assert not (tmp_path / "model").exists()


def test_abbreviated_flag_and_yaml_syntax_error(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--resum"], capture_output=True, text=True, timeout=60,
                          cwd=REPO)
    assert proc.returncode == 2 and "unrecognized arguments: --resum" in proc.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("defaults: " + str(CONFIG) + "\ngrpo:\n  seed: [1,\n")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--config", str(bad)], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"{bad}, line" in proc.stderr and "YAML syntax error" in proc.stderr
