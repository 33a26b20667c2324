"""Tests for the synthetic arithmetic problems."""

import re

import pytest

from nemo_fp8.data import make_arithmetic_problems
from nemo_fp8.rewards import verify_answer

PATTERN = re.compile(r"What is (\d+) ([+\-*]) (\d+)\?")


def test_deterministic_for_seed():
    a = make_arithmetic_problems(200, seed=3)
    b = make_arithmetic_problems(200, seed=3)
    c = make_arithmetic_problems(200, seed=4)
    assert a == b
    assert a != c
    assert make_arithmetic_problems(50, seed=3) == a[:50]


def test_format_and_answers():
    examples = make_arithmetic_problems(500, seed=0, max_operand=20, ops=("+", "-", "*"))
    seen_ops = set()
    negatives = 0
    for i, ex in enumerate(examples):
        match = PATTERN.fullmatch(ex.problem)
        assert match, ex.problem
        a, op, b = int(match[1]), match[2], int(match[3])
        assert 0 <= a <= 20 and 0 <= b <= 20
        seen_ops.add(op)
        expected = {"+": a + b, "-": a - b, "*": a * b}[op]
        assert ex.answer == str(expected)
        negatives += expected < 0
        assert ex.data_source == "synthetic_arithmetic" and ex.index == i and ex.messages is None
        assert verify_answer(ex.answer, str(expected))
    assert seen_ops == {"+", "-", "*"}
    assert negatives > 0


def test_exact_text():
    ex = make_arithmetic_problems(1, seed=1, ops=("+",))[0]
    assert ex.problem.startswith("What is ") and ex.problem.endswith("?")
    assert " + " in ex.problem


def test_bad_args():
    with pytest.raises(ValueError):
        make_arithmetic_problems(-1, seed=0)
    with pytest.raises(ValueError, match="unknown operators"):
        make_arithmetic_problems(3, seed=0, ops=("/",))
    with pytest.raises(ValueError):
        make_arithmetic_problems(3, seed=0, ops=())
    assert make_arithmetic_problems(0, seed=0) == []
