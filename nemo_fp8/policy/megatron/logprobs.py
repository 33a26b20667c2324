"""Per-token log-probs from vocab-parallel logits, chunked, without full-vocabulary fp32 logits.

Megatron's output layer gives each tensor-parallel rank a slice of the vocabulary:
``logits_local`` ``[B, T, V / tp]`` in bf16 holds columns ``[vocab_start, vocab_start + V / tp)``.
A token's log-prob under ``softmax(logits / temperature)`` needs the max, the sum of exponentials
and the target's logit over the whole vocabulary, so each is reduced across the tensor-parallel
group (max, sum, sum), the way Megatron's ``vocab_parallel_cross_entropy`` and NeMo-RL's
``DistributedLogprob`` do. Here the work runs ``chunk_size`` positions at a time: forward keeps
only the bf16 logits (already alive) and one fp32 ``[B, T]`` log-sum-exp; backward recomputes
each chunk's softmax, so the peak extra memory is one chunk in fp32, not ``B * T * V / tp * 4``
bytes (32 GiB for 2 x 4096 tokens of a 151,936-word vocabulary if kept whole). NeMo-RL's
``ChunkedDistributedLogprob`` does the same.

Gradient (per position, ``z = logits / temperature``, target ``y``)::

    d logp_y / d logits_j = (1[j == y] - softmax(z)_j) / temperature

Pure torch; runs on CPU (with or without a process group) so tests pin down what the GPU does.
``FusedVocabParallelLogprobs`` (``logprob_kernel: fused``) is the same math as two Triton kernels;
on CPU they run under Triton's interpreter, which is how the tests pin them to the chunked kernel.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

DEFAULT_CHUNK_SIZE = 1024  # positions per chunk (rows of B * T)


def _all_reduce(t: Tensor, op, group) -> Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _scaled_fp32(logits: Tensor, temperature: float) -> Tensor:
    """A fresh fp32 copy of one chunk of logits, divided by the temperature in place."""
    z = logits.float() if logits.dtype != torch.float32 else logits.clone()
    return z.div_(temperature) if temperature != 1.0 else z


def _chunk_stats(z: Tensor, targets: Tensor, vocab_start: int, group) -> tuple[Tensor, Tensor]:
    """(log-sum-exp, target logit) over the full vocabulary for one chunk; overwrites ``z``.

    z: [N, V_local] float32 (already divided by the temperature); targets: [N] int64 global ids.
    """
    local = targets - vocab_start
    mine = (local >= 0) & (local < z.shape[-1])
    picked = z.gather(-1, local.clamp(0, z.shape[-1] - 1)[:, None]).squeeze(-1) * mine  # [N]
    _all_reduce(picked, dist.ReduceOp.SUM, group)
    m = z.amax(-1)  # [N]
    _all_reduce(m, dist.ReduceOp.MAX, group)
    sumexp = z.sub_(m[:, None]).exp_().sum(-1)  # [N]; in place: one fp32 chunk alive
    _all_reduce(sumexp, dist.ReduceOp.SUM, group)
    return m + sumexp.log(), picked


class ChunkedVocabParallelLogprobs(torch.autograd.Function):
    """logp[n] = z[n, y_n] - logsumexp_j z[n, j], z = logits / temperature, vocab split across ranks.

    forward(logits [N, V_local] (any float dtype), targets [N] int64, vocab_start, temperature,
    group, chunk_size) -> [N] float32. See the module docstring for memory and the gradient.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, vocab_start: int, temperature: float,
                group: Optional[dist.ProcessGroup], chunk_size: int) -> Tensor:
        n = logits.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        for s in range(0, n, chunk_size):
            z = _scaled_fp32(logits[s:s + chunk_size], temperature)  # [c, V_local] fp32, one chunk
            lse[s:s + chunk_size], picked = _chunk_stats(z, targets[s:s + chunk_size], vocab_start, group)
            out[s:s + chunk_size] = picked - lse[s:s + chunk_size]
        ctx.save_for_backward(logits, targets, lse)
        ctx.vocab_start, ctx.temperature, ctx.chunk_size = vocab_start, temperature, chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, targets, lse = ctx.saved_tensors
        t, vs = ctx.temperature, ctx.vocab_start
        grad = torch.empty_like(logits)
        v_local = logits.shape[-1]
        for s in range(0, logits.shape[0], ctx.chunk_size):
            e = s + ctx.chunk_size
            g = grad_out[s:e].float()  # [c]
            gz = _scaled_fp32(logits[s:e], t).sub_(lse[s:e, None]).exp_().mul_(-g[:, None])  # -softmax * g
            local = targets[s:e] - vs
            mine = (local >= 0) & (local < v_local)
            gz.scatter_add_(-1, local.clamp(0, v_local - 1)[:, None], (g * mine)[:, None])  # + g at the target
            grad[s:e] = gz.div_(t) if t != 1.0 else gz  # cast to the logits' dtype on copy
        return grad, None, None, None, None, None


