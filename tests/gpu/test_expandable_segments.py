"""The trainer's allocator toggled between expandable and ``cudaMalloc`` segments (``train_expandable_segments``;
``pytest -m gpu tests/gpu/test_expandable_segments.py``): after a "training pass" in expandable segments that leaves
live tensors and freed gaps behind, a packed refit bucket (``PACKED_MIN_BUFFER_BYTES`` or more) lands in a
``cudaMalloc`` segment, and another process opens its CUDA IPC handle and reads it, as the vLLM engine does.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from nemo_fp8.generation.vllm.refit import PACKED_MIN_BUFFER_BYTES
from nemo_fp8.utils.memory import set_expandable_segments

pytestmark = pytest.mark.gpu
MiB = 2**20


def _segment_of(ptr: int) -> dict:
    for seg in torch.cuda.memory_snapshot():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return seg
    raise AssertionError(f"no segment holds {ptr:#x}")


def _read_in_child(queue, done) -> None:
    t = queue.get()  # rebuilt from its CUDA IPC handle in this process
    done.put(int(t.sum(dtype=torch.int64).item()))


def test_a_refit_bucket_after_an_expandable_pass_is_shareable():
    dev = torch.device("cuda", torch.cuda.current_device())
    set_expandable_segments(True)
    try:  # a pass: tensors that stay (moments) between tensors that go (activations), small and large
        keep, gone = [], []
        for i in range(24):
            big = torch.ones(int((1 + i % 5) * 7.3 * MiB), dtype=torch.uint8, device=dev)
            (keep if i % 3 == 0 else gone).append(big)
            (keep if i % 4 == 0 else gone).append(torch.ones(4096 + 512 * i, dtype=torch.uint8, device=dev))
        del gone
    finally:
        set_expandable_segments(False)  # the refit's release
    torch.cuda.empty_cache()
    if "is_expandable" in _segment_of(keep[0].data_ptr()):
        assert _segment_of(keep[0].data_ptr())["is_expandable"]  # the pass did run in expandable segments
    bucket = torch.full((PACKED_MIN_BUFFER_BYTES,), 7, dtype=torch.uint8, device=dev)
    seg = _segment_of(bucket.data_ptr())
    assert not seg.get("is_expandable", False), seg
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_read_in_child, args=(queue, done))
    child.start()
    queue.put(bucket)
    assert done.get(timeout=120) == 7 * PACKED_MIN_BUFFER_BYTES
    child.join(timeout=60)
    assert child.exitcode == 0
