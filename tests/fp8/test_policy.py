"""Layer-precision policy on small transformers-free toy models."""

from types import SimpleNamespace

import pytest
import torch.nn as nn

from nemo_fp8.fp8 import (
    VLLM_PACKED_MODULES,
    Fp8BlockLinear,
    Fp8TrainingLinear,
    Fp8TrainingRecipe,
    find_decoder_layers,
    plan_layer_precision,
)

H, I = 16, 32


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(H, H)
        self.k_proj = nn.Linear(H, H // 2)
        self.v_proj = nn.Linear(H, H // 2)
        self.o_proj = nn.Linear(H, H)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)


class MoE(nn.Module):
    def __init__(self, num_experts):
        super().__init__()
        self.gate = nn.Linear(H, num_experts, bias=False)  # router
        self.experts = nn.ModuleList(MLP() for _ in range(num_experts))
        self.shared_expert = MLP()
        self.shared_expert_gate = nn.Linear(H, 1, bias=False)


class DecoderLayer(nn.Module):
    def __init__(self, num_experts=0):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(H)
        self.self_attn = Attention()
        self.post_attention_layernorm = nn.LayerNorm(H)
        self.mlp = MoE(num_experts) if num_experts else MLP()


class Backbone(nn.Module):
    def __init__(self, num_layers, num_experts):
        super().__init__()
        self.embed_tokens = nn.Embedding(100, H)
        self.layers = nn.ModuleList(DecoderLayer(num_experts) for _ in range(num_layers))
        self.norm = nn.LayerNorm(H)


class ToyCausalLM(nn.Module):
    def __init__(self, num_layers=4, num_experts=0, with_config=True):
        super().__init__()
        if with_config:
            self.config = SimpleNamespace(num_hidden_layers=num_layers)
        self.model = Backbone(num_layers, num_experts)
        self.lm_head = nn.Linear(H, 100, bias=False)


ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP_NAMES = ["gate_proj", "up_proj", "down_proj"]


def _layer_of(name):
    return int(name.split(".")[2]) if name.startswith("model.layers.") else None


def test_dense_all_fp8_by_default():
    plan = plan_layer_precision(ToyCausalLM())
    assert plan.num_layers == 4 and plan.decoder_layers_name == "model.layers"
    assert len(plan.fp8_modules) == 4 * 7
    assert plan.high_precision_modules == ["lm_head"]
    assert plan.vllm_ignored_layers == ["lm_head"]
    assert not any("embed" in n or "norm" in n for n in plan.fp8_modules + plan.high_precision_modules)


@pytest.mark.parametrize("first,last", [(1, 1), (0, 2), (3, 0), (2, 2)])
def test_first_and_last_layers_in_bf16(first, last):
    plan = plan_layer_precision(ToyCausalLM(), num_first_layers_in_bf16=first, num_last_layers_in_bf16=last)
    fp8_layers = sorted({_layer_of(n) for n in plan.fp8_modules})
    assert fp8_layers == list(range(first, 4 - last))
    assert len(plan.fp8_modules) == 7 * (4 - first - last)
    bf16_layers = [i for i in range(4) if i < first or i >= 4 - last]
    expected_high = [f"model.layers.{i}.self_attn.{p}" for i in bf16_layers for p in ATTN]
    expected_high += [f"model.layers.{i}.mlp.{p}" for i in bf16_layers for p in MLP_NAMES]
    assert sorted(plan.high_precision_modules) == sorted(expected_high + ["lm_head"])
    ignored = set(plan.vllm_ignored_layers)
    for i in range(4):
        fused = {f"model.layers.{i}.self_attn.qkv_proj", f"model.layers.{i}.mlp.gate_up_proj"}
        unfused = {f"model.layers.{i}.self_attn.{p}" for p in ATTN} | {f"model.layers.{i}.mlp.{p}" for p in MLP_NAMES}
        if i in bf16_layers:
            # vLLM fused names, plus the shard names vLLM's is_layer_skipped looks up
            assert fused | unfused <= ignored
        else:
            assert not (fused | unfused) & ignored
    assert "lm_head" in ignored
    assert set(plan.fp8_modules).isdisjoint(plan.high_precision_modules)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_first_layers_in_bf16=-1), r"num_first_layers_in_bf16.*\[0, 4\]"),
        (dict(num_last_layers_in_bf16=5), r"num_last_layers_in_bf16.*\[0, 4\]"),
        (dict(num_first_layers_in_bf16=3, num_last_layers_in_bf16=2), r"num_first_layers_in_bf16 \+ num_last_layers_in_bf16.*<= 4"),
        (dict(num_first_layers_in_bf16=1.5), r"num_first_layers_in_bf16"),
    ],
)
def test_bad_counts_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_layer_precision(ToyCausalLM(), **kwargs)


def test_moe_router_and_shared_gate_excluded_and_stack_found_despite_equal_lengths():
    # 4 experts and 4 layers: the per-layer `experts` lists have the config's length too;
    # the outermost list must be chosen.
    model = ToyCausalLM(num_layers=4, num_experts=4)
    plan = plan_layer_precision(model, num_first_layers_in_bf16=1)
    assert plan.decoder_layers_name == "model.layers"
    routers = [f"model.layers.{i}.mlp.gate" for i in range(4)]
    shared_gates = [f"model.layers.{i}.mlp.shared_expert_gate" for i in range(4)]
    assert plan.router_modules == [n for i in range(4) for n in (routers[i], shared_gates[i])]
    for name in routers + shared_gates:
        assert name in plan.high_precision_modules and name not in plan.fp8_modules
    # experts and shared expert of layers 1..3 are FP8
    assert "model.layers.2.mlp.experts.3.down_proj" in plan.fp8_modules
    assert "model.layers.2.mlp.shared_expert.up_proj" in plan.fp8_modules
    per_layer = 4 + 4 * 3 + 3  # attention + experts + shared expert
    assert len(plan.fp8_modules) == 3 * per_layer
    assert "model.layers.0.mlp.experts" in plan.vllm_ignored_layers  # vLLM FusedMoE prefix
    assert "model.layers.1.mlp.experts" not in plan.vllm_ignored_layers


