"""The policy's Ray worker group: one ``PolicyWorker`` actor per rank and the ``PolicyGroup`` facade over them
(NeMo-RL's ``lm_policy``), and ``start_groups``, which starts it beside the engines.

Placement (which bundle each actor takes, one engine per ``tensor_parallel_size`` GPUs, placement groups per
node): ``nemo_fp8.distributed.placement``. The engines and their facade ``GenerationGroup``:
``nemo_fp8.generation.group``. Every rank gets the run's ``PolicySpec`` (``nemo_fp8.policy.spec``) and nothing else.

Start order (``start_groups``): the policy's rank actors (no backend yet, nothing on the GPUs), then the
engines (vLLM measures the free GPU memory as it starts), then the policy backends.

The driver holds ``PolicyGroup`` and ``GenerationGroup``, which implement the backend interfaces
at group level (the GRPO loop cannot tell them from local backends): batches are sharded by
data-parallel rank and gathered back; every call fans out through ``nemo_fp8.distributed.fanout``.
Weights reach the engines through ``nemo_fp8.distributed.weight_sync``,
actor to actor, never through the driver: packed buckets through Ray's object store
(``packed_weight_buckets`` -> ``receive_packed_bucket`` on every engine), CUDA IPC handles from the
policy rank on each engine's GPU (``send_weights_cuda_ipc``), or an NCCL broadcast from rank 0 to all
engines on GPUs of their own (``send_weights_nccl``; the group of rank 0 and every engine's workers is
formed once at start, ``init_weight_transfer_nccl`` / ``GenerationWorker.init_weight_transfer``, and
released by the actors' ``shutdown``).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterator, Optional, Sequence

import ray
import torch

from nemo_fp8.batch import TrainBatch
from nemo_fp8.distributed.cluster import free_address
from nemo_fp8.distributed.pipeline import ParallelLayout
from nemo_fp8.distributed.fanout import call_all, call_each, gather, shutdown_actors
from nemo_fp8.distributed.placement import ClusterPlan, MemoryProbe, Placement, actor_options, set_threads
from nemo_fp8.distributed.weight_sync import (PackedBucket, direct_refit_stream, iter_buckets, pack_bucket,
                                              update_info_stats, weight_stream)
from nemo_fp8.fp8.kv_scales import KvScales
from nemo_fp8.generation.group import GenerationGroup
from nemo_fp8.generation.spec import GenerationSpec
from nemo_fp8.policy.spec import PolicySpec

logger = logging.getLogger(__name__)


def max_per_key(per_rank: list[Optional[dict[str, float]]]) -> dict[str, float]:
    """The ranks' ``{name: value}`` dicts (None: nothing) -> each name's largest value."""
    out: dict[str, float] = {}
    for figures in per_rank:
        for k, v in (figures or {}).items():
            out[k] = max(out.get(k, v), v)
    return out


# --------------------------------------------------------------------------- actors
@ray.remote
class PolicyWorker(MemoryProbe):
    """One rank of the policy (data-parallel, or tensor-parallel with Megatron): a ``PolicyBackend``
    in its own process."""

    def __init__(self, torch_threads: Optional[int] = None):
        set_threads(torch_threads)
        self.backend = None
        self._nccl_group = None  # rank 0 of the refit's NCCL group (init_weight_transfer_nccl)
        self._packer = None  # the in-place packed refit's plan (send_weights_cuda_ipc with pack_in_place)

    def gpu_ids(self) -> list[str]:
        """The GPUs Ray gave this rank, as ``CUDA_VISIBLE_DEVICES`` values (``ray.get_gpu_ids()``)."""
        return [str(i) for i in ray.get_gpu_ids()]

    def rendezvous_address(self) -> str:
        """``tcp://ip:port`` with a free port on this node, for ``torch.distributed`` (rank 0)."""
        ip, port = free_address()
        return f"tcp://{ip}:{port}"

    def nccl_rendezvous(self) -> tuple[str, int]:
        """(this node's IP, a free port on it): where this rank, rank 0 of the refit's NCCL group, serves the
        group's TCP store (``NcclWeightSync.connect``)."""
        return free_address()

    def setup(self, spec: PolicySpec, rank: int, world_size: int, dist_init_method: Optional[str]) -> bool:
        """Build this rank's backend from the run's ``spec`` (``build_policy_backend``)."""
        from nemo_fp8.policy import build_policy_backend

        self.backend = build_policy_backend(spec, rank=rank, world_size=world_size, dist_init_method=dist_init_method)
        return True

    def get_logprobs(self, batch: TrainBatch, reference: bool) -> torch.Tensor:
        return self.backend.get_logprobs(batch, reference)

    def train_shard(self, batch: TrainBatch, loss_fn, micro_batches: Optional[list] = None):
        return self.backend.train_shard(batch, loss_fn, micro_batches)

    def calibrate_kv_scales(self, batch: TrainBatch, step: int, margin: float) -> KvScales:
        return self.backend.calibrate_kv_scales(batch, step, margin)

    def packed_weight_buckets(self, bucket_bytes: int, kv_scales: Optional[KvScales]) -> Iterator[PackedBucket]:
        """Streaming generator: the refit's tensors, packed one bucket at a time."""
        for bucket in iter_buckets(weight_stream(self.backend.named_weights(), kv_scales), bucket_bytes):
            yield pack_bucket(bucket)

    def send_weights_cuda_ipc(self, generation_worker, bucket_bytes: int, kv_scales: Optional[KvScales],
                              packed: bool = False, pack_in_place: bool = False) -> list[tuple[int, int, float]]:
        """The refit straight from this rank's GPU into a colocated vLLM engine (``CudaIpcWeightSync``).

        The weights (and KV scales) are quantized here as the engine's ``direct_refit_spec`` says and
        handed over bucket by bucket as CUDA IPC handles (vLLM's IPC weight-transfer engine): the engine
        actor passes each bucket's handles to ``LLM.update_weights`` and its worker copies from this
        process's memory, which stays alive until the call returns; ``packed``: one handle per bucket
        (``send_weights_ipc``), ``pack_in_place``: filled in place from this rank's second refit on (one
        ``InPlacePacker`` a rank: one engine, one model). Returns (tensors, bytes, seconds of the engine's call)
        per update.

        Raises:
            KeyError: a weight the engine's model does not have (raised before that tensor is quantized); with
                ``pack_in_place``, a refit whose tensors differ from the first one's.
        """
        from nemo_fp8.generation.vllm.refit import send_weights_ipc

        if pack_in_place and (self._packer is None or self._packer.bucket_bytes != bucket_bytes):
            from nemo_fp8.generation.vllm.packed_in_place import InPlacePacker

            self._packer = InPlacePacker(bucket_bytes)
        packer = self._packer if pack_in_place else None
        return self._send_direct([generation_worker], kv_scales,
                                 lambda stream, update, plan, layout: send_weights_ipc(
                                     stream, update, plan, bucket_bytes, packed=packed, layout=layout,
                                     packer=packer))

    def _send_direct(self, generation_workers: list, kv_scales: Optional[KvScales],
                     send) -> list[tuple[int, int, float]]:
        """What the direct refits (CUDA IPC, NCCL) share: the engine's ``direct_refit_spec``, this rank's weights and
        KV scales through ``direct_refit_stream``, ``send(stream, update, plan, layout) -> tensors sent`` (``layout``:
        the engine's ``KernelLayout`` or None) with ``update`` starting the engine actors' ``receive_update`` of a
        bucket's ``{"update_info": ...}`` and returning the wait for them (``send_weights_ipc``'s ``update_fn``),
        then ``note_sent``. Returns (tensors, bytes, seconds this rank waited for the engines' load) per bucket, of
        the converted tensors (``update_info_stats``)."""
        spec = ray.get(generation_workers[0].direct_refit_spec.remote())  # every engine has the same model
        names: list[str] = []
        buckets: list[tuple[int, int, float]] = []

        def update(payload: dict) -> Callable[[], None]:  # the engines' calls started; the wait for them returned
            refs = [w.receive_update.remote(payload) for w in generation_workers]

            def wait() -> None:  # the seconds this rank waits on the engines' load, what the next bucket's
                t0 = time.perf_counter()  # conversion (send_weights_ipc's, between the start and here) did not hide
                gather(refs, "receive_update")
                buckets.append((*update_info_stats(payload["update_info"]), time.perf_counter() - t0))
            return wait

        stream = direct_refit_stream(weight_stream(self.backend.named_weights(), kv_scales), spec["plan"],
                                     spec["skip"], names)
        n = send(stream, update, spec["plan"], spec.get("layout"))
        call_all(generation_workers, "note_sent", names, n)
        return buckets

    def init_weight_transfer_nccl(self, master_address: str, master_port: int, world_size: int) -> None:
        """Join the refit's NCCL group as rank 0, the weights' source, on this rank's GPU (``NcclWeightSync.connect``).

        vLLM 0.22's ``NCCLWeightTransferEngine.trainer_init`` (``refit.nccl_trainer_init``): serves the group's
        TCP store at ``master_address:master_port`` (``nccl_rendezvous``) and blocks until the engine's
        ``world_size - 1`` workers have joined (``GenerationWorker.init_weight_transfer``, started first).

        Raises:
            RuntimeError: this rank joined a group already.
        """
        from nemo_fp8.generation.vllm.refit import nccl_trainer_init

        if self._nccl_group is not None:
            raise RuntimeError("init_weight_transfer_nccl: this policy rank is in an NCCL refit group already")
        self._nccl_group = nccl_trainer_init(master_address, master_port, world_size)

    def send_weights_nccl(self, generation_workers: list, bucket_bytes: int,
                          kv_scales: Optional[KvScales]) -> list[tuple[int, int, float]]:
        """The refit from this rank's GPU to a vLLM engine on GPUs of its own, by NCCL broadcast (``NcclWeightSync``).

        The weights (and KV scales) stream in buckets of ``bucket_bytes`` (``iter_buckets``, bytes before
        conversion), the names the engine skips dropped and the others checked first (``direct_refit_stream``).
        Per bucket, ``refit.send_weights_nccl`` quantizes it here as the engine's ``direct_refit_spec`` says, has
        the engine actor's ``receive_update`` (``LLM.update_weights``) tell its workers the names/dtypes/shapes,
        from a thread, and broadcasts the bucket meanwhile; the call returns once the workers have loaded it
        (``NcclWeightSync``'s docstring says why this does not deadlock). Then ``note_sent``. Returns (tensors,
        bytes, seconds of the engines' call) per bucket, of the converted tensors.

        Raises:
            RuntimeError: no NCCL group (``init_weight_transfer_nccl`` first; ``start_workers`` does it for
                ``policy.weight_sync.method: nccl``).
            KeyError: a weight the engine's model does not have (raised before its bucket is sent).
        """
        from nemo_fp8.generation.vllm.refit import send_weights_nccl

        if self._nccl_group is None:
            raise RuntimeError("send_weights_nccl: this policy rank is in no NCCL refit group; "
                               "init_weight_transfer_nccl first (start_workers does it for "
                               "policy.weight_sync.method='nccl')")
        group = self._nccl_group

        def send(stream, update, plan, layout) -> int:  # update runs in send_weights_nccl's thread meanwhile
            if layout is not None:  # the config refuses it (vllm_cfg.refit_format)
                raise RuntimeError("send_weights_nccl: the NCCL refit sends the checkpoint format only; the engine "
                                   "expects its kernel format (vllm_cfg.refit_format: kernel)")

            def blocking(payload: dict) -> None:  # in send_weights_nccl's thread, across the bucket's broadcast
                update(payload)()

            return sum(send_weights_nccl(bucket, blocking, plan, group)
                       for bucket in iter_buckets(stream, bucket_bytes))

        return self._send_direct(generation_workers, kv_scales, send)

    def drain_weights(self) -> int:
        """Take part in an export another rank sends (Megatron tensor-parallel gathers)."""
        return self.backend.drain_weights()

    def prepare_for_training(self) -> None:
        self.backend.prepare_for_training()

    def offload_before_refit(self) -> None:
        self.backend.offload_before_refit()

    def offload_after_refit(self) -> None:
        self.backend.offload_after_refit()

    def release_cached_memory(self, gc_generation: int = 2) -> dict[str, float]:
        return self.backend.release_cached_memory(gc_generation) or {}

    def cuda_memory_gib(self) -> dict[str, float]:
        return self.backend.cuda_memory_gib() or {}

    def save(self, path: str) -> None:
        self.backend.save(path)

    def load(self, path: str) -> None:
        self.backend.load(path)

    def shutdown(self) -> None:
        """Release the refit's NCCL communicator (``PyNcclCommunicator.destroy``, if this rank joined one), then
        the backend."""
        group, self._nccl_group = self._nccl_group, None
        if group is not None:
            try:
                group.destroy()
            except Exception as e:  # the backend must still shut down
                logger.warning("destroying the NCCL refit communicator failed: %s", e)
        if self.backend is not None:
            self.backend.shutdown()


