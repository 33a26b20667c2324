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

from omegaconf import DictConfig, ListConfig, OmegaConf
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
from nemo_fp8.utils.nemo_rl_compat import canonical_key, did_you_mean, nemo_rl_keys_at, register_resolvers, translate

__all__ = ["MasterConfig", "ConfigError", "load_config", "validate_config", "config_to_yaml", "cross_field_errors",
           # the sections, re-exported for convenience (each is defined in its component's folder)
           "GRPOConfig", "ClippedPGLossConfig", "RewardShapingConfig", "TRUNCATED_IS_TYPES", "DataConfig", "ClusterConfig",
           "WeightSyncConfig", "SUPPORTED_WEIGHT_BLOCK_SIZE", "ColocationConfig", "GenerationConfig", "VllmConfig",
           "Fp8TrainingConfig", "MegatronConfig", "MegatronOptimizerConfig", "OptimizerConfig", "PolicyConfig",
           "TinyModelConfig", "TokenizerConfig", "EnvConfig", "MathEnvConfig", "CheckpointingConfig", "LoggerConfig",
           "WandbConfig", "load_yaml_file", "config_diff", "IMMUTABLE_ON_RESUME", "resume_changes"]


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
    # the torch reference engine refits in its own process, in no format of vLLM's: it ignores the key
    if vllm_cfg.refit_format == "kernel" and (cfg.policy.weight_sync.method == "nccl"
                                              or cfg.policy.generation.backend == "sglang"):
        errs.append("policy.generation.vllm_cfg.refit_format: 'kernel' is for the vLLM engine refit by CUDA IPC or "
                    f"from its own process (policy.weight_sync.method: {cfg.policy.weight_sync.method!r}, "
                    f"policy.generation.backend: {cfg.policy.generation.backend!r}); valid otherwise: 'checkpoint'")
    dp = cfg.policy.data_parallel_size
    if vllm_cfg.kv_cache_is_fp8 and vllm_cfg.kv_calibration_max_samples is not None \
            and vllm_cfg.kv_calibration_max_samples < dp:
        errs.append(f"policy.generation.vllm_cfg.kv_calibration_max_samples: {vllm_cfg.kv_calibration_max_samples} "
                    f"leaves some of policy.data_parallel_size={dp} ranks without a sequence to calibrate on "
                    f"(valid: >= {dp}, or null for the whole batch)")
    rollout = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    gbs = cfg.policy.train_global_batch_size
    if rollout % gbs != 0:
        errs.append(f"policy.train_global_batch_size: {gbs} must divide grpo.num_prompts_per_step * "
                    f"grpo.num_generations_per_prompt = {rollout}")
    if cfg.grpo.async_grpo.enabled and cfg.policy.generation.colocated.enabled:
        errs.append("policy.generation.colocated.enabled: grpo.async_grpo.enabled=true generates while the trainer "
                    "trains, on engines of their own; set policy.generation.colocated.enabled=false (on GPUs with "
                    "policy.generation.colocated.resources.gpus_per_node / num_nodes for the engines), or "
                    "grpo.async_grpo.enabled=false")
    if cfg.data.max_input_seq_length > cfg.policy.max_total_sequence_length:  # equal: NeMo-RL's upper bound
        errs.append(f"data.max_input_seq_length: {cfg.data.max_input_seq_length} leaves no room to generate within "
                    f"policy.max_total_sequence_length={cfg.policy.max_total_sequence_length} (valid: at most that; "
                    "prompts leaving no room for one token are dropped)")
    return errs


