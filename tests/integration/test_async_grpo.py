"""Asynchronous GRPO on CPU with the torch engines (``grpo.async_grpo``): config errors before any work, the job to
the end, the same numbers as the synchronous loop where the rollouts are made with the same weights, and a SIGTERM
that stops both sides and resumes."""

import os
import signal
import time

import pytest

from nemo_fp8.config import ConfigError, load_config
from tests.integration.test_main_job import rows
from tests.integration.test_run_safety import CONFIG, fails_fast, job
from tests.integration.test_run_signals import assert_none_left, resume_finishes, start_job, wait_for_checkpoint

ASYNC = ["grpo.async_grpo.enabled=true", "policy.generation.colocated.enabled=false"]
# the tiny job, smaller: 4 prompts x 4 samples, dynamic sampling on (the shipped model's groups carry signal), so a
# step may take several generation rounds; one torch thread per actor, so both loops run the same kernels
SHORT = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "policy.train_global_batch_size=16",
         "policy.train_micro_batch_size=16", "grpo.max_val_samples=16", "grpo.val_batch_size=16",
         "grpo.val_period=2", "grpo.max_num_steps=3", "cluster.torch_threads_per_worker=1",
         "logger.tensorboard_enabled=false", "logger.plot_enabled=false"]
SAME = ("train/", "loss/", "mismatch/", "val/")


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


@pytest.mark.slow
def test_async_runs_to_the_end_and_matches_the_synchronous_loop_where_weights_agree(shipped_tiny_model, tmp_path):
    sync, wait, ahead = tmp_path / "sync", tmp_path / "wait", tmp_path / "ahead"
    for out, extra in ((sync, []), (wait, [*ASYNC, "grpo.async_grpo.wait_for_current_weights=true"]),
                       (ahead, [*ASYNC, "grpo.async_grpo.max_trajectory_age_steps=1"])):
        proc = job(shipped_tiny_model, out, *SHORT, *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
    s, w, a = rows(sync), rows(wait), rows(ahead)
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


@pytest.mark.slow
def test_sigterm_stops_both_sides_and_resume_continues(shipped_tiny_model, tmp_path):
    args = [*ASYNC, "cluster.torch_threads_per_worker=1"]
    proc = start_job(shipped_tiny_model, tmp_path, "grpo.max_num_steps=50", *args)
    procs = wait_for_checkpoint(proc, tmp_path)
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert time.monotonic() - t0 < 20, err[-3000:]
    assert "continue with --resume" in err and "Traceback" not in err, err[-3000:]
    assert_none_left(procs)
    resume_finishes(shipped_tiny_model, tmp_path, *args)
