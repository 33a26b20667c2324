"""Count tensor -> Python transfers (a CPU-side proxy for CUDA host syncs).

On a GPU, reading a tensor's *value* on the host blocks the CPU until every queued kernel
has run: ``t.item()``, ``float(t)``, ``int(t)``, ``bool(t)`` (so ``if t:`` and ``if t > 0:``),
``t.tolist()``, ``t.numpy()``, and ops whose output *shape* depends on values, such as
boolean-mask indexing ``x[mask]`` (a ``nonzero``). Inside a training micro-batch each one
stalls the launch queue.

:func:`count_host_syncs` counts the Python-level calls of those methods while it is active,
on any device, CPU included, so a unit test can assert "this function does 0 host syncs"
without a GPU. It is a proxy: it sees only calls made through the Python ``torch.Tensor``
methods, not syncs made inside C++ ops (``torch.nonzero``, ``torch.unique``,
``torch.masked_select`` called as functions, copies to the CPU, ...). The GPU-side check is
``torch.cuda.set_sync_debug_mode("warn")`` (or ``"error"``), which reports every synchronising
CUDA call, whatever issued it.

Example::

    with count_host_syncs() as syncs:
        loss, metrics = clipped_pg_loss(...)
    assert syncs.count == 0, syncs.calls
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
from typing import Any, Callable, Iterator

import torch

__all__ = ["HostSyncCounter", "count_host_syncs", "SYNC_METHODS"]

#: Method of ``torch.Tensor`` -> the kind it is counted as (``calls`` keys). ``__index__``
#: (``range(t)``, ``lst[t]``) and ``nonzero`` / ``masked_select`` (value-dependent output
#: shape) are counted too. ``__getitem__`` / ``__setitem__`` count only when an index is a bool
#: or uint8 tensor (a mask), see :func:`_has_mask_index`.
SYNC_METHODS: dict[str, str] = {
    "item": "item",
    "__float__": "float",
    "__int__": "int",
    "__index__": "int",
    "__bool__": "bool",
    "tolist": "tolist",
    "numpy": "numpy",
    "nonzero": "nonzero",
    "masked_select": "masked_select",
    "__getitem__": "bool_mask_getitem",
    "__setitem__": "bool_mask_setitem",
}

_LOCK = threading.Lock()


class HostSyncCounter:
    """What :func:`count_host_syncs` yields.

    Attributes:
        count: total number of counted calls.
        calls: ``collections.Counter`` of kind (the values of :data:`SYNC_METHODS`) -> calls.
    """

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()

    @property
    def count(self) -> int:
        return sum(self.calls.values())

    def __repr__(self) -> str:
        return f"HostSyncCounter(count={self.count}, calls={dict(self.calls)})"


def _is_mask(index: Any) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _has_mask_index(index: Any) -> bool:
    """True when ``index`` (or an element of an index tuple/list) is a bool/uint8 tensor."""
    if _is_mask(index):
        return True
    if isinstance(index, (tuple, list)):
        return any(_is_mask(i) for i in index)
    return False


def _wrap(name: str, kind: str, original: Callable, counters: list[HostSyncCounter]) -> Callable:
    if name in ("__getitem__", "__setitem__"):

        @functools.wraps(original)
        def wrapper(self, index, *args, **kwargs):
            if _has_mask_index(index):
                for c in counters:
                    c.calls[kind] += 1
            return original(self, index, *args, **kwargs)

    else:

        @functools.wraps(original)
        def wrapper(self, *args, **kwargs):
            for c in counters:
                c.calls[kind] += 1
            return original(self, *args, **kwargs)

    return wrapper


# Active counters (a stack, so nested contexts each count) and the saved originals.
_ACTIVE: list[HostSyncCounter] = []
_SAVED: dict[str, tuple[bool, Callable]] = {}


@contextlib.contextmanager
def count_host_syncs() -> Iterator[HostSyncCounter]:
    """Count, while active, Python-level calls on ``torch.Tensor`` that read values on the host.

    Patches the methods of :data:`SYNC_METHODS` on ``torch.Tensor`` on entry and restores the
    originals on exit (also on an exception). Nested contexts are allowed: each counter sees
    the calls made while it is active. Counts calls from every thread (the patch is global).

    Yields:
        a :class:`HostSyncCounter` (``.count`` total, ``.calls`` per kind), final on exit.
    """
    counter = HostSyncCounter()
    with _LOCK:
        if not _ACTIVE:
            for name, kind in SYNC_METHODS.items():
                own = name in torch.Tensor.__dict__
                original = getattr(torch.Tensor, name)
                _SAVED[name] = (own, original)
                setattr(torch.Tensor, name, _wrap(name, kind, original, _ACTIVE))
        _ACTIVE.append(counter)
    try:
        yield counter
    finally:
        with _LOCK:
            _ACTIVE.remove(counter)
            if not _ACTIVE:
                for name, (own, original) in _SAVED.items():
                    if own:
                        setattr(torch.Tensor, name, original)
                    else:
                        delattr(torch.Tensor, name)
                _SAVED.clear()
