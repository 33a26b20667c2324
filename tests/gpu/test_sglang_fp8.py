"""SGLang 0.5.17 FP8 rollout engine on the GPU host (``pytest -m gpu -s tests/gpu/test_sglang_fp8.py``; skipped
without SGLang, which lives in a site folder of its own there: docs/rollout-engines.md).

Random-weight Qwen3-shaped models (``tests/gpu/helpers.py``: hidden 1024, 4 layers, 8 heads / 4 KV heads of 128,
every Linear FP8-eligible), no tokenizer. One SGLang engine at a time (``_Engines``: two in one process would each
claim ``mem_fraction_static`` of the GPU), Triton block GEMM (``use_deep_gemm: false``: no DeepGEMM JIT at start),
FA3 attention, CUDA graphs on, colocated (``enable_memory_saver``):

* after one FP8 refit, greedy outputs equal those of an SGLang engine that loaded the same FP8 checkpoint from disk
  (the refit's tensors are what a block-FP8 checkpoint holds);
* a refit with other weights changes them, refitting the first weights brings them back;
* memory and every parameter's address stay put over 10 refits (in place: CUDA graphs stay valid);
* a release of the weights' memory discards them, a refit restores the same outputs;
* FP8 KV cache: an engine never given scales does not generate; the scales of a refit land in every attention
  layer's ``k_scale`` / ``v_scale`` exactly and change the outputs; a refit without scales is refused.
"""

from __future__ import annotations

import gc
import json
import shutil

import pytest
import torch

pytestmark = pytest.mark.gpu
sglang = pytest.importorskip("sglang")

from nemo_fp8.fp8.kv_scales import KvScales  # noqa: E402
from nemo_fp8.generation.config import VllmConfig  # noqa: E402
from nemo_fp8.generation.interfaces import SamplingParams  # noqa: E402
from nemo_fp8.generation.sglang.config import SglangConfig  # noqa: E402
from tests.gpu.helpers import EOS, MAX_LEN, hf_state, perturbed, prompts, save_qwen3  # noqa: E402

NUM_LAYERS = 4
GREEDY = SamplingParams(max_new_tokens=24, greedy=True)
FP8 = dict(precision="fp8", num_last_layers_in_bf16=1)
SGL = SglangConfig(mem_fraction_static=0.25, max_running_requests=64)


def _backend(path, **cfg):
    from nemo_fp8.generation.sglang.backend import SglangGenerationBackend

    return SglangGenerationBackend(str(path), VllmConfig(**{**FP8, **cfg}), SGL, pad_token_id=0, eos_token_id=EOS,
                                   max_total_sequence_length=MAX_LEN, colocated=True)


def _refit(be, state, version, kv: KvScales = None):
    be.start_weight_update(version)
    be.update_weights(state.items())
    if kv is not None:
        be.update_weights(kv.named_tensors())
    return be.finish_weight_update(require_kv_scales=kv is not None)


def _responses(out) -> list[list[int]]:
    return [out.token_ids[i, p:p + r].tolist()
            for i, (p, r) in enumerate(zip(out.prompt_lengths.tolist(), out.response_lengths.tolist()))]


def _scales(amax: float, step: int) -> KvScales:
    a = torch.full((NUM_LAYERS,), amax)
    return KvScales.from_amax(a, a, a * 0.5, step)


class _Engines:
    """The module's engines, one alive at a time: asking for one shuts the other down first."""

    def __init__(self, model_dir):
        self.model_dir, self.name, self.backend = model_dir, None, None

    def get(self, name: str, **cfg):
        if self.name != name:
            self.close()
            self.backend, self.name = _backend(self.model_dir, **cfg), name
        return self.backend

    def close(self):
        if self.backend is not None:
            self.backend.shutdown()
            self.backend, self.name = None, None
            gc.collect()
            torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return save_qwen3(tmp_path_factory.mktemp("m") / "qwen3")


