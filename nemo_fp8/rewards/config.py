"""Config section ``env``: the math reward environment (NeMo-RL's ``env.math``)."""

from __future__ import annotations

import math
from typing import Optional

from pydantic import Field

from nemo_fp8.utils.config import StrictConfig


class MathEnvConfig(StrictConfig):
    """Attributes:
        num_workers: reward worker processes (>= 1: the per-answer limit is enforced by killing a
            worker; inline scoring could not stop a hung answer).
        timeout_s: seconds allowed per answer; an answer past it scores 0.0.
        max_seconds_per_step: seconds allowed for all the answers of one scoring call (one
            rollout batch), shared fairly between them (``MathRewardScorer``); answers not scored by
            then are left out of the advantages and counted in the metrics
            (``reward/num_over_step_budget``). None: no step budget.
    """

    num_workers: int = 2
    timeout_s: float = Field(5.0, gt=0)
    max_seconds_per_step: Optional[float] = Field(60.0, gt=0)

    def config_errors(self) -> list[str]:
        errs = []
        if self.num_workers < 1:
            errs.append(f"num_workers: {self.num_workers} would score inline, where timeout_s={self.timeout_s} "
                        "cannot stop an answer that hangs the verifier (valid: >= 1)")
        if not math.isfinite(self.timeout_s):
            errs.append(f"timeout_s: {self.timeout_s} is not a time limit (valid: a finite number of seconds > 0)")
        if self.max_seconds_per_step is not None and not math.isfinite(self.max_seconds_per_step):
            errs.append(f"max_seconds_per_step: {self.max_seconds_per_step} is not a time budget (valid: a finite "
                        "number of seconds > 0, or null for no step budget)")
        return errs


class EnvConfig(StrictConfig):
    math: MathEnvConfig = MathEnvConfig()
