"""Asynchronous GRPO: generation on engines of their own, running ahead of training by a bounded number of steps.

Modelled on NeMo-RL's async GRPO (``grpo.async_grpo``: ``nemo_rl/algorithms/async_utils.py``'s
``AsyncTrajectoryCollector`` and ``ReplayBuffer``, ``async_grpo_train``); the guide is docs/async-grpo.md. Two
threads of the driver share the run's worker groups:

* the **collector** (``TrajectoryCollector``) drives the engines (``GenerationGroup``): for step ``s`` it draws the
  prompt batches, generates, scores and computes the advantages per prompt group exactly as the synchronous
  ``grpo_step`` does (same prompts, same sampling seeds, same dynamic-sampling rounds), and puts the step's
  ``StepRollouts``, each round tagged with the weight version that made it, into the ``TrajectoryBuffer``. It may
  start step ``s`` while the engines hold version ``v`` only if ``s - 1 - v <= max_trajectory_age_steps``;
* the **trainer** (``async_grpo_train``, the main thread) takes step ``s``'s rollouts, computes ``prev_logprobs``
  with its current weights (version ``s - 1``), trains, then pauses the collector at its next round boundary,
  refits the engines to version ``s`` (and validates, when due) and lets it go on. A refit never lands inside a
  generation round: the torch engines never switch weights mid-sequence (NeMo-RL without in-flight updates).

The off-policy gap of a rollout of age ``s - 1 - v`` is corrected by the same importance weights as the FP8
mismatch: the loss weighs each token by ``pi_trainer / pi_engine`` from ``prev_logprobs`` (trainer, current
weights) and ``generation_logprobs`` (the engine that sampled, older weights), truncated as
``loss_fn.truncated_importance_sampling_*`` says. ``async/age_<a>/*`` reports that correction per age.

A checkpoint of step ``s`` is written with the collector paused between rounds; it saves what the collector has
made ahead (the buffer's steps, the rounds so far of the step in progress, its prompt-loader position:
``nemo_fp8.algorithms.async_state``), and ``--resume`` puts them back, so the resumed run trains on the rollouts the
uninterrupted run trains on.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import time
from typing import Optional

import torch

from nemo_fp8.algorithms.async_state import ROLLOUTS_FILE, STATE_KEY, AheadState, save_ahead
from nemo_fp8.algorithms.grpo import (LoopConfig, RefitController, RewardFn, _concat_batches, _log_row,
                                      compute_advantages, rollout, rollout_metrics, step_sampling, update_policy,
                                      validate)
from nemo_fp8.algorithms.loss import importance_sampling_weights
from nemo_fp8.algorithms.metrics import mismatch_metrics
from nemo_fp8.algorithms.trajectory_buffer import POLL_S, StepRollouts, TrajectoryBuffer
from nemo_fp8.batch import TrainBatch
from nemo_fp8.generation.interfaces import GenerationBackend
from nemo_fp8.policy.interfaces import PolicyBackend
from nemo_fp8.utils.console import StepBar
from nemo_fp8.utils.timer import Timer

logger = logging.getLogger(__name__)


def effective_max_age(cfg: LoopConfig) -> int:
    """The age limit the collector and buffer enforce: ``grpo.async_grpo.max_trajectory_age_steps``, or 0 with
    ``wait_for_current_weights`` (every rollout made with the weights it trains)."""
    a = cfg.grpo.async_grpo
    return 0 if a.wait_for_current_weights else a.max_trajectory_age_steps


class TrajectoryCollector:
    """A driver thread that makes each step's rollouts ahead of the trainer (module docstring).

    Args:
        cfg: the run's config.
        generation: the engines (a ``GenerationBackend`` or ``GenerationGroup``); only this thread calls them, except
            while ``pause`` holds it (the trainer refits and validates then).
        reward_fn, tokenizer: as ``grpo_train``'s.
        dataloader: the prompt batches; only this thread draws from it.
        buffer: where the rollouts go.
        start_step: the weight version the engines hold at the start (the step resumed from; 0 fresh).
        max_age: ``effective_max_age(cfg)``.
    """

    def __init__(self, cfg: LoopConfig, generation: GenerationBackend, reward_fn: RewardFn, tokenizer, dataloader,
                 buffer: TrajectoryBuffer, start_step: int, max_age: int):
        self.cfg, self.generation, self.reward_fn, self.tokenizer = cfg, generation, reward_fn, tokenizer
        self.dataloader, self.buffer, self.max_age = dataloader, buffer, max_age
        self.version = start_step  # the weights the engines hold (set by resume after each refit)
        self.next_step = start_step + 1
        self._current: Optional[StepRollouts] = None  # the step in progress: its rounds made so far
        self.error: Optional[BaseException] = None
        self._cond = threading.Condition()
        self._pause_requested = self._idle = self._stopped = False
        self._wait_s = 0.0
        self._thread = threading.Thread(target=self._run, name="trajectory-collector", daemon=True)

    # ------------------------------------------------------------------ the trainer's side
    def restore(self, ahead: AheadState) -> None:
        """Before ``start``: go on from what a checkpoint's collector had made ahead (``restorable_ahead``): its
        complete steps into the buffer, its step in progress and prompt-loader position here."""
        self.dataloader.load_state_dict(ahead.dataloader_state)
        for made in ahead.steps:
            self.buffer.put(made)
        self._current, self.next_step = ahead.partial, ahead.next_step

    def snapshot(self) -> AheadState:
        """What the collector has made ahead, for a checkpoint; call while it is paused (``pause``) or done. Copies
        the lists of the step in progress (the collector appends to them after ``resume``).

        Raises:
            RuntimeError: the collector is generating (not paused).
        """
        with self._cond:
            if self._thread.is_alive() and not self._idle:
                raise RuntimeError("TrajectoryCollector.snapshot: the collector is generating; pause it first")
            cur = self._current
            partial = None if cur is None or not cur.rollouts else StepRollouts(
                cur.step, list(cur.parts), list(cur.rollouts), list(cur.versions),
                copy.deepcopy(cur.dataloader_state), dict(cur.phases))
            return AheadState(self.buffer.steps(), partial, self.next_step,
                              copy.deepcopy(self.dataloader.state_dict()), self.max_age,
                              ended=self.next_step > self.cfg.grpo.max_num_steps)

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def pause(self) -> float:
        """Hold the collector at its next round boundary (it finishes the round it is generating); returns the
        seconds waited. The engines are then the caller's until ``resume``.

        Raises:
            BaseException: the error the collector failed with.
        """
        t0 = time.perf_counter()
        with self._cond:
            self._pause_requested = True
            self._cond.notify_all()
            while not self._idle and self._thread.is_alive():
                self._cond.wait(POLL_S)
        if self.error is not None:
            raise self.error
        return time.perf_counter() - t0

    def resume(self, version: int) -> None:
        """Let the collector go on; the engines now hold the weights of ``version``."""
        with self._cond:
            self.version = version
            self._pause_requested = False
            self._cond.notify_all()

    def pop_metrics(self) -> dict[str, float]:
        """``async/collector_wait_s``: seconds the collector waited for newer weights (or for the trainer's refit
        and validation) since the last call."""
        with self._cond:
            out, self._wait_s = {"async/collector_wait_s": self._wait_s}, 0.0
        return out

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop at the next boundary; waits at most ``timeout_s`` for the thread (one blocked in an engine call
        ends when the engines are torn down; it is a daemon thread)."""
        with self._cond:
            self._stopped = True
            self._pause_requested = False
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    # ------------------------------------------------------------------ the collector's thread
    def _boundary(self, step: int) -> bool:
        """Wait until step ``step`` may be generated now: no pause asked, its age within the limit, room in the
        buffer. False: stopped."""
        t0 = time.perf_counter()
        with self._cond:
            while not self._stopped and (self._pause_requested or step - 1 - self.version > self.max_age
                                         or len(self.buffer) >= self.buffer.capacity):
                if not self._idle:
                    self._idle = True
                    self._cond.notify_all()
                self._cond.wait(POLL_S)
            self._idle = False
            self._wait_s += time.perf_counter() - t0
            return not self._stopped

    def _collect(self, step: int) -> Optional[StepRollouts]:
        """Step ``step``'s rollouts, round by round as the synchronous ``grpo_step`` makes them (a step restored
        in progress goes on at its next round); None when stopped."""
        g = self.cfg.grpo
        n, want = g.num_generations_per_prompt, g.num_prompts_per_step * g.num_generations_per_prompt
        cur = self._current
        if cur is None or cur.step != step:
            cur = self._current = StepRollouts(step, [], [], [], {})
        timer = Timer()
        for round_idx in range(len(cur.rollouts), g.dynamic_sampling_max_gen_batches if g.use_dynamic_sampling
                               else 1):
            if not self._boundary(step):
                return None
            r = rollout(next(self.dataloader), n, self.generation, self.reward_fn, self.tokenizer,
                        step_sampling(self.cfg, step, round_idx), timer)
            with timer("advantages"):
                adv, keep = compute_advantages(r, self.cfg)
            o = r.output
            cur.rollouts.append(r)
            cur.versions.append(self.version)  # unchanged during the round: refits happen only while paused
            cur.parts.append(TrainBatch(o.token_ids, o.prompt_lengths, o.response_lengths, adv,
                                        o.generation_logprobs).select(keep))
            cur.dataloader_state = copy.deepcopy(self.dataloader.state_dict())
            took = timer.pop()
            cur.phases = {k: cur.phases.get(k, 0.0) + took.get(k, 0.0) for k in {**cur.phases, **took}}
            if sum(p.size for p in cur.parts) >= want:
                break
        self._current = None
        return cur

    def _run(self) -> None:
        try:
            while self.next_step <= self.cfg.grpo.max_num_steps:
                made = self._collect(self.next_step)
                if made is None:
                    return
                self.buffer.put(made, stopped=lambda: self._stopped)
                self.next_step += 1
        except BaseException as e:  # noqa: BLE001 - handed to the trainer, which raises it
            if not self._stopped:
                self.error = e
                self.buffer.fail(e)
        finally:
            with self._cond:
                self._idle = True
                self._cond.notify_all()


