"""Weight sync: the refit's transport from the policy to the rollout engine, in buckets.

The policy yields HF-named high-precision tensors (``PolicyBackend.named_weights``, a stream);
the sync groups them into buckets of at most ``bucket_size_mb`` (a larger tensor travels
alone), moves one bucket at a time, and the engine quantizes each tensor on arrival
(``GenerationBackend.update_weights``: FP8 layers re-quantize blockwise in place). FP8 KV scales
(``nemo_fp8.fp8.kv_scales``) travel last, in the same stream, and the whole update is tagged with
its version (the GRPO step), so the engine can tell stale from fresh.

Peak extra memory is one bucket plus the largest tensor, never a copy of the model (the older
refit sent the whole state dict as one object: for an 8B model, 16 GB through Ray's object
store every step). The same design as NeMo-RL's ``weight_sync`` and verl's checkpoint engine
(``send_weights`` / ``receive_weights`` in buckets).

Transports (``policy.weight_sync.method``), each to every engine of the run
(``nemo_fp8.generation.group``; every engine's version is checked, a failing one named):

* ``in_process``: policy and engine in one process; buckets are lists of views, no copy.
* ``object_store``: Ray actors. The policy's rank 0 packs a bucket into one contiguous uint8
  numpy buffer (zero-copy into Ray's shared-memory object store), a streaming generator hands
  the engines one bucket at a time (back-pressure keeps at most one more in flight), put once and
  read by every engine, which unpacks views of the shared buffer and copies them into its parameters.
* ``cuda_ipc``: Ray actors, one-GPU vLLM engines colocated with the policy, one per rank. The policy
  rank on each engine's GPU quantizes each bucket there and hands its engine CUDA IPC handles (vLLM's
  IPC weight-transfer engine, ``trainer_send_weights``); the engine's worker copies from the policy's
  memory. Nothing goes through host memory, and FP8 layers travel as FP8 + ``scale_inv`` (about
  half the bytes of bf16).
* ``nccl``: Ray actors, vLLM engines on GPUs of their own (``generation.colocated.enabled: false``,
  tensor parallel n >= 1). At start (``NcclWeightSync.connect``) the policy's rank 0 and every engine's n
  workers form one NCCL group (vLLM 0.22's ``NCCLWeightTransferEngine``: trainer rank 0, engine i's
  workers 1 + i*n ..); at each refit rank 0 quantizes a bucket on its GPU, tells the engines the
  names/dtypes/shapes and broadcasts it once (``refit.send_weights_nccl``), GPU to GPUs. Nothing goes
  through host memory; FP8 layers travel as FP8 + ``scale_inv``. ``auto`` does not pick it.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional, Protocol, Sequence

import numpy as np
import torch
from torch import Tensor

from nemo_fp8.distributed.fanout import call_all, call_each, gather
from nemo_fp8.fp8.kv_scales import KvScales

logger = logging.getLogger(__name__)

_ALIGN = 16  # bytes; every tensor starts at a multiple, so views of any dtype are legal


@dataclass(frozen=True)
class WeightVersion:
    """What the engine holds after a refit: the policy version of its weights and KV scales.

    Attributes:
        weights: GRPO step of the policy weights loaded (0: the initial weights), or -1 before
            the first refit.
        kv_scales: GRPO step of the FP8 KV scales loaded, or -1 when none were ever sent.
        num_tensors: tensors received in the last update (weights and scales).
    """

    weights: int = -1
    kv_scales: int = -1
    num_tensors: int = 0


def iter_buckets(named_tensors: Iterable[tuple[str, Tensor]], bucket_bytes: int,
                 nbytes: Optional[Callable[[Tensor], int]] = None) -> Iterator[list[tuple[str, Tensor]]]:
    """Group a stream of ``(name, tensor)`` into lists of at most ``bucket_bytes`` (no copies).

    A tensor larger than ``bucket_bytes`` forms a bucket on its own. Order is preserved. ``nbytes``: the bytes a
    tensor takes in a bucket (default: its own; a packed layout may round each up to its alignment).

    Raises:
        ValueError: ``bucket_bytes <= 0``.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for name, t in named_tensors:
        n = nbytes(t) if nbytes is not None else t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


