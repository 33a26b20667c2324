"""Asynchronous GRPO on CPU with the torch engines (``grpo.async_grpo``): config errors before any work, the job to
the end, the same numbers as the synchronous loop where the rollouts are made with the same weights, and a SIGTERM
that stops both sides, after which ``--resume`` is the uninterrupted run."""

import os
import re
import subprocess
import sys
import time

import pytest

from nemo_fp8.config import ConfigError, load_config
from nemo_fp8.distributed.teardown import descendants
from tests.integration.test_main_job import REPO, SCRIPT, rows
from tests.integration.test_run_safety import CONFIG, fails_fast, job
from tests.integration.test_run_signals import assert_none_left
from tests.signals import sigint_default

ASYNC = ["grpo.async_grpo.enabled=true", "policy.generation.colocated.enabled=false"]
# the tiny job, smaller: 4 prompts x 4 samples, dynamic sampling on (the shipped model's groups carry signal), so a
# step may take several generation rounds; one torch thread per actor, so both loops run the same kernels
SHORT = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "policy.train_global_batch_size=16",
         "policy.train_micro_batch_size=16", "grpo.max_val_samples=16", "grpo.val_batch_size=16",
         "grpo.val_period=2", "grpo.max_num_steps=3", "cluster.torch_threads_per_worker=1",
         "logger.tensorboard_enabled=false", "logger.plot_enabled=false"]
SAME = ("train/", "loss/", "mismatch/", "val/")
AHEAD = [*SHORT, *ASYNC, "grpo.async_grpo.max_trajectory_age_steps=1"]


def _load(*overrides):
    return load_config(CONFIG, list(overrides))


@pytest.mark.parametrize("overrides,needle", [
    (["grpo.async_grpo.enabled=true"],
     "policy.generation.colocated.enabled: grpo.async_grpo.enabled=true generates while the trainer trains"),
    ([*ASYNC, "grpo.async_grpo.max_trajectory_age_steps=0"], "grpo.async_grpo.max_trajectory_age_steps"),
    ([*ASYNC, "grpo.async_grpo.in_flight_weight_updates=true"],
     "grpo.async_grpo.in_flight_weight_updates: true: in-flight weight updates"),
    ([*ASYNC, "grpo.async_grpo.enabled=1"], "grpo.async_grpo.enabled"),
], ids=["colocated", "age_0", "in_flight", "not_a_bool"])
def test_impossible_async_settings_are_config_errors(overrides, needle):
    with pytest.raises(ConfigError) as e:
        _load(*overrides)
    assert needle in str(e.value), str(e.value)


def test_nemo_rls_async_section_at_its_defaults_loads():
    cfg = _load(*ASYNC, "grpo.async_grpo.max_trajectory_age_steps=2", "grpo.async_grpo.max_generation_failures=0",
                "grpo.async_grpo.recompute_kv_cache_after_weight_updates=false")
    assert cfg.grpo.async_grpo.enabled and cfg.grpo.async_grpo.max_trajectory_age_steps == 2


def test_too_few_cpus_for_both_sides_fails_before_any_work(tmp_path):
    """The engine and the trainer run at once, each on a CPU slot of its own: one CPU cannot hold them."""
    fails_fast(job(tmp_path / "model", tmp_path, "policy.tiny_model.build_if_missing=true", *ASYNC,
                   "cluster.num_cpus=1"), "cluster.num_cpus: the actors need 2 CPUs", "has 1")
    assert not (tmp_path / "model").exists()  # reported before the model build


def _compared(row: dict) -> dict:
    return {k: v for k, v in row.items() if k.startswith(SAME)}