@pytest.fixture(scope="module")
def engines(dense_dir):
    e = _Engines(dense_dir)
    yield e
    e.close()


def _save_fp8_checkpoint(src, dst, spec) -> None:
    """``src``'s weights as an FP8 block checkpoint in ``dst``: each tensor as the refit converts it
    (``RefitPlan.convert``: e4m3 weight + fp32 ``weight_scale_inv`` per FP8 Linear, bf16 otherwise) and the
    engine's ``quantization_config`` in ``config.json``."""
    from safetensors.torch import save_file

    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    out = {}
    for name, t in hf_state(src).items():
        for n, c in spec.refit_plan.convert(name, t.cuda()):
            out[n] = c.cpu().contiguous()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = json.loads(spec.engine_kwargs["json_model_override_args"])["quantization_config"]
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))


def test_refit_equals_an_engine_loaded_from_the_fp8_checkpoint(engines, dense_dir, tmp_path):
    from sglang.srt.entrypoints.engine import Engine

    from nemo_fp8.generation.sglang.engine_args import build_engine_spec

    engines.close()
    be_spec = build_engine_spec(VllmConfig(**FP8), SGL, str(dense_dir), str(dense_dir), colocated=True,
                                max_total_sequence_length=MAX_LEN)
    fp8_dir = tmp_path / "qwen3-fp8"
    _save_fp8_checkpoint(dense_dir, fp8_dir, be_spec)
    ps = prompts(16)
    disk = Engine(**{**be_spec.engine_kwargs, "model_path": str(fp8_dir), "load_format": "auto"})
    try:
        outs = disk.generate(input_ids=ps, sampling_params=[{"max_new_tokens": 24, "temperature": 0.0,
                                                             "stop_token_ids": [EOS]}] * len(ps))
        from_disk = [list(o["output_ids"]) for o in outs]
    finally:
        disk.shutdown()
        gc.collect()
        torch.cuda.empty_cache()
    be = engines.get("dense")  # its initial load is the refit of version 0 from the BF16 checkpoint
    refit = _responses(be.generate(ps, GREEDY))
    same = sum(a == b for a, b in zip(refit, from_disk))
    print(f"refit vs FP8 checkpoint from disk: {same}/16 greedy sequences identical")
    assert refit == from_disk


def test_other_weights_change_the_outputs_and_the_first_bring_them_back(engines, dense_dir):
    be = engines.get("dense")
    state = hf_state(dense_dir)
    ps = prompts(16, seed=1)
    a = be.generate(ps, GREEDY)
    assert _refit(be, perturbed(state, 7), 1).weights == 1
    b = be.generate(ps, GREEDY)
    changed = sum(x != y for x, y in zip(_responses(a), _responses(b)))
    _refit(be, state, 2)
    a2 = be.generate(ps, GREEDY)
    diff = (a.generation_logprobs - a2.generation_logprobs).abs().max().item()
    print(f"other weights changed {changed}/16 outputs; the first weights again: max logprob |diff| {diff:.2e}")
    assert changed >= 12
    assert torch.equal(a.token_ids, a2.token_ids) and diff <= 1e-3


def test_memory_and_parameter_addresses_flat_over_10_refits(engines, dense_dir):
    be = engines.get("dense")
    state = {k: v.cuda() for k, v in hf_state(dense_dir).items()}
    _refit(be, state, 10)
    s0 = be.engine_state()
    for i in range(10):
        _refit(be, state, 11 + i)
    s1 = be.engine_state()
    print("engine memory after refit 1:", s0["memory"], "after 11:", s1["memory"])
    assert len(s0["param_ptrs"]) > 0 and s1["param_ptrs"] == s0["param_ptrs"]
    assert s1["memory"]["allocated"] == s0["memory"]["allocated"]


