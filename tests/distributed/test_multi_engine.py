"""Data-parallel rollout with the torch engine on CPU: several ``GenerationWorker`` actors behind one
``GenerationGroup`` (placement, dispatch, per-request seeds, refit to every engine, failures named)."""

import time

import pytest
import ray
import torch

from nemo_fp8.config import ConfigError, load_config
from nemo_fp8.generation.group import EngineError, GenerationGroup, assign_bins, expected_tokens, plan_bins
from nemo_fp8.distributed.placement import create_placement_group, plan_cluster, plan_from_config
from nemo_fp8.distributed.weight_sync import ObjectStoreWeightSync
from nemo_fp8.generation import GenerationSpec, SamplingParams
from nemo_fp8.generation.torch_backend import TorchGenerationBackend
from nemo_fp8.generation.interfaces import request_seed
from nemo_fp8.trainer import start_workers
from nemo_fp8.policy.spec import PolicySpec

CPU = torch.device("cpu")
TINY_MEGATRON = "examples/configs/grpo_math_tiny_megatron_fp8.yaml"
DP4 = ["policy.train_global_batch_size=128", "policy.train_micro_batch_size=8"]


def _prompts(tok, distinct: int, n: int) -> list[list[int]]:
    """``distinct`` prompts of different lengths, each repeated ``n`` times (a GRPO step's requests)."""
    texts = [f"Q: What is {7 * i} + {13 * i + 100 * (i % 3)}?{' Think.' * (i % 2)}\n" for i in range(distinct)]
    return [tok.encode(t, add_special_tokens=False) for t in texts for _ in range(n)]


def _spec(cfg, tok, batch_size: int) -> GenerationSpec:
    return GenerationSpec(backend="torch", model_name=cfg.policy.model_name, vllm_cfg=cfg.policy.generation.vllm_cfg,
                          device=CPU, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                          max_total_sequence_length=cfg.policy.max_total_sequence_length, batch_size=batch_size)


def test_bins_keep_a_prompts_samples_together_and_do_not_depend_on_the_engine_count():
    prompts = [[1, 2]] * 4 + [[3]] * 4 + [[4, 5, 6]] * 4 + [[7]] * 2
    bins = plan_bins(prompts, 4)
    assert [(b.start, b.chunk_sizes) for b in bins] == [(0, (4,)), (4, (4,)), (8, (4,)), (12, (2,))]
    big = plan_bins(prompts, 3)  # a group larger than a batch fills two batches, both in one bin; the last
    assert [(b.start, b.chunk_sizes) for b in big] == [(0, (3, 1)), (4, (3, 1)), (8, (3, 3))]  # group joins a batch
    assert [(b.start, b.chunk_sizes) for b in plan_bins(prompts, 8)] == [(0, (8,)), (8, (6,))]
    for b in bins + big:  # bins cover the rows in order and never cut a group
        assert b.start == 0 or prompts[b.start] != prompts[b.start - 1]
    assert [r for b in big for r in b.rows] == list(range(len(prompts)))
    costs = [expected_tokens(prompts, b.rows, 10) for b in bins]
    assert costs == [48.0, 44.0, 52.0, 22.0]
    two = assign_bins(bins, costs, 2)  # longest first to the least loaded: 52 | 48, then 44 -> 1, 22 -> 0
    assert [[b.start for b in e] for e in two] == [[8, 12], [0, 4]]
    assert [sum(costs[bins.index(b)] for b in e) for e in two] == [74.0, 92.0]
    assert [[b.start for b in e] for e in assign_bins(bins, costs, 5)] == [[8], [0], [4], [12], []]
    with pytest.raises(ValueError, match="policy.generation_batch_size must be >= 1"):
        plan_bins(prompts, 0)


