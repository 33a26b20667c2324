"""The run configuration: schema, YAML loading, ``key.sub=value`` overrides, validation.

Keys mirror NeMo-RL's GRPO configs (``grpo.*``, ``loss_fn.*``, ``policy.generation.vllm_cfg.*``,
``policy.megatron_cfg.fp8_cfg.*``, ``data.*``, ``logger.*``, ``checkpointing.*``), so a NeMo-RL
user can read our YAML files. Loading is OmegaConf (``defaults:`` inheritance, ``${...}``
interpolation, dotted overrides); validation is pydantic with unknown keys forbidden. Every
problem is reported in one ``ConfigError`` whose lines each name the key and what would be
valid, before any model, Ray or GPU work starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

from omegaconf import OmegaConf
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

SUPPORTED_WEIGHT_BLOCK_SIZE = [128, 128]


class ConfigError(ValueError):
    """A configuration problem; the message lists each offending key and the valid values."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# --------------------------------------------------------------------------- algorithm
class RewardShapingConfig(_Strict):
    """DAPO overlong-response penalty (soft overlong punishment)."""

    enabled: bool = False
    overlong_buffer_length: int = Field(0, ge=0)
    overlong_buffer_penalty: float = Field(1.0, ge=0)
    max_response_length: Optional[int] = Field(None, ge=1)


class GRPOConfig(_Strict):
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


class LossConfig(_Strict):
    """ClippedPG + importance-sampling correction (``nemo_fp8.algorithms.loss``)."""

    ratio_clip_min: float = Field(0.2, ge=0, lt=1)
    ratio_clip_max: float = Field(0.2, ge=0)
    ratio_clip_c: Optional[float] = Field(None, gt=1)
    reference_policy_kl_penalty: float = Field(0.0, ge=0)
    token_level_loss: bool = True
    use_importance_sampling_correction: bool = False
    truncated_importance_sampling_type: Literal["tis", "icepop", "seq-mask-tis", "seq-tis"] = "tis"
    truncated_importance_sampling_ratio: Optional[float] = Field(2.0, gt=0)
    truncated_importance_sampling_ratio_min: Optional[float] = Field(None, gt=0)
    kl_input_clamp_value: Optional[float] = 20.0
    kl_output_clamp_value: Optional[float] = 10.0
    allow_fp8_rollout_without_is_correction: bool = False

    def to_loss_config(self):
        """The algorithm's ``ClippedPGLossConfig`` (validates its own ranges too)."""
        from nemo_fp8.algorithms.loss import ClippedPGLossConfig

        return ClippedPGLossConfig(**self.model_dump(exclude={"allow_fp8_rollout_without_is_correction"}))


# --------------------------------------------------------------------------- policy
class VllmConfig(_Strict):
    """Rollout-engine settings. The torch reference backend honours the precision keys too."""

    precision: Literal["bfloat16", "fp8"] = "bfloat16"
    use_deep_gemm: bool = False
    num_first_layers_in_bf16: int = Field(0, ge=0)
    num_last_layers_in_bf16: int = Field(0, ge=0)
    fp8_ignore_patterns: list[str] = Field(default_factory=list)
    pow2_weight_scaling_factors: bool = False
    pow2_activation_scaling_factors: bool = False
    weight_block_size: list[int] = Field(default_factory=lambda: list(SUPPORTED_WEIGHT_BLOCK_SIZE))
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    gpu_memory_utilization: float = Field(0.6, gt=0, le=1)
    tensor_parallel_size: int = Field(1, ge=1)
    max_model_len: Optional[int] = Field(None, ge=1)
    enforce_eager: bool = False


class ColocationConfig(_Strict):
    enabled: bool = True


class GenerationConfig(_Strict):
    backend: Literal["torch", "vllm"] = "torch"
    max_new_tokens: int = Field(512, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=1)
    stop_token_ids: Optional[list[int]] = None
    vllm_cfg: VllmConfig = VllmConfig()
    colocated: ColocationConfig = ColocationConfig()


class Fp8TrainingConfig(_Strict):
    """TransformerEngine FP8 training (the torch backend emulates the same recipe)."""

    enabled: bool = False
    fp8: Literal["e4m3", "hybrid"] = "e4m3"
    fp8_recipe: Literal["tensorwise", "blockwise"] = "blockwise"
    fp8_param: bool = False


class MegatronOptimizerConfig(_Strict):
    optimizer: Literal["adam", "sgd"] = "adam"
    lr: float = Field(5e-7, gt=0)
    min_lr: float = Field(5e-8, ge=0)
    weight_decay: float = Field(0.01, ge=0)
    bf16: bool = True
    fp16: bool = False
    params_dtype: Literal["float32", "bfloat16"] = "float32"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = Field(1.0, gt=0)
    use_distributed_optimizer: bool = True
    use_precision_aware_optimizer: bool = False


