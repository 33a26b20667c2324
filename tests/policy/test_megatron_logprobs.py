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
