"""Named phase timing for the GRPO step (``generation``, ``reward``, ``logprobs``, ...)."""

from __future__ import annotations

import time
from contextlib import contextmanager


class Timer:
    """Accumulates wall-clock seconds per phase name; ``pop()`` returns and clears them."""

    def __init__(self):
        self._seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[name] = self._seconds.get(name, 0.0) + time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        """Add ``seconds`` timed elsewhere (another process's part of a phase) to ``name``."""
        self._seconds[name] = self._seconds.get(name, 0.0) + seconds

    def pop(self) -> dict[str, float]:
        out, self._seconds = self._seconds, {}
        return out