class MegatronConfig(_Strict):
    enabled: bool = False
    tensor_model_parallel_size: int = Field(1, ge=1)
    pipeline_model_parallel_size: int = Field(1, ge=1)
    context_parallel_size: int = Field(1, ge=1)
    expert_model_parallel_size: int = Field(1, ge=1)
    sequence_parallel: bool = False
    activation_checkpointing: bool = False
    optimizer: MegatronOptimizerConfig = MegatronOptimizerConfig()
    fp8_cfg: Fp8TrainingConfig = Fp8TrainingConfig()


class OptimizerConfig(_Strict):
    """AdamW for the torch reference policy."""

    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)


class TokenizerConfig(_Strict):
    name: Optional[str] = None  # defaults to policy.model_name


class TinyModelConfig(_Strict):
    """``tools/make_tiny_model.py`` settings, used when ``build_if_missing`` is true."""

    build_if_missing: bool = False
    sft_steps: int = Field(400, ge=0)
    max_operand: int = Field(49, ge=1)
    seed: int = 1234


class PolicyConfig(_Strict):
    model_name: str
    tokenizer: TokenizerConfig = TokenizerConfig()
    tiny_model: TinyModelConfig = TinyModelConfig()
    precision: Literal["float32", "bfloat16"] = "bfloat16"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    train_global_batch_size: int = Field(512, ge=1)
    train_micro_batch_size: int = Field(4, ge=1)
    logprob_batch_size: int = Field(4, ge=1)
    generation_batch_size: int = Field(32, ge=1)
    max_total_sequence_length: int = Field(1024, ge=2)
    max_grad_norm: float = Field(1.0, gt=0)
    optimizer: OptimizerConfig = OptimizerConfig()
    megatron_cfg: MegatronConfig = MegatronConfig()
    generation: GenerationConfig = GenerationConfig()


# --------------------------------------------------------------------------- data, env, io
class DataConfig(_Strict):
    """Training/validation problems. ``synthetic`` needs no files (the embedded default)."""

    dataset: Literal["synthetic", "gsm8k", "dapo", "problem_answer", "auto"] = "synthetic"
    train_path: Optional[str] = None
    val_path: Optional[str] = None
    max_train_samples: Optional[int] = Field(None, ge=1)
    num_synthetic_train: int = Field(4096, ge=1)
    num_synthetic_val: int = Field(256, ge=1)
    synthetic_max_operand: int = Field(99, ge=1)
    prompt_template: str = "{problem}"
    use_chat_template: bool = False
    system_prompt: Optional[str] = None
    max_input_seq_length: int = Field(512, ge=1)
    shuffle: bool = True
    seed: int = 0


class MathEnvConfig(_Strict):
    num_workers: int = Field(2, ge=0)
    timeout_s: float = Field(5.0, gt=0)


class EnvConfig(_Strict):
    math: MathEnvConfig = MathEnvConfig()


class WandbConfig(_Strict):
    project: str = "nemo-fp8"
    name: Optional[str] = None
    mode: Literal["online", "offline"] = "offline"


class LoggerConfig(_Strict):
    log_dir: str = "logs/run"
    tensorboard_enabled: bool = True
    wandb_enabled: bool = False
    wandb: WandbConfig = WandbConfig()
    plot_enabled: bool = True
    num_val_samples_to_print: int = Field(0, ge=0)


class CheckpointingConfig(_Strict):
    enabled: bool = True
    checkpoint_dir: str = "results/run"
    save_period: int = Field(10, ge=1)
    keep_last_k: int = Field(2, ge=1)


class ClusterConfig(_Strict):
    address: Optional[str] = None  # None: start a local Ray; else e.g. "auto" or "ray://host:10001"
    num_cpus: Optional[int] = Field(None, ge=1)
    gpus_per_node: int = Field(0, ge=0)
    num_nodes: int = Field(1, ge=1)
    torch_threads_per_worker: Optional[int] = Field(None, ge=1)


class MasterConfig(_Strict):
    grpo: GRPOConfig = GRPOConfig()
    loss_fn: LossConfig = LossConfig()
    policy: PolicyConfig
    data: DataConfig = DataConfig()
    env: EnvConfig = EnvConfig()
    logger: LoggerConfig = LoggerConfig()
    checkpointing: CheckpointingConfig = CheckpointingConfig()
    cluster: ClusterConfig = ClusterConfig()

    @model_validator(mode="after")
    def _cross_checks(self) -> "MasterConfig":
        errors = cross_field_errors(self)
        if errors:
            raise ValueError("\n".join(errors))
        return self


