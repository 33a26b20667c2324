"""Data-parallel rollout: one ``GenerationWorker`` actor per engine and the ``GenerationGroup`` facade over them.

A run has ``num_engines`` engines (``nemo_fp8.distributed.placement``: one per ``tensor_parallel_size`` GPUs),
each a ``GenerationBackend`` in its own Ray actor. ``GenerationGroup`` implements the backend interface over
all of them, so the GRPO loop cannot tell one engine from many (NeMo-RL's and verl's data-parallel vLLM):

* ``generate``: the step's requests are cut into bins independent of the engine count (``plan_bins``: the
  samples of one prompt, consecutive rows, always in one bin, so one engine's prefix cache serves them; bins
  of at most ``rows_per_batch`` rows, one forward batch of the torch engine each), the bins go to the
  engines balanced by expected tokens (``assign_bins``: longest first to the least loaded engine), and the
  outputs come back in the original order. Every request carries its own seed (``request_seed`` of the
  step's seed and its row), so a rollout does not depend on how many engines ran it (bit-exact with the
  torch engine; vLLM takes the same per-request seeds).
* lifecycle (refit, sleep / wake, shutdown): every engine together; versions must agree.
* errors: an engine that raises, or whose actor dies (Ray raises ``RayActorError`` as soon as it notices
  the process is gone), stops the call at once with the engine's index, node and GPUs named
  (``EngineError``); the other engines' calls are not waited for.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import ray
import torch

from nemo_fp8.batch import GenerationOutput, concat_padded
from nemo_fp8.distributed.fanout import call_all, gather, shutdown_actors
from nemo_fp8.distributed.placement import ClusterPlan, MemoryProbe, Placement, actor_options, set_threads
from nemo_fp8.distributed.weight_sync import PackedBucket, unpack_bucket
from nemo_fp8.generation.interfaces import SamplingParams, WeightVersion, request_seed
from nemo_fp8.generation.spec import GenerationSpec
from nemo_fp8.utils.run_dir import RunFailed

logger = logging.getLogger(__name__)


class EngineError(RunFailed):
    """An engine failed (raised, or its actor died); the text names the engine's index, node and GPUs. A
    ``RunFailed``: the run stops with this message (exit code 1) and ``--resume`` continues it."""


@ray.remote
class GenerationWorker(MemoryProbe):
    """One rollout engine: a ``GenerationBackend`` in its own process.

    Args:
        spec: the backend's arguments (``build_generation_backend``).
        torch_threads: CPU threads of torch in this process.
        cuda_visible_devices: physical GPU ids (``ray.get_gpu_ids()`` of the policy ranks it shares,
            ``nemo_fp8.distributed.placement``) that replace the ``CUDA_VISIBLE_DEVICES`` Ray set (its bundle's GPU)
            before the backend is built: torch reads it when CUDA initializes, vLLM's worker processes inherit
            it, so the engine's ``cuda:i`` is the i-th of them. None: Ray's setting stays.

    Raises:
        RuntimeError: ``cuda_visible_devices`` given after CUDA was initialized in this process (too late).
    """

    def __init__(self, spec: GenerationSpec, torch_threads: Optional[int] = None,
                 cuda_visible_devices: Optional[Sequence[str]] = None):
        if cuda_visible_devices:
            if torch.cuda.is_initialized():
                raise RuntimeError("GenerationWorker: CUDA is initialized already; CUDA_VISIBLE_DEVICES="
                                   f"{','.join(cuda_visible_devices)} would not apply")
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in cuda_visible_devices)
        from nemo_fp8.generation import build_generation_backend

        set_threads(torch_threads)
        self.backend = build_generation_backend(spec)

    def ready(self) -> bool:
        return True

    def cuda_visible_devices(self) -> Optional[str]:
        """This process's ``CUDA_VISIBLE_DEVICES`` (None: unset): the GPUs its engine runs on."""
        return os.environ.get("CUDA_VISIBLE_DEVICES")

    def where(self) -> str:
        """``"node <ip>, GPUs <ids>"`` (``"CPU"`` without GPUs): named in errors about this engine."""
        gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
        return f"node {ray.util.get_node_ip_address()}, " + (f"GPUs {gpus}" if gpus else "CPU")

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams,
                 request_seeds: Optional[list[int]] = None,
                 chunk_sizes: Optional[list[int]] = None) -> tuple[GenerationOutput, float]:
        """The backend's ``generate`` and its wall time in seconds."""
        t0 = time.perf_counter()
        out = self.backend.generate(prompt_token_ids, sampling, request_seeds=request_seeds, chunk_sizes=chunk_sizes)
        return out, time.perf_counter() - t0

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

    def init_weight_transfer(self, master_address: str, master_port: int, world_size: int,
                             rank_offset: int = 1) -> None:
        """Join the engine's workers to the refit's NCCL group as ranks ``rank_offset..rank_offset+n-1``
        (``NcclWeightSync.connect``; blocks until every rank joins). Raises what
        ``VllmGenerationBackend.init_weight_transfer`` raises."""
        self.backend.init_weight_transfer(master_address, master_port, world_size, rank_offset)

    def engine_params(self, names: list[str]) -> list[dict]:
        """Raw engine parameters per worker (``VllmGenerationBackend.engine_params``; diagnostics and tests)."""
        return self.backend.engine_params(names)

    def receive_packed_bucket(self, bucket: PackedBucket) -> tuple[int, int]:
        """Load one bucket (read straight from the object store); returns (tensors, bytes)."""
        items = unpack_bucket(bucket)
        self.backend.update_weights(items)
        return len(items), sum(t.numel() * t.element_size() for _, t in items)

    def finish_weight_update(self) -> WeightVersion:
        return self.backend.finish_weight_update()

    def weight_version(self) -> WeightVersion:
        return self.backend.weight_version()

    def prepare_for_generation(self) -> None:
        self.backend.prepare_for_generation()

    def finish_generation(self) -> None:
        self.backend.finish_generation()

    def pop_engine_metrics(self) -> dict[str, float]:
        """The backend's own ``pop_engine_metrics`` (a vLLM engine's ``generation/kv_capacity_tokens``)."""
        return self.backend.pop_engine_metrics()

    def shutdown(self) -> None:
        self.backend.shutdown()