# --------------------------------------------------------------------------- facades
def shard_rows(size: int, parts: int) -> list[slice]:
    """``parts`` contiguous row ranges covering ``range(size)``, sizes differing by at most 1."""
    base, extra = divmod(size, parts)
    out, start = [], 0
    for r in range(parts):
        n = base + (1 if r < extra else 0)
        out.append(slice(start, start + n))
        start += n
    return out


def train_shard_indices(size: int, global_batch_size: int, dp_size: int, rank: int) -> torch.Tensor:
    """Rows of rank ``rank``: its ``global_batch_size / dp_size`` rows of every global batch, in order.

    Raises:
        ValueError: ``size`` not a multiple of ``global_batch_size``, or ``global_batch_size``
            not a multiple of ``dp_size``.
    """
    if size % global_batch_size or global_batch_size % dp_size:
        raise ValueError(f"train: {size} rows in global batches of {global_batch_size} over {dp_size} ranks: "
                         "the batch must be a multiple of the global batch, the global batch of the ranks")
    per_rank = global_batch_size // dp_size
    return torch.cat([torch.arange(g + rank * per_rank, g + (rank + 1) * per_rank)
                      for g in range(0, size, global_batch_size)]) if size else torch.zeros(0, dtype=torch.long)


class PolicyGroup:
    """``PolicyBackend`` over ``dp_size x tp_size x pp_size`` ``PolicyWorker`` ranks (see the module docstring).

    Ranks follow megatron-core's order (``nemo_fp8.distributed.pipeline.ParallelLayout``: tensor-parallel ranks
    neighbours, then data-parallel replicas, then pipeline stages): rank ``r`` is tensor-parallel rank
    ``r % tp_size`` of data-parallel rank ``(r // tp_size) % dp_size`` in stage ``r // (tp_size * dp_size)``. Every
    rank of one data-parallel group (all its stages and tensor-parallel ranks) gets the same rows; results are read
    from the group's ``layout.read_rank``: tensor-parallel rank 0 of the last stage.

    Args:
        workers: the rank actors, rank 0 first.
        global_batch_size: ``policy.train_global_batch_size``.
        tp_size: tensor-parallel ranks per replica.
        spec: the ranks' ``PolicySpec`` (None: ``setup`` cannot run; the group only forwards calls): with sequence
            packing its shapes plan the ranks' rows and micro-batches here, on the driver.
        pp_size: pipeline stages per replica.

    Raises:
        ValueError: a number of ranks that is not a multiple of ``tp_size x pp_size``.
    """

    def __init__(self, workers: list, global_batch_size: int, tp_size: int = 1, spec: Optional[PolicySpec] = None,
                 pp_size: int = 1):
        self.layout = ParallelLayout.from_world(len(workers), tp=tp_size, pp=pp_size)
        self.workers, self.global_batch_size, self.tp_size, self.pp_size = workers, global_batch_size, tp_size, pp_size
        self.dp_size = self.layout.dp
        self.spec = spec
        self.labels = [f"policy rank {r}" for r in range(len(workers))]

    @classmethod
    def create(cls, pg: Optional[Placement], plan: ClusterPlan, spec: PolicySpec,
               torch_threads: Optional[int]) -> "PolicyGroup":
        """Start the rank actors on their bundles without building their backends (nothing on the GPUs yet);
        ``setup`` builds them. Each rank's process gets ``spec.env_vars``, merged by Ray over the job's
        environment."""
        env = {"runtime_env": {"env_vars": dict(spec.env_vars)}} if spec.env_vars else {}
        workers = [PolicyWorker.options(**actor_options(pg, slot), **env).remote(torch_threads)
                   for slot in plan.policy_slots]
        return cls(workers, spec.global_batch_size, spec.tp_size, spec, pp_size=spec.pp_size)

    def setup(self) -> None:
        """Build every rank's backend (``build_policy_backend``; errors surface here)."""
        self.finish_setup(self.begin_setup())

    def begin_setup(self) -> list:
        """Start building every rank's backend from ``self.spec``; returns the calls' refs for ``finish_setup``."""
        world = len(self.workers)
        init = ray.get(self.workers[0].rendezvous_address.remote()) if world > 1 else None
        return [w.setup.remote(self.spec, r, world, init) for r, w in enumerate(self.workers)]

    def finish_setup(self, refs: list) -> None:
        """Wait for ``begin_setup``'s calls (a backend's construction error surfaces here)."""
        gather(refs, "setup", self.labels)
        logger.info("policy: %d rank(s) ready (data parallel %d x tensor parallel %d x pipeline %d)",
                    len(self.workers), self.dp_size, self.tp_size, self.pp_size)

    @classmethod
    def start(cls, pg, plan: ClusterPlan, spec: PolicySpec, torch_threads: Optional[int]) -> "PolicyGroup":
        """``create`` then ``setup``: the ranks on their bundles with their backends built."""
        group = cls.create(pg, plan, spec, torch_threads)
        group.setup()
        return group

    def gpu_ids(self, ranks: Sequence[int]) -> list[str]:
        """The physical GPU id (a ``CUDA_VISIBLE_DEVICES`` value) of each rank in ``ranks``, in that order.

        Raises:
            RuntimeError: a rank holds other than one GPU, or two ranks the same one.
        """
        ids = call_all([self.workers[r] for r in ranks], "gpu_ids", labels=[self.labels[r] for r in ranks])
        if any(len(i) != 1 for i in ids) or len({i[0] for i in ids}) != len(ids):
            raise RuntimeError(f"policy ranks {list(ranks)} hold GPUs {ids}; each must hold one GPU of its own")
        return [i[0] for i in ids]

    @property
    def weight_source(self):
        """The rank-0 actor, which streams the weights for the refit (the full model, every tensor once)."""
        return self.workers[0]

    @property
    def weight_peers(self) -> list:
        """The other ranks of replica 0 (its tensor-parallel ranks of every stage, ``layout.replica_ranks(0)``):
        they join the export (``drain_weights``), sending their parts to rank 0."""
        return [self.workers[r] for r in self.layout.replica_ranks(0)[1:]]

    def _call_all(self, method: str, *args) -> list:
        return call_all(self.workers, method, *args, labels=self.labels)

    def _per_rank(self, shards: list) -> list:
        """Data-parallel shards -> one per rank (every tensor-parallel rank and stage gets its group's)."""
        return [shards[self.layout.coords(r)[1]] for r in range(len(self.workers))]

    def _first_of_groups(self, outs: list) -> list:
        """Per-rank answers -> one per data-parallel group (its ``layout.read_rank``'s: tensor-parallel rank 0 of
        the last stage)."""
        return [outs[self.layout.read_rank(d)] for d in range(self.dp_size)]

    def _call_per_rank(self, method: str, shard_args: list[tuple]) -> list:
        """``method`` on every rank with its data-parallel group's arguments (``shard_args``: one tuple per
        data-parallel rank); the answers of each group's tensor-parallel rank 0."""
        return self._first_of_groups(call_each(self.workers, method, self._per_rank(shard_args), labels=self.labels))

    def _row_shards(self, batch: TrainBatch) -> list[torch.Tensor]:
        """Rows of each data-parallel rank for log-probs and KV calibration: contiguous, or with sequence
        packing balanced by tokens (``packing.plan_logprobs`` with ``spec.logprob_packing``)."""
        shape = self.spec.logprob_packing if self.spec is not None else None
        if shape is None:
            return [torch.arange(s.start, s.stop) for s in shard_rows(batch.size, self.dp_size)]
        from nemo_fp8.policy.packing import plan_logprobs

        return [torch.tensor(p.rows, dtype=torch.long)
                for p in plan_logprobs(batch.sequence_lengths(), self.dp_size, shape)]

    def get_logprobs(self, batch: TrainBatch, reference: bool = False) -> torch.Tensor:
        rows = self._row_shards(batch)
        outs = self._call_per_rank("get_logprobs", [(batch.select(r), reference) for r in rows])
        out = torch.zeros(batch.token_ids.shape, dtype=torch.float32)
        for r, o in zip(rows, outs):
            out[r] = o
        return out

    def train(self, batch: TrainBatch, loss_fn) -> dict[str, float]:
        """Each data-parallel rank trains on its rows of every global batch; with sequence packing the
        rows and micro-batches of ``packing.plan_train`` (every rank the same number of micro-batches,
        tokens balanced)."""
        from nemo_fp8.policy.torch_backend import reduce_train_results

        dp = self.dp_size
        shape = self.spec.train_packing if self.spec is not None else None
        if shape is None:
            plans = [(batch.select(train_shard_indices(batch.size, self.global_batch_size, dp, r)), None)
                     for r in range(dp)]
        else:
            from nemo_fp8.policy.packing import plan_train

            plans = [(batch.select(torch.tensor(p.rows, dtype=torch.long)), p.micro_batches)
                     for p in plan_train(batch.sequence_lengths(), self.global_batch_size, dp, shape)]
        return reduce_train_results(self._call_per_rank("train_shard", [(s, loss_fn, mbs) for s, mbs in plans]))

    def calibrate_kv_scales(self, batch: TrainBatch, step: int, margin: float = 1.0) -> KvScales:
        shards = [(batch.select(r), step, margin) for r in self._row_shards(batch)]
        return self._call_per_rank("calibrate_kv_scales", shards)[0]  # amax already max-reduced over all ranks

    def prepare_for_training(self) -> None:
        self._call_all("prepare_for_training")

    def offload_before_refit(self) -> None:
        self._call_all("offload_before_refit")

    def offload_after_refit(self) -> None:
        self._call_all("offload_after_refit")

    def release_cached_memory(self, gc_generation: int = 2) -> dict[str, float]:
        """Every rank's; the seconds of each part, the slowest rank's (the refit waits for all of them)."""
        return max_per_key(self._call_all("release_cached_memory", gc_generation))

    def cuda_memory_gib(self) -> dict[str, float]:
        """Every rank's; the largest of each figure (the fullest GPU is the one an engine beside it fails on)."""
        return max_per_key(self._call_all("cuda_memory_gib"))

    def save(self, path) -> None:
        self._call_all("save", str(path))  # rank 0 writes; Megatron ranks write shards

    def load(self, path) -> None:
        self._call_all("load", str(path))

    def shutdown(self, timeout_s: Optional[float] = None) -> None:
        """Shut every rank's backend down, then end the rank actors (also when a call fails or is late).

        Args:
            timeout_s: how long to wait for the ranks' shutdown calls (a rank still busy with the call a Ctrl-C
                interrupted runs it only after that one); None: no limit.

        Raises:
            TimeoutError: ranks that did not answer within ``timeout_s`` (named; their actors are ended anyway).
            ray.exceptions.RayError: a rank's shutdown raised or its process died.
        """
        shutdown_actors(self.workers, timeout_s, labels=self.labels)


