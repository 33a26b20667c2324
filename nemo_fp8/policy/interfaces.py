"""The policy (trainer) backend interface.

``get_logprobs`` gives the trainer's per-token log-probs (``prev_logprobs``, or the reference
policy's with ``reference=True``); ``train`` runs one GRPO update over a rollout batch with a
loss function; ``named_weights`` streams the weights, by HF name, for the refit;
``calibrate_kv_scales`` measures per-layer q/k/v amax for the FP8 KV cache. Two
implementations: ``torch`` (reference: HF model + AdamW, FP8 recipes emulated) and ``megatron``
(Megatron-core + TransformerEngine, ``nemo_fp8.policy.megatron``; docs/megatron-fp8-training.md). Batches follow ``nemo_fp8.batch``.

Lifecycle (NeMo-RL's names): around a refit with a colocated engine the loop calls
``offload_before_refit`` (optimizer state off the device) and ``offload_after_refit`` (weights
off the device too, so the engine can wake); ``prepare_for_training`` brings both back before
the next log-probs / training; ``shutdown`` releases everything. Colocated with
``offload_trainer`` off, the state stays and the refit ends with ``release_cached_memory``
(the allocator's free cached blocks back to the device).

Data parallelism: a backend instance is one data-parallel rank. ``train`` on a rank sees its
shard of each global batch and sums gradients across ranks (the loss is normalised by the
global batch's token counts, so the update equals a single rank's on the whole batch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Protocol

from torch import Tensor

from nemo_fp8.batch import TrainBatch
from nemo_fp8.fp8.kv_scales import KvScales

# what a colocated release reports beside its parts' seconds (``release_cached_memory``): the unreachable objects its
# ``gc.collect`` found and the GPU memory (GiB) their tensors held; logged as ``release_<when>/<name>``, not timed
RELEASE_COUNTS = ("gc_collected", "gc_freed_gib")


class LossFn(Protocol):
    """A loss over one micro-batch (``nemo_fp8.algorithms.loss.ClippedPGLossFn``)."""

    metric_reductions: dict[str, str]  # metric name -> "sum" | "token_mean" | "seq_mean" | "min" | "max"

    def __call__(self, logprobs: Tensor, batch: TrainBatch, global_valid_tokens: float | Tensor,
                 global_valid_seqs: float | Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """(scalar loss, 0-dim metric tensors), normalised by the global batch's counts; no host sync."""
        ...


class PolicyBackend(Protocol):
    def get_logprobs(self, batch: TrainBatch, reference: bool = False) -> Tensor:
        """[B, T] float32 log-probs aligned as in nemo_fp8.batch (0 outside responses)."""
        ...

    def train(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step per ``train_global_batch_size`` rows; metrics reduced once per global batch."""
        ...

    def calibrate_kv_scales(self, batch: TrainBatch, step: int, margin: float = 1.0) -> KvScales:
        """Per-layer q/k/v amax over ``batch``'s real tokens (post-RoPE, post q/k-norm) -> scales."""
        ...

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The current weights by HF name, high precision, for the refit (a stream, no copies)."""
        ...

    def prepare_for_training(self) -> None: ...

    def offload_before_refit(self) -> None: ...

    def offload_after_refit(self) -> None: ...

    def release_cached_memory(self, gc_generation: int = 2) -> dict[str, float]:
        """Hand the GPU blocks the allocator caches but no tensor uses (the last step's activations) back to the
        device, keeping the weights and optimizer state where they are (the Megatron backend also frees what its
        next pass rebuilds: the gradient buffer, TransformerEngine's FP8 weight copies): what a colocated engine
        needs when the trainer's state stays. First ``gc.collect(gc_generation)``: 2 scans every generation, 1
        only the young ones (what the colocated refit asks for: the full collection freed no GPU memory there).
        Returns the seconds of each part by name (``{}``: none timed); a backend may add what its collection did
        under ``RELEASE_COUNTS``' names."""
        ...

    def cuda_memory_gib(self) -> dict[str, float]:
        """What this policy's process holds on its GPU now, GiB (``nemo_fp8.utils.memory.cuda_memory_gib``:
        ``allocated_gib``, ``reserved_gib``; ``{}`` on CPU): read after ``release_cached_memory``, the trainer's
        part of the GPU beside a colocated engine."""
        ...

    def save(self, path: str | Path) -> None: ...

    def load(self, path: str | Path) -> None: ...

    def shutdown(self) -> None: ...
