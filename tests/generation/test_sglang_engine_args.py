"""CPU tests of the SGLang backend's pure parts (no SGLang needed): engine arguments, the config rules, the refit's
flattened buckets, KV-scale checks, completeness, the output conversion and the engine-side read-back."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import pytest
import torch

from nemo_fp8.config import ConfigError, load_config
from nemo_fp8.fp8 import quantize_weight_blockwise
from nemo_fp8.generation.config import GenerationConfig, VllmConfig
from nemo_fp8.generation.interfaces import SamplingParams
from nemo_fp8.generation.sglang import engine_hooks
from nemo_fp8.generation.sglang.backend import outputs_to_batch, parse_engine_state, sampling_params
from nemo_fp8.generation.sglang.config import SglangConfig
from nemo_fp8.generation.sglang.engine_args import READBACK_HOOK, SYNC_HOOK, build_engine_spec
from nemo_fp8.generation.sglang.refit import (ALIGN, FlatBucket, RefitLedger, check_kv_scale, flat_buckets,
                                              kv_scale_names, pack_flat_bucket, refit_problem, sent_kv_scale,
                                              unpack_flat_bucket)

TINY = Path(__file__).resolve().parents[2] / "examples" / "configs" / "grpo_math_tiny_fp8.yaml"
# every fused shard of 128 rows or more (q 256, k/v 128, gate/up 512): SGLang takes all of them in FP8
DENSE = dict(model_type="qwen3", hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=512, tie_word_embeddings=False)
FP8 = VllmConfig(precision="fp8")


def _qc(spec) -> dict:
    return json.loads(spec.engine_kwargs["json_model_override_args"])["quantization_config"]


def test_fp8_engine_args():
    cfg = VllmConfig(precision="fp8", num_first_layers_in_bf16=1, num_last_layers_in_bf16=1, kv_cache_dtype="fp8",
                     fp8_ignore_patterns=["*.mlp.down_proj"])
    spec = build_engine_spec(cfg, SglangConfig(mem_fraction_static=0.3, random_seed=7), DENSE, "/m",
                             max_total_sequence_length=1024)
    kw = spec.engine_kwargs
    assert kw["quantization"] == "fp8" and kw["load_format"] == "dummy" and kw["model_path"] == "/m"
    assert _qc(spec) == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                         "weight_block_size": [128, 128], "ignored_layers": spec.ignored_layers}
    ignored = set(spec.ignored_layers)
    for edge in (0, 3):  # first and last layers stay BF16, fused names and their shards alike
        assert {f"model.layers.{edge}.self_attn.qkv_proj", f"model.layers.{edge}.self_attn.q_proj",
                f"model.layers.{edge}.mlp.gate_up_proj", f"model.layers.{edge}.mlp.up_proj"} <= ignored
    assert "model.layers.1.mlp.down_proj" in ignored and "model.layers.2.mlp.down_proj" in ignored  # the pattern
    assert "model.layers.1.self_attn.q_proj" not in ignored and spec.ignored_layers[-1] == "lm_head"
    assert "model.layers.1.self_attn.q_proj" in spec.fp8_modules and "model.layers.1.mlp.down_proj" not in spec.fp8_modules
    assert kw["kv_cache_dtype"] == "fp8_e4m3" and kw["attention_backend"] == "fa3"
    assert kw["mem_fraction_static"] == 0.3 and kw["random_seed"] == 7 and kw["context_length"] == 1024
    assert kw["tp_size"] == 1 and kw["skip_tokenizer_init"] and kw["dtype"] == "bfloat16"
    assert kw["enable_memory_saver"] and not kw["enable_weights_cpu_backup"]  # colocated, weights discarded
    assert kw["fp8_gemm_runner_backend"] == "triton" and kw["sampling_backend"] == "pytorch"
    assert spec.num_layers == 4 and spec.head_dim == 64


def test_every_fused_layer_is_fp8_or_bf16_as_a_whole():
    """SGLang fuses q/k/v and gate/up and refuses shards of mixed precision (``is_layer_skipped``): every fused
    Linear's shards are all in ``ignored_layers`` or none, and exactly the non-ignored ones are FP8 in the plan."""
    spec = build_engine_spec(VllmConfig(precision="fp8", num_last_layers_in_bf16=2), SglangConfig(), DENSE)
    ignored, fp8 = set(spec.ignored_layers), set(spec.fp8_modules)
    for i in range(4):
        for fused, shards in (("self_attn.qkv_proj", "qkv"), ("mlp.gate_up_proj", ("gate", "up"))):
            names = [f"model.layers.{i}.{fused.split('.')[0]}.{s}_proj" for s in shards]
            skipped = {n in ignored for n in names}
            assert len(skipped) == 1 and skipped == {i >= 2} and (f"model.layers.{i}.{fused}" in ignored) == (i >= 2)
            assert all((n in fp8) == (i < 2) for n in names)


