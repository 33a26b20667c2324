"""Synthetic arithmetic problems for training a tiny model from scratch.

The text format is deliberately minimal and regular: ``"What is 37 + 5?"`` with the integer
answer ``"42"``, so that a small model can learn it quickly.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Sequence

from nemo_fp8.data.schema import MathExample

SYNTHETIC_DATA_SOURCE = "synthetic_arithmetic"

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def make_arithmetic_problems(
    num_problems: int,
    seed: int,
    max_operand: int = 99,
    ops: Sequence[str] = ("+", "-"),
) -> list[MathExample]:
    """Make ``num_problems`` random binary arithmetic problems, deterministically for ``seed``.

    Both operands are drawn uniformly from ``[0, max_operand]``; the operator uniformly from
    ``ops``. Subtraction can give negative answers.

    Args:
        num_problems (int): How many problems (>= 0).
        seed (int): Seed of the ``random.Random`` generator; same seed -> same problems.
        max_operand (int): Largest operand (>= 0).
        ops (Sequence[str]): Operators to use, a non-empty subset of ``"+"``, ``"-"``, ``"*"``.

    Returns:
        list[MathExample]: Problems like ``"What is 37 + 5?"`` with answer ``"42"``,
        ``data_source="synthetic_arithmetic"`` and ``index`` 0..num_problems-1.

    Raises:
        ValueError: Negative ``num_problems`` or ``max_operand``, empty or unknown ``ops``.
    """
    if num_problems < 0:
        raise ValueError(f"num_problems must be >= 0, got {num_problems}")
    if max_operand < 0:
        raise ValueError(f"max_operand must be >= 0, got {max_operand}")
    ops = tuple(ops)
    if not ops:
        raise ValueError("ops must not be empty")
    unknown = [op for op in ops if op not in _OPS]
    if unknown:
        raise ValueError(f"unknown operators {unknown}; valid: {list(_OPS)}")

    rng = random.Random(seed)
    examples = []
    for i in range(num_problems):
        op = rng.choice(ops)
        a = rng.randint(0, max_operand)
        b = rng.randint(0, max_operand)
        examples.append(
            MathExample(
                problem=f"What is {a} {op} {b}?",
                answer=str(_OPS[op](a, b)),
                data_source=SYNTHETIC_DATA_SOURCE,
                index=i,
            )
        )
    return examples