def age_metrics(batch: TrainBatch, ages: torch.Tensor, loss_cfg) -> dict[str, float]:
    """Trajectory age and the off-policy correction per age.

    Args:
        batch: the trained batch, with ``prev_logprobs`` ([B, T] float32, trainer) and ``generation_logprobs``
            ([B, T] float32, the engine that sampled).
        ages: [B] int64, per row the trainer's version minus the version that generated it (steps, >= 0).
        loss_cfg: ``loss_fn`` (``ClippedPGLossConfig``): the IS correction whose weights are reported.

    Returns:
        ``async/trajectory_age_mean`` / ``_max`` (over sequences) and, per age ``a`` present,
        ``async/age_<a>/{num_sequences, gen_kl_error, token_mult_prob_error, is_weight_mean, is_weight_min,
        is_weight_max, is_frac_tokens_truncated}``: the mismatch metrics (``mismatch_metrics``) and the statistics
        of the importance weights the loss applies (``importance_sampling_weights``; unit weights when
        ``use_importance_sampling_correction`` is false) on that age's rows.
    """
    out = {"async/trajectory_age_mean": float(ages.float().mean()), "async/trajectory_age_max": float(ages.max())}
    mask = batch.token_mask
    for a in sorted(set(ages.tolist())):
        rows = ages == a
        prev, gen, m = batch.prev_logprobs[rows], batch.generation_logprobs[rows], mask[rows]
        mm = mismatch_metrics(prev, gen, m)
        _, stats = importance_sampling_weights(prev, gen, m, loss_cfg)
        key = f"async/age_{a}"
        out[f"{key}/num_sequences"] = float(rows.sum())
        out[f"{key}/gen_kl_error"] = mm["gen_kl_error"]
        out[f"{key}/token_mult_prob_error"] = mm["token_mult_prob_error"]
        for k in ("is_weight_mean", "is_weight_min", "is_weight_max", "is_frac_tokens_truncated"):
            out[f"{key}/{k}"] = float(stats[k])
    return out


