"""FP8 KV cache in the vLLM FP8 engine, fed by the policy's per-step calibration (GPU host).

``VLLM_USE_DEEP_GEMM=0 pytest -m gpu -s tests/gpu/test_vllm_fp8_kv.py`` (``-s`` prints the numbers).

One random-weight Qwen3-shaped model (``tests/gpu/helpers.py``: hidden 1024, 4 layers, head_dim
128), one colocated engine (FP8 W8A8 blockwise with CUTLASS kernels, ``kv_cache_dtype="fp8"``,
FlashAttention 3 on Hopper) and the torch reference policy (bf16) that measures the scales:

* the scales ``calibrate_kv_scales`` measures reach every attention layer of the engine exactly
  (``_{q,k,v}_scale`` and vLLM's host copies, read through the worker extension);
* an engine never given scales does not generate, a refit without scales is refused (vLLM would
  keep the previous step's, silently) and leaves the engine refusing to generate;
* greedy rollouts and log-probs of the engine vs the torch reference with the same FP8 KV
  emulation (``nemo_fp8.models.hf.enable_fp8_kv_attention``), with the numbers printed;
* a second refit with other scales replaces them (not stale) and they are live in the kernels.
"""

from __future__ import annotations

import gc
import re
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

pytestmark = pytest.mark.gpu
vllm = pytest.importorskip("vllm")

from nemo_fp8.batch import TrainBatch  # noqa: E402
from nemo_fp8.fp8.kv_scales import KvScales  # noqa: E402
from nemo_fp8.generation.config import VllmConfig  # noqa: E402
from nemo_fp8.generation.interfaces import SamplingParams  # noqa: E402
from nemo_fp8.policy.spec import PolicySpec
from tests.gpu.helpers import EOS, MAX_LEN, engine, prompts, save_qwen3, score  # noqa: E402

NUM_LAYERS = 4  # save_qwen3
_ATTN_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.attn$")


@dataclass
class KvEngine:
    """The module's engine and what its first ``generate`` said, before any scales arrived.

    Attributes:
        backend: ``VllmGenerationBackend`` (FP8 weights and FP8 KV cache).
        fresh_error: the ``RuntimeError`` message of that call (None: it generated).
    """

    backend: object
    fresh_error: Optional[str]


def calibration_batch(seed: int, n: int = 32, width: int = 96) -> TrainBatch:
    """``n`` rows: a random prompt (8..47 tokens) and random "response" tokens, 16 to ``width`` in all.

    Long enough to cover the positions the rollouts below reach (RoPE changes q/k with position).
    """
    ps = prompts(n, seed)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.zeros((n, width), dtype=torch.long)
    plen = torch.tensor([len(p) for p in ps])
    rlen = torch.stack([torch.randint(16, width - int(p) + 1, (1,), generator=g)[0] for p in plen])
    for i, p in enumerate(ps):
        ids[i, :len(p)] = torch.tensor(p)
        ids[i, len(p):len(p) + int(rlen[i])] = torch.randint(2, 4096, (int(rlen[i]),), generator=g)
    return TrainBatch(ids, plen, rlen, torch.zeros(n), torch.zeros((n, width)))


def calibrate(policy, seed: int, margin: float = 1.0, step: int = 1) -> KvScales:
    return policy.calibrate_kv_scales(calibration_batch(seed), step=step, margin=margin)


def refit_with_scales(be, policy, kv: KvScales, version: int):
    """A full refit as the trainer sends it: the policy's weights, then its KV scales."""
    be.start_weight_update(version)
    be.update_weights(policy.named_weights())
    be.update_weights(kv.named_tensors())
    return be.finish_weight_update()


def engine_scales(be) -> dict[int, dict]:
    """layer index -> the scales its attention layer holds (``Fp8WorkerExtension.nemo_fp8_attn_scales``)."""
    out = {}
    for name, rec in be.llm.collective_rpc("nemo_fp8_attn_scales")[0].items():
        m = _ATTN_RE.search(name)
        assert m is not None, f"unexpected attention module {name!r}"
        out[int(m.group(1))] = rec
    return out


