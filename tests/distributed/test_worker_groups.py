"""Ray worker groups: object-store refit (correct, bounded memory), data parallelism, cluster plan."""

import mmap
import re
from pathlib import Path

import pytest
import ray
import torch

from nemo_fp8.algorithms.loss import ClippedPGLossFn
from nemo_fp8.batch import TrainBatch
from nemo_fp8.distributed.placement import create_placement_group, plan_cluster
from nemo_fp8.distributed.weight_sync import InProcessWeightSync, ObjectStoreWeightSync
from nemo_fp8.generation import SamplingParams
from nemo_fp8.generation.torch_backend import TorchGenerationBackend
from nemo_fp8.policy.group import PolicyGroup, shard_rows, train_shard_indices
from nemo_fp8.policy.spec import PolicySpec
from nemo_fp8.policy.torch_backend import TorchPolicyBackend
from nemo_fp8.trainer import start_workers

CPU = torch.device("cpu")
MiB = 2**20


def test_cluster_plan_and_sharding():
    cpu = plan_cluster(2, use_gpu=False, colocated=True)
    assert cpu.required() == {"CPU": 3.0} and cpu.generation_slot == (2, {"CPU": 1.0})
    colo = plan_cluster(2, use_gpu=True, colocated=True)
    assert colo.required() == {"CPU": 3.0, "GPU": 2.0} and colo.generation_slot == (0, {"CPU": 1.0, "GPU": 0.5})
    assert plan_cluster(1, use_gpu=True, colocated=False).required() == {"CPU": 2.0, "GPU": 2.0}
    assert [s.stop - s.start for s in shard_rows(7, 3)] == [3, 2, 2]
    idx = [train_shard_indices(8, 4, 2, r).tolist() for r in range(2)]
    assert idx == [[0, 1, 4, 5], [2, 3, 6, 7]]  # each rank: its half of every global batch
    with pytest.raises(ValueError, match="multiple"):
        train_shard_indices(6, 4, 2, 0)


def test_cluster_plan_for_a_two_gpu_engine():
    """vLLM tensor parallel 2: colocated, the engine actor keeps its half of bundle 0 and runs on the GPUs of
    policy ranks 0 and 1 (no GPU more is reserved); on its own, its bundle holds both its GPUs. One GPU
    reproduces today's plans exactly."""
    colo = plan_cluster(2, use_gpu=True, colocated=True, engine_gpus=2)
    assert colo.bundles == [{"CPU": 2.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}]
    assert colo.generation_slot == (0, {"CPU": 1.0, "GPU": 0.5}) and colo.required() == {"CPU": 3.0, "GPU": 2.0}
    assert colo.policy_slots == [(0, {"CPU": 1.0, "GPU": 0.5}), (1, {"CPU": 1.0, "GPU": 1.0})]
    assert (colo.engine_gpus, colo.engine_policy_ranks) == (2, [0, 1])
    assert plan_cluster(4, use_gpu=True, colocated=True, engine_gpus=2).engine_policy_ranks == [0, 1]
    own = plan_cluster(2, use_gpu=True, colocated=False, engine_gpus=2)
    assert own.bundles[-1] == {"CPU": 1.0, "GPU": 2.0} and own.generation_slot == (2, {"CPU": 1.0, "GPU": 2.0})
    assert own.required() == {"CPU": 3.0, "GPU": 4.0} and own.engine_policy_ranks == []
    assert plan_cluster(1, use_gpu=True, colocated=False, engine_gpus=2).required() == {"CPU": 2.0, "GPU": 3.0}
    for dp, colocated in ((1, True), (2, True), (1, False), (3, False)):  # engine_gpus=1: the one-GPU plans
        one = plan_cluster(dp, use_gpu=True, colocated=colocated, engine_gpus=1)
        old = plan_cluster(dp, use_gpu=True, colocated=colocated)
        assert (one.bundles, one.policy_slots, one.generation_slot) == (old.bundles, old.policy_slots,
                                                                       old.generation_slot)
    assert plan_cluster(2, use_gpu=True, colocated=False).bundles[-1] == {"CPU": 1.0, "GPU": 1.0}
    cpu = plan_cluster(2, use_gpu=False, colocated=True, engine_gpus=2)  # the torch engine: no GPUs to plan
    assert cpu.required() == {"CPU": 3.0} and cpu.engine_policy_ranks == []
    with pytest.raises(ValueError) as e:
        plan_cluster(1, use_gpu=True, colocated=True, engine_gpus=2)
    msg = str(e.value)
    assert msg.startswith("policy.generation.vllm_cfg.tensor_parallel_size: 2 with policy.generation.colocated")
    assert "the policy has 1 rank(s)" in msg and "valid: 1," in msg
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        plan_cluster(1, use_gpu=True, colocated=False, engine_gpus=0)


