"""CPU tests of the vLLM backend's pure logic (no vLLM needed): engine args, refit names, patch table."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from nemo_fp8.generation.config import VllmConfig
from nemo_fp8.generation.vllm.engine_args import (FP8_WORKER_EXTENSION_CLS, WORKER_EXTENSION_CLS, build_engine_spec,
                                                  engine_env, live_activation_scales)
from nemo_fp8.generation.vllm.patches import ENGINE_SETTINGS_KEY, PATCHES, check_patch_table, engine_settings
from nemo_fp8.generation.vllm.refit import build_refit_plan, merge_ipc_handles

DENSE = dict(model_type="qwen3", hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=512, tie_word_embeddings=False)
MOE = dict(model_type="qwen3_moe", hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=4,
           num_experts_per_tok=2, vocab_size=512, tie_word_embeddings=False)


def test_fp8_engine_args():
    cfg = VllmConfig(precision="fp8", num_first_layers_in_bf16=1, kv_cache_dtype="fp8", max_model_len=1024)
    spec = build_engine_spec(cfg, DENSE, "/m")
    kw = spec.engine_kwargs
    qc = kw["hf_overrides"]["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128] and qc["activation_scheme"] == "dynamic"
    assert "model.layers.0.self_attn.qkv_proj" in qc["ignored_layers"] and "model.layers.0.mlp.down_proj" in qc["ignored_layers"]
    assert not any(".layers.1." in n for n in qc["ignored_layers"]) and qc["ignored_layers"][-1] == "lm_head"
    assert kw["load_format"] == "dummy" and kw["logprobs_mode"] == "processed_logprobs"
    assert kw["kv_cache_dtype"] == "fp8" and kw["worker_extension_cls"] == FP8_WORKER_EXTENSION_CLS
    assert kw["weight_transfer_config"] == {"backend": "ipc"} and kw["max_model_len"] == 1024 and kw["model"] == "/m"
    assert "model.layers.1.self_attn.q_proj" in spec.fp8_modules and "model.layers.0.self_attn.q_proj" not in spec.fp8_modules
    assert "kv_cache_memory_bytes" not in kw  # vLLM sizes the KV cache from gpu_memory_utilization
    sized = build_engine_spec(VllmConfig(kv_cache_memory_bytes=2**30), DENSE).engine_kwargs
    assert sized["kv_cache_memory_bytes"] == 2**30


def test_tensor_parallel_engine_runs_vllms_multiprocessing_executor():
    """n > 1: vLLM's worker processes inside the engine actor's GPUs ("mp"); inside a Ray placement group vLLM
    0.22 would otherwise pick its Ray executor. One GPU: vLLM's own choice (its in-process executor), as before."""
    one = build_engine_spec(VllmConfig(precision="fp8"), DENSE).engine_kwargs
    assert one["tensor_parallel_size"] == 1 and "distributed_executor_backend" not in one
    for tp in (2, 4, 8):
        kw = build_engine_spec(VllmConfig(precision="fp8", tensor_parallel_size=tp), DENSE).engine_kwargs
        assert kw["tensor_parallel_size"] == tp and kw["distributed_executor_backend"] == "mp"
    with pytest.raises(ValueError, match="tensor_parallel_size: 3; valid: 1, 2, 4, 8"):
        build_engine_spec(VllmConfig(tensor_parallel_size=3), DENSE)


def test_ipc_handles_of_every_gpu_are_merged_per_tensor():
    """A tensor-parallel engine's refit: each tensor's copies on n GPUs become one ``{uuid: args}`` dict (vLLM
    0.22's non-packed ``ipc_handles``), so every worker finds the copy on its own GPU."""
    gpu0 = [{"GPU-a": ("w0", 0)}, {"GPU-a": ("s0", 0)}]
    gpu1 = [{"GPU-b": ("w1", 1)}, {"GPU-b": ("s1", 1)}]
    assert merge_ipc_handles([gpu0, gpu1]) == [{"GPU-a": ("w0", 0), "GPU-b": ("w1", 1)},
                                               {"GPU-a": ("s0", 0), "GPU-b": ("s1", 1)}]
    assert merge_ipc_handles([gpu0]) == gpu0 and merge_ipc_handles([[], []]) == []
    with pytest.raises(ValueError, match=r"different numbers of tensors \[2, 1\]"):
        merge_ipc_handles([gpu0, gpu1[:1]])
    with pytest.raises(ValueError, match="GPU GPU-a appears twice for tensor 0"):
        merge_ipc_handles([gpu0, gpu0])
    with pytest.raises(ValueError, match="no devices"):
        merge_ipc_handles([])


