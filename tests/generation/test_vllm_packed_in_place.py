"""The in-place packed refit (``policy.weight_sync.pack_in_place``, ``packed_in_place``; CPU, no vLLM): buckets planned
from one refit's stream and filled in place hold the bytes the packed path sends, tensor for tensor, in the kernel
format (fused q/k/v and gate/up) and in the checkpoint format (FP8 KV scales as scalars); a stream that no longer
fits the plan is refused."""

from __future__ import annotations

import pytest
import torch

from nemo_fp8.generation.vllm.kernel_format import KernelLayout
from nemo_fp8.generation.vllm.packed_in_place import InPlacePacker, PackedLayout
from nemo_fp8.generation.vllm.refit import _buckets
from tests.generation.test_vllm_kernel_format import PACKED, _engine_params, _model_and_plan

CPU = torch.device("cpu")


def _state(model, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g).to(torch.bfloat16) for n, p in model.state_dict().items()}


def _packed_path(stream, bucket_bytes):
    """What ``refit._send_packed`` puts in each bucket: (names, dtypes, shapes, bytes) of its tensors, widest dtype
    first, their bytes one after another, and its scalars' (name, value)."""
    out = []
    for bucket in _buckets(iter(stream), bucket_bytes):
        items = sorted(((n, t) for n, t in bucket if t.dim() > 0), key=lambda it: -it[1].element_size())
        flat = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for _, t in items]) if items else None
        out.append(([(n, t.dtype, tuple(t.shape)) for n, t in items], flat,
                    [(n, float(t)) for n, t in bucket if t.dim() == 0]))
    return out


def _in_place(packer, state, plan):
    return [(packer.layout.buckets[i], None if buf is None else buf[: packer.layout.buckets[i].total], scalars)
            for i, buf, scalars in packer.fill(state.items(), plan, CPU)]


def _assert_same(expected, got):
    assert len(got) == len(expected) >= 2  # several buckets, so the grouping is checked too
    for (items, flat, scalars), (bucket, buf, got_scalars) in zip(expected, got):
        assert [(it.name, it.dtype, it.shape) for it in bucket.items] == items
        assert (buf is None) == (flat is None) and (flat is None or torch.equal(buf, flat))
        assert [(n, float(t)) for n, t in got_scalars] == scalars


@pytest.mark.parametrize("bucket_bytes", [96 << 10, 256 << 10])
def test_kernel_format_buckets_filled_in_place_hold_the_packed_paths_bytes(bucket_bytes):
    """FP8 q/k/v and gate/up quantized straight into their rows of the fused parameters' places, bf16 tensors
    copied into theirs: each bucket's buffer equals the packed path's (the stream quantized apart, stacked by
    ``KernelLayout.fuse``, sorted and concatenated), at a second refit with other weights too."""
    model, plan = _model_and_plan()
    layout = KernelLayout(_engine_params(model, plan), PACKED)
    packer = InPlacePacker(bucket_bytes)
    first = _state(model, seed=0)
    recorded = list(packer.record(plan.convert_all(first.items())))  # the first refit: the usual way
    packer.plan_recorded(layout)
    assert packer.layout.stream == [(n, t.dtype, tuple(t.shape)) for n, t in recorded]
    for seed in (0, 1):
        state = _state(model, seed)
        expected = _packed_path(layout.fuse(plan.convert_all(state.items())), bucket_bytes)
        _assert_same(expected, _in_place(packer, state, plan))


def test_checkpoint_format_buckets_with_kv_scales_filled_in_place():
    """Without a kernel layout each converted tensor keeps its name (FP8 weights and their ``weight_scale_inv``
    apart); FP8 KV scales go with their bucket as fp32 scalars, as the packed path sends them."""
    model, plan = _model_and_plan()
    state = _state(model, seed=2)
    scales = {f"model.layers.{i}.self_attn.{x}_scale": torch.tensor(0.5 + i + 0.25 * j)
              for i in range(2) for j, x in enumerate("kv")}
    stream = list(state.items()) + list(scales.items())
    packer = InPlacePacker(64 << 10)
    list(packer.record(plan.convert_all(stream)))
    packer.plan_recorded()
    expected = _packed_path(plan.convert_all(stream), 64 << 10)
    got = [(packer.layout.buckets[i], None if b is None else b[: packer.layout.buckets[i].total], s)
           for i, b, s in packer.fill(stream, plan, CPU)]
    _assert_same(expected, got)
    assert sum(len(s) for _, _, s in got) == 4


def test_a_stream_that_left_the_plan_is_refused():
    """A tensor of another shape than planned, one sent twice, or a stream that ends early: refused, naming it."""
    model, plan = _model_and_plan()
    layout = KernelLayout(_engine_params(model, plan), PACKED)
    state = _state(model, seed=0)
    packer = InPlacePacker(1 << 20)
    list(packer.record(plan.convert_all(state.items())))
    packer.plan_recorded(layout)
    grown = dict(state, **{"model.norm.weight": torch.ones(300, dtype=torch.bfloat16)})
    with pytest.raises(KeyError, match=r"model.norm.weight \(torch.bfloat16 \[300\]\) does not match the layout "
                                       r"planned at the first refit \(planned as torch.bfloat16 \[256\]\)"):
        list(packer.fill(grown.items(), plan, CPU))
    twice = list(state.items()) + [next(iter(state.items()))]
    with pytest.raises(ValueError, match="written twice"):
        list(packer.fill(twice, plan, CPU))
    with pytest.raises(ValueError, match=r"the stream ended without \['lm_head.weight'\]"):
        list(packer.fill([it for it in state.items() if it[0] != "lm_head.weight"], plan, CPU))
    with pytest.raises(KeyError, match="no parameter"):  # the plan itself: a tensor the engine does not hold
        PackedLayout.plan([("model.layers.0.self_attn.qz_proj.weight", torch.bfloat16, (4, 4))], 1 << 20, layout)
