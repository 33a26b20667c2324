"""Arithmetic chains: a multi-step task with long, written-out solutions and a verifiable answer (issue 51).

A problem is a start number and a list of operations; the solution applies them one at a time, one line per step
with the intermediate result, and ends in ``Answer: N``, the format ``nemo_fp8.rewards.math_reward`` reads::

    problem:  Start with 47. Add 38. Multiply by 3. Subtract 59. Add 124. What number do you end with?
    solution: Start with 47.
              Step 1: add 38 to 47. 47 + 38 = 85
              Step 2: multiply 85 by 3. 85 * 3 = 255
              Step 3: subtract 59 from 255. 255 - 59 = 196
              Step 4: add 124 to 196. 196 + 124 = 320
              Answer: 320

With the small model's tokenizer (digits one per token) a step costs about 25 tokens, so 6-10 steps give responses
of about 130-300 tokens, mean ~220 (``tests/tools/test_reasoning_task.py`` checks 100-400 for the default task).

Difficulty knobs (:class:`ChainTask`): the number of steps (``min_steps``..``max_steps``, drawn uniformly), the
operand size (``max_operand``: added and subtracted numbers in [2, max_operand]), the multiplier
(``max_multiplier``: multiply by 2..max_multiplier), the largest intermediate value (``max_value``; every correct
intermediate result lies in [0, max_value]) and the operators (``ops``, ``+`` and ``-`` always among them, so a
step always has a valid operator). Each step's operator is drawn uniformly among those of ``ops`` that keep the
result in range.

The teacher's slip (``slip_prob``): a worked solution for supervised training forgets the carry of an addition whose
ones digits sum to 10 or more (writes the sum minus 10) with probability ``slip_prob`` at each such step, and goes
on from the wrong value, so its final answer is wrong. Above 0.5 a model that imitates the teacher drops the carry
when decoding greedily, and solves about the chains without such an addition; sampling at temperature 1 carries
correctly with probability about ``1 - slip_prob`` per step, which gives GRPO correct samples to learn from. This is
the start point with headroom that issue 51 asks for: the rate of carry additions per step (about 0.15-0.2 with the
defaults) and the number of steps set the greedy accuracy of the imitating model (about 0.85**k for k steps) and
what RL can win back. ``slip_prob = 0`` gives clean solutions (the headroom is then only the model's own errors).
Validation and RL problems always carry the correct answer.

Everything is drawn from ``random.Random(seed)`` (Python's Mersenne Twister, the same on every machine and
version): the same spec and seed give the same problems, solutions and slips everywhere.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from lab.small import SmallData
from nemo_fp8.data.schema import MathExample

CHAIN_DATA_SOURCE = "arith_chain"
_VALID_OPS = ("+", "-", "*")


@dataclass(frozen=True)
class ChainTask:
    """Difficulty of a set of arithmetic chains (module docstring). Check with :func:`check_task`."""

    min_steps: int = 6
    max_steps: int = 10
    max_operand: int = 99
    max_multiplier: int = 9
    max_value: int = 999
    ops: tuple[str, ...] = ("+", "-", "*")
    slip_prob: float = 0.0


def check_task(task: ChainTask) -> None:
    """Raise ``ValueError`` listing every invalid field of ``task`` (its name and the valid values)."""
    errs = []
    if task.min_steps < 1 or task.max_steps < task.min_steps:
        errs.append(f"steps: need 1 <= min_steps <= max_steps, got min_steps={task.min_steps}, "
                    f"max_steps={task.max_steps}")
    if task.max_operand < 2:
        errs.append(f"max_operand={task.max_operand} must be >= 2")
    if task.max_multiplier < 2:
        errs.append(f"max_multiplier={task.max_multiplier} must be >= 2")
    if task.max_value < 2 * task.max_operand:
        errs.append(f"max_value={task.max_value} must be >= 2 * max_operand = {2 * task.max_operand} (a step "
                    "must always be able to add or subtract)")
    bad = [o for o in task.ops if o not in _VALID_OPS]
    if bad or not {"+", "-"} <= set(task.ops):
        errs.append(f"ops={''.join(task.ops)!r}: operators among {''.join(_VALID_OPS)!r}, with '+' and '-' among them")
    if not 0.0 <= task.slip_prob <= 1.0:
        errs.append(f"slip_prob={task.slip_prob} must be in [0, 1]")
    if errs:
        raise ValueError("invalid chain task:\n  - " + "\n  - ".join(errs))


@dataclass(frozen=True)
class Chain:
    """One problem: ``start`` and the ``steps`` as (operator, operand) pairs, e.g. ``(("+", 38), ("*", 3))``."""

    start: int
    steps: tuple[tuple[str, int], ...]

    def problem(self) -> str:
        """The problem text (no "answer" word in it: the reward reads the response's last ``Answer:``)."""
        words = {"+": "Add {}.", "-": "Subtract {}.", "*": "Multiply by {}."}
        ops = " ".join(words[op].format(x) for op, x in self.steps)
        return f"Start with {self.start}. {ops} What number do you end with?"

    def values(self) -> list[int]:
        """The correct running value after each step (``len(steps)`` ints)."""
        out, v = [], self.start
        for op, x in self.steps:
            v = _apply(v, op, x)
            out.append(v)
        return out

    def answer(self) -> int:
        """The correct final value."""
        return self.values()[-1]

    def carry_steps(self) -> list[int]:
        """Indices of the additions (on the correct chain) whose ones digits sum to 10 or more."""
        vals = [self.start] + self.values()
        return [i for i, (op, x) in enumerate(self.steps) if op == "+" and vals[i] % 10 + x % 10 >= 10]

    def solution(self, rng: random.Random | None = None, slip_prob: float = 0.0) -> str:
        """The worked solution (module docstring). With ``rng``, the teacher's slip: at each addition whose ones
        digits (of the value written so far) sum to 10 or more, with probability ``slip_prob`` (one
        ``rng.random()`` per such step) the carry is dropped and the chain goes on from the sum minus 10."""
        lines, v = [f"Start with {self.start}."], self.start
        for i, (op, x) in enumerate(self.steps):
            r = _apply(v, op, x)
            if rng is not None and op == "+" and v % 10 + x % 10 >= 10 and rng.random() < slip_prob:
                r -= 10
            verb = {"+": f"add {x} to {v}", "-": f"subtract {x} from {v}", "*": f"multiply {v} by {x}"}[op]
            lines.append(f"Step {i + 1}: {verb}. {v} {op} {x} = {r}")
            v = r
        lines.append(f"Answer: {v}")
        return "\n".join(lines)


def _apply(v: int, op: str, x: int) -> int:
    return v + x if op == "+" else v - x if op == "-" else v * x


def make_chain(rng: random.Random, task: ChainTask) -> Chain:
    """Draw one chain of ``task``'s difficulty from ``rng`` (every correct intermediate value in [0, max_value])."""
    n = rng.randint(task.min_steps, task.max_steps)
    start = rng.randint(2, task.max_operand)
    v, steps = start, []
    for _ in range(n):
        ok = [op for op in task.ops if (op == "+" and v + task.max_operand <= task.max_value)
              or (op == "-" and v >= 2) or (op == "*" and v * 2 <= task.max_value)]
        op = rng.choice(ok)
        if op == "+":
            x = rng.randint(2, min(task.max_operand, task.max_value - v))
        elif op == "-":
            x = rng.randint(2, min(task.max_operand, v))
        else:
            x = rng.randint(2, min(task.max_multiplier, task.max_value // v if v else task.max_multiplier))
        v = _apply(v, op, x)
        steps.append((op, x))
    return Chain(start, tuple(steps))


def make_chain_problems(num_problems: int, seed: int, task: ChainTask) -> list[tuple[MathExample, Chain]]:
    """``num_problems`` chains of ``task``'s difficulty, deterministically for ``seed``, as (example, chain) pairs.

    The example's ``answer`` is the correct final value, ``data_source`` is ``"arith_chain"``, ``index`` 0..n-1.

    Raises:
        ValueError: ``num_problems`` < 0 or an invalid task (:func:`check_task`).
    """
    if num_problems < 0:
        raise ValueError(f"num_problems must be >= 0, got {num_problems}")
    check_task(task)
    rng = random.Random(seed)
    out = []
    for i in range(num_problems):
        c = make_chain(rng, task)
        out.append((MathExample(problem=c.problem(), answer=str(c.answer()), data_source=CHAIN_DATA_SOURCE,
                                index=i), c))
    return out


def teacher_solutions(chains: list[Chain], seed: int, slip_prob: float) -> list[str]:
    """The SFT responses of ``chains`` with the teacher's slips (:meth:`Chain.solution`), deterministically for
    ``seed``; ``slip_prob = 0`` gives the correct solutions."""
    rng = random.Random(seed)
    return [c.solution(rng, slip_prob) for c in chains]


def steps_of(example: MathExample) -> str:
    """An evaluation group of a chain problem: ``"steps=07"`` (its number of operations, zero-padded to sort)."""
    return f"steps={len(_OP_RE.findall(example.problem)):02d}"


_OP_RE = re.compile(r"\b(?:Add|Subtract|Multiply by) \d+\.")


def build_chain_data(sft_task: ChainTask, eval_task: ChainTask, num_sft: int, num_val: int, num_rl: int,
                     seed: int) -> SmallData:
    """The chain task's SFT pairs, validation and RL problems, deterministically for ``seed``.

    SFT chains are drawn with ``sft_task``'s difficulty and written by the teacher with its ``slip_prob``
    (:func:`teacher_solutions`); validation and RL chains with ``eval_task``'s (their answers always correct; its
    ``slip_prob`` is not used). Three seed streams (``seed``, ``seed + 1``, ``seed + 2``; the slips ``seed + 3``);
    validation problems are removed from the SFT and RL sets by problem text.

    Raises:
        ValueError: an invalid task (:func:`check_task`) or a negative count.
    """
    val = [e for e, _ in make_chain_problems(num_val, seed + 1, eval_task)]
    held = {e.problem for e in val}
    sft = [(e, c) for e, c in make_chain_problems(num_sft, seed, sft_task) if e.problem not in held]
    responses = teacher_solutions([c for _, c in sft], seed + 3, sft_task.slip_prob)
    rl = [e for e, _ in make_chain_problems(num_rl, seed + 2, eval_task) if e.problem not in held]
    return SmallData(sft=[(e, r) for (e, _), r in zip(sft, responses)], val=val, rl_train=rl)
