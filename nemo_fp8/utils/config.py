"""Config building blocks shared by every component's schema, and the run-wide sections.

Each component owns its section in its own folder (``algorithms/config.py``,
``generation/config.py``, ``policy/config.py``, ``data/config.py``, ``rewards/config.py``,
``distributed/config.py``); ``nemo_fp8/config.py`` only assembles them into ``MasterConfig``,
checks what crosses sections, and loads YAML. Schema modules import pydantic and each other,
never the code they configure (``nemo_fp8.config`` does not import the loss, a backend or Ray).

Error convention: a section's ``config_errors()`` returns one line per problem, each starting
with the key *relative to that section* (``ratio: ...``). Built on its own, a section raises them
at once (``ValueError``); inside ``MasterConfig`` the checks are deferred and collected from every
section plus the cross-section checks, each prefixed with its path, so one error lists them all.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

_DEFER_CHECKS = contextvars.ContextVar("nemo_fp8_defer_config_checks", default=False)


def raise_if(errors: list[str]) -> None:
    """Raise one ``ValueError`` holding every line of ``errors`` (none: return)."""
    if errors:
        raise ValueError("\n".join(errors))


class StrictConfig(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated, and
    ``config_errors()`` (override it) holds the section's checks across its own keys."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def config_errors(self) -> list[str]:
        """Problems across this section's keys, each ``key: problem (valid: ...)``, keys relative."""
        return []

    @model_validator(mode="after")
    def _run_config_checks(self):
        if not _DEFER_CHECKS.get():
            raise_if(self.config_errors())
        return self


@contextlib.contextmanager
def deferred_checks() -> Iterator[None]:
    """Inside: sections skip their own checks, so the root can collect every error at once."""
    token = _DEFER_CHECKS.set(True)
    try:
        yield
    finally:
        _DEFER_CHECKS.reset(token)


def collect_errors(cfg: BaseModel, prefix: str = "") -> list[str]:
    """``config_errors()`` of ``cfg`` and of every nested section, keys prefixed with their path."""
    errs = [f"{prefix}{e}" for e in cfg.config_errors()] if isinstance(cfg, StrictConfig) else []
    for name in type(cfg).model_fields:
        value = getattr(cfg, name)
        if isinstance(value, BaseModel):
            errs.extend(collect_errors(value, f"{prefix}{name}."))
    return errs


class WandbConfig(StrictConfig):
    project: str = "nemo-fp8"
    name: Optional[str] = None
    mode: Literal["online", "offline"] = "offline"


class LoggerConfig(StrictConfig):
    log_dir: str = "logs/run"
    tensorboard_enabled: bool = True
    wandb_enabled: bool = False
    wandb: WandbConfig = WandbConfig()
    plot_enabled: bool = True
    num_val_samples_to_print: int = Field(0, ge=0)


class ProfileConfig(StrictConfig):
    """Section ``policy.profile``: an opt-in ``torch.profiler`` window over one training call of each policy rank
    (``nemo_fp8.utils.profiling.TrainProfiler``; the Megatron backend). Part of the resolved config, so a run's
    ``config.yaml`` says whether it was profiled; it may change on ``--resume`` (listed with the other changes).

    Attributes:
        dir: folder each rank writes ``train_call<N>_rank<R>.txt`` (and the trace) into; None: no profiling, no
            cost. A relative path is read against the config's folder, like ``logger.log_dir``.
        train_call: which training call of the process to profile (1-based; default 3: the first two carry the
            warm-up, kernel selection and allocator growth).
        micro_batches: how many micro-batches the window records, after one untimed.
        trace: also write the window's Chrome trace, ``train_call<N>_rank<R>.json.gz`` (chrome://tracing or
            Perfetto; tens of MB for an 8B model's 6 micro-batches).
    """

    dir: Optional[str] = None
    train_call: int = Field(3, ge=1)
    micro_batches: int = Field(6, ge=1)
    trace: StrictBool = False


class CheckpointingConfig(StrictConfig):
    enabled: bool = True
    checkpoint_dir: str = "results/run"
    save_period: int = Field(10, ge=1)
    keep_last_k: int = Field(2, ge=1)
