"""Which Linear layers run in FP8 (rollout and training) and which stay high precision.

The rule follows NeMo-RL's FP8 rollout (`num_first_layers_in_bf16`,
`num_last_layers_in_bf16`, lm_head always BF16) and DeepSeek-V3 (arXiv:2412.19437,
Sec. 3.3: embedding, output head, MoE gating and normalization stay in high
precision). Decisions are made by module type and decoder-layer index, never by
name substrings:

  1. The decoder stack is the nn.ModuleList whose length equals
     `model.config.num_hidden_layers` (or `config.text_config.num_hidden_layers`),
     the outermost one if several match. Without a config (or if none matches) it
     is the longest outermost nn.ModuleList whose children all have one type
     ("outermost": not inside another such list, so per-layer `experts` lists are
     never taken for the stack).
  2. A module is FP8-eligible iff it is an nn.Linear (Fp8TrainingLinear is one) or
     an Fp8BlockLinear, lies in decoder layer i with
     num_first <= i < num_layers - num_last, is not an MoE router and does not
     match an ignore pattern.
  3. MoE router: a Linear whose parent module also has a child registered as
     `experts`, and whose out_features equals the number of experts (len() of the
     `experts` container, else its / the parent's `num_experts` attribute), or is 1
     (a shared-expert gate such as Qwen2-MoE's `shared_expert_gate`). transformers 5
     routers are not Linears (`Qwen3MoeTopKRouter`: a 2-D `weight` [num_experts, hidden]
     applied with F.linear); a sibling of `experts` holding such a `weight` (plus at
     most a bias / score-correction bias) counts the same way, so it stays high
     precision and lands in vLLM's `ignored_layers` (vLLM's `mlp.gate` is a Linear).
  4. ignore_patterns are matched against the full HF module name with
     fnmatch.fnmatchcase (e.g. "model.layers.*.mlp.down_proj"); a pattern starting
     with "re:" is a Python regex applied with re.match (the compressed-tensors /
     vLLM "ignore" convention, e.g. "re:.*self_attn.*").

Everything else that is Linear-like (lm_head, routers, layers outside the range)
is high precision; embeddings and norms are not Linear and are never FP8.
"""

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Sequence

import torch.nn as nn

from nemo_fp8.fp8.linear import Fp8BlockLinear

# vLLM's fused (packed) modules and the HF shards they are built from
# (`packed_modules_mapping` of vLLM's Llama/Qwen models).
VLLM_PACKED_MODULES: dict[str, list[str]] = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}
_SHARD_TO_PACKED = {shard: packed for packed, shards in VLLM_PACKED_MODULES.items() for shard in shards}

LINEAR_TYPES = (nn.Linear, Fp8BlockLinear)


@dataclass
class LayerPrecisionPlan:
    """Result of plan_layer_precision. Names are HF module names (model.named_modules()).

    Attributes:
        fp8_modules: Linear modules that run in FP8.
        high_precision_modules: every other Linear-like module (lm_head, routers,
            first/last layers, ignored modules).
        vllm_ignored_layers: entries for vLLM's `quantization_config["ignored_layers"]`:
            every high-precision Linear under its HF (unfused) name - vLLM's
            `is_layer_skipped` looks fused layers up by their shard names - plus the
            fused name (`...qkv_proj`, `...gate_up_proj`, `...mlp.experts`) where all
            shards are high precision, plus "lm_head".
        num_layers: length of the decoder stack (0 if none was found).
        decoder_layers_name: name of the decoder-stack ModuleList ("" if none).
        router_modules: Linear modules recognised as MoE routers (all high precision).
    """

    fp8_modules: list[str]
    high_precision_modules: list[str]
    vllm_ignored_layers: list[str]
    num_layers: int
    decoder_layers_name: str = ""
    router_modules: list[str] = field(default_factory=list)