def test_cluster_plan_has_one_engine_per_tensor_parallel_group_and_engines_never_span_nodes():
    four = plan_cluster(4, use_gpu=True, colocated=True, engine_gpus=1, num_engines=4)
    assert four.engine_slots == [(i, {"CPU": 1.0, "GPU": 0.5}) for i in range(4)]
    assert four.policy_slots == [(i, {"CPU": 1.0, "GPU": 0.5}) for i in range(4)]
    assert four.required() == {"CPU": 8.0, "GPU": 4.0} and four.engine_ranks == [[0], [1], [2], [3]]
    two = plan_cluster(4, use_gpu=True, colocated=True, engine_gpus=2, num_engines=2, gpus_per_node=2)
    assert two.engine_slots == [(0, {"CPU": 1.0, "GPU": 0.5}), (2, {"CPU": 1.0, "GPU": 0.5})]
    assert two.engine_ranks == [[0, 1], [2, 3]] and two.node_groups == [[0, 1], [2, 3]]
    assert two.strategy == "STRICT_PACK" and two.required() == {"CPU": 6.0, "GPU": 4.0}
    own = plan_cluster(2, use_gpu=True, colocated=False, engine_gpus=2, num_engines=3, gpus_per_node=2,
                       engine_gpus_per_node=4)
    assert own.engine_slots == [(b, {"CPU": 1.0, "GPU": 2.0}) for b in (2, 3, 4)]
    assert own.node_groups == [[0, 1], [2, 3], [4]] and own.required() == {"CPU": 5.0, "GPU": 8.0}
    cpu = plan_cluster(2, use_gpu=False, colocated=True, num_engines=3)
    assert cpu.engine_slots == [(2, {"CPU": 1.0}), (3, {"CPU": 1.0}), (4, {"CPU": 1.0})] and cpu.strategy == "PACK"
    with pytest.raises(ValueError, match="cluster.gpus_per_node: 3 is not a multiple of .*tensor_parallel_size=2"):
        plan_cluster(6, use_gpu=True, colocated=True, engine_gpus=2, num_engines=3, gpus_per_node=3)
    with pytest.raises(ValueError, match="policy.generation.num_engines: 3 colocated engines .* valid: 1 to 2"):
        plan_cluster(4, use_gpu=True, colocated=True, engine_gpus=2, num_engines=3)


def test_engine_count_follows_the_gpus_and_bad_layouts_are_config_errors():
    gpu = ["policy.device=cuda"]
    cfg = load_config(TINY_MEGATRON, [*gpu, "policy.data_parallel_size=4", *DP4])
    cluster = cfg.cluster
    assert plan_from_config(cfg.policy, cluster, use_gpu=True).num_engines == 4  # TP 1 on every policy GPU
    tp2 = load_config(TINY_MEGATRON, [*gpu, "policy.data_parallel_size=4", *DP4,
                                      "policy.generation.vllm_cfg.tensor_parallel_size=2"])
    assert plan_from_config(tp2.policy, cluster, use_gpu=True).engine_ranks == [[0, 1], [2, 3]]
    one = tp2.policy.model_copy(update={"generation": tp2.policy.generation.model_copy(update={"num_engines": 1})})
    assert plan_from_config(one, cluster, use_gpu=True).num_engines == 1
    own = load_config(TINY_MEGATRON, [*gpu, "policy.generation.colocated.enabled=false",
                                      "policy.generation.colocated.resources.gpus_per_node=4"])
    assert plan_from_config(own.policy, cluster, use_gpu=True).num_engines == 4
    assert plan_from_config(own.policy, cluster, use_gpu=False).num_engines == 1  # CPU: one per policy rank
    with pytest.raises(ConfigError) as e:  # world size 6, TP 4: not a multiple
        load_config(TINY_MEGATRON, ["policy.data_parallel_size=6", "grpo.num_prompts_per_step=24",
                                    "policy.train_global_batch_size=192", "policy.train_micro_batch_size=8",
                                    "policy.generation.vllm_cfg.tensor_parallel_size=4"])
    msg = str(e.value)
    assert "generation.vllm_cfg.tensor_parallel_size: 4 with policy.generation.colocated.enabled=true" in msg
    assert "policy world size 6" in msg and "not a multiple" in msg and "valid: 1, 2" in msg
    with pytest.raises(ConfigError, match=r"generation.num_engines: 3 engines of .*tensor_parallel_size=2 GPU\(s\) "
                                          r"need 6 GPUs, but the policy's GPUs \(policy world size\) gives 4; valid: "
                                          r"1 to 2"):
        load_config(TINY_MEGATRON, [*gpu, "policy.data_parallel_size=4", *DP4,
                                    "policy.generation.vllm_cfg.tensor_parallel_size=2",
                                    "policy.generation.num_engines=3"])
    with pytest.raises(ConfigError, match="colocated.resources.gpus_per_node: 3 is not a multiple"):
        load_config(TINY_MEGATRON, ["policy.generation.colocated.enabled=false",
                                    "policy.generation.vllm_cfg.tensor_parallel_size=2",
                                    "policy.generation.colocated.resources.gpus_per_node=3"])