def test_transformers5_moe_router_module_is_a_router():
    """Qwen3-MoE in transformers 5: fused ``experts`` (3-D parameters) and a ``Qwen3MoeTopKRouter`` gate
    (a [num_experts, hidden] ``weight``, no Linear): the gate is a high-precision router in every layer."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, vocab_size=256, num_experts=4,
                         num_experts_per_tok=2)
    model = AutoModelForCausalLM.from_config(cfg)
    assert not isinstance(model.model.layers[0].mlp.gate, nn.Linear)
    plan = plan_layer_precision(model)
    gates = [f"model.layers.{i}.mlp.gate" for i in range(2)]
    assert plan.router_modules == gates
    assert all(g in plan.high_precision_modules and g in plan.vllm_ignored_layers for g in gates)
    assert "model.layers.0.self_attn.q_proj" in plan.fp8_modules
    assert not any(n.endswith("mlp.experts") for n in plan.vllm_ignored_layers)  # fused experts stay FP8


def test_router_is_decided_by_shape_not_name():
    model = ToyCausalLM(num_layers=2, num_experts=4)
    model.model.layers[0].mlp.gate = nn.Linear(H, 3)  # not one logit per expert: not a router
    plan = plan_layer_precision(model)
    assert "model.layers.0.mlp.gate" in plan.fp8_modules
    assert "model.layers.1.mlp.gate" in plan.high_precision_modules


def test_stack_without_config_is_longest_outermost_list():
    model = ToyCausalLM(num_layers=2, num_experts=8, with_config=False)
    name, layers = find_decoder_layers(model)
    assert name == "model.layers" and len(layers) == 2
    plan = plan_layer_precision(model, num_last_layers_in_bf16=1)
    assert plan.num_layers == 2
    assert {_layer_of(n) for n in plan.fp8_modules} == {0}


def test_other_naming_schemes_work_by_type_and_index():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(H, 3 * H)
            self.c_fc = nn.Linear(H, I)
            self.ln = nn.LayerNorm(H)

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = SimpleNamespace(text_config=SimpleNamespace(num_hidden_layers=3))
            self.transformer = nn.Module()
            self.transformer.wte = nn.Embedding(10, H)
            self.transformer.h = nn.ModuleList(Block() for _ in range(3))
            self.head = nn.Linear(H, 10)

    plan = plan_layer_precision(GPT(), num_first_layers_in_bf16=1)
    assert plan.decoder_layers_name == "transformer.h"
    assert plan.fp8_modules == ["transformer.h.1.c_attn", "transformer.h.1.c_fc", "transformer.h.2.c_attn", "transformer.h.2.c_fc"]
    assert "head" in plan.high_precision_modules and "head" in plan.vllm_ignored_layers


def test_ignore_patterns_fnmatch_and_regex():
    plan = plan_layer_precision(ToyCausalLM(), ignore_patterns=["model.layers.*.mlp.down_proj"])
    assert not any(n.endswith("down_proj") for n in plan.fp8_modules)
    assert "model.layers.2.mlp.down_proj" in plan.vllm_ignored_layers
    assert "model.layers.2.mlp.gate_up_proj" not in plan.vllm_ignored_layers
    plan = plan_layer_precision(ToyCausalLM(), ignore_patterns=[r"re:model\.layers\.[13]\.self_attn\.o_proj"])
    assert "model.layers.1.self_attn.o_proj" in plan.high_precision_modules
    assert "model.layers.2.self_attn.o_proj" in plan.fp8_modules
    # a whole fused group may be ignored
    plan = plan_layer_precision(ToyCausalLM(), ignore_patterns=["model.layers.2.self_attn.[qkv]_proj"])
    assert "model.layers.2.self_attn.qkv_proj" in plan.vllm_ignored_layers


def test_splitting_a_fused_group_raises():
    with pytest.raises(ValueError, match="qkv_proj"):
        plan_layer_precision(ToyCausalLM(), ignore_patterns=["model.layers.1.self_attn.q_proj"])
    with pytest.raises(ValueError, match="experts"):
        plan_layer_precision(ToyCausalLM(num_experts=2), ignore_patterns=["model.layers.0.mlp.experts.1.*"])


def test_fp8_module_types_are_recognised():
    model = ToyCausalLM()
    attn = model.model.layers[1].self_attn
    attn.o_proj = Fp8BlockLinear.from_linear(attn.o_proj)
    attn.q_proj = Fp8TrainingLinear.from_linear(attn.q_proj, Fp8TrainingRecipe())
    plan = plan_layer_precision(model, num_first_layers_in_bf16=2)
    assert "model.layers.1.self_attn.o_proj" in plan.high_precision_modules
    plan = plan_layer_precision(model)
    assert "model.layers.1.self_attn.o_proj" in plan.fp8_modules
    assert "model.layers.1.self_attn.q_proj" in plan.fp8_modules


def test_packed_modules_constant():
    assert VLLM_PACKED_MODULES == {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
