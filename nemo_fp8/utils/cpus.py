"""The CPUs a run may use, and splitting them among runs that share a machine.

A process bound to some of the machine's cores (``taskset``, a cgroup cpuset, a launcher's CPU binding, or
``tools/compare_precision.py`` running several variants side by side) should size its thread pools and its local
Ray cluster to those cores, not to ``os.cpu_count()``, which counts the whole machine: four runs on a 64-core node
that each start 64 torch threads and a 64-CPU Ray cluster oversubscribe the host (Megatron-Bridge's performance
guide names CPU binding among the fixes for host-bound training).
"""

from __future__ import annotations

import os
from typing import Sequence


def affinity_cpus() -> list[int] | None:
    """The ids of the CPUs this process may run on (its affinity mask, ``os.sched_getaffinity``), sorted; None
    where the platform has no affinity call (macOS)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return sorted(os.sched_getaffinity(0))


def usable_cpus() -> int:
    """How many CPUs this process may run on: the size of its affinity mask (:func:`affinity_cpus`), or
    ``os.cpu_count()`` where the platform has no affinity call. Always >= 1."""
    ids = affinity_cpus()
    return max(1, len(ids)) if ids is not None else os.cpu_count() or 1


def split_cpus(cpus: Sequence[int], slots: int, min_per_slot: int = 1) -> list[list[int]] | None:
    """Split ``cpus`` (CPU ids, e.g. ``sorted(os.sched_getaffinity(0))``) into ``slots`` disjoint blocks of
    consecutive ids, as even as possible (the first ``len(cpus) % slots`` blocks get one more).

    Consecutive ids keep a block on few sockets where the kernel numbers a socket's cores together, and on
    distinct physical cores where it numbers hyper-threads after all cores (the usual x86 layout).

    Returns:
        ``slots`` lists of CPU ids, or None when a block would hold fewer than ``min_per_slot`` CPUs (the caller
        then leaves the runs unbound).

    Raises:
        ValueError: ``slots`` or ``min_per_slot`` < 1.
    """
    if slots < 1 or min_per_slot < 1:
        raise ValueError(f"slots and min_per_slot must be >= 1, got {slots} and {min_per_slot}")
    ids = sorted(set(cpus))
    size, extra = divmod(len(ids), slots)
    if size < min_per_slot:
        return None
    blocks, start = [], 0
    for i in range(slots):
        end = start + size + (1 if i < extra else 0)
        blocks.append(ids[start:end])
        start = end
    return blocks
