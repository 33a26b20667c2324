"""The bounded buffer between asynchronous GRPO's trajectory collector and its trainer.

The collector (``nemo_fp8.algorithms.async_grpo.TrajectoryCollector``, a thread on the driver) makes the rollouts
of one training step at a time, a ``StepRollouts``: the step's generation rounds (prompt groups, advantages
computed per group as in the synchronous loop), each round tagged with the weight version that generated it. The
trainer takes the one made for its step (NeMo-RL's ``target_weight_version``: no rollout misses the step it was
made for, ``nemo_rl/algorithms/async_utils.py``'s ``ReplayBuffer.sample``) and checks that every round is within
``grpo.async_grpo.max_trajectory_age_steps`` of the weights it trains.

Torch only; ``threading`` for the hand-over. Waits poll every ``POLL_S`` so a signal reaches the main thread.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from nemo_fp8.batch import TrainBatch

#: Seconds between checks of a waiting ``put`` / ``take`` (a ``KeyboardInterrupt`` lands between two).
POLL_S = 0.2


@dataclass
class StepRollouts:
    """The rollouts the collector made for one training step.

    Attributes:
        step: the GRPO step they are for (it updates the weights of version ``step - 1``).
        parts: per generation round, its rows kept for training (``TrainBatch`` without ``prev_logprobs``; with
            ``grpo.use_dynamic_sampling`` the uniform groups are dropped).
        rollouts: per round, the ``nemo_fp8.algorithms.grpo.Rollout`` (all rows: rewards, lengths, engine metrics).
        versions: per round, the weight version the engines held while generating it.
        dataloader_state: the prompt loader's ``state_dict()`` right after this step's prompts were drawn: what a
            checkpoint of this step saves as ``dataloader`` (where the synchronous loop, or a resume without the
            rollouts made ahead, goes on).
        phases: the collector's seconds per phase for this step (``generation``, ``reward``, ``advantages``).
    """

    step: int
    parts: list[TrainBatch]
    rollouts: list
    versions: list[int]
    dataloader_state: dict
    phases: dict[str, float] = field(default_factory=dict)

    def row_versions(self) -> torch.Tensor:
        """[rows of all parts, concatenated] int64: the weight version that generated each kept row."""
        if not self.parts:
            return torch.zeros(0, dtype=torch.long)
        return torch.cat([torch.full((p.size,), v, dtype=torch.long) for p, v in zip(self.parts, self.versions)])


class TrajectoryBuffer:
    """At most ``capacity`` ``StepRollouts``, handed from the collector's thread to the trainer's.

    Args:
        capacity: steps of rollouts held at once (``max_trajectory_age_steps + 1`` covers every step the age limit
            lets the collector make ahead).

    Raises:
        ValueError: ``capacity < 1``.
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"TrajectoryBuffer capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._steps: dict[int, StepRollouts] = {}
        self._cond = threading.Condition()
        self._error: Optional[BaseException] = None

    def __len__(self) -> int:
        with self._cond:
            return len(self._steps)

    def put(self, rollouts: StepRollouts, stopped: Callable[[], bool] = lambda: False) -> Optional[float]:
        """Add one step's rollouts, waiting while the buffer is full; returns the seconds waited for room, or None
        when ``stopped()`` turned true first (nothing added).

        Raises:
            ValueError: rollouts for that step are in the buffer already.
        """
        t0 = time.perf_counter()
        with self._cond:
            while len(self._steps) >= self.capacity:
                if stopped():
                    return None
                self._cond.wait(POLL_S)
            if rollouts.step in self._steps:
                raise ValueError(f"trajectory buffer: step {rollouts.step} has rollouts already")
            self._steps[rollouts.step] = rollouts
            self._cond.notify_all()
        return time.perf_counter() - t0

    def take(self, step: int, max_age: int, alive: Callable[[], bool] = lambda: True) -> StepRollouts:
        """Remove and return the rollouts made for ``step``, waiting until the collector has put them.

        Args:
            step: the GRPO step about to train (it updates the weights of version ``step - 1``).
            max_age: ``grpo.async_grpo.max_trajectory_age_steps`` (0 with ``wait_for_current_weights``).
            alive: whether the collector can still deliver (False: an error, not a wait forever).

        Raises:
            BaseException: the error the collector failed with (``fail``), itself.
            RuntimeError: the collector stopped without the step's rollouts, or a round is older than ``max_age``
                (the collector's gate should make that impossible: a bug, not a config error).
        """
        with self._cond:
            while step not in self._steps:
                if self._error is not None:
                    raise self._error
                if not alive():
                    raise RuntimeError(f"trajectory buffer: the collector stopped before making step {step}'s "
                                       "rollouts")
                self._cond.wait(POLL_S)
            out = self._steps.pop(step)
            self._cond.notify_all()
        oldest = min(out.versions, default=step - 1)
        if step - 1 - oldest > max_age:
            raise RuntimeError(f"trajectory buffer: step {step} got rollouts of weight version {oldest}, older than "
                               f"grpo.async_grpo.max_trajectory_age_steps={max_age} allows")
        return out

    def fail(self, error: BaseException) -> None:
        """The collector failed: ``take`` raises ``error`` from now on."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def steps(self) -> list[StepRollouts]:
        """The steps' rollouts held now, ascending by step, left in place (what a checkpoint saves: the caller
        holds the collector paused, so none is added meanwhile)."""
        with self._cond:
            return [self._steps[k] for k in sorted(self._steps)]

    def clear(self) -> int:
        """Drop every step's rollouts (at the end of the loop); returns how many steps were dropped."""
        with self._cond:
            n = len(self._steps)
            self._steps.clear()
            self._cond.notify_all()
            return n
