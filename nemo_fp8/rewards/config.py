"""Config section ``env``: the math reward environment (NeMo-RL's ``env.math``)."""

from __future__ import annotations

from pydantic import Field

from nemo_fp8.utils.config import StrictConfig


class MathEnvConfig(StrictConfig):
    num_workers: int = Field(2, ge=0)
    timeout_s: float = Field(5.0, gt=0)


class EnvConfig(StrictConfig):
    math: MathEnvConfig = MathEnvConfig()