# --------------------------------------------------------------------------- loading
def _load_yaml_with_defaults(path: Path, seen: tuple[Path, ...] = ()) -> Any:
    """Load ``path``; a top-level ``defaults: other.yaml`` (relative to it) is merged underneath."""
    from nemo_fp8.utils.paths import files_in, special_file_kind

    kind = special_file_kind(path)  # os.stat only: a FIFO is never opened
    if kind is not None:
        listing = files_in(path, (".yaml", ".yml")) if kind == "a directory" else ""
        raise ConfigError(f"{path} is {kind}, not a config file{listing}; valid: a YAML file such as "
                          "examples/configs/grpo_math_tiny_fp8.yaml")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    if path in seen:
        raise ConfigError(f"config 'defaults' cycle: {' -> '.join(map(str, seen + (path,)))}")
    node = load_yaml_file(path)
    if not isinstance(node, DictConfig):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (grpo:, policy:, ...), "
                          f"got {'a list' if isinstance(node, ListConfig) else repr(node)}")
    base_names = node.pop("defaults", None)
    if base_names is None:
        return node
    names = list(base_names) if isinstance(base_names, ListConfig) else [base_names]
    if not names or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{path}: 'defaults' must be a file name (a YAML beside it) or a list of them, "
                          f"got {base_names!r}")
    base = OmegaConf.create({})
    for name in names:  # NeMo-RL's order: a later file overrides an earlier one, the file itself overrides them all
        base = OmegaConf.merge(base, _load_yaml_with_defaults((path.parent / name).resolve(), seen + (path,)))
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


def _validation_lines(err: ValidationError) -> list[str]:
    """One ``  - key: problem`` line per error of ``err``; an unknown key names the nearest valid one (ours or
    NeMo-RL's, ``docs/nemo-rl-configs.md``)."""
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            fields = _section_fields(e["loc"])
            section = ".".join(str(p) for p in e["loc"][:-1])
            hint = did_you_mean(str(e["loc"][-1]), fields + nemo_rl_keys_at(section))
            lines.append(f"  - {key}: unknown key{hint} (valid keys here: {', '.join(fields)})")
        elif e["type"] == "value_error":  # a section's own checks: lines relative to the section
            prefix = f"{key}." if key else ""
            lines.extend(f"  - {prefix}{m}" for m in str(e["ctx"]["error"]).splitlines())
        elif e["type"] in _NUMBER_ERRORS and (expects := _expected_value(key)) is not None:
            lines.append(f"  - {key}: expects {expects[0]}, got {e.get('input')!r}; e.g. {key}={expects[1]}")
        else:
            got = e.get("input")
            got_s = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"  - {key}: {e['msg']}{got_s}")
    return lines


# pydantic's errors for a value that is not a number where one is needed ("2.0.0", "1e", [1], 3.5 for an int)
_NUMBER_ERRORS = ("float_parsing", "float_type", "int_parsing", "int_type", "int_from_float")


def _expected_value(key: str) -> tuple[str, str] | None:
    """What the key ``key`` of ours takes, in words, and a valid value as an override writes it (its default, else a
    typical one): ``("a float (a number such as 2.0) or null", "2.0")``. None for a key that takes text, a choice
    of names, or is not ours (quoting the value may then be the fix)."""
    import json
    import typing

    field = _field(key)
    if field is None or _takes(field.annotation, str):
        return None
    ann = field.annotation
    args = typing.get_args(ann) if typing.get_origin(ann) is typing.Union else ()
    types = [a for a in args if a is not type(None)] or [ann]
    optional = " or null" if type(None) in args else ""
    origin = typing.get_origin(types[0]) or types[0]
    for kind, words, fallback in ((bool, "true or false", False), (float, "a float (a number such as {})", 1.0),
                                  (int, "an integer (such as {})", 1), (list, "a list (such as {})", [1]),
                                  (dict, "a mapping (such as {})", {"key": "value"})):
        if len(types) == 1 and origin is kind:
            default = field.get_default(call_default_factory=True)
            ok = isinstance(default, kind) and not (kind is int and isinstance(default, bool))
            example = json.dumps(default if ok else fallback, separators=(",", ":"))
            return words.format(example) + optional, example
    return None


# Keys holding local paths. Relative ones are read against where they were written: in a YAML file,
# the repository that holds it (``config_root``), so a job started from any folder uses the same model,
# data, logs and checkpoints; in a command-line override, the working directory, as for any command.
PATH_KEYS: tuple[str, ...] = ("policy.model_name", "policy.tokenizer.name", "data.train_path", "data.val_path",
                              "logger.log_dir", "checkpointing.checkpoint_dir", "policy.profile.dir")


def config_root(config_path: Path) -> Path:
    """The folder relative paths of ``config_path`` are read against: the nearest folder above it holding a
    ``pyproject.toml`` (the repository, for the shipped configs), else the config file's own folder."""
    config_path = Path(config_path).resolve()
    return next((p for p in config_path.parents if (p / "pyproject.toml").is_file()), config_path.parent)