def _perturbed_policy_checkpoint(cfg, path: Path) -> TorchPolicyBackend:
    policy = TorchPolicyBackend(PolicySpec.from_config(cfg.policy, CPU))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    policy.save(path)
    return policy


@pytest.mark.parametrize("precision", ["fp8"])
def test_object_store_refit_equals_in_process_refit(ray_cluster, tiny_cfg, tok, tmp_path, precision):
    cfg = tiny_cfg("policy.weight_sync.bucket_size_mb=0.25", f"policy.generation.vllm_cfg.precision={precision}")
    local = _perturbed_policy_checkpoint(cfg, tmp_path / "policy")
    workers = start_workers(cfg, tok)
    try:
        workers.policy.load(tmp_path / "policy")
        sync = workers.refitter.weight_sync
        assert isinstance(sync, ObjectStoreWeightSync)
        assert workers.refitter.offload_trainer  # colocated (the default) with offload_trainer (the default)
        stats = sync.sync(version=3)
        assert stats.num_buckets > 4 and workers.generation.weight_version().weights == 3
        ref = TorchGenerationBackend(cfg.policy.model_name, cfg.policy.generation.vllm_cfg, CPU, tok.pad_token_id,
                                     tok.eos_token_id, cfg.policy.max_total_sequence_length)
        InProcessWeightSync(local, ref, bucket_bytes=MiB).sync(version=3)
        prompts = [tok.encode(f"Q: What is {i} + {2 * i}?\n", add_special_tokens=False) for i in range(8)]
        sampling = SamplingParams(max_new_tokens=8, greedy=True)
        remote, here = workers.generation.generate(prompts, sampling), ref.generate(prompts, sampling)
        assert torch.equal(remote.token_ids, here.token_ids)
        assert torch.equal(remote.generation_logprobs, here.generation_logprobs)
    finally:
        workers.shutdown()


