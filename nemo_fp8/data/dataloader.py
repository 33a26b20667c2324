"""An endless, seeded, resumable batch iterator over prompt samples."""

from __future__ import annotations

import random
from typing import Any

from nemo_fp8.data.prompts import PromptSample


class PromptDataloader:
    """Yield batches of :class:`PromptSample`, epoch after epoch, forever.

    Each epoch uses its own permutation, drawn from ``random.Random`` seeded with a string built
    from ``(seed, epoch)``, so the order depends only on the seed and the epoch number. Every
    batch has exactly ``batch_size`` samples; the partial batch at the end of an epoch is dropped.
    :meth:`state_dict` / :meth:`load_state_dict` save and restore the position, so a resumed
    run sees the same batches as an uninterrupted one.

    Args:
        samples (list[PromptSample]): The dataset.
        batch_size (int): Samples per batch (1 <= batch_size <= len(samples)).
        seed (int): Seed of the per-epoch permutations.
        shuffle (bool): If False, every epoch is in the original order.

    Raises:
        ValueError: Empty ``samples`` or bad ``batch_size``.
    """

    def __init__(self, samples: list[PromptSample], batch_size: int, seed: int, shuffle: bool = True) -> None:
        if not samples:
            raise ValueError("PromptDataloader needs at least one sample")
        if batch_size < 1 or batch_size > len(samples):
            raise ValueError(f"batch_size must be in [1, {len(samples)}] (number of samples), got {batch_size}")
        self.samples = list(samples)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # index into this epoch's order of the next sample to yield
        self._order_epoch = -1
        self._order: list[int] = []

    @property
    def batches_per_epoch(self) -> int:
        """int: Full batches in one epoch."""
        return len(self.samples) // self.batch_size

    def __len__(self) -> int:
        """Return the number of batches per epoch (iteration itself never ends)."""
        return self.batches_per_epoch

    def epoch_order(self, epoch: int) -> list[int]:
        """Return the sample indices of ``epoch`` in the order they are yielded.

        Args:
            epoch (int): Epoch number (0-based).

        Returns:
            list[int]: A permutation of ``range(len(samples))``.
        """
        order = list(range(len(self.samples)))
        if self.shuffle:
            random.Random(f"PromptDataloader:{self.seed}:{epoch}").shuffle(order)
        return order

    def __iter__(self) -> PromptDataloader:
        """Return self: iteration continues from the current state and never stops."""
        return self

    def __next__(self) -> list[PromptSample]:
        """Return the next batch, moving to the next epoch when this one has no full batch left."""
        if self.position + self.batch_size > len(self.samples):
            self.epoch += 1
            self.position = 0
        if self._order_epoch != self.epoch:
            self._order = self.epoch_order(self.epoch)
            self._order_epoch = self.epoch
        indices = self._order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return [self.samples[i] for i in indices]

    def state_dict(self) -> dict[str, Any]:
        """Return the resumable state.

        Returns:
            dict[str, Any]: ``epoch``, ``position`` (samples consumed in that epoch), and
            ``seed``, ``shuffle``, ``batch_size``, ``num_samples`` for consistency checks.
        """
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "num_samples": len(self.samples),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict`.

        Args:
            state (dict[str, Any]): Needs ``epoch`` and ``position``; ``seed``, ``shuffle`` and
                ``num_samples``, when present, must match this loader (otherwise the data order
                would silently differ). A different ``batch_size`` is allowed.

        Raises:
            KeyError: ``epoch`` or ``position`` missing.
            ValueError: Mismatched ``seed`` / ``shuffle`` / ``num_samples``, or bad values.
        """
        current = {"seed": self.seed, "shuffle": self.shuffle, "num_samples": len(self.samples)}
        for key, value in current.items():
            if key in state and state[key] != value:
                raise ValueError(f"dataloader state has {key}={state[key]!r} but this loader has {key}={value!r}")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self.samples):
            raise ValueError(f"invalid dataloader state epoch={epoch}, position={position}")
        self.epoch = epoch
        self.position = position
