"""Config section ``env``: the math reward environment (NeMo-RL's ``env.math``)."""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from nemo_fp8.utils.config import StrictConfig


class MathEnvConfig(StrictConfig):
    """Attributes:
        num_workers: reward worker processes (0: score inline, no time limits).
        timeout_s: seconds allowed per answer; an answer past it scores 0.0.
        max_seconds_per_step: seconds allowed for all the answers of one scoring call (one
            rollout batch); answers not scored by then score 0.0 and are counted in the metrics
            (``reward/num_over_step_budget``). None: no step budget.
    """

    num_workers: int = Field(2, ge=0)
    timeout_s: float = Field(5.0, gt=0)
    max_seconds_per_step: Optional[float] = Field(60.0, gt=0)


class EnvConfig(StrictConfig):
    math: MathEnvConfig = MathEnvConfig()