def train_on_rollouts(step: int, made: StepRollouts, policy: PolicyBackend, cfg: LoopConfig, tokenizer, timer: Timer,
                      refitter: RefitController) -> dict[str, float]:
    """The training half of ``grpo_step`` on rollouts made ahead: batch, ``prev_logprobs`` with the current
    weights, mismatch and age metrics, the update, FP8 KV calibration; then ``refitter.mark_stale(step)``.

    A step with nothing to train (dynamic sampling found no informative group) still moves the version to
    ``step`` (the same weights; the FP8 KV scales relabelled), so the collector's age gate keeps counting steps.
    """
    with timer("data_processing"):
        batch = _concat_batches(made.parts, tokenizer.pad_token_id)
        want = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
        gbs = cfg.policy.train_global_batch_size
        usable = min(batch.size, want) // gbs * gbs
        batch = batch.select(slice(0, usable))
        ages = (step - 1) - made.row_versions()[:usable]
    metrics = rollout_metrics(made.rollouts, usable)
    if usable == 0:
        logger.warning("step %d: no informative groups after %d generation rounds; skipping the update", step,
                       len(made.rollouts))
        kv = refitter.kv_scales
        refitter.mark_stale(step, dataclasses.replace(kv, step=step) if kv is not None else None)
        return metrics
    return update_policy(cfg, policy, batch, step, refitter, timer, metrics,
                         extra_metrics=lambda b: age_metrics(b, ages, cfg.loss_fn))


