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


def test_a_reserved_arena_takes_the_first_state_that_fits():
    host = HostBuffers(pin=False)
    items = _state()
    need = HostBuffers.arena_bytes([t.numel() * t.element_size() for _, t in items])
    assert need % 64 == 0 and need >= sum(t.numel() * t.element_size() for _, t in items)
    host.reserve(need)
    arena = host._arena.data_ptr()
    views = host.offload(items)
    assert views[0].data_ptr() == arena and host.nbytes == need  # no second allocation in the first offload
    assert all(torch.equal(v, t) for v, (_, t) in zip(views, items))
    host.reserve(10 * need)  # an arena exists: no-op
    assert host.nbytes == need
    small = HostBuffers(pin=False)
    small.reserve(8)  # too small for the state: the offload allocates what it needs
    views = small.offload(items)
    assert small.nbytes >= need - 64 and all(torch.equal(v, t) for v, (_, t) in zip(views, items))


@pytest.mark.parametrize("moment_dtype", ["float32", "bfloat16"])
def test_the_megatron_reserve_holds_adams_moments_after_the_first_update(moment_dtype):
    """The megatron backend reserves the arena at start-up from its optimizer's parameters; after the first update
    (when Adam's state exists) the whole state fits in it, so the first refit after training allocates nothing."""
    from types import SimpleNamespace

    from nemo_fp8.config import load_config
    from nemo_fp8.policy.megatron.backend import MegatronPolicyBackend

    cfg = load_config("examples/configs/grpo_math_8B_megatron.yaml", [
        "cluster.gpus_per_node=1", "policy.data_parallel_size=1", "policy.megatron_cfg.tensor_model_parallel_size=1",
        "policy.megatron_cfg.sequence_parallel=false", "policy.megatron_cfg.optimizer.use_precision_aware_optimizer=true",
        "policy.megatron_cfg.distributed_data_parallel_config.grad_reduce_in_fp32=false",
        f"policy.megatron_cfg.optimizer.exp_avg_dtype={moment_dtype}",
        f"policy.megatron_cfg.optimizer.exp_avg_sq_dtype={moment_dtype}"])
    params = [torch.nn.Parameter(torch.randn(n)) for n in (1000, 37, 4096)]
    adam = torch.optim.Adam(params)
    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=adam)])  # megatron-core's nesting
    need = MegatronPolicyBackend._adam_moment_bytes(SimpleNamespace(cfg=cfg.policy, optimizer=chained))
    per_element = 2 * torch.empty((), dtype=getattr(torch, moment_dtype)).element_size()
    assert need >= per_element * sum(p.numel() for p in params)
    for p in params:
        p.grad = torch.ones_like(p)
    adam.step()
    # torch's Adam keeps fp32 moments; the reserve for 16-bit moments is checked against their size instead
    state = [((i, k), v.to(getattr(torch, moment_dtype))) for i, p in enumerate(params)
             for k, v in adam.state[p].items() if k != "step"]
    host = HostBuffers(pin=False)
    host.reserve(need)
    arena = host._arena.data_ptr()
    views = host.offload(state)
    assert views[0].data_ptr() == arena and host.nbytes == need