@dataclass
class PackedBucket:
    """One bucket as a single contiguous byte buffer plus the metadata to view it back.

    Attributes:
        names: HF names, in order.
        shapes: each tensor's shape.
        dtypes: each tensor's dtype name (``"bfloat16"``, ``"float32"``, ...).
        offsets: byte offset of each tensor in ``buffer`` (multiples of 16).
        buffer: [nbytes] uint8 numpy array (numpy, so Ray stores and reads it zero-copy).
    """

    names: list[str]
    shapes: list[tuple[int, ...]]
    dtypes: list[str]
    offsets: list[int]
    buffer: np.ndarray = field(repr=False)

    @property
    def nbytes(self) -> int:
        return int(self.buffer.nbytes)


def pack_bucket(items: list[tuple[str, Tensor]]) -> PackedBucket:
    """Copy ``items`` (any device) into one host byte buffer (one bucket's worth of memory).

    Raises:
        ValueError: a tensor of a non-float, non-integer dtype that cannot be viewed as bytes.
    """
    offsets, total = [], 0
    for _, t in items:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    buffer = np.empty(total, dtype=np.uint8)
    flat = torch.from_numpy(buffer)
    for (name, t), off in zip(items, offsets):
        n = t.numel() * t.element_size()
        flat[off:off + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8), non_blocking=False)
    return PackedBucket([n for n, _ in items], [tuple(t.shape) for _, t in items],
                        [str(t.dtype).removeprefix("torch.") for _, t in items], offsets, buffer)


def unpack_bucket(bucket: PackedBucket) -> list[tuple[str, Tensor]]:
    """Views of ``bucket.buffer`` as the original tensors (no copy; read-only if the buffer is).

    Raises:
        ValueError: metadata that does not fit the buffer.
    """
    with warnings.catch_warnings():  # a buffer read from Ray's object store is read-only; we only read it
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(bucket.buffer)
    out = []
    for name, shape, dtype, off in zip(bucket.names, bucket.shapes, bucket.dtypes, bucket.offsets):
        dt = getattr(torch, dtype)
        n = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dt).element_size()
        if off + n > flat.numel():
            raise ValueError(f"bucket entry {name} ({dtype}{list(shape)}) at offset {off} overruns the "
                             f"{flat.numel()}-byte buffer")
        out.append((name, flat[off:off + n].view(dt).reshape(shape)))
    return out


def weight_stream(named_weights: Iterable[tuple[str, Tensor]],
                  kv_scales: Optional[KvScales]) -> Iterator[tuple[str, Tensor]]:
    """The refit's tensor stream: the policy's weights, then the FP8 KV scales if any."""
    yield from named_weights
    if kv_scales is not None:
        yield from kv_scales.named_tensors()


@dataclass
class SyncStats:
    """What one refit moved.

    Attributes:
        version: the policy version (GRPO step) sent.
        num_tensors, num_buckets: counts.
        bytes: payload bytes (sum of tensor sizes).
        max_bucket_bytes: the largest bucket sent (bounds the extra memory).
        seconds: wall time of the whole update.
        start_seconds, finish_seconds: the engines' ``start_weight_update`` / ``finish_weight_update`` with the
            version checks (vLLM's layerwise reload set up and finished).
        load_seconds: the seconds the sender waited for the buckets' engine calls (the Ray call, vLLM's RPC to its
            workers and their load), summed: over NCCL each call whole (it spans the bucket's broadcast, which the
            sender runs meanwhile); over CUDA IPC from the conversion of the next bucket, made while the engine
            loads (``send_weights_ipc``), to the call's return; 0 where the transport does not time them.
    """

    version: int
    num_tensors: int = 0
    num_buckets: int = 0
    bytes: int = 0
    max_bucket_bytes: int = 0
    seconds: float = 0.0
    start_seconds: float = 0.0
    finish_seconds: float = 0.0
    load_seconds: float = 0.0

    def add_bucket(self, num_tensors: int, nbytes: int, load_seconds: float = 0.0) -> None:
        self.num_buckets += 1
        self.num_tensors += num_tensors
        self.bytes += nbytes
        self.max_bucket_bytes = max(self.max_bucket_bytes, nbytes)
        self.load_seconds += load_seconds

    def parts(self) -> dict[str, float]:
        """Seconds of the update by part: ``start`` and ``finish`` (the engines' weight-update frame), ``load`` (the
        sender's waits for the engines' calls per bucket) and ``export``, the rest: the sender's export of its
        weights, their conversion (FP8 quantization), packing, and the calls that start the transfer. Empty when
        the buckets' loads were not timed (the export could not be told from the load)."""
        if not self.load_seconds:
            return {}
        export = self.seconds - self.start_seconds - self.finish_seconds - self.load_seconds
        return {"start": self.start_seconds, "export": max(export, 0.0), "load": self.load_seconds,
                "finish": self.finish_seconds}

    def metrics(self) -> dict[str, float]:
        return {"refit/num_buckets": float(self.num_buckets), "refit/gbytes": self.bytes / 1e9,
                "refit/max_bucket_mbytes": self.max_bucket_bytes / 2**20,
                "refit/gbytes_per_s": self.bytes / 1e9 / max(self.seconds, 1e-9)}