def assert_engine_holds(be, kv: KvScales) -> None:
    got = engine_scales(be)
    assert sorted(got) == list(range(kv.num_layers)), sorted(got)
    for i, rec in got.items():
        assert rec["kv_cache_dtype"].startswith("fp8"), rec
        for kind in "qkv":
            want = float(getattr(kv, f"{kind}_scale")[i])
            assert rec[kind] == want, f"layer {i} {kind}: engine {rec[kind]!r}, sent {want!r}"
            assert rec[f"{kind}_float"] == want, f"layer {i} {kind} host copy: {rec[f'{kind}_float']!r} vs {want!r}"


def torch_reference(model_dir, policy, kv: Optional[KvScales], precision: str = "fp8"):
    """The torch generation backend refit with the policy's weights (and ``kv``: FP8 KV emulation on)."""
    from nemo_fp8.generation.torch_backend import TorchGenerationBackend

    cfg = VllmConfig(precision=precision, kv_cache_dtype="fp8" if kv is not None else "auto")
    ref = TorchGenerationBackend(str(model_dir), cfg, torch.device("cuda"), pad_token_id=0, eos_token_id=EOS,
                                 max_total_sequence_length=MAX_LEN, batch_size=64)
    ref.start_weight_update(1)
    ref.update_weights(policy.named_weights())
    if kv is not None:
        ref.update_weights(kv.named_tensors())
    ref.finish_weight_update()
    return ref


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_qwen3(tmp_path_factory.mktemp("kv") / "qwen3", seed=5)


@pytest.fixture(scope="module")
def policy(model_dir):
    from nemo_fp8.policy.config import PolicyConfig
    from nemo_fp8.policy.torch_backend import TorchPolicyBackend

    cfg = PolicyConfig(model_name=str(model_dir), precision="bfloat16", device="cuda", logprob_batch_size=32)
    yield TorchPolicyBackend(PolicySpec.from_config(cfg, torch.device("cuda")))
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def kv_engine(model_dir):
    be = engine(model_dir, kv_cache_dtype="fp8")  # loads the checkpoint's weights, no scales
    try:
        be.generate(prompts(2), SamplingParams(max_new_tokens=2, greedy=True))
        fresh = None
    except RuntimeError as e:
        fresh = str(e)
    yield KvEngine(be, fresh)
    be.shutdown()
    gc.collect()


def test_refit_lands_the_policys_scales_in_every_attention_layer(kv_engine, policy):
    be = kv_engine.backend
    kv = calibrate(policy, seed=0)
    assert kv.num_layers == NUM_LAYERS
    v = refit_with_scales(be, policy, kv, 1)
    assert (v.weights, v.kv_scales) == (1, 1)
    print("calibrated scales (q, k, v per layer):",
          [(round(float(kv.q_scale[i]), 6), round(float(kv.k_scale[i]), 6), round(float(kv.v_scale[i]), 6))
           for i in range(kv.num_layers)])
    assert_engine_holds(be, kv)
    rec = engine_scales(be)[0]
    print(f"attention: {rec['impl']}, FlashAttention {rec['fa_version']}, FP8 q: {rec['query_quant']}")
    # the torch emulation quantizes q as well as k and v: true of FlashAttention 3 with an FP8 KV cache
    assert rec["query_quant"], rec
    out = be.generate(prompts(8, seed=1), SamplingParams(max_new_tokens=8, greedy=True))
    m = out.token_mask.bool()
    assert int(out.response_lengths.sum()) > 0 and torch.isfinite(out.generation_logprobs[m]).all()