def test_kv_dtype_memory_seed_context_and_colocation_mapping():
    auto = build_engine_spec(FP8, SglangConfig(context_length=512, cpu_weight_backup=True), DENSE,
                             max_total_sequence_length=2048).engine_kwargs
    assert auto["kv_cache_dtype"] == "auto" and auto["context_length"] == 512
    assert auto["enable_memory_saver"] and auto["enable_weights_cpu_backup"]
    own = build_engine_spec(VllmConfig(precision="fp8", use_deep_gemm=True), SglangConfig(cpu_weight_backup=True),
                            DENSE, colocated=False, extra={"max_total_tokens": 4096}).engine_kwargs
    assert not own["enable_memory_saver"] and not own["enable_weights_cpu_backup"]  # GPUs of its own: no release
    assert own["fp8_gemm_runner_backend"] == "deep_gemm" and own["max_total_tokens"] == 4096
    bf16 = build_engine_spec(VllmConfig(), SglangConfig(disable_cuda_graph=True, disable_radix_cache=True,
                                                        max_running_requests=32), DENSE)
    assert bf16.fp8_modules == [] and bf16.ignored_layers == [] and bf16.refit_plan.fp8_modules == set()
    assert not {"quantization", "json_model_override_args", "fp8_gemm_runner_backend"} & set(bf16.engine_kwargs)
    assert bf16.engine_kwargs["disable_cuda_graph"] and bf16.engine_kwargs["disable_radix_cache"]
    assert bf16.engine_kwargs["max_running_requests"] == 32


def test_the_engine_hooks_resolve_as_sglang_imports_them():
    """``custom_weight_loader`` entries are ``module.function`` paths SGLang imports in its scheduler process
    (``dynamic_import``): both must resolve to this project's functions."""
    kw = build_engine_spec(FP8, SglangConfig(), DENSE).engine_kwargs
    assert kw["custom_weight_loader"] == [SYNC_HOOK, READBACK_HOOK]
    for path in kw["custom_weight_loader"]:
        module, _, fn = path.rpartition(".")
        assert callable(getattr(importlib.import_module(module), fn))
    assert importlib.import_module(SYNC_HOOK.rpartition(".")[0]) is engine_hooks


def test_engine_spec_refusals_name_their_keys(monkeypatch):
    with pytest.raises(ValueError, match=r"k_proj has 64 output rows"):  # 2 KV heads x 32: half a block
        build_engine_spec(FP8, SglangConfig(), dict(DENSE, head_dim=32, num_attention_heads=8))
    # the same model keeps those layers BF16 and runs
    build_engine_spec(VllmConfig(precision="fp8", fp8_ignore_patterns=["*.self_attn.*"]), SglangConfig(),
                      dict(DENSE, head_dim=32, num_attention_heads=8))
    with pytest.raises(ValueError, match=r"head_dim 512: SGLang's FA3 applies the KV scales only up to 256"):
        build_engine_spec(VllmConfig(precision="fp8", kv_cache_dtype="fp8"), SglangConfig(),
                          dict(DENSE, head_dim=512, num_attention_heads=1, num_key_value_heads=1))
    monkeypatch.setenv("SGLANG_FP8_IGNORED_LAYERS", "model.layers.1.mlp.down_proj")
    with pytest.raises(ValueError, match="SGLANG_FP8_IGNORED_LAYERS='model.layers.1.mlp.down_proj' is set"):
        build_engine_spec(FP8, SglangConfig(), DENSE)


def _load_error(*overrides) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["policy.generation.backend=sglang", *overrides])
    return str(e.value)