def start_groups(placement: Placement, plan: ClusterPlan, policy_spec: PolicySpec, generation_spec: GenerationSpec,
                 torch_threads: Optional[int]) -> tuple[PolicyGroup, GenerationGroup]:
    """Start the policy ranks and the engines on ``plan``'s bundles, in the order the GPUs need.

    1. the policy's rank actors, backends not built (``PolicyGroup.create``: nothing on the GPUs);
    2. colocated engines of more than one GPU: the GPU ids of each engine's policy ranks (``plan.engine_ranks``),
       which become that engine actor's ``CUDA_VISIBLE_DEVICES`` (a one-GPU engine keeps Ray's: its bundle's);
    3. the engines, all at once (vLLM measures the free memory of its GPUs as it starts, so before the trainer
       allocates);
    4. colocated (``generation_spec.offload_when_idle``): the engines go to sleep, as after every rollout, so the
       trainer's weights, gradient buffers and optimizer state fit beside their reserved share of the GPU;
    5. the policy backends (``PolicyGroup.setup``). Without GPUs nothing is shared, so the backends build while the
       engines start (on a 2-core machine the two processes' imports and model builds overlap: seconds of the
       first run).

    Args:
        placement: ``create_placement_group(plan)``.
        policy_spec: every policy rank's backend (``nemo_fp8.policy.spec.PolicySpec``; its layout: ranks, tensor
            parallelism, global batch).
        generation_spec: every engine's backend (``nemo_fp8.generation.GenerationSpec``).

    Raises:
        RuntimeError: a shared policy rank holds other than one GPU of its own; or what building a
            backend raised (``EngineError`` naming the engine).
    """
    policy = PolicyGroup.create(placement, plan, policy_spec, torch_threads)
    visible = [policy.gpu_ids(ranks) if len(ranks) > 1 else None for ranks in plan.engine_ranks] or None
    on_gpu = any(b.get("GPU", 0) for b in plan.bundles)
    pending = None if on_gpu else policy.begin_setup()  # CPU: nothing shared, build beside the engines
    generation = GenerationGroup.start(placement, plan, generation_spec, torch_threads, cuda_visible_devices=visible)
    if generation_spec.offload_when_idle:  # colocated: the engines sleep while the trainer builds on their GPUs
        generation.finish_generation()
    if pending is None:
        pending = policy.begin_setup()
    policy.finish_setup(pending)
    return policy, generation