def resolve_paths(data: dict, root: Path, from_command_line: set[str]) -> dict:
    """Make the ``PATH_KEYS`` of a config dict absolute (in place; returns ``data``).

    A model or tokenizer name stays as written when it is not an existing local path and not a tiny-model
    build target: it may be a Hugging Face hub id (``nemo_fp8.models.hub``).
    """
    import os

    from nemo_fp8.models.hub import is_tiny_build_target

    build = bool(((data.get("policy") or {}).get("tiny_model") or {}).get("build_if_missing", False))
    for key in PATH_KEYS:
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        value = node.get(leaf) if isinstance(node, dict) else None
        if not isinstance(value, str) or not value:
            continue
        base = Path.cwd() if key in from_command_line else root
        path = Path(os.path.expanduser(value))
        absolute = path if path.is_absolute() else base / path
        if key in ("policy.model_name", "policy.tokenizer.name") and not value.startswith((".", "/", "~")) \
                and not absolute.exists() and not (key == "policy.model_name" and is_tiny_build_target(value, build)):
            continue  # a hub id, or a missing folder the preflight names
        node[leaf] = os.path.normpath(absolute)
    return data


def load_config(path: str | Path, overrides: list[str] | None = None) -> MasterConfig:
    """Load a YAML config, apply ``key.sub=value`` overrides, validate, return the typed config.

    Relative paths (``PATH_KEYS``) become absolute: those of the YAML against ``config_root(path)``,
    those of the overrides against the working directory.

    NeMo-RL's configs load too: its resolvers (``mul``, ``max``, ...) are registered, and its keys become ours
    or are accepted at their off value (``nemo_fp8.utils.nemo_rl_compat``; ``docs/nemo-rl-configs.md``).

    Raises:
        ConfigError: missing file, malformed override, or any invalid key/value/combination;
            the message names every offending key and its valid values.
    """
    register_resolvers()  # NeMo-RL's ${mul:...} / ${max:...}
    path = Path(path).resolve()
    node = _load_yaml_with_defaults(path)
    if overrides:
        node = OmegaConf.merge(node, parse_overrides(overrides))
    try:
        data = OmegaConf.to_container(node, resolve=True)
    except Exception as e:  # interpolation errors name the key themselves
        raise ConfigError(f"invalid configuration ({path}): {e}") from e
    cli_keys = {item.split("=", 1)[0].lstrip("+~") for item in overrides or []}
    root = config_root(path)
    data, compat_errors = translate(data, MasterConfig, root, cli_keys)  # NeMo-RL's keys -> ours
    cli_keys |= {canonical_key(k) for k in cli_keys} - {None}
    data = resolve_paths(data, root, cli_keys)
    return validate_config(data, source=str(path), extra_errors=compat_errors)


def _field(key: str) -> Any:
    """The schema's pydantic ``FieldInfo`` of dotted ``key`` (None: not a key of ours)."""
    model: Any = MasterConfig
    field = None
    for part in key.split("."):
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return None
        model = field.annotation
    return field


def _annotation(key: str) -> Any:
    """The schema's type of dotted ``key`` (None: not a key of ours)."""
    field = _field(key)
    return None if field is None else field.annotation


def _takes(ann: Any, kind: type) -> bool:
    """Whether a value of ``kind`` (``str`` or ``dict``) is valid for a key of type ``ann``."""
    import typing

    args = typing.get_args(ann)
    if typing.get_origin(ann) is typing.Union:
        return any(_takes(a, kind) for a in args)
    return ann is kind or typing.get_origin(ann) is kind


