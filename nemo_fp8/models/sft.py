"""Pieces shared by the project's model builders (``tiny.py``, ``small.py``): SFT batches, atomic save,
deterministic training and a fingerprint of the weights."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch


def pad_sft_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_token_id: int,
                  device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad prompt+response token ids into a causal-LM batch with the loss on responses only.

    Args:
        prompts: per row, the prompt token ids.
        responses: per row, the response token ids (including the EOS the model should learn).
        pad_token_id: id written into padding columns.
        device: where the tensors go.

    Returns:
        (input_ids [B, T] int64, labels [B, T] int64 with -100 outside the responses and on padding,
        attention_mask [B, T] int64, 1 on real tokens), T = the longest prompt+response.

    Raises:
        ValueError: empty batch, or ``prompts`` and ``responses`` of different lengths.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"pad_sft_batch: {len(prompts)} prompts but {len(responses)} responses")
    if not prompts:
        raise ValueError("pad_sft_batch: empty batch")
    seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
    labels = [[-100] * len(p) + list(r) for p, r in zip(prompts, responses)]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
    lab = torch.full((len(seqs), width), -100, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, l) in enumerate(zip(seqs, labels)):
        ids[i, : len(s)] = torch.tensor(s)
        lab[i, : len(l)] = torch.tensor(l)
        attn[i, : len(s)] = 1
    return ids.to(device), lab.to(device), attn.to(device)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross entropy over the labelled positions (what HF's ``model(labels=...).loss`` computes).

    Position t's logits predict ``labels[:, t + 1]``; labels equal to ``ignore_index`` (prompt and
    padding) count for nothing. The log-probability of each target is read with a 1-D ``gather``
    over the flattened fp32 log-softmax, not with ``nll_loss``: PyTorch lists ``NLLLoss`` on CUDA
    among the operations without a deterministic implementation, and a 1-D gather's backward among
    those it makes deterministic (``torch.use_deterministic_algorithms``), so the small model's
    deterministic build can use this loss.

    Args:
        logits: [B, T, V] (any float dtype; computed in fp32).
        labels: [B, T] int64 token ids, ``ignore_index`` where no loss is taken.

    Returns:
        0-dim fp32 tensor; 0 when no position is labelled.
    """
    vocab = logits.shape[-1]
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).reshape(-1)
    target = labels[:, 1:].reshape(-1)
    keep = target != ignore_index
    flat = torch.arange(target.numel(), device=target.device) * vocab + target.clamp(min=0)
    token_logp = logp.gather(0, flat)
    return -(token_logp * keep).sum() / keep.sum().clamp(min=1)


def save_checkpoint_atomically(out_dir: str | Path, model, tokenizer, spec_name: str, spec: dict,
                               extra_files: dict[str, str] | None = None) -> Path:
    """Write ``model`` + ``tokenizer`` (HF ``save_pretrained``) + ``spec_name`` (JSON of ``spec``) to ``out_dir``.

    Everything goes into a sibling ``<out_dir>.tmp`` first, which is renamed at the end, so an
    interrupted build leaves no half checkpoint at ``out_dir``. ``extra_files`` maps relative
    paths (e.g. ``data/val.jsonl``) to text contents written beside the weights.

    Raises:
        FileExistsError: ``out_dir`` exists (checked before writing and again before the rename).
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists; not overwriting it")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    for rel, text in (extra_files or {}).items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_text(text)
    (tmp / spec_name).write_text(json.dumps(spec, indent=2))
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} appeared while the model was being built; not overwriting it")
    tmp.rename(out_dir)
    return out_dir


def state_dict_sha256(state_dict: dict[str, torch.Tensor]) -> str:
    """SHA-256 (hex) of a state dict: every tensor's name, dtype, shape and raw bytes, in name order.

    Two builds of a model agree bit for bit exactly when their fingerprints agree; the dtype is part
    of it (the bf16 weights as saved, not the fp32 ones trained). Tied weights are hashed under each
    of their names.

    Args:
        state_dict: name -> tensor (any device, any dtype; copied to the CPU to read the bytes).
    """
    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@contextlib.contextmanager
def deterministic_training(enabled: bool = True):
    """Run the block with PyTorch's deterministic algorithms, so a rebuild on the same stack repeats the bits.

    Sets ``torch.use_deterministic_algorithms(True)`` in its strict form, ``cudnn.deterministic``
    with ``cudnn.benchmark`` off, and ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` when unset (cuBLAS reads
    it when its handle is created, so enter this before the first CUDA matmul of the process). The
    previous settings come back on exit; the environment variable stays. Source: PyTorch's
    "Reproducibility" notes. Strict, not ``warn_only``: PyTorch's cuDNN attention backward takes its
    deterministic algorithm only then (with ``warn_only=True`` two builds of the small model on the same
    GPU end with different weights).

    Raises:
        RuntimeError: (from PyTorch, inside the block) an operation with no deterministic
            implementation on this device; the message names it.
    """
    if not enabled:
        yield
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    prev = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev[0], warn_only=prev[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = prev[2], prev[3]
