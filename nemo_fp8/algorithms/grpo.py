"""The GRPO loop: one ``grpo_step`` that reads top to bottom, validation, and the outer loop.

Engine-free: it talks to a ``GenerationBackend`` and a ``PolicyBackend`` (local objects or Ray
worker groups, it cannot tell) and imports no vLLM / Megatron / TransformerEngine. One step::

    refit if stale -> wake -> generate -> sleep -> reward -> advantages -> logprobs -> train
      -> (FP8 KV) calibrate q/k/v scales -> mark the engine stale

Each phase is timed by name: ``refit``, ``generation``, ``reward``, ``advantages``,
``logprobs``, ``training``, ``kv_calibration``, ``validation``, ``checkpoint``.

GRPO: Shao et al. 2024 (DeepSeekMath); DAPO options: Yu et al. 2025; importance-sampling
correction of the rollout/trainer mismatch: Yao et al. 2025, NeMo-RL's FP8 recipe.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Protocol

import torch
from tqdm import tqdm

from nemo_fp8.algorithms.advantages import dynamic_sampling_keep_mask, grpo_advantages, overlong_penalty
from nemo_fp8.algorithms.config import ClippedPGLossConfig, GRPOConfig
from nemo_fp8.algorithms.loss import ClippedPGLossFn
from nemo_fp8.algorithms.metrics import mismatch_metrics
from nemo_fp8.batch import GenerationOutput, TrainBatch, concat_padded
from nemo_fp8.data import PromptSample
from nemo_fp8.fp8.kv_scales import KvScales, calibration_rows
from nemo_fp8.generation.interfaces import GenerationBackend, SamplingParams
from nemo_fp8.policy.config import PolicyConfig
from nemo_fp8.policy.interfaces import RELEASE_COUNTS, PolicyBackend
from nemo_fp8.utils.config import CheckpointingConfig, LoggerConfig
from nemo_fp8.utils.console import StepBar
from nemo_fp8.utils.run_dir import RunFailed
from nemo_fp8.utils.timer import Timer

logger = logging.getLogger(__name__)

RewardFn = Callable[[list[str], list[str]], list[float]]


class LoopConfig(Protocol):
    """The config sections the loop reads: ``nemo_fp8.config.MasterConfig`` has them (the loop sits below the
    assembled config and names only the sections it needs)."""

    grpo: GRPOConfig
    loss_fn: ClippedPGLossConfig
    policy: PolicyConfig  # train_global_batch_size, generation (sampling, FP8 KV calibration)
    checkpointing: CheckpointingConfig
    logger: LoggerConfig  # num_val_samples_to_print


@dataclass
class Rollout:
    """One generation round: the engine output, decoded responses and rewards ([B] float32), and the engines'
    ``generation/*`` metrics of this round (``engine_metrics``)."""

    output: GenerationOutput
    responses: list[str]
    rewards: torch.Tensor
    engine_metrics: dict[str, float] = field(default_factory=dict)


# engine metrics that describe the engines, not one round's work: a step's rounds keep them as they are
ENGINE_STATE_METRICS = ("generation/engines", "generation/engine_imbalance", "generation/kv_capacity_tokens")


def sum_engine_metrics(rounds: list[dict[str, float]]) -> dict[str, float]:
    """The engine metrics of a step's generation rounds: tokens and seconds summed, the engine count and KV capacity
    kept (``ENGINE_STATE_METRICS``), the imbalance (slowest engine's seconds / mean) recomputed from the sums."""
    out: dict[str, float] = {}
    for m in rounds:
        for k, v in m.items():
            out[k] = v if k in ENGINE_STATE_METRICS else out.get(k, 0.0) + v
    seconds = [v for k, v in out.items() if k.endswith("/seconds")]
    if seconds and sum(seconds) > 0:
        out["generation/engine_imbalance"] = max(seconds) / (sum(seconds) / len(seconds))
    return out


def wake_oom_hint(error: str, beside_engine: dict[str, float]) -> str:
    """What to change when a colocated engine ran out of memory waking beside a trainer that kept its state.

    Args:
        error: the engine's error text; only one that says "out of memory" gets a hint.
        beside_engine: the trainer's ``cuda_memory_gib()`` after the refit's release (``allocated_gib``,
            ``reserved_gib``); ``{}`` when the trainer's state left the GPU (``offload_trainer``) or on CPU.

    Returns:
        str: the trainer's GiB on the GPU and the keys that give the engine room, or "" (no hint).
    """
    if "out of memory" not in error.lower() or "reserved_gib" not in beside_engine:
        return ""
    reserved, allocated = beside_engine["reserved_gib"], beside_engine.get("allocated_gib", float("nan"))
    return (f"the trainer held {reserved:.1f} GiB of this GPU beside the engine ({allocated:.1f} GiB of live "
            f"tensors, the rest cached blocks that torch.cuda.empty_cache could not return); lower "
            f"policy.generation.vllm_cfg.gpu_memory_utilization or policy.sequence_packing.train_mb_tokens, or set "
            f"policy.generation.colocated.offload_trainer=true")


class RefitController:
    """Keeps the engine's weights (and FP8 KV scales) on the policy's version (NeMo-RL's "stale" flag).

    After each training step the loop calls ``mark_stale(step, kv_scales)``; the next
    ``generating()`` block first refits (with ``offload_trainer``: the policy offloads its optimizer
    state before and its weights after, so the engine can wake), then wakes the engine, checks that it
    holds exactly this version (weights and, with FP8 KV, scales), and puts it to sleep at the end.

    Args:
        policy: a ``PolicyBackend`` (or group).
        generation: a ``GenerationBackend`` (or group).
        weight_sync: a ``nemo_fp8.distributed.weight_sync.WeightSync``.
        version: the policy version held now (the GRPO step; 0 for the initial weights).
        kv_scales: FP8 KV scales for ``version`` (required when ``requires_kv_scales``).
        requires_kv_scales: the engine runs an FP8 KV cache: every refit must carry fresh scales.
        offload_trainer: move the trainer's optimizer state (before the refit) and weights (after it) to
            host memory around each refit so a colocated engine can wake; False when the engine has GPUs
            of its own or both fit (``policy.generation.colocated.offload_trainer``).
        colocated: the engine shares the trainer's GPUs. Without ``offload_trainer`` the refit then starts and
            ends with ``policy.release_cached_memory()``: the trainer's weights and optimizer state stay, what its
            next pass rebuilds (gradients, cached blocks of the step's activation peak, then the export's buckets)
            goes back to the device before the engine wakes for the refit and for generation.
        sleep_discards_weights: the engine's sleep drops its weights (vLLM ``sleep_level=2``): every sleep marks
            the engine stale, so the next rollout (a validation right after a step's rollout too) refits first.
    """

    def __init__(self, policy: PolicyBackend, generation: GenerationBackend, weight_sync, version: int = 0,
                 kv_scales: Optional[KvScales] = None,
                 requires_kv_scales: bool = False, offload_trainer: bool = True, colocated: bool = True,
                 sleep_discards_weights: bool = False):
        self.policy, self.generation, self.weight_sync = policy, generation, weight_sync
        self.requires_kv_scales = requires_kv_scales
        self.offload_trainer = offload_trainer
        self.colocated = colocated
        self.sleep_discards_weights = sleep_discards_weights
        self.beside_engine: dict[str, float] = {}  # policy.cuda_memory_gib() after the last colocated refit
        self.stale = True
        self.version, self.kv_scales = version, kv_scales
        self.last_stats = None

    def mark_stale(self, version: int, kv_scales: Optional[KvScales] = None) -> None:
        """The policy now holds ``version``; refit before the next rollout."""
        self.version, self.kv_scales, self.stale = version, kv_scales, True

    def refit_if_stale(self, timer: Timer) -> dict[str, float]:
        """Refit when stale; returns the refit's metrics (empty when nothing was sent).

        Raises:
            RuntimeError: FP8 KV cache on and no scales for this version.
        """
        if not self.stale:
            return {}
        if self.requires_kv_scales and (self.kv_scales is None or self.kv_scales.step != self.version):
            got = None if self.kv_scales is None else self.kv_scales.step
            raise RuntimeError(f"refit to version {self.version}: the FP8 KV cache needs scales measured on these "
                               f"weights (have: {got}); calibrate_kv_scales after every training step")
        # the refit's parts under refit/ (timing/refit/*: trainer state out, the transfer, the weights out)
        counts: dict[str, float] = {}  # the colocated releases' RELEASE_COUNTS
        with timer("refit"):
            with timer("refit/offload_trainer_state"):
                if self.offload_trainer:
                    self.policy.offload_before_refit()
                elif self.colocated:  # the last pass's cached activation peak goes back before the engine wakes
                    counts.update(self._release(timer, "before"))  # for the refit (else the wake ran out of memory)
            with timer("refit/transfer"):
                self.last_stats = self.weight_sync.sync(self.version, self.kv_scales)
            for part, seconds in self.last_stats.parts().items():  # inside the transfer: SyncStats.parts
                timer.add(f"refit/transfer/{part}", seconds)
            with timer("refit/offload_weights"):
                if self.offload_trainer:
                    self.policy.offload_after_refit()
                elif self.colocated:
                    counts.update(self._release(timer, "after"))
        self.stale = False
        metrics = {**self.last_stats.metrics(), **counts}
        if self.colocated and not self.offload_trainer:  # the trainer's part of the GPU the engine wakes beside
            self.beside_engine = self.policy.cuda_memory_gib() or {}
            metrics.update({f"memory/beside_engine_{k}": v for k, v in self.beside_engine.items()})
        return metrics

    def _release(self, timer: Timer, when: str) -> dict[str, float]:
        """``policy.release_cached_memory()``; its parts' seconds (the slowest rank's) under ``release_<when>/<part>``
        (``when``: ``before`` or ``after`` the transfer), outside ``refit/`` (they lie inside the refit's parts).
        Returns its ``RELEASE_COUNTS`` (the largest rank's) as ``release_<when>/<name>``, for the refit's metrics."""
        # the young generations only, before the transfer too: in the 8B one-GPU mission the full collection there
        # took 0.07 s scanning the trainer's unfrozen heap and its garbage held no GPU memory (gc_freed_gib 0 in
        # BF16 and FP8); what gives the engine memory is empty_cache. Older cycles are left to Python's collector.
        counts = {}
        for part, value in (self.policy.release_cached_memory(1) or {}).items():
            if part in RELEASE_COUNTS:
                counts[f"release_{when}/{part}"] = value
            else:
                timer.add(f"release_{when}/{part}", value)
        return counts

    @contextlib.contextmanager
    def generating(self, timer: Timer):
        """Refit if stale, wake the engine, check its version, yield; then put it to sleep.

        Raises:
            RuntimeError: the engine does not hold this version's weights (or KV scales).
        """
        self.refit_if_stale(timer)
        with timer("engine_wake"):  # outside the four phases: the step's "other" time
            try:
                self.generation.prepare_for_generation()
            except RunFailed as e:
                hint = wake_oom_hint(str(e), self.beside_engine)
                if not hint:
                    raise
                raise type(e)(f"{e}; {hint}") from e
        try:
            with timer("engine_wake"):  # the version check counts with the wake
                held = self.generation.weight_version()
            if held.weights != self.version:
                raise RuntimeError(f"rollout: the engine holds weights of version {held.weights}, the policy is at "
                                   f"{self.version} (a refit was lost)")
            if self.requires_kv_scales and held.kv_scales != self.version:
                raise RuntimeError(f"rollout: the engine's FP8 KV scales are of version {held.kv_scales} (-1: never "
                                   f"set, i.e. the default 1.0), the weights of {self.version}: stale scales")
            yield
        finally:
            with timer("engine_sleep"):
                self.generation.finish_generation()
            if self.sleep_discards_weights:
                self.stale = True  # the weights are gone: the next wake needs them sent again


def prompts_batch(prompts: list[PromptSample], pad_token_id: int) -> TrainBatch:
    """Prompts alone as a ``TrainBatch`` (no responses): what KV calibration sees before the first rollout."""
    lengths = torch.tensor([len(p.prompt_token_ids) for p in prompts], dtype=torch.long)
    ids = torch.full((len(prompts), int(lengths.max())), pad_token_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p.prompt_token_ids)] = torch.tensor(p.prompt_token_ids)
    zeros = torch.zeros(ids.shape, dtype=torch.float32)
    return TrainBatch(ids, lengths, torch.zeros_like(lengths), torch.zeros(len(prompts)), zeros)


def decode_responses(output: GenerationOutput, tokenizer) -> list[str]:
    """Response text of each row (special tokens dropped)."""
    texts = []
    for ids, p, r in zip(output.token_ids, output.prompt_lengths.tolist(), output.response_lengths.tolist()):
        texts.append(tokenizer.decode(ids[p:p + r].tolist(), skip_special_tokens=True))
    return texts


def rollout(prompts: list[PromptSample], n: int, generation: GenerationBackend, reward_fn: RewardFn, tokenizer,
            sampling: SamplingParams, timer: Timer) -> Rollout:
    """Generate ``n`` responses per prompt (grouped consecutively) and score them: the reward reads each
    prompt's ``response_prefix`` (the prefilled start of the answer, ``data.response_prefix``) followed by
    its response. ``engine_metrics``: the engines' ``pop_engine_metrics`` (tokens and seconds of this round)."""
    with timer("generation"):
        out = generation.generate([s.prompt_token_ids for s in prompts for _ in range(n)], sampling)
    with timer("reward"):
        responses = decode_responses(out, tokenizer)
        rows = [s for s in prompts for _ in range(n)]
        rewards = reward_fn([s.response_prefix + text for s, text in zip(rows, responses)],
                            [s.example.answer for s in rows])
    return Rollout(out, responses, torch.tensor(rewards, dtype=torch.float32), generation.pop_engine_metrics())


def compute_advantages(r: Rollout, cfg: LoopConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [B], keep [B] bool): shaped rewards -> group baseline -> optional std scaling.

    A reward of ``nan`` is an answer the reward's step budget left unscored (``MathRewardScorer``): not
    wrong, unknown. It gets advantage 0 (no policy-gradient term), takes no part in its group's baseline
    and std (the group is normalised over its scored answers), and is dropped from the batch with
    ``grpo.use_dynamic_sampling`` (whose extra rounds refill it).
    """
    g = cfg.grpo
    scored = ~torch.isnan(r.rewards)
    shaped = torch.where(scored, r.rewards, torch.zeros_like(r.rewards))
    if g.reward_shaping.enabled:
        max_len = g.reward_shaping.max_response_length or cfg.policy.generation.max_new_tokens
        shaped = shaped + overlong_penalty(r.output.response_lengths, max_len,
                                           g.reward_shaping.overlong_buffer_length,
                                           g.reward_shaping.overlong_buffer_penalty)
    n = g.num_generations_per_prompt
    baseline = "leave_one_out" if g.use_leave_one_out_baseline else "mean"
    if bool(scored.all()):
        adv = grpo_advantages(shaped, n, baseline, normalize_std=g.normalize_rewards)
        keep = dynamic_sampling_keep_mask(shaped, n) if g.use_dynamic_sampling else torch.ones_like(scored)
        return adv, keep
    adv, keep = torch.zeros_like(shaped), scored.clone()
    for start in range(0, shaped.numel(), n):
        idx = start + torch.nonzero(scored[start:start + n]).flatten()
        if idx.numel() >= 2:
            adv[idx] = grpo_advantages(shaped[idx], idx.numel(), baseline, normalize_std=g.normalize_rewards)
        if g.use_dynamic_sampling and (idx.numel() < 2 or bool(shaped[idx].max() == shaped[idx].min())):
            keep[start:start + n] = False
    if not g.use_dynamic_sampling:
        keep = torch.ones_like(scored)  # rows keep the batch's shape; advantage 0 leaves them out of the update
    return adv, keep


def grpo_step(step: int, prompt_batches: Iterator[list[PromptSample]], policy: PolicyBackend,
              generation: GenerationBackend, reward_fn: RewardFn, tokenizer, cfg: LoopConfig, timer: Timer,
              refitter: RefitController) -> dict[str, float]:
    """One GRPO step; returns flat ``group/name`` metrics.

    With ``grpo.use_dynamic_sampling`` (DAPO), groups whose rewards are all equal carry no
    signal and are dropped; more prompt batches are drawn (at most
    ``grpo.dynamic_sampling_max_gen_batches``) until ``num_prompts_per_step`` groups remain.
    If they never do, the step trains on the largest multiple of
    ``policy.train_global_batch_size`` rows it has (possibly none).
    """
    g, gen_cfg = cfg.grpo, cfg.policy.generation
    n, want = g.num_generations_per_prompt, g.num_prompts_per_step * g.num_generations_per_prompt
    parts, rollouts = [], []
    refit_metrics = refitter.refit_if_stale(timer)
    with refitter.generating(timer):
        for round_idx in range(g.dynamic_sampling_max_gen_batches if g.use_dynamic_sampling else 1):
            r = rollout(next(prompt_batches), n, generation, reward_fn, tokenizer, step_sampling(cfg, step, round_idx),
                        timer)
            with timer("advantages"):
                adv, keep = compute_advantages(r, cfg)
            o = r.output
            rollouts.append(r)
            parts.append(TrainBatch(o.token_ids, o.prompt_lengths, o.response_lengths, adv,
                                    o.generation_logprobs).select(keep))
            if sum(p.size for p in parts) >= want:
                break
    with timer("data_processing"):  # the driver's own work between the phases (NeMo-RL's timer of that name)
        batch = _concat_batches(parts, tokenizer.pad_token_id)
        usable = min(batch.size, want) // cfg.policy.train_global_batch_size * cfg.policy.train_global_batch_size
        batch = batch.select(slice(0, usable))

    metrics = {**rollout_metrics(rollouts, usable), **refit_metrics}
    if usable == 0:
        logger.warning("step %d: no informative groups after %d generation rounds; skipping the update", step,
                       len(rollouts))
        return metrics  # the policy did not change: the engine stays fresh
    return update_policy(cfg, policy, batch, step, refitter, timer, metrics)


def step_sampling(cfg: LoopConfig, step: int, round_idx: int) -> SamplingParams:
    """Sampling of generation round ``round_idx`` of step ``step``; the seed depends only on the run's seed, the
    step and the round, so a step made ahead (asynchronous GRPO) samples what the synchronous loop would (also each
    request's limit under ``policy.generation.response_limits``, drawn from the request's seed)."""
    g, gen_cfg = cfg.grpo, cfg.policy.generation
    limits = gen_cfg.response_limits
    return SamplingParams(max_new_tokens=gen_cfg.max_new_tokens, temperature=gen_cfg.temperature,
                          seed=g.seed * 1_000_003 + step * 101 + round_idx,
                          stop_token_ids=tuple(gen_cfg.stop_token_ids or ()),
                          response_limits=None if limits is None else limits.limits())


def rollout_metrics(rollouts: list[Rollout], usable: int) -> dict[str, float]:
    """A step's ``train/*`` rollout metrics over all its generation rounds (``usable``: rows trained on) and the
    engines' summed ``generation/*`` metrics."""
    rewards = torch.cat([r.rewards for r in rollouts])
    resp_len = torch.cat([r.output.response_lengths for r in rollouts]).float()
    return {
        "train/reward_mean": float(rewards.nanmean()),  # nan: left unscored by the reward's step budget
        "train/num_unscored": float(rewards.isnan().sum()),
        "train/response_length_mean": float(resp_len.mean()),
        "train/truncated_frac": float(torch.cat([r.output.truncated for r in rollouts]).float().mean()),
        "train/num_sequences_trained": float(usable),
        "train/num_generation_rounds": float(len(rollouts)),
        **sum_engine_metrics([r.engine_metrics for r in rollouts]),
    }


def update_policy(cfg: LoopConfig, policy: PolicyBackend, batch: TrainBatch, step: int, refitter: RefitController,
                  timer: Timer, metrics: dict[str, float],
                  extra_metrics: Optional[Callable[[TrainBatch], dict[str, float]]] = None) -> dict[str, float]:
    """The training half of a step on ``batch`` (rows trained on): ``prev_logprobs`` (and reference log-probs for
    the KL penalty) with the current weights, the mismatch metrics (plus ``extra_metrics(batch)``), one
    ``policy.train`` with the clipped PG loss, the FP8 KV calibration where the engines need scales, then
    ``refitter.mark_stale(step)``. Adds to and returns ``metrics``."""
    with timer("logprobs"):
        batch.prev_logprobs = policy.get_logprobs(batch)
        if cfg.loss_fn.reference_policy_kl_penalty > 0:
            batch.reference_logprobs = policy.get_logprobs(batch, reference=True)
    with timer("data_processing"):
        metrics.update({f"mismatch/{k}": v for k, v in
                        mismatch_metrics(batch.prev_logprobs, batch.generation_logprobs, batch.token_mask).items()})
        if extra_metrics is not None:
            metrics.update(extra_metrics(batch))
    with timer("training"):
        train_metrics = policy.train(batch, ClippedPGLossFn(cfg.loss_fn))
    # the loss's own metrics under loss/; a backend's grouped ones (memory/train_*) as they come
    metrics.update({k if "/" in k else f"loss/{k}": v for k, v in train_metrics.items()})
    kv_scales = None
    if refitter.requires_kv_scales:
        vllm_cfg = cfg.policy.generation.vllm_cfg
        rows = calibration_rows(batch.size, vllm_cfg.kv_calibration_max_samples)
        with timer("kv_calibration"):
            kv_scales = policy.calibrate_kv_scales(batch.select(rows), step, vllm_cfg.kv_scale_margin)
        metrics.update(kv_scales.metrics())
        metrics["kv_scales/calibration_samples"] = float(rows.numel())
    refitter.mark_stale(step, kv_scales)
    return metrics


def _concat_batches(parts: list[TrainBatch], pad_token_id: int) -> TrainBatch:
    return TrainBatch(concat_padded([p.token_ids for p in parts], pad_token_id),
                      torch.cat([p.prompt_lengths for p in parts]), torch.cat([p.response_lengths for p in parts]),
                      torch.cat([p.advantages for p in parts]),
                      concat_padded([p.generation_logprobs for p in parts], 0.0))


def validate(generation: GenerationBackend, reward_fn: RewardFn, tokenizer, samples: list[PromptSample],
             cfg: LoopConfig, step: int, refitter: RefitController, timer: Timer) -> dict[str, float]:
    """Accuracy (mean reward) on ``samples``: greedy when ``grpo.val_greedy``, one response each.

    Returns ``val/accuracy`` and ``val/num_samples``; when the samples come from more than one
    ``data_source`` (e.g. the small model's synthetic arithmetic + GSM8K split), also
    ``val/accuracy/<data_source>`` for each (verl logs ``val/test_score/<data_source>`` the same way),
    so a gain on one source is not averaged away by a source the model cannot solve yet. Answers the
    reward's step budget left unscored (nan) count neither way; ``val/num_unscored`` says how many, when any.
    """
    g, gen_cfg = cfg.grpo, cfg.policy.generation
    sampling = SamplingParams(max_new_tokens=gen_cfg.max_new_tokens, temperature=gen_cfg.temperature,
                              greedy=g.val_greedy, seed=g.seed + 7 * step,
                              stop_token_ids=tuple(gen_cfg.stop_token_ids or ()))
    rewards, shown = [], 0
    with refitter.generating(timer):
        for i in range(0, len(samples), g.val_batch_size):  # no bar of its own: the run shows one (utils/console)
            chunk = samples[i:i + g.val_batch_size]
            r = rollout(chunk, 1, generation, reward_fn, tokenizer, sampling, Timer())
            rewards.append(r.rewards)
            for s, text, rew in zip(chunk, r.responses, r.rewards.tolist()):
                if shown < cfg.logger.num_val_samples_to_print:
                    tqdm.write(f"[val] {s.prompt!r} -> {text!r} (gold {s.example.answer!r}, reward {rew})")
                    shown += 1
    scores = torch.cat(rewards)  # nan: left unscored by the reward's step budget, not counted either way
    out = {"val/accuracy": float(scores.nanmean()), "val/num_samples": float(len(samples))}
    if scores.isnan().any():
        out["val/num_unscored"] = float(scores.isnan().sum())
    sources = [s.example.data_source for s in samples]
    if len(set(sources)) > 1:
        for src in sorted(set(sources)):
            mask = torch.tensor([x == src for x in sources])
            out[f"val/accuracy/{src}"] = float(scores[mask].nanmean())
    return out


def grpo_train(cfg: LoopConfig, policy: PolicyBackend, generation: GenerationBackend, reward_fn: RewardFn, tokenizer,
               dataloader, val_samples: list[PromptSample], metrics_logger, checkpointer, start_step: int,
               config_yaml: str, refitter: RefitController) -> dict[str, float]:
    """Run steps ``start_step + 1 .. grpo.max_num_steps``; returns the last step's metrics.

    ``dataloader`` is an endless iterator of prompt batches with ``state_dict()``; its state is
    saved with each checkpoint so ``--resume`` continues with the same data order.
    """
    g = cfg.grpo
    timer = Timer()
    last: dict[str, float] = {}
    if start_step == 0 and g.val_at_start and g.val_period > 0:
        with timer("validation"):
            last = validate(generation, reward_fn, tokenizer, val_samples, cfg, 0, refitter, timer)
        metrics_logger.log(0, {**last, **{f"timing/{k}": v for k, v in timer.pop().items()}})
    bar = StepBar(range(start_step + 1, g.max_num_steps + 1), start_step, g.max_num_steps, "grpo")
    for step in bar:
        t0 = time.perf_counter()
        metrics = grpo_step(step, dataloader, policy, generation, reward_fn, tokenizer, cfg, timer, refitter)
        is_last = step == g.max_num_steps
        if (g.val_period > 0 and step % g.val_period == 0) or (is_last and g.val_at_end):
            with timer("validation"):
                metrics.update(validate(generation, reward_fn, tokenizer, val_samples, cfg, step, refitter, timer))
        if cfg.checkpointing.enabled and (step % cfg.checkpointing.save_period == 0 or is_last):
            # The row is written before the checkpoint becomes visible (utils/checkpoint.py): one commit.
            t_save = time.perf_counter()
            checkpointer.save(step, policy, {"dataloader": dataloader.state_dict()}, config_yaml,
                              before_commit=lambda: _log_row(metrics_logger, step, metrics, timer, t0, cfg,
                                                             time.perf_counter() - t_save))
        else:
            _log_row(metrics_logger, step, metrics, timer, t0, cfg)
        bar.set_postfix(reward=f"{metrics['train/reward_mean']:.3f}")
        last = metrics
    return last


def _log_row(metrics_logger, step: int, metrics: dict[str, float], timer: Timer, t0: float, cfg: LoopConfig,
             checkpoint_s: Optional[float] = None) -> None:
    """Add the step's phase timings (``timing/*``, ``timing/checkpoint``: the checkpoint's files, seconds) and
    rollout throughput to ``metrics`` and write its row."""
    g = cfg.grpo
    phases = timer.pop()
    if checkpoint_s is not None:
        phases["checkpoint"] = checkpoint_s
    metrics.update({f"timing/{k}": v for k, v in phases.items()})
    metrics["timing/step"] = time.perf_counter() - t0
    resp_tokens = metrics.get("train/response_length_mean", 0.0) * g.num_prompts_per_step \
        * g.num_generations_per_prompt * metrics.get("train/num_generation_rounds", 1.0)
    if phases.get("generation"):
        metrics["perf/rollout_tokens_per_s"] = resp_tokens / phases["generation"]
    metrics_logger.log(step, metrics)
