"""Packed CUDA IPC refit buckets filled in place (``policy.weight_sync.pack_in_place``).

The packed refit (``refit.send_weights_ipc(..., packed=True)``) makes every converted tensor on its own (the FP8
quantizer's e4m3 weight and ``weight_scale_inv``, a bf16 cast), stacks fused parts into new tensors (the kernel
format's q/k/v and gate/up, ``KernelLayout.fuse``) and then copies a bucket's tensors into one uint8 buffer: per
weight up to three allocations and up to two copies. Filled in place, each bucket's buffer is allocated once and every
tensor is written straight into its place there: the quantizer's kernel writes the e4m3 rows and their scales into
views of the buffer (``quantize_blockwise_gpu(..., out=)``), a cast copies into one, and a fused part's rows are a
row range of its parameter's place. One read of each weight and one write of what the engine gets: the memory
traffic of the refit's floor.

The layout (``PackedLayout``) is what the packed path would send: the same buckets (``refit._buckets`` over the
fused stream), each with its tensors in the same order (widest dtype first) at the same offsets, so an engine gets
the same bytes either way (the CPU tests compare the buffers). It is planned from a refit's converted stream
(``PackedLayout.plan`` on ``(name, dtype, shape)`` in stream order, ``RefitPlan.conversions`` without computing
anything), so the first refit with ``pack_in_place`` goes the usual way and records its stream
(``InPlacePacker``), and every later one fills the planned buckets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterable, Iterator, Optional

import torch
from torch import Tensor

from nemo_fp8.generation.vllm.refit import (PACKED_MIN_BUFFER_BYTES, RefitPlan, UpdateFn, _finish, _InFlight,
                                            scale_inv_name, send_packed_buffer)

Meta = tuple[str, torch.dtype, tuple[int, ...]]  # a converted tensor: (name, dtype, shape)


def _elsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


@dataclass
class _Item:
    """One tensor of a bucket as the engine gets it: its name, dtype, shape and byte offset in the buffer."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int = 0
    nbytes: int = field(init=False)

    def __post_init__(self):
        self.nbytes = math.prod(self.shape) * _elsize(self.dtype)  # a scalar's: its 4 bytes


@dataclass
class _Bucket:
    items: list[_Item] = field(default_factory=list)  # in the buffer's order (widest dtype first)
    scalars: list[str] = field(default_factory=list)  # converted names of fp32 scalars, sent unpacked
    writes: int = 0  # converted tensors that land in it (its items' parts and its scalars)

    @property
    def total(self) -> int:
        return sum(it.nbytes for it in self.items)