def vocab_parallel_token_logprobs(logits: Tensor, token_ids: Tensor, temperature: float = 1.0,
                                  vocab_start: int = 0, group: Optional[dist.ProcessGroup] = None,
                                  chunk_size: int = DEFAULT_CHUNK_SIZE, fused: bool = False) -> Tensor:
    """Log-prob of each token aligned to the token, from (vocab-parallel) logits.

    Same result as ``nemo_fp8.models.hf.token_logprobs`` (and the same gradient), without
    building full-vocabulary fp32 logits for the batch.

    Args:
        logits: [B, T, V_local] (bf16 / fp16 / fp32), this rank's vocabulary columns
            ``[vocab_start, vocab_start + V_local)``; ``V_local = V`` without tensor parallelism.
        token_ids: [B, T] int64 global token ids.
        temperature: > 0, the sampler's temperature (logits are divided by it).
        vocab_start: first global vocabulary id held by this rank.
        group: the tensor-parallel process group (None: the whole vocabulary is here).
        chunk_size: positions per chunk (trades memory for kernel launches).
        fused: one Triton pass each way (``FusedVocabParallelLogprobs``) instead of torch chunks;
            same math, fp32 inside, the gradient rounded to the logits' dtype once.

    Returns:
        [B, T] float32; column t = log p(token_t | tokens_<t); column 0 is 0.

    Raises:
        ValueError: shapes that do not match, or ``temperature <= 0`` / ``chunk_size < 1``.
        RuntimeError: ``fused`` where Triton cannot run (no triton, or CPU tensors outside
            ``TRITON_INTERPRET=1``).
    """
    if logits.dim() != 3 or token_ids.shape != logits.shape[:2]:
        raise ValueError(f"logits must be [B, T, V_local] and token_ids [B, T]; got {tuple(logits.shape)} "
                         f"and {tuple(token_ids.shape)}")
    if temperature <= 0 or chunk_size < 1:
        raise ValueError(f"temperature must be > 0 and chunk_size >= 1, got {temperature}, {chunk_size}")
    b, t, v = logits.shape
    # Position t-1 predicts token t. Every position is scored (the last against token 0, then
    # dropped) so the logits are viewed, not copied.
    targets = torch.cat([token_ids[:, 1:], torch.zeros_like(token_ids[:, :1])], dim=1).reshape(-1)  # [B*T]
    if fused and not fused_kernels_available(logits.device):
        raise RuntimeError(f"vocab_parallel_token_logprobs(fused=True): Triton cannot run here (triton "
                           f"{'missing' if triton is None else 'present'}, logits on {logits.device}); use "
                           "the chunked kernel (fused=False)")
    fn = FusedVocabParallelLogprobs if fused else ChunkedVocabParallelLogprobs
    picked = fn.apply(logits.reshape(b * t, v), targets, vocab_start, float(temperature), group, chunk_size).view(b, t)
    return torch.cat([torch.zeros_like(picked[:, :1]), picked[:, :-1]], dim=1)  # [B, T]


IGNORE_INDEX = -100  # target id whose loss and gradient are 0 (TE's and torch's ``ignore_idx`` default)


