"""The run configuration: schema, YAML loading, ``key.sub=value`` overrides, validation.

Keys mirror NeMo-RL's GRPO configs (``grpo.*``, ``loss_fn.*``, ``policy.generation.vllm_cfg.*``,
``policy.megatron_cfg.fp8_cfg.*``, ``data.*``, ``logger.*``, ``checkpointing.*``), so a NeMo-RL
user can read our YAML files. Loading is OmegaConf (``defaults:`` inheritance, ``${...}``
interpolation, dotted overrides); validation is pydantic with unknown keys forbidden. Every
problem is reported in one ``ConfigError`` whose lines each name the key and what would be
valid, before any model, Ray or GPU work starts.

Each section is defined beside the code it configures (``algorithms/config.py``: ``grpo``,
``loss_fn``; ``policy/config.py``: ``policy``; ``generation/config.py``: ``policy.generation``;
``distributed/config.py``: ``cluster``, ``policy.weight_sync``; ``data/config.py``;
``rewards/config.py``: ``env``; ``utils/config.py``: ``logger``, ``checkpointing``); this module
assembles them, checks what crosses sections and loads YAML.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from pydantic import BaseModel, ValidationError, model_validator

from nemo_fp8.algorithms.config import GRPOConfig, ClippedPGLossConfig, RewardShapingConfig, TRUNCATED_IS_TYPES
from nemo_fp8.data.config import DataConfig
from nemo_fp8.distributed.config import ClusterConfig, WeightSyncConfig
from nemo_fp8.generation.config import SUPPORTED_WEIGHT_BLOCK_SIZE, ColocationConfig, GenerationConfig, VllmConfig
from nemo_fp8.policy.config import (Fp8TrainingConfig, MegatronConfig, MegatronOptimizerConfig, OptimizerConfig,
                                    PolicyConfig, TinyModelConfig, TokenizerConfig)
from nemo_fp8.rewards.config import EnvConfig, MathEnvConfig
from nemo_fp8.utils.config import (CheckpointingConfig, LoggerConfig, StrictConfig, WandbConfig, collect_errors,
                                   deferred_checks, raise_if)

__all__ = ["MasterConfig", "ConfigError", "load_config", "validate_config", "config_to_yaml", "cross_field_errors",
           # the sections, re-exported for convenience (each is defined in its component's folder)
           "GRPOConfig", "ClippedPGLossConfig", "RewardShapingConfig", "TRUNCATED_IS_TYPES", "DataConfig", "ClusterConfig",
           "WeightSyncConfig", "SUPPORTED_WEIGHT_BLOCK_SIZE", "ColocationConfig", "GenerationConfig", "VllmConfig",
           "Fp8TrainingConfig", "MegatronConfig", "MegatronOptimizerConfig", "OptimizerConfig", "PolicyConfig",
           "TinyModelConfig", "TokenizerConfig", "EnvConfig", "MathEnvConfig", "CheckpointingConfig", "LoggerConfig",
           "WandbConfig"]


class ConfigError(ValueError):
    """A configuration problem; the message lists each offending key and the valid values."""


class MasterConfig(StrictConfig):
    grpo: GRPOConfig = GRPOConfig()
    loss_fn: ClippedPGLossConfig = ClippedPGLossConfig()
    policy: PolicyConfig
    data: DataConfig = DataConfig()
    env: EnvConfig = EnvConfig()
    logger: LoggerConfig = LoggerConfig()
    checkpointing: CheckpointingConfig = CheckpointingConfig()
    cluster: ClusterConfig = ClusterConfig()

    def config_errors(self) -> list[str]:
        return cross_field_errors(self)

    @model_validator(mode="after")
    def _collect_all_errors(self) -> "MasterConfig":
        raise_if(collect_errors(self))  # every section's checks and the cross-section ones, at once
        return self


def cross_field_errors(cfg: MasterConfig) -> list[str]:
    """Impossible combinations across sections, each as ``key: problem (valid: ...)``.

    Checks within one section live with that section's schema.
    """
    errs: list[str] = []
    vllm_cfg, loss = cfg.policy.generation.vllm_cfg, cfg.loss_fn
    if vllm_cfg.precision == "fp8" and not loss.use_importance_sampling_correction \
            and not loss.allow_fp8_rollout_without_is_correction:
        errs.append("loss_fn.use_importance_sampling_correction: FP8 rollout (policy.generation.vllm_cfg.precision='fp8') "
                    "needs true, to correct the rollout/trainer mismatch; set "
                    "loss_fn.allow_fp8_rollout_without_is_correction=true to run uncorrected on purpose")
    rollout = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    gbs = cfg.policy.train_global_batch_size
    if rollout % gbs != 0:
        errs.append(f"policy.train_global_batch_size: {gbs} must divide grpo.num_prompts_per_step * "
                    f"grpo.num_generations_per_prompt = {rollout}")
    if cfg.data.max_input_seq_length >= cfg.policy.max_total_sequence_length:
        errs.append(f"data.max_input_seq_length: {cfg.data.max_input_seq_length} leaves no room to generate within "
                    f"policy.max_total_sequence_length={cfg.policy.max_total_sequence_length} (valid: smaller)")
    return errs


# --------------------------------------------------------------------------- loading
def _load_yaml_with_defaults(path: Path, seen: tuple[Path, ...] = ()) -> Any:
    """Load ``path``; a top-level ``defaults: other.yaml`` (relative to it) is merged underneath."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    if path in seen:
        raise ConfigError(f"config 'defaults' cycle: {' -> '.join(map(str, seen + (path,)))}")
    node = OmegaConf.load(path)
    base_name = node.pop("defaults", None)
    if base_name is None:
        return node
    if not isinstance(base_name, str):
        raise ConfigError(f"{path}: 'defaults' must be one file name (a YAML beside it), got {base_name!r}")
    base = _load_yaml_with_defaults((path.parent / base_name).resolve(), seen + (path,))
    return OmegaConf.merge(base, node)