def _group(cfg, tok, num_engines: int, batch_size: int):
    plan = plan_cluster(1, use_gpu=False, colocated=True, num_engines=num_engines)
    placement = create_placement_group(plan)
    return GenerationGroup.start(placement, plan, _spec(cfg, tok, batch_size), torch_threads=1), placement


def test_one_two_and_four_engines_give_the_same_rollout(ray_cluster, tiny_cfg, tok):
    """Per-request seeds and batches fixed by the step, not by the engines: the same tokens and log-probs, bit
    for bit, whichever engine draws a request; a one-engine call in this process with the same seeds and batches
    agrees too. Every engine gets work and reports its tokens and time."""
    cfg = tiny_cfg()
    prompts = _prompts(tok, distinct=4, n=4)
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0, seed=1234)
    outs, metrics = {}, {}
    for k in (1, 2, 4):
        group, placement = _group(cfg, tok, k, batch_size=4)
        try:
            assert group.num_engines == k and group.labels[0].startswith("engine 0 (node ")
            outs[k] = group.generate(prompts, sampling)
            metrics[k] = group.pop_engine_metrics()
        finally:
            group.shutdown()
            placement.remove()
    for k in (2, 4):
        assert torch.equal(outs[k].token_ids, outs[1].token_ids), k
        assert torch.equal(outs[k].generation_logprobs, outs[1].generation_logprobs), k
        assert torch.equal(outs[k].response_lengths, outs[1].response_lengths), k
    assert not torch.equal(outs[1].token_ids[0], outs[1].token_ids[1])  # samples of one prompt differ (own seeds)
    local = TorchGenerationBackend(cfg.policy.model_name, cfg.policy.generation.vllm_cfg, CPU, tok.pad_token_id,
                                   tok.eos_token_id, cfg.policy.max_total_sequence_length, batch_size=4)
    here = local.generate(prompts, sampling, request_seeds=[request_seed(1234, r) for r in range(len(prompts))])
    assert torch.equal(here.token_ids, outs[1].token_ids)
    m = metrics[4]
    assert m["generation/engines"] == 4.0
    tokens = [m[f"generation/engine_{e}/tokens"] for e in range(4)]
    assert all(t > 0 for t in tokens) and sum(tokens) == float(outs[4].response_lengths.sum())
    assert all(m[f"generation/engine_{e}/seconds"] > 0 for e in range(4)) and m["generation/engine_imbalance"] >= 1.0
    assert metrics[1]["generation/engine_0/tokens"] == sum(tokens)


def test_an_engine_that_raises_or_dies_stops_the_call_naming_it(ray_cluster, tiny_cfg, tok):
    cfg = tiny_cfg("policy.max_total_sequence_length=64")
    group, placement = _group(cfg, tok, 2, batch_size=2)
    try:
        prompts = _prompts(tok, distinct=2, n=2)
        long = [5] * 70  # over max_total_sequence_length: its engine raises, the other one is fine
        with pytest.raises(EngineError, match=r"generate: engine \d \(node .*, CPU\) failed: .*prompt 0 has 70 tokens"):
            group.generate(prompts[:2] + [long, long], SamplingParams(max_new_tokens=4))
        ray.kill(group.workers[1], no_restart=True)  # its process ends while the step is handed out
        t0 = time.monotonic()
        with pytest.raises(EngineError, match=r"generate: engine 1 \(node .*\) died"):
            group.generate(_prompts(tok, distinct=4, n=2), SamplingParams(max_new_tokens=8, seed=3))
        assert time.monotonic() - t0 < 60  # a clear error in bounded time, never a hang
        with pytest.raises(EngineError, match="weight_version: engine 1 .* died"):
            group.weight_version()
    finally:
        ray.kill(group.workers[0])
        placement.remove()