def async_grpo_train(cfg: LoopConfig, policy: PolicyBackend, generation: GenerationBackend, reward_fn: RewardFn,
                     tokenizer, dataloader, val_samples, metrics_logger, checkpointer, start_step: int, config_yaml: str,
                     refitter: RefitController, ahead: Optional[AheadState] = None) -> dict[str, float]:
    """``grpo_train`` with the collector running ahead (module docstring); returns the last step's metrics.

    ``ahead``: what the resumed checkpoint's collector had made ahead (``async_state.restorable_ahead``); the
    collector goes on from it (its prompt-loader position replaces ``dataloader``'s). None: it starts at step
    ``start_step + 1`` from ``dataloader``'s position.

    Per step, besides the synchronous loop's metrics: ``timing/buffer_wait`` (the trainer waited for the step's
    rollouts), ``timing/collector_pause`` (it waited for the collector's round to end before the refit),
    ``async/collector_wait_s``, ``async/buffer_steps`` (steps made ahead, after this one was taken),
    ``async/trajectory_age_*`` and ``async/age_<a>/*`` (``age_metrics``), and ``timing/collector/*``: the
    collector's own phases for this step's rollouts, which overlap the trainer's.

    Raises:
        BaseException: whatever the collector failed with (an ``EngineError``, the reward's ``RunFailed``), in
            this thread.
    """
    g = cfg.grpo
    max_age = effective_max_age(cfg)
    timer = Timer()
    last: dict[str, float] = {}
    if start_step == 0 and g.val_at_start and g.val_period > 0:
        with timer("validation"):  # the first refit, of the starting weights, happens inside
            last = validate(generation, reward_fn, tokenizer, val_samples, cfg, 0, refitter, timer)
        metrics_logger.log(0, {**last, **{f"timing/{k}": v for k, v in timer.pop().items()}})
    refitter.refit_if_stale(timer)  # the engines hold the starting weights before the collector starts
    buffer = TrajectoryBuffer(max(max_age + 1, len(ahead.steps) if ahead is not None else 0))
    collector = TrajectoryCollector(cfg, generation, reward_fn, tokenizer, dataloader, buffer, start_step, max_age)
    if ahead is not None:
        collector.restore(ahead)
    collector.start()
    logger.info("async GRPO: the collector runs up to %d step(s) ahead of the trainer", max_age)
    bar = StepBar(range(start_step + 1, g.max_num_steps + 1), start_step, g.max_num_steps, "grpo (async)")
    try:
        for step in bar:
            t0 = time.perf_counter()
            with timer("buffer_wait"):
                made = buffer.take(step, max_age, alive=collector.alive)
            metrics = train_on_rollouts(step, made, policy, cfg, tokenizer, timer, refitter)
            saved = _between_steps(cfg, step, collector, refitter, generation, reward_fn, tokenizer, val_samples,
                                   timer, metrics)
            metrics.update(collector.pop_metrics())
            metrics["async/buffer_steps"] = float(len(buffer))
            metrics.update({f"timing/collector/{k}": v for k, v in made.phases.items()})
            if made.phases.get("generation"):
                tokens = sum(float(r.output.response_lengths.sum()) for r in made.rollouts)
                metrics["perf/rollout_tokens_per_s"] = tokens / made.phases["generation"]
            _save_or_log(cfg, checkpointer, metrics_logger, policy, step, metrics, timer, t0, made, config_yaml,
                         saved)
            bar.set_postfix(reward=f"{metrics['train/reward_mean']:.3f}")
            last = metrics
    finally:
        bar.close()
        collector.stop()
        left = buffer.clear()
        if left:
            logger.info("async GRPO: stopped with %d step(s) of rollouts made ahead (a checkpoint holds those made "
                        "ahead of its step)", left)
    return last