def direct_refit_stream(named_tensors: Iterable[tuple[str, Tensor]], plan, skip: set[str],
                        sent_names: list[str]) -> Iterator[tuple[str, Tensor]]:
    """The refit's tensors as a trainer sends them straight into a vLLM engine (CUDA IPC or NCCL).

    Drops the names in ``skip`` (what the engine does not take: a tied ``lm_head``), checks each other name
    against the engine's ``plan`` (``RefitPlan.checked_names``) before it is yielded, so before anything of
    it is quantized or sent, and appends it to ``sent_names`` (for ``note_sent``).

    Args:
        named_tensors: ``(HF name, tensor)``, e.g. ``weight_stream(...)``.
        plan, skip: the engine's ``direct_refit_spec()`` (``"plan"``, ``"skip"``).
        sent_names: filled with the names yielded, in order.

    Raises:
        KeyError: a name the engine's model has no weight for.
    """
    for name, t in named_tensors:
        if name in skip:
            continue
        plan.checked_names([name])
        sent_names.append(name)
        yield name, t


def update_info_stats(update_info: dict) -> tuple[int, int]:
    """(tensors, bytes) of one ``update_info`` of vLLM's weight-transfer engines (IPC or NCCL), from its
    ``names`` / ``dtype_names`` / ``shapes`` (a shape ``[]`` is a scalar)."""
    nbytes = sum(math.prod(shape) * getattr(torch, d).itemsize
                 for d, shape in zip(update_info["dtype_names"], update_info["shapes"]))
    return len(update_info["names"]), nbytes


class WeightSync(Protocol):
    def sync(self, version: int, kv_scales: Optional[KvScales] = None) -> SyncStats:
        """Move the policy's current weights (and KV scales) into the engine, as ``version``."""
        ...


def _check_version(got: WeightVersion, version: int, kv_scales: Optional[KvScales],
                   engine: str = "the engine") -> None:
    if got.weights != version:
        raise RuntimeError(f"refit: {engine} reports weights of version {got.weights} after an update to {version}")
    if kv_scales is not None and got.kv_scales != kv_scales.step:
        raise RuntimeError(f"refit: {engine} reports KV scales of step {got.kv_scales}, sent {kv_scales.step}")


def engine_labels(generation_workers: Sequence, labels: Optional[Sequence[str]]) -> list[str]:
    """What errors call each engine: ``labels`` (``GenerationGroup.labels``: index, node, GPUs) or ``engine <i>``."""
    return list(labels) if labels else [f"engine {i}" for i in range(len(generation_workers))]


