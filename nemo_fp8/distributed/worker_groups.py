"""Ray worker groups for the policy (N data-parallel ranks) and the rollout engine, with typed facades.

Layout (``plan_cluster``): one Ray placement group whose bundles hold every actor of the run. The
engine runs on ``engine_gpus`` GPUs (vLLM's ``tensor_parallel_size``; 1 for the torch engine).

* CPU: one ``{"CPU": 1}`` bundle per policy rank plus one for the engine.
* CUDA, colocated (``policy.generation.colocated.enabled``): one ``{"CPU": 1, "GPU": 1}``
  bundle per policy rank; the engine sleeps while the trainer works (NeMo-RL's colocated mode).
  Its actor takes half of bundle 0's GPU (rank 0 the other half) and its engine runs on the GPUs
  of policy ranks ``0..engine_gpus-1`` (needs a policy world size >= ``engine_gpus``). One Ray
  actor cannot span bundles, so with ``engine_gpus > 1`` the driver asks those ranks for their
  GPU ids (``ray.get_gpu_ids()``) and the engine actor sets ``CUDA_VISIBLE_DEVICES`` to them
  before anything touches CUDA; vLLM's worker processes inherit it (``start_groups``).
* CUDA, not colocated: the engine gets a bundle of its own, ``{"CPU": 1, "GPU": engine_gpus}``,
  and Ray gives its actor those GPUs.

Start order (``start_groups``): the policy's rank actors (no backend yet, nothing on the GPUs),
then the engine (vLLM measures the free GPU memory as it starts), then the policy backends.

The driver holds ``PolicyGroup`` and ``GenerationGroup``, which implement the backend interfaces
at group level (the GRPO loop cannot tell them from local backends): batches are sharded by
data-parallel rank and gathered back; every call is a typed method of a typed actor (no method
names as strings). Weights reach the engine through ``nemo_fp8.distributed.weight_sync``,
actor to actor, never through the driver: packed buckets through Ray's object store
(``packed_weight_buckets`` -> ``receive_packed_bucket``), CUDA IPC handles from a colocated rank 0
(``send_weights_cuda_ipc``), or an NCCL broadcast from rank 0 to an engine on GPUs of its own
(``send_weights_nccl``; the group of rank 0 and the engine's workers is formed once at start,
``init_weight_transfer_nccl`` / ``GenerationWorker.init_weight_transfer``, and released by the two
actors' ``shutdown``).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import ray
import torch

from nemo_fp8.batch import GenerationOutput, TrainBatch
from nemo_fp8.distributed.weight_sync import (PackedBucket, direct_refit_stream, iter_buckets, pack_bucket,
                                              unpack_bucket, update_info_stats, weight_stream)
from nemo_fp8.fp8.kv_scales import KvScales
from nemo_fp8.generation.config import colocated_engine_error
from nemo_fp8.utils.memory import MemoryWatch

logger = logging.getLogger(__name__)


def init_ray(address: Optional[str], num_cpus: Optional[int]) -> None:
    """Start (``address`` None: a local cluster of this process's own, even where other runs have theirs)
    or join a Ray cluster, once per driver process.

    Ray's dashboard and usage stats are off; workers inherit the driver's ``PYTHONPATH`` plus
    the repository root, so ``nemo_fp8`` imports there without an install too.
    """
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pythonpath = os.pathsep.join(p for p in (repo_root, os.environ.get("PYTHONPATH")) if p)
    kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=True, configure_logging=False,
                                  runtime_env={"env_vars": {"PYTHONPATH": pythonpath, "TOKENIZERS_PARALLELISM": "false"}})
    if address:
        ray.init(address=address, **kwargs)
    else:  # "local": a cluster of this run's own; with None Ray joins the newest other local run's cluster
        # (concurrent runs on one machine, compare_precision --parallel), unless RAY_ADDRESS names one
        ray.init(address=None if os.environ.get("RAY_ADDRESS") else "local", num_cpus=num_cpus, **kwargs)
    logger.info("ray: %s", ray.cluster_resources())


# --------------------------------------------------------------------------- cluster plan
@dataclass
class ClusterPlan:
    """Placement-group bundles and which bundle (and share of it) each actor takes.

    Attributes:
        bundles: resources of each bundle, e.g. ``{"CPU": 1, "GPU": 1}``.
        policy_slots: per data-parallel rank, ``(bundle index, actor resources)``.
        generation_slot: the engine actor's ``(bundle index, actor resources)``.
        engine_gpus: GPUs the engine runs on (vLLM's ``tensor_parallel_size``; 0 on CPU).
        engine_policy_ranks: colocated on CUDA, the policy ranks whose GPUs the engine runs on
            (``0..engine_gpus-1``); empty when the engine has a bundle of its own or on CPU.
    """

    bundles: list[dict[str, float]]
    policy_slots: list[tuple[int, dict[str, float]]]
    generation_slot: tuple[int, dict[str, float]]
    engine_gpus: int = 1
    engine_policy_ranks: list[int] = field(default_factory=list)

    def required(self) -> dict[str, float]:
        """Total resources the run asks of the Ray cluster (compare with ``ray.cluster_resources()``)."""
        total: dict[str, float] = {}
        for b in self.bundles:
            for k, v in b.items():
                total[k] = total.get(k, 0.0) + v
        return total


def plan_cluster(dp_size: int, use_gpu: bool, colocated: bool, engine_gpus: int = 1) -> ClusterPlan:
    """The placement plan described in the module docstring; ``dp_size`` is the number of policy
    ranks (``policy.world_size``: data parallel x Megatron tensor parallel), ``engine_gpus`` the
    engine's (``policy.generation.engine_gpus``: vLLM's ``tensor_parallel_size``; ignored on CPU,
    where the engine is the torch reference). ``engine_gpus=1`` gives the one-GPU engine's layout.

    Raises:
        ValueError: ``dp_size < 1``, ``engine_gpus < 1``, or a colocated engine of more GPUs than
            there are policy ranks (the text names ``policy.generation.vllm_cfg.tensor_parallel_size``
            and the valid values; the config check says the same before any GPU work).
    """
    if dp_size < 1:
        raise ValueError(f"policy.data_parallel_size must be >= 1, got {dp_size}")
    if engine_gpus < 1:
        raise ValueError(f"policy.generation.vllm_cfg.tensor_parallel_size must be >= 1, got {engine_gpus}")
    if not use_gpu:
        bundles = [{"CPU": 1.0} for _ in range(dp_size + 1)]
        return ClusterPlan(bundles, [(i, {"CPU": 1.0}) for i in range(dp_size)], (dp_size, {"CPU": 1.0}), engine_gpus=0)
    bundles = [{"CPU": 1.0, "GPU": 1.0} for _ in range(dp_size)]
    if colocated:
        why = colocated_engine_error(engine_gpus, dp_size)
        if why:
            raise ValueError(f"policy.generation.vllm_cfg.tensor_parallel_size: {why}")
        bundles[0]["CPU"] += 1.0
        slots = [(0, {"CPU": 1.0, "GPU": 0.5})] + [(i, {"CPU": 1.0, "GPU": 1.0}) for i in range(1, dp_size)]
        return ClusterPlan(bundles, slots, (0, {"CPU": 1.0, "GPU": 0.5}), engine_gpus, list(range(engine_gpus)))
    bundles.append({"CPU": 1.0, "GPU": float(engine_gpus)})
    return ClusterPlan(bundles, [(i, {"CPU": 1.0, "GPU": 1.0}) for i in range(dp_size)],
                       (dp_size, {"CPU": 1.0, "GPU": float(engine_gpus)}), engine_gpus)


def create_placement_group(plan: ClusterPlan, timeout_s: float = 60.0):
    """Reserve ``plan``'s bundles (PACK strategy).

    Raises:
        RuntimeError: the cluster cannot hold them within ``timeout_s``; names what the run
            needs and what the cluster has, instead of waiting forever.
    """
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(plan.bundles, strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        have = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
        raise RuntimeError(f"ray: the run needs {plan.required()} in {len(plan.bundles)} bundles {plan.bundles}; the "
                           f"cluster has {have} free; raise cluster.num_cpus / GPUs or lower "
                           "policy.data_parallel_size (or policy.generation.vllm_cfg.tensor_parallel_size: a bundle's "
                           "GPUs must be on one node)")
    return pg


def _options(pg, slot: tuple[int, dict[str, float]]) -> dict:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle, res = slot
    return dict(num_cpus=res.get("CPU", 0.0), num_gpus=res.get("GPU", 0.0), max_concurrency=1,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle))


def _free_address() -> tuple[str, int]:
    """(this node's IP, a port free on it now) for a rendezvous this process will serve."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def _set_threads(torch_threads: Optional[int]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if torch_threads:
        torch.set_num_threads(torch_threads)


class _MemoryProbe:
    """Mixed into both actors: sample this process's memory around an operation (refit diagnostics)."""

    def watch_memory(self, start: bool) -> Optional[dict[str, int]]:
        """``start=True``: begin sampling (``nemo_fp8.utils.memory.MemoryWatch``); ``False``: stop, return the peaks."""
        if start:
            self._memory_watch = MemoryWatch()
            self._memory_watch.start()
            return None
        return self._memory_watch.stop()


# --------------------------------------------------------------------------- actors
@ray.remote
class PolicyWorker(_MemoryProbe):
    """One rank of the policy (data-parallel, or tensor-parallel with Megatron): a ``PolicyBackend``
    in its own process."""

    def __init__(self, torch_threads: Optional[int] = None):
        _set_threads(torch_threads)
        self.backend = None
        self._nccl_group = None  # rank 0 of the refit's NCCL group (init_weight_transfer_nccl)

    def gpu_ids(self) -> list[str]:
        """The GPUs Ray gave this rank, as ``CUDA_VISIBLE_DEVICES`` values (``ray.get_gpu_ids()``)."""
        return [str(i) for i in ray.get_gpu_ids()]

    def rendezvous_address(self) -> str:
        """``tcp://ip:port`` with a free port on this node, for ``torch.distributed`` (rank 0)."""
        ip, port = _free_address()
        return f"tcp://{ip}:{port}"

    def nccl_rendezvous(self) -> tuple[str, int]:
        """(this node's IP, a free port on it): where this rank, rank 0 of the refit's NCCL group, serves the
        group's TCP store (``NcclWeightSync.connect``)."""
        return _free_address()

    def setup(self, backend_kwargs: dict, rank: int, world_size: int, dist_init_method: Optional[str]) -> bool:
        from nemo_fp8.policy import build_policy_backend

        self.backend = build_policy_backend(**backend_kwargs, rank=rank, world_size=world_size,
                                            dist_init_method=dist_init_method)
        return True

    def get_logprobs(self, batch: TrainBatch, reference: bool) -> torch.Tensor:
        return self.backend.get_logprobs(batch, reference)

    def train_shard(self, batch: TrainBatch, loss_fn):
        return self.backend.train_shard(batch, loss_fn)

    def calibrate_kv_scales(self, batch: TrainBatch, step: int, margin: float) -> KvScales:
        return self.backend.calibrate_kv_scales(batch, step, margin)

    def packed_weight_buckets(self, bucket_bytes: int, kv_scales: Optional[KvScales]) -> Iterator[PackedBucket]:
        """Streaming generator: the refit's tensors, packed one bucket at a time."""
        for bucket in iter_buckets(weight_stream(self.backend.named_weights(), kv_scales), bucket_bytes):
            yield pack_bucket(bucket)

    def send_weights_cuda_ipc(self, generation_worker, bucket_bytes: int,
                              kv_scales: Optional[KvScales]) -> list[tuple[int, int]]:
        """The refit straight from this rank's GPU into a colocated vLLM engine (``CudaIpcWeightSync``).

        The weights (and KV scales) are quantized here as the engine's ``direct_refit_spec`` says and
        handed over bucket by bucket as CUDA IPC handles (vLLM's IPC weight-transfer engine): the engine
        actor passes each bucket's handles to ``LLM.update_weights`` and its worker copies from this
        process's memory, which stays alive until the call returns. Returns (tensors, bytes) per bucket.

        Raises:
            KeyError: a weight the engine's model does not have (raised before that tensor is quantized).
        """
        from nemo_fp8.generation.vllm.refit import send_weights_ipc

        return self._send_direct(generation_worker, kv_scales,
                                 lambda stream, update, plan: send_weights_ipc(stream, update, plan, bucket_bytes))

    def _send_direct(self, generation_worker, kv_scales: Optional[KvScales], send) -> list[tuple[int, int]]:
        """What the direct refits (CUDA IPC, NCCL) share: the engine's ``direct_refit_spec``, this rank's weights and
        KV scales through ``direct_refit_stream``, ``send(stream, update, plan) -> tensors sent`` with ``update``
        handing each bucket's ``{"update_info": ...}`` to the engine actor's ``receive_update``, then ``note_sent``.
        Returns (tensors, bytes) per bucket, of the converted tensors (``update_info_stats``)."""
        spec = ray.get(generation_worker.direct_refit_spec.remote())
        names: list[str] = []
        buckets: list[tuple[int, int]] = []

        def update(payload: dict) -> None:
            ray.get(generation_worker.receive_update.remote(payload))
            buckets.append(update_info_stats(payload["update_info"]))

        stream = direct_refit_stream(weight_stream(self.backend.named_weights(), kv_scales), spec["plan"],
                                     spec["skip"], names)
        n = send(stream, update, spec["plan"])
        ray.get(generation_worker.note_sent.remote(names, n))
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

    def send_weights_nccl(self, generation_worker, bucket_bytes: int,
                          kv_scales: Optional[KvScales]) -> list[tuple[int, int]]:
        """The refit from this rank's GPU to a vLLM engine on GPUs of its own, by NCCL broadcast (``NcclWeightSync``).

        The weights (and KV scales) stream in buckets of ``bucket_bytes`` (``iter_buckets``, bytes before
        conversion), the names the engine skips dropped and the others checked first (``direct_refit_stream``).
        Per bucket, ``refit.send_weights_nccl`` quantizes it here as the engine's ``direct_refit_spec`` says, has
        the engine actor's ``receive_update`` (``LLM.update_weights``) tell its workers the names/dtypes/shapes,
        from a thread, and broadcasts the bucket meanwhile; the call returns once the workers have loaded it
        (``NcclWeightSync``'s docstring says why this does not deadlock). Then ``note_sent``. Returns (tensors,
        bytes) per bucket, of the converted tensors.

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

        def send(stream, update, plan) -> int:  # update runs in send_weights_nccl's thread while this one broadcasts
            return sum(send_weights_nccl(bucket, update, plan, group) for bucket in iter_buckets(stream, bucket_bytes))

        return self._send_direct(generation_worker, kv_scales, send)

    def drain_weights(self) -> int:
        """Take part in an export another rank sends (Megatron tensor-parallel gathers)."""
        return self.backend.drain_weights()

    def prepare_for_training(self) -> None:
        self.backend.prepare_for_training()

    def offload_before_refit(self) -> None:
        self.backend.offload_before_refit()

    def offload_after_refit(self) -> None:
        self.backend.offload_after_refit()

    def release_cached_memory(self) -> None:
        self.backend.release_cached_memory()

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


@ray.remote
class GenerationWorker(_MemoryProbe):
    """The rollout engine: a ``GenerationBackend`` in its own process.

    Args:
        backend_kwargs: ``build_generation_backend``'s arguments.
        torch_threads: CPU threads of torch in this process.
        cuda_visible_devices: physical GPU ids (``ray.get_gpu_ids()`` of the policy ranks it shares, module
            docstring) that replace the ``CUDA_VISIBLE_DEVICES`` Ray set (bundle 0's GPU) before the backend
            is built: torch reads it when CUDA initializes, vLLM's worker processes inherit it, so the
            engine's ``cuda:i`` is the i-th of them. None: Ray's setting stays.

    Raises:
        RuntimeError: ``cuda_visible_devices`` given after CUDA was initialized in this process (too late).
    """

    def __init__(self, backend_kwargs: dict, torch_threads: Optional[int] = None,
                 cuda_visible_devices: Optional[Sequence[str]] = None):
        if cuda_visible_devices:
            if torch.cuda.is_initialized():
                raise RuntimeError("GenerationWorker: CUDA is initialized already; CUDA_VISIBLE_DEVICES="
                                   f"{','.join(cuda_visible_devices)} would not apply")
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in cuda_visible_devices)
        from nemo_fp8.generation import build_generation_backend

        _set_threads(torch_threads)
        self.backend = build_generation_backend(**backend_kwargs)

    def ready(self) -> bool:
        return True

    def cuda_visible_devices(self) -> Optional[str]:
        """This process's ``CUDA_VISIBLE_DEVICES`` (None: unset): the GPUs its engine runs on."""
        return os.environ.get("CUDA_VISIBLE_DEVICES")

    def generate(self, prompt_token_ids: list[list[int]], sampling) -> GenerationOutput:
        return self.backend.generate(prompt_token_ids, sampling)

    def start_weight_update(self, version: int) -> None:
        self.backend.start_weight_update(version)

    def update_weights(self, named_tensors) -> None:
        self.backend.update_weights(named_tensors)

    def direct_refit_spec(self) -> dict:
        return self.backend.direct_refit_spec()

    def receive_update(self, payload: dict) -> None:
        self.backend.receive_update(payload)

    def note_sent(self, names: list[str], num_tensors: int) -> None:
        self.backend.note_sent(names, num_tensors)

    def init_weight_transfer(self, master_address: str, master_port: int, world_size: int) -> None:
        """Join the engine's workers to the refit's NCCL group as ranks 1..n (``NcclWeightSync.connect``; blocks
        until policy rank 0 joins too). Raises what ``VllmGenerationBackend.init_weight_transfer`` raises."""
        self.backend.init_weight_transfer(master_address, master_port, world_size)

    def engine_params(self, names: list[str]) -> list[dict]:
        """Raw engine parameters per worker (``VllmGenerationBackend.engine_params``; diagnostics and tests)."""
        return self.backend.engine_params(names)

    def receive_packed_bucket(self, bucket: PackedBucket) -> tuple[int, int]:
        """Load one bucket (read straight from the object store); returns (tensors, bytes)."""
        items = unpack_bucket(bucket)
        self.backend.update_weights(items)
        return len(items), sum(t.numel() * t.element_size() for _, t in items)

    def finish_weight_update(self):
        return self.backend.finish_weight_update()

    def weight_version(self):
        return self.backend.weight_version()

    def prepare_for_generation(self) -> None:
        self.backend.prepare_for_generation()

    def finish_generation(self) -> None:
        self.backend.finish_generation()

    def shutdown(self) -> None:
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
    """``PolicyBackend`` over ``dp_size x tp_size`` ``PolicyWorker`` ranks (see the module docstring).

    Ranks follow megatron-core's order (tensor-parallel ranks neighbours): rank ``r`` is
    tensor-parallel rank ``r % tp_size`` of data-parallel rank ``r // tp_size``. The ranks of one
    data-parallel group get the same rows; results are read from its tensor-parallel rank 0.
    """

    def __init__(self, workers: list, global_batch_size: int, tp_size: int = 1):
        if len(workers) % tp_size:
            raise ValueError(f"PolicyGroup: {len(workers)} ranks is not a multiple of tensor_model_parallel_size={tp_size}")
        self.workers, self.global_batch_size, self.tp_size = workers, global_batch_size, tp_size
        self.dp_size = len(workers) // tp_size

    @classmethod
    def create(cls, pg, plan: ClusterPlan, global_batch_size: int, torch_threads: Optional[int],
               tp_size: int = 1) -> "PolicyGroup":
        """Start the rank actors on their bundles without building their backends (nothing on the GPUs yet);
        ``setup`` builds them."""
        workers = [PolicyWorker.options(**_options(pg, slot)).remote(torch_threads) for slot in plan.policy_slots]
        return cls(workers, global_batch_size, tp_size)

    def setup(self, backend_kwargs: dict) -> None:
        """Build every rank's backend (``build_policy_backend``; errors surface here)."""
        world = len(self.workers)
        init = ray.get(self.workers[0].rendezvous_address.remote()) if world > 1 else None
        ray.get([w.setup.remote(backend_kwargs, r, world, init) for r, w in enumerate(self.workers)])
        logger.info("policy: %d rank(s) ready (data parallel %d x tensor parallel %d)", world, self.dp_size,
                    self.tp_size)

    @classmethod
    def start(cls, pg, plan: ClusterPlan, backend_kwargs: dict, torch_threads: Optional[int],
              tp_size: int = 1) -> "PolicyGroup":
        """``create`` then ``setup``: the ranks on their bundles with their backends built."""
        group = cls.create(pg, plan, backend_kwargs["cfg"].train_global_batch_size, torch_threads, tp_size)
        group.setup(backend_kwargs)
        return group

    def gpu_ids(self, ranks: Sequence[int]) -> list[str]:
        """The physical GPU id (a ``CUDA_VISIBLE_DEVICES`` value) of each rank in ``ranks``, in that order.

        Raises:
            RuntimeError: a rank holds other than one GPU, or two ranks the same one.
        """
        ids = ray.get([self.workers[r].gpu_ids.remote() for r in ranks])
        if any(len(i) != 1 for i in ids) or len({i[0] for i in ids}) != len(ids):
            raise RuntimeError(f"policy ranks {list(ranks)} hold GPUs {ids}; each must hold one GPU of its own")
        return [i[0] for i in ids]

    @property
    def weight_source(self):
        """The rank-0 actor, which streams the weights for the refit (a full replica)."""
        return self.workers[0]

    @property
    def weight_peers(self) -> list:
        """The other tensor-parallel ranks of replica 0: they join the export (``drain_weights``)."""
        return self.workers[1:self.tp_size]

    def _per_rank(self, shards: list[TrainBatch]) -> list[TrainBatch]:
        """Data-parallel shards -> one per rank (each tensor-parallel rank gets its group's)."""
        return [shards[r // self.tp_size] for r in range(len(self.workers))]

    def _first_of_groups(self, outs: list) -> list:
        return outs[::self.tp_size]

    def get_logprobs(self, batch: TrainBatch, reference: bool = False) -> torch.Tensor:
        shards = self._per_rank([batch.select(s) for s in shard_rows(batch.size, self.dp_size)])
        outs = ray.get([w.get_logprobs.remote(s, reference) for w, s in zip(self.workers, shards)])
        return torch.cat(self._first_of_groups(outs))

    def train(self, batch: TrainBatch, loss_fn) -> dict[str, float]:
        from nemo_fp8.policy.torch_backend import reduce_train_results

        dp = self.dp_size
        shards = self._per_rank([batch.select(train_shard_indices(batch.size, self.global_batch_size, dp, r))
                                 for r in range(dp)])
        outs = ray.get([w.train_shard.remote(s, loss_fn) for w, s in zip(self.workers, shards)])
        return reduce_train_results(self._first_of_groups(outs))

    def calibrate_kv_scales(self, batch: TrainBatch, step: int, margin: float = 1.0) -> KvScales:
        shards = self._per_rank([batch.select(s) for s in shard_rows(batch.size, self.dp_size)])
        return ray.get([w.calibrate_kv_scales.remote(s, step, margin)
                        for w, s in zip(self.workers, shards)])[0]  # amax already max-reduced across ranks

    def prepare_for_training(self) -> None:
        ray.get([w.prepare_for_training.remote() for w in self.workers])

    def offload_before_refit(self) -> None:
        ray.get([w.offload_before_refit.remote() for w in self.workers])

    def offload_after_refit(self) -> None:
        ray.get([w.offload_after_refit.remote() for w in self.workers])

    def release_cached_memory(self) -> None:
        ray.get([w.release_cached_memory.remote() for w in self.workers])

    def save(self, path) -> None:
        ray.get([w.save.remote(str(path)) for w in self.workers])  # rank 0 writes; Megatron ranks write shards

    def load(self, path) -> None:
        ray.get([w.load.remote(str(path)) for w in self.workers])

    def shutdown(self) -> None:
        ray.get([w.shutdown.remote() for w in self.workers])
        for w in self.workers:
            ray.kill(w)


class GenerationGroup:
    """``GenerationBackend`` whose engine runs in a ``GenerationWorker`` actor."""

    def __init__(self, worker):
        self.worker = worker

    @classmethod
    def start(cls, pg, plan: ClusterPlan, backend_kwargs: dict, torch_threads: Optional[int],
              cuda_visible_devices: Optional[Sequence[str]] = None) -> "GenerationGroup":
        """Start the engine actor on ``plan.generation_slot`` and build its backend (errors surface here).

        ``cuda_visible_devices``: the GPUs a colocated multi-GPU engine runs on (``GenerationWorker``).
        """
        worker = GenerationWorker.options(**_options(pg, plan.generation_slot)).remote(
            backend_kwargs, torch_threads, cuda_visible_devices)
        ray.get(worker.ready.remote())  # re-raises the backend's construction error
        logger.info("generation engine ready (CUDA_VISIBLE_DEVICES=%s)", ray.get(worker.cuda_visible_devices.remote()))
        return cls(worker)

    def generate(self, prompt_token_ids: list[list[int]], sampling) -> GenerationOutput:
        return ray.get(self.worker.generate.remote(prompt_token_ids, sampling))

    def start_weight_update(self, version: int) -> None:
        ray.get(self.worker.start_weight_update.remote(version))

    def update_weights(self, named_tensors) -> None:
        ray.get(self.worker.update_weights.remote(list(named_tensors)))

    def finish_weight_update(self):
        return ray.get(self.worker.finish_weight_update.remote())

    def weight_version(self):
        return ray.get(self.worker.weight_version.remote())

    def prepare_for_generation(self) -> None:
        ray.get(self.worker.prepare_for_generation.remote())

    def finish_generation(self) -> None:
        ray.get(self.worker.finish_generation.remote())

    def shutdown(self) -> None:
        ray.get(self.worker.shutdown.remote())
        ray.kill(self.worker)


def start_groups(pg, plan: ClusterPlan, policy_kwargs: dict, generation_kwargs: dict, torch_threads: Optional[int],
                 tp_size: int = 1) -> tuple[PolicyGroup, GenerationGroup]:
    """Start the policy ranks and the engine on ``plan``'s bundles, in the order the GPUs need.

    1. the policy's rank actors, backends not built (``PolicyGroup.create``: nothing on the GPUs);
    2. colocated with ``plan.engine_gpus > 1``: the GPU ids of policy ranks ``plan.engine_policy_ranks``,
       which become the engine actor's ``CUDA_VISIBLE_DEVICES`` (a one-GPU engine keeps Ray's: bundle 0's);
    3. the engine (vLLM measures the free memory of its GPUs as it starts, so before the trainer allocates);
    4. the policy backends (``PolicyGroup.setup``).

    Args:
        policy_kwargs: ``build_policy_backend``'s arguments (``cfg``: ``PolicyConfig``).
        generation_kwargs: ``build_generation_backend``'s arguments.
        tp_size: Megatron tensor parallelism of the policy.

    Raises:
        RuntimeError: a shared policy rank holds other than one GPU of its own; or what building a
            backend raised.
    """
    policy = PolicyGroup.create(pg, plan, policy_kwargs["cfg"].train_global_batch_size, torch_threads, tp_size)
    visible = policy.gpu_ids(plan.engine_policy_ranks) if len(plan.engine_policy_ranks) > 1 else None
    generation = GenerationGroup.start(pg, plan, generation_kwargs, torch_threads, cuda_visible_devices=visible)
    policy.setup(policy_kwargs)
    return policy, generation