def parse_overrides(overrides: list[str]) -> DictConfig:
    """``key.sub=value`` items as one config (values parsed as YAML, as ``OmegaConf.from_dotlist``).

    Hydra's ``+key=`` / ``++key=`` (NeMo-RL's way to add a key) mean ``key=`` here. A value that YAML cannot parse,
    or that parses to a mapping (``Answer: x``) for a key that holds no mapping, is taken as the text typed when
    the key holds a string (``data.response_prefix=Answer: ``).

    Raises:
        ConfigError: an item without ``=``, or such a value for a key that holds no string; the message names the
            key and how to quote the value.
    """
    import yaml

    merged = OmegaConf.create({})
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} is not of the form key.sub=value")
        key, raw = item.split("=", 1)
        key = key.lstrip("+")
        ann = _annotation(key)
        try:
            node = OmegaConf.from_dotlist([f"{key}={raw}"])
            problem = "a mapping" if isinstance(OmegaConf.select(node, key), DictConfig) \
                and ann is not None and not _takes(ann, dict) else None
        except yaml.YAMLError as e:
            problem = f"not valid YAML: {getattr(e, 'problem', None) or e}"
        if problem is not None:
            if (expects := _expected_value(key)) is not None:  # quoted, it would be text: still not what the key takes
                raise ConfigError(f"override {item!r}: {key} expects {expects[0]}, got {raw!r} ({problem}); "
                                  f"e.g. {key}={expects[1]}")
            if ann is None or not _takes(ann, str):
                raise ConfigError(f"override {item!r}: the value of {key} is {problem}; quote it, e.g. "
                                  f"{key}='\"{raw}\"' (the shell passes the outer quotes' content)")
            node = OmegaConf.create({})
            OmegaConf.update(node, key, raw, force_add=True)  # the text as typed
        merged = OmegaConf.merge(merged, node)
    return merged


def validate_config(data: dict, source: str = "<dict>", extra_errors: list[str] | tuple = ()) -> MasterConfig:
    """Validate a plain dict; see ``load_config``.

    Raises:
        ConfigError: one line per problem: ``extra_errors`` (the NeMo-RL keys refused before validation) first,
            then the schema's.
    """
    lines = [f"  - {e}" for e in extra_errors]
    try:
        with deferred_checks():
            cfg = MasterConfig.model_validate(data)
    except ValidationError as e:
        lines.extend(_validation_lines(e))
    if lines:
        raise ConfigError(f"invalid configuration ({source}):\n" + "\n".join(lines))
    return cfg


def config_to_yaml(cfg: MasterConfig) -> str:
    """The fully resolved config as YAML (saved beside logs and checkpoints)."""
    return OmegaConf.to_yaml(OmegaConf.create(cfg.model_dump(mode="json")))


# --------------------------------------------------------------------------- resume diffs, YAML errors
#: The environment variable OmegaConf (>= 2.4) reads its limit on a YAML file's nodes from: every mapping key,
#: value and list item counts, an alias at each use; 10,000 by default ("none": no limit).
NODE_LIMIT_ENV = "OMEGACONF_MAX_YAML_EXPANDED_NODES"


def node_limit_message(path: Path, error: str) -> str:
    """The line for OmegaConf's refusal ``error`` of ``path`` for its size: the limit, the variable that raises it,
    the file (the error reads as a syntax error otherwise)."""
    import re

    counted = "every mapping key, value and list item counts, an alias at each use"
    if m := re.search(r"limit of (\d+)", error):
        return (f"{path}: not a syntax error: the file has more YAML nodes than OmegaConf's limit of {m.group(1)} "
                f"({counted}). For a file you trust, raise the limit in the environment: {NODE_LIMIT_ENV}="
                f"{int(m.group(1)) * 10} (or {NODE_LIMIT_ENV}=none for no limit)")
    ratio = re.search(r"from (\d+) nodes to (\d+) nodes", error)
    what = f"from {ratio.group(1)} to {ratio.group(2)} nodes" if ratio else "past the supported ratio"
    return (f"{path}: not a syntax error: its YAML aliases expand the file {what}, past OmegaConf's limit on "
            f"alias expansion ({counted}). For a file you trust, lift it in the environment: {NODE_LIMIT_ENV}=none")