def _sync_actors(generation_workers: Sequence, labels: Sequence[str], peers: Sequence, version: int,
                 kv_scales: Optional[KvScales], transfer: Callable[[], Iterable[tuple]]) -> SyncStats:
    """The frame every refit between Ray actors shares: every engine's ``start_weight_update``; the ``peers``
    (Megatron tensor-parallel ranks that gather their shards into rank 0's export) join with
    ``drain_weights``; ``transfer()`` moves the buckets to every engine and yields (tensors, bytes) or (tensors,
    bytes, seconds of the engines' load) per bucket (one engine's copy); then every engine's
    ``finish_weight_update`` and the version checks, each engine named. The times of the frame's parts go into
    the ``SyncStats`` (``parts``).

    Raises:
        RuntimeError: an engine's checks (a refit in progress, weights missing, KV scales incomplete or of
            another step, another version held), naming the engine; whatever ``transfer`` raises.
    """
    import ray

    t0 = time.perf_counter()
    stats = SyncStats(version)
    call_all(generation_workers, "start_weight_update", version)
    stats.start_seconds = time.perf_counter() - t0
    draining = [p.drain_weights.remote() for p in peers]
    for bucket in transfer():
        stats.add_bucket(*bucket)
    ray.get(draining)
    t1 = time.perf_counter()
    held = call_all(generation_workers, "finish_weight_update")
    for got, label in zip(held, labels):
        _check_version(got, version, kv_scales, label)
    stats.finish_seconds = time.perf_counter() - t1
    stats.seconds = time.perf_counter() - t0
    return stats


class InProcessWeightSync:
    """Policy and engine objects in one process: buckets of views, no copies.

    Args:
        policy: a ``PolicyBackend`` (``named_weights``).
        generation: a ``GenerationBackend``.
        bucket_bytes: bucket size in bytes.
    """

    def __init__(self, policy, generation, bucket_bytes: int):
        self.policy, self.generation, self.bucket_bytes = policy, generation, bucket_bytes

    def sync(self, version: int, kv_scales: Optional[KvScales] = None) -> SyncStats:
        t0 = time.perf_counter()
        stats = SyncStats(version)
        self.generation.start_weight_update(version)
        stats.start_seconds = time.perf_counter() - t0
        for bucket in iter_buckets(weight_stream(self.policy.named_weights(), kv_scales), self.bucket_bytes):
            t1 = time.perf_counter()
            self.generation.update_weights(bucket)
            stats.add_bucket(len(bucket), sum(t.numel() * t.element_size() for _, t in bucket),
                             time.perf_counter() - t1)
        t1 = time.perf_counter()
        _check_version(self.generation.finish_weight_update(), version, kv_scales)
        stats.finish_seconds = time.perf_counter() - t1
        stats.seconds = time.perf_counter() - t0
        return stats


class ObjectStoreWeightSync:
    """Ray actors: packed buckets stream policy rank 0 -> object store -> every engine actor.

    Each bucket is put into the object store once and every engine reads it from there (one object, any number
    of readers); the next bucket is packed while the engines load this one.

    Args:
        policy_worker: the policy's rank-0 actor (``PolicyWorker``), which sends a full replica.
        generation_workers: the engines' actors (``GenerationWorker``), engine 0 first.
        bucket_bytes: bucket size in bytes.
        peers: policy actors that must take part in the export without sending (the other
            tensor-parallel ranks of a Megatron replica: the export gathers their shards).
        labels: per engine, what errors call it (``GenerationGroup.labels``).
    """

    def __init__(self, policy_worker, generation_workers: Sequence, bucket_bytes: int, peers: Sequence = (),
                 labels: Optional[Sequence[str]] = None):
        self.policy_worker, self.bucket_bytes = policy_worker, bucket_bytes
        self.generation_workers = list(generation_workers)
        self.peers, self.labels = list(peers), engine_labels(self.generation_workers, labels)

    def sync(self, version: int, kv_scales: Optional[KvScales] = None) -> SyncStats:
        def transfer():
            # One bucket is packed ahead while the engines load the previous one (back-pressure 1).
            stream = self.policy_worker.packed_weight_buckets.options(
                num_returns="streaming", _generator_backpressure_num_objects=1).remote(self.bucket_bytes, kv_scales)
            for ref in stream:
                # The ref resolves inside each engine actor, straight from the object store.
                t0 = time.perf_counter()
                loaded = call_all(self.generation_workers, "receive_packed_bucket", ref)
                del ref  # its object can be freed now
                yield (*loaded[0], time.perf_counter() - t0)

        return _sync_actors(self.generation_workers, self.labels, self.peers, version, kv_scales, transfer)