def test_stale_scales_are_refused(kv_engine, policy):
    be = kv_engine.backend
    assert kv_engine.fresh_error is not None and "no KV scales were ever loaded" in kv_engine.fresh_error
    kv = calibrate(policy, seed=0)
    refit_with_scales(be, policy, kv, 2)
    be.start_weight_update(3)
    be.update_weights(policy.named_weights())  # weights only
    with pytest.raises(RuntimeError, match="no KV scales were sent"):
        be.finish_weight_update()
    assert be.weight_version().weights == 2
    # what the guard is for: vLLM itself kept the previous refit's scales, silently
    assert_engine_holds(be, kv)
    sp = SamplingParams(max_new_tokens=4, greedy=True)
    with pytest.raises(RuntimeError, match="last refit was refused"):
        be.generate(prompts(2), sp)
    v = refit_with_scales(be, policy, kv, 4)
    assert (v.weights, v.kv_scales) == (4, 4)
    assert int(be.generate(prompts(2), sp).response_lengths.sum()) > 0


def test_vllm_fp8_kv_matches_torch_fp8_kv_reference(kv_engine, policy, model_dir):
    be = kv_engine.backend
    kv = calibrate(policy, seed=0)
    refit_with_scales(be, policy, kv, 10)
    ps, sp = prompts(32, seed=5), SamplingParams(max_new_tokens=48, greedy=True)
    a = be.generate(ps, sp)
    m = a.token_mask.bool()
    ref = torch_reference(model_dir, policy, kv)
    b = ref.generate(ps, sp)
    lp_kv = score(ref.model, a)  # torch FP8 + FP8 KV emulation, teacher forced on the engine's tokens
    del ref
    ref = torch_reference(model_dir, policy, None)
    lp_fp8 = score(ref.model, a)  # torch FP8 linears, BF16 attention
    del ref
    ref = torch_reference(model_dir, policy, None, precision="bfloat16")
    lp_bf16 = score(ref.model, a)
    del ref
    torch.cuda.empty_cache()
    lp_a = a.generation_logprobs
    assert torch.isfinite(lp_a[m]).all()
    d_engine = (lp_a - lp_kv)[m].abs()  # vLLM FP8+KV vs its torch emulation, same contexts
    d_no_kv = (lp_a - lp_fp8)[m].abs()  # vLLM FP8+KV vs torch FP8 without the KV emulation
    d_kv = (lp_fp8 - lp_kv)[m].abs()  # what the FP8 KV cache itself changes (torch)
    d_all = (lp_bf16 - lp_kv)[m].abs()  # what FP8 (weights, activations, KV) changes altogether (torch)
    same = total = seqs = 0
    prefix = []
    for i, p in enumerate(ps):
        n = len(p)
        k = min(int(a.response_lengths[i]), int(b.response_lengths[i]))
        eq = a.token_ids[i, n:n + k] == b.token_ids[i, n:n + k]
        same, total = same + int(eq.sum()), total + k
        prefix.append(int(eq.long().cumprod(0).sum()))
        seqs += int(torch.equal(a.token_ids[i, n:n + int(a.response_lengths[i])],
                                b.token_ids[i, n:n + int(b.response_lengths[i])]))
    print(f"vllm-fp8+kv vs torch-fp8+kv ({int(m.sum())} tokens, teacher forced on vLLM's): logprob |diff| max "
          f"{d_engine.max():.4f} mean {d_engine.mean():.4f}; vs torch-fp8 without KV emulation: max "
          f"{d_no_kv.max():.4f} mean {d_no_kv.mean():.4f}; FP8 KV's own effect (torch): mean {d_kv.mean():.4f}; "
          f"all of FP8 (torch bf16 vs fp8+kv): mean {d_all.mean():.4f}")
    print(f"greedy vllm-fp8+kv vs torch-fp8+kv: identical tokens {same}/{total} ({same / max(total, 1):.3f}) at "
          f"aligned positions; {seqs}/{len(ps)} sequences identical; mean common prefix "
          f"{sum(prefix) / len(prefix):.1f}/{sp.max_new_tokens}")
    # Same FP8 weights, activations quantized the same way, same static q/k/v scales: the engine differs from
    # its emulation only in kernels (GEMM accumulation order, FA3's internals, bf16 rounding). Loose bounds:
    # (1) nearer its emulation than BF16 is, i.e. below what FP8 changes altogether;
    assert d_engine.mean() < d_all.mean()
    # (2) the KV emulation does not move the reference away from the engine: with a faithful emulation
    # E|e| <= E|e + kv effect| for the engine noise e; the tolerance (a quarter of the KV effect, which bounds
    # each token's difference) covers the sampling noise of a 32-sequence mean.
    assert d_engine.mean() <= d_no_kv.mean() + 0.25 * d_kv.mean()


