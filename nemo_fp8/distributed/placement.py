"""Where the run's actors go: the cluster plan (bundles, slots, engines) and its Ray placement groups.

Layout (``plan_cluster``): ``num_engines`` rollout engines of ``engine_gpus`` GPUs each (vLLM's
``tensor_parallel_size``; 1 for the torch engine) beside ``world_size`` policy ranks.

* CPU: one ``{"CPU": 1}`` bundle per policy rank and one per engine (the torch reference engine),
  in one placement group (``PACK``).
* CUDA, colocated (``policy.generation.colocated.enabled``): one ``{"CPU": 1, "GPU": 1}`` bundle per
  policy rank. Engine ``i`` runs on the GPUs of policy ranks ``i*n..(i+1)*n-1`` (``n = engine_gpus``;
  the world size is a multiple of ``n``): its actor takes half of rank ``i*n``'s GPU (that rank the
  other half) and, with ``n > 1``, sets ``CUDA_VISIBLE_DEVICES`` to those ranks' GPUs before anything
  touches CUDA (one Ray actor cannot span bundles; ``nemo_fp8.generation.group``).
* CUDA, not colocated: engine ``i`` gets a bundle of its own, ``{"CPU": 1, "GPU": n}``, and Ray gives
  its actor those GPUs.

Across nodes (NeMo-RL's ``RayVirtualCluster``: one placement group per node): on CUDA the bundles go
into placement groups of at most ``gpus_per_node`` GPUs each (``cluster.gpus_per_node``; the engines'
own ones by ``policy.generation.colocated.resources.gpus_per_node``), each ``STRICT_PACK``, i.e. on one
node. ``gpus_per_node`` is a multiple of ``n``, so an engine's bundles always share one placement group
and never span nodes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import ray

from nemo_fp8.distributed.config import colocated_engine_error

logger = logging.getLogger(__name__)

Slot = tuple[int, dict[str, float]]  # (flat bundle index, the actor's resources)


@dataclass
class ClusterPlan:
    """Placement-group bundles and which bundle (and share of it) each actor takes.

    Attributes:
        bundles: resources of each bundle, e.g. ``{"CPU": 1, "GPU": 1}``, over all placement groups.
        policy_slots: per policy rank, ``(bundle index, actor resources)``.
        engine_slots: per engine, ``(bundle index, actor resources)``.
        engine_gpus: GPUs each engine runs on (vLLM's ``tensor_parallel_size``; 0 on CPU).
        engine_ranks: colocated on CUDA, per engine the policy ranks whose GPUs it runs on; empty when the
            engines have bundles of their own or on CPU.
        node_groups: the bundle indices of each placement group (one node each on CUDA, ``STRICT_PACK``).
        strategy: the placement groups' strategy (``STRICT_PACK`` on CUDA, ``PACK`` on CPU).
    """

    bundles: list[dict[str, float]]
    policy_slots: list[Slot]
    engine_slots: list[Slot]
    engine_gpus: int = 1
    engine_ranks: list[list[int]] = field(default_factory=list)
    node_groups: list[list[int]] = field(default_factory=list)
    strategy: str = "PACK"

    def __post_init__(self):
        if not self.node_groups:
            self.node_groups = [list(range(len(self.bundles)))]

    @property
    def num_engines(self) -> int:
        return len(self.engine_slots)

    @property
    def generation_slot(self) -> Slot:
        """Engine 0's slot (the only one with one engine)."""
        return self.engine_slots[0]

    @property
    def engine_policy_ranks(self) -> list[int]:
        """Engine 0's policy ranks (``engine_ranks[0]``; empty when not colocated on CUDA)."""
        return self.engine_ranks[0] if self.engine_ranks else []

    def required(self) -> dict[str, float]:
        """Total resources the run asks of the Ray cluster (compare with ``ray.cluster_resources()``)."""
        total: dict[str, float] = {}
        for b in self.bundles:
            for k, v in b.items():
                total[k] = total.get(k, 0.0) + v
        return total


def _chunks(indices: list[int], size: int) -> list[list[int]]:
    return [indices[i:i + size] for i in range(0, len(indices), size)] if indices else []


def plan_cluster(world_size: int, use_gpu: bool, colocated: bool, engine_gpus: int = 1, num_engines: int = 1,
                 gpus_per_node: int = 0, engine_gpus_per_node: int = 0) -> ClusterPlan:
    """The placement plan described in the module docstring.

    Args:
        world_size: policy ranks (``policy.world_size``: data parallel x Megatron tensor parallel).
        use_gpu: CUDA (else the CPU plan: the torch engines, ``engine_gpus`` ignored).
        colocated: ``policy.generation.colocated.enabled``.
        engine_gpus: GPUs per engine (``policy.generation.engine_gpus``: vLLM's ``tensor_parallel_size``).
        num_engines: engines (``GenerationConfig.resolve_num_engines``); colocated at most
            ``world_size / engine_gpus``.
        gpus_per_node: ``cluster.gpus_per_node`` (0: all policy ranks on one node).
        engine_gpus_per_node: not colocated, the engines' GPUs per node
            (``policy.generation.colocated.resources.gpus_per_node``; 0: all engines on one node).

    Raises:
        ValueError: a count below 1; colocated engines that do not fit the policy's GPUs (the text names
            ``policy.generation.vllm_cfg.tensor_parallel_size`` / ``policy.generation.num_engines`` and the valid
            values; the config check says the same before any GPU work); a ``gpus_per_node`` that is not a
            multiple of ``engine_gpus`` (an engine would span nodes).
    """
    if world_size < 1:
        raise ValueError(f"policy.data_parallel_size must be >= 1, got {world_size}")
    if engine_gpus < 1:
        raise ValueError(f"policy.generation.vllm_cfg.tensor_parallel_size must be >= 1, got {engine_gpus}")
    if num_engines < 1:
        raise ValueError(f"policy.generation.num_engines must be >= 1, got {num_engines}")
    if not use_gpu:
        bundles = [{"CPU": 1.0} for _ in range(world_size + num_engines)]
        return ClusterPlan(bundles, [(i, {"CPU": 1.0}) for i in range(world_size)],
                           [(world_size + e, {"CPU": 1.0}) for e in range(num_engines)], engine_gpus=0)
    per_node = gpus_per_node or world_size
    if colocated and gpus_per_node and gpus_per_node % engine_gpus:
        raise ValueError(f"cluster.gpus_per_node: {per_node} is not a multiple of "
                         f"policy.generation.vllm_cfg.tensor_parallel_size={engine_gpus} (an engine never spans "
                         f"nodes); valid: multiples of {engine_gpus}")
    bundles = [{"CPU": 1.0, "GPU": 1.0} for _ in range(world_size)]
    policy_groups = _chunks(list(range(world_size)), per_node)
    if colocated:
        why = colocated_engine_error(engine_gpus, world_size)
        if why:
            raise ValueError(f"policy.generation.vllm_cfg.tensor_parallel_size: {why}")
        if num_engines > world_size // engine_gpus:
            raise ValueError(f"policy.generation.num_engines: {num_engines} colocated engines of {engine_gpus} GPU(s) "
                             f"need {num_engines * engine_gpus} policy ranks, the policy has {world_size}; valid: 1 to "
                             f"{world_size // engine_gpus}")
        slots = [(i, {"CPU": 1.0, "GPU": 1.0}) for i in range(world_size)]
        engine_slots, engine_ranks = [], []
        for e in range(num_engines):
            first = e * engine_gpus
            bundles[first]["CPU"] += 1.0
            slots[first] = (first, {"CPU": 1.0, "GPU": 0.5})
            engine_slots.append((first, {"CPU": 1.0, "GPU": 0.5}))
            engine_ranks.append(list(range(first, first + engine_gpus)))
        return ClusterPlan(bundles, slots, engine_slots, engine_gpus, engine_ranks, policy_groups, "STRICT_PACK")
    engines_per_node = (engine_gpus_per_node // engine_gpus if engine_gpus_per_node else num_engines) or 1
    if engine_gpus_per_node and engine_gpus_per_node % engine_gpus:
        raise ValueError(f"policy.generation.colocated.resources.gpus_per_node: {engine_gpus_per_node} is not a "
                         f"multiple of policy.generation.vllm_cfg.tensor_parallel_size={engine_gpus}")
    engine_bundles = list(range(world_size, world_size + num_engines))
    bundles += [{"CPU": 1.0, "GPU": float(engine_gpus)} for _ in engine_bundles]
    return ClusterPlan(bundles, [(i, {"CPU": 1.0, "GPU": 1.0}) for i in range(world_size)],
                       [(b, {"CPU": 1.0, "GPU": float(engine_gpus)}) for b in engine_bundles], engine_gpus, [],
                       policy_groups + _chunks(engine_bundles, engines_per_node), "STRICT_PACK")


def plan_from_config(policy, cluster, use_gpu: bool) -> ClusterPlan:
    """The run's plan: policy ranks and engines from ``policy`` (``PolicyConfig``: ``world_size``,
    ``generation``), nodes from ``cluster.gpus_per_node`` (``ClusterConfig``) and
    ``policy.generation.colocated.resources``.

    Raises:
        ValueError: engines that do not fit (``plan_cluster``, ``GenerationConfig.resolve_num_engines``).
    """
    gen = policy.generation
    world = policy.world_size
    return plan_cluster(world, use_gpu, gen.colocated.enabled, engine_gpus=gen.engine_gpus,
                        num_engines=gen.resolve_num_engines(world, use_gpu), gpus_per_node=cluster.gpus_per_node,
                        engine_gpus_per_node=gen.colocated.resources.gpus_per_node or 0)


class Placement:
    """The Ray placement groups of a ``ClusterPlan``, and where each of its (flat) bundles is.

    Attributes:
        plan: the plan.
        groups: one Ray placement group per ``plan.node_groups`` entry.
    """

    def __init__(self, plan: ClusterPlan, groups: list):
        self.plan, self.groups = plan, groups
        self._where: dict[int, tuple[int, int]] = {b: (g, i) for g, members in enumerate(plan.node_groups)
                                                   for i, b in enumerate(members)}

    def options(self, slot: Slot) -> dict:
        """Ray actor options (``.options(**...)``) for an actor on ``slot``: its resources on its bundle, one call
        at a time."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle, res = slot
        g, index = self._where[bundle]
        return dict(num_cpus=res.get("CPU", 0.0), num_gpus=res.get("GPU", 0.0), max_concurrency=1,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.groups[g],
                                                                         placement_group_bundle_index=index))

    def bundle_nodes(self) -> list[str]:
        """The Ray node id of each (flat) bundle, in ``plan.bundles`` order."""
        tables = [ray.util.placement_group_table(pg)["bundles_to_node_id"] for pg in self.groups]
        return [tables[g][i] for g, i in (self._where[b] for b in range(len(self.plan.bundles)))]

    def remove(self) -> None:
        """Release every placement group (best effort: one that is gone already is skipped)."""
        from ray.util.placement_group import remove_placement_group

        for pg in self.groups:
            try:
                remove_placement_group(pg)
            except Exception as e:  # a dead cluster must not hide the error that ended the run
                logger.warning("removing a placement group failed: %s", e)
        self.groups = []


def create_placement_group(plan: ClusterPlan, timeout_s: float = 60.0) -> Placement:
    """Reserve ``plan``'s bundles: one placement group per ``plan.node_groups`` entry (``plan.strategy``).

    Raises:
        RuntimeError: the cluster cannot hold them within ``timeout_s``; names what the run needs and what the
            cluster has, instead of waiting forever.
    """
    from ray.util.placement_group import placement_group

    groups = [placement_group([plan.bundles[b] for b in members], strategy=plan.strategy)
              for members in plan.node_groups]
    placement = Placement(plan, groups)
    ready, _ = ray.wait([pg.ready() for pg in groups], num_returns=len(groups), timeout=timeout_s)
    if len(ready) < len(groups):
        placement.remove()
        have = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
        raise RuntimeError(f"ray: the run needs {plan.required()} in {len(plan.bundles)} bundles {plan.bundles}, "
                           f"placed {plan.strategy} in groups {plan.node_groups}; the cluster has {have} free; raise "
                           "cluster.num_cpus / GPUs, set cluster.gpus_per_node / cluster.num_nodes to the nodes' "
                           "GPUs, or lower policy.data_parallel_size / policy.generation.num_engines (an engine's "
                           "GPUs, policy.generation.vllm_cfg.tensor_parallel_size, must be on one node)")
    return placement


def actor_options(placement: Optional[Placement], slot: Slot) -> dict:
    """``placement.options(slot)``, or plain resources (no placement group: tests that start bare actors)."""
    if placement is None:
        _, res = slot
        return dict(num_cpus=res.get("CPU", 0.0), num_gpus=res.get("GPU", 0.0), max_concurrency=1)
    return placement.options(slot)


# --------------------------------------------------------------------------- what every actor shares
def set_threads(torch_threads: Optional[int]) -> None:
    """An actor's logging format, torch's CPU threads (None: torch's default), and no Hugging Face progress bars
    (the driver's console would show them every step, ``nemo_fp8.utils.console``)."""
    import torch

    from nemo_fp8.utils.console import quiet_library_progress

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    quiet_library_progress()
    if torch_threads:
        torch.set_num_threads(torch_threads)


class MemoryProbe:
    """Mixed into the actors: sample this process's memory around an operation (refit diagnostics)."""

    def watch_memory(self, start: bool) -> Optional[dict[str, int]]:
        """``start=True``: begin sampling (``nemo_fp8.utils.memory.MemoryWatch``); ``False``: stop, return the peaks."""
        from nemo_fp8.utils.memory import MemoryWatch

        if start:
            self._memory_watch = MemoryWatch()
            self._memory_watch.start()
            return None
        return self._memory_watch.stop()
