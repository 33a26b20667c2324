"""Our policy config -> megatron-core settings (pure mapping, CPU) and the config checks around it."""

from __future__ import annotations

import pytest
import torch

from nemo_fp8.policy.group import PolicyGroup
from nemo_fp8.policy.config import PolicyConfig
from nemo_fp8.policy.megatron import settings
from pydantic import ValidationError


def _cfg(**megatron):
    fp8 = megatron.pop("fp8_cfg", {})
    vllm = megatron.pop("vllm_cfg", {})
    top = megatron.pop("top", {})
    return PolicyConfig(model_name="m", **top, megatron_cfg={"enabled": True, **megatron, "fp8_cfg": fp8},
                        generation={"vllm_cfg": vllm})


def test_fp8_recipe_and_bf16_layers_come_from_one_source():
    cfg = _cfg(fp8_cfg=dict(enabled=True, fp8="hybrid", fp8_recipe="tensorwise"),
               vllm_cfg=dict(precision="fp8", num_first_layers_in_bf16=1, num_last_layers_in_bf16=2))
    o = settings.provider_overrides(cfg)
    assert (o["fp8"], o["fp8_recipe"], o["fp8_param"]) == ("hybrid", "tensorwise", False)
    assert o["first_last_layers_bf16"] is True
    assert (o["num_layers_at_start_in_bf16"], o["num_layers_at_end_in_bf16"]) == (1, 2)
    assert o["calculate_per_token_loss"] is True and o["gradient_accumulation_fusion"] is False
    no_keep = settings.provider_overrides(_cfg(fp8_cfg=dict(enabled=True)))
    assert no_keep["first_last_layers_bf16"] is False
    off = settings.provider_overrides(_cfg())
    assert off["fp8"] is None and off["fp8_param"] is False and "fp8_recipe" not in off


def test_dtypes_bf16_fp16_fp32():
    assert settings.train_dtype(_cfg()) == torch.bfloat16
    fp16 = _cfg(optimizer=dict(bf16=False, fp16=True))
    assert settings.train_dtype(fp16) == torch.float16
    o = settings.provider_overrides(fp16)
    assert (o["fp16"], o["bf16"], o["params_dtype"]) == (True, False, torch.float16)
    opt = settings.optimizer_config_kwargs(fp16)
    assert (opt["fp16"], opt["bf16"], opt["loss_scale"]) == (True, False, None)  # None: dynamic loss scaling
    # starts at GradScaler's 2^16 (megatron-core's 2^32 overflowed on the H200's first fp16 update), and an
    # overflow is the loss scaler's to handle (skip + lower the scale), not a fatal NaN check
    assert opt["initial_loss_scale"] == 2.0**16
    assert settings.ddp_config_kwargs(fp16)["check_for_nan_in_grad"] is False
    assert settings.ddp_config_kwargs(_cfg())["check_for_nan_in_grad"] is True
    fp32 = _cfg(top=dict(precision="float32"), optimizer=dict(bf16=False))
    assert settings.train_dtype(fp32) == torch.float32
    assert opt["fp8_recipe"] is None  # no FP8 training: the optimizer sees no FP8 parameters
    fp8 = _cfg(fp8_cfg=dict(enabled=True, fp8_recipe="tensorwise"))
    assert settings.optimizer_config_kwargs(fp8)["fp8_recipe"] == "tensorwise"


