"""Config sections of the distributed layer: ``cluster`` and ``policy.weight_sync``."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from nemo_fp8.utils.config import StrictConfig


class ClusterConfig(StrictConfig):
    """The Ray cluster (``nemo_fp8.distributed.placement``).

    Attributes:
        address: None starts a local Ray; else e.g. ``"auto"`` or ``"ray://host:10001"``.
        num_cpus: a local Ray's CPUs (None: this machine's).
        gpus_per_node: GPUs of each node: the policy's bundles go into one ``STRICT_PACK`` placement group per
            this many GPUs (0: all on one node); a multiple of ``policy.generation.vllm_cfg.tensor_parallel_size``.
        num_nodes: nodes; with ``gpus_per_node``, the GPUs the run may use (checked by the preflight).
        torch_threads_per_worker: torch CPU threads per actor (None: CPUs / data-parallel ranks).
    """

    address: Optional[str] = None  # None: start a local Ray; else e.g. "auto" or "ray://host:10001"
    num_cpus: Optional[int] = Field(None, ge=1)
    gpus_per_node: int = Field(0, ge=0)
    num_nodes: int = Field(1, ge=1)
    torch_threads_per_worker: Optional[int] = Field(None, ge=1)


class WeightSyncConfig(StrictConfig):
    """How the refit moves the policy's weights into the rollout engine.

    Attributes:
        method: ``auto`` picks ``object_store`` when the backends are Ray actors and
            ``in_process`` when they live in the driver (never ``nccl``: not yet run on two GPUs).
            ``object_store``: buckets travel policy actor -> Ray object store -> engine actor, one
            bucket in flight at a time. ``cuda_ipc``: every policy rank quantizes on its GPU and hands the
            one-GPU vLLM engine colocated there CUDA IPC handles, bucket by bucket (``generation.backend: vllm``,
            ``generation.vllm_cfg.tensor_parallel_size: 1``, ``generation.colocated.enabled``, a CUDA device;
            Megatron tensor parallel ranks each hold the full tensors, Megatron-Bridge's export gathers them).
            ``nccl``: the policy's rank 0 quantizes on its GPU and broadcasts each bucket over NCCL
            to the workers of a vLLM engine on GPUs of its own, tensor parallel or not (vLLM 0.22's
            ``NCCLWeightTransferEngine``; ``generation.backend: vllm``,
            ``generation.colocated.enabled: false``, a CUDA device); nothing goes through host memory.
        bucket_size_mb: bytes per bucket (MiB); a tensor larger than a bucket travels alone.
            Peak extra memory of a refit is about one bucket plus the largest tensor.
        packed: ``cuda_ipc`` only: each bucket travels as one buffer with one IPC handle (vLLM's packed IPC
            format; the engine's worker opens one mapping per bucket and copies the tensors out of it) instead of
            one handle per tensor. Costs one more bucket of memory on each side while a bucket loads.
    """

    method: Literal["auto", "in_process", "object_store", "cuda_ipc", "nccl"] = "auto"
    bucket_size_mb: float = Field(256.0, gt=0)
    packed: bool = False
