"""Pipeline parallelism (and the gradient finalisation it shares with tensor parallelism) of the megatron backend on
2-4 GPUs (``pytest -m gpu tests/gpu/test_megatron_pipeline.py``, an nvidia-h100-x4 / x2 machine).

Each layout runs in its own processes (one per rank, NCCL) on the same random 4-layer Qwen3 checkpoint and batch:
log-probs, one training step (loss, gradient norm), log-probs after it, and the exported weights (every HF tensor
once, gathered from every stage). Pipeline stages run the same GEMMs on the same shapes as one GPU does and pass
bf16 hidden states unchanged, so PP 2 (1F1B) and PP 2 x 2 virtual stages (interleaved) give PP 1's log-probs exactly
and its update up to the gradient norm's reduction order. Tensor parallel 2 with sequence parallelism sums the gradients of
the norms each rank holds whole (the layer norms, Qwen3's q/k norms) over its ranks (megatron-core's ``finalize_model_grads``): after a step both ranks hold the same
norm weights.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch

pytestmark = pytest.mark.gpu
os.environ["NVTE_FP8_BLOCK_SCALING_FP32_SCALES"] = "1"
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("megatron.bridge")
pytest.importorskip("transformer_engine")

from nemo_fp8.algorithms.config import ClippedPGLossConfig  # noqa: E402
from nemo_fp8.algorithms.loss import ClippedPGLossFn  # noqa: E402
from nemo_fp8.policy.spec import PolicySpec  # noqa: E402
from tests.gpu.helpers import save_qwen3  # noqa: E402
from tests.gpu.test_megatron_policy import _batch, _policy_cfg  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_qwen3(tmp_path_factory.mktemp("m") / "qwen3")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, path: str, layout: dict, out) -> None:
    from megatron.core import parallel_state

    from nemo_fp8.policy.megatron.backend import MegatronPolicyBackend

    torch.cuda.set_device(rank)
    cfg = _policy_cfg(path, lr=1e-4, **layout)
    be = MegatronPolicyBackend(PolicySpec.from_config(cfg, torch.device("cuda", rank)), rank=rank, world_size=world,
                               dist_init_method=f"tcp://127.0.0.1:{port}")
    batch = _batch()
    batch.prev_logprobs = be.get_logprobs(batch)
    batch.generation_logprobs = batch.prev_logprobs.clone()
    metrics = be.train(batch, ClippedPGLossFn(ClippedPGLossConfig()))
    after = be.get_logprobs(batch)
    weights = {n: t.float().cpu() for n, t in be.named_weights()}
    norms = {n: p.detach().float().cpu() for n, p in be.model.named_parameters() if "norm" in n}
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    if last and parallel_state.get_tensor_model_parallel_rank() == 0:
        out["lp"], out["after"], out["metrics"] = batch.prev_logprobs, after, metrics
    if rank == 0:
        out["weights"] = weights
    out[f"norms{rank}"] = norms
    be.shutdown()


def _run(ckpt, world: int, **layout) -> dict:
    import torch.multiprocessing as mp

    out = mp.Manager().dict()
    mp.start_processes(_rank, args=(world, _free_port(), str(ckpt), layout, out), nprocs=world, join=True,
                       start_method="spawn")
    return dict(out)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="pipeline parallel 2 needs two GPUs")
def test_pipeline_parallel_matches_one_stage(ckpt):
    one = _run(ckpt, 1)
    mask = _batch().token_mask.bool()
    for layout in (dict(pipeline_model_parallel_size=2),
                   dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)):
        pp = _run(ckpt, 2, **layout)
        d_lp = (pp["lp"] - one["lp"])[mask].abs()
        d_after = (pp["after"] - one["after"])[mask].abs()
        d_w = max((pp["weights"][n] - w).abs().max().item() for n, w in one["weights"].items())
        print(f"{layout}: |dlogp| max {d_lp.max():.2e}; after the step {d_after.max():.2e}; loss "
              f"{pp['metrics']['loss']:.6f} vs {one['metrics']['loss']:.6f}; grad_norm "
              f"{pp['metrics']['grad_norm']:.6f} vs {one['metrics']['grad_norm']:.6f}; weights max |d| {d_w:.2e}")
        assert sorted(pp["weights"]) == sorted(one["weights"])  # every tensor, once, with its global name
        assert d_lp.max() <= 1e-6
        assert pp["metrics"]["loss"] == pytest.approx(one["metrics"]["loss"], rel=1e-6)
        assert pp["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=1e-3)
        assert d_w < 1e-3 and d_after.mean() < 1e-3


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallel 2 needs two GPUs")
def test_sequence_parallel_ranks_keep_the_same_layer_norms(ckpt):
    tp = _run(ckpt, 2, tensor_model_parallel_size=2, sequence_parallel=True)
    assert tp["norms0"] and sorted(tp["norms0"]) == sorted(tp["norms1"])
    for name, w in tp["norms0"].items():
        assert torch.equal(w, tp["norms1"][name]), name
