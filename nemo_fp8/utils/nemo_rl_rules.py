"""The table of NeMo-RL's GRPO config keys (``RULES``) and the conversions its rules use.

See ``nemo_fp8.utils.nemo_rl_compat`` for how the table is applied.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

_MISSING = object()


def get_path(data: Any, key: str) -> Any:
    """The value at dotted ``key`` of nested dicts, or ``_MISSING``."""
    node = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


class Refused(ValueError):
    """A NeMo-RL key whose value asks for something this project cannot do (the message says what is valid).

    ``key`` / ``value``: the key under the rule's key, and its value, that the error is about (a section's
    ``enabled``), when not the rule's key itself."""

    def __init__(self, message: str, key: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.key, self.value = key, value


@dataclass
class Context:
    """What a rule may read besides its own value: the whole config (``data``, as loaded, before any rule ran),
    the folder YAML paths are read against (``root``) and the keys given on the command line (``cli_keys``)."""

    data: dict
    root: Path
    cli_keys: set[str] = field(default_factory=set)

    def get(self, key: str, default: Any = None) -> Any:
        """The value at dotted ``key`` of the loaded config (``default`` when absent)."""
        value = get_path(self.data, key)
        return default if value is _MISSING else value


@dataclass(frozen=True)
class Rule:
    """What one NeMo-RL key becomes. ``apply(value, ctx)`` returns ``{our key: value}`` to set (empty: dropped)
    or raises ``Refused``; ``kind`` and ``doc`` are the mapping table's columns."""

    kind: str  # alias | off | inert | feature
    doc: str
    apply: Callable[[Any, Context], dict[str, Any]]
    target: Optional[str] = None  # an alias's one key of ours


def show(value: Any) -> str:
    """``value`` as it would be written in YAML (``true``, ``null``, ``"text"``, ``[1, 2]``)."""
    try:
        return json.dumps(value)
    except TypeError:
        return repr(value)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    return a == b


def alias(target: str, convert: Optional[Callable[[Any, Context], Any]] = None, note: str = "") -> Rule:
    """The key is ours as ``target``; ``convert(value, ctx)`` gives our value (may raise ``Refused``)."""
    return Rule("alias", f"`{target}`" + (f" ({note})" if note else ""),
                lambda v, ctx: {target: convert(v, ctx) if convert else v}, target)


def off(*accepted: Any, what: str, hint: str = "") -> Rule:
    """A feature this project lacks (``what``): accepted at one of ``accepted``, refused at any other value."""
    valid = " or ".join(show(a) for a in accepted)

    def apply(v: Any, ctx: Context) -> dict[str, Any]:
        if any(_same(v, a) for a in accepted):
            return {}
        raise Refused(f"{what} is not supported by nemo-fp8; {hint or f'set it to {valid}'}")

    return Rule("off", f"accepted at {valid}; otherwise refused: {what}", apply)


def inert(note: str) -> Rule:
    """A setting that changes nothing here: accepted with any value, dropped."""
    return Rule("inert", f"accepted, any value: {note}", lambda v, ctx: {})


def feature(what: str, keys: tuple[str, ...], gate: str = "enabled") -> Rule:
    """A section switched by its ``gate`` key (NeMo-RL's other keys of it: ``keys``): dropped whole when that is
    false or null; refused by its ``gate`` key when true, and by name for a key NeMo-RL does not have there."""
    import difflib

    def apply(v: Any, ctx: Context) -> dict[str, Any]:
        if not isinstance(v, dict):
            if v is None or v is False:
                return {}
            raise Refused(f"{what} is configured by a mapping with {gate}: false here (or null)")
        for name in v:
            if name != gate and name not in keys:
                close = difflib.get_close_matches(str(name), [gate, *keys], n=1)
                raise Refused(f"unknown key{f' (did you mean {close[0]!r}?)' if close else ''} (valid keys here: "
                              f"{', '.join(sorted([gate, *keys]))})", key=str(name), value=v[name])
        if not v.get(gate):
            return {}
        raise Refused(f"{what} is not supported by nemo-fp8; set it to false", key=gate, value=v[gate])

    return Rule("feature", f"accepted while `{gate}` is false (the section is dropped); refused when true: {what}",
                apply)


# --------------------------------------------------------------------------- value conversions
def _null_is(default: Any) -> Callable[[Any, Context], Any]:
    return lambda v, ctx: default if v is None else v


def _read_text(key: str, value: Any, ctx: Context) -> Optional[str]:
    """The text of the file a NeMo-RL ``*_file`` key names (relative: to the working directory when given on the
    command line, else to the config's folder root), or None for null."""
    if value is None:
        return None
    path = Path(str(value)).expanduser()
    base = Path.cwd() if key in ctx.cli_keys else ctx.root
    path = path if path.is_absolute() else base / path
    if not path.is_file():
        raise Refused(f"file not found: {path} (valid: a local text file, or null)")
    return path.read_text()


def prompt_template(text: str) -> str:
    """A NeMo-RL prompt file (``str.format`` with one ``{}`` for the problem, ``{{``/``}}`` for braces) as our
    ``data.prompt_template`` (``{problem}`` replaced literally, braces as written).

    Raises:
        Refused: a field other than ``{}`` / ``{0}``, or no field at all.
    """
    out, fields = [], 0
    try:
        parts = list(string.Formatter().parse(text))
    except ValueError as e:
        raise Refused(f"not a str.format template: {e}") from None
    for literal, name, spec, conversion in parts:
        out.append(literal)
        if name is None:
            continue
        if name not in ("", "0") or spec or conversion:
            raise Refused(f"the prompt file's field {{{name}}} is not the problem's {{}} (valid: one {{}})")
        out.append("{problem}")
        fields += 1
    if not fields:
        raise Refused("the prompt file has no {} for the problem")
    return "".join(out)


def _prompt_file(key: str) -> Callable[[Any, Context], Any]:
    def convert(v: Any, ctx: Context) -> Any:
        text = _read_text(key, v, ctx)
        return "{problem}" if text is None else prompt_template(text)
    return convert


def _system_prompt_file(key: str) -> Callable[[Any, Context], Any]:
    return lambda v, ctx: _read_text(key, v, ctx)


# NeMo-RL's dataset names with a loader here (files on disk; nothing is downloaded)
DATASET_NAMES = {"ResponseDataset": "problem_answer", "DAPOMath17K": "dapo", "DAPOMathAIME2024": "dapo",
                 "GSM8K": "gsm8k", "gsm8k": "gsm8k"}
RESPONSE_KEYS = {"input_key": "problem", "output_key": "answer"}


def _dataset_name(where: str, validation: bool = False) -> Callable[[Any, Context], Any]:
    """``dataset_name`` of the NeMo-RL section ``where`` (``data.train``, ``data.validation``, or ``data`` in its
    older flat layout) as our ``data.dataset``; its ``input_key`` / ``output_key`` are read there or in
    ``data.default``."""
    def convert(v: Any, ctx: Context) -> Any:
        if v not in DATASET_NAMES:
            raise Refused(f"nemo-fp8 reads local files and has no loader for {show(v)}; valid: "
                          f"{', '.join(DATASET_NAMES)} with {where}.data_path naming a local .jsonl/.json/.parquet "
                          "file (ResponseDataset with input_key: problem, output_key: answer)")
        if v == "ResponseDataset":
            for k, ours in RESPONSE_KEYS.items():
                got = ctx.get(f"{where}.{k}", ctx.get(f"data.default.{k}"))
                if got != ours:
                    raise Refused(f"ResponseDataset here reads the file's keys problem and answer; set "
                                  f"{where}.{k}={ours} (got {show(got)}; NeMo-RL's default is "
                                  f"{show('input' if k == 'input_key' else 'output')})")
        if validation:
            train = DATASET_NAMES.get(ctx.get("data.train.dataset_name", ctx.get("data.default.dataset_name")))
            if train is not None and DATASET_NAMES[v] != train:
                raise Refused(f"train and validation files share one schema here (data.dataset={show(train)})")
        return DATASET_NAMES[v]
    return convert


def _response_key(k: str) -> Rule:
    return off(RESPONSE_KEYS[k], what=f"{'a problem' if k == 'input_key' else 'an answer'} key other than "
                                      f"{show(RESPONSE_KEYS[k])}",
               hint=f"set it to {show(RESPONSE_KEYS[k])} and name the file's key so")


def _like_train(key: str) -> Rule:
    def apply(v: Any, ctx: Context) -> dict[str, Any]:
        train = ctx.get(f"data.train.{key}", ctx.get(f"data.default.{key}"))
        if _same(v, train):
            return {}
        raise Refused(f"train and validation prompts are formatted alike here; set it to data.train.{key}'s "
                      f"{show(train)}")
    return Rule("off", f"accepted when equal to `data.train.{key}` (one setting for both)", apply)


def _processor(v: Any, ctx: Context) -> bool:
    if v != "math_hf_data_processor":
        raise Refused("nemo-fp8 formats math problems like math_hf_data_processor only (the prompt file's text in "
                      "the tokenizer's chat template); set it to \"math_hf_data_processor\"")
    return True


def _val_greedy(v: Any, ctx: Context) -> bool:
    temperature = ctx.get("policy.generation.temperature", 1.0)
    if v == 0:
        return True
    if _same(v, temperature):
        return False
    raise Refused(f"validation samples at policy.generation.temperature ({show(temperature)}) or greedily here "
                  "(grpo.val_greedy); set it to one of those, or to 0 for greedy")


def _updates_per_step(ctx: Context) -> int:
    rollout = ctx.get("grpo.num_prompts_per_step", 32) * ctx.get("grpo.num_generations_per_prompt", 16)
    return max(1, rollout // ctx.get("policy.train_global_batch_size", 512))


def torch_scheduler(v: Any, ctx: Context) -> dict[str, Any]:
    """NeMo-RL's torch scheduler list as our warm-up: ``LinearLR(start_factor=f, end_factor=1, total_iters=n)``
    then ``ConstantLR(factor=1)`` (and ``milestones``) is a linear warm-up from ``f x lr`` over ``n`` GRPO steps,
    which here is ``lr_warmup_init`` / ``lr_warmup_steps`` counted in optimizer updates (``n`` x updates per step).

    Raises:
        Refused: any other scheduler.
    """
    if v is None or v == []:
        return {}
    entries = v if isinstance(v, list) else [v]
    named = [e for e in entries if isinstance(e, dict) and "name" in e]
    other = [e for e in entries if not (isinstance(e, dict) and ("name" in e or set(e) == {"milestones"}))]
    kinds = [e["name"].rsplit(".", 1)[-1] for e in named]
    constant_ok = all((e.get("kwargs") or {}).get("factor", 1.0) == 1.0 for e in named
                      if e["name"].endswith("ConstantLR"))
    if other or not constant_ok or kinds not in (["ConstantLR"], ["LinearLR"], ["LinearLR", "ConstantLR"]):
        raise Refused("only a LinearLR warm-up (end_factor 1.0) followed by ConstantLR(factor 1.0) maps to "
                      "nemo-fp8's schedule; use policy.optimizer.lr_warmup_steps / lr_warmup_init / lr_decay_style "
                      "instead, or set it to null")
    if kinds == ["ConstantLR"]:
        return {}
    kw = named[0].get("kwargs") or {}
    if kw.get("end_factor", 1.0) != 1.0:
        raise Refused("a LinearLR that ends below the learning rate (end_factor != 1.0) has no equivalent here; "
                      "use policy.optimizer.lr_decay_style")
    lr = ctx.get("policy.optimizer.kwargs.lr", ctx.get("policy.optimizer.lr", 1e-5))
    return {"policy.optimizer.lr_warmup_init": float(kw.get("start_factor", 1.0 / 3)) * lr,
            "policy.optimizer.lr_warmup_steps": int(kw.get("total_iters", 5)) * _updates_per_step(ctx)}


def _scheduler_rule() -> Rule:
    return Rule("alias", "`policy.optimizer.lr_warmup_init` / `lr_warmup_steps` (a LinearLR warm-up, end_factor "
                "1.0, then ConstantLR(factor 1.0); its GRPO steps become optimizer updates; null: none; other "
                "schedulers refused)", lambda v, ctx: torch_scheduler(v, ctx))


def _weight_decay_schedule(v: Any, ctx: Context) -> dict[str, Any]:
    wd = ctx.get("policy.megatron_cfg.optimizer.weight_decay", 0.01)
    if v == wd:
        return {}
    raise Refused(f"a weight decay schedule is not supported by nemo-fp8; set it to "
                  f"policy.megatron_cfg.optimizer.weight_decay ({show(wd)})")


def _torch_optimizer_name(v: Any, ctx: Context) -> dict[str, Any]:
    if v in ("torch.optim.AdamW", "AdamW"):
        return {}
    raise Refused("the torch backend trains with AdamW only; set it to \"torch.optim.AdamW\"")


def _sgd_momentum(v: Any, ctx: Context) -> dict[str, Any]:
    if ctx.get("policy.megatron_cfg.optimizer.optimizer", "adam") != "sgd" or v == 0.9:
        return {}
    raise Refused("an SGD momentum other than megatron-core's 0.9 is not supported by nemo-fp8; set it to 0.9")


def _dtensor(*accepted: Any, what: str) -> Rule:
    """A ``policy.dtensor_cfg`` key: inert while that backend is disabled, else an ``off`` rule."""
    rule = off(*accepted, what=what)

    def apply(v: Any, ctx: Context) -> dict[str, Any]:
        return rule.apply(v, ctx) if ctx.get("policy.dtensor_cfg.enabled") else {}
    return Rule("off", f"accepted while `policy.dtensor_cfg.enabled` is false; else {rule.doc}", apply)


def _dtensor_enabled(v: Any, ctx: Context) -> dict[str, Any]:
    if v and ctx.get("policy.megatron_cfg.enabled"):
        raise Refused("the torch (DTensor) and megatron backends are both enabled; set one of them to false")
    return {}




def _default_of(key: str, train_rule: Rule) -> Rule:
    """``data.default.<key>``: NeMo-RL's value for train and validation unless ``data.train.<key>`` is set."""
    def apply(v: Any, ctx: Context) -> dict[str, Any]:
        return {} if ctx.get(f"data.train.{key}") is not None else train_rule.apply(v, ctx)
    return Rule(train_rule.kind, f"as `data.train.{key}` when that is not set", apply, train_rule.target)


def _data_rules() -> dict[str, Rule]:
    """NeMo-RL's ``data`` section: ``data.train`` / ``data.validation`` (one dataset each) over ``data.default``."""
    train = {
        "dataset_name": alias("data.dataset", _dataset_name("data.train"), "ResponseDataset -> problem_answer, "
                              "DAPOMath17K -> dapo, GSM8K -> gsm8k; other names refused (nothing is downloaded)"),
        "data_path": alias("data.train_path"),
        "input_key": _response_key("input_key"),
        "output_key": _response_key("output_key"),
        "prompt_file": alias("data.prompt_template", _prompt_file("data.train.prompt_file"),
                             "the file's text, its {} becoming {problem}; null: the problem alone"),
        "system_prompt_file": alias("data.system_prompt", _system_prompt_file("data.train.system_prompt_file"),
                                    "the file's text; null: none"),
        "processor": alias("data.use_chat_template", _processor, "math_hf_data_processor: true (the prompt in the "
                           "tokenizer's chat template); others refused"),
        "env_name": off("math", what="an environment other than math"),
        "split_validation_size": inert("with no validation file, nemo-fp8 holds grpo.max_val_samples problems of the "
                                       "train file out for validation"),
        "seed": inert("the seed of NeMo-RL's train/validation split; the held-out problems here are the file's last"),
    }
    rules = {f"data.train.{k}": r for k, r in train.items()}
    rules.update({f"data.default.{k}": _default_of(k, r) for k, r in train.items() if k not in ("data_path", "seed")})
    rules["data.validation.data_path"] = alias("data.val_path")
    rules["data.validation.dataset_name"] = alias("data.dataset", _dataset_name("data.validation", True),
                                                  "must give the train file's schema")
    for k in ("input_key", "output_key", "prompt_file", "system_prompt_file", "processor", "env_name"):
        rules[f"data.validation.{k}"] = _like_train(k)
    rules["data.validation"] = off(None, what="a validation section without data_path",
                                   hint="set data.validation.data_path, or null")
    rules.update({
        "data.num_workers": inert("the prompts are tokenized once in the driver"),
        "data.use_multiple_dataloader": off(False, what="several train dataloaders"),
        "data.train": off(None, what="a list of train datasets", hint="give one dataset (a mapping)"),
        "data.default": inert("its keys apply to data.train and data.validation (above)"),
        # NeMo-RL's older flat data keys
        "data.dataset_name": alias("data.dataset", _dataset_name("data")),
        "data.train_data_path": alias("data.train_path"),
        "data.val_data_path": alias("data.val_path"),
        "data.input_key": _response_key("input_key"),
        "data.output_key": _response_key("output_key"),
        "data.prompt_file": alias("data.prompt_template", _prompt_file("data.prompt_file")),
        "data.system_prompt_file": alias("data.system_prompt", _system_prompt_file("data.system_prompt_file")),
    })
    return rules


def _off_all(section: str, what: str, **accepted: Any) -> dict[str, Rule]:
    return {f"{section}.{k}": off(v, what=f"{what} ({k})") for k, v in accepted.items()}


_LORA = ("target_modules", "exclude_modules", "dim", "alpha", "dropout", "dropout_position")

RULES: dict[str, Rule] = {
    # ------------------------------------------------------------------ grpo
    "grpo.max_rollout_turns": off(1, what="multi-turn rollouts"),
    "grpo.max_num_epochs": inert("nemo-fp8 runs grpo.max_num_steps steps, starting a new pass over the data when one "
                                 "ends; set grpo.max_num_steps to the steps one epoch takes to stop there"),
    "grpo.val_start_at": off(-1, 0, None, what="delaying periodic validation"),
    "grpo.overlong_filtering": off(False, what="overlong filtering (grpo.reward_shaping is DAPO's overlong penalty)"),
    "grpo.advantage_clip_low": off(None, what="advantage clipping"),
    "grpo.advantage_clip_high": off(None, what="advantage clipping"),
    "grpo.val_num_generations_per_prompt": off(1, what="several validation samples per prompt (pass@k)"),
    "grpo.stop_at_validation_metric": off(None, what="early stopping on a validation metric"),
    "grpo.stop_at_validation_threshold": off(None, what="early stopping on a validation metric"),
    "grpo.batch_multiplier": off(1, what="a batch multiplier"),
    "grpo.adv_estimator.name": off("grpo", what="an advantage estimator other than GRPO's"),
    "grpo.adv_estimator.normalize_rewards": alias("grpo.normalize_rewards"),
    "grpo.adv_estimator.use_leave_one_out_baseline": alias("grpo.use_leave_one_out_baseline"),
    "grpo.adv_estimator.minus_baseline": off(True, what="GRPO without its baseline (Reinforce++'s minus_baseline)"),
    "grpo.reward_scaling": feature("reward scaling", ("source_min", "source_max", "target_min", "target_max")),
    "grpo.reward_shaping.stop_properly_penalty_coef": off(None, what="the stop-properly penalty"),
    "grpo.seq_logprob_error_threshold": off(None, what="masking sequences by log-prob error"),
    "grpo.invalid_tool_call_advantage": off(None, what="tool calls"),
    "grpo.malformed_thinking_advantage": off(None, what="a <think>-tag advantage"),
    # grpo.async_grpo.enabled / max_trajectory_age_steps are ours (docs/async-grpo.md); the engines take new
    # weights between generation rounds only, and an engine error stops the run
    "grpo.async_grpo.in_flight_weight_updates": off(False, what="in-flight weight updates (new weights reach the "
                                                    "engines between generation rounds)"),
    "grpo.async_grpo.recompute_kv_cache_after_weight_updates": off(False, what="recomputing the KV cache after "
                                                                   "in-flight weight updates"),
    "grpo.async_grpo.max_generation_failures": off(0, what="tolerating failed generation rounds (an engine error "
                                                   "stops the run)"),
    "reward_penalties": off(None, what="NeMo-Gym reward penalties"),
    **_off_all("reward_penalties", "NeMo-Gym reward penalties", penalize_duplicated_reasoning=False,
               penalize_empty_final_answer=False, penalize_unwanted_tokens=False, penalize_malformed_think_tag=False,
               token_ids=None),
    "data_plane": feature("the TransferQueue data plane", ("impl", "backend", "storage_capacity", "num_storage_units",
                                                        "claim_meta_poll_interval_s", "global_segment_size",
                                                        "local_buffer_size", "observability")),
    "on_policy_distillation": off(None, what="on-policy distillation"),
    # ------------------------------------------------------------------ loss_fn
    "loss_fn.reference_policy_kl_type": off("k3", what="a KL estimator other than k3"),
    "loss_fn.use_on_policy_kl_approximation": off(False, what="the on-policy KL approximation"),
    "loss_fn.truncated_importance_sampling_type": alias("loss_fn.truncated_importance_sampling_type",
                                                        _null_is("tis"), "null: tis"),
    "loss_fn.sequence_level_importance_ratios": off(False, what="sequence-level importance ratios (GSPO)"),
    "loss_fn.force_on_policy_ratio": off(False, what="forcing the ratio to 1"),
    "loss_fn.use_kl_in_reward": off(False, what="the KL penalty in the reward"),
    "loss_fn.use_cispo": off(False, what="CISPO"),
    "loss_fn.disable_ppo_ratio": off(False, what="disabling the PPO ratio"),
    "loss_fn.positive_example_nll_weight": off(0.0, what="VAPO's positive-example NLL loss"),
    # ------------------------------------------------------------------ policy
    "policy.tokenizer.chat_template_kwargs": off(None, what="chat template arguments"),
    "policy.tokenizer.use_fastokens": inert("a faster tokenizer, same tokens"),
    "policy.hf_config_overrides": off({}, what="Hugging Face config overrides"),
    "policy.logprob_chunk_size": off(None, what="chunked log-probs by sequence length"),
    "policy.offload_optimizer_for_logprob": inert("memory placement while not colocated"),
    "policy.make_sequence_length_divisible_by": inert("nemo-fp8 pads to the parallel layout's multiple itself"),
    "policy.optimizer": off(None, what="a torch optimizer section that is not a mapping", hint="give a mapping or null"),
    "policy.optimizer.name": Rule("off", "accepted at \"torch.optim.AdamW\" (the torch backend's optimizer)",
                                  _torch_optimizer_name),
    "policy.optimizer.kwargs.lr": alias("policy.optimizer.lr"),
    "policy.optimizer.kwargs.weight_decay": alias("policy.optimizer.weight_decay"),
    "policy.optimizer.kwargs.betas": alias("policy.optimizer.betas"),
    "policy.optimizer.kwargs.eps": alias("policy.optimizer.eps"),
    "policy.optimizer.kwargs.foreach": inert("a torch kernel choice"),
    "policy.optimizer.kwargs.fused": inert("a torch kernel choice"),
    "policy.scheduler": _scheduler_rule(),
    "policy.dtensor_cfg.enabled": Rule("off", "accepted: the torch backend trains when `policy.megatron_cfg.enabled` "
                                       "is false; both true refused", _dtensor_enabled),
    "policy.dtensor_cfg._v2": inert("NeMo-RL's DTensor worker version"),
    "policy.dtensor_cfg.cpu_offload": _dtensor(False, what="DTensor CPU offload"),
    "policy.dtensor_cfg.sequence_parallel": _dtensor(False, what="DTensor sequence parallelism"),
    "policy.dtensor_cfg.activation_checkpointing": _dtensor(False,
                                                            what="activation checkpointing in the torch backend"),
    "policy.dtensor_cfg.tensor_parallel_size": _dtensor(1, what="tensor parallelism in the "
                                                        "torch backend (policy.megatron_cfg has it)"),
    "policy.dtensor_cfg.context_parallel_size": _dtensor(1, what="context parallelism"),
    "policy.dtensor_cfg.custom_parallel_plan": _dtensor(None, what="a custom parallel plan"),
    "policy.dtensor_cfg.automodel_kwargs": _dtensor({}, what="Automodel arguments"),
    "policy.dtensor_cfg.lora_cfg": feature("LoRA", _LORA + ("match_all_linear", "lora_A_init", "use_triton")),
    "policy.dynamic_batching": feature("dynamic batching (policy.sequence_packing packs by token budget)",
                                       ("train_mb_tokens", "logprob_mb_tokens", "sequence_length_round")),
    "policy.sequence_packing.microbatch_order": off("packer", what="a micro-batch order other than the packer's"),
    "policy.draft": feature("draft-model training", ("model_name", "loss_weight", "num_layers", "aux_layer_indices")),
    # ------------------------------------------------------------------ policy.megatron_cfg
    "policy.megatron_cfg.model_overrides": alias("policy.megatron_cfg.override_transformer_config",
                                                 _null_is({}), "Megatron-Bridge provider attributes"),
    "policy.megatron_cfg.gradient_accumulation_fusion": alias("policy.megatron_cfg.fuse_wgrad_accumulation"),
    "policy.megatron_cfg.env_vars": alias("policy.megatron_cfg.env_vars", _null_is({}), "null: none"),
    "policy.megatron_cfg.fp8_cfg": off(None, what="an fp8_cfg that is not a mapping", hint="give a mapping or null"),
    "policy.megatron_cfg.checkpoint.async_save": inert("nemo-fp8 saves its own checkpoints"),
    "policy.megatron_cfg.checkpoint.ckpt_assume_constant_structure": inert("nemo-fp8 saves its own checkpoints"),
    "policy.megatron_cfg.use_fused_linear_logprobs": off(False, what="fused linear log-probs "
                                                         "(policy.megatron_cfg.logprob_kernel chooses the kernel)"),
    "policy.megatron_cfg.fused_linear_logprobs_chunk_size": inert("used only with use_fused_linear_logprobs"),
    "policy.megatron_cfg.force_reconvert_from_hf": inert("nemo-fp8 converts from Hugging Face each run"),
    "policy.megatron_cfg.empty_unused_memory_level": inert("the allocator's cache between phases"),
    "policy.megatron_cfg.cuda_graph_impl": off("none", what="CUDA graphs in training"),
    "policy.megatron_cfg.cuda_graph_modules": off([], what="CUDA graphs in training"),
    "policy.megatron_cfg.cuda_graph_warmup_steps": inert("used only with cuda_graph_impl"),
    "policy.megatron_cfg.fine_grained_activation_offloading": off(False, what="activation offloading"),
    "policy.megatron_cfg.offload_modules": off(None, what="activation offloading"),
    "policy.megatron_cfg.recompute_granularity": off("full", what="selective recomputation "
                                                     "(activation_checkpointing recomputes full layers)"),
    "policy.megatron_cfg.recompute_modules": off(None, what="selective recomputation"),
    "policy.megatron_cfg.expert_tensor_parallel_size": off(1, what="expert tensor parallelism"),
    "policy.megatron_cfg.num_layers_in_first_pipeline_stage": off(None, what="pipeline parallelism"),
    "policy.megatron_cfg.num_layers_in_last_pipeline_stage": off(None, what="pipeline parallelism"),
    "policy.megatron_cfg.pipeline_dtype": inert("set from policy.precision / megatron_cfg.optimizer.bf16|fp16"),
    "policy.megatron_cfg.defer_fp32_logits": off(False, None, what="deferred fp32 logits"),
    "policy.megatron_cfg.use_gloo_process_groups": inert("a communication backend choice"),
    "policy.megatron_cfg.use_fused_weighted_squared_relu": off(False, what="the fused weighted squared ReLU"),
    "policy.megatron_cfg.peft": feature("LoRA (Megatron PEFT)", _LORA + ("lora_A_init_method", "lora_B_init_method",
                                                                   "a2a_experimental", "lora_dtype")),
    **{f"policy.megatron_cfg.{k}": inert("a mixture-of-experts setting; nemo-fp8 trains dense models")
       for k in ("freeze_moe_router", "moe_router_dtype", "moe_router_load_balancing_type", "moe_router_bias_update_rate",
                 "moe_permute_fusion", "moe_per_layer_logging", "moe_enable_deepep", "moe_token_dispatcher_type",
                 "moe_shared_expert_overlap")},
    **_off_all("policy.megatron_cfg", "multi-token prediction", mtp_num_layers=0, mtp_loss_scaling_factor=0.0,
               mtp_use_repeated_layer=False, mtp_detach_heads=False),
    "policy.megatron_cfg.optimizer.sgd_momentum": Rule("off", "accepted with optimizer adam, or at 0.9 "
                                                       "(megatron-core's) with sgd", _sgd_momentum),
    "policy.megatron_cfg.scheduler.lr_warmup_iters": alias("policy.megatron_cfg.optimizer.lr_warmup_steps"),
    "policy.megatron_cfg.scheduler.lr_warmup_init": alias("policy.megatron_cfg.optimizer.lr_warmup_init"),
    "policy.megatron_cfg.scheduler.lr_decay_style": alias("policy.megatron_cfg.optimizer.lr_decay_style"),
    "policy.megatron_cfg.scheduler.lr_decay_iters": alias(
        "policy.megatron_cfg.optimizer.lr_decay_steps",
        lambda v, ctx: None if ctx.get("policy.megatron_cfg.scheduler.lr_decay_style") == "constant" else v,
        "dropped with lr_decay_style constant"),
    "policy.megatron_cfg.scheduler.wsd_decay_iters": alias("policy.megatron_cfg.optimizer.wsd_decay_steps"),
    "policy.megatron_cfg.scheduler.lr_wsd_decay_style": alias("policy.megatron_cfg.optimizer.lr_wsd_decay_style"),
    "policy.megatron_cfg.scheduler.start_weight_decay": Rule("off", "accepted when equal to optimizer.weight_decay",
                                                             _weight_decay_schedule),
    "policy.megatron_cfg.scheduler.end_weight_decay": Rule("off", "accepted when equal to optimizer.weight_decay",
                                                           _weight_decay_schedule),
    "policy.megatron_cfg.scheduler.weight_decay_incr_style": off("constant", what="a weight decay schedule"),
    "policy.megatron_cfg.distributed_data_parallel_config.overlap_grad_reduce": inert("overlap of communication"),
    "policy.megatron_cfg.distributed_data_parallel_config.overlap_param_gather": inert("overlap of communication"),
    "policy.megatron_cfg.distributed_data_parallel_config.average_in_collective": inert("where the mean is taken"),
    "policy.megatron_cfg.distributed_data_parallel_config.use_custom_fsdp": off(False, what="Megatron FSDP"),
    "policy.megatron_cfg.distributed_data_parallel_config.data_parallel_sharding_strategy": inert(
        "used only with use_custom_fsdp"),
    # ------------------------------------------------------------------ policy.generation
    "policy.generation.port_range_low": inert("ports of NeMo-RL's HTTP servers"),
    "policy.generation.port_range_high": inert("ports of NeMo-RL's HTTP servers"),
    "policy.generation.val_temperature": alias("grpo.val_greedy", _val_greedy, "0: true; equal to "
                                               "policy.generation.temperature: false; other values refused"),
    "policy.generation.val_top_p": off(1.0, what="top-p sampling"),
    "policy.generation.val_top_k": off(None, what="top-k sampling"),
    "policy.generation.stop_strings": off(None, what="stop strings (policy.generation.stop_token_ids are supported)"),
    "policy.generation.refit_transport": off(None, what="choosing the refit transport by NeMo-RL's name",
                                             hint="set it to null and choose policy.weight_sync.method"),
    "policy.generation.real_quant_export_cpu_offload": inert("memory placement during the refit"),
    "policy.generation.refit_cfg": inert("settings of NeMo-RL's NIXL refit (refit_transport)"),
    "policy.generation.mcore_generation_config": inert("settings of NeMo-RL's megatron generation backend"),
    "policy.generation.vllm_kwargs": off({}, what="extra vLLM engine arguments"),
    "policy.generation.vllm_cfg.async_engine": off(False, what="vLLM's async engine"),
    "policy.generation.vllm_cfg.logprobs_mode": off("processed_logprobs", what="raw (unprocessed) rollout log-probs"),
    "policy.generation.vllm_cfg.pipeline_parallel_size": off(1, what="vLLM pipeline parallelism"),
    "policy.generation.vllm_cfg.expert_parallel_size": off(1, what="vLLM expert parallelism"),
    "policy.generation.vllm_cfg.use_tqdm": inert("a progress bar"),
    "policy.generation.vllm_cfg.enable_vllm_metrics_logger": inert("vLLM's metrics logger"),
    "policy.generation.vllm_cfg.vllm_metrics_logger_interval": inert("vLLM's metrics logger"),
    "policy.generation.vllm_cfg.http_refit_api_key_env_var": off(None, what="NeMo-RL's HTTP refit"),
    "policy.generation.vllm_cfg.http_refit_server_port": off(None, what="NeMo-RL's HTTP refit"),
    "policy.generation.vllm_cfg.zmq_refit_server_port": off(None, what="NeMo-RL's ZeroMQ refit"),
    "policy.generation.vllm_cfg.reset_encoder_cache_after_weight_update": off(False, what="multimodal encoders"),
    # ------------------------------------------------------------------ env, logger, checkpointing, cluster
    "env.math.math_verify_impl": off("hf_math_verify", what="a math verifier other than math-verify's"),
    "logger.mlflow_enabled": off(False, what="MLflow logging"),
    "logger.swanlab_enabled": off(False, what="SwanLab logging"),
    "logger.monitor_gpus": inert("GPU monitoring"),
    "logger.gpu_monitoring": inert("GPU monitoring intervals"),
    "logger.mlflow": inert("settings of the MLflow logger (logger.mlflow_enabled)"),
    "logger.swanlab": inert("settings of the SwanLab logger (logger.swanlab_enabled)"),
    "logger.tensorboard": off({}, None, what="TensorBoard settings", hint="set it to {} (logger.tensorboard_enabled "
                              "switches it)"),
    "logger.wandb.log_nemo_gym_full_result_tables": off(False, what="NeMo-Gym result tables"),
    "checkpointing.metric_name": inert("nemo-fp8 keeps the last checkpointing.keep_last_k checkpoints, not the best"),
    "checkpointing.higher_is_better": inert("nemo-fp8 keeps the last checkpoints, not the best"),
    "checkpointing.keep_top_k": alias("checkpointing.keep_last_k", _null_is(1000000),
                                      "the newest k are kept (not the best); null: all"),
    "checkpointing.checkpoint_must_save_by": off(None, what="a save deadline"),
    "checkpointing.model_save_format": inert("nemo-fp8 writes its own checkpoint format"),
    "checkpointing.save_consolidated": off(False, what="consolidated Hugging Face checkpoints"),
    "checkpointing.save_optimizer": off(True, what="checkpoints without the optimizer state (resume needs it)"),
    "cluster.master_port_range_low": inert("ports of the rendezvous"),
    "cluster.master_port_range_high": inert("ports of the rendezvous"),
    "cluster.segment_size": off(None, what="NVLink-domain segments"),
    **_data_rules(),
}
