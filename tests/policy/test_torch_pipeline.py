"""Pipeline parallelism in the torch reference policy on gloo ranks (float64, a 4-layer tiny Qwen3 with tied
embeddings): PP 2 (also DP 2 x PP 2, packed micro-batches, the FP8 recipe's emulation) gives PP 1's log-probs, KV
scales, loss, grad norm and updated weights; the refit from PP 2 carries every tensor of the full model once, under
PP 1's names and order; the checkpoint is one HF model; the layout helpers, PolicyGroup and config errors; the tiny
job with 3 stages runs and resumes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from nemo_fp8.algorithms.loss import ClippedPGLossFn
from nemo_fp8.distributed.cluster import free_address
from nemo_fp8.distributed.pipeline import ParallelLayout, global_layer_name, layer_split_error, stage_layers
from nemo_fp8.policy import build_policy_backend
from nemo_fp8.policy.group import train_shard_indices
from nemo_fp8.policy.spec import PolicySpec
from nemo_fp8.policy.torch_backend import TorchPolicyBackend, reduce_train_results
from tests.conftest import REPO
from tests.policy.test_torch_packing import PACKED, make_batch

CPU = torch.device("cpu")
GBS = 8
# the TE recipe's emulation, its first and last layer kept in BF16 (the plan is made on the whole model: per stage,
# layer 0 on stage 0 and layer 3 on stage 1 stay high precision)
FP8 = ("policy.megatron_cfg.fp8_cfg.enabled=true", "policy.megatron_cfg.fp8_cfg.fp8_recipe=tensorwise",
       "policy.generation.vllm_cfg.num_first_layers_in_bf16=1", "policy.generation.vllm_cfg.num_last_layers_in_bf16=1")


# --------------------------------------------------------------------------- pure layout
def test_layout_follows_megatron_order():
    lay = ParallelLayout(tp=2, pp=2, dp=3)
    assert lay.world_size == 12
    for r in range(12):
        assert lay.rank_of(*lay.coords(r)) == r
    assert lay.coords(5) == (1, 2, 0) and lay.coords(6) == (0, 0, 1)  # tp fastest, then dp, then pp
    assert lay.replica_ranks(0) == [0, 1, 6, 7]
    assert [lay.read_rank(d) for d in range(3)] == [6, 8, 10]
    assert lay.stage_ranks(1, 2) == [5, 11] and lay.data_parallel_ranks(0, 1) == [6, 8, 10]
    assert ParallelLayout.from_world(8, tp=1, pp=2) == ParallelLayout(tp=1, pp=2, dp=4)
    with pytest.raises(ValueError, match="pipeline_model_parallel_size=2"):
        ParallelLayout.from_world(6, tp=2, pp=2)
    with pytest.raises(ValueError, match="rank 12"):
        lay.coords(12)


def test_stage_layers_even_split_and_interleaving():
    assert stage_layers(4, 2, 0) == [range(0, 2)] and stage_layers(4, 2, 1) == [range(2, 4)]
    assert stage_layers(3, 1, 0) == [range(0, 3)]
    # megatron-core's docstring example: 8 layers, 2 stages, 2 chunks each
    assert stage_layers(8, 2, 0, vpp_size=2) == [range(0, 2), range(4, 6)]
    assert stage_layers(8, 2, 1, vpp_size=2) == [range(2, 4), range(6, 8)]
    for pp, vpp in ((2, None), (4, None), (2, 2), (2, 4)):  # every layer owned once
        owned = sorted(i for p in range(pp) for chunk in stage_layers(8, pp, p, vpp) for i in chunk)
        assert owned == list(range(8))
    with pytest.raises(ValueError, match="pipeline_model_parallel_size=2"):
        stage_layers(3, 2, 0)
    with pytest.raises(ValueError, match="virtual_pipeline_model_parallel_size=3"):
        stage_layers(8, 2, 0, vpp_size=3)
    with pytest.raises(ValueError, match="needs policy.megatron_cfg.pipeline_model_parallel_size > 1"):
        stage_layers(8, 1, 0, vpp_size=2)
    assert layer_split_error(36, 2) is None and "decoder layers" in layer_split_error(35, 2)


def test_global_layer_name():
    assert global_layer_name("model.layers.0.mlp.up_proj.weight", 4) == "model.layers.4.mlp.up_proj.weight"
    assert global_layer_name("decoder.layers.11.self_attention.linear_qkv.weight", 12) == \
        "decoder.layers.23.self_attention.linear_qkv.weight"
    assert global_layer_name("model.embed_tokens.weight", 4) == "model.embed_tokens.weight"
    assert global_layer_name("lm_head.weight", 2) == "lm_head.weight"


def test_policy_group_on_the_layout():
    from nemo_fp8.policy.group import PolicyGroup

    ranks = [f"r{i}" for i in range(8)]  # tp 2 x dp 2 x pp 2
    group = PolicyGroup(workers=ranks, global_batch_size=4, tp_size=2, pp_size=2)
    assert group.dp_size == 2
    assert group.weight_source == "r0" and group.weight_peers == ["r1", "r4", "r5"]  # replica 0's other ranks
    assert group._per_rank(["s0", "s1"]) == ["s0", "s0", "s1", "s1"] * 2  # every stage gets its group's rows
    assert group._first_of_groups(ranks) == ["r4", "r6"]  # tp 0 of the last stage
    with pytest.raises(ValueError, match="pipeline_model_parallel_size=2"):
        PolicyGroup(workers=ranks[:6], global_batch_size=4, tp_size=2, pp_size=2)


# --------------------------------------------------------------------------- config
def _load(model_dir: Path, tmp_path: Path, *overrides: str):
    from nemo_fp8.config import load_config

    return load_config(REPO / "examples" / "configs" / "grpo_math_tiny.yaml", [
        f"policy.model_name={model_dir}", "policy.tiny_model.build_if_missing=false",
        f"logger.log_dir={tmp_path / 'logs'}", f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
        "logger.tensorboard_enabled=false", "policy.precision=float64", "policy.megatron_cfg.fp8_cfg.enabled=false",
        f"policy.train_global_batch_size={GBS}", "policy.train_micro_batch_size=4", "policy.logprob_batch_size=3",
        "grpo.num_prompts_per_step=8",
        "grpo.num_generations_per_prompt=1", "loss_fn.use_importance_sampling_correction=true",
        "policy.shared_prefix_forward=false", *overrides])  # stages run the unshared forward


def test_config_pipeline_keys(tiny_model_dir, tmp_path):
    cfg = _load(tiny_model_dir, tmp_path, "policy.megatron_cfg.pipeline_model_parallel_size=2",
                "policy.data_parallel_size=2", "policy.train_micro_batch_size=2")
    assert cfg.policy.world_size == 4 and cfg.policy.pipeline_parallel_size == 2
    spec = PolicySpec.from_config(cfg.policy, CPU)
    assert spec.pp_size == 2 and spec.vpp_size is None and spec.layout == ParallelLayout(tp=1, pp=2, dp=2)
    with pytest.raises(ValueError, match="virtual_pipeline_model_parallel_size: 2 interleaves .* needs pipeline"):
        _load(tiny_model_dir, tmp_path, "policy.megatron_cfg.virtual_pipeline_model_parallel_size=2")
    with pytest.raises(ValueError, match="only the megatron backend interleaves"):
        _load(tiny_model_dir, tmp_path, "policy.megatron_cfg.pipeline_model_parallel_size=2",
              "policy.megatron_cfg.virtual_pipeline_model_parallel_size=2")


def test_preflight_names_layers_that_do_not_split(tiny_model_dir, tmp_path):
    from nemo_fp8.preflight import check_pipeline_layers

    cfg = _load(tiny_model_dir, tmp_path, "policy.megatron_cfg.pipeline_model_parallel_size=2")
    (err,) = check_pipeline_layers(cfg)  # the session's tiny model has 3 layers; the torch backend checked too
    assert "pipeline_model_parallel_size: 2" in err and "3 decoder layers" in err
    assert check_pipeline_layers(_load(tiny_model_dir, tmp_path)) == []
    assert check_pipeline_layers(_load(tiny_model_dir, tmp_path,
                                       "policy.megatron_cfg.pipeline_model_parallel_size=3")) == []


# --------------------------------------------------------------------------- PP 2 == PP 1 on gloo ranks
@pytest.fixture(scope="module")
def four_layer_model(tmp_path_factory) -> Path:
    """A small random 4-layer tiny Qwen3 (tied embeddings, as the tiny model): weights, not skill."""
    from nemo_fp8.models.tiny import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, sft_steps=0)
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny4", spec, shipped_dir=None)


def _rank(rank: int, world: int, port: int, spec: PolicySpec, batch, loss_cfg, out: str) -> None:
    """One policy rank: log-probs, one training step, the refit stream (rank 0) or the drain, save and load."""
    torch.set_num_threads(1)
    be = build_policy_backend(spec, rank=rank, world_size=world, dist_init_method=f"tcp://127.0.0.1:{port}")
    lp = be.get_logprobs(batch)
    kv = be.calibrate_kv_scales(batch, step=0)
    dp_rank, dp = be.dp_rank, be.dp_size
    res = be.train_shard(batch.select(train_shard_indices(batch.size, GBS, dp, dp_rank)), ClippedPGLossFn(loss_cfg))
    if rank == 0:
        weights = [(n, t.clone()) for n, t in be.named_weights()]
    else:
        be.drain_weights()
        weights = None
    be.save(Path(out) / "ckpt")
    before = [(n, t.clone()) for n, t in be.local_named_weights()]
    for p in be.model.parameters():
        p.data.zero_()
    be.load(Path(out) / "ckpt")
    reloaded = all(torch.equal(t, dict(be.local_named_weights())[n]) for n, t in before)
    torch.save({"logprobs": lp, "kv": kv, "result": res, "weights": weights, "reloaded": reloaded,
                "updates": be.num_updates}, Path(out) / f"rank{rank}.pt")
    be.shutdown()


def _pp1(model_dir, tmp_path, micro_batch: int, extra: tuple = ()):
    cfg = _load(model_dir, tmp_path, f"policy.train_micro_batch_size={micro_batch}", *extra)
    be = TorchPolicyBackend(PolicySpec.from_config(cfg.policy, CPU))
    batch = make_batch(be.model.config.vocab_size, n=GBS, seed=3)
    lp = be.get_logprobs(batch)
    batch.prev_logprobs = lp.to(batch.generation_logprobs.dtype)
    kv = be.calibrate_kv_scales(batch, step=0)
    metrics = be.train(batch, ClippedPGLossFn(cfg.loss_fn))
    return cfg, batch, lp, kv, metrics, [(n, t.clone()) for n, t in be.named_weights()]


@pytest.mark.parametrize("dp,micro_batch,extra", [(1, 4, ()), (2, 2, ()), (1, 4, PACKED), (1, 4, FP8)],
                         ids=["pp2", "dp2xpp2", "pp2-packed", "pp2-fp8"])
def test_pipeline_equals_one_stage(four_layer_model, tmp_path, dp, micro_batch, extra):
    cfg1, batch, lp1, kv1, m1, w1 = _pp1(four_layer_model, tmp_path, micro_batch, extra)
    cfg = _load(four_layer_model, tmp_path, "policy.megatron_cfg.pipeline_model_parallel_size=2",
                f"policy.data_parallel_size={dp}", f"policy.train_micro_batch_size={micro_batch}", *extra)
    spec = PolicySpec.from_config(cfg.policy, CPU)
    world = spec.world_size
    mp.start_processes(_rank, args=(world, free_address()[1], spec, batch, cfg.loss_fn, str(tmp_path)),
                       nprocs=world, join=True, start_method="spawn")
    outs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    lay = spec.layout
    for d in range(dp):  # log-probs from each group's last stage
        torch.testing.assert_close(outs[lay.read_rank(d)]["logprobs"], lp1, rtol=0, atol=1e-12)
    for r in range(world):  # KV amax: every layer, from whichever stage holds it
        for k in ("k_scale", "v_scale", "q_scale"):
            torch.testing.assert_close(getattr(outs[r]["kv"], k), getattr(kv1, k), rtol=1e-12, atol=0)
    # every micro-batch of the global batch (2 per data-parallel rank; packed: the bins) ran through both stages
    m2 = reduce_train_results([outs[lay.read_rank(d)]["result"] for d in range(dp)])
    assert m1["micro_batches"] == m2["micro_batches"] == (GBS // micro_batch if not extra else m1["micro_batches"])
    assert m2["micro_batches"] >= 2
    for k in ("loss", "grad_norm", "is_weight_mean", "clip_fraction"):
        assert m2[k] == pytest.approx(m1[k], rel=1e-10, abs=1e-12), k
    assert {round(o["result"].grad_norms[0], 9) for o in outs} == {round(m1["grad_norm"], 9)}  # global norm
    # the refit: PP 1's names in PP 1's order, each once, and the updated weights
    w2 = outs[0]["weights"]
    assert [n for n, _ in w2] == [n for n, _ in w1]
    for (n, a), (_, b) in zip(w2, w1):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=n)
    moved = max(float((a - b).abs().max()) for (_, a), (_, b) in zip(w1, _pp1_initial(four_layer_model)))
    assert moved > 1e-6  # the step changed the weights
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["model", "optimizer.pt", "optimizer_pp1.pt"]
    assert all(o["reloaded"] and o["updates"] == 1 for o in outs)
    from nemo_fp8.models.hf import load_causal_lm  # the checkpoint is a plain HF model: PP 1's weights

    saved = load_causal_lm(str(ckpt / "model"), torch.float64, CPU).state_dict()
    for n, t in w1:
        torch.testing.assert_close(saved[n], t, rtol=0, atol=1e-10, msg=n)


def _pp1_initial(model_dir):
    from nemo_fp8.models.hf import load_causal_lm

    m = load_causal_lm(str(model_dir), torch.float64, CPU)
    return [(n, t) for n, t in m.state_dict().items() if not n.endswith("inv_freq")]


@pytest.mark.slow
def test_tiny_job_with_three_pipeline_stages_runs_and_resumes(shipped_tiny_model, tmp_path):
    """examples/run_grpo_math.py on the shipped 3-layer tiny model with pipeline_model_parallel_size=3 (one layer
    per stage: a first, a middle and a last stage, three policy ranks through Ray; the refit gathers all three):
    2 training steps, then --resume from the stages' checkpoint for a third."""
    from tests.integration.test_main_job import FAST, rows, run_job

    args = (*FAST, "policy.megatron_cfg.pipeline_model_parallel_size=3", "policy.shared_prefix_forward=false",
            "policy.generation.num_engines=1",
            "cluster.num_cpus=4")
    run_job(shipped_tiny_model, tmp_path, *args, "grpo.max_num_steps=2", config="grpo_math_tiny.yaml")
    saved = {p.name for p in (tmp_path / "ckpt" / "step_2").rglob("*")}
    assert {"model.safetensors", "optimizer.pt", "optimizer_pp1.pt", "optimizer_pp2.pt"} <= saved
    proc = run_job(shipped_tiny_model, tmp_path, *args, "grpo.max_num_steps=3", "--resume",
                   config="grpo_math_tiny.yaml")
    assert "resumed from" in proc.stderr
    r = rows(tmp_path)
    assert [x["step"] for x in r] == [0, 1, 2, 3] and r[2]["refit/num_buckets"] >= 1
    assert all(x["train/reward_mean"] > 0 and x["loss/grad_norm"] > 0 for x in r[1:])  # a real update each step
