"""Data-parallel FP8 rollout on four GPUs: several vLLM engines beside a four-rank policy, refit to all of them.

``VLLM_USE_DEEP_GEMM=0 pytest -m gpu -s tests/gpu/test_multi_engine.py`` (``-s`` prints the numbers).

``start_workers``' own layouts with a random-weight Qwen3 (``helpers.save_qwen3``: every Linear FP8-eligible,
k/v shards of whole 128-row blocks at tensor parallel 2) and four torch policy ranks, one GPU each:

* four engines of one GPU (vLLM TP 1), colocated, refit through the object store or by CUDA IPC from the
  policy rank on each engine's GPU;
* two engines of two GPUs (vLLM TP 2), colocated on ranks 0-1 and 2-3, refit through the object store;
* two engines of one GPU on GPUs of their own beside a one-rank policy, refit by one NCCL broadcast.

Each case: every engine holds the policy's version and, worker by worker, the same FP8 weights and
``weight_scale_inv`` bit for bit, equal to the reference quantization (``quantize_weight_blockwise``) at TP 1;
after a refit to perturbed weights every engine's greedy rollout changes and agrees with engine 0's; the
group's rollout spreads the prompts over all engines (each reports tokens).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four GPUs (four policy ranks)")]
vllm = pytest.importorskip("vllm")

from nemo_fp8.generation.interfaces import SamplingParams  # noqa: E402
from nemo_fp8.policy.spec import PolicySpec
from tests.gpu.helpers import (decode_engine_params, fused_fp8_reference, prompts, save_perturbed_policy,  # noqa: E402
                               save_qwen3)

CPU = torch.device("cpu")
LAYERS = (0, 3)
# The first case runs the engines as the trainer does (torch.compile + CUDA graphs: the refit must write into the
# tensors the captured graphs read); the others check their transport and layout in eager mode, which starts in
# a fraction of the time (vLLM's compile and graph capture take most of a start)
EAGER = "policy.generation.vllm_cfg.enforce_eager=true"
CASES = {  # id: (overrides, engines, GPUs per engine)
    "tp1x4_object_store": (["policy.data_parallel_size=4"], 4, 1),
    "tp1x4_cuda_ipc": (["policy.data_parallel_size=4", "policy.weight_sync.method=cuda_ipc", EAGER], 4, 1),
    "tp2x2_object_store": (["policy.data_parallel_size=4", "policy.generation.vllm_cfg.tensor_parallel_size=2", EAGER],
                           2, 2),
    "tp1x2_nccl_own_gpus": (["policy.data_parallel_size=1", "policy.weight_sync.method=nccl",
                             "policy.generation.colocated.enabled=false",
                             "policy.generation.colocated.resources.gpus_per_node=2", EAGER], 2, 1),
}



def _engines_hold(workers, state: dict, tp: int) -> None:
    """Every engine, worker by worker, holds the same bytes as engine 0; at TP 1, the reference quantization."""
    import ray

    want = fused_fp8_reference(state, LAYERS)
    names = list(want)
    per_engine = [decode_engine_params(ray.get(w.engine_params.remote(names))) for w in workers.generation.workers]
    assert all(len(e) == tp for e in per_engine)
    for e, held in enumerate(per_engine):
        for rank, params in enumerate(held):
            for n in names:
                assert torch.equal(params[n].view(torch.uint8), per_engine[0][rank][n].view(torch.uint8)), (e, rank, n)
    assert per_engine[0][0][names[0]].dtype == torch.float8_e4m3fn
    if tp == 1:
        for n, w in want.items():
            got = per_engine[0][0][n]
            assert got.shape == w.shape and torch.equal(got.view(torch.uint8), w.view(torch.uint8)), n


@pytest.mark.parametrize("case", list(CASES))
def test_refit_reaches_every_engine_and_their_rollouts_follow_it(case, tiny_cfg, tiny_model_dir, tmp_path):
    import ray

    from nemo_fp8.distributed.cluster import init_ray
    from nemo_fp8.models.hf import load_tokenizer
    from nemo_fp8.policy.torch_backend import TorchPolicyBackend
    from nemo_fp8.trainer import start_workers
    from nemo_fp8.utils.timer import Timer

    overrides, engines, tp = CASES[case]
    model = save_qwen3(tmp_path / "qwen3")
    cfg = tiny_cfg(f"policy.model_name={model}", f"policy.tokenizer.name={tiny_model_dir}",
                   "policy.generation.backend=vllm", "policy.generation.vllm_cfg.precision=fp8",
                   "policy.generation.vllm_cfg.gpu_memory_utilization=0.15", "policy.device=cuda",
                   "policy.train_global_batch_size=32", "policy.train_micro_batch_size=8",
                   # bins of 8 rows (plan_bins): the 32 prompts make 4 bins, one or two per engine; the tiny config's
                   # 128 would make one bin, all of it on engine 0
                   "policy.generation_batch_size=8", "policy.weight_sync.bucket_size_mb=16", *overrides)
    tok = load_tokenizer(str(tiny_model_dir))
    start = {n: t.clone() for n, t in TorchPolicyBackend(PolicySpec.from_config(cfg.policy, CPU)).named_weights()}
    changed_state = save_perturbed_policy(cfg.policy, tmp_path / "changed")

    init_ray(None, num_cpus=16)
    workers = start_workers(cfg, tok)
    try:
        group = workers.generation
        assert group.num_engines == engines
        visible = [ray.get(w.cuda_visible_devices.remote()) for w in group.workers]
        print(f"{case}: engines on {group.labels}")
        assert len({v for v in visible}) == engines and all(len(v.split(",")) == tp for v in visible)
        ids = prompts(32, seed=3)
        sp = SamplingParams(max_new_tokens=16, greedy=True)
        per_engine = []
        for version, path in ((0, None), (1, tmp_path / "changed")):
            if path is not None:
                workers.policy.load(path)
                workers.refitter.mark_stale(version)
            timer = Timer()
            with workers.refitter.generating(timer):
                whole = group.generate(ids, sp)
                metrics = group.pop_engine_metrics()
                per_engine.append([ray.get(w.generate.remote(ids, sp))[0] for w in group.workers])
                # read while awake: after the block the engines sleep and their weights are off the GPU
                _engines_hold(workers, changed_state if version == 1 else start, tp)
            s = workers.refitter.last_stats
            print(f"{case}: refit to version {version} in {s.seconds:.3f} s, {s.num_buckets} buckets, "
                  f"{s.bytes / 2**20:.1f} MiB; per-engine tokens "
                  f"{[metrics[f'generation/engine_{e}/tokens'] for e in range(engines)]}")
            assert group.weight_version().weights == version
            assert all(metrics[f"generation/engine_{e}/tokens"] > 0 for e in range(engines))
            for e, out in enumerate(per_engine[-1]):
                assert torch.equal(out.token_ids, per_engine[-1][0].token_ids), e  # same weights, same greedy rollout
            # spread over the engines, rows come back in order: vLLM batches differently, so a row may drift
            same = sum(torch.equal(whole.token_ids[i], per_engine[-1][0].token_ids[i]) for i in range(len(ids)))
            print(f"{case}: group rollout vs engine 0 alone: {same}/{len(ids)} rows identical")
            assert same >= len(ids) // 2
        for e in range(engines):  # every engine's rollout follows the refit
            moved = sum(not torch.equal(per_engine[0][e].token_ids[i], per_engine[1][e].token_ids[i])
                        for i in range(len(ids)))
            assert moved >= len(ids) // 2, (e, moved)
    finally:
        workers.shutdown()
        ray.shutdown()
