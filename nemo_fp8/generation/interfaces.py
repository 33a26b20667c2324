"""The generation (rollout) backend interface.

A backend turns prompt token ids into responses plus the log-probs of the sampled tokens
(``generation_logprobs``) and takes new weights from the policy (the refit). Three
implementations: ``torch`` (reference, CPU or CUDA, same FP8 numerics code as the engine),
``vllm`` (vLLM FP8 W8A8 engine, ``nemo_fp8.generation.vllm``; docs/vllm-fp8-rollout.md) and ``sglang`` (SGLang FP8
W8A8 engine, ``nemo_fp8.generation.sglang``; docs/rollout-engines.md). Batches follow ``nemo_fp8.batch``.

Lifecycle (NeMo-RL's names), as the GRPO step drives it::

    start_weight_update(version) -> update_weights(bucket) x N -> finish_weight_update()   # refit, when stale
    prepare_for_generation() -> generate(...) -> finish_generation()                      # wake, roll out, sleep
    shutdown()

``update_weights`` receives buckets of ``(HF name, high-precision tensor)``; FP8 layers quantize
on arrival (blockwise 128x128, in place). FP8 KV scales travel in the same stream under
``model.layers.{i}.self_attn.{q,k,v}_scale`` (``nemo_fp8.fp8.kv_scales``), so they are always
tagged with the version (GRPO step) of the weights they were measured on.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Iterable, Optional, Protocol, Sequence

from torch import Tensor

from nemo_fp8.batch import GenerationOutput
from nemo_fp8.distributed.weight_sync import WeightVersion  # noqa: F401 (part of this interface)


@dataclass(frozen=True)
class ResponseLimits:
    """Long-tailed per-request response limits, for measuring rollouts whose lengths vary as real RL's do.

    Each request gets its own ``max_new_tokens``: a lognormal draw (median ``median_tokens``, log-space standard
    deviation ``sigma``) rounded and clamped to ``[min_tokens, SamplingParams.max_new_tokens]``, drawn from the
    request's seed (``request_seed``), so every engine and the asynchronous loop give a request the same limit. With
    a model that seldom stops (random weights) the responses take these lengths, and a synchronous rollout waits
    on its longest; with a trained model a limit truncates the responses it cuts. RL response lengths are
    long-tailed (DAPO, arXiv 2503.14476; verl's and NeMo-RL's asynchronous trainers exist for that tail).
    """

    median_tokens: int
    sigma: float
    min_tokens: int = 1

    def limit(self, seed: int, max_new_tokens: int) -> int:
        """The token limit (>= 1, <= ``max_new_tokens``) of the request seeded ``seed``."""
        draw = random.Random(seed).lognormvariate(math.log(self.median_tokens), self.sigma)
        return max(1, min(max_new_tokens, max(self.min_tokens, round(draw))))


@dataclass(frozen=True)
class SamplingParams:
    """How to sample.

    Attributes:
        max_new_tokens: upper bound on generated tokens per sequence (a backend also stops at
            its max total sequence length).
        temperature: softmax temperature; ``generation_logprobs`` are of logits / temperature.
        greedy: argmax decoding (validation); logprobs are then of logits / temperature too.
        seed: seed of the sampling RNG for this call (reproducible rollouts and resume).
        stop_token_ids: extra ids that end a sequence besides the tokenizer's EOS.
        response_limits: per-request limits under ``max_new_tokens`` (``ResponseLimits``); None: every request
            may use ``max_new_tokens``.
    """

    max_new_tokens: int
    temperature: float = 1.0
    greedy: bool = False
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    response_limits: Optional[ResponseLimits] = None


def one_engine_metrics(kv_capacity_tokens: Optional[int]) -> dict[str, float]:
    """``pop_engine_metrics`` of a single engine in its process: ``generation/engines`` 1 (a group adds each
    engine's tokens and seconds) and ``generation/kv_capacity_tokens`` when the engine reports its KV capacity
    (tokens it holds at once; None: not known)."""
    out = {"generation/engines": 1.0}
    if kv_capacity_tokens is not None:
        out["generation/kv_capacity_tokens"] = float(kv_capacity_tokens)
    return out


def request_seed(seed: int, row: int) -> int:
    """The sampling seed of request ``row`` of a generate call seeded ``seed`` (``SamplingParams.seed``).

    A data-parallel rollout gives each request the seed of its row in the whole step's batch, so the samples do
    not depend on which engine draws them (``nemo_fp8.generation.group``); vLLM takes it as the request's
    ``SamplingParams.seed``, the torch engine as the seed of the request's own generator.
    """
    return seed * 1_000_003 + row


def request_max_new_tokens(sampling: SamplingParams, num_requests: int,
                           request_seeds: Optional[Sequence[int]] = None) -> list[int]:
    """Each request's token limit: ``sampling.max_new_tokens``, or with ``sampling.response_limits`` its own draw from
    its seed (``request_seeds[i]``, else ``request_seed(sampling.seed, i)``, as the engines seed requests).

    Raises:
        ValueError: ``request_seeds`` not of ``num_requests`` seeds.
    """
    if request_seeds is not None and len(request_seeds) != num_requests:
        raise ValueError(f"request_max_new_tokens: {len(request_seeds)} request_seeds for {num_requests} requests")
    if sampling.response_limits is None:
        return [sampling.max_new_tokens] * num_requests
    seeds = request_seeds if request_seeds is not None else [request_seed(sampling.seed, i)
                                                            for i in range(num_requests)]
    return [sampling.response_limits.limit(int(s), sampling.max_new_tokens) for s in seeds]


class GenerationBackend(Protocol):
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams,
                 request_seeds: Optional[Sequence[int]] = None,
                 chunk_sizes: Optional[Sequence[int]] = None) -> GenerationOutput:
        """Generate one response per prompt (repeat a prompt for n samples); see GenerationOutput.

        ``request_seeds``: one sampling seed per prompt (``request_seed``), so a request samples the same
        wherever it runs. ``chunk_sizes``: rows of each forward batch, for an engine that batches rows itself (the
        torch engine); vLLM schedules its own and ignores it.
        """
        ...

    def start_weight_update(self, version: int) -> None:
        """Begin a refit to policy ``version`` (GRPO step); buckets follow."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Load one bucket of HF-named high-precision tensors; FP8 layers quantize in place."""
        ...

    def finish_weight_update(self) -> WeightVersion:
        """End the refit; returns what the engine now holds.

        Raises:
            RuntimeError: not every weight arrived (the engine would mix two versions).
        """
        ...

    def weight_version(self) -> WeightVersion:
        """The versions currently loaded (checked by the loop before each rollout)."""
        ...

    def prepare_for_generation(self) -> None:
        """Wake: bring weights / KV cache back to the device (colocated with the trainer)."""
        ...

    def finish_generation(self) -> None:
        """Sleep: free device memory for the trainer (colocated)."""
        ...

    def pop_engine_metrics(self) -> dict[str, float]:
        """``generation/engines`` and, for a group of engines, each engine's generated tokens and generation seconds
        since the last call (``generation/engine_<i>/tokens`` / ``seconds``, ``generation/engine_imbalance``);
        resets the counts. Read after every generation round. An engine that knows its KV cache's size (vLLM) adds
        ``generation/kv_capacity_tokens``, the tokens it holds at once; the torch engine reports none."""
        ...

    def shutdown(self) -> None:
        """Release everything; the backend is unusable afterwards."""
        ...
