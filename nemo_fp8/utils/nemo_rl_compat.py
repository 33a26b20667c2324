"""Running NeMo-RL's GRPO configs: its resolvers, and what each of its keys becomes here.

NeMo-RL's YAML files (``examples/configs/grpo_math_*.yaml`` of NVIDIA-NeMo/RL) use keys this project has under
the same name, under another name, or not at all. ``translate`` rewrites a loaded config (a plain dict, after
``defaults:`` and overrides are merged) before the strict schema sees it:

* ``alias``: the key is ours under another name (``policy.megatron_cfg.scheduler.lr_warmup_iters`` ->
  ``policy.megatron_cfg.optimizer.lr_warmup_steps``), with its value converted where the meaning needs it; the
  resolved ``config.yaml`` shows only our name.
* ``off``: a feature this project lacks, accepted silently at the value that means "off" (or NeMo-RL's default,
  which changes nothing here) and dropped; any other value is one error naming the key and the value accepted.
* ``inert``: a setting that changes nothing in a run here (progress bars, ports, monitoring intervals, the
  settings of a logger that is off), accepted with any value and dropped.
* ``feature``: a section switched by its ``enabled`` key (``policy.dynamic_batching``, ``grpo.async_grpo``):
  dropped whole when off, refused by its ``enabled`` key when on.

A key in neither schema stays an error; the loader suggests the nearest valid key (``suggest``). The table is
``RULES``; ``tools/nemo_rl_keys.py`` writes it into ``docs/nemo-rl-configs.md``.
"""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Any, Optional

from nemo_fp8.utils.nemo_rl_rules import _MISSING, RULES, Context, Refused, get_path, show, _same



# --------------------------------------------------------------------------- the rewrite
def _set_path(data: dict, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[leaf] = value


def _pop_path(data: dict, key: str, keep: set[str]) -> None:
    """Remove dotted ``key``, then every parent left empty that is not a section of ours (``keep``)."""
    parts = key.split(".")
    nodes = [data]
    for part in parts[:-1]:
        nodes.append(nodes[-1][part])
    del nodes[-1][parts[-1]]
    for depth in range(len(parts) - 1, 0, -1):
        path = ".".join(parts[:depth])
        if nodes[depth] or path in keep:
            break
        del nodes[depth - 1][parts[depth - 1]]


def schema_sections(model: Any, prefix: str = "") -> dict[str, set[str]]:
    """Every section of a pydantic ``model`` (``""`` the root) with its field names."""
    from pydantic import BaseModel

    out = {prefix: set(model.model_fields)}
    for name, f in model.model_fields.items():
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.update(schema_sections(ann, f"{prefix}.{name}" if prefix else name))
    return out


def _megatron_off_settings(ctx: Context) -> list[str]:
    """Keys under ``policy.megatron_cfg`` that only the megatron backend reads, written in the config files while
    ``policy.megatron_cfg.enabled`` is false: NeMo-RL reads the section only when enabled, so they are inert (our
    defaults apply). Given on the command line they stay and are checked (the schema refuses them there)."""
    if ctx.get("policy.megatron_cfg.enabled", False) or not isinstance(ctx.get("policy.megatron_cfg"), dict):
        return []
    keys = [f"policy.megatron_cfg.{k}" for k in MEGATRON_ONLY]
    typed = [k for k in keys if any(c == k or c.startswith(k + ".") for c in ctx.cli_keys)]
    return [k for k in keys if get_path(ctx.data, k) is not _MISSING and k not in typed]


# megatron_cfg keys (ours and NeMo-RL's) that the schema refuses at non-default values without the megatron backend
MEGATRON_ONLY = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "expert_model_parallel_size", "apply_rope_fusion", "bias_activation_fusion",
                 "gradient_accumulation_fusion", "env_vars", "model_overrides", "optimizer.use_precision_aware_optimizer",
                 "optimizer.fp16", "distributed_data_parallel_config.grad_reduce_in_fp32", "fp8_cfg.fp8_param")