class CudaIpcWeightSync:
    """Ray actors sharing GPUs: each engine's policy rank quantizes and sends it CUDA IPC handles.

    Engine ``i`` (one GPU, vLLM tensor parallel 1) runs on the GPU of policy rank ``i``. Every rank drives the
    transfer into its engine at the same time (``PolicyWorker.send_weights_cuda_ipc``); with Megatron tensor
    parallelism the ranks of a group export together, and Megatron-Bridge's ``export_hf_weights`` gathers each
    tensor onto every one of them ("all ranks get full tensors"), so each engine gets whole tensors from the rank
    on its GPU and no bucket crosses GPUs or host memory. Per bucket a rank calls its engine actor, which loads the
    bucket through ``LLM.update_weights`` before the call returns; the rank converts the next bucket meanwhile and
    waits for that call before the next one (``send_weights_ipc``), so each GPU holds at most two buckets of
    converted tensors besides the policy's weights, quantized once per bucket on that GPU.

    Args:
        policy_workers: per engine, the policy rank on its GPU (``PolicyWorker``).
        generation_workers: the engines' actors (``GenerationWorker`` with the vLLM backend), engine 0 first.
        bucket_bytes: bucket size in bytes (of the converted tensors).
        labels: per engine, what errors call it (``GenerationGroup.labels``).
        packed: one IPC handle per bucket instead of per tensor (``policy.weight_sync.packed``,
            ``refit.send_weights_ipc``).
        pack_in_place: with ``packed``, the buckets filled in place from the second refit on
            (``policy.weight_sync.pack_in_place``, ``packed_in_place.InPlacePacker``).

    Raises:
        ValueError: not one policy rank per engine.
    """

    def __init__(self, policy_workers: Sequence, generation_workers: Sequence, bucket_bytes: int,
                 labels: Optional[Sequence[str]] = None, packed: bool = False, pack_in_place: bool = False):
        self.policy_workers, self.generation_workers = list(policy_workers), list(generation_workers)
        if len(self.policy_workers) != len(self.generation_workers):
            raise ValueError(f"CUDA IPC refit: {len(self.policy_workers)} policy ranks for "
                             f"{len(self.generation_workers)} engines; each engine needs the rank on its GPU")
        self.bucket_bytes, self.labels = bucket_bytes, engine_labels(self.generation_workers, labels)
        self.packed, self.pack_in_place = packed, pack_in_place

    def sync(self, version: int, kv_scales: Optional[KvScales] = None) -> SyncStats:
        def transfer():
            sent = call_each(self.policy_workers, "send_weights_cuda_ipc",
                             [(g, self.bucket_bytes, kv_scales, self.packed, self.pack_in_place)
                              for g in self.generation_workers])
            return sent[0]  # every engine gets the same buckets: one engine's count

        return _sync_actors(self.generation_workers, self.labels, (), version, kv_scales, transfer)