def _stub_vllm_ipc(monkeypatch, uuids: list[str]) -> None:
    """Stand-ins for vLLM 0.22's ``IPCWeightTransferUpdateInfo`` (its fields) and for the GPU UUIDs, asked once per
    device in the order of ``uuids``, so ``send_weights_ipc`` runs on CPU tensors."""
    import sys
    import types
    from dataclasses import dataclass

    @dataclass
    class UpdateInfo:  # the fields of vLLM 0.22's IPCWeightTransferUpdateInfo
        names: list
        dtype_names: list
        shapes: list
        ipc_handles: object
        tensor_sizes: object = None
        packed: bool = False

    ipc_engine = types.ModuleType("vllm.distributed.weight_transfer.ipc_engine")
    ipc_engine.IPCWeightTransferUpdateInfo = UpdateInfo
    for name in ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, ipc_engine.__name__, ipc_engine)
    it = iter(uuids)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(uuid=next(it)))


def test_tensor_parallel_ipc_send_gives_every_gpu_a_copy_of_each_bucket(monkeypatch):
    """``send_weights_ipc(devices=...)`` on stand-ins for CUDA and vLLM's dataclass: one update per bucket whose
    ``ipc_handles`` hold, per tensor, a handle for each GPU's UUID; every copy alive while the engine loads;
    ``ipc_collect`` after each bucket (what vLLM's trainer does)."""
    import weakref

    from nemo_fp8.generation.vllm.refit import RefitPlan, send_weights_ipc

    _stub_vllm_ipc(monkeypatch, ["GPU-aaa", "GPU-bbb"])
    shared = []
    monkeypatch.setattr(torch.multiprocessing.reductions, "reduce_tensor",
                        lambda t: shared.append(weakref.ref(t)) or (None, ("args", len(shared) - 1)))
    collects = []
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: collects.append(1))
    updates = []

    def update(payload):
        mine = shared[-2 * len(payload["update_info"]["names"]):]  # this bucket's copies on the two devices
        assert all(r() is not None for r in mine)  # every copy alive while the engine loads
        updates.append(payload["update_info"])

    tensors = [("a.weight", torch.randn(4, 8)), ("b.weight", torch.randn(16)),
               ("model.layers.0.self_attn.k_scale", torch.tensor(0.5))]
    cpu = torch.device("cpu")  # stands in for cuda:0 and cuda:1 (the copies are no-ops here)
    n = send_weights_ipc(tensors, update, RefitPlan(set()), bucket_bytes=64, devices=[cpu, cpu])
    assert n == 3 and len(updates) == 2 and len(collects) == 3  # 64 bytes of bf16 [4, 8]: a bucket alone
    first, second = updates
    assert first["names"] == ["a.weight"] and first["dtype_names"] == ["bfloat16"] and first["shapes"] == [[4, 8]]
    assert first["ipc_handles"] == [{"GPU-aaa": ("args", 0), "GPU-bbb": ("args", 1)}] and not first["packed"]
    assert second["names"] == ["b.weight", "model.layers.0.self_attn.k_scale"]
    assert second["dtype_names"] == ["bfloat16", "float32"] and second["shapes"] == [[16], []]
    assert second["ipc_handles"] == [{"GPU-aaa": ("args", 2), "GPU-bbb": ("args", 4)},
                                     {"GPU-aaa": ("args", 3), "GPU-bbb": ("args", 5)}]
    with pytest.raises(ValueError, match="not both"):
        send_weights_ipc(tensors, update, RefitPlan(set()), devices=[cpu, cpu], device=cpu)
    # one GPU: the same updates with one handle per tensor, sent by this call itself. vLLM's own sender
    # (IPCWeightTransferEngine.trainer_send_weights, absent from the stand-in) sends from torch.distributed's
    # rank 0 only: with one engine per data-parallel rank, engines 1.. were never refit
    _stub_vllm_ipc(monkeypatch, ["GPU-ccc"])
    updates.clear()
    update_one = lambda payload: updates.append(payload["update_info"])  # noqa: E731
    assert send_weights_ipc(tensors, update_one, RefitPlan(set()), bucket_bytes=64, device=cpu) == 3
    assert [u["names"] for u in updates] == [["a.weight"], ["b.weight", "model.layers.0.self_attn.k_scale"]]
    assert [list(h) for u in updates for h in u["ipc_handles"]] == [["GPU-ccc"]] * 3