# --------------------------------------------------------------------------- dispatch
@dataclass(frozen=True)
class Bin:
    """Consecutive rows of a step's requests that one engine generates.

    Attributes:
        start: first row.
        chunk_sizes: rows of each forward batch of the torch engine, in order (their sum is the bin's rows).
    """

    start: int
    chunk_sizes: tuple[int, ...]

    @property
    def rows(self) -> range:
        return range(self.start, self.start + sum(self.chunk_sizes))


def plan_bins(prompt_token_ids: Sequence[Sequence[int]], rows_per_batch: int) -> list[Bin]:
    """Cut the requests into bins whose boundaries do not depend on the number of engines.

    Consecutive identical prompts are one group (the samples of one prompt). Groups are packed in order into
    forward batches of at most ``rows_per_batch`` rows; a group larger than that fills several batches, all
    in one bin. A bin ends wherever a batch ends at a group boundary.

    Raises:
        ValueError: ``rows_per_batch < 1``.
    """
    if rows_per_batch < 1:
        raise ValueError(f"policy.generation_batch_size must be >= 1, got {rows_per_batch}")
    groups, start = [], 0
    for i in range(1, len(prompt_token_ids) + 1):
        if i == len(prompt_token_ids) or list(prompt_token_ids[i]) != list(prompt_token_ids[start]):
            groups.append(i - start)
            start = i
    bins: list[Bin] = []
    bin_start, chunks, open_rows, row = 0, [], 0, 0
    for n in groups:
        if open_rows and open_rows + n > rows_per_batch:  # close the batch at this group boundary: a new bin
            bins.append(Bin(bin_start, tuple(chunks + [open_rows])))
            bin_start, chunks, open_rows = row, [], 0
        left = n
        while open_rows + left > rows_per_batch:  # only a group larger than a batch gets here (open_rows == 0)
            chunks.append(rows_per_batch)
            left -= rows_per_batch
        open_rows += left
        row += n
    if open_rows or chunks:
        bins.append(Bin(bin_start, tuple(chunks + ([open_rows] if open_rows else []))))
    return bins


def assign_bins(bins: Sequence[Bin], costs: Sequence[float], num_engines: int) -> list[list[Bin]]:
    """Bins per engine, balanced by cost (longest processing time first: each bin, largest first, to the engine
    with the least cost so far, ties to the lower index); each engine's bins in row order.

    Args:
        costs: per bin, its expected tokens (``expected_tokens``).
    """
    load = [0.0] * num_engines
    out: list[list[Bin]] = [[] for _ in range(num_engines)]
    for i in sorted(range(len(bins)), key=lambda i: (-costs[i], i)):
        e = min(range(num_engines), key=lambda e: (load[e], e))
        load[e] += costs[i]
        out[e].append(bins[i])
    return [sorted(b, key=lambda b: b.start) for b in out]


