"""Config sections of the algorithm: ``grpo`` (the loop, advantages) and ``loss_fn``.

``ClippedPGLossConfig`` is the one loss configuration: the YAML section ``loss_fn`` and the argument of
``nemo_fp8.algorithms.loss.clipped_pg_loss`` are the same object, validated once, here. Key
names follow NeMo-RL's ``ClippedPGLossConfig`` (``nemo_rl/algorithms/loss_functions.py``).
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, StrictBool

from nemo_fp8.algorithms.is_corrections import IS_CORRECTIONS
from nemo_fp8.utils.config import StrictConfig

#: The valid ``loss_fn.truncated_importance_sampling_type`` values: the IS correction registry's names.
TRUNCATED_IS_TYPES: tuple[str, ...] = tuple(IS_CORRECTIONS)
TruncatedISType = Literal[TRUNCATED_IS_TYPES]  # type: ignore[valid-type]


class RewardShapingConfig(StrictConfig):
    """DAPO overlong-response penalty (soft overlong punishment; Yu et al. 2025)."""

    enabled: bool = False
    overlong_buffer_length: int = Field(0, ge=0)
    overlong_buffer_penalty: float = Field(1.0, ge=0)
    max_response_length: Optional[int] = Field(None, ge=1)


class AsyncGRPOConfig(StrictConfig):
    """Asynchronous GRPO (NeMo-RL's ``grpo.async_grpo``; ``nemo_fp8.algorithms.async_grpo``, docs/async-grpo.md).

    Attributes:
        enabled: generation runs on engines of their own (``policy.generation.colocated.enabled: false``) ahead of
            training, into a bounded trajectory buffer; false: the synchronous loop.
        max_trajectory_age_steps: NeMo-RL's bound: a rollout made with the weights of version ``v`` (the weights
            after step ``v``) may train at the step that updates version ``t`` only if ``t - v <= max age``; step
            ``s`` updates version ``s - 1``, so at 1 the collector generates one step ahead. >= 1.
        wait_for_current_weights: the collector makes step ``s``'s rollouts only with the weights of version
            ``s - 1`` (age 0 always): synchronous GRPO on engines of their own, step for step the colocated loop's
            numbers. For tests and for measuring what running ahead buys; not a NeMo-RL key.
    """

    enabled: StrictBool = False
    max_trajectory_age_steps: int = Field(1, ge=1)
    wait_for_current_weights: StrictBool = False


class GRPOConfig(StrictConfig):
    num_prompts_per_step: int = Field(32, ge=1)
    num_generations_per_prompt: int = Field(16, ge=1)
    max_num_steps: int = Field(1000, ge=1)
    normalize_rewards: bool = True
    use_leave_one_out_baseline: bool = False
    use_dynamic_sampling: bool = False
    dynamic_sampling_max_gen_batches: int = Field(10, ge=1)
    reward_shaping: RewardShapingConfig = RewardShapingConfig()
    val_period: int = Field(10, ge=0, description="validate every N steps; 0 disables")
    val_at_start: bool = True
    val_at_end: bool = True
    max_val_samples: int = Field(256, ge=1)
    val_batch_size: int = Field(256, ge=1)
    val_greedy: bool = True
    seed: int = 42
    async_grpo: AsyncGRPOConfig = AsyncGRPOConfig()

    def config_errors(self) -> list[str]:
        return ["num_generations_per_prompt: the leave-one-out baseline (use_leave_one_out_baseline=true) "
                "needs >= 2"] if self.use_leave_one_out_baseline and self.num_generations_per_prompt < 2 else []


class ClippedPGLossConfig(StrictConfig):
    """ClippedPG + importance-sampling correction (``nemo_fp8.algorithms.loss``).

    Attributes:
        ratio_clip_min: eps_low; the PPO ratio is clipped below at ``1 - eps_low``. In [0, 1).
        ratio_clip_max: eps_high; clipped above at ``1 + eps_high``. ``> ratio_clip_min`` is
            DAPO's clip-higher.
        ratio_clip_c: dual-clip constant ``c > 1`` (Ye et al. 2020), or None.
        reference_policy_kl_penalty: beta >= 0 of the k3 KL penalty; 0 disables it.
        token_level_loss: True: mean over all valid tokens of the global batch; False: mean
            over sequences of per-sequence token means.
        use_importance_sampling_correction: weight each token's loss by the truncated ratio
            ``pi_train / pi_rollout`` (``prev_logprobs`` vs ``generation_logprobs``).
        truncated_importance_sampling_type: a name of ``nemo_fp8.algorithms.is_corrections.IS_CORRECTIONS``:
            ``tis`` | ``icepop`` | ``seq-mask-tis`` | ``seq-tis``.
        truncated_importance_sampling_ratio: upper bound C (hi), > 0; None: no upper bound
            for ``tis`` / ``seq-tis``.
        truncated_importance_sampling_ratio_min: lower bound (lo), > 0, <= C; ``tis`` / ``seq-tis``
            clamp weights to ``[lo, C]`` (NeMo-RL's ``tis``; None: no lower bound), ``icepop`` /
            ``seq-mask-tis`` need ``lo < 1 < C`` and mask outside ``[lo, C]``.
        kl_input_clamp_value / kl_output_clamp_value: NeMo-RL's clamps of the k3 input log-ratio
            and output value; None disables.
        allow_fp8_rollout_without_is_correction: run FP8 rollout uncorrected on purpose.

    The three booleans are strict: ``1`` or ``"yes"`` is an error naming the key, not ``True``.
    Validation runs on construction and on assignment, not in ``model_copy(update=...)``
    (pydantic skips it there): build a changed copy with
    ``ClippedPGLossConfig.model_validate({**cfg.model_dump(), **changes})``.
    """

    ratio_clip_min: float = Field(0.2, ge=0, lt=1)
    ratio_clip_max: float = Field(0.2, ge=0)
    ratio_clip_c: Optional[float] = Field(None, gt=1)
    reference_policy_kl_penalty: float = Field(0.0, ge=0)
    token_level_loss: StrictBool = True
    use_importance_sampling_correction: StrictBool = False
    truncated_importance_sampling_type: TruncatedISType = "tis"
    truncated_importance_sampling_ratio: Optional[float] = Field(2.0, gt=0)
    truncated_importance_sampling_ratio_min: Optional[float] = Field(None, gt=0)
    kl_input_clamp_value: Optional[float] = Field(20.0, gt=0)
    kl_output_clamp_value: Optional[float] = Field(10.0, gt=0)
    allow_fp8_rollout_without_is_correction: StrictBool = False

    def config_errors(self) -> list[str]:
        t, hi, lo = (self.truncated_importance_sampling_type, self.truncated_importance_sampling_ratio,
                     self.truncated_importance_sampling_ratio_min)
        errs = []
        if IS_CORRECTIONS[t].window:  # a window around 1 (NeMo-RL requires both bounds set)
            if lo is None or not lo < 1.0:
                errs.append(f"truncated_importance_sampling_ratio_min: must be set and < 1 for type '{t}' "
                            f"(got {lo}; e.g. 0.5, or 0.999 for seq-mask-tis)")
            if hi is None or not hi > 1.0:
                errs.append(f"truncated_importance_sampling_ratio: must be set and > 1 for type '{t}' "
                            f"(got {hi}; e.g. 2.0, or 1.002 for seq-mask-tis)")
        elif lo is not None and hi is not None and not lo <= hi:
            errs.append(f"truncated_importance_sampling_ratio_min: {lo} must be <= truncated_importance_sampling_ratio"
                        f"={hi}")
        return errs
