"""Host memory for GPU state that leaves the GPU around every colocated refit (no engine imports).

Colocated, the trainer moves its optimizer state (Adam's ``exp_avg`` / ``exp_avg_sq``: 8 bytes per
parameter in fp32, 4 with the precision-aware optimizer's bf16 moments) to host memory before the
engine wakes and back before training, once per step. ``tensor.to("cpu")`` would allocate fresh
pageable host memory and copy synchronously each time (the page faults of a new allocation cost as
much as the copy). :class:`HostBuffers` keeps one pinned host arena across steps (one allocation:
torch's pinned-memory allocator rounds every allocation up to a power of two, so one buffer per
tensor could waste up to half of it) and fills views of it with non-blocking copies, as
megatron-core keeps one pinned ``param_data_cpu`` per DDP buffer (``_ParamAndGradBuffer.offload_to_cpu``).
"""

from __future__ import annotations

from typing import Hashable, Optional, Sequence

import torch
from torch import Tensor

_ALIGN = 64  # bytes: every view starts aligned for any dtype (and for the copy engines)


def timed_parts(parts) -> dict[str, float]:
    """Run each ``(name, callable)`` of ``parts`` in order; returns ``{name: seconds}`` (wall clock; the CUDA work they
    queue is waited for before each clock is read, so a part's GPU time counts in it)."""
    import time

    out = {}
    for name, fn in parts:
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out[name] = time.perf_counter() - t0
    return out


class HostBuffers:
    """A host arena reused while the offloaded tensors keep their slots, shapes and dtypes.

    Args:
        pin: page-locked memory (default: when CUDA is available; pinning needs it).
    """

    def __init__(self, pin: Optional[bool] = None):
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._arena: Optional[Tensor] = None
        self._layout: list[tuple[Hashable, tuple[int, ...], torch.dtype, int]] = []

    @staticmethod
    def arena_bytes(tensor_bytes: Sequence[int]) -> int:
        """Host bytes that tensors of these sizes (bytes each) take in an arena, in any order: each rounded up
        to the 64-byte alignment of a view's start."""
        return sum(-(-int(n) // _ALIGN) * _ALIGN for n in tensor_bytes)

    def reserve(self, nbytes: int) -> None:
        """Allocate the arena now, before the first :meth:`offload` (page-locking tens of GiB of host memory
        takes seconds: at start-up rather than inside the first step that offloads). The first offload whose
        state fits in it keeps it; one that does not allocates anew. No-op once an arena exists.

        Args:
            nbytes: bytes to allocate (``arena_bytes`` of the state to come); 0 or less: nothing.
        """
        if nbytes > 0 and self._arena is None:
            self._arena = torch.empty(int(nbytes), dtype=torch.uint8, device="cpu", pin_memory=self.pin)
            self._layout = []

    def offload(self, items: Sequence[tuple[Hashable, Tensor]]) -> list[Tensor]:
        """Copy each ``(slot, tensor)`` (any shape and dtype) into the arena; returns the host views, in order.

        The arena is reallocated only when the list of slots, shapes or dtypes changes (or, after
        :meth:`reserve`, when the first state does not fit), so the same state offloaded step after step lands in
        the same host memory. From CUDA tensors the copies are
        asynchronous: call :meth:`synchronize` before reading the views or freeing the GPU tensors' memory.
        The views stay valid until the next ``offload``, which overwrites them.
        """
        layout, offset = [], 0
        for slot, t in items:
            offset = -(-offset // _ALIGN) * _ALIGN
            layout.append((slot, tuple(t.shape), t.dtype, offset))
            offset += t.numel() * t.element_size()
        reserved = self._arena is not None and not self._layout and offset <= self._arena.numel()
        if not reserved and (self._arena is None or layout != self._layout):
            self._arena = torch.empty(max(offset, 1), dtype=torch.uint8, device="cpu", pin_memory=self.pin)
        self._layout = layout
        views = []
        for (_, shape, dtype, start), (_, t) in zip(layout, items):
            n = t.numel() * t.element_size()
            view = self._arena[start:start + n].view(dtype).view(shape)
            view.copy_(t, non_blocking=self.pin and t.is_cuda)
            views.append(view)
        return views

    @staticmethod
    def reload(view: Tensor, device: torch.device | str) -> Tensor:
        """A new tensor on ``device`` with ``view``'s values (never the host memory itself, which the next
        offload overwrites); asynchronous from pinned memory, ordered on the current stream."""
        return view.to(device, non_blocking=True, copy=True)

    @staticmethod
    def synchronize() -> None:
        """Wait for the asynchronous copies (no-op without CUDA)."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    @property
    def nbytes(self) -> int:
        """Host bytes held (the arena lives as long as this object)."""
        return 0 if self._arena is None else self._arena.numel()
