"""Process memory readings for refit and colocation diagnostics (Linux ``/proc``).

``peak_rss_bytes`` reads the resident-set high-water mark (``VmHWM``); ``reset_peak_rss`` resets
it (``/proc/self/clear_refs``, Linux >= 4.0), so the peak of one operation can be measured:
reset, run it, read. CUDA memory is read with ``torch.cuda.max_memory_allocated`` instead.
"""

from __future__ import annotations

from pathlib import Path


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} (not Linux?)")


def rss_bytes() -> int:
    """Current resident set size of this process, bytes."""
    return _status_kb("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """Resident-set high-water mark of this process since start or the last ``reset_peak_rss``, bytes."""
    return _status_kb("VmHWM") * 1024


def reset_peak_rss() -> bool:
    """Reset the high-water mark to the current RSS; False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def memory_stats(reset_peak: bool = False) -> dict[str, int]:
    """``{"rss": bytes, "peak_rss": bytes}`` of this process; ``reset_peak`` first resets the peak."""
    if reset_peak:
        reset_peak_rss()
    return {"rss": rss_bytes(), "peak_rss": peak_rss_bytes()}
