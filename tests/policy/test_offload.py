"""HostBuffers: the optimizer state's host copies around a colocated refit, reused from step to step."""

import torch

from nemo_fp8.policy.offload import HostBuffers


def test_buffers_are_reused_across_offloads_and_reloads_are_copies():
    host = HostBuffers()
    assert host.pin is torch.cuda.is_available()
    exp_avg = torch.randn(4, 3)
    buf = host.offload(("opt0", 0, "exp_avg"), exp_avg)
    host.synchronize()
    assert torch.equal(buf, exp_avg) and buf.data_ptr() != exp_avg.data_ptr()
    back = HostBuffers.reload(buf, "cpu")
    assert torch.equal(back, exp_avg) and back.data_ptr() != buf.data_ptr()
    back.add_(1.0)  # the optimizer's next update must not write into the host buffer
    assert torch.equal(buf, exp_avg)
    # the next step's offload lands in the same buffer (no new host allocation) with the new values
    again = host.offload(("opt0", 0, "exp_avg"), back)
    assert again is buf and torch.equal(buf, exp_avg + 1.0)
    assert host.nbytes == 4 * 3 * 4


def test_a_slot_whose_shape_or_dtype_changes_gets_a_new_buffer():
    host = HostBuffers(pin=False)
    first = host.offload("s", torch.zeros(8))
    assert host.offload("s", torch.zeros(8, dtype=torch.bfloat16)) is not first
    resized = host.offload("s", torch.ones(2, 2, dtype=torch.bfloat16))
    assert resized.shape == (2, 2) and resized.dtype == torch.bfloat16 and bool((resized == 1).all())
    assert host.offload("t", torch.zeros(3)) is not resized and host.nbytes == 2 * 2 * 2 + 3 * 4
