"""HostBuffers: the optimizer state's host memory around a colocated refit, one arena reused from step to step."""

import pytest
import torch

from nemo_fp8.policy.offload import HostBuffers


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(("opt0", 0, "exp_avg"), torch.randn(4, 3, generator=g)),
            (("opt0", 0, "exp_avg_sq"), torch.rand(5, generator=g).to(torch.bfloat16)),
            (("opt0", 1, "step"), torch.tensor(7.0, dtype=torch.float64)),
            (("opt0", 1, "exp_avg"), torch.randn(2, 2, 2, generator=g)[:, 0])]  # not contiguous


def test_offload_into_one_arena_that_the_next_step_reuses():
    host = HostBuffers()
    assert host.pin is torch.cuda.is_available()
    items = _state()
    views = host.offload(items)
    host.synchronize()
    for (_, t), v in zip(items, views):
        assert v.dtype == t.dtype and v.shape == t.shape and torch.equal(v, t) and v.device.type == "cpu"
    arena = host.nbytes
    assert arena >= sum(t.numel() * t.element_size() for _, t in items)
    bases = {v.untyped_storage().data_ptr() for v in views}
    assert len(bases) == 1  # views of one allocation
    starts = [v.data_ptr() - min(w.data_ptr() for w in views) for v in views]
    assert all(s % 64 == 0 for s in starts)  # each view aligned for any dtype
    # reloads are copies: the optimizer's next update must not write into the host memory
    back = [HostBuffers.reload(v, "cpu") for v in views]
    back[0].add_(1.0)
    assert torch.equal(views[0], items[0][1])
    # the next step's state (same slots, shapes, dtypes) lands in the same memory with its new values
    nxt = [(slot, t + 1) for slot, t in _state(1)]
    again = host.offload(nxt)
    assert [v.data_ptr() for v in again] == [v.data_ptr() for v in views] and host.nbytes == arena
    assert all(torch.equal(v, t) for v, (_, t) in zip(again, nxt))


@pytest.mark.parametrize("change", ["shape", "dtype", "slot"])
def test_a_changed_layout_gets_a_new_arena(change):
    host = HostBuffers(pin=False)
    items = _state()
    first = host.offload(items)
    slot, t = items[0]
    items[0] = {"shape": (slot, torch.zeros(6)), "dtype": (slot, t.double()), "slot": (("opt1", 0, "m"), t)}[change]
    second = host.offload(items)
    assert second[0].data_ptr() != first[0].data_ptr() and torch.equal(second[0], items[0][1])
    assert host.offload([]) == [] and host.nbytes == 1