def test_second_refit_with_new_scales_is_not_stale(kv_engine, policy):
    be = kv_engine.backend
    kv1 = calibrate(policy, seed=0)
    kv2 = calibrate(policy, seed=3, margin=1.7, step=2)  # other data, non-power-of-two head-room: other grids
    for kind in "qkv":
        assert (getattr(kv1, f"{kind}_scale") != getattr(kv2, f"{kind}_scale")).all()
    ps, sp = prompts(16, seed=2), SamplingParams(max_new_tokens=24, greedy=True)
    refit_with_scales(be, policy, kv1, 20)
    out1 = be.generate(ps, sp)
    v = refit_with_scales(be, policy, kv2, 21)
    assert (v.weights, v.kv_scales) == (21, 21)
    assert_engine_holds(be, kv2)
    out2 = be.generate(ps, sp)
    rows = torch.arange(len(ps))
    first1 = out1.generation_logprobs[rows, out1.prompt_lengths]  # same prompt, same weights: only scales differ
    first2 = out2.generation_logprobs[rows, out2.prompt_lengths]
    d_first = (first1 - first2).abs().max().item()
    changed = sum(not torch.equal(out1.token_ids[i], out2.token_ids[i]) for i in range(len(ps)))
    refit_with_scales(be, policy, kv1, 22)
    assert_engine_holds(be, kv1)
    out3 = be.generate(ps, sp)
    back = (out1.generation_logprobs - out3.generation_logprobs).abs().max().item()
    print(f"new scales: first-token logprob max |diff| {d_first:.4f}, {changed}/{len(ps)} greedy outputs changed; "
          f"first scales again: {sum(torch.equal(out1.token_ids[i], out3.token_ids[i]) for i in range(len(ps)))}"
          f"/{len(ps)} identical, logprob max |diff| {back:.2e}")
    assert d_first > 1e-3  # the new scales are live in the kernels, not only stored
    assert torch.equal(out1.token_ids, out3.token_ids)
    assert back <= 1e-3


@pytest.mark.parametrize("level", [1, 2])
def test_scales_survive_the_engines_sleep_and_wake(kv_engine, policy, level):
    """vLLM 0.22's V1 runner resets k/v scales to 1.0 when an FP8 KV cache wakes (``init_fp8_kv_scales``); the
    backend restores the refit's and checks them live, for either sleep level (level 2 needs a refit first)."""
    be = kv_engine.backend
    be.vllm_cfg = be.vllm_cfg.model_copy(update={"sleep_level": level})
    kv = calibrate(policy, seed=7, margin=1.25, step=10 + level)
    refit_with_scales(be, policy, kv, 10 + level)
    before = be.generate(prompts(8, seed=3), SamplingParams(max_new_tokens=8, greedy=True))
    be.finish_generation()
    if level == 2:
        refit_with_scales(be, policy, kv, 10 + level)
    be.prepare_for_generation()
    assert_engine_holds(be, kv)
    after = be.generate(prompts(8, seed=3), SamplingParams(max_new_tokens=8, greedy=True))
    assert torch.equal(after.token_ids, before.token_ids)
