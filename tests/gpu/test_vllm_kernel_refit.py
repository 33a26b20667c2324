"""The refit in the engine's kernel format (``vllm_cfg.refit_format: kernel``; ``pytest -m gpu
tests/gpu/test_vllm_kernel_refit.py``): an FP8 engine on CUTLASS's block-scaled kernel and a BF16 one, each refit in
kernel format, hold every parameter bit for bit where the same weights refit in checkpoint format (vLLM's layerwise
reload) leave an engine of the other format, give the same greedy tokens, and keep their parameters' addresses over
refits. The time of both formats' refits is printed side by side. With packed buckets filled in place
(``policy.weight_sync.pack_in_place``) the engine ends with the packed refit's bytes.
"""

from __future__ import annotations

import gc
import os
import time

import pytest
import torch

pytestmark = pytest.mark.gpu
vllm = pytest.importorskip("vllm")

from nemo_fp8.generation.interfaces import SamplingParams  # noqa: E402
from tests.gpu.helpers import (engine as _engine, engine_params as _engine_params, hf_state as _hf_state,  # noqa: E402
                               perturbed as _perturbed, prompts as _prompts, save_qwen3 as _save_qwen3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _save_qwen3(tmp_path_factory.mktemp("m") / "qwen3")


def _timed_refit(engine, state, version) -> float:
    t0 = time.perf_counter()
    engine.start_weight_update(version)
    engine.update_weights(state.items())
    assert engine.finish_weight_update(require_kv_scales=False).weights == version
    return time.perf_counter() - t0


@pytest.mark.parametrize("precision", ["fp8", "bfloat16"])
def test_kernel_format_refit_loads_what_the_checkpoint_refit_loads(model_dir, precision):
    os.environ.setdefault("VLLM_USE_DEEP_GEMM", "0")
    state = {k: v.cuda() for k, v in _perturbed(_hf_state(model_dir), 5).items()}
    prompts, sp = _prompts(8, seed=4), SamplingParams(max_new_tokens=16, greedy=True)
    got, outs, seconds, ptrs = {}, {}, {}, {}
    for fmt in ("checkpoint", "kernel"):
        be = _engine(model_dir, precision=precision, num_last_layers_in_bf16=1, refit_format=fmt)
        try:
            names = list(be.llm.collective_rpc("nemo_fp8_param_info")[0])
            ptr0 = {n: p for n, (_, _, p) in be.llm.collective_rpc("nemo_fp8_param_info")[0].items()}
            seconds[fmt] = [_timed_refit(be, state, 2 + i) for i in range(5)]
            ptrs[fmt] = ptr0 == {n: p for n, (_, _, p) in be.llm.collective_rpc("nemo_fp8_param_info")[0].items()}
            got[fmt] = _engine_params(be, names)
            outs[fmt] = be.generate(prompts, sp)
        finally:
            be.shutdown()
            gc.collect()
    print(f"{precision}: refit s, checkpoint format {seconds['checkpoint']}, kernel format {seconds['kernel']}")
    assert ptrs == {"checkpoint": True, "kernel": True}
    assert got["checkpoint"].keys() == got["kernel"].keys()
    for n, a in got["checkpoint"].items():
        b = got["kernel"][n]
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), n
    assert torch.equal(outs["checkpoint"].token_ids, outs["kernel"].token_ids)


@pytest.mark.parametrize("precision", ["fp8", "bfloat16"])
def test_buckets_filled_in_place_load_what_the_packed_refit_loads(model_dir, precision):
    """``policy.weight_sync.pack_in_place``: an engine in kernel format refit in packed buckets, the first refit
    recording the stream and the later ones filling the planned buckets in place (the FP8 quantizer writing into
    the buffer), holds every parameter bit for bit as the same refits through the packed path leave it, with the
    parameters' addresses unchanged. The refits' seconds of both paths are printed side by side."""
    from nemo_fp8.generation.vllm.packed_in_place import InPlacePacker

    os.environ.setdefault("VLLM_USE_DEEP_GEMM", "0")
    base = _hf_state(model_dir)
    states = [{k: v.cuda() for k, v in _perturbed(base, seed).items()} for seed in (5, 6)]
    got, seconds, ptrs = {}, {}, {}
    for mode in ("packed", "in_place"):
        be = _engine(model_dir, precision=precision, num_last_layers_in_bf16=1, refit_format="kernel")
        try:
            packer = InPlacePacker(be.bucket_bytes) if mode == "in_place" else None
            info = be.llm.collective_rpc("nemo_fp8_param_info")[0]
            seconds[mode] = []
            for i in range(4):  # the states alternate, so each refit changes every weight
                t0 = time.perf_counter()
                be.start_weight_update(2 + i)
                be.update_weights(states[i % 2].items(), packed=True, packer=packer)
                assert be.finish_weight_update(require_kv_scales=False).weights == 2 + i
                seconds[mode].append(round(time.perf_counter() - t0, 4))
            assert packer is None or packer.layout is not None
            after = be.llm.collective_rpc("nemo_fp8_param_info")[0]
            ptrs[mode] = {n: p for n, (_, _, p) in info.items()} == {n: p for n, (_, _, p) in after.items()}
            got[mode] = _engine_params(be, list(info))
        finally:
            be.shutdown()
            gc.collect()
    print(f"{precision}: refit s, packed {seconds['packed']}, filled in place {seconds['in_place']} (the first "
          f"in-place refit records its stream the packed way)")
    assert ptrs == {"packed": True, "in_place": True}
    assert got["packed"].keys() == got["in_place"].keys()
    for n, a in got["packed"].items():
        b = got["in_place"][n]
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), n
