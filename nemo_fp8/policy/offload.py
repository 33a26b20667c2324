"""Host buffers for GPU state that leaves the GPU around every colocated refit (no engine imports).

Colocated, the trainer moves its optimizer state (Adam's ``exp_avg`` / ``exp_avg_sq``, fp32: 8 bytes
per parameter) to host memory before the engine wakes and back before training, once per step.
``tensor.to("cpu")`` would allocate fresh pageable host memory and copy synchronously each time (the
page faults of a new allocation cost as much as the copy); :class:`HostBuffers` keeps one host
buffer per slot across steps, pinned where CUDA is present, filled by non-blocking copies, as
megatron-core keeps ``param_data_cpu`` for its DDP buffers (``_ParamAndGradBuffer.offload_to_cpu``).
"""

from __future__ import annotations

from typing import Hashable, Optional

import torch
from torch import Tensor


class HostBuffers:
    """One reusable host buffer per slot (a hashable key: e.g. optimizer, parameter index, state name).

    Args:
        pin: page-locked buffers (default: when CUDA is available; pinning needs it).
    """

    def __init__(self, pin: Optional[bool] = None):
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._buffers: dict[Hashable, Tensor] = {}

    def offload(self, slot: Hashable, tensor: Tensor) -> Tensor:
        """Copy ``tensor`` (any shape and dtype) into ``slot``'s host buffer and return that buffer.

        The buffer is reused while the slot's shape and dtype stay the same. From a CUDA tensor the copy
        is asynchronous: call :meth:`synchronize` before reading the buffer or freeing GPU memory.
        """
        buf = self._buffers.get(slot)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            buf = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=self.pin)
            self._buffers[slot] = buf
        buf.copy_(tensor, non_blocking=self.pin and tensor.is_cuda)
        return buf

    @staticmethod
    def reload(buffer: Tensor, device: torch.device | str) -> Tensor:
        """A new tensor on ``device`` with ``buffer``'s values (never the buffer itself, which the next
        offload overwrites); asynchronous from a pinned buffer, ordered on the current stream."""
        return buffer.to(device, non_blocking=True, copy=True)

    @staticmethod
    def synchronize() -> None:
        """Wait for the asynchronous copies (no-op without CUDA)."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    @property
    def nbytes(self) -> int:
        """Host bytes held (the buffers live as long as this object)."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