def test_refit_reaches_every_engine_with_the_same_weights(ray_cluster, tiny_cfg, tok, tmp_path):
    """Two policy ranks on CPU start two torch engines (one per rank); an FP8 refit through the object store
    (each bucket put once) leaves both with the version and the same bytes, FP8 weights and ``weight_scale_inv``
    included, equal to an engine refit in this process; a GRPO step runs on both and logs each one's tokens; an
    engine left on another version is named."""
    from nemo_fp8.algorithms.grpo import grpo_step
    from nemo_fp8.data import PromptDataloader
    from nemo_fp8.distributed.weight_sync import InProcessWeightSync
    from nemo_fp8.policy.torch_backend import TorchPolicyBackend
    from nemo_fp8.trainer import prepare_prompts
    from nemo_fp8.utils.timer import Timer

    cfg = tiny_cfg("policy.data_parallel_size=2", "policy.train_global_batch_size=16",
                   "policy.train_micro_batch_size=8", "grpo.num_prompts_per_step=4",
                   "grpo.num_generations_per_prompt=4", "policy.generation.max_new_tokens=8",
                   "policy.generation_batch_size=4", "policy.weight_sync.bucket_size_mb=0.25", "cluster.num_cpus=8")
    local = TorchPolicyBackend(PolicySpec.from_config(cfg.policy, CPU))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in local.model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    local.save(tmp_path / "policy")
    workers = start_workers(cfg, tok)
    try:
        assert workers.generation.num_engines == 2  # CPU default: one engine per policy rank
        workers.policy.load(tmp_path / "policy")
        sync = workers.refitter.weight_sync
        assert isinstance(sync, ObjectStoreWeightSync) and len(sync.generation_workers) == 2
        stats = sync.sync(version=3)
        assert stats.num_buckets > 4
        held = [ray.get(w.weight_version.remote()) for w in workers.generation.workers]
        assert [h.weights for h in held] == [3, 3] and workers.generation.weight_version().weights == 3
        names = ["model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight_scale_inv",
                 "model.layers.1.self_attn.q_proj.weight", "model.norm.weight"]
        params = [ray.get(w.engine_params.remote(names))[0] for w in workers.generation.workers]
        assert params[0][names[0]][0] == "float8_e4m3fn" and params[0][names[1]][0] == "float32"
        assert params[0] == params[1]
        ref = TorchGenerationBackend(cfg.policy.model_name, cfg.policy.generation.vllm_cfg, CPU, tok.pad_token_id,
                                     tok.eos_token_id, cfg.policy.max_total_sequence_length)
        before = ref.engine_params(names)[0]
        InProcessWeightSync(local, ref, bucket_bytes=2**20).sync(version=3)
        assert ref.engine_params(names)[0] == params[0] and before[names[0]] != params[0][names[0]]
        train, _ = prepare_prompts(cfg, tok)
        m = grpo_step(1, iter(PromptDataloader(train, 4, seed=0)), workers.policy, workers.generation,
                      lambda responses, answers: [float(len(r) % 2) for r in responses], tok, cfg, Timer(),
                      workers.refitter)
        assert m["generation/engines"] == 2.0 and m["train/num_sequences_trained"] == 16.0
        assert m["generation/engine_0/tokens"] > 0 and m["generation/engine_1/tokens"] > 0
        assert m["generation/engine_0/tokens"] + m["generation/engine_1/tokens"] == 16 * m["train/response_length_mean"]
        # engine 1 alone refit to another version: the group refuses to roll out and names it
        ObjectStoreWeightSync(workers.policy.weight_source, workers.generation.workers[1:], 2**20).sync(version=4)
        with pytest.raises(EngineError, match=r"rollout: engine 1 \(node .*\) holds weights of version 4 .* engine 0 "
                                              r"\(node .*\) of version 0 .* a refit did not reach every engine"):
            workers.generation.weight_version()
    finally:
        workers.shutdown()


def test_preflight_names_the_cluster_keys_when_the_engines_do_not_fit():
    from nemo_fp8.preflight import compare_resources

    cfg = load_config(TINY_MEGATRON, ["policy.device=cuda", "policy.data_parallel_size=4", *DP4,
                                      "cluster.gpus_per_node=2", "cluster.num_nodes=1"])
    need = plan_from_config(cfg.policy, cfg.cluster, use_gpu=True).required()  # preflight's required_resources
    assert need == {"CPU": 8.0, "GPU": 4.0}  # four policy ranks, four colocated one-GPU engines
    errs = compare_resources(need, {"CPU": 8.0, "GPU": 4.0}, cfg)
    assert errs == ["cluster.num_nodes x cluster.gpus_per_node: the actors need 4 GPUs (policy ranks, plus engines "
                    "on GPUs of their own) but 1 x 2 = 2 are declared"]
    assert compare_resources(need, {"CPU": 8.0, "GPU": 4.0}, cfg.model_copy(update={"cluster": cfg.cluster.model_copy(
        update={"num_nodes": 2})})) == []