def _checkpoint_due(cfg: LoopConfig, step: int) -> bool:
    return cfg.checkpointing.enabled and (step % cfg.checkpointing.save_period == 0 or step == cfg.grpo.max_num_steps)


def _between_steps(cfg: LoopConfig, step: int, collector: TrajectoryCollector, refitter: RefitController,
                   generation, reward_fn: RewardFn, tokenizer, val_samples, timer: Timer,
                   metrics: dict[str, float]) -> Optional[AheadState]:
    """After training ``step``: with the collector paused at its round boundary, refit the engines (unless it was
    the last step) and validate when due (their metrics into ``metrics``), and take what the collector has made
    ahead when a checkpoint is due (returned; else None). Then let the collector go on."""
    g = cfg.grpo
    is_last = step == g.max_num_steps
    validating = (g.val_period > 0 and step % g.val_period == 0) or (is_last and g.val_at_end)
    saving, refitting = _checkpoint_due(cfg, step), validating or not is_last
    if not (refitting or saving):
        return None
    with timer("collector_pause"):
        collector.pause()
    try:
        if refitting:
            metrics.update(refitter.refit_if_stale(timer))
        if validating:
            with timer("validation"):
                metrics.update(validate(generation, reward_fn, tokenizer, val_samples, cfg, step, refitter, timer))
        return collector.snapshot() if saving else None
    finally:
        collector.resume(refitter.version if refitting else collector.version)


def _save_or_log(cfg: LoopConfig, checkpointer, metrics_logger, policy, step: int, metrics: dict[str, float],
                 timer: Timer, t0: float, made: StepRollouts, config_yaml: str, ahead: Optional[AheadState]) -> None:
    """Write the step's row, inside a checkpoint's commit when one is due (``grpo_train``'s order). The checkpoint
    saves the prompt loader's position after this step's prompts (what the synchronous loop would resume from) and,
    in ``async_rollouts.pt``, what the collector had made ahead (``ahead``, taken while it was paused)."""
    if _checkpoint_due(cfg, step):
        t_save = time.perf_counter()
        checkpointer.save(step, policy, {"dataloader": made.dataloader_state, STATE_KEY: ahead.summary()},
                          config_yaml, before_commit=lambda: _log_row(metrics_logger, step, metrics, timer, t0, cfg,
                                                                      time.perf_counter() - t_save),
                          extra_files={ROLLOUTS_FILE: lambda path: save_ahead(path, ahead)})
    else:
        _log_row(metrics_logger, step, metrics, timer, t0, cfg)