def cross_field_errors(cfg: MasterConfig) -> list[str]:
    """Impossible combinations, each as ``key: problem (valid: ...)``."""
    errs: list[str] = []
    gen, vllm_cfg, loss = cfg.policy.generation, cfg.policy.generation.vllm_cfg, cfg.loss_fn
    fp8_rollout = vllm_cfg.precision == "fp8"
    if vllm_cfg.weight_block_size != SUPPORTED_WEIGHT_BLOCK_SIZE:
        errs.append(f"policy.generation.vllm_cfg.weight_block_size: {vllm_cfg.weight_block_size} is not supported "
                    f"(valid: {SUPPORTED_WEIGHT_BLOCK_SIZE}, the block size of vLLM/DeepGEMM block-scaled FP8 kernels)")
    if vllm_cfg.kv_cache_dtype == "fp8" and not fp8_rollout:
        errs.append("policy.generation.vllm_cfg.kv_cache_dtype: 'fp8' needs policy.generation.vllm_cfg.precision='fp8' "
                    "(valid with bfloat16 precision: 'auto')")
    if vllm_cfg.kv_cache_dtype == "fp8" and gen.backend != "vllm":
        errs.append("policy.generation.vllm_cfg.kv_cache_dtype: 'fp8' is implemented by the vllm backend only "
                    f"(policy.generation.backend is '{gen.backend}'; valid here: 'auto')")
    if fp8_rollout and not loss.use_importance_sampling_correction and not loss.allow_fp8_rollout_without_is_correction:
        errs.append("loss_fn.use_importance_sampling_correction: FP8 rollout (policy.generation.vllm_cfg.precision='fp8') "
                    "needs true, to correct the rollout/trainer mismatch; set "
                    "loss_fn.allow_fp8_rollout_without_is_correction=true to run uncorrected on purpose")
    if loss.use_importance_sampling_correction:
        t, hi, lo = loss.truncated_importance_sampling_type, loss.truncated_importance_sampling_ratio, \
            loss.truncated_importance_sampling_ratio_min
        if hi is None:
            errs.append(f"loss_fn.truncated_importance_sampling_ratio: required for type '{t}' (e.g. 2.0)")
        if t in ("icepop", "seq-mask-tis") and (lo is None or hi is None or not lo < 1.0 < hi):
            errs.append(f"loss_fn.truncated_importance_sampling_ratio_min: type '{t}' needs 0 < ratio_min < 1 < ratio "
                        f"(got ratio_min={lo}, ratio={hi}; e.g. 0.5 and 2.0)")
    if gen.top_p != 1.0 or gen.top_k is not None:
        errs.append("policy.generation.top_p/top_k: must be 1.0/null; the trainer's log-probs cannot reproduce a "
                    "truncated sampling distribution, so IS correction would be wrong")
    rollout = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    gbs, mbs = cfg.policy.train_global_batch_size, cfg.policy.train_micro_batch_size
    if rollout % gbs != 0:
        errs.append(f"policy.train_global_batch_size: {gbs} must divide grpo.num_prompts_per_step * "
                    f"grpo.num_generations_per_prompt = {rollout}")
    if gbs % mbs != 0:
        errs.append(f"policy.train_micro_batch_size: {mbs} must divide policy.train_global_batch_size = {gbs}")
    if cfg.grpo.use_leave_one_out_baseline and cfg.grpo.num_generations_per_prompt < 2:
        errs.append("grpo.num_generations_per_prompt: the leave-one-out baseline needs >= 2")
    if cfg.data.max_input_seq_length >= cfg.policy.max_total_sequence_length:
        errs.append(f"data.max_input_seq_length: {cfg.data.max_input_seq_length} leaves no room to generate within "
                    f"policy.max_total_sequence_length={cfg.policy.max_total_sequence_length} (valid: smaller)")
    if cfg.data.dataset != "synthetic" and not cfg.data.train_path:
        errs.append(f"data.train_path: required for data.dataset='{cfg.data.dataset}' (a local .jsonl/.json/.parquet "
                    "file), or use data.dataset='synthetic'")
    fp8_cfg = cfg.policy.megatron_cfg.fp8_cfg
    if fp8_cfg.fp8_param and not fp8_cfg.enabled:
        errs.append("policy.megatron_cfg.fp8_cfg.fp8_param: true needs policy.megatron_cfg.fp8_cfg.enabled=true")
    if fp8_cfg.fp8_param and not cfg.policy.megatron_cfg.enabled:
        errs.append("policy.megatron_cfg.fp8_cfg.fp8_param: FP8 parameters need the megatron backend "
                    "(policy.megatron_cfg.enabled=true); the torch backend emulates activations/weights only")
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
        elif e["type"] == "value_error" and not key:
            lines.extend(f"  - {m}" for m in str(e["ctx"]["error"]).splitlines())
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
        return MasterConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, source)) from None


def config_to_yaml(cfg: MasterConfig) -> str:
    """The fully resolved config as YAML (saved beside logs and checkpoints)."""
    return OmegaConf.to_yaml(OmegaConf.create(cfg.model_dump(mode="json")))