def translate(data: dict, schema: Any, root: Path, cli_keys: set[str] = frozenset()) -> tuple[dict, list[str]]:
    """Rewrite NeMo-RL's keys of a loaded config into ours (see the module docstring).

    Args:
        data: the config as plain nested dicts (``OmegaConf.to_container(..., resolve=True)``); not modified.
        schema: the root pydantic model (``MasterConfig``): its sections are kept even when left empty.
        root: the folder relative file names of the YAML are read against (``config_root``).
        cli_keys: keys given on the command line (their relative files are read against the working directory).

    Returns:
        The rewritten dict, and one ``key: value: problem`` line per refused key (an alias whose target is also
        set to another value is refused too).
    """
    ctx = Context(copy.deepcopy(data), root, set(cli_keys))
    out = copy.deepcopy(data)
    sections = schema_sections(schema)
    errs: list[str] = []
    for key in _megatron_off_settings(ctx):
        _pop_path(out, key, set(sections))
    sets: dict[str, tuple[str, Any]] = {}
    for key, rule in RULES.items():
        value = get_path(out, key)
        if value is _MISSING or (isinstance(value, dict) and (key in _SECTIONS_WITH_RULES or key in sections)):
            continue  # a section of ours, or one whose keys have rules of their own (they run one by one)
        _pop_path(out, key, set(sections))
        try:
            targets = rule.apply(value, ctx)
        except Refused as e:
            errs.append(f"{key}.{e.key}: {show(e.value)}: {e}" if e.key else f"{key}: {show(value)}: {e}")
            continue
        for target, new in targets.items():
            mine = get_path(ctx.data, target)
            if mine is not _MISSING and mine != new and target != key:
                errs.append(f"{key}: {show(value)} sets {target}={show(new)}, but {target} is also set to "
                            f"{show(mine)}; keep one of them")
            elif target in sets and not _same(sets[target][1], new):
                errs.append(f"{key}: {show(value)} sets {target}={show(new)}, but {sets[target][0]} sets it to "
                            f"{show(sets[target][1])}; keep one of them")
            else:
                sets[target] = (key, new)
                _set_path(out, target, new)
    errs.extend(_unknown_in_nemo_rl_sections(out, sections))
    return out, errs


_SECTIONS_WITH_RULES = {".".join(k.split(".")[:i]) for k in RULES for i in range(1, k.count(".") + 1)}


def _nemo_rl_sections(sections: dict[str, set[str]]) -> set[str]:
    """Sections that only NeMo-RL has (parents of ``RULES`` keys that are no section of ours)."""
    parents = {k.rsplit(".", 1)[0] for k in RULES if "." in k}
    return {p for p in parents if p not in sections}


def _unknown_in_nemo_rl_sections(out: dict, sections: dict[str, set[str]]) -> list[str]:
    """Keys left in NeMo-RL-only sections after the rules ran: typos; reported with the nearest known key, and
    removed (the schema would otherwise report the whole section)."""
    errs = []
    for section in sorted(_nemo_rl_sections(sections), key=len, reverse=True):
        node = get_path(out, section)
        if not isinstance(node, dict):
            continue
        known = [k.rsplit(".", 1)[1] for k in RULES if k.rsplit(".", 1)[0] == section]
        for name in list(node):
            errs.append(f"{section}.{name}: unknown key{did_you_mean(str(name), known)} (valid keys here: "
                        f"{', '.join(sorted(known))})")
            _pop_path(out, f"{section}.{name}", set(sections))
    return errs


def did_you_mean(name: str, candidates: list[str]) -> str:
    """`` (did you mean 'x'?)`` for the nearest of ``candidates`` (difflib), or ``""``."""
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def nemo_rl_keys_at(section: str) -> list[str]:
    """NeMo-RL's key names directly under ``section`` (dotted; ``""`` the root) that ``RULES`` knows."""
    depth = 0 if not section else section.count(".") + 1
    return sorted({k.split(".")[depth] for k in RULES
                   if (not section or k.startswith(section + ".")) and len(k.split(".")) > depth})


def canonical_key(key: str) -> Optional[str]:
    """Our name of NeMo-RL's ``key`` when ``RULES`` aliases it to one key, else None."""
    rule = RULES.get(key)
    return rule.target if rule is not None else None


def register_resolvers() -> None:
    """Register NeMo-RL's OmegaConf resolvers (``add``, ``mul``, ``div``, ``max``; ``nemo_rl/utils/config.py``) once:
    its configs write e.g. ``train_mb_tokens: ${mul:${policy.max_total_sequence_length}, ...}``."""
    from omegaconf import OmegaConf

    resolvers = {"add": lambda a, b: a + b, "mul": lambda a, b: a * b, "div": lambda a, b: a / b,
                 "max": lambda a, b: max(a, b)}
    for name, fn in resolvers.items():
        if OmegaConf.has_resolver(name):
            continue
        try:  # omegaconf >= 2.4 (register_new_resolver is deprecated there)
            OmegaConf.register_resolver(name, fn, replace=True)
        except TypeError:  # omegaconf 2.3: register_resolver is the legacy string-argument API
            OmegaConf.register_new_resolver(name, fn)
