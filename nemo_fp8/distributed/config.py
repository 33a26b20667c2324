"""Config sections of the distributed layer: ``cluster`` and ``policy.weight_sync``; the rule for colocated engines."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from nemo_fp8.utils.config import StrictConfig

# vLLM's tensor-parallel sizes (``policy.generation.vllm_cfg.tensor_parallel_size``): an engine's GPUs
SUPPORTED_TENSOR_PARALLEL_SIZES = (1, 2, 4, 8)


def colocated_engine_error(tensor_parallel_size: int, policy_world_size: int) -> Optional[str]:
    """Why colocated vLLM engines of ``tensor_parallel_size`` GPUs cannot run beside a policy of
    ``policy_world_size`` ranks (None: they can).

    Colocated engine ``i`` shares the GPUs of policy ranks ``i*n..(i+1)*n-1`` (``n = tensor_parallel_size``,
    one GPU per rank, ``nemo_fp8.distributed.placement.plan_cluster``), so the policy needs at least ``n`` ranks
    and a multiple of ``n``. The text follows ``policy.generation.vllm_cfg.tensor_parallel_size: `` in both
    the config check and ``plan_cluster``'s error.
    """
    if tensor_parallel_size <= policy_world_size and policy_world_size % tensor_parallel_size == 0:
        return None
    valid = [n for n in SUPPORTED_TENSOR_PARALLEL_SIZES if n <= policy_world_size and policy_world_size % n == 0]
    if tensor_parallel_size <= policy_world_size:
        return (f"{tensor_parallel_size} with policy.generation.colocated.enabled=true runs one engine on the GPUs of "
                f"each {tensor_parallel_size} consecutive policy ranks, but the policy world size {policy_world_size} "
                "(policy.data_parallel_size x policy.megatron_cfg.tensor_model_parallel_size) is not a multiple of "
                f"it; valid: {', '.join(map(str, valid))}, or a policy world size that is a multiple of "
                f"{tensor_parallel_size}")
    return (f"{tensor_parallel_size} with policy.generation.colocated.enabled=true runs the engine on the GPUs of "
            f"policy ranks 0..{tensor_parallel_size - 1}, but the policy has {policy_world_size} rank(s) (policy world "
            "size = policy.data_parallel_size x policy.megatron_cfg.tensor_model_parallel_size); valid: "
            f"{', '.join(map(str, valid))}, or a policy world size >= {tensor_parallel_size}, or "
            f"policy.generation.colocated.enabled=false (the engine then gets {tensor_parallel_size} GPUs of its own)")


class ClusterConfig(StrictConfig):
    """The Ray cluster (``nemo_fp8.distributed.placement``).

    Attributes:
        address: None starts a local Ray; else e.g. ``"auto"`` or ``"ray://host:10001"``.
        num_cpus: a local Ray's CPUs (None: those this process may run on, its affinity mask).
        gpus_per_node: GPUs of each node: the policy's bundles go into one ``STRICT_PACK`` placement group per
            this many GPUs (0: all on one node); a multiple of ``policy.generation.vllm_cfg.tensor_parallel_size``.
        num_nodes: nodes; with ``gpus_per_node``, the GPUs the run may use (checked by the preflight).
        torch_threads_per_worker: torch CPU threads per actor (None: the CPUs this process may run on / the actors
            that compute side by side: data-parallel ranks x pipeline stages, plus the engines with async GRPO).
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
        pack_in_place: with ``packed``: from the second refit on, each tensor is quantized or copied straight into
            its place in its bucket's buffer (``nemo_fp8.generation.vllm.packed_in_place``: the same bytes, planned
            from the first refit's tensors) instead of being made on its own, stacked and copied into the buffer.
    """

    method: Literal["auto", "in_process", "object_store", "cuda_ipc", "nccl"] = "auto"
    bucket_size_mb: float = Field(256.0, gt=0)
    packed: bool = False
    pack_in_place: bool = False
