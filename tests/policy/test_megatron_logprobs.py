"""The megatron backend's chunked vocab-parallel log-probs against the plain full-vocabulary ones.

Pure torch on CPU: the same function runs on the GPU host inside the megatron backend, so these
tests pin down its values and gradients, with and without a (gloo) tensor-parallel group.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nemo_fp8.models.hf import token_logprobs
from nemo_fp8.policy.megatron.logprobs import fused_token_logprobs, torch_cross_entropy, vocab_parallel_token_logprobs


def _case(seed=0, b=3, t=7, v=50, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(b, t, v, generator=g)).to(dtype)
    ids = torch.randint(0, v, (b, t), generator=g)
    return logits, ids


@pytest.mark.parametrize("chunk_size", [1, 4, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradient_match_full_vocab(chunk_size, temperature):
    logits, ids = _case()
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    got = vocab_parallel_token_logprobs(a, ids, temperature, chunk_size=chunk_size)
    want = token_logprobs(b, ids, temperature)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (got[:, 0] == 0).all()
    w = torch.randn(got.shape, generator=torch.Generator().manual_seed(1))  # any upstream gradient
    (got * w).sum().backward()
    (want * w).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-6)
    assert (a.grad[:, -1] == 0).all()  # the last position predicts nothing


def test_bf16_logits_are_read_in_fp32_and_grad_keeps_dtype():
    logits, ids = _case(dtype=torch.bfloat16)
    x = logits.clone().requires_grad_(True)
    got = vocab_parallel_token_logprobs(x, ids)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, token_logprobs(logits, ids), rtol=0, atol=1e-5)
    got.sum().backward()
    assert x.grad.dtype == torch.bfloat16


def test_bad_shapes_and_arguments_raise():
    logits, ids = _case()
    with pytest.raises(ValueError, match="token_ids"):
        vocab_parallel_token_logprobs(logits, ids[:, :-1])
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_token_logprobs(logits, ids, temperature=0.0)


def _tp_worker(rank: int, world: int, port: int, out: dict):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    logits, ids = _case(seed=3, v=48)
    v_local = logits.shape[-1] // world
    mine = logits[..., rank * v_local:(rank + 1) * v_local].clone().requires_grad_(True)
    lp = vocab_parallel_token_logprobs(mine, ids, 0.9, vocab_start=rank * v_local, group=dist.group.WORLD, chunk_size=5)
    w = torch.randn(lp.shape, generator=torch.Generator().manual_seed(1))
    (lp * w).sum().backward()
    out[rank] = (lp.detach(), mine.grad)
    dist.destroy_process_group()


def test_tensor_parallel_shards_give_the_full_vocab_result():
    """Two gloo ranks, each with half the vocabulary: same log-probs on both, and the gradient
    slices equal the full computation's."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.Manager()
    out = manager.dict()
    mp.start_processes(_tp_worker, args=(2, port, out), nprocs=2, join=True, start_method="spawn")
    logits, ids = _case(seed=3, v=48)
    full = logits.clone().requires_grad_(True)
    want = token_logprobs(full, ids, 0.9)
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    (want * w).sum().backward()
    for rank in range(2):
        lp, grad = out[rank]
        torch.testing.assert_close(lp, want.detach(), rtol=0, atol=1e-5)
        torch.testing.assert_close(grad, full.grad[..., rank * 24:(rank + 1) * 24], rtol=0, atol=1e-6)


class _OverwritingCrossEntropy(torch.autograd.Function):
    """TransformerEngine's ``parallel_cross_entropy`` contract on CPU, including its side effect.

    Like TE's Triton kernel it computes the loss and its gradient (``softmax - onehot``, 0 for
    ignored targets) in the forward, writes the gradient into the input's storage (the logits are
    gone afterwards) and scales it by the upstream gradient in the backward.
    """

    @staticmethod
    def forward(ctx, inp, target, ignore_idx):
        z = inp.detach().float()
        keep = target != ignore_idx
        safe = torch.where(keep, target, 0)
        lse = torch.logsumexp(z, -1)
        loss = (lse - z.gather(-1, safe[..., None]).squeeze(-1)) * keep
        grad = torch.softmax(z, -1)
        grad.scatter_add_(-1, safe[..., None], -torch.ones_like(grad[..., :1]))
        inp.data.copy_(grad * keep[..., None])  # the logits are overwritten, as TE does
        ctx.save_for_backward(inp.detach())
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        (g,) = ctx.saved_tensors
        return g * grad_out[..., None].to(g.dtype), None, None


def _te_like(inp, target, group):
    return _OverwritingCrossEntropy.apply(inp, target, -100)