def _mid_model(tok, path: Path) -> Path:
    """A 34M-parameter Qwen3 (random weights): big enough that a full copy dwarfs a bucket."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tok), hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=128,
                         tie_word_embeddings=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    Qwen3ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_refit_peak_extra_memory_is_one_bucket_not_a_model_copy(ray_cluster, tiny_cfg, tok, tmp_path):
    """Peak memory growth of the engine process during a refit, sampled every 0.5 ms.

    Private memory (copies this process makes) stays under one bucket plus the largest tensor
    (plus an allowance for the interpreter) in the least of three refits, and no bucket sent is
    larger than that either: the object store holds at most two at a time (back-pressure 1). ``test_memory_watch_sees_a_copy``
    shows the sampler sees a model-sized private copy when there is one.
    """
    model = _mid_model(tok, tmp_path / "mid")
    bucket_mb = 4
    cfg = tiny_cfg(f"policy.model_name={model}", "policy.generation.vllm_cfg.precision=fp8",
                   "loss_fn.use_importance_sampling_correction=true", f"policy.weight_sync.bucket_size_mb={bucket_mb}")
    workers = start_workers(cfg, tok)
    try:
        sync, gen_actor = workers.refitter.weight_sync, workers.generation.worker
        model = TorchPolicyBackend(PolicySpec.from_config(cfg.policy, CPU)).model
        model_bytes = sum(p.numel() * 4 for p in model.parameters())  # fp32 sent
        largest = 2048 * 512 * 4

        sync.sync(version=1)  # warm-up: first-use allocations of the transport
        peaks = []
        for version in (2, 3, 4):
            ray.get(gen_actor.watch_memory.remote(True))
            stats = sync.sync(version=version)
            peaks.append(ray.get(gen_actor.watch_memory.remote(False))["anon_extra"])
        allowance = 8 * MiB  # interpreter, allocator and per-call Ray overhead: 4-8 MiB measured here
        print(f"engine peak extra during 3 refits in {bucket_mb} MiB buckets: private "
              f"{', '.join(f'{p / MiB:.1f}' for p in peaks)} MiB (model {model_bytes / MiB:.0f} MiB, "
              f"largest tensor {largest / MiB:.0f} MiB)")
        # A copy the refit makes shows in every refit; the least of three filters out one-off
        # allocations of Ray's own threads in this process (seen once at 19.7 MiB in a full-suite run).
        assert min(peaks) <= bucket_mb * MiB + largest + allowance, peaks
        assert stats.max_bucket_bytes <= bucket_mb * MiB and stats.bytes >= model_bytes
    finally:
        workers.shutdown()


def test_memory_watch_sees_a_copy():
    from nemo_fp8.utils.memory import MemoryWatch

    # Fresh anonymous pages from mmap, each one written: a tensor from malloc can land on pages a
    # freed allocation left resident (in a full-suite run only 4 KiB showed), which is not a copy.
    region = mmap.mmap(-1, 64 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    watch = MemoryWatch()
    watch.start()
    torch.frombuffer(region, dtype=torch.uint8).fill_(1)
    peaks = watch.stop()
    region.close()
    assert peaks["anon_extra"] >= 60 * MiB, peaks


def _train_batch(cfg, tok) -> TrainBatch:
    policy = TorchPolicyBackend(PolicySpec.from_config(cfg.policy, CPU))
    gen = TorchGenerationBackend(cfg.policy.model_name, cfg.policy.generation.vllm_cfg, CPU, tok.pad_token_id,
                                 tok.eos_token_id, cfg.policy.max_total_sequence_length)
    prompts = [tok.encode(f"Q: What is {i} + {3 * i}?\n", add_special_tokens=False) for i in range(8)]
    out = gen.generate(prompts, SamplingParams(max_new_tokens=6, seed=1))
    batch = TrainBatch(out.token_ids, out.prompt_lengths, out.response_lengths,
                       torch.tensor([1.0, -1.0, 0.5, -0.5] * 2), out.generation_logprobs)
    batch.prev_logprobs = policy.get_logprobs(batch)
    return batch


def test_two_data_parallel_ranks_train_like_one(ray_cluster, tiny_cfg, tok):
    cfg = tiny_cfg("policy.train_global_batch_size=4", "policy.train_micro_batch_size=2", "grpo.num_prompts_per_step=4",
                   "grpo.num_generations_per_prompt=2", "policy.optimizer.lr=1e-3",
                   "loss_fn.use_importance_sampling_correction=true")
    batch = _train_batch(cfg, tok)
    results = {}
    for dp in (1, 2):
        dcfg = cfg.policy.model_copy(update={"data_parallel_size": dp})
        plan = plan_cluster(dp, use_gpu=False, colocated=True)
        pg = create_placement_group(plan)
        group = PolicyGroup.start(pg, plan, PolicySpec.from_config(dcfg, CPU), torch_threads=1)
        try:
            metrics = group.train(batch, ClippedPGLossFn(cfg.loss_fn))
            results[dp] = (metrics, group.get_logprobs(batch))
        finally:
            group.shutdown()
            pg.remove()
    (m1, lp1), (m2, lp2) = results[1], results[2]
    assert m1.keys() == m2.keys()
    for k in m1:  # two global batches of 4 rows; ranks hold 2 rows of each
        assert m2[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-6), k
    torch.testing.assert_close(lp2, lp1, rtol=0, atol=1e-5)  # same update: the replicas agree after training
    assert not torch.allclose(lp1, batch.prev_logprobs)  # and it was a real update


def test_policy_ranks_get_the_megatron_env_vars(ray_cluster):
    """``megatron_cfg.env_vars`` over the defaults (expandable segments) reach every rank's process, merged by Ray
    over the job's environment (PYTHONPATH stays); the torch backend's ranks get none."""
    import os

    from nemo_fp8.config import load_config
    from nemo_fp8.policy.config import megatron_env_vars

    mcfg = lambda *o: load_config("examples/configs/grpo_math_tiny_megatron_fp8.yaml", list(o)).policy  # noqa: E731
    env = megatron_env_vars(mcfg("policy.megatron_cfg.env_vars={NEMO_FP8_TEST_VAR: '7'}"))
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "NEMO_FP8_TEST_VAR": "7"}
    off = "policy.megatron_cfg.env_vars={PYTORCH_CUDA_ALLOC_CONF: 'expandable_segments:False'}"
    assert megatron_env_vars(mcfg(off)) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    assert megatron_env_vars(mcfg("policy.weight_sync.method=cuda_ipc")) == {}  # IPC cannot share those segments
    assert megatron_env_vars(load_config("examples/configs/grpo_math_tiny.yaml").policy) == {}  # torch backend
    plan = plan_cluster(2, use_gpu=False, colocated=True)
    pg = create_placement_group(plan)
    spec = PolicySpec.from_config(mcfg("policy.megatron_cfg.env_vars={NEMO_FP8_TEST_VAR: '7'}"), CPU)
    assert spec.env_vars == env  # the spec carries them to the ranks
    group = PolicyGroup.create(pg, plan, spec, torch_threads=1)
    try:
        seen = ray.get([w.__ray_call__.remote(lambda self: {k: os.environ.get(k) for k in (*env, "PYTHONPATH")})
                        for w in group.workers])
    finally:
        for w in group.workers:
            ray.kill(w)
        pg.remove()
    for s in seen:
        assert {k: s[k] for k in env} == env
        assert s["PYTHONPATH"]  # the job's runtime_env is kept


def test_megatron_env_vars_need_the_megatron_backend():
    from pydantic import ValidationError

    from nemo_fp8.policy.config import MegatronConfig

    with pytest.raises(ValidationError, match=r"env_vars: .*policy.megatron_cfg.enabled=true"):
        MegatronConfig(env_vars={"X": "1"})


def test_expandable_segments_with_the_cuda_ipc_refit_is_a_config_error():
    from nemo_fp8.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"megatron_cfg.env_vars: .*expandable_segments.*'cuda_ipc'.*165685"):
        load_config("examples/configs/grpo_math_tiny_megatron_fp8.yaml", [
            "policy.weight_sync.method=cuda_ipc",
            "policy.megatron_cfg.env_vars={PYTORCH_CUDA_ALLOC_CONF: 'expandable_segments:True'}"])


def test_train_expandable_segments_fits_only_the_colocated_cuda_ipc_refit_that_keeps_the_trainer():
    """``megatron_cfg.train_expandable_segments``: the one-GPU layout (cuda_ipc, trainer state kept) takes it; every
    setting it cannot run beside is named, with what would run."""
    from nemo_fp8.config import ConfigError, load_config

    one_gpu = "examples/configs/grpo_math_8B_megatron_fp8_1gpu.yaml"
    on = "policy.megatron_cfg.train_expandable_segments=true"
    assert load_config(one_gpu, [on]).policy.megatron_cfg.train_expandable_segments
    for override, named in [("policy.weight_sync.method=object_store", "weight_sync.method: 'cuda_ipc'"),
                            ("policy.generation.colocated.offload_trainer=true", "offload_trainer: false"),
                            ("policy.weight_sync.packed=false", "weight_sync.packed: true"),
                            ("policy.generation.vllm_cfg.kv_cache_dtype=fp8", "kv_cache_dtype other than fp8")]:
        with pytest.raises(ConfigError, match=r"train_expandable_segments: true needs .*" + re.escape(named)):
            load_config(one_gpu, [on, override])
    with pytest.raises(ConfigError, match=r"train_expandable_segments: true needs megatron_cfg.enabled: true"):
        load_config("examples/configs/grpo_math_tiny.yaml", [on])


def test_the_trainer_allocates_in_expandable_segments_and_refits_from_cudamalloc_ones(monkeypatch):
    """With ``train_expandable_segments`` each log-prob / training pass starts by switching the allocator to
    expandable segments and each release before a refit switches it back before it empties the cache; without the
    key the allocator is never touched."""
    from nemo_fp8.config import load_config
    from nemo_fp8.policy.megatron import colocation

    calls = []
    monkeypatch.setattr(colocation, "set_expandable_segments", lambda on: calls.append(("expandable", on)))
    monkeypatch.setattr(colocation.torch.cuda, "empty_cache", lambda: calls.append(("empty_cache",)))

    class Trainer(colocation.ColocationMixin):  # the mixin's state without a model: nothing to move or free
        def __init__(self):
            self.chunks, self.reference_chunks, self.device = [], None, CPU
            self._offloaded, self._state_on_host, self.optimizer = set(), [], None

    for key, expect in [(True, [("expandable", True), ("expandable", False), ("empty_cache",)]),
                        (False, [("empty_cache",)])]:
        trainer = Trainer()
        trainer.cfg = load_config("examples/configs/grpo_math_8B_megatron_fp8_1gpu.yaml",
                                  [f"policy.megatron_cfg.train_expandable_segments={str(key).lower()}"]).policy
        calls.clear()
        trainer.prepare_for_training()
        parts = trainer.release_cached_memory()
        assert calls == expect and set(parts) == {"free_rebuilt", "gc", "empty_cache", "gc_collected", "gc_freed_gib"}