def _section_fields(loc: tuple) -> list[str]:
    """Field names of the config section that holds the key at ``loc``."""
    model: Any = MasterConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part)) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return []
        model = field.annotation
    return sorted(model.model_fields) if isinstance(model, type) and issubclass(model, BaseModel) else []


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            valid = ", ".join(_section_fields(e["loc"]))
            lines.append(f"  - {key}: unknown key (valid keys here: {valid})")
        elif e["type"] == "value_error":  # a section's own checks: lines relative to the section
            prefix = f"{key}." if key else ""
            lines.extend(f"  - {prefix}{m}" for m in str(e["ctx"]["error"]).splitlines())
        else:
            got = e.get("input")
            got_s = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"  - {key}: {e['msg']}{got_s}")
    return f"invalid configuration ({source}):\n" + "\n".join(lines)


def load_config(path: str | Path, overrides: list[str] | None = None) -> MasterConfig:
    """Load a YAML config, apply ``key.sub=value`` overrides, validate, return the typed config.

    Raises:
        ConfigError: missing file, malformed override, or any invalid key/value/combination;
            the message names every offending key and its valid values.
    """
    path = Path(path).resolve()
    node = _load_yaml_with_defaults(path)
    for item in overrides or []:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} is not of the form key.sub=value")
    if overrides:
        node = OmegaConf.merge(node, OmegaConf.from_dotlist(list(overrides)))
    try:
        data = OmegaConf.to_container(node, resolve=True)
    except Exception as e:  # interpolation errors name the key themselves
        raise ConfigError(f"invalid configuration ({path}): {e}") from e
    return validate_config(data, source=str(path))


def validate_config(data: dict, source: str = "<dict>") -> MasterConfig:
    """Validate a plain dict; see ``load_config``."""
    try:
        with deferred_checks():
            return MasterConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, source)) from None


def config_to_yaml(cfg: MasterConfig) -> str:
    """The fully resolved config as YAML (saved beside logs and checkpoints)."""
    return OmegaConf.to_yaml(OmegaConf.create(cfg.model_dump(mode="json")))