def fused_token_logprobs(logits: Tensor, token_ids: Tensor, cross_entropy, temperature: float = 1.0,
                         group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """Log-prob of each token aligned to the token, through a fused vocab-parallel cross-entropy kernel.

    ``log p(y) = -CE(z, y)`` with ``z = logits / temperature``, so the cross entropy's gradient
    ``softmax(z) - onehot(y)`` is the log-prob's, negated. TransformerEngine's
    ``parallel_cross_entropy`` (the Triton kernel megatron-core uses for its own loss,
    ``cross_entropy_fusion_impl='te'``) reads the bf16 logits once per pass (online softmax, ranks
    exchange max / sum / target logit) and writes the gradient into the logits' storage during the
    forward, so the backward is one scaling: no fp32 copy of the logits at all, against
    ``vocab_parallel_token_logprobs``' chunked fp32 recomputation.

    Args:
        logits: [B, T, V_local] bf16 / fp32 vocab-parallel logits (overwritten by the kernel with the
            cross entropy's gradient when it is TE's: do not reuse them).
        token_ids: [B, T] int64 global token ids.
        cross_entropy: ``f(inp [B, T, V_local], target [B, T] int64, group) -> [B, T] float32`` per-token
            cross entropy over the whole vocabulary, differentiable in ``inp``, ``target ==
            IGNORE_INDEX`` giving 0 loss and 0 gradient; e.g. ``lambda x, y, g:
            transformer_engine.pytorch.parallel_cross_entropy(x, y, 0.0, False, g)``.
        temperature: > 0, the sampler's temperature (logits are divided by it; a copy unless 1).
        group: the tensor-parallel process group (None: the whole vocabulary is here).

    Returns:
        [B, T] float32; column t = log p(token_t | tokens_<t); column 0 is 0.

    Raises:
        ValueError: shapes that do not match, or ``temperature <= 0``.
    """
    if logits.dim() != 3 or token_ids.shape != logits.shape[:2]:
        raise ValueError(f"logits must be [B, T, V_local] and token_ids [B, T]; got {tuple(logits.shape)} "
                         f"and {tuple(token_ids.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    z = logits if temperature == 1.0 else logits / temperature
    # position t-1 predicts token t; the last position predicts nothing
    targets = torch.cat([token_ids[:, 1:], torch.full_like(token_ids[:, :1], IGNORE_INDEX)], dim=1)
    logp = -cross_entropy(z, targets, group)  # [B, T]
    return torch.cat([torch.zeros_like(logp[:, :1]), logp[:, :-1]], dim=1)


def torch_cross_entropy(inp: Tensor, target: Tensor, group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """The ``cross_entropy`` contract of ``fused_token_logprobs`` in plain torch (fp32, full vocabulary).

    The CPU reference for that contract (TransformerEngine's kernel is the GPU one); no tensor
    parallelism.

    Raises:
        ValueError: a process group of more than one rank.
    """
    if group is not None and dist.get_world_size(group) > 1:
        raise ValueError("torch_cross_entropy: the whole vocabulary must be on this rank (no tensor parallelism)")
    b, t, v = inp.shape
    return torch.nn.functional.cross_entropy(inp.float().reshape(b * t, v), target.reshape(-1),
                                             ignore_index=IGNORE_INDEX, reduction="none").view(b, t)


# ----------------------------------------------------------------------------- one fused pass each way
# ``logprob_kernel: fused``: the chunked kernel's math (fp32 softmax, gradient rounded to the logits'
# dtype once) in one Triton pass per direction: the forward reads the logits once (online max and sum
# of exponentials, the target's logit), the backward reads them once and writes the gradient once.
# Against TransformerEngine's ``parallel_cross_entropy`` (``logprob_kernel: te``), which stores its
# gradient in the bf16 logits during the forward and scales it there in the backward (two roundings),
# this keeps the chunked kernel's gradient. On CPU the kernels run under Triton's interpreter
# (``TRITON_INTERPRET=1``), which is how the tests pin them to the chunked kernel.
try:  # Triton ships with CUDA builds of torch; on CPU it is a dev dependency (the tests' interpreter)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None

FUSED_BLOCK = 2048  # vocabulary columns per loop iteration (a power of two)

if triton is not None:

    @triton.jit
    def _row_stats_kernel(x_ptr, x_stride, tgt_ptr, m_ptr, s_ptr, picked_ptr, v_local, vocab_start, inv_t,
                          BLOCK: tl.constexpr):
        """Per row: m = max_j z_j, s = sum_j exp(z_j - m), picked = z_y (0 if y is on another rank); z = x / T."""
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * x_stride
        m = tl.full([], float("-inf"), tl.float32)
        s = tl.zeros([], tl.float32)
        for off in range(0, v_local, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            z = tl.load(x_row + cols, mask=cols < v_local, other=float("-inf")).to(tl.float32) * inv_t
            new_m = tl.maximum(m, tl.max(z, 0))
            s = s * tl.exp(m - new_m) + tl.sum(tl.exp(z - new_m), 0)
            m = new_m
        y = tl.load(tgt_ptr + row) - vocab_start
        inside = (y >= 0) & (y < v_local)
        z_y = tl.load(x_row + tl.where(inside, y, 0)).to(tl.float32) * inv_t
        tl.store(m_ptr + row, m)
        tl.store(s_ptr + row, s)
        tl.store(picked_ptr + row, tl.where(inside, z_y, 0.0))

    @triton.jit
    def _grad_kernel(x_ptr, x_stride, tgt_ptr, lse_ptr, g_ptr, out_ptr, out_stride, v_local, vocab_start, inv_t,
                     BLOCK: tl.constexpr):
        """Per row: d logp_y / d x_j * g = (1[j == y] - exp(z_j - lse)) * g / T, computed in fp32, stored once."""
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * x_stride
        out_row = out_ptr + row * out_stride
        lse = tl.load(lse_ptr + row)
        g = tl.load(g_ptr + row) * inv_t
        y = tl.load(tgt_ptr + row) - vocab_start
        for off in range(0, v_local, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            mask = cols < v_local
            z = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32) * inv_t
            grad = (tl.where(cols == y, 1.0, 0.0) - tl.exp(z - lse)) * g
            tl.store(out_row + cols, grad.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


def fused_kernels_available(device: torch.device) -> bool:
    """True where ``FusedVocabParallelLogprobs`` can run: Triton importable and the tensors on CUDA,
    or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set before triton's import)."""
    return triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


class FusedVocabParallelLogprobs(torch.autograd.Function):
    """``ChunkedVocabParallelLogprobs`` (same arguments and results, ``chunk_size`` ignored) in one
    Triton pass per direction. Tensor parallelism: each rank's (max, sum of exponentials relative to
    it, target logit) are combined as ``M = max m``, ``S = sum s * exp(m - M)``, ``picked = sum``.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, vocab_start: int, temperature: float,
                group: Optional[dist.ProcessGroup], chunk_size: int) -> Tensor:
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        n, v_local = logits.shape
        targets = targets.contiguous()
        m, s, picked = (torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(3))
        if n:
            _row_stats_kernel[(n,)](logits, logits.stride(0), targets, m, s, picked, v_local, vocab_start,
                                    1.0 / temperature, BLOCK=FUSED_BLOCK)
        m_all = _all_reduce(m.clone(), dist.ReduceOp.MAX, group)
        s = _all_reduce(s * torch.exp(m - m_all), dist.ReduceOp.SUM, group)  # rescaled to the global max
        _all_reduce(picked, dist.ReduceOp.SUM, group)
        lse = m_all + s.log()
        ctx.save_for_backward(logits, targets, lse)
        ctx.vocab_start, ctx.temperature = vocab_start, temperature
        return picked - lse

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, targets, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        n, v_local = logits.shape
        if n:
            _grad_kernel[(n,)](logits, logits.stride(0), targets, lse, grad_out.float().contiguous(), grad,
                               grad.stride(0), v_local, ctx.vocab_start, 1.0 / ctx.temperature, BLOCK=FUSED_BLOCK)
        return grad, None, None, None, None, None