def _config_num_layers(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    for cfg in (config, getattr(config, "text_config", None)):
        value = getattr(cfg, "num_hidden_layers", None)
        if isinstance(value, int):
            return value
    return None


def _is_homogeneous(module_list: nn.ModuleList) -> bool:
    return len(module_list) > 0 and len({type(m) for m in module_list}) == 1


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList | None]:
    """Locate the decoder-layer stack (rule 1 of the module docstring).

    Returns:
        (name, module_list), or ("", None) when the model has no homogeneous ModuleList.
    """
    candidates = [
        (name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and _is_homogeneous(m)
    ]
    num_hidden = _config_num_layers(model)
    if num_hidden is not None:
        for name, m in candidates:  # pre-order: the outermost match comes first
            if len(m) == num_hidden:
                return name, m
    outermost = [
        (name, m)
        for name, m in candidates
        if not any(other != name and name.startswith(other + ".") for other, _ in candidates)
    ]
    if not outermost:
        return "", None
    best = max(len(m) for _, m in outermost)
    return next((name, m) for name, m in outermost if len(m) == best)


def _num_experts(moe_block: nn.Module) -> int | None:
    experts = moe_block._modules.get("experts")
    if experts is None:
        return None
    if isinstance(experts, (nn.ModuleList, nn.ModuleDict)):
        return len(experts)
    for owner in (experts, moe_block):
        value = getattr(owner, "num_experts", None)
        if isinstance(value, int):
            return value
    return None


_ROUTER_PARAMS = {"weight", "bias", "e_score_correction_bias"}


def _is_router(module: nn.Module, parent: nn.Module) -> bool:
    """Rule 3: a Linear (or a module with a 2-D ``weight``) next to an `experts` container that
    produces one logit per expert."""
    if "experts" not in parent._modules or module is parent._modules["experts"]:
        return False
    if isinstance(module, nn.Linear):
        out = module.out_features
    else:
        params = dict(module.named_parameters(recurse=False))
        weight = params.get("weight")
        if weight is None or weight.dim() != 2 or not set(params) <= _ROUTER_PARAMS:
            return False
        out = weight.shape[0]
    num_experts = _num_experts(parent)
    return out == 1 or (num_experts is not None and out == num_experts)


def _matches(name: str, patterns: Sequence[str]) -> bool:
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif fnmatch.fnmatchcase(name, pattern):
            return True
    return False


def _check_count(value: int, key: str, num_layers: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= num_layers:
        raise ValueError(f"{key} must be an int in [0, {num_layers}] (num_layers = {num_layers}), got {value!r}")


def plan_layer_precision(
    model: nn.Module,
    num_first_layers_in_bf16: int = 0,
    num_last_layers_in_bf16: int = 0,
    ignore_patterns: Sequence[str] = (),
) -> LayerPrecisionPlan:
    """Decide which Linear modules of `model` run in FP8 (rules in the module docstring).

    Args:
        model: an HF-style causal LM (e.g. `model.layers[i].self_attn.q_proj`, `lm_head`).
        num_first_layers_in_bf16: keep decoder layers [0, num_first) high precision.
        num_last_layers_in_bf16: keep decoder layers [num_layers - num_last, num_layers)
            high precision.
        ignore_patterns: extra user ignores, fnmatch patterns or "re:<regex>" on HF names.

    Returns:
        LayerPrecisionPlan (lists in model.named_modules() order).

    Raises:
        ValueError: a count is negative / not an int, num_first + num_last exceeds
            num_layers (the message names the key and the valid range), or the plan
            would split the shards of a vLLM fused layer (q/k/v, gate/up, experts)
            between FP8 and high precision, which vLLM rejects at load time.
    """
    if isinstance(ignore_patterns, str):
        ignore_patterns = [ignore_patterns]
    stack_name, stack = find_decoder_layers(model)
    num_layers = len(stack) if stack is not None else 0
    _check_count(num_first_layers_in_bf16, "num_first_layers_in_bf16", num_layers)
    _check_count(num_last_layers_in_bf16, "num_last_layers_in_bf16", num_layers)
    if num_first_layers_in_bf16 + num_last_layers_in_bf16 > num_layers:
        raise ValueError(
            f"num_first_layers_in_bf16 + num_last_layers_in_bf16 = "
            f"{num_first_layers_in_bf16} + {num_last_layers_in_bf16} exceeds num_layers = {num_layers}; "
            f"valid range: 0 <= num_first_layers_in_bf16 + num_last_layers_in_bf16 <= {num_layers}"
        )
    fp8_lo, fp8_hi = num_first_layers_in_bf16, num_layers - num_last_layers_in_bf16

    modules = dict(model.named_modules())
    stack_prefix = stack_name + "." if stack_name else ""
    fp8, high, routers = [], [], []
    for name, module in modules.items():
        if not name:
            continue
        parent = modules[name.rpartition(".")[0]] if "." in name else model
        if not isinstance(module, LINEAR_TYPES) and not _is_router(module, parent):
            continue
        layer_index = None
        if stack is not None and name.startswith(stack_prefix):
            head = name[len(stack_prefix) :].split(".", 1)[0]
            layer_index = int(head) if head.isdigit() else None
        is_router = _is_router(module, parent)
        if is_router:
            routers.append(name)
        eligible = (
            layer_index is not None
            and fp8_lo <= layer_index < fp8_hi
            and not is_router
            and not _matches(name, ignore_patterns)
        )
        (fp8 if eligible else high).append(name)

    ignored = _vllm_ignored_layers(modules, fp8, high)
    return LayerPrecisionPlan(
        fp8_modules=fp8,
        high_precision_modules=high,
        vllm_ignored_layers=ignored,
        num_layers=num_layers,
        decoder_layers_name=stack_name,
        router_modules=routers,
    )


def _vllm_ignored_layers(modules: dict[str, nn.Module], fp8: list[str], high: list[str]) -> list[str]:
    """Build vLLM `ignored_layers`; raise if a fused group mixes precisions."""
    fp8_set, high_set = set(fp8), set(high)
    ignored: list[str] = []

    # MoE expert containers (children registered as `experts` next to a router):
    # vLLM fuses all experts of a block into one FusedMoE named `<block>.experts`.
    expert_containers = [
        f"{name}.experts" if name else "experts"
        for name, m in modules.items()
        if isinstance(m._modules.get("experts"), (nn.ModuleList, nn.ModuleDict))
    ]
    for container in expert_containers:
        inside = [n for n in fp8 + high if n.startswith(container + ".")]
        # routers/gates never sit inside the container, so all of these are expert weights
        precisions = {n in high_set for n in inside}
        if len(precisions) > 1:
            raise ValueError(
                f"experts of {container} are partly FP8 and partly high precision; vLLM fuses them "
                f"into one FusedMoE layer, so all experts of a layer must share one precision"
            )
        if precisions == {True}:
            ignored.append(container)

    for name in high:
        parent, _, leaf = name.rpartition(".")
        packed = _SHARD_TO_PACKED.get(leaf)
        if packed is not None:
            shards = [f"{parent}.{s}" if parent else s for s in VLLM_PACKED_MODULES[packed]]
            present = [s for s in shards if s in fp8_set or s in high_set]
            if any(s in fp8_set for s in present):
                raise ValueError(
                    f"{name} is high precision but its vLLM fused siblings "
                    f"{[s for s in present if s in fp8_set]} are FP8; vLLM fuses {present} into "
                    f"{parent}.{packed} and requires one precision for all shards"
                )
            if len(present) == len(shards):
                ignored.append(f"{parent}.{packed}" if parent else packed)
        ignored.append(name)
    ignored.append("lm_head")
    return list(dict.fromkeys(ignored))