def test_config_errors_name_the_key_and_the_valid_values():
    cfg = load_config(TINY, ["policy.generation.backend=sglang", "policy.generation.vllm_cfg.kv_cache_dtype=fp8"])
    assert cfg.policy.generation.sglang_cfg == SglangConfig() and cfg.policy.generation.sleep_discards_weights
    msg = _load_error("policy.generation.sglang_cfg.tp_size=2", "policy.generation.vllm_cfg.kv_cache_dtype=fp8",
                      "policy.generation.sglang_cfg.attention_backend=flashinfer",
                      "policy.generation.vllm_cfg.gpu_memory_utilization=0.5",
                      "policy.generation.vllm_cfg.enforce_eager=true",
                      "policy.generation.vllm_cfg.pow2_activation_scaling_factors=true")
    assert "policy.generation.sglang_cfg.tp_size: 2 is not supported (valid: 1)" in msg
    assert "policy.generation.sglang_cfg.attention_backend: 'flashinfer' reads the FP8 KV scales" in msg
    assert "valid with vllm_cfg.kv_cache_dtype 'fp8': 'fa3'" in msg
    assert ("policy.generation.vllm_cfg.gpu_memory_utilization: 0.5 is a vLLM engine setting, unused with backend "
            "'sglang' (set sglang_cfg.mem_fraction_static; valid: its default 0.6)") in msg
    assert "policy.generation.vllm_cfg.enforce_eager: True" in msg and "set sglang_cfg.disable_cuda_graph" in msg
    assert "policy.generation.vllm_cfg.pow2_activation_scaling_factors: true cannot hold in SGLang 0.5.17" in msg
    bf16_kv = _load_error("policy.generation.vllm_cfg.precision=bfloat16", "policy.generation.vllm_cfg.kv_cache_dtype=fp8")
    assert "policy.generation.vllm_cfg.kv_cache_dtype: 'fp8' needs policy.generation.vllm_cfg.precision='fp8'" in bf16_kv
    # BF16 KV on FlashInfer is fine: its load-time scales are unused
    load_config(TINY, ["policy.generation.backend=sglang", "policy.generation.sglang_cfg.attention_backend=flashinfer"])
    # the same keys are vLLM's own under backend: vllm, and sglang_cfg is inert there
    load_config(TINY, ["policy.generation.backend=vllm", "policy.generation.vllm_cfg.gpu_memory_utilization=0.5"])


def test_generation_config_properties_for_sglang():
    g = GenerationConfig(backend="sglang", sglang_cfg=SglangConfig(mem_fraction_static=0.4))
    assert g.engine_gpus == 1 and g.engine_memory_fraction == 0.4 and g.sleep_discards_weights
    assert not GenerationConfig(backend="sglang", sglang_cfg=SglangConfig(cpu_weight_backup=True)).sleep_discards_weights
    assert not GenerationConfig(backend="sglang", colocated={"enabled": False}).sleep_discards_weights
    assert GenerationConfig(backend="vllm", vllm_cfg=VllmConfig(gpu_memory_utilization=0.3)).engine_memory_fraction == 0.3
    assert GenerationConfig().engine_memory_fraction == 0.0 and not GenerationConfig().sleep_discards_weights


# --------------------------------------------------------------------------- the refit's data
def _mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 384, generator=g, dtype=torch.float32).to(torch.bfloat16)
    q, s = quantize_weight_blockwise(w, scale_mode="fp32")
    odd = torch.randn(3, 5, generator=g).to(torch.float8_e4m3fn)  # 15 bytes: the next tensor would be misaligned
    return [("a.weight", q), ("odd", odd), ("a.weight_scale_inv", s), ("norm.weight", torch.randn(7).to(torch.bfloat16)),
            ("model.layers.0.self_attn.k_scale", torch.tensor(0.125)), ("ids", torch.arange(5, dtype=torch.int64))]