class NcclWeightSync:
    """Ray actors on separate GPUs: the policy's rank 0 quantizes each bucket and broadcasts it over NCCL to
    the workers of every vLLM engine (vLLM 0.22's ``NCCLWeightTransferEngine``), GPUs of their own.

    ``connect`` (once, at start, ``nemo_fp8.trainer.start_workers``): policy rank 0 picks an address on its node
    (``PolicyWorker.nccl_rendezvous``); engine ``i``'s ``engine_gpus`` workers join as ranks
    ``1 + i*engine_gpus ..`` (``GenerationWorker.init_weight_transfer``) and rank 0 as the trainer
    (``PolicyWorker.init_weight_transfer_nccl``): one group of ``1 + engines x engine_gpus`` ranks, so one
    broadcast per bucket reaches every engine. All calls block until every rank has joined, so all are started
    before any is waited on.

    ``sync`` (each refit): every engine's ``start_weight_update``; the Megatron tensor-parallel ``peers`` join the
    export (``drain_weights``) as in ``ObjectStoreWeightSync``; rank 0 streams its weights and KV scales in
    buckets of ``bucket_bytes`` (``PolicyWorker.send_weights_nccl``), then ``note_sent``; every engine's
    ``finish_weight_update`` and the version checks. At most one bucket (converted, plus vLLM's packed
    buffer of it) exists besides the policy's weights.

    Why the actors (each ``max_concurrency=1``) do not deadlock: while rank 0's ``send_weights_nccl``
    holds the policy actor, the driver waits on it and sends the engine actors nothing, so each engine actor
    runs one call at a time from rank 0: ``receive_update`` per bucket, whose ``LLM.update_weights`` blocks in
    vLLM's workers until the broadcast arrives. Rank 0 makes those calls (one per engine, all at once) from a
    thread of its own (``refit.send_weights_nccl``) and broadcasts meanwhile from the actor's thread; ``ray.get``
    from a second thread needs no free slot of the policy actor. The broadcast's receivers are the engines'
    worker processes, not the engine actors, so it completes, the workers load, ``receive_update`` returns,
    and the next bucket starts.

    Args:
        policy_worker: the policy's rank-0 actor (``PolicyWorker``), which sends a full replica.
        generation_workers: the engines' actors (``GenerationWorker`` with a vLLM backend built with
            ``weight_transfer="nccl"``), engine 0 first.
        bucket_bytes: bucket size in bytes, of the policy's tensors before conversion (an FP8 layer then
            travels in about half).
        engine_gpus: each engine's workers (vLLM's ``tensor_parallel_size``).
        peers: policy actors that must take part in the export without sending (``ObjectStoreWeightSync``).
        labels: per engine, what errors call it (``GenerationGroup.labels``).
    """

    def __init__(self, policy_worker, generation_workers: Sequence, bucket_bytes: int, engine_gpus: int = 1,
                 peers: Sequence = (), labels: Optional[Sequence[str]] = None):
        self.policy_worker, self.bucket_bytes = policy_worker, bucket_bytes
        self.generation_workers = list(generation_workers)
        self.engine_gpus, self.peers = engine_gpus, list(peers)
        self.labels = engine_labels(self.generation_workers, labels)

    @property
    def world_size(self) -> int:
        """Ranks of the NCCL group: the trainer's rank 0 plus every engine's workers."""
        return 1 + len(self.generation_workers) * self.engine_gpus

    def connect(self) -> None:
        """Form the NCCL group (see the class docstring); returns once every rank has joined.

        Raises:
            RuntimeError, ValueError: what any side raised (an engine built without NCCL weight transfer,
                ranks that do not fit the group, a group formed already).
        """
        import ray

        address, port = ray.get(self.policy_worker.nccl_rendezvous.remote())
        engines = [w.init_weight_transfer.remote(address, port, self.world_size, 1 + i * self.engine_gpus)
                   for i, w in enumerate(self.generation_workers)]
        trainer = self.policy_worker.init_weight_transfer_nccl.remote(address, port, self.world_size)
        gather([*engines, trainer], "init_weight_transfer")
        logger.info("refit over NCCL: policy rank 0 + %d engine(s) x %d worker(s) joined at %s:%d",
                    len(self.generation_workers), self.engine_gpus, address, port)

    def sync(self, version: int, kv_scales: Optional[KvScales] = None) -> SyncStats:
        """Move the policy's current weights (and KV scales) into every engine as ``version``; per-bucket stats
        are of the converted tensors (FP8 + ``scale_inv`` where the engines are FP8), broadcast once.

        Raises:
            RuntimeError: a refit in progress, the group not formed (``connect``), or an engine's checks
                (weights missing, KV scales incomplete or of another step, another version held), naming it.
            KeyError: a weight the engines' model does not have (raised before it is sent).
        """
        import ray

        return _sync_actors(self.generation_workers, self.labels, self.peers, version, kv_scales, lambda: ray.get(
            self.policy_worker.send_weights_nccl.remote(self.generation_workers, self.bucket_bytes, kv_scales)))