def test_preflight_warns_when_the_run_leaves_declared_gpus_idle():
    from nemo_fp8.preflight import idle_gpus_warning, required_resources

    config_8b = "examples/configs/grpo_math_8B_megatron_fp8.yaml"
    eight = load_config(config_8b, ["policy.device=cuda"])  # the config's own layout: TP 1 x DP 8, 8 engines
    assert required_resources(eight)["GPU"] == 8 and idle_gpus_warning(eight, required_resources(eight)) is None
    two = load_config(config_8b, ["policy.device=cuda", "policy.data_parallel_size=1",
                                  "policy.megatron_cfg.tensor_model_parallel_size=2"])
    assert idle_gpus_warning(two, required_resources(two)) == (
        "cluster.gpus_per_node x cluster.num_nodes: 8 GPUs declared, the run uses 2 (policy.data_parallel_size=1 x "
        "tensor parallel 2, engines colocated); policy.data_parallel_size=4 uses them all")
    cpu = load_config(TINY_MEGATRON)  # no GPU count declared
    assert idle_gpus_warning(cpu, required_resources(cpu)) is None


def test_step_metrics_sum_the_engines_over_generation_rounds():
    from nemo_fp8.algorithms.grpo import sum_engine_metrics
    from nemo_fp8.generation.torch_backend import TorchGenerationBackend

    rounds = [{"generation/engines": 2.0, "generation/engine_0/tokens": 10.0, "generation/engine_0/seconds": 1.0,
               "generation/engine_1/tokens": 30.0, "generation/engine_1/seconds": 3.0,
               "generation/engine_imbalance": 1.5},
              {"generation/engines": 2.0, "generation/engine_0/tokens": 20.0, "generation/engine_0/seconds": 2.0,
               "generation/engine_1/tokens": 0.0, "generation/engine_1/seconds": 0.0}]
    m = sum_engine_metrics(rounds)
    assert m["generation/engines"] == 2.0 and m["generation/engine_0/tokens"] == 30.0
    assert m["generation/engine_1/seconds"] == 3.0 and m["generation/engine_imbalance"] == 1.0  # 3 s each in sum
    # one engine in this process (the method reads no state)
    assert TorchGenerationBackend.pop_engine_metrics(object()) == {"generation/engines": 1.0}
    group = GenerationGroup([object(), object()])
    group._tokens, group._seconds = [5, 7], [1.0, 3.0]
    assert group.pop_engine_metrics() == {"generation/engines": 2.0, "generation/engine_0/tokens": 5.0,
                                          "generation/engine_0/seconds": 1.0, "generation/engine_1/tokens": 7.0,
                                          "generation/engine_1/seconds": 3.0, "generation/engine_imbalance": 1.5}
    assert group.pop_engine_metrics()["generation/engine_1/tokens"] == 0.0  # reset after each pop


def test_too_few_bins_for_the_engines_warns_once_naming_the_key(ray_cluster, tiny_cfg, tok, caplog):
    """4 rows in bins of 16 make one bin: engine 1 idles, which a user should hear of (once), with the key."""
    cfg = tiny_cfg()
    group, placement = _group(cfg, tok, 2, batch_size=16)
    try:
        with caplog.at_level("WARNING", logger="nemo_fp8.generation.group"):
            group.generate(_prompts(tok, distinct=2, n=2), SamplingParams(max_new_tokens=2, seed=1))
            group.generate(_prompts(tok, distinct=2, n=2), SamplingParams(max_new_tokens=2, seed=2))
        warned = [r.getMessage() for r in caplog.records if "stay idle" in r.getMessage()]
        assert len(warned) == 1 and "policy.generation_batch_size=16" in warned[0] and "at most 2" in warned[0]
        assert group.pop_engine_metrics()["generation/engine_1/tokens"] == 0
    finally:
        group.shutdown()
        placement.remove()
