"""The generation (rollout) backend interface.

A backend turns prompt token ids into responses plus the log-probs of the sampled tokens
(``generation_logprobs``), and accepts new weights from the policy (``update_weights``, the
refit). Two implementations: ``torch`` (reference, CPU or CUDA, same FP8 numerics code as the
engine) and ``vllm`` (later issue). Batches follow ``nemo_fp8.batch``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Protocol

from torch import Tensor

from nemo_fp8.batch import GenerationOutput


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


class GenerationBackend(Protocol):
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        """Generate one response per prompt (repeat a prompt for n samples); see GenerationOutput."""
        ...

    def update_weights(self, named_tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]) -> None:
        """Refit: load high-precision weights by HF name; FP8 layers quantize them in place."""
        ...
