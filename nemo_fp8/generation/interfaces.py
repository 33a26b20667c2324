"""The generation (rollout) backend interface.

A backend turns prompt token ids into responses plus the log-probs of the sampled tokens
(``generation_logprobs``) and takes new weights from the policy (the refit). Two
implementations: ``torch`` (reference, CPU or CUDA, same FP8 numerics code as the engine) and
``vllm`` (vLLM FP8 W8A8 engine, ``nemo_fp8.generation.vllm``; docs/vllm-fp8-rollout.md). Batches follow ``nemo_fp8.batch``.

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

from dataclasses import dataclass
from typing import Iterable, Optional, Protocol, Sequence

from torch import Tensor

from nemo_fp8.batch import GenerationOutput
from nemo_fp8.distributed.weight_sync import WeightVersion  # noqa: F401 (part of this interface)


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
    """

    max_new_tokens: int
    temperature: float = 1.0
    greedy: bool = False
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()


def request_seed(seed: int, row: int) -> int:
    """The sampling seed of request ``row`` of a generate call seeded ``seed`` (``SamplingParams.seed``).

    A data-parallel rollout gives each request the seed of its row in the whole step's batch, so the samples do
    not depend on which engine draws them (``nemo_fp8.generation.group``); vLLM takes it as the request's
    ``SamplingParams.seed``, the torch engine as the seed of the request's own generator.
    """
    return seed * 1_000_003 + row


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
        resets the counts. Read after every generation round."""
        ...

    def shutdown(self) -> None:
        """Release everything; the backend is unusable afterwards."""
        ...
