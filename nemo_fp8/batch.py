"""Typed batches that cross process boundaries, and the one padding convention they share.

Convention (checked by ``validate``):

* ``token_ids`` is ``[B, T]`` int64, **right padded** with ``pad_token_id``; row ``i`` holds
  ``prompt_lengths[i]`` prompt tokens followed by ``response_lengths[i]`` response tokens
  (the response includes the EOS token when one was generated).
* Per-token float tensors (``generation_logprobs``, ``prev_logprobs``, ...) are ``[B, T]``
  float32 aligned with ``token_ids``: column ``t`` holds log p(token_t | tokens_<t). Column 0,
  the other prompt columns and padding hold 0.
* ``token_mask`` is derived, never stored: 1.0 on response columns, 0.0 elsewhere.

Worked example (B=2, pad=0)::

    token_ids        = [[5, 6, 7, 8, 0],     prompt [5, 6], response [7, 8]
                        [5, 9, 4, 0, 0]]     prompt [5, 9, 4], response [] (empty)
    prompt_lengths   = [2, 3];  response_lengths = [2, 0]
    token_mask       = [[0, 0, 1, 1, 0],
                        [0, 0, 0, 0, 0]]
    generation_logprobs[0, 2] = log p(7 | 5, 6)

The layout follows NeMo-RL's ``BatchedDataDict`` message-log flattening (right padding,
logprobs aligned to the token they score).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional

import torch
from torch import Tensor


def response_mask(prompt_lengths: Tensor, response_lengths: Tensor, width: int) -> Tensor:
    """``[B, width]`` float32 mask, 1.0 where ``prompt_len <= t < prompt_len + response_len``."""
    cols = torch.arange(width, device=prompt_lengths.device)[None, :]  # [1, T]
    start, end = prompt_lengths[:, None], (prompt_lengths + response_lengths)[:, None]  # [B, 1]
    return ((cols >= start) & (cols < end)).float()


def concat_padded(tensors: list[Tensor], value: float) -> Tensor:
    """Concatenate [B_i, T_i] tensors along the batch, right-padding each to the widest T with ``value``."""
    width = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value) for t in tensors])


def _check_per_token(name: str, t: Optional[Tensor], shape: torch.Size) -> None:
    if t is None:
        return
    if t.shape != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} (same as token_ids)")
    if t.dtype != torch.float32:
        raise ValueError(f"{name} has dtype {t.dtype}, expected torch.float32")


@dataclass
class GenerationOutput:
    """What a generation backend returns for B sequences (see the module convention).

    Attributes:
        token_ids: [B, T] int64, prompt then response, right padded.
        prompt_lengths: [B] int64.
        response_lengths: [B] int64, generated tokens incl. EOS.
        generation_logprobs: [B, T] float32, log-prob of each response token under the
            distribution actually sampled from (logits / temperature).
        truncated: [B] bool, True where generation hit the length limit before EOS.
    """

    token_ids: Tensor
    prompt_lengths: Tensor
    response_lengths: Tensor
    generation_logprobs: Tensor
    truncated: Tensor

    @property
    def token_mask(self) -> Tensor:
        return response_mask(self.prompt_lengths, self.response_lengths, self.token_ids.shape[1])

    def validate(self) -> "GenerationOutput":
        """Check shapes, dtypes and lengths; raise ValueError naming the field."""
        _validate_common(self.token_ids, self.prompt_lengths, self.response_lengths)
        _check_per_token("generation_logprobs", self.generation_logprobs, self.token_ids.shape)
        if self.truncated.shape != self.prompt_lengths.shape or self.truncated.dtype != torch.bool:
            raise ValueError(f"truncated must be a [B] bool tensor, got {tuple(self.truncated.shape)} {self.truncated.dtype}")
        return self


def _validate_common(token_ids: Tensor, prompt_lengths: Tensor, response_lengths: Tensor) -> None:
    if token_ids.dim() != 2 or token_ids.dtype != torch.long:
        raise ValueError(f"token_ids must be [B, T] int64, got {tuple(token_ids.shape)} {token_ids.dtype}")
    b, t = token_ids.shape
    for name, v in (("prompt_lengths", prompt_lengths), ("response_lengths", response_lengths)):
        if v.shape != (b,) or v.dtype != torch.long:
            raise ValueError(f"{name} must be [{b}] int64, got {tuple(v.shape)} {v.dtype}")
    if (prompt_lengths < 1).any():
        raise ValueError("prompt_lengths: every sequence needs at least one prompt token")
    if (prompt_lengths + response_lengths > t).any():
        raise ValueError(f"prompt_lengths + response_lengths exceed token_ids width {t}")


def to_device(t: Tensor, device: torch.device | str, non_blocking: bool = False) -> Tensor:
    """``t`` on ``device``. ``non_blocking`` and a CPU tensor bound for a GPU: copied into contiguous
    page-locked memory (torch's caching host allocator), then up with ``non_blocking=True``, the
    DataLoader's ``pin_memory`` pattern. A plain ``.to("cuda")`` of pageable memory is a
    ``cudaMemcpyAsync`` then a stream synchronize: the host waits until the GPU has run everything queued
    before it, and the GPU then idles until the host has queued the next kernels. Contiguous, because
    torch copies a strided source (a trimmed micro-batch is a view) into pageable memory first. The pinned
    buffer is ordered on the current stream and kept alive by the allocator until the copy completes, so
    ``t`` may change afterwards."""
    device = torch.device(device)
    if non_blocking and device.type == "cuda" and t.device.type == "cpu":
        pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return pinned.copy_(t).to(device, non_blocking=True)
    return t.to(device)


@dataclass
class TrainBatch:
    """One GRPO training batch: the rollout plus what the loss needs (module convention).

    Attributes:
        token_ids, prompt_lengths, response_lengths: as in ``GenerationOutput``.
        advantages: [B] float32, one advantage per sequence (GRPO).
        generation_logprobs: [B, T] float32 from the rollout engine.
        prev_logprobs: [B, T] float32 from the trainer before this step's update, or None
            before ``get_logprobs`` has filled it.
        reference_logprobs: [B, T] float32 from the reference policy (KL penalty), or None.
    """

    token_ids: Tensor
    prompt_lengths: Tensor
    response_lengths: Tensor
    advantages: Tensor
    generation_logprobs: Tensor
    prev_logprobs: Optional[Tensor] = None
    reference_logprobs: Optional[Tensor] = None

    @property
    def size(self) -> int:
        return self.token_ids.shape[0]

    @property
    def token_mask(self) -> Tensor:
        return response_mask(self.prompt_lengths, self.response_lengths, self.token_ids.shape[1])

    def sequence_lengths(self) -> list[int]:
        """Each row's prompt + response length as host ints (one device read when the batch is on a GPU:
        read it once per batch and pass the values down)."""
        return (self.prompt_lengths + self.response_lengths).tolist()

    def validate(self) -> "TrainBatch":
        """Check shapes and dtypes; raise ValueError naming the field."""
        _validate_common(self.token_ids, self.prompt_lengths, self.response_lengths)
        if self.advantages.shape != (self.size,) or self.advantages.dtype != torch.float32:
            raise ValueError(f"advantages must be [{self.size}] float32, got {tuple(self.advantages.shape)} "
                             f"{self.advantages.dtype}")
        for name in ("generation_logprobs", "prev_logprobs", "reference_logprobs"):
            _check_per_token(name, getattr(self, name), self.token_ids.shape)
        return self

    def select(self, index: Tensor | slice) -> "TrainBatch":
        """Rows ``index`` of every tensor field (micro-batching, dynamic-sampling filters)."""
        return replace(self, **{f.name: (None if getattr(self, f.name) is None else getattr(self, f.name)[index])
                                for f in fields(self)})

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "TrainBatch":
        """Every tensor field on ``device``; ``non_blocking``: host -> GPU through pinned memory
        (``to_device``), so that moving a micro-batch does not wait for the GPU's queue."""
        return replace(self, **{f.name: to_device(getattr(self, f.name), device, non_blocking) for f in fields(self)
                                if getattr(self, f.name) is not None})

    def trimmed(self, width: Optional[int] = None) -> "TrainBatch":
        """Drop padding columns past ``width`` (default: the longest sequence; saves compute on
        micro-batches). Pass ``width`` when it is known, to avoid reading the lengths here."""
        if width is None:
            width = int((self.prompt_lengths + self.response_lengths).max())
        return replace(self, **{f.name: (getattr(self, f.name)[:, :width]
                                         if getattr(self, f.name) is not None and getattr(self, f.name).dim() == 2
                                         else getattr(self, f.name)) for f in fields(self)})
