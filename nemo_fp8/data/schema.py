"""Common record type for math problems, whatever file they were read from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MathExample:
    """One math problem with its ground-truth final answer.

    Attributes:
        problem (str): The user-facing problem text. For DAPO-style records this is the
            content of the user chat message, kept verbatim (instructions included).
        answer (str): The ground-truth final answer, e.g. ``"18"`` or ``"\\frac{1}{2}"``.
            For GSM8K it is the text after ``####`` with thousands separators removed.
        data_source (str): Where the example came from, e.g. ``"gsm8k"``, ``"math_dapo"``,
            ``"synthetic_arithmetic"``.
        index (int): Index of the example within its source (``extra_info.index`` for DAPO,
            the record position otherwise).
        messages (tuple[dict, ...] | None): The original chat messages (DAPO ``prompt``
            column), or ``None`` when the source only has a plain problem string.

    Note:
        The dataclass is frozen, but ``messages`` holds dicts, so ``hash()`` of an example
        with messages raises ``TypeError``; do not use such examples as dict keys.
    """

    problem: str
    answer: str
    data_source: str
    index: int
    messages: tuple[dict, ...] | None = None
