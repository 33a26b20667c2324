"""The refit over NCCL broadcast into a vLLM engine on a GPU of its own (GPU host with at least two GPUs).

``VLLM_USE_DEEP_GEMM=0 pytest -m gpu -s tests/gpu/test_weight_sync_nccl.py`` (``-s`` prints the numbers).

``start_workers``' layout for ``policy.weight_sync.method=nccl``: one torch policy rank (the tiny model, fp32)
on one GPU, an FP8 vLLM engine of one GPU in a bundle of its own (``policy.generation.colocated.enabled=false``),
and the refit's NCCL group of the two formed at start (vLLM 0.22's ``NCCLWeightTransferEngine``: policy rank 0
the trainer, the engine's worker rank 1). NCCL cannot put two ranks of one group on one GPU, hence two GPUs.

* the engine starts without weights; the first refit (version 0) puts our reference quantization
  (``nemo_fp8.fp8.quantize_weight_blockwise``) of the policy's weights into the engine's FP8 parameters bit
  for bit (q/k/v, gate/up fused as vLLM holds them; o and down);
* a second refit, of perturbed weights, does the same for those and changes the greedy rollouts; a third,
  back to the first weights, brings the first rollouts back: the rollouts follow the refits;
* the refit's stats count every converted tensor and byte (what ``nccl_update_info`` lists), in several
  buckets; the refit seconds are printed.

Not yet run: written without a two-GPU host.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2,
                                 reason="needs two GPUs (NCCL cannot put two ranks of one group on one GPU)")]
vllm = pytest.importorskip("vllm")

from nemo_fp8.generation.interfaces import SamplingParams  # noqa: E402
from nemo_fp8.policy.spec import PolicySpec
from tests.gpu.helpers import decode_engine_params, fused_fp8_reference, save_perturbed_policy  # noqa: E402

CPU = torch.device("cpu")
LAYERS = (0, 2)


def _engine_weights(workers, names):
    """The engine's parameters ``names`` (its only worker), read through the engine actor."""
    import ray

    return decode_engine_params(ray.get(workers.generation.worker.engine_params.remote(names)))[0]



def _assert_engine_holds(workers, state):
    want = fused_fp8_reference(state, LAYERS)
    got = _engine_weights(workers, list(want))
    for name, w in want.items():
        assert got[name].dtype == w.dtype and got[name].shape == w.shape, (name, got[name].dtype, got[name].shape)
        assert torch.equal(got[name].view(torch.uint8), w.view(torch.uint8)), name
    assert got[f"model.layers.{LAYERS[0]}.self_attn.qkv_proj.weight"].dtype == torch.float8_e4m3fn


def test_refit_over_nccl_into_an_engine_on_its_own_gpu(tiny_cfg, tmp_path):
    import ray

    from nemo_fp8.distributed.weight_sync import NcclWeightSync, update_info_stats
    from nemo_fp8.distributed.cluster import init_ray
    from nemo_fp8.generation.vllm.refit import build_refit_plan, nccl_update_info
    from nemo_fp8.models.hf import load_tokenizer
    from nemo_fp8.policy.torch_backend import TorchPolicyBackend
    from nemo_fp8.trainer import start_workers
    from nemo_fp8.utils.timer import Timer

    cfg = tiny_cfg("policy.generation.backend=vllm", "policy.generation.colocated.enabled=false",
                   "policy.weight_sync.method=nccl", "policy.weight_sync.bucket_size_mb=1",
                   "policy.generation.vllm_cfg.gpu_memory_utilization=0.3", "policy.device=cuda")
    tok = load_tokenizer(cfg.policy.model_name)
    # what the policy rank loads: fp32
    start = dict(TorchPolicyBackend(PolicySpec.from_config(cfg.policy, CPU)).named_weights())
    changed_state = save_perturbed_policy(cfg.policy, tmp_path / "changed")
    plan, _ = build_refit_plan(cfg.policy.generation.vllm_cfg, cfg.policy.model_name)
    sent = [(n, t) for n, t in start.items() if n != "lm_head.weight"]  # tied: the engine skips it
    want_tensors, want_bytes = update_info_stats(nccl_update_info(sent, plan))

    init_ray(None, num_cpus=8)
    workers = start_workers(cfg, tok)
    try:
        sync = workers.refitter.weight_sync
        assert isinstance(sync, NcclWeightSync) and sync.world_size == 2
        assert not workers.refitter.offload_trainer  # the engine has its own GPU: nothing to move
        assert workers.generation.weight_version().weights == -1  # no initial load: weights come with the refit
        workers.policy.save(tmp_path / "start")
        ids = [tok.encode(f"Q: What is {i} + {2 * i}?\n", add_special_tokens=False) for i in range(16)]
        sp = SamplingParams(max_new_tokens=8, greedy=True)
        outs, stats = [], []
        for version, path in ((0, None), (1, tmp_path / "changed"), (2, tmp_path / "start")):
            if path is not None:
                workers.policy.load(path)
                workers.refitter.mark_stale(version)
            timer = Timer()
            with workers.refitter.generating(timer):
                outs.append(workers.generation.generate(ids, sp))
            stats.append(workers.refitter.last_stats)
            assert workers.generation.weight_version().weights == version
            _assert_engine_holds(workers, changed_state if version == 1 else start)
            s = stats[-1]
            print(f"NCCL refit to version {version}: {s.seconds:.3f} s (refit phase {timer.pop()['refit']:.3f} s), "
                  f"{s.num_buckets} buckets, {s.num_tensors} tensors, {s.bytes / 2**20:.2f} MiB, largest bucket "
                  f"{s.max_bucket_bytes / 2**20:.2f} MiB")
        for s, version in zip(stats, (0, 1, 2)):
            assert s.version == version and s.num_buckets > 1
            assert (s.num_tensors, s.bytes) == (want_tensors, want_bytes)
        moved = sum(not torch.equal(outs[0].token_ids[i], outs[1].token_ids[i]) for i in range(len(ids)))
        print(f"greedy rollouts changed by the perturbed refit: {moved}/{len(ids)}; back to the first weights: "
              f"{sum(torch.equal(outs[0].token_ids[i], outs[2].token_ids[i]) for i in range(len(ids)))}/{len(ids)} "
              "identical")
        assert int(outs[0].response_lengths.sum()) > 0
        assert moved >= len(ids) // 2
        assert torch.equal(outs[0].token_ids, outs[2].token_ids)
    finally:
        workers.shutdown()
        ray.shutdown()