def load_yaml_file(path: Path) -> Any:
    """``OmegaConf.load(path)``, with a YAML syntax error reported as one line naming file, line, column.

    Raises:
        ConfigError: the file is not valid YAML, or has more nodes than OmegaConf's limit (``node_limit_message``).
    """
    import yaml

    try:
        return OmegaConf.load(path)
    except yaml.YAMLError as e:
        if NODE_LIMIT_ENV in str(e):  # valid YAML, refused by OmegaConf's size limit (an alias bomb guard)
            raise ConfigError(node_limit_message(path, str(e))) from None
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark is not None else str(path)
        problem = " ".join(str(x) for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x) or str(e)
        raise ConfigError(f"{where}: YAML syntax error: {problem}") from None
    except OSError as e:  # OmegaConf refuses a top level that is a scalar ("Invalid loaded object type")
        raise ConfigError(f"{path}: the top level must be a mapping of sections (grpo:, policy:, ...): {e}") from None


# Keys that cannot change when a run is resumed: the model and its precision (the checkpoint's
# weights and the FP8 recipe), the data and its order (the saved dataloader state), the group
# size. A key matches when it equals an entry or lies under it.
IMMUTABLE_ON_RESUME: tuple[str, ...] = (
    "policy.model_name", "policy.tokenizer.name", "policy.precision", "policy.megatron_cfg",
    "policy.generation.backend", "policy.generation.vllm_cfg.precision", "policy.generation.vllm_cfg.kv_cache_dtype",
    "policy.generation.vllm_cfg.num_first_layers_in_bf16", "policy.generation.vllm_cfg.num_last_layers_in_bf16",
    "policy.generation.vllm_cfg.fp8_ignore_patterns", "policy.generation.vllm_cfg.weight_block_size",
    "policy.generation.vllm_cfg.pow2_weight_scaling_factors",
    "policy.generation.vllm_cfg.pow2_activation_scaling_factors",
    "data.dataset", "data.train_path", "data.max_train_samples", "data.num_synthetic_train",
    "data.synthetic_max_operand", "data.seed", "data.shuffle",
    "grpo.num_prompts_per_step", "grpo.num_generations_per_prompt",
)


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        out.update(_flatten(v, key) if isinstance(v, dict) and v else {key: v})
    return out


def config_diff(old: dict, new: dict) -> dict[str, tuple[Any, Any]]:
    """Every leaf key whose value differs between two config dicts: ``{key: (old, new)}``.

    A key present on one side only is reported with ``None`` on the other side.
    """
    a, b = _flatten(old), _flatten(new)
    return {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}


def _same_path(old: str, new: str) -> bool:
    """``old`` (as saved, maybe relative to the repository or the working directory) names the folder ``new``."""
    target = Path(new).resolve()
    repo = Path(__file__).resolve().parents[1]
    return target.exists() and any((base / old).resolve() == target for base in (Path.cwd(), repo))


def resume_changes(old_yaml: str, cfg: MasterConfig, checkpoint_step: int) -> dict[str, tuple[Any, Any]]:
    """Compare the config saved with a checkpoint to the new one; return the changes that apply.

    Keys under ``IMMUTABLE_ON_RESUME`` and a ``grpo.max_num_steps`` below the checkpoint's step are
    errors; every other change (learning rate, number of steps, logging, ...) is returned so the
    caller logs it and applies it.

    Raises:
        ConfigError: lists every change that cannot apply, with the old and new values.
    """
    old = OmegaConf.to_container(OmegaConf.create(old_yaml), resolve=True)
    diff = config_diff(old, cfg.model_dump(mode="json"))
    for key in PATH_KEYS:  # the same folder written relative (older checkpoints) or absolute is no change
        if key in diff and all(isinstance(v, str) for v in diff[key]) and \
                _same_path(diff[key][0], diff[key][1]):
            del diff[key]
    frozen = [k for k in diff if any(k == p or k.startswith(p + ".") for p in IMMUTABLE_ON_RESUME)]
    errs = [f"  - {k}: {diff[k][0]!r} in the checkpoint, {diff[k][1]!r} now (cannot change when resuming)"
            for k in frozen]
    if cfg.grpo.max_num_steps < checkpoint_step:
        errs.append(f"  - grpo.max_num_steps: {cfg.grpo.max_num_steps} is below the checkpoint's step "
                    f"{checkpoint_step} (valid: >= {checkpoint_step})")
    if errs:
        raise ConfigError("cannot resume with this config:\n" + "\n".join(errs)
                          + "\nstart a new run (new logger.log_dir / checkpointing.checkpoint_dir) to change them")
    return {k: v for k, v in diff.items() if k not in frozen}