def test_flat_bucket_round_trip_is_bit_exact_and_aligned():
    items = _mixed_tensors()
    bucket = pack_flat_bucket(items)
    assert [e.name for e in bucket.entries] == [n for n, _ in items]
    for e, (_, t) in zip(bucket.entries, items):
        assert e.start_idx % ALIGN == 0 and e.numel == e.end_idx - e.start_idx == t.numel() * t.element_size()
        assert e.shape == tuple(t.shape) and e.dtype == t.dtype
    assert bucket.nbytes % ALIGN == 0 and bucket.buffer.dtype == torch.uint8
    back = unpack_flat_bucket(bucket)
    for (n, t), (m, u) in zip(items, back):
        assert n == m and u.dtype == t.dtype and u.shape == t.shape
        assert torch.equal(u.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
    assert back[4][1].dim() == 0 and float(back[4][1]) == 0.125  # a 0-dim scale comes back 0-dim


def test_flat_buckets_split_by_size_in_order():
    items = _mixed_tensors()
    sizes = [-(-t.numel() * t.element_size() // ALIGN) * ALIGN for _, t in items]
    buckets = list(flat_buckets(iter(items), bucket_bytes=sizes[0] // 2))  # smaller than the first tensor
    assert [e.name for b in buckets for e in b.entries] == [n for n, _ in items]
    assert [e.name for e in buckets[0].entries] == ["a.weight"]  # larger than a bucket: alone
    assert all(b.nbytes <= sizes[0] // 2 or len(b.entries) == 1 for b in buckets)
    assert len(list(flat_buckets(iter(items), bucket_bytes=1 << 30))) == 1
    with pytest.raises(ValueError, match="bucket_bytes must be > 0"):
        list(flat_buckets(iter(items), 0))


def test_flat_bucket_errors():
    with pytest.raises(ValueError, match="empty bucket"):
        pack_flat_bucket([])
    bucket = pack_flat_bucket(_mixed_tensors()[:2])
    bad = FlatBucket(bucket.buffer, [bucket.entries[0].__class__(**{**bucket.entries[0].__dict__, "end_idx": 1 << 40})])
    with pytest.raises(ValueError, match="a.weight: bytes"):
        unpack_flat_bucket(bad)


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf])
def test_kv_scales_must_be_finite_and_positive(value):
    with pytest.raises(ValueError, match=r"KV scale model.layers.3.self_attn.v_scale = .*finite and > 0"):
        check_kv_scale("model.layers.3.self_attn.v_scale", torch.tensor(value))


def test_kv_scale_shape_and_which_are_sent():
    check_kv_scale("model.layers.0.self_attn.k_scale", torch.tensor([0.5]))
    with pytest.raises(ValueError, match="one value per layer"):
        check_kv_scale("model.layers.0.self_attn.k_scale", torch.ones(2))
    assert sent_kv_scale("model.layers.0.self_attn.k_scale") and sent_kv_scale("model.layers.9.self_attn.v_scale")
    assert not sent_kv_scale("model.layers.0.self_attn.q_scale") and not sent_kv_scale("model.layers.0.mlp.up_proj.weight")
    assert kv_scale_names(2) == {f"model.layers.{i}.self_attn.{k}_scale" for i in (0, 1) for k in "kv"}


def test_refit_completeness():
    plan = build_engine_spec(FP8, SglangConfig(), DENSE).refit_plan
    assert "model.layers.0.self_attn.q_proj.weight" in plan.expected and "lm_head.weight" in plan.expected
    full = RefitLedger(3, weights=set(plan.expected))
    assert refit_problem(plan.expected, full, 4, kv_fp8=False, require_kv_scales=True) is None
    gone = RefitLedger(3, weights=set(plan.expected) - {"model.layers.2.mlp.up_proj.weight"})
    assert "refit to version 3: 1 weights did not arrive (e.g. ['model.layers.2.mlp.up_proj.weight'])" in \
        refit_problem(plan.expected, gone, 4, False, True)
    no_kv = refit_problem(plan.expected, full, 4, kv_fp8=True, require_kv_scales=True)
    assert "kv_cache_dtype='fp8' but no KV scales" in no_kv
    assert refit_problem(plan.expected, full, 4, kv_fp8=True, require_kv_scales=False) is None  # the initial load
    some = RefitLedger(3, weights=set(plan.expected), kv_scales=kv_scale_names(4) - {"model.layers.1.self_attn.v_scale"})
    assert "KV scales for 7 of 8 (layer, k/v) pairs (missing e.g. ['model.layers.1.self_attn.v_scale']" in \
        refit_problem(plan.expected, some, 4, True, True)
    every = RefitLedger(3, weights=set(plan.expected), kv_scales=kv_scale_names(4))
    assert refit_problem(plan.expected, every, 4, True, True) is None


# --------------------------------------------------------------------------- requests and outputs
def test_sampling_params():
    s = SamplingParams(max_new_tokens=16, temperature=0.7, stop_token_ids=(5,))
    p = sampling_params([[3, 4], [3] * 60], s, [16, 16], [11, 12], context_length=64, eos_token_id=1)
    assert p[0] == {"max_new_tokens": 16, "temperature": 0.7, "top_p": 1.0, "top_k": -1, "stop_token_ids": [1, 5],
                    "sampling_seed": 11}
    assert p[1]["max_new_tokens"] == 4  # what the context leaves
    assert sampling_params([[3]], SamplingParams(8, greedy=True), [8], [0], 64, 1)[0]["temperature"] == 0.0
    with pytest.raises(ValueError, match="prompt 0 has 64 tokens; valid: 1 to 63"):
        sampling_params([[3] * 64], s, [16], [0], 64, 1)


def _out(ids, finish="stop", version="4", logprobs=None):
    lps = logprobs if logprobs is not None else [(-0.5 * (j + 1), t, None) for j, t in enumerate(ids)]
    return {"output_ids": ids, "meta_info": {"output_token_logprobs": lps, "finish_reason": {"type": finish},
                                             "weight_version": version}}


def test_outputs_to_batch():
    out = outputs_to_batch([[7, 8, 9], [7]], [_out([10, 1]), _out([11, 12, 13], finish="length")], 0, "4")
    assert out.token_ids.tolist() == [[7, 8, 9, 10, 1], [7, 11, 12, 13, 0]]
    assert out.prompt_lengths.tolist() == [3, 1] and out.response_lengths.tolist() == [2, 3]
    assert out.truncated.tolist() == [False, True]
    assert out.generation_logprobs[0, 3:5].tolist() == [-0.5, -1.0] and out.generation_logprobs[0, :3].eq(0).all()
    assert out.generation_logprobs[1, 1:4].tolist() == [-0.5, -1.0, -1.5] and out.generation_logprobs[1, 4] == 0
    with pytest.raises(RuntimeError, match="request 1 was served by weights of version '3'"):
        outputs_to_batch([[7], [7]], [_out([1]), _out([1], version="3")], 0, "4")
    with pytest.raises(RuntimeError, match="SGLang aborted request 0"):
        outputs_to_batch([[7]], [_out([1], finish="abort")], 0, "4")
    with pytest.raises(RuntimeError, match="request 0: 1 log-probs for 2 tokens"):
        outputs_to_batch([[7]], [_out([2, 1], logprobs=[(-1.0, 2, None)])], 0, "4")
    with pytest.raises(RuntimeError, match="log-probs for 1 tokens, or for other tokens"):
        outputs_to_batch([[7]], [_out([2], logprobs=[(-1.0, 3, None)])], 0, "4")


class _Attn(torch.nn.Module):
    def __init__(self, layer, k, v, k_float=None):
        super().__init__()
        self.layer_id = layer
        self.k_scale = torch.nn.Parameter(torch.tensor(k), requires_grad=False)
        self.v_scale = torch.nn.Parameter(torch.tensor(v), requires_grad=False)
        self.k_scale_float, self.v_scale_float = k_float, k_float


def test_engine_state_read_back(monkeypatch):
    """``engine_hooks.read_engine_state`` (what runs in the engine's process) into the read-back tensors, parsed
    by ``parse_engine_state``: the live tensor scales, SGLang's load-time floats, parameter addresses, memory."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)  # the hook's device sync: nothing to wait for here
    model = torch.nn.ModuleList([_Attn(0, 0.25, 0.5, k_float=1.0), _Attn(2, 0.125, 2.0)])
    kv = torch.full((3, 4), math.nan)
    ptrs = torch.zeros(8, dtype=torch.int64)
    engine_hooks.read_engine_state(model, [(engine_hooks.KV_SCALES, kv), (engine_hooks.PARAM_PTRS, ptrs)])
    state = parse_engine_state(kv, ptrs, torch.tensor([1, 2, 3]))
    assert state["kv_scales"] == {0: {"k": 0.25, "v": 0.5, "k_float": 1.0, "v_float": 1.0},
                                  2: {"k": 0.125, "v": 2.0, "k_float": None, "v_float": None}}
    assert state["param_ptrs"] == [p.data_ptr() for p in model.parameters()]
    assert state["memory"] == {"allocated": 1, "reserved": 2, "free": 3}
    small = torch.zeros(3, dtype=torch.int64)
    engine_hooks.read_engine_state(model, [(engine_hooks.PARAM_PTRS, small)])
    with pytest.raises(RuntimeError, match="the engine has 4 parameters, the read-back held 2"):
        parse_engine_state(kv, small, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(KeyError, match="no state named 'x'"):
        engine_hooks.read_engine_state(model, [("x", kv)])
    with pytest.raises(ValueError, match="synchronize loads no weights"):
        engine_hooks.synchronize(model, [("w", kv)])