def test_packed_ipc_send_gives_one_buffer_per_bucket_that_unpacks_to_the_converted_tensors(monkeypatch):
    """``send_weights_ipc(packed=True)`` on stand-ins for CUDA and vLLM's dataclass: per bucket one uint8 buffer with
    one handle per GPU and ``tensor_sizes``; unpacked the way vLLM 0.22's receiver does (``packed_tensor.split``,
    then ``.view(dtype).view(*shape)``) it gives back every converted tensor bit for bit: e4m3 weights with their
    fp32 ``weight_scale_inv`` and bf16 norms, each at an offset its dtype can be viewed at (widest first); a scalar
    KV scale, which that unpacking cannot give shape ``[]``, follows in an unpacked update."""
    from nemo_fp8.fp8.quantize import quantize_weight_blockwise
    from nemo_fp8.generation.vllm.refit import PACKED_MIN_BUFFER_BYTES, RefitPlan, send_weights_ipc

    _stub_vllm_ipc(monkeypatch, ["GPU-aaa", "GPU-bbb"])
    monkeypatch.setattr(torch.multiprocessing.reductions, "reduce_tensor", lambda t: (None, t))  # "handle": itself
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: None)
    received, updates = {}, []

    def update(payload):  # vLLM's receiver, for the buffer of the first GPU; the second GPU's copy must match it
        info = payload["update_info"]
        updates.append(info)
        if not info["packed"]:
            for name, handle in zip(info["names"], info["ipc_handles"]):
                received[name] = handle["GPU-aaa"].clone()
            return
        buffers = [info["ipc_handles"][u] for u in ("GPU-aaa", "GPU-bbb")]
        assert buffers[0].dtype == torch.uint8 and torch.equal(buffers[0], buffers[1])
        content = sum(info["tensor_sizes"])  # vLLM's receiver reads the buffer's first bytes (packed_ipc_consumer)
        assert buffers[0].numel() == max(content, PACKED_MIN_BUFFER_BYTES)
        for name, d, shape, chunk in zip(info["names"], info["dtype_names"], info["shapes"],
                                         buffers[0][:content].split(info["tensor_sizes"])):
            received[name] = chunk.contiguous().view(getattr(torch, d)).view(*shape).clone()

    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 384, generator=g)
    norm = torch.randn(384, generator=g)
    tensors = [("model.layers.0.mlp.down_proj.weight", w), ("model.layers.0.input_layernorm.weight", norm),
               ("model.layers.0.self_attn.k_scale", torch.tensor(0.5))]
    plan = RefitPlan({"model.layers.0.mlp.down_proj"})
    cpu = torch.device("cpu")
    n = send_weights_ipc(tensors, update, plan, bucket_bytes=1 << 20, devices=[cpu, cpu], packed=True)
    assert n == 4 and [u["packed"] for u in updates] == [True, False]  # converted tensors: + weight_scale_inv
    assert updates[0]["names"] == ["model.layers.0.mlp.down_proj.weight_scale_inv",  # fp32, bf16, then e4m3
                                   "model.layers.0.input_layernorm.weight", "model.layers.0.mlp.down_proj.weight"]
    assert updates[0]["tensor_sizes"] == [2 * 3 * 4, 384 * 2, 256 * 384]
    assert updates[1]["names"] == ["model.layers.0.self_attn.k_scale"] and updates[1]["shapes"] == [[]]
    q, scale_inv = quantize_weight_blockwise(w, (128, 128))
    assert torch.equal(received["model.layers.0.mlp.down_proj.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(received["model.layers.0.mlp.down_proj.weight_scale_inv"], scale_inv)
    assert torch.equal(received["model.layers.0.input_layernorm.weight"], norm.to(torch.bfloat16))
    assert received["model.layers.0.self_attn.k_scale"].shape == () and received[
        "model.layers.0.self_attn.k_scale"].item() == 0.5


def test_bf16_engine_has_no_quantization():
    spec = build_engine_spec(VllmConfig(), DENSE)
    assert "hf_overrides" not in spec.engine_kwargs and spec.fp8_modules == [] and spec.ignored_layers == []
    assert spec.engine_kwargs["worker_extension_cls"] == WORKER_EXTENSION_CLS  # only the patches of every engine


def test_engine_settings_travel_in_vllms_additional_config_not_the_environment():
    """What the workers' patches read comes in the engine's own config (``additional_config``); the environment
    holds vLLM's switches only."""
    pow2 = dict(use_deep_gemm=True, pow2_weight_scaling_factors=True, pow2_activation_scaling_factors=True)
    for cfg, expected in [(VllmConfig(precision="fp8", **pow2), {"precision": "fp8", "pow2_activation_scales": True}),
                          (VllmConfig(precision="fp8"), {"precision": "fp8", "pow2_activation_scales": False}),
                          (VllmConfig(**pow2), {"precision": "bfloat16", "pow2_activation_scales": False})]:
        spec = build_engine_spec(cfg, DENSE)
        extra = spec.engine_kwargs["additional_config"]
        assert extra == {ENGINE_SETTINGS_KEY: expected}
        assert engine_settings(SimpleNamespace(additional_config=extra)) == expected
        assert all(k.startswith("VLLM_") for k in spec.env), spec.env
    assert engine_settings(SimpleNamespace(additional_config={})) == {}  # an engine built without them
    assert engine_settings(object()) == {}


def test_the_worker_extension_an_engine_names_decides_its_patches(monkeypatch):
    """The module named by ``worker_extension_cls`` is imported in each worker before the model is built: BF16
    engines' applies the patches of every engine, FP8 engines' the FP8 ones too; both give the same class."""
    import importlib

    from nemo_fp8.generation.vllm import patches

    calls = []
    monkeypatch.setattr(patches, "apply_patches", lambda fp8=True: calls.append(fp8))
    classes = []
    for qualname, expected in [(WORKER_EXTENSION_CLS, [False]), (FP8_WORKER_EXTENSION_CLS, [False, True])]:
        module, _, name = qualname.rpartition(".")
        for m in ("nemo_fp8.generation.vllm.worker_extension", "nemo_fp8.generation.vllm.worker_extension_fp8"):
            monkeypatch.delitem(sys.modules, m, raising=False)  # a fresh worker process
        calls.clear()
        classes.append(getattr(importlib.import_module(module), name))
        assert calls == expected, qualname
    assert classes[0].__name__ == classes[1].__name__ == "Fp8WorkerExtension"
    assert hasattr(classes[1], "nemo_fp8_scale_convention")


@pytest.mark.parametrize("pow2", [True, False])
def test_quantfp8_patch_reads_pow2_from_the_engine_being_built(monkeypatch, pow2):
    """vLLM builds the model under ``set_current_vllm_config``; the patched ``QuantFP8.__init__`` takes
    ``use_ue8m0`` of dynamic per-token-group quantizers from that config's settings, and leaves others alone."""
    from nemo_fp8.generation.vllm.patches import _wrap_quantfp8_init

    spec = build_engine_spec(VllmConfig(precision="fp8", use_deep_gemm=pow2, pow2_weight_scaling_factors=pow2,
                                        pow2_activation_scaling_factors=pow2), DENSE)
    current = SimpleNamespace(additional_config=spec.engine_kwargs["additional_config"])
    vllm_config_mod = types.ModuleType("vllm.config")
    vllm_config_mod.get_current_vllm_config = lambda: current
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.config", vllm_config_mod)

    def init(self, static, group):
        self.static, self.is_group_quant, self.use_ue8m0 = static, group, "vllm's choice"

    patched = _wrap_quantfp8_init(init)
    dynamic_group, static_group, per_token = (SimpleNamespace() for _ in range(3))
    patched(dynamic_group, False, True)
    patched(static_group, True, True)
    patched(per_token, False, False)
    assert dynamic_group.use_ue8m0 is pow2
    assert static_group.use_ue8m0 == per_token.use_ue8m0 == "vllm's choice"
    current.additional_config = {}  # not built by nemo_fp8: fp32 scales, as before the patch knew of settings
    patched(dynamic_group, False, True)
    assert dynamic_group.use_ue8m0 is False


def test_model_runner_sets_vllms_switch_only_when_asked():
    """auto leaves vLLM's per-model choice (no variable); v1 / v2 pin the runner for every precision."""
    assert "VLLM_USE_V2_MODEL_RUNNER" not in engine_env(VllmConfig(precision="fp8"))
    assert build_engine_spec(VllmConfig(precision="fp8", model_runner="v2"), DENSE).env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert engine_env(VllmConfig(model_runner="v1"))["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    with pytest.raises(ValueError, match="model_runner"):
        VllmConfig(model_runner="v3")


def test_scale_convention_env_and_refusal():
    assert engine_env(VllmConfig(precision="fp8"))["VLLM_USE_DEEP_GEMM_E8M0"] == "0"
    env = engine_env(VllmConfig(precision="fp8", use_deep_gemm=True, pow2_weight_scaling_factors=True,
                                pow2_activation_scaling_factors=True))
    assert env["VLLM_USE_DEEP_GEMM"] == "1" and env["VLLM_USE_DEEP_GEMM_E8M0"] == "1"
    assert engine_env(VllmConfig(precision="fp8", use_deep_gemm=True))["VLLM_USE_DEEP_GEMM_E8M0"] == "0"
    with pytest.raises(ValueError, match="pow2_activation_scaling_factors"):
        build_engine_spec(VllmConfig(precision="fp8", use_deep_gemm=True, pow2_weight_scaling_factors=True), DENSE)
    with pytest.raises(ValueError, match="weight_transfer"):
        build_engine_spec(VllmConfig(precision="fp8"), DENSE, weight_transfer="tcp")


def test_deep_gemm_warmup_is_vllms_switch_and_needs_deep_gemm():
    assert engine_env(VllmConfig(precision="fp8", use_deep_gemm=True))["VLLM_DEEP_GEMM_WARMUP"] == "relax"
    skip = engine_env(VllmConfig(precision="fp8", use_deep_gemm=True, deep_gemm_warmup="skip"))
    assert skip["VLLM_DEEP_GEMM_WARMUP"] == "skip"
    assert "VLLM_DEEP_GEMM_WARMUP" not in engine_env(VllmConfig(precision="fp8"))  # no DeepGEMM: no warm-up
    with pytest.raises(ValueError, match=r"deep_gemm_warmup: 'skip' .* use_deep_gemm: true"):
        VllmConfig(precision="fp8", deep_gemm_warmup="skip")


def test_compiled_fp8_engines_turn_vllms_fp32_only_fused_quant_kernels_off():
    off = {"pass_config": {"fuse_act_quant": False, "fuse_norm_quant": False}}
    pow2 = dict(precision="fp8", use_deep_gemm=True, pow2_weight_scaling_factors=True,
                pow2_activation_scaling_factors=True)
    for cfg in (VllmConfig(**pow2), VllmConfig(precision="fp8"), VllmConfig(precision="fp8", use_deep_gemm=True)):
        assert build_engine_spec(cfg, DENSE).engine_kwargs["compilation_config"] == off
    # eager engines run no fusion pass; BF16: no quant
    for cfg in (VllmConfig(**pow2, enforce_eager=True), VllmConfig(pow2_activation_scaling_factors=True)):
        assert "compilation_config" not in build_engine_spec(cfg, DENSE).engine_kwargs
    # what the worker reports: a compiled engine with a fusion on gives pow2 quantizers fp32 scales at the fused sites
    assert live_activation_scales([True], compiled=True, fuse_act_quant=True, fuse_norm_quant=True) == "mixed"
    assert live_activation_scales([True], compiled=True, fuse_act_quant=False, fuse_norm_quant=True) == "mixed"
    assert live_activation_scales([True], compiled=True, fuse_act_quant=False, fuse_norm_quant=False) == "pow2"
    assert live_activation_scales([True], compiled=False, fuse_act_quant=True, fuse_norm_quant=True) == "pow2"
    assert live_activation_scales([False], compiled=True, fuse_act_quant=True, fuse_norm_quant=True) == "fp32"
    assert live_activation_scales([False, True], compiled=False, fuse_act_quant=False, fuse_norm_quant=False) == "mixed"
    assert live_activation_scales([], compiled=True, fuse_act_quant=True, fuse_norm_quant=True) == "none"


def test_refit_plan_dense_names_and_quantization():
    plan, _ = build_refit_plan(VllmConfig(precision="fp8", num_last_layers_in_bf16=1), DENSE)
    w = torch.randn(256, 256, dtype=torch.bfloat16)
    out = dict(plan.convert("model.layers.0.self_attn.q_proj.weight", w))
    assert out["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert out["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (2, 2)
    assert list(plan.convert("model.layers.3.self_attn.q_proj.weight", w))[0][1].dtype == torch.bfloat16
    assert list(plan.convert("model.layers.0.input_layernorm.weight", torch.ones(256)))[0][1].dtype == torch.bfloat16
    (n, s), = plan.convert("model.layers.2.self_attn.k_scale", torch.tensor(0.5))
    assert n == "model.layers.2.self_attn.k_scale" and s.dtype == torch.float32 and s.dim() == 0
    assert "lm_head.weight" in plan.expected and "model.embed_tokens.weight" in plan.expected
    meta = plan.converted_meta("model.layers.0.self_attn.q_proj.weight", (256, 256), torch.bfloat16)
    assert meta == [("model.layers.0.self_attn.q_proj.weight", "float8_e4m3fn", [256, 256]),
                    ("model.layers.0.self_attn.q_proj.weight_scale_inv", "float32", [2, 2])]


def test_refit_plan_moe_splits_fused_experts():
    plan, ignored = build_refit_plan(VllmConfig(precision="fp8", num_first_layers_in_bf16=1), MOE)
    assert plan.fp8_expert_containers == {"model.layers.1.mlp.experts", "model.layers.2.mlp.experts"}
    assert "model.layers.0.mlp.experts" in ignored and ignored[-1] == "lm_head"
    gu = torch.randn(4, 256, 256, dtype=torch.bfloat16)
    out = dict(plan.convert("model.layers.1.mlp.experts.gate_up_proj", gu))
    assert torch.equal(out["model.layers.1.mlp.experts.3.up_proj.weight"].float(),
                       dict(plan.convert("model.layers.1.mlp.experts.gate_up_proj", gu))[
                           "model.layers.1.mlp.experts.3.up_proj.weight"].float())
    assert out["model.layers.1.mlp.experts.0.gate_proj.weight"].shape == (128, 256)
    assert out["model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv"].shape == (1, 2)
    bf = dict(plan.convert("model.layers.0.mlp.experts.down_proj", torch.randn(4, 256, 128, dtype=torch.bfloat16)))
    assert set(bf) == {f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(4)}
    meta = plan.converted_meta("model.layers.1.mlp.experts.gate_up_proj", (4, 256, 256), torch.bfloat16)
    assert len(meta) == 16 and [m[0] for m in meta] == list(out)


def test_refit_plan_moe_takes_per_expert_names_as_checkpoints_and_bridge_write_them(tmp_path):
    """transformers 5 fuses the experts in memory (``experts.gate_up_proj`` [E, 2I, H]) but still
    writes checkpoints per expert (``experts.{e}.gate_proj.weight``), as Megatron-Bridge exports them.
    Seen on the H200: the MoE engine refused its own checkpoint ("no weight ...experts.0.down_proj.weight").
    Both forms must pass the completeness check, and per-expert tensors of an FP8 layer must be
    quantized exactly as the fused split is (not sent as bf16 into FP8 storage)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from nemo_fp8.models.hf import iter_checkpoint

    plan, _ = build_refit_plan(VllmConfig(precision="fp8", num_first_layers_in_bf16=1), MOE)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**MOE)).to(torch.bfloat16).save_pretrained(str(tmp_path))
    on_disk = dict(iter_checkpoint(str(tmp_path)))
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in on_disk and not any(n.endswith("gate_up_proj") for n in on_disk)
    assert set(on_disk) == plan.expected  # every name known, none missing
    assert plan.canonical_names("model.layers.1.mlp.experts.down_proj") == [
        f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(4)]
    assert plan.canonical_names("model.layers.1.mlp.gate.weight") == ["model.layers.1.mlp.gate.weight"]

    gate = [on_disk[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"] for e in range(4)]
    up = [on_disk[f"model.layers.1.mlp.experts.{e}.up_proj.weight"] for e in range(4)]
    fused = dict(plan.convert("model.layers.1.mlp.experts.gate_up_proj",
                              torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])))
    per_expert = {}
    for name in (f"model.layers.1.mlp.experts.{e}.{p}_proj.weight" for e in range(4) for p in ("gate", "up")):
        per_expert.update(plan.convert(name, on_disk[name]))
    assert set(per_expert) == set(fused)
    for name, t in fused.items():
        assert t.dtype == per_expert[name].dtype and torch.equal(t.view(torch.uint8), per_expert[name].view(torch.uint8))
    assert per_expert["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == torch.float8_e4m3fn
    (name, w), = plan.convert("model.layers.0.mlp.experts.2.down_proj.weight",
                              on_disk["model.layers.0.mlp.experts.2.down_proj.weight"])  # first layer: BF16
    assert w.dtype == torch.bfloat16
    meta = plan.converted_meta("model.layers.2.mlp.experts.1.down_proj.weight", (256, 128), torch.bfloat16)
    assert meta[1] == ("model.layers.2.mlp.experts.1.down_proj.weight_scale_inv", "float32", [2, 1])


def test_moe_router_stays_bf16_in_the_engine_and_the_refit():
    """transformers 5's router (``Qwen3MoeTopKRouter``, a [num_experts, hidden] weight, not a Linear) is
    high precision: vLLM must not quantize ``mlp.gate`` (its Linear of 4 outputs would become a block-FP8
    GEMM, and a bf16 refit of it would be cast into FP8 without a scale), so it is in ``ignored_layers``
    in every layer and refits as bf16."""
    plan, ignored = build_refit_plan(VllmConfig(precision="fp8"), MOE)
    assert all(f"model.layers.{i}.mlp.gate" in ignored for i in range(3))
    assert "model.layers.1.mlp.gate" not in plan.fp8_modules
    (name, w), = plan.convert("model.layers.1.mlp.gate.weight", torch.randn(4, 256, dtype=torch.bfloat16))
    assert name == "model.layers.1.mlp.gate.weight" and w.dtype == torch.bfloat16
    spec = build_engine_spec(VllmConfig(precision="fp8"), MOE, "/m")
    assert "model.layers.2.mlp.gate" in spec.engine_kwargs["hf_overrides"]["quantization_config"]["ignored_layers"]


def test_patch_table_is_versioned():
    assert PATCHES and all(p.tested_versions for p in PATCHES)
    assert check_patch_table("0.22.0") == []
    errs = check_patch_table("0.23.1")
    assert errs and "0.22.0" in errs[0] and "0.23.1" in errs[0]


def test_package_import_does_not_import_vllm():
    import sys

    import nemo_fp8

    assert callable(nemo_fp8.init_fp8)
    import nemo_fp8.generation.vllm  # noqa: F401
    assert "vllm" not in sys.modules or sys.modules["vllm"] is not None


def test_sleep_patch_lets_only_the_shared_gpu_memory_check_pass(caplog):
    """vLLM's Worker.sleep asserts after releasing the memory that the whole GPU's free memory did not fall:
    the patch logs that one failure; other assertion errors and normal returns pass through."""
    from nemo_fp8.generation.vllm.patches import SLEEP_CHECK_MESSAGE, _wrap_worker_sleep

    calls = []

    def sleep(self, level=1, fail=None):
        calls.append(level)
        if fail:
            raise AssertionError(fail)
        return "slept"

    patched = _wrap_worker_sleep(sleep)
    assert patched(None, 2) == "slept" and patched._nemo_fp8_patched
    with caplog.at_level("WARNING"):
        assert patched(None, 1, fail=SLEEP_CHECK_MESSAGE + ".") is None
    assert calls == [2, 1] and "another process" in caplog.text
    with pytest.raises(AssertionError, match="other"):
        patched(None, 1, fail="other")
    sleep_patch = next(p for p in PATCHES if p.name == "worker_sleep_shared_gpu")
    assert not sleep_patch.fp8_only and sleep_patch.attr == "Worker.sleep"
    assert all(p.fp8_only for p in PATCHES if p.name == "quantfp8_pow2_act")


def test_refit_names_are_checked_before_anything_is_sent():
    """``checked_names``: what the engine's completeness check counts, and a clear error for a weight the engine's
    model lacks (the CUDA IPC refit checks each name in the trainer before quantizing it)."""
    plan, _ = build_refit_plan(VllmConfig(precision="fp8"), MOE)
    assert plan.checked_names(["model.layers.1.mlp.experts.down_proj", "model.layers.0.self_attn.k_scale"]) == [
        *(f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(4)), "model.layers.0.self_attn.k_scale"]
    with pytest.raises(KeyError, match="has no weight 'model.layers.9.mlp.up_proj.weight'"):
        plan.checked_names(["model.embed_tokens.weight", "model.layers.9.mlp.up_proj.weight"])


@pytest.mark.parametrize("model", [DENSE, MOE], ids=["dense", "moe"])
def test_nccl_update_info_lists_exactly_what_the_sender_broadcasts(model):
    """The NCCL refit's contract: the engine's workers allocate receive buffers from ``nccl_update_info``
    (names, dtypes, shapes, in order) and, packed, cut the stream into chunks by the same byte counts as the
    sender, which broadcasts ``plan.convert_all``'s tensors. Both must agree tensor for tensor over a whole refit
    (FP8 and BF16 layers, fused experts split per expert, KV scales as fp32 scalars) or wrong bytes are loaded.
    The quantization runs as the torch reference here (no CUDA); the broadcast needs two GPUs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from nemo_fp8.fp8.kv_scales import KvScales
    from nemo_fp8.generation.vllm.refit import nccl_update_info

    plan, _ = build_refit_plan(VllmConfig(precision="fp8", num_first_layers_in_bf16=1), model)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**model)).to(torch.bfloat16)
    n = model["num_hidden_layers"]
    scales = KvScales.from_amax(torch.ones(n), torch.ones(n), torch.ones(n), step=1)
    stream = [(k, v) for k, v in hf.state_dict().items()] + list(scales.named_tensors())
    info = nccl_update_info(stream, plan)
    sent = list(plan.convert_all(stream, torch.device("cpu")))
    assert info["packed"] and len(info["names"]) == len(info["dtype_names"]) == len(info["shapes"]) == len(sent)
    assert info["names"] == [name for name, _ in sent]
    assert info["dtype_names"] == [str(t.dtype).removeprefix("torch.") for _, t in sent]
    assert info["shapes"] == [list(t.shape) for _, t in sent]
    assert "float8_e4m3fn" in info["dtype_names"] and "bfloat16" in info["dtype_names"]
    assert info["shapes"][-1] == [] and info["dtype_names"][-1] == "float32"  # the last KV scale
    if model is MOE:
        assert "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv" in info["names"]


def test_nccl_engine_args_and_init_info():
    """``weight_transfer="nccl"`` builds vLLM's NCCL weight-transfer engine; its workers join as ranks 1..n after
    the trainer's rank 0."""
    from nemo_fp8.generation.vllm.refit import nccl_init_info

    spec = build_engine_spec(VllmConfig(precision="fp8", tensor_parallel_size=2), DENSE, "/m", weight_transfer="nccl",
                             colocated=False)
    assert spec.engine_kwargs["weight_transfer_config"] == {"backend": "nccl"}
    assert not spec.engine_kwargs["enable_sleep_mode"]
    with pytest.raises(ValueError, match=r"weight_transfer: 'rdma'; valid: \['ipc', 'nccl'\]"):
        build_engine_spec(VllmConfig(), DENSE, weight_transfer="rdma")
    assert nccl_init_info("10.0.0.1", "29500", 3) == {"master_address": "10.0.0.1", "master_port": 29500,
                                                      "rank_offset": 1, "world_size": 3}


def test_the_rotary_reload_warning_is_dropped_and_other_layers_still_warn(caplog):
    """vLLM 0.22's layerwise reload warns ``RotaryEmbedding: Failed to load weights`` on every refit (its
    ``cos_sin_cache`` is a non-persistent buffer nobody sends; vLLM puts it back unchanged): that record is
    dropped in the engine's processes, the same warning for a real weight is kept."""
    import logging

    from nemo_fp8.generation.vllm.log_filters import FAILED_TO_LOAD, LAYERWISE_LOGGER, install_log_filters

    install_log_filters()
    install_log_filters()  # once only
    log = logging.getLogger(LAYERWISE_LOGGER)
    assert len(log.filters) == 1
    with caplog.at_level(logging.WARNING, logger=LAYERWISE_LOGGER):
        for name in ("RotaryEmbedding", "Llama3RotaryEmbedding", "QKVParallelLinear"):
            log.warning(FAILED_TO_LOAD, name)
        log.warning("%s: Delayed processing", "RotaryEmbedding")
    assert [r.getMessage() for r in caplog.records] == ["QKVParallelLinear: Failed to load weights",
                                                        "RotaryEmbedding: Delayed processing"]


@pytest.mark.parametrize("packed", [False, True])
def test_ipc_send_converts_the_next_bucket_while_the_engine_loads_the_last(monkeypatch, packed):
    """An ``update_fn`` that returns a wait (a Ray call started, not waited on): ``send_weights_ipc`` reads and
    converts the next bucket before it waits for the last one, waits for each bucket before the next update and
    for the last before it returns, and keeps each bucket's shared tensors alive until its wait has returned."""
    import weakref

    from nemo_fp8.generation.vllm.refit import RefitPlan, send_weights_ipc

    _stub_vllm_ipc(monkeypatch, ["GPU-aaa"])
    events, shared = [], []
    monkeypatch.setattr(torch.multiprocessing.reductions, "reduce_tensor",
                        lambda t: shared.append(weakref.ref(t)) or (None, ("args", len(shared) - 1)))
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: None)
    loading = []  # the updates started and not yet waited for

    def update(payload):
        k = len([e for e in events if e[0] == "update"])
        events.append(("update", k))
        mine = shared[-(1 if payload["update_info"]["packed"] else len(payload["update_info"]["names"])):]
        loading.append(k)

        def wait():
            assert all(r() is not None for r in mine)  # what the engine reads is alive until it has loaded it
            loading.remove(k)
            events.append(("wait", k))
        return wait

    def weights():  # the trainer's export: each tensor read as the sender asks for it
        for i in range(3):
            events.append(("read", i))
            yield f"l{i}.weight", torch.randn(4, 8)  # 64 bytes in bf16: a bucket each

    n = send_weights_ipc(weights(), update, RefitPlan(set()), bucket_bytes=64, device=torch.device("cpu"),
                         packed=packed)
    assert n == 3 and not loading  # every bucket waited for before the call returned
    assert events == [("read", 0), ("update", 0), ("read", 1), ("wait", 0), ("update", 1), ("read", 2), ("wait", 1),
                      ("update", 2), ("wait", 2)]
