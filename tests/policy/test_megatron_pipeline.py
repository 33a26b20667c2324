"""Pipeline parallelism in the megatron backend, the parts that run without a GPU: the settings megatron-core and
Megatron-Bridge get, the interleaved schedule's micro-batch rule, the memory estimate and the preflight's layer split.
The schedules themselves run on the GPU host (tests/gpu/test_megatron_policy.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from nemo_fp8.config import load_config
from nemo_fp8.policy.config import PolicyConfig
from nemo_fp8.policy.megatron import settings
from nemo_fp8.policy.megatron.memory import estimate_trainer_memory
from nemo_fp8.policy.megatron.pipeline import interleaving_error
from nemo_fp8.preflight import check_pipeline_layers, idle_gpus_warning

CONFIG_8B = "examples/configs/grpo_math_8B_megatron.yaml"


def _policy(**megatron) -> PolicyConfig:
    return PolicyConfig(model_name="m", megatron_cfg={"enabled": True, **megatron})


def test_provider_gets_the_stages_chunks_and_shape_exchange():
    o = settings.provider_overrides(_policy(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2))
    assert (o["pipeline_model_parallel_size"], o["virtual_pipeline_model_parallel_size"]) == (2, 2)
    assert o["variable_seq_lengths"] is True  # packed rows of any length travel between stages
    flat = settings.provider_overrides(_policy())
    assert (flat["pipeline_model_parallel_size"], flat["virtual_pipeline_model_parallel_size"]) == (1, None)
    assert flat["variable_seq_lengths"] is False


def test_override_transformer_config_may_not_set_the_pipeline_keys():
    for key in ("pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size", "variable_seq_lengths"):
        with pytest.raises(ValueError, match=f"override_transformer_config.{key}: set by"):
            _policy(override_transformer_config={key: 2})


@pytest.mark.parametrize("count,pp,vpp,ok", [(8, 2, 2, True), (4, 4, 2, True), (3, 2, 2, False), (1, 2, 2, False),
                                             (5, 4, 3, False), (3, 2, None, True), (1, 4, 1, True)])
def test_interleaving_needs_a_multiple_of_the_stages(count, pp, vpp, ok):
    error = interleaving_error(count, pp, vpp)
    assert (error is None) == ok
    if not ok:
        assert f"pipeline_model_parallel_size={pp}" in error and "virtual_pipeline_model_parallel_size" in error


def test_memory_estimate_divides_over_stages_like_tensor_parallelism():
    n = 8_000_000_000
    tp2 = estimate_trainer_memory(n, _policy(tensor_model_parallel_size=2))
    pp2 = estimate_trainer_memory(n, _policy(pipeline_model_parallel_size=2))
    tp2pp2 = estimate_trainer_memory(n, _policy(tensor_model_parallel_size=2, pipeline_model_parallel_size=2))
    assert pp2.per_gpu == pytest.approx(tp2.per_gpu)
    assert tp2pp2.per_gpu == pytest.approx(tp2.per_gpu / 2)


def _model_dir(tmp_path, layers: int):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": layers}))
    save_file({"w": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    return tmp_path


@pytest.mark.parametrize("pp,vpp,layers,ok", [(2, None, 32, True), (2, 2, 32, True), (4, 4, 32, True),
                                              (3, None, 32, False), (2, 3, 32, False), (2, None, 36, True)])
def test_preflight_refuses_stages_that_do_not_split_the_layers(tmp_path, pp, vpp, layers, ok):
    cfg = load_config(CONFIG_8B, [f"policy.model_name={_model_dir(tmp_path, layers)}",
                                  f"policy.megatron_cfg.pipeline_model_parallel_size={pp}",
                                  f"policy.megatron_cfg.virtual_pipeline_model_parallel_size={vpp or 'null'}"])
    errs = check_pipeline_layers(cfg)
    assert (errs == []) == ok
    if not ok:
        (line,) = errs
        assert line.startswith(f"policy.megatron_cfg.pipeline_model_parallel_size: {pp} stages")
        assert f"the {layers} decoder layers" in line and "one of [1, 2, 4, 8, 16, 32]" in line


def test_world_size_and_idle_gpus_count_the_stages(tmp_path):
    cfg = load_config(CONFIG_8B, ["policy.megatron_cfg.tensor_model_parallel_size=1",
                                  "policy.megatron_cfg.sequence_parallel=false",
                                  "policy.megatron_cfg.pipeline_model_parallel_size=2", "policy.data_parallel_size=1",
                                  "cluster.gpus_per_node=4"])
    assert cfg.policy.world_size == 2
    line = idle_gpus_warning(cfg, {"GPU": 2})
    assert "x pipeline parallel 2" in line and "policy.data_parallel_size=2 uses them all" in line


def test_interleaved_packing_gives_each_rank_a_multiple_of_the_stages():
    from nemo_fp8.policy.packing import plan_logprobs, plan_train

    cfg = PolicyConfig(model_name="m", data_parallel_size=2,
                       sequence_packing={"enabled": True, "train_mb_tokens": 4096, "logprob_mb_tokens": 4096},
                       megatron_cfg={"enabled": True, "pipeline_model_parallel_size": 2,
                                     "virtual_pipeline_model_parallel_size": 2})
    shape = cfg.packing_shape("train")
    assert shape.bins_multiple == 2
    lengths = [300 + 7 * i for i in range(48)]  # 17,3xx tokens: 5 bins of 4,096 would do; 8 = 2 ranks x 2 x 2
    for plan in plan_train(lengths, 48, 2, shape):
        assert all(len(mbs) % 2 == 0 for mbs in plan.micro_batches)
        assert interleaving_error(len(plan.micro_batches[0]), 2, 2) is None
    assert all(len(p.micro_batches[0]) % 2 == 0 for p in plan_logprobs(lengths, 2, cfg.packing_shape("logprobs")))
    assert _policy(pipeline_model_parallel_size=2).packing_shape("train").bins_multiple == 1  # 1F1B: any count


def test_interleaved_without_packing_needs_micro_batches_in_multiples_of_the_stages():
    bad = dict(model_name="m", train_global_batch_size=24, train_micro_batch_size=8,
               megatron_cfg={"enabled": True, "pipeline_model_parallel_size": 2,
                             "virtual_pipeline_model_parallel_size": 2})
    with pytest.raises(ValueError, match="3 micro-batches per data-parallel rank.*multiple of "
                                         "pipeline_model_parallel_size=2"):
        PolicyConfig(**bad)
    PolicyConfig(**{**bad, "train_micro_batch_size": 6})  # 4 micro-batches
