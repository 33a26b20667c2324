"""The refit in vLLM's kernel format (``vllm_cfg.refit_format: kernel``, ``KernelLayout``; CPU, no vLLM): the
converted HF stream stacked into the engine's own parameters, checked against them, and the config's refusals."""

from __future__ import annotations

import pytest
import torch

from nemo_fp8.config import ConfigError, load_config
from nemo_fp8.fp8 import quantize_weight_blockwise
from nemo_fp8.generation.vllm.kernel_format import KernelLayout
from nemo_fp8.generation.vllm.refit import RefitPlan, meta_model

# a Qwen3 whose fused parts fill whole 128-row blocks: q 2 x 128 rows, k and v 128, gate and up 512
QWEN3 = {"model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 128, "num_hidden_layers": 2, "vocab_size": 512,
         "tie_word_embeddings": False}
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def _model_and_plan(cfg=QWEN3):
    model = meta_model(cfg)
    fp8 = {n[: -len(".weight")] for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2}
    return model, RefitPlan(fp8)


def _engine_params(model, plan) -> dict[str, tuple[str, list[int]]]:
    """The parameters vLLM's Qwen3 holds for ``model`` (FP8 linears with their block scales): fused q/k/v and
    gate/up stacked along dim 0, everything else under its HF name."""
    out: dict[str, tuple[str, list[int]]] = {}
    for name, p in model.state_dict().items():
        for n, dtype, shape in plan.converted_meta(name, tuple(p.shape), p.dtype):
            prefix, _, rest = n.rpartition(".self_attn.") if ".self_attn." in n else n.rpartition(".mlp.")
            module, _, suffix = rest.partition(".")
            fused = next((f for f, parts in PACKED.items() if module in parts), None)
            if fused is None:
                out[n] = (dtype, list(shape))
                continue
            key = f"{prefix}.{'self_attn' if fused == 'qkv_proj' else 'mlp'}.{fused}.{suffix}"
            rows = out.get(key, (dtype, [0, *shape[1:]]))[1][0]
            out[key] = (dtype, [rows + shape[0], *shape[1:]])
    return out


def _converted(model, plan, seed=0):
    g = torch.Generator().manual_seed(seed)
    state = {n: torch.randn(p.shape, generator=g).to(torch.bfloat16) for n, p in model.state_dict().items()}
    return state, list(plan.convert_all(state.items()))


