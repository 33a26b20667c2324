"""Process memory readings for refit and colocation diagnostics (Linux ``/proc``).

``MemoryWatch`` samples the private (``RssAnon``) and shared-memory (``RssShmem``: Ray's object
store is mapped there) parts separately, so a refit's private copies can be told from
object-store pages. CUDA memory is read with
``torch.cuda.max_memory_allocated`` instead.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} (not Linux?)")


class MemoryWatch:
    """Peak growth of this process's private and shared resident memory while it runs.

    A thread samples ``RssAnon`` and ``RssShmem`` (``/proc/self/status``) every ``interval_s``
    between ``start()`` and ``stop()``; ``stop()`` returns ``{"anon_extra": bytes,
    "shmem_extra": bytes}``, the peaks above the values at ``start()``. Shared pages of a
    memory-mapped store stay resident once touched, so ``shmem_extra`` is an upper bound of
    the store memory used.
    """

    def __init__(self, interval_s: float = 0.0005):
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._sample_once()
            time.sleep(self.interval_s)

    def start(self) -> None:
        self._base_anon, self._base_shmem = _status_kb("RssAnon"), _status_kb("RssShmem")
        self._peak_anon, self._peak_shmem = self._base_anon, self._base_shmem
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def stop(self) -> dict[str, int]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample_once()
        return {"anon_extra": (self._peak_anon - self._base_anon) * 1024,
                "shmem_extra": (self._peak_shmem - self._base_shmem) * 1024}

    def _sample_once(self) -> None:
        self._peak_anon = max(self._peak_anon, _status_kb("RssAnon"))
        self._peak_shmem = max(self._peak_shmem, _status_kb("RssShmem"))


def cuda_memory_gib(device) -> dict[str, float]:
    """This process's CUDA caching-allocator holdings now, GiB: ``allocated_gib`` (``torch.cuda.memory_allocated``:
    live tensors) and ``reserved_gib`` (``torch.cuda.memory_reserved``: the segments it holds from the device, what
    another process on the GPU cannot have; above ``allocated_gib`` by the cached free blocks, which
    ``torch.cuda.empty_cache`` returns only where a whole segment is free); and ``device_used_gib``, the whole GPU's
    used memory (``torch.cuda.mem_get_info``: total - free, every process on it, what is outside PyTorch too).
    ``{}`` for a CPU device or without CUDA.
    """
    import torch

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {"allocated_gib": torch.cuda.memory_allocated(device) / 2**30,
            "reserved_gib": torch.cuda.memory_reserved(device) / 2**30, "device_used_gib": (total - free) / 2**30}


def set_expandable_segments(on: bool) -> None:
    """Switch this process's CUDA caching allocator between expandable segments (``on``: new segments are CUDA
    virtual-memory ranges mapped page by page, whose free pages ``torch.cuda.empty_cache`` unmaps, so freed memory
    goes back to the device whatever lives beside it) and ``cudaMalloc`` segments (``off``: what a legacy CUDA IPC
    handle can share), at run time (``torch._C._accelerator_setAllocatorSettings``, the call behind
    ``torch.cuda.memory._set_allocator_settings``; SkyRL #1470 and miles #2852 switch it on for the training step
    the same way). Segments already made keep their kind; a no-op without CUDA."""
    import torch

    if torch.cuda.is_available():
        torch._C._accelerator_setAllocatorSettings(f"expandable_segments:{'True' if on else 'False'}")


class CudaMemoryWindow:
    """This process's CUDA caching-allocator figures over a window of work (one training call).

    ``start()`` resets the peaks and reads the allocator's retry count; ``metrics(prefix)`` returns
    ``{prefix}peak_allocated_gib`` and ``{prefix}peak_reserved_gib`` (``torch.cuda.max_memory_allocated`` /
    ``max_memory_reserved``, GiB) and ``{prefix}alloc_retries``: how often an allocation found no cached
    block, freed the whole cache and tried again (``torch.cuda.memory_stats()["num_alloc_retries"]``; each one
    synchronizes the device: a step that retries hundreds of times is short of memory, not of compute).
    Without CUDA both return nothing.
    """

    def __init__(self, device):
        import torch

        self.device = torch.device(device)
        self._on = self.device.type == "cuda" and torch.cuda.is_available()
        self._retries = 0

    def start(self) -> None:
        import torch

        if self._on:
            torch.cuda.reset_peak_memory_stats(self.device)
            self._retries = torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)

    def metrics(self, prefix: str) -> dict[str, float]:
        import torch

        if not self._on:
            return {}
        stats = torch.cuda.memory_stats(self.device)
        return {f"{prefix}peak_allocated_gib": torch.cuda.max_memory_allocated(self.device) / 2**30,
                f"{prefix}peak_reserved_gib": torch.cuda.max_memory_reserved(self.device) / 2**30,
                f"{prefix}alloc_retries": float(stats.get("num_alloc_retries", 0) - self._retries)}