@pytest.mark.parametrize("cross_entropy", [_te_like, torch_cross_entropy], ids=["te-like", "torch"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_logprobs_match_the_chunked_ones(cross_entropy, temperature):
    """Values and gradients equal the chunked implementation's, with an in-place-gradient kernel too."""
    logits, ids = _case(seed=3)
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    got = fused_token_logprobs(a * 1, ids, cross_entropy, temperature)  # "* 1": a non-leaf, like the model's output
    want = vocab_parallel_token_logprobs(b, ids, temperature, chunk_size=4)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert got.dtype == torch.float32 and (got[:, 0] == 0).all()
    w = torch.randn(got.shape, generator=torch.Generator().manual_seed(2))
    (got * w).sum().backward()
    (want * w).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-6)
    assert (a.grad[:, -1] == 0).all()  # the last position predicts nothing (ignored target)


def test_fused_logprobs_bad_arguments_raise():
    logits, ids = _case()
    with pytest.raises(ValueError, match="token_ids"):
        fused_token_logprobs(logits, ids[:, :-1], torch_cross_entropy)
    with pytest.raises(ValueError, match="temperature"):
        fused_token_logprobs(logits, ids, torch_cross_entropy, temperature=-1.0)


# ----------------------------------------------------------------------------- the fused (Triton) kernel
# Triton's interpreter runs the kernels on CPU tensors; it is chosen when triton is imported, so each
# check runs in a fresh (spawned) process started with TRITON_INTERPRET=1.

def _fused_worker(rank: int, world: int, port: int, out: dict):
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from nemo_fp8.policy.megatron.logprobs import FUSED_BLOCK

    res = {}
    if world == 1:
        # fp32: fused == chunked == full vocabulary, values and gradients; one vocabulary block and several
        for key, (v, temperature) in {"small": (50, 1.0), "temp": (50, 0.7), "loop": (2 * FUSED_BLOCK + 7, 0.9)}.items():
            logits, ids = _case(seed=5, b=2, t=3, v=v)
            x = {k: logits.clone().requires_grad_(True) for k in ("fused", "chunked")}
            lp = {k: vocab_parallel_token_logprobs(x[k], ids, temperature, chunk_size=2, fused=k == "fused")
                  for k in x}
            w = torch.randn(lp["fused"].shape, generator=torch.Generator().manual_seed(1))
            for k in x:
                (lp[k] * w).sum().backward()
            res[key] = {k: (lp[k].detach(), x[k].grad) for k in x}
        # bf16 logits: the fused gradient is computed in fp32 and rounded to bf16 once, like the chunked
        # one; "fp32": the chunked kernel's gradient before that rounding (fp32 copies of the same logits)
        logits, ids = _case(seed=6, b=2, t=4, v=300, dtype=torch.bfloat16)
        x = {k: logits.clone().requires_grad_(True) for k in ("fused", "chunked")}
        x["fp32"] = logits.float().requires_grad_(True)
        lp = {k: vocab_parallel_token_logprobs(x[k], ids, fused=k == "fused") for k in x}
        for k in x:
            (lp[k] * 1e-3).sum().backward()  # GRPO-sized upstream gradients
        res["bf16"] = {k: (lp[k].detach(), x[k].grad) for k in x}
    else:
        logits, ids = _case(seed=3, v=48)
        v_local = logits.shape[-1] // world
        mine = logits[..., rank * v_local:(rank + 1) * v_local].clone().requires_grad_(True)
        lp = vocab_parallel_token_logprobs(mine, ids, 0.9, vocab_start=rank * v_local, group=dist.group.WORLD,
                                           fused=True)
        (lp * torch.randn(lp.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
        res = (lp.detach(), mine.grad)
        dist.destroy_process_group()
    out[rank] = res


def _run_fused(world, monkeypatch):
    import socket

    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.start_processes(_fused_worker, args=(world, port, out), nprocs=world, join=True, start_method="spawn")
    return dict(out)


def test_fused_kernel_equals_the_chunked_one(monkeypatch):
    """Values and gradients of the one-pass Triton kernel equal the chunked kernel's (fp32: to 1e-5 /
    1e-6, with a temperature and with a vocabulary spanning several blocks), and with bf16 logits
    its gradient is the chunked one's up to one bf16 rounding step (both round once)."""
    res = _run_fused(1, monkeypatch)[0]
    for key in ("small", "temp", "loop"):
        (lp_f, g_f), (lp_c, g_c) = res[key]["fused"], res[key]["chunked"]
        torch.testing.assert_close(lp_f, lp_c, rtol=0, atol=1e-5)
        torch.testing.assert_close(g_f, g_c, rtol=0, atol=1e-6)
        assert (lp_f[:, 0] == 0).all() and (g_f[:, -1] == 0).all()
    (lp_f, g_f), (lp_c, g_c), (_, g_32) = (res["bf16"][k] for k in ("fused", "chunked", "fp32"))
    assert g_f.dtype == torch.bfloat16 and lp_f.dtype == torch.float32
    torch.testing.assert_close(lp_f, lp_c, rtol=0, atol=1e-5)
    torch.testing.assert_close(g_f.float(), g_c.float(), rtol=2 ** -7, atol=1e-12)  # within one bf16 step
    # One rounding of the fp32 gradient: Triton's interpreter casts to bf16 by truncation (the GPU rounds to
    # nearest, as the kernel asks, like the chunked kernel's copy), so the fused gradient is the chunked fp32
    # gradient truncated, bit for bit but for fp32 last-bit differences at a truncation boundary.
    truncated = (g_32.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
    assert (g_f == truncated).float().mean() > 0.99


def test_fused_kernel_with_tensor_parallel_shards_gives_the_full_vocab_result(monkeypatch):
    out = _run_fused(2, monkeypatch)
    logits, ids = _case(seed=3, v=48)
    full = logits.clone().requires_grad_(True)
    want = token_logprobs(full, ids, 0.9)
    (want * torch.randn(want.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
    for rank in range(2):
        lp, grad = out[rank]
        torch.testing.assert_close(lp, want.detach(), rtol=0, atol=1e-5)
        torch.testing.assert_close(grad, full.grad[..., rank * 24:(rank + 1) * 24], rtol=0, atol=1e-6)


def test_fused_kernel_refuses_cpu_tensors_outside_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    logits, ids = _case()
    with pytest.raises(RuntimeError, match="fused=True.*chunked"):
        vocab_parallel_token_logprobs(logits, ids, fused=True)