def test_gradients_are_summed_across_ranks_and_clip_defaults_to_max_grad_norm():
    cfg = _cfg(top=dict(max_grad_norm=0.5))
    ddp = settings.ddp_config_kwargs(cfg)
    assert ddp["average_in_collective"] is False and ddp["grad_reduce_in_fp32"] is True
    assert settings.optimizer_config_kwargs(cfg)["clip_grad"] == 0.5
    assert settings.optimizer_config_kwargs(_cfg(optimizer=dict(clip_grad=2.0)))["clip_grad"] == 2.0
    fp8_param = _cfg(fp8_cfg=dict(enabled=True, fp8_param=True))  # FP8 primary weights (passed on the H200)
    assert settings.provider_overrides(fp8_param)["fp8_param"] is True
    assert settings.ddp_config_kwargs(fp8_param)["fp8_param_gather"] is True
    assert settings.ddp_config_kwargs(cfg)["fp8_param_gather"] is False
    sched = settings.scheduler_kwargs(cfg)
    assert sched["lr_decay_style"] == "constant" and sched["init_lr"] == sched["max_lr"] == cfg.megatron_cfg.optimizer.lr
    assert sched["lr_warmup_steps"] == 0
    warm = settings.scheduler_kwargs(_cfg(optimizer=dict(lr=3e-5, lr_warmup_steps=10, lr_warmup_init=1e-6)))
    # megatron-core asserts lr_warmup_steps < lr_decay_steps and init_lr <= max_lr
    assert (warm["init_lr"], warm["max_lr"], warm["lr_warmup_steps"]) == (1e-6, 3e-5, 10) and warm["lr_decay_steps"] > 10
    wsd = settings.scheduler_kwargs(_cfg(optimizer=dict(lr=3e-5, min_lr=1e-6, lr_decay_style="WSD", lr_decay_steps=40,
                                                        wsd_decay_steps=20, lr_wsd_decay_style="cosine")))
    assert (wsd["lr_decay_style"], wsd["lr_decay_steps"], wsd["min_lr"]) == ("WSD", 40, 1e-6)
    assert (wsd["wsd_decay_steps"], wsd["lr_wsd_decay_style"]) == (20, "cosine")
    with pytest.raises(ValidationError, match="lr_decay_steps"):
        _cfg(optimizer=dict(lr=3e-5, lr_decay_style="linear"))


@pytest.mark.parametrize("recipe, tp, sp, want", [
    (None, 1, False, 1), ("tensorwise", 1, False, 16), ("blockwise", 1, False, 128),
    ("blockwise", 2, True, 256), ("tensorwise", 2, False, 16), (None, 2, True, 2)])
def test_sequence_padding_follows_the_recipe(recipe, tp, sp, want):
    fp8 = dict(enabled=True, fp8_recipe=recipe) if recipe else {}
    cfg = _cfg(fp8_cfg=fp8, tensor_model_parallel_size=tp, sequence_parallel=sp)
    assert settings.sequence_pad_multiple(cfg) == want