def test_a_release_discards_the_weights_and_a_refit_restores_them(engines, dense_dir):
    be = engines.get("dense")
    state = hf_state(dense_dir)
    _refit(be, state, 30)
    ps = prompts(8, seed=2)
    before = be.generate(ps, GREEDY)
    ptrs = be.engine_state()["param_ptrs"]
    be.finish_generation()
    assert be.weight_version().weights == -1
    with pytest.raises(RuntimeError, match="discarded its weights"):
        be.prepare_for_generation()
    _refit(be, state, 31)
    be.prepare_for_generation()
    after = be.generate(ps, GREEDY)
    assert torch.equal(before.token_ids, after.token_ids)
    assert be.engine_state()["param_ptrs"] == ptrs


def test_sampled_logprobs_are_of_the_sampled_distribution(engines):
    be = engines.get("dense")
    out = be.generate(prompts(8, seed=3), SamplingParams(max_new_tokens=16, temperature=0.7, seed=5))
    m = out.token_mask.bool()
    assert (out.generation_logprobs[m] <= 0).all() and (out.generation_logprobs[~m] == 0).all()
    assert out.generation_logprobs[m].lt(0).any()


def test_a_kv_engine_never_given_scales_does_not_generate(engines):
    be = engines.get("kv", kv_cache_dtype="fp8")
    assert be.weight_version().kv_scales == -1
    with pytest.raises(RuntimeError, match="no KV scales were ever loaded"):
        be.generate(prompts(2), GREEDY)


def test_kv_scales_land_in_every_layer_and_change_the_outputs(engines, dense_dir):
    be = engines.get("kv", kv_cache_dtype="fp8")
    state = hf_state(dense_dir)
    fine, coarse = _scales(16.0, 1), _scales(1e5, 2)  # coarse: K/V mostly round to e4m3 zero
    ps = prompts(16, seed=4)
    assert _refit(be, state, 1, fine).kv_scales == 1
    held = be.engine_state()["kv_scales"]
    assert sorted(held) == list(range(NUM_LAYERS))
    for i, rec in held.items():
        assert rec["k"] == float(fine.k_scale[i]) and rec["v"] == float(fine.v_scale[i]), (i, rec)
    print("SGLang's load-time k/v floats (unused by FA3):", {i: (r["k_float"], r["v_float"]) for i, r in held.items()})
    a = be.generate(ps, GREEDY)
    _refit(be, state, 2, coarse)
    held = be.engine_state()["kv_scales"]
    assert all(rec["k"] == float(coarse.k_scale[i]) for i, rec in held.items())
    b = be.generate(ps, GREEDY)
    _refit(be, state, 3, _scales(16.0, 3))
    a2 = be.generate(ps, GREEDY)
    changed = sum(x != y for x, y in zip(_responses(a), _responses(b)))
    print(f"coarse KV scales changed {changed}/16 outputs; the fine ones again: "
          f"{sum(x == y for x, y in zip(_responses(a), _responses(a2)))}/16 identical")
    assert changed >= 8 and torch.equal(a.token_ids, a2.token_ids)


def test_a_refit_without_scales_is_refused(engines, dense_dir):
    be = engines.get("kv", kv_cache_dtype="fp8")
    state = hf_state(dense_dir)
    _refit(be, state, 5, _scales(16.0, 5))
    be.start_weight_update(6)
    be.update_weights(state.items())
    with pytest.raises(RuntimeError, match="refit to version 6: kv_cache_dtype='fp8' but no KV scales"):
        be.finish_weight_update()
    with pytest.raises(RuntimeError, match="the last refit was refused"):
        be.generate(prompts(2), GREEDY)
    # what the refusal guards against: SGLang still holds step 5's scales beside step 6's weights
    assert all(rec["k"] == float(_scales(16.0, 5).k_scale[i]) for i, rec in be.engine_state()["kv_scales"].items())
    assert _refit(be, state, 7, _scales(16.0, 7)).kv_scales == 7
    be.generate(prompts(2), GREEDY)
