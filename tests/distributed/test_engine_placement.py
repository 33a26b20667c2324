"""A colocated engine of two GPUs on a Ray cluster with two (logical) GPUs: the start order and the
``CUDA_VISIBLE_DEVICES`` the engine actor gets, with the torch backends on the CPU.

Ray hands out logical GPUs as it would real ones (ids, ``CUDA_VISIBLE_DEVICES`` per actor), so the
driver's part of a tensor-parallel vLLM engine's placement runs here; the GPU test
``tests/gpu/test_vllm_tp2.py`` runs the engine itself.
"""

import os
from contextlib import contextmanager

import pytest
import ray
import torch

from nemo_fp8.batch import TrainBatch
from nemo_fp8.distributed.placement import create_placement_group, plan_cluster
from nemo_fp8.policy.group import start_groups
from nemo_fp8.policy.spec import PolicySpec
from nemo_fp8.generation import GenerationSpec, SamplingParams
from nemo_fp8.models.hf import load_tokenizer

CPU = torch.device("cpu")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def ray_two_gpus():
    if ray.is_initialized():
        ray.shutdown()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": REPO, "TOKENIZERS_PARALLELISM": "false"}})
    yield
    ray.shutdown()


def _start(pg, plan, cfg, tok):
    return start_groups(
        pg, plan, policy_spec=PolicySpec.from_config(cfg.policy, CPU),
        generation_spec=GenerationSpec(backend="torch", model_name=cfg.policy.model_name,
                                       vllm_cfg=cfg.policy.generation.vllm_cfg, device=CPU,
                                       pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                       max_total_sequence_length=cfg.policy.max_total_sequence_length, batch_size=8,
                                       offload_when_idle=True),
        torch_threads=1)


@contextmanager
def _started(cfg, plan):
    """``start_groups`` on a placement group of ``plan``; yields (policy, generation, tokenizer), then shuts all down."""
    tok = load_tokenizer(cfg.policy.model_name)
    pg = create_placement_group(plan)
    try:
        policy, generation = _start(pg, plan, cfg, tok)
        try:
            yield policy, generation, tok
        finally:
            generation.shutdown()
            policy.shutdown()
    finally:
        pg.remove()


def test_colocated_two_gpu_engine_runs_on_the_gpus_of_policy_ranks_0_and_1(ray_two_gpus, tiny_cfg):
    cfg = tiny_cfg("policy.data_parallel_size=2")
    with _started(cfg, plan_cluster(2, use_gpu=True, colocated=True, engine_gpus=2)) as (policy, generation, tok):
        ranks = ray.get([w.gpu_ids.remote() for w in policy.workers])
        assert sorted(ranks) == [["0"], ["1"]]
        # rank 0's GPU first: the engine's cuda:0, where the refit converts, is the GPU its actor shares
        assert ray.get(generation.worker.cuda_visible_devices.remote()) == f"{ranks[0][0]},{ranks[1][0]}"
        assert policy.gpu_ids([1, 0]) == [ranks[1][0], ranks[0][0]]
        prompts = [tok.encode(f"Q: What is {i} + {i}?\n", add_special_tokens=False) for i in range(2)]
        out = generation.generate(prompts, SamplingParams(max_new_tokens=3, greedy=True))
        batch = TrainBatch(out.token_ids, out.prompt_lengths, out.response_lengths, torch.zeros(2),
                           out.generation_logprobs)
        assert policy.get_logprobs(batch).shape == out.token_ids.shape  # the policy backends were built too


def test_one_gpu_engine_keeps_the_gpu_ray_gave_it(ray_two_gpus, tiny_cfg):
    """``engine_gpus=1``: no ids are asked for, the engine actor keeps Ray's ``CUDA_VISIBLE_DEVICES``
    (rank 0's GPU, which it shares)."""
    with _started(tiny_cfg(), plan_cluster(1, use_gpu=True, colocated=True)) as (policy, generation, _):
        (rank0,) = ray.get([w.gpu_ids.remote() for w in policy.workers])
        assert ray.get(generation.worker.cuda_visible_devices.remote()) == rank0[0]


@pytest.mark.parametrize("use_gpu", [True, False], ids=["gpus", "cpu"])
def test_policy_builds_after_the_engines_sleep_on_gpus_and_beside_them_on_cpu(ray_two_gpus, tiny_cfg, monkeypatch,
                                                                              use_gpu):
    """On GPUs the trainer must build after the engines measured their memory and went to sleep; on the CPU
    nothing is shared, so the policy's backend builds while the engines start (the first run's start-up)."""
    from nemo_fp8.policy import group as wg

    order = []
    real_begin, real_start = wg.PolicyGroup.begin_setup, wg.GenerationGroup.start
    real_sleep = wg.GenerationGroup.finish_generation

    def begin(self):
        order.append("policy setup")
        return real_begin(self)

    def start(*a, **k):
        order.append("engines start")
        out = real_start(*a, **k)
        order.append("engines ready")
        return out

    def sleep(self):
        order.append("engines asleep")
        return real_sleep(self)

    monkeypatch.setattr(wg.PolicyGroup, "begin_setup", begin)
    monkeypatch.setattr(wg.GenerationGroup, "start", staticmethod(start))
    monkeypatch.setattr(wg.GenerationGroup, "finish_generation", sleep)
    with _started(tiny_cfg(), plan_cluster(1, use_gpu=use_gpu, colocated=True)):
        pass
    if use_gpu:
        assert order == ["engines start", "engines ready", "engines asleep", "policy setup"]
    else:
        assert order == ["policy setup", "engines start", "engines ready", "engines asleep"]
