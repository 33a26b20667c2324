"""Asynchronous GRPO's rollouts made ahead, through a checkpoint and back (no Ray, no model): a collector paused
in the middle of a dynamic-sampling step, saved, restored into a new collector, makes what the uninterrupted one
makes; what ``--resume`` keeps or drops, and why; a damaged file is named."""

import logging
import re
import threading
import time
from pathlib import Path

import pytest
import torch

from nemo_fp8.algorithms.async_grpo import TrajectoryCollector
from nemo_fp8.algorithms.async_state import (ROLLOUTS_FILE, STATE_KEY, AheadState, load_ahead, restorable_ahead,
                                             rollout_key_changes, save_ahead)
from nemo_fp8.algorithms.trajectory_buffer import StepRollouts, TrajectoryBuffer
from nemo_fp8.batch import GenerationOutput
from nemo_fp8.config import load_config
from nemo_fp8.data import MathExample, PromptDataloader, PromptSample
from nemo_fp8.utils.checkpoint import CheckpointError, CheckpointManager, verify_checkpoint
from tests.utils.test_run_safety_units import CONFIG, FakePolicy

MAX_STEPS = 4


class Engines:
    """Seeded stand-in engines: two response tokens per row from ``sampling.seed``; ``hold``: the seed of a round
    that waits, once ``entered`` is set, for ``go``."""

    def __init__(self, hold=None):
        self.hold, self.entered, self.go = hold, threading.Event(), threading.Event()

    def generate(self, prompts, sampling):
        if sampling.seed == self.hold:
            self.entered.set()
            assert self.go.wait(10)
        g = torch.Generator().manual_seed(sampling.seed)
        b, p = len(prompts), max(len(x) for x in prompts)
        ids = torch.zeros(b, p + 2, dtype=torch.long)
        for i, x in enumerate(prompts):
            ids[i, :len(x)] = torch.tensor(x)
            ids[i, len(x):len(x) + 2] = torch.randint(3, 11, (2,), generator=g)
        plen = torch.tensor([len(x) for x in prompts])
        logprobs = -torch.rand(b, p + 2, generator=g)
        return GenerationOutput(ids, plen, torch.full((b,), 2), logprobs, torch.zeros(b, dtype=torch.bool))

    def pop_engine_metrics(self):
        return {"generation/engine_0/tokens": 1.0}


class Tokenizer:
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def reward(responses, answers):
    return [float(int(r.split()[-1]) % 4 == 0) for r in responses]  # groups of 2 informative about 3 times in 8


def _cfg(tmp_path, *overrides):
    return load_config(CONFIG, [f"policy.model_name={tmp_path / 'model'}", f"logger.log_dir={tmp_path / 'logs'}",
                                f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}", "grpo.num_prompts_per_step=2",
                                "grpo.num_generations_per_prompt=2", "grpo.use_dynamic_sampling=true",
                                "grpo.dynamic_sampling_max_gen_batches=3", f"grpo.max_num_steps={MAX_STEPS}",
                                "policy.train_global_batch_size=4", "policy.train_micro_batch_size=4",
                                "grpo.async_grpo.enabled=true", "policy.generation.colocated.enabled=false",
                                *overrides])


def _loader():
    samples = [PromptSample(MathExample(f"{i}+1", str(i + 1), "t", i), f"q{i}", [1, 2 + i % 5, 3]) for i in range(40)]
    return PromptDataloader(samples, 2, seed=0)


def _collector(cfg, engines, start_step, max_age=3):
    return TrajectoryCollector(cfg, engines, reward, Tokenizer(), _loader(), TrajectoryBuffer(max_age + 1),
                               start_step, max_age)


def _made(collector, steps) -> list[StepRollouts]:
    collector.start()
    try:
        return [collector.buffer.take(s, collector.max_age, alive=collector.alive) for s in steps]
    finally:
        collector.stop()


def _same(a: StepRollouts, b: StepRollouts) -> bool:
    tensors = lambda s: [*(t for p in s.parts for t in vars(p).values() if t is not None),  # noqa: E731
                         *(t for r in s.rollouts for t in (*vars(r.output).values(), r.rewards))]
    return (a.step == b.step and a.dataloader_state == b.dataloader_state and len(a.parts) == len(b.parts)
            and [r.responses for r in a.rollouts] == [r.responses for r in b.rollouts]
            and all(torch.equal(x, y) for x, y in zip(tensors(a), tensors(b))))