@dataclass
class PackedLayout:
    """The packed buckets of a refit and where each converted tensor lands in them.

    Attributes:
        stream: the converted tensors' ``(name, dtype, shape)`` in the order the refit yields them.
        buckets: each bucket's tensors (``_Item``: engine name, dtype, shape, offset) and scalars.
        where: converted name -> (bucket, item index, first row, end row) of its place; a scalar's item index is -1.
    """

    stream: list[Meta]
    buckets: list[_Bucket]
    where: dict[str, tuple[int, int, int, int]]

    @cached_property
    def planned(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Converted name -> (dtype, shape) it was planned with (``stream``)."""
        return {name: (dtype, shape) for name, dtype, shape in self.stream}

    @classmethod
    def plan(cls, stream: list[Meta], bucket_bytes: int, layout=None) -> "PackedLayout":
        """The layout of ``stream`` (converted tensors in order) in buckets of ``bucket_bytes``, fused into the
        engine's parameters by ``layout`` (a ``kernel_format.KernelLayout``; None: each tensor as it is).

        Raises:
            KeyError / ValueError: what ``KernelLayout.fuse`` refuses (a tensor the engine has no parameter for, a
                fused part twice, a stacked shape or dtype not the parameter's).
        """
        fused = [(name, _Item(name, dtype, shape), [(name, shape[0] if shape else 1)])
                 for name, dtype, shape in stream] if layout is None else _fused_entries(stream, layout)
        buckets, where = [], {}
        for group in _group(fused, bucket_bytes):
            b = _Bucket()
            ordered = sorted((e for e in group if e[1].shape), key=lambda e: -_elsize(e[1].dtype))
            offset = 0
            for i, (_, item, parts) in enumerate(ordered):
                item.offset, offset = offset, offset + item.nbytes
                b.items.append(item)
                row = 0
                for part, rows in parts:
                    where[part] = (len(buckets), i, row, row + rows)
                    row += rows
                b.writes += len(parts)
            for name, item, _ in (e for e in group if not e[1].shape):
                where[name] = (len(buckets), -1, 0, 0)
                b.scalars.append(name)
                b.writes += 1
            buckets.append(b)
        return cls(list(stream), buckets, where)


def _group(entries: list, bucket_bytes: int) -> Iterator[list]:
    """``refit._buckets`` on planned entries: a bucket closes at the entry that brings it to ``bucket_bytes``."""
    group, size = [], 0
    for entry in entries:
        group.append(entry)
        size += entry[1].nbytes
        if size >= bucket_bytes:
            yield group
            group, size = [], 0
    if group:
        yield group


def _fused_entries(stream: list[Meta], layout) -> list[tuple[str, _Item, list[tuple[str, int]]]]:
    """(engine name, its item, [(converted part name, rows)] in part order) in the order ``layout.fuse`` yields the
    engine's tensors (a fused one when its last part has come): ``fuse`` itself, run on meta tensors of ``stream``,
    so its checks (a tensor the engine has no parameter for, a part twice, a stacked shape or dtype not the
    parameter's) hold here too."""
    parts: dict[str, list[tuple[int, str, int]]] = {}
    for name, _, shape in stream:
        engine, part, _ = layout.target(name)
        parts.setdefault(engine, []).append((part, name, shape[0] if shape else 1))
    metas = ((name, torch.empty(shape, dtype=dtype, device="meta")) for name, dtype, shape in stream)
    return [(engine, _Item(engine, t.dtype, tuple(t.shape)), [(n, rows) for _, n, rows in sorted(parts[engine])])
            for engine, t in layout.fuse(metas)]


class InPlacePacker:
    """``send_weights_ipc``'s packed refit, filled in place from the second refit on (module docstring).

    One per sending process and engine model: ``send_weights_ipc`` sends its first refit the usual packed way
    through ``record`` and plans ``layout`` after it (``plan_recorded``); every later refit goes through ``send``,
    as long as its stream stays the one recorded.

    Args:
        bucket_bytes: bytes of a bucket (``policy.weight_sync.bucket_size_mb``).
    """

    def __init__(self, bucket_bytes: int):
        self.bucket_bytes = bucket_bytes
        self.layout: Optional[PackedLayout] = None

    def record(self, converted: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """Pass the first refit's converted stream through, noting each tensor's ``(name, dtype, shape)``; the
        layout is planned when the stream ends (``plan_recorded``)."""
        self._seen: list[Meta] = []
        for name, t in converted:
            self._seen.append((name, t.dtype, tuple(t.shape)))
            yield name, t

    def plan_recorded(self, layout=None) -> None:
        """Plan ``self.layout`` from the stream ``record`` saw (``layout``: the engine's ``KernelLayout`` or None)."""
        self.layout = PackedLayout.plan(self._seen, self.bucket_bytes, layout)

    def send(self, named_tensors: Iterable[tuple[str, Tensor]], update_fn: UpdateFn, plan: RefitPlan,
             devices: list[torch.device], uuids: list[str]) -> int:
        """Convert ``named_tensors`` (HF names) straight into the planned buckets on ``devices[0]`` (``fill``) and
        send each one as it fills (one ``update_fn`` per bucket, as ``refit._send_packed``; the wait for a bucket's
        load comes after the next one is filled, so at most two buckets are alive); returns the number of engine
        tensors sent.

        Raises:
            KeyError, ValueError: as ``fill``.
        """
        n, in_flight = 0, None
        try:
            for index, buffer, scalars in self.fill(named_tensors, plan, devices[0]):
                _finish(in_flight)
                in_flight = self._send_bucket(index, buffer, scalars, update_fn, devices, uuids)
                n += len(self.layout.buckets[index].items) + len(scalars)
        except BaseException:
            _finish(in_flight, quiet=True)
            raise
        _finish(in_flight)
        torch.cuda.ipc_collect()
        return n

    def fill(self, named_tensors: Iterable[tuple[str, Tensor]], plan: RefitPlan, device: torch.device
             ) -> Iterator[tuple[int, Optional[Tensor], list[tuple[str, Tensor]]]]:
        """Each bucket, in order, as soon as all its tensors are in: (index, its uint8 buffer on ``device``, of at
        least ``PACKED_MIN_BUFFER_BYTES``; None when it holds only scalars, (name, fp32 scalar) of its scalars).

        Raises:
            KeyError: a converted tensor the layout has no place for, or of another dtype or shape than planned
                (the model changed: make a new ``InPlacePacker``).
            ValueError: a tensor written twice, or the stream ended with a bucket not full (a tensor missing).
        """
        from nemo_fp8.generation.vllm.quantize_gpu import quantize_blockwise_gpu

        lay = self.layout
        self._buffers: dict[int, Tensor] = {}
        self._written = [0] * len(lay.buckets)
        self._done: set[str] = set()
        scalars: dict[int, list[tuple[str, Tensor]]] = {}
        next_out = 0
        for name, tensor in named_tensors:
            for out, src, how in plan.conversions(name, tensor, device):
                if how == "fp8":
                    rows, cols = src.shape
                    q = self._place(out, torch.float8_e4m3fn, (rows, cols), device)
                    s = self._place(scale_inv_name(out), torch.float32,
                                    (math.ceil(rows / 128), math.ceil(cols / 128)), device)
                    quantize_blockwise_gpu(src, plan.scale_mode, out=(q, s))
                elif how == "scalar":
                    bucket = self._claim(out, torch.float32, ())
                    scalars.setdefault(bucket, []).append((out, src.to(torch.float32).reshape(())))
                else:
                    self._place(out, plan.dtype, tuple(src.shape), device).copy_(src)
            while next_out < len(lay.buckets) and self._written[next_out] == lay.buckets[next_out].writes:
                yield next_out, self._buffers.pop(next_out, None), scalars.pop(next_out, [])
                next_out += 1
        if next_out < len(lay.buckets):
            missing = sorted(set(lay.where) - self._done)
            raise ValueError(f"in-place packed refit: the stream ended without {missing[:3]} ({len(missing)} "
                             f"tensors): bucket {next_out} of {len(lay.buckets)} was not filled")

    def _claim(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> int:
        """Check converted tensor ``name`` against the plan and count its write; returns its bucket."""
        planned = self.layout.planned.get(name)
        if planned != (dtype, shape):
            got = "not in it" if planned is None else f"planned as {planned[0]} {list(planned[1])}"
            raise KeyError(f"in-place packed refit: {name} ({dtype} {list(shape)}) does not match the layout "
                           f"planned at the first refit ({got})")
        if name in self._done:
            raise ValueError(f"in-place packed refit: {name} written twice")
        self._done.add(name)
        bucket = self.layout.where[name][0]
        self._written[bucket] += 1
        return bucket

    def _place(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device) -> Tensor:
        """The view of its bucket's buffer that converted tensor ``name`` fills (its rows of the engine tensor),
        the buffer allocated at the bucket's first write."""
        bucket = self._claim(name, dtype, shape)
        _, i, r0, r1 = self.layout.where[name]
        if bucket not in self._buffers:
            size = max(self.layout.buckets[bucket].total, PACKED_MIN_BUFFER_BYTES)
            self._buffers[bucket] = torch.empty(size, dtype=torch.uint8, device=device)
        item = self.layout.buckets[bucket].items[i]
        full = self._buffers[bucket][item.offset: item.offset + item.nbytes].view(item.dtype).view(item.shape)
        return full[r0:r1]

    def _send_bucket(self, index: int, buffer: Optional[Tensor], scalars: list[tuple[str, Tensor]],
                     update_fn: UpdateFn, devices: list[torch.device], uuids: list[str]) -> _InFlight:
        """One packed update of bucket ``index``'s filled buffer (``refit.send_packed_buffer``, as the packed
        path's), its scalars in an unpacked one."""
        items = self.layout.buckets[index].items
        fields = {"names": [it.name for it in items], "dtype_names": [str(it.dtype).split(".")[-1] for it in items],
                  "shapes": [list(it.shape) for it in items]}
        return send_packed_buffer(buffer if items else None, fields, [it.nbytes for it in items], scalars,
                                  update_fn, devices, uuids)