def expected_tokens(prompt_token_ids: Sequence[Sequence[int]], rows: range, max_new_tokens: int) -> float:
    """Tokens an engine processes for ``rows``: each prompt plus ``max_new_tokens`` (an upper bound that ranks
    bins like their real cost when responses run long, as in a generation-bound step)."""
    return float(sum(len(prompt_token_ids[r]) + max_new_tokens for r in rows))


# --------------------------------------------------------------------------- the facade
class GenerationGroup:
    """``GenerationBackend`` over ``GenerationWorker`` actors, one per engine (module docstring).

    Args:
        workers: the engines' actors, engine 0 first.
        labels: per engine, where it runs (``GenerationWorker.where``), named in errors.
        rows_per_batch: ``policy.generation_batch_size`` (``plan_bins``).
        pad_token_id: what pads the merged rows (the tokenizer's, as the engines use).
    """

    def __init__(self, workers: Sequence, labels: Optional[Sequence[str]] = None, rows_per_batch: int = 64,
                 pad_token_id: int = 0):
        self.workers = list(workers)
        self.pad_token_id = pad_token_id
        self.labels = [f"engine {i} ({w})" for i, w in enumerate(labels or ["?"] * len(self.workers))]
        self.rows_per_batch = rows_per_batch
        self._tokens = [0] * len(self.workers)
        self._seconds = [0.0] * len(self.workers)
        self._warned_idle = False
        self.kv_capacity_tokens: list[Optional[float]] = []  # per engine, read once at start (``start``)

    @classmethod
    def start(cls, placement: Optional[Placement], plan: ClusterPlan, spec: GenerationSpec,
              torch_threads: Optional[int],
              cuda_visible_devices: Optional[Sequence[Optional[Sequence[str]]]] = None) -> "GenerationGroup":
        """Start one engine actor on each of ``plan.engine_slots`` and build their backends, all at once.

        ``cuda_visible_devices``: per engine, the GPUs of a colocated multi-GPU engine (``GenerationWorker``).

        Raises:
            EngineError: an engine's backend could not be built (its index and place named).
        """
        visible = list(cuda_visible_devices or [None] * plan.num_engines)
        workers = [GenerationWorker.options(**actor_options(placement, slot)).remote(spec, torch_threads, vis)
                   for slot, vis in zip(plan.engine_slots, visible)]
        group = cls(workers, rows_per_batch=spec.batch_size, pad_token_id=spec.pad_token_id)
        group._each("ready")  # re-raises a backend's construction error
        group.labels = [f"engine {i} ({w})" for i, w in enumerate(group._each("where"))]
        # an engine's KV capacity is fixed once it has profiled its memory: one read, logged with every step
        group.kv_capacity_tokens = [m.get("generation/kv_capacity_tokens") for m in group._each("pop_engine_metrics")]
        logger.info("generation: %d engine(s) ready: %s", len(workers), "; ".join(group.labels))
        return group

    @property
    def num_engines(self) -> int:
        return len(self.workers)

    @property
    def worker(self):
        """Engine 0's actor (the only one with one engine)."""
        return self.workers[0]

    def _gather(self, refs: Sequence, what: str, engines: Optional[Sequence[int]] = None,
                timeout_s: Optional[float] = None) -> list:
        """The answers of one call per engine (``engines``: their indices, default all in order), the first failure
        raised as soon as it happens as an ``EngineError`` naming that engine (``fanout.gather``; a dead engine:
        the first line of Ray's reason). ``timeout_s``: an ``EngineError`` naming the engines that have not
        answered by then."""
        engines = list(range(len(refs))) if engines is None else list(engines)
        return gather(refs, what, [self.labels[e] for e in engines], timeout_s, error=EngineError)

    def _each(self, method: str, *args) -> list:
        return call_all(self.workers, method, *args, labels=self.labels, error=EngineError)

    # ----------------------------------------------------------------------- generation
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        """Generate over all engines (module docstring); rows in the order of ``prompt_token_ids``.

        Raises:
            ValueError: no prompts.
            EngineError: an engine raised or died (named).
        """
        if not prompt_token_ids:
            raise ValueError("generate: no prompts")
        bins = plan_bins(prompt_token_ids, self.rows_per_batch)
        if len(bins) < len(self.workers) and not self._warned_idle:
            self._warned_idle = True  # once: a step's rollout and a validation pass may differ in size
            logger.warning("generate: %d rows make %d bin(s) of policy.generation_batch_size=%d rows, so %d of the "
                           "%d engines stay idle; a generation_batch_size of at most %d keeps them all busy",
                           len(prompt_token_ids), len(bins), self.rows_per_batch, len(self.workers) - len(bins),
                           len(self.workers), max(1, len(prompt_token_ids) // len(self.workers)))
        costs = [expected_tokens(prompt_token_ids, b.rows, sampling.max_new_tokens) for b in bins]
        per_engine = assign_bins(bins, costs, len(self.workers))
        refs, engines, rows = [], [], []
        for e, mine in enumerate(per_engine):
            if not mine:
                continue
            idx = [r for b in mine for r in b.rows]
            refs.append(self.workers[e].generate.remote(
                [prompt_token_ids[r] for r in idx], sampling, [request_seed(sampling.seed, r) for r in idx],
                [c for b in mine for c in b.chunk_sizes]))
            engines.append(e)
            rows.extend(idx)
        results = self._gather(refs, "generate", engines)
        for e, (out, seconds) in zip(engines, results):
            self._tokens[e] += int(out.response_lengths.sum())
            self._seconds[e] += seconds
        outs = [out for out, _ in results]
        order = torch.empty(len(rows), dtype=torch.long)
        order[torch.tensor(rows)] = torch.arange(len(rows))  # row r of the step is row order[r] of the concat
        merged = GenerationOutput(
            token_ids=concat_padded([o.token_ids for o in outs], self.pad_token_id),
            prompt_lengths=torch.cat([o.prompt_lengths for o in outs]),
            response_lengths=torch.cat([o.response_lengths for o in outs]),
            generation_logprobs=concat_padded([o.generation_logprobs for o in outs], 0.0),
            truncated=torch.cat([o.truncated for o in outs]))
        return GenerationOutput(merged.token_ids[order], merged.prompt_lengths[order], merged.response_lengths[order],
                                merged.generation_logprobs[order], merged.truncated[order]).validate()

    def pop_engine_metrics(self) -> dict[str, float]:
        """``generation/engines`` and each engine's generated tokens and generation seconds since the last call
        (``generation/engine_<i>/tokens``, ``generation/engine_<i>/seconds``), and ``generation/engine_imbalance``
        (the slowest engine's seconds / the mean; 1.0 is balanced); then resets the counts. With every engine's KV
        capacity known (vLLM engines, read at ``start``), ``generation/kv_capacity_tokens``: their sum, the tokens
        the rollout's KV caches hold at once."""
        out = {"generation/engines": float(len(self.workers))}
        if self.kv_capacity_tokens and all(c is not None for c in self.kv_capacity_tokens):
            out["generation/kv_capacity_tokens"] = float(sum(self.kv_capacity_tokens))
        for e in range(len(self.workers)):
            out[f"generation/engine_{e}/tokens"] = float(self._tokens[e])
            out[f"generation/engine_{e}/seconds"] = self._seconds[e]
        if sum(self._seconds) > 0:
            out["generation/engine_imbalance"] = max(self._seconds) / (sum(self._seconds) / len(self._seconds))
        self._tokens = [0] * len(self.workers)
        self._seconds = [0.0] * len(self.workers)
        return out

    # ----------------------------------------------------------------------- refit and lifecycle
    def start_weight_update(self, version: int) -> None:
        self._each("start_weight_update", version)

    def update_weights(self, named_tensors) -> None:
        items = list(named_tensors)
        self._each("update_weights", items)

    def finish_weight_update(self) -> WeightVersion:
        return self._agree(self._each("finish_weight_update"), "refit")

    def weight_version(self) -> WeightVersion:
        """The version every engine holds.

        Raises:
            EngineError: engines hold different versions (the one that differs from engine 0 is named).
        """
        return self._agree(self._each("weight_version"), "rollout")

    def _agree(self, held: list[WeightVersion], what: str) -> WeightVersion:
        for e, h in enumerate(held):
            if (h.weights, h.kv_scales) != (held[0].weights, held[0].kv_scales):
                raise EngineError(f"{what}: {self.labels[e]} holds weights of version {h.weights} (KV scales "
                                  f"{h.kv_scales}), {self.labels[0]} of version {held[0].weights} (KV scales "
                                  f"{held[0].kv_scales}): a refit did not reach every engine")
        return held[0]

    def prepare_for_generation(self) -> None:
        self._each("prepare_for_generation")

    def finish_generation(self) -> None:
        self._each("finish_generation")

    def shutdown(self, timeout_s: Optional[float] = None) -> None:
        """Shut every engine down (all are tried; the first failure is raised after), then end their actors.

        Args:
            timeout_s: how long to wait for the engines' shutdown calls (one busy with an interrupted call may not
                answer); None: no limit. The actors are ended either way.

        Raises:
            EngineError: an engine's shutdown raised, it died, or it did not answer within ``timeout_s``.
        """
        shutdown_actors(self.workers, timeout_s, labels=self.labels, error=EngineError)