def test_a_collector_paused_mid_step_resumes_from_its_checkpoint_as_the_uninterrupted_one(tmp_path):
    cfg = _cfg(tmp_path)
    straight = _made(_collector(cfg, Engines(), 0), range(1, MAX_STEPS + 1))
    # the step to interrupt: after step 1 (the trained one), one that needs more than one round
    cut = next(s.step for s in straight[1:] if len(s.rollouts) > 1)
    engines = Engines(hold=cfg.grpo.seed * 1_000_003 + cut * 101)  # step_sampling's seed of its round 0
    first = _collector(cfg, engines, 0)
    first.start()
    assert engines.entered.wait(10)
    pauser = threading.Thread(target=first.pause)
    pauser.start()
    while not first._pause_requested:  # the pause is asked while round 0 is generating ...
        time.sleep(0.01)
    engines.go.set()
    pauser.join(10)  # ... and lands at the boundary after it
    assert _same(first.buffer.take(1, 3), straight[0])  # step 1 trained: the checkpoint is step_1's
    ahead = first.snapshot()
    first.stop()
    assert [s.step for s in ahead.steps] == list(range(2, cut)) and ahead.next_step == cut
    assert ahead.partial.step == cut and len(ahead.partial.rollouts) == 1

    ckpt = CheckpointManager(tmp_path / "ckpt", run_id="r")
    ckpt.save(1, FakePolicy(), {"dataloader": straight[0].dataloader_state, STATE_KEY: ahead.summary()}, "a: 1\n",
              extra_files={ROLLOUTS_FILE: lambda path: save_ahead(path, ahead)})
    state = verify_checkpoint(tmp_path / "ckpt" / "step_1")
    assert state[STATE_KEY]["partial_step"] == cut and state["extra_files"] == [ROLLOUTS_FILE]
    restored = restorable_ahead(tmp_path / "ckpt" / "step_1", state, 1, 3, MAX_STEPS, {})
    resumed = _collector(cfg, Engines(), 1)
    resumed.restore(restored)
    made = _made(resumed, range(2, MAX_STEPS + 1))
    for m, s in zip(made, straight[1:]):
        assert _same(m, s), m.step
    # the restored rounds keep the version that made them; the rest come from the resumed weights (version 1)
    assert [m.versions for m in made] == [[0] * len(m.rollouts) if m.step < cut else
                                         [0] + [1] * (len(m.rollouts) - 1) if m.step == cut else
                                         [1] * len(m.rollouts) for m in made]


def _step(step: int, versions: list[int]) -> StepRollouts:
    return StepRollouts(step, [], [], versions, {"epoch": 0, "position": 2 * step})


def _saved(tmp_path, ahead: AheadState, step: int = 2) -> tuple[Path, dict]:
    folder = tmp_path / f"step_{step}"
    folder.mkdir()
    save_ahead(folder / ROLLOUTS_FILE, ahead)
    return folder, {"step": step, STATE_KEY: ahead.summary()}


def test_resume_keeps_the_saved_rollouts_or_drops_them_naming_why(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="nemo_fp8.algorithms.async_state")
    ahead = AheadState([_step(3, [1])], _step(4, [2]), 4, {"epoch": 0, "position": 8}, max_age=1)
    folder, state = _saved(tmp_path, ahead)
    kept = restorable_ahead(folder, state, 2, 2, 10, {"policy.optimizer.lr": (1e-5, 2e-5), "grpo.max_num_steps":
                                                      (6, 10), "grpo.async_grpo.max_trajectory_age_steps": (1, 2)})
    assert [s.step for s in kept.steps] == [3] and kept.partial.versions == [2] and kept.next_step == 4
    assert [s.step for s in restorable_ahead(folder, state, 2, 1, 3, {}).steps] == [3]  # step 4 is past the end
    assert restorable_ahead(folder, state, 2, 1, 3, {}).partial is None
    cases = [
        (dict(trainer_state={"step": 2}), "holds no rollouts made ahead (a synchronous run's checkpoint"),
        (dict(changes={"policy.generation.temperature": (0.7, 1.0)}),
         "policy.generation.temperature changed how rollouts are made; the rollouts saved with"),
        (dict(max_age=0), "step 3's rollouts of weight version 1 (age 1) are older than "
                          "grpo.async_grpo.max_trajectory_age_steps=0"),
    ]
    for kw, needle in cases:
        caplog.clear()
        args = {"trainer_state": state, "max_age": 1, "changes": {}, **kw}
        assert restorable_ahead(folder, args["trainer_state"], 2, args["max_age"], 10, args["changes"]) is None
        assert needle in caplog.text and "the collector makes step 3's rollouts again" in caplog.text, caplog.text
    last, last_state = _saved(tmp_path, AheadState([], None, 7, {}, max_age=1, ended=True), step=6)
    caplog.clear()
    assert restorable_ahead(last, last_state, 6, 1, 10, {}) is None
    assert "is its run's last step: no rollouts were made ahead of it" in caplog.text
    assert rollout_key_changes({"grpo.val_period": (1, 2), "policy.generation.colocated.resources.num_nodes": (1, 2),
                                "env.math.timeout_s": (5, 9), "grpo.seed": (1, 2)}) == ["env.math.timeout_s",
                                                                                        "grpo.seed"]


def test_a_damaged_or_inconsistent_rollouts_file_is_named(tmp_path):
    folder, state = _saved(tmp_path, AheadState([_step(3, [1])], None, 4, {}, max_age=1))
    with pytest.raises(CheckpointError, match=r"holds steps \[3\] \(partial: None\) and next step 4; a checkpoint of "
                                              r"step 1 holds steps \[2, 3\]"):
        load_ahead(folder, 1)
    f = folder / ROLLOUTS_FILE
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=re.escape(f"the rollouts made ahead ({f}) cannot be read")):
        restorable_ahead(folder, state, 2, 1, 10, {})

    m = CheckpointManager(tmp_path / "ckpt", run_id="r")
    ahead = AheadState([_step(2, [0])], None, 3, {}, max_age=1)
    m.save(1, FakePolicy(), {STATE_KEY: ahead.summary()}, "a: 1\n",
           extra_files={ROLLOUTS_FILE: lambda path: save_ahead(path, ahead)})
    saved = tmp_path / "ckpt" / "step_1" / ROLLOUTS_FILE
    saved.write_bytes(saved.read_bytes()[:50])
    with pytest.raises(CheckpointError, match=f"{ROLLOUTS_FILE}: truncated or not a torch archive"):
        verify_checkpoint(tmp_path / "ckpt" / "step_1")
    saved.unlink()
    with pytest.raises(CheckpointError, match=f"{ROLLOUTS_FILE}: missing"):
        verify_checkpoint(tmp_path / "ckpt" / "step_1")