def test_the_stream_stacks_into_the_engines_parameters_bit_for_bit():
    """q/k/v and gate/up quantized apart and stacked are the fused weight's blockwise quantization (whole blocks),
    scales included; every other tensor passes as it is; the result covers every engine parameter once."""
    model, plan = _model_and_plan()
    layout = KernelLayout(_engine_params(model, plan), PACKED)
    state, converted = _converted(model, plan)
    layout.check({n: tuple(t.shape) for n, t in converted})
    fused = dict(layout.fuse(converted))
    assert sorted(fused) == sorted(layout.params)
    for layer in range(2):
        p = f"model.layers.{layer}.self_attn."
        q, s = quantize_weight_blockwise(torch.cat([state[f"{p}{x}_proj.weight"] for x in "qkv"]), (128, 128))
        assert torch.equal(fused[f"{p}qkv_proj.weight"].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(fused[f"{p}qkv_proj.weight_scale_inv"], s)
        m = f"model.layers.{layer}.mlp."
        q, s = quantize_weight_blockwise(torch.cat([state[f"{m}{x}_proj.weight"] for x in ("gate", "up")]), (128, 128))
        assert torch.equal(fused[f"{m}gate_up_proj.weight"].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(fused[f"{m}gate_up_proj.weight_scale_inv"], s)
    assert torch.equal(fused["model.embed_tokens.weight"], state["model.embed_tokens.weight"])
    # the parts in any order: k before q
    order = sorted(converted, key=lambda it: ".k_proj." not in it[0])
    again = dict(layout.fuse(order))
    assert all(torch.equal(again[n].view(torch.uint8), t.view(torch.uint8)) for n, t in fused.items())


def test_the_plan_knows_the_shapes_a_whole_refit_sends():
    """``build_refit_plan`` records the model's tensors, so ``converted_shapes`` (what the engine checks its layout
    against at start-up) are the shapes ``convert_all`` yields for the whole state dict."""
    from nemo_fp8.generation.config import VllmConfig
    from nemo_fp8.generation.vllm.refit import build_refit_plan

    plan, _ = build_refit_plan(VllmConfig(precision="fp8", num_last_layers_in_bf16=1), QWEN3)
    model = meta_model(QWEN3)
    _, converted = _converted(model, plan)
    assert plan.converted_shapes() == {n: tuple(t.shape) for n, t in converted}
    assert plan.converted_shapes()["model.layers.0.self_attn.q_proj.weight_scale_inv"] == (2, 2)
    assert "model.layers.1.self_attn.q_proj.weight_scale_inv" not in plan.converted_shapes()  # the BF16 last layer


def test_a_stream_that_does_not_fit_the_engine_is_refused():
    model, plan = _model_and_plan()
    params = _engine_params(model, plan)
    layout = KernelLayout(params, PACKED)
    _, converted = _converted(model, plan)
    with pytest.raises(KeyError, match="no parameter 'model.layers.0.self_attn.qz_proj.weight'"):
        list(layout.fuse([("model.layers.0.self_attn.qz_proj.weight", converted[0][1])]))
    q = next(t for n, t in converted if n == "model.layers.0.self_attn.q_proj.weight")
    with pytest.raises(ValueError, match="part 0 of model.layers.0.self_attn.qkv_proj.weight sent twice"):
        list(layout.fuse([("model.layers.0.self_attn.q_proj.weight", q)] * 2))
    with pytest.raises(ValueError, match="parts of \\['model.layers.0.self_attn.qkv_proj.weight'\\] missing"):
        list(layout.fuse([("model.layers.0.self_attn.q_proj.weight", q)]))
    with pytest.raises(ValueError, match="model.embed_tokens.weight arrives as float32\\[512, 256\\], the engine "
                                         "holds bfloat16\\[512, 256\\]"):
        list(layout.fuse([("model.embed_tokens.weight", torch.zeros(512, 256))]))
    shapes = {n: tuple(t.shape) for n, t in converted}
    with pytest.raises(ValueError, match="no tensor of the refit reaches the engine's \\['lm_head.weight'\\]"):
        layout.check(shapes, skip={"lm_head.weight"})
    short = dict(params, **{"model.norm.weight": ("bfloat16", [255])})
    with pytest.raises(ValueError, match="model.norm.weight stacks to \\[256\\], the engine's is \\[255\\]"):
        KernelLayout(short, PACKED).check(shapes)
    # k and v of 64 rows: their scales would not stack into the fused weight's
    small = dict(QWEN3, head_dim=64, num_attention_heads=4)
    model, plan = _model_and_plan(small)
    _, converted = _converted(model, plan)
    with pytest.raises(ValueError, match="not multiples of the 128-row block"):
        KernelLayout(_engine_params(model, plan), PACKED).check({n: tuple(t.shape) for n, t in converted})


def test_the_config_takes_the_kernel_format_only_where_it_runs():
    fp8 = "examples/configs/grpo_math_8B_megatron_fp8_1gpu.yaml"
    cfg = load_config(fp8, ["policy.generation.vllm_cfg.refit_format=kernel",
                            "policy.generation.vllm_cfg.use_deep_gemm=false"])
    assert cfg.policy.generation.vllm_cfg.refit_format == "kernel"
    assert load_config("examples/configs/grpo_math_8B_megatron_1gpu.yaml",
                       ["policy.generation.vllm_cfg.refit_format=kernel"]).policy.generation.vllm_cfg.refit_format \
        == "kernel"  # BF16: no kernel to check
    for extra, says in [([], "needs use_deep_gemm: false"),
                        (["policy.generation.vllm_cfg.use_deep_gemm=false",
                          "policy.generation.vllm_cfg.kv_cache_dtype=fp8",
                          "policy.megatron_cfg.train_expandable_segments=false"], "kv_cache_dtype: 'auto'"),
                        (["policy.generation.vllm_cfg.use_deep_gemm=false", "policy.weight_sync.method=nccl",
                          "policy.megatron_cfg.train_expandable_segments=false",
                          "policy.generation.colocated.enabled=false"], "refit by CUDA IPC or from its own process")]:
        with pytest.raises(ConfigError, match=says):
            load_config(fp8, ["policy.generation.vllm_cfg.refit_format=kernel", *extra])


def test_frozen_engine_parameters_take_vllms_direct_copy_in_place(monkeypatch):
    """vLLM 0.22's kernel-format load (``load_weights_direct``) is ``model.get_parameter(name).copy_(weight)``
    outside ``torch.no_grad``: autograd refuses it on a leaf that requires grad (an ``nn.Parameter`` made with the
    default, as vLLM's norm weights are). ``nemo_fp8_freeze_params`` turns that off; the copy then lands in place."""
    import importlib
    import sys
    import types

    from nemo_fp8.generation.vllm import patches

    monkeypatch.setattr(patches, "apply_patches", lambda fp8=True: None)
    monkeypatch.delitem(sys.modules, "nemo_fp8.generation.vllm.worker_extension", raising=False)
    ext_cls = importlib.import_module("nemo_fp8.generation.vllm.worker_extension").Fp8WorkerExtension
    model = torch.nn.Module()
    model.norm = torch.nn.Module()
    model.norm.weight = torch.nn.Parameter(torch.ones(8))  # requires grad, as vLLM's RMSNorm weight
    model.proj = torch.nn.Linear(8, 8, bias=False)
    model.proj.weight.requires_grad_(False)  # as vLLM's ModelWeightParameter
    new = torch.full((8,), 2.0)

    def load_weights_direct():  # vLLM 0.22 gpu_worker.update_weights, is_checkpoint_format=False
        model.get_parameter("norm.weight").copy_(new)

    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        load_weights_direct()
    ext = ext_cls()
    ext.model_runner = types.SimpleNamespace(model=model)
    ptr = model.norm.weight.data_ptr()
    assert ext.nemo_fp8_freeze_params() == 1 and ext.nemo_fp8_freeze_params() == 0
    load_weights_direct()
    assert model.norm.weight.data_ptr() == ptr and torch.equal(model.norm.weight, new)
