"""Placement across nodes on Ray's own multi-node simulation (``ray.cluster_utils.Cluster``): two raylets of two
logical GPUs each, a four-rank policy and two colocated engines of two GPUs (vLLM tensor parallel 2's layout),
with the torch backends on the CPU. Ray hands out logical GPUs as it would real ones, so the driver's part of
the layout runs here; ``tests/gpu/test_multi_engine.py`` runs vLLM engines on real GPUs."""

import os

import pytest
import ray
import torch

from nemo_fp8.distributed.placement import create_placement_group, plan_cluster
from nemo_fp8.distributed.weight_sync import ObjectStoreWeightSync
from nemo_fp8.policy.group import start_groups
from nemo_fp8.policy.spec import PolicySpec
from nemo_fp8.generation import GenerationSpec, SamplingParams
from nemo_fp8.models.hf import load_tokenizer

CPU = torch.device("cpu")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "num_gpus": 2})
    cluster.add_node(num_cpus=3, num_gpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": REPO, "TOKENIZERS_PARALLELISM": "false"}})
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_each_engine_on_one_node_and_the_run_starts(two_nodes, tiny_cfg):
    cfg = tiny_cfg("policy.data_parallel_size=4", "policy.train_global_batch_size=64",
                   "policy.train_micro_batch_size=16")
    tok = load_tokenizer(cfg.policy.model_name)
    plan = plan_cluster(4, use_gpu=True, colocated=True, engine_gpus=2, num_engines=2, gpus_per_node=2)
    placement = create_placement_group(plan)
    try:
        nodes = placement.bundle_nodes()
        assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2]  # an engine's GPUs: one node
        spec = GenerationSpec(backend="torch", model_name=cfg.policy.model_name,
                              vllm_cfg=cfg.policy.generation.vllm_cfg, device=CPU, pad_token_id=tok.pad_token_id,
                              eos_token_id=tok.eos_token_id,
                              max_total_sequence_length=cfg.policy.max_total_sequence_length, batch_size=4)
        policy, generation = start_groups(placement, plan, PolicySpec.from_config(cfg.policy, CPU), spec,
                                          torch_threads=1)
        try:
            ranks = ray.get([w.gpu_ids.remote() for w in policy.workers])
            for e, w in enumerate(generation.workers):  # each engine sees the GPUs of its two policy ranks
                assert ray.get(w.cuda_visible_devices.remote()) == f"{ranks[2 * e][0]},{ranks[2 * e + 1][0]}"
            node_ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
            assert [lbl.split("node ")[1].split(",")[0] for lbl in generation.labels] == [node_ips[nodes[0]],
                                                                                          node_ips[nodes[2]]]
            sync = ObjectStoreWeightSync(policy.weight_source, generation.workers, 2**20, labels=generation.labels)
            assert sync.sync(version=1).num_buckets > 0 and generation.weight_version().weights == 1
            prompts = [tok.encode(f"Q: What is {i} + {i}?\n", add_special_tokens=False) for i in range(4)
                       for _ in range(2)]
            out = generation.generate(prompts, SamplingParams(max_new_tokens=4, seed=5))
            assert out.token_ids.shape[0] == 8 and int(out.response_lengths.min()) > 0
            m = generation.pop_engine_metrics()
            assert m["generation/engines"] == 2.0 and m["generation/engine_1/tokens"] > 0
        finally:
            generation.shutdown()
            policy.shutdown()
    finally:
        placement.remove()
