"""The policy (trainer) backend interface.

``get_logprobs`` gives the trainer's per-token log-probs (``prev_logprobs``, or the reference
policy's with ``reference=True``); ``train`` runs one GRPO update over a rollout batch with a
loss function; ``named_weights`` streams the weights, by HF name, for the refit. Two
implementations: ``torch`` (reference: HF model + AdamW, FP8 recipes emulated) and ``megatron``
(Megatron-core + TransformerEngine, later issue). Batches follow ``nemo_fp8.batch``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Protocol

from torch import Tensor

from nemo_fp8.batch import TrainBatch


class LossFn(Protocol):
    def __call__(self, logprobs: Tensor, batch: TrainBatch, global_valid_tokens: float,
                 global_valid_seqs: float) -> tuple[Tensor, dict[str, float]]:
        """Loss of one micro-batch, normalised by the global batch's token/sequence counts."""
        ...


class PolicyBackend(Protocol):
    def get_logprobs(self, batch: TrainBatch, reference: bool = False) -> Tensor:
        """[B, T] float32 log-probs aligned as in nemo_fp8.batch (0 outside responses)."""
        ...

    def train(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        """One pass over ``batch`` in global batches of ``train_global_batch_size``."""
        ...

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The current weights by HF name, high precision, for the refit."""
        ...

    def save(self, path: str | Path) -> None: ...

    def load(self, path: str | Path) -> None: ...