def test_block_scale_convention_follows_pow2_weight_scaling_factors():
    assert settings.block_scaling_env(_cfg(vllm_cfg=dict(pow2_weight_scaling_factors=True))) == \
        {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "0"}
    assert settings.block_scaling_env(_cfg(vllm_cfg=dict(pow2_weight_scaling_factors=False))) == \
        {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"}


def test_world_size_and_config_errors():
    assert _cfg(tensor_model_parallel_size=2, top=dict(data_parallel_size=4)).world_size == 8
    assert PolicyConfig(model_name="m", data_parallel_size=2,
                        megatron_cfg={"tensor_model_parallel_size": 1}).world_size == 2
    assert _cfg(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                top=dict(data_parallel_size=1)).world_size == 4
    for bad, key in [(dict(megatron_cfg={"optimizer": {"fp16": True, "bf16": False}}), "fp16"),
                     (dict(megatron_cfg={"enabled": True, "virtual_pipeline_model_parallel_size": 2}),
                      "virtual_pipeline_model_parallel_size: 2 interleaves"),
                     (dict(megatron_cfg={"enabled": True, "context_parallel_size": 2}), "context_parallel_size"),
                     (dict(megatron_cfg={"tensor_model_parallel_size": 2}), "tensor_model_parallel_size"),
                     (dict(megatron_cfg={"logprob_kernel": "te"}), "logprob_kernel: 'te'"),
                     (dict(megatron_cfg={"logprob_kernel": "fused"}), "logprob_kernel: 'fused'"),
                     (dict(megatron_cfg={"enabled": True, "logprob_kernel": "triton"}), "logprob_kernel"),
                     (dict(megatron_cfg={"enabled": True, "optimizer": {"fp16": True}}), "bf16 and fp16")]:
        with pytest.raises((ValidationError, ValueError), match=key):
            PolicyConfig(model_name="m", **bad)


def test_policy_group_gives_tensor_parallel_ranks_their_groups_rows():
    group = PolicyGroup(workers=["r0", "r1", "r2", "r3"], global_batch_size=4, tp_size=2)
    assert group.dp_size == 2 and group.weight_peers == ["r1"]
    assert group._per_rank(["shard0", "shard1"]) == ["shard0", "shard0", "shard1", "shard1"]
    assert group._first_of_groups(["a", "b", "c", "d"]) == ["a", "c"]
    with pytest.raises(ValueError, match="multiple"):
        PolicyGroup(workers=["r0", "r1", "r2"], global_batch_size=4, tp_size=2)


def test_precision_aware_optimizer_and_bf16_gradients_map_to_megatron_core():
    """16-bit Adam moments (megatron-core's precision-aware optimizer) and bf16 gradient buffers: the memory that
    lets an 8B model train on one GPU; a 16-bit dtype without the precision-aware optimizer is refused up front."""
    cfg = _cfg(optimizer=dict(use_precision_aware_optimizer=True, exp_avg_dtype="bfloat16",
                              exp_avg_sq_dtype="bfloat16"), distributed_data_parallel_config=dict(grad_reduce_in_fp32=False))
    opt = settings.optimizer_config_kwargs(cfg)
    assert opt["use_precision_aware_optimizer"] is True
    assert opt["exp_avg_dtype"] == opt["exp_avg_sq_dtype"] == torch.bfloat16
    assert settings.ddp_config_kwargs(cfg)["grad_reduce_in_fp32"] is False
    default = settings.optimizer_config_kwargs(_cfg())
    assert default["exp_avg_dtype"] == default["exp_avg_sq_dtype"] == torch.float32
    with pytest.raises(ValidationError, match="exp_avg_sq_dtype=float16 needs use_precision_aware_optimizer=true"):
        _cfg(optimizer=dict(exp_avg_sq_dtype="float16"))
    with pytest.raises(ValidationError, match="use_precision_aware_optimizer needs optimizer=adam and use_distributed"):
        _cfg(optimizer=dict(use_precision_aware_optimizer=True, use_distributed_optimizer=False))
    with pytest.raises(ValidationError, match="torch backend trains with fp32 AdamW"):
        PolicyConfig(model_name="m", megatron_cfg={"distributed_data_parallel_config": {"grad_reduce_in_fp32": False}})


def test_sgd_is_refused_with_the_distributed_optimizer():
    """megatron-core's distributed optimizer asserts Adam when it is built (seen on the H200): say so at config time."""
    with pytest.raises(ValidationError, match="optimizer=sgd needs use_distributed_optimizer=false"):
        _cfg(optimizer=dict(optimizer="sgd"))
    assert settings.optimizer_config_kwargs(_cfg(optimizer=dict(optimizer="sgd", use_distributed_optimizer=False)))[
        "optimizer"] == "sgd"


def test_override_transformer_config_comes_last_and_cannot_touch_managed_keys():
    from nemo_fp8.policy.config import MANAGED_TRANSFORMER_KEYS

    cfg = _cfg(fp8_cfg=dict(enabled=True), override_transformer_config={"moe_router_padding_for_quantization": True})
    assert settings.provider_overrides(cfg)["moe_router_padding_for_quantization"] is True
    # every key this project sets itself is in the managed list (so an override can't shadow it silently)
    for c in (_cfg(), _cfg(fp8_cfg=dict(enabled=True)), _cfg(activation_checkpointing=True),
              _cfg(optimizer=dict(bf16=False, fp16=True))):
        assert set(settings.provider_overrides(c)) <= set(MANAGED_TRANSFORMER_KEYS)
    with pytest.raises(ValidationError, match=r"override_transformer_config.fp8_recipe: set by policy.megatron_cfg"
                                              r".fp8_cfg.fp8_recipe"):
        _cfg(override_transformer_config={"fp8_recipe": "tensorwise"})
    with pytest.raises(ValidationError, match=r"gradient_accumulation_fusion: set by policy.megatron_cfg"
                                              r".fuse_wgrad_accumulation \(TE layers; .* needs APEX"):
        _cfg(override_transformer_config={"gradient_accumulation_fusion": True})
    # TE's wgrad fusion is on by default, off only through the megatron backend's own key
    assert _cfg().megatron_cfg.fuse_wgrad_accumulation is True
    assert _cfg(fuse_wgrad_accumulation=False).megatron_cfg.fuse_wgrad_accumulation is False
    with pytest.raises(ValidationError, match="fuse_wgrad_accumulation: false is a setting of the megatron backend"):
        PolicyConfig(model_name="m", megatron_cfg={"fuse_wgrad_accumulation": False})
    # NeMo-RL's fusion keys: on by default, set on the provider, refused as overrides
    o = settings.provider_overrides(_cfg())
    assert o["apply_rope_fusion"] is True and o["bias_activation_fusion"] is True
    o = settings.provider_overrides(_cfg(apply_rope_fusion=False, bias_activation_fusion=False))
    assert o["apply_rope_fusion"] is False and o["bias_activation_fusion"] is False
    with pytest.raises(ValidationError, match="override_transformer_config.apply_rope_fusion: set by policy.megatron_cfg"
                                              ".apply_rope_fusion"):
        _cfg(override_transformer_config={"apply_rope_fusion": False})
    with pytest.raises(ValidationError, match="apply_rope_fusion, bias_activation_fusion: false is a setting of the "
                                              "megatron backend"):
        PolicyConfig(model_name="m", megatron_cfg={"apply_rope_fusion": False, "bias_activation_fusion": False})
    with pytest.raises(ValidationError, match="override_transformer_config: megatron-core settings need the megatron"):
        PolicyConfig(model_name="m", megatron_cfg={"override_transformer_config": {"moe_router_fusion": True}})


def test_packed_seq_params_give_the_padded_offsets_as_the_bounds_and_no_padded_copies():
    """TransformerEngine compares ``cu_seqlens_*_padded`` with ``cu_seqlens_*`` in every attention layer when they are
    given (``torch.equal`` on device tensors: a host sync per layer); the backend passes the padded offsets as the
    bounds and leaves the padded fields None, with host ints for the lengths (fixed ones with fixed shapes)."""
    from nemo_fp8.policy.megatron.backend import packed_seq_kwargs
    from nemo_fp8.policy.packing import pack_rows

    ids = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 1, 2, 3]])
    for fixed, total, cu in (((), 16, [0, 4, 16]), ((32,), 32, [0, 4, 32] + [32] * 6)):
        packed = pack_rows(ids, [3, 5], seq_multiple=4, total_multiple=16, fixed_sizes=fixed)
        kw = packed_seq_kwargs(packed, torch.device("cpu"))
        assert kw["qkv_format"] == "thd" and kw["cu_seqlens_q_padded"] is None and kw["cu_seqlens_kv_padded"] is None
        assert kw["cu_seqlens_q"].tolist() == kw["cu_seqlens_kv"].tolist() == cu
        assert kw["cu_seqlens_q"].dtype == torch.int32
        assert kw["total_tokens"] == total and type(kw["max_seqlen_q"]) is int and type(kw["total_tokens"]) is int
        assert kw["max_seqlen_q"] == kw["max_seqlen_kv"] == (12 if not fixed else 32)
