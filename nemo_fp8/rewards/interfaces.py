"""The reward scorer interface: what the trainer needs from a reward (``MathRewardScorer`` implements it)."""

from __future__ import annotations

from typing import Protocol


class RewardScorer(Protocol):
    def __call__(self, responses: list[str], ground_truths: list[str]) -> list[float]:
        """One reward per response (``nan``: left unscored, e.g. by a step budget: the loop leaves it out of the
        advantages)."""
        ...

    def pop_stats(self) -> dict[str, float]:
        """Counts since the last call (``num_timeouts``, ``num_over_step_budget``, ``num_errors``); resets them.
        Logged under ``reward/`` with each step's row."""
        ...

    def close(self) -> None:
        """Release the scorer's workers (safe to call more than once)."""
        ...