@pytest.fixture(scope="module")
def ahead_run(shipped_tiny_model, tmp_path_factory):
    """The SHORT job one step ahead (``AHEAD``), uninterrupted: steps 0-3 (shared by the tests below)."""
    out = tmp_path_factory.mktemp("ahead")
    proc = job(shipped_tiny_model, out, *AHEAD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_async_runs_to_the_end_and_matches_the_synchronous_loop_where_weights_agree(shipped_tiny_model, ahead_run,
                                                                                    tmp_path):
    sync, wait = tmp_path / "sync", tmp_path / "wait"
    for out, extra in ((sync, []), (wait, [*ASYNC, "grpo.async_grpo.wait_for_current_weights=true"])):
        proc = job(shipped_tiny_model, out, *SHORT, *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
    s, w, a = rows(sync), rows(wait), rows(ahead_run)
    assert [r["step"] for r in s] == [r["step"] for r in w] == [r["step"] for r in a] == [0, 1, 2, 3]
    assert s[1]["train/num_sequences_trained"] > 0 and "val/accuracy" in s[3]
    # rollouts made with the weights they train on: every step the synchronous loop's numbers, exactly
    for rs, rw in zip(s, w):
        assert _compared(rs) == _compared(rw), rs["step"]
        assert rw.get("async/trajectory_age_max", 0.0) == 0.0
    # one step ahead: step 1's rollouts come from the starting weights either way; later ones are one step old
    assert _compared(s[1]) == _compared(a[1])
    assert a[1]["async/trajectory_age_max"] == 0.0
    assert a[3]["async/trajectory_age_max"] == 1.0 and a[3]["async/age_1/num_sequences"] > 0
    for key in ("async/age_1/gen_kl_error", "async/age_1/is_weight_mean", "timing/buffer_wait",
                "async/collector_wait_s", "timing/collector/generation"):
        assert key in a[3], key
    assert a[3]["async/age_1/gen_kl_error"] >= 0


#: The main job, with a SIGTERM to its whole process group right after step 1's checkpoint is committed (what a
#: cluster's time limit does at any moment, here at a fixed one): the collector, let go after the refit, is then
#: generating step 3 with step 2's rollouts made ahead in the buffer.
TERM_AFTER_STEP_1 = """
import os, runpy, signal, sys, time
from nemo_fp8.utils.checkpoint import CheckpointManager
save = CheckpointManager.save
def save_then_term(self, step, *args, **kwargs):
    out = save(self, step, *args, **kwargs)
    if step == 1:
        print(f"SIGTERM AT {time.time()}", file=sys.stderr, flush=True)
        os.killpg(os.getpgid(0), signal.SIGTERM)
    return out
CheckpointManager.save = save_then_term
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

#: A metrics key that measures time (or a rate over time), not the run's numbers.
TIMING = re.compile(r"^(timing|perf)/|/seconds$|_per_s$|_wait_s$")


def _numbers(row: dict) -> dict:
    return {k: v for k, v in row.items() if not TIMING.search(k)}


@pytest.mark.slow
def test_sigterm_stops_both_sides_and_the_resumed_run_is_the_uninterrupted_one(shipped_tiny_model, ahead_run,
                                                                              tmp_path):
    cmd = [sys.executable, "-c", TERM_AFTER_STEP_1, str(SCRIPT), "--config", str(CONFIG),
           f"policy.model_name={shipped_tiny_model}", "policy.tiny_model.build_if_missing=false",
           f"logger.log_dir={tmp_path / 'logs'}", f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}", *AHEAD]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=sigint_default)
    procs = {proc.pid: 0}
    while proc.poll() is None:  # every process of the job (Ray's included), for the check that none is left
        procs.update(descendants(proc.pid))
        time.sleep(0.1)
    _, err = proc.communicate(timeout=120)
    ended = time.time()
    assert proc.returncode == 143, err[-3000:]
    assert ended - float(re.search(r"SIGTERM AT ([0-9.]+)", err).group(1)) < 20, err[-3000:]
    assert "continue with --resume" in err and "Traceback" not in err, err[-3000:]
    assert_none_left(procs)
    assert [r["step"] for r in rows(tmp_path)] == [0, 1]

    proc = job(shipped_tiny_model, tmp_path, *AHEAD, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "restored the rollouts made ahead: steps [2]" in proc.stderr, proc.stderr[-3000:]
    resumed, straight = rows(tmp_path), rows(ahead_run)
    assert [r["step"] for r in resumed] == [r["step"] for r in straight] == [0, 1, 2, 3]
    # step 2 trains the rollouts made ahead with the starting weights (age 1), saved with step_1; step 3 those the
    # restored collector made from the prompts that follow: every number of every step as in the uninterrupted run
    assert resumed[2]["async/trajectory_age_max"] == 1.0
    for r, s in zip(resumed, straight):
        assert _numbers(r) == _numbers(s), (r["step"], {k: (v, _numbers(s).get(k)) for k, v in _numbers(r).items()
                                                        if v != _numbers(s).get(k)})
