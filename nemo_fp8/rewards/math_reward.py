"""Rule-based math reward: extract the final answer of a response and check it with math-verify.

Answer extraction follows the formats of the datasets used here:

* DAPO-Math-17k / AIME prompts ask for a last line ``Answer: $Answer`` (the DAPO reward in verl,
  ``verl/utils/reward_score/math_dapo.py``, reads ``Answer\\s*:\\s*([^\\n]+)``),
* MATH-style solutions put the result in ``\\boxed{...}``,
* GSM8K solutions end with ``#### <answer>`` (github.com/openai/grade-school-math).

Equivalence is decided by Hugging Face math-verify (github.com/huggingface/Math-Verify) with its
own timeouts disabled: they rely on ``signal.alarm`` and only work on the main thread. The time
limit is enforced instead by :class:`MathRewardScorer`, which runs cheap checks first, then scores
in ``pebble`` worker processes, kills a worker whose answer takes longer than its limit and shares
a step budget fairly between the answers.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FuturesTimeoutError
from concurrent.futures import wait as futures_wait
from decimal import Decimal, InvalidOperation

import math_verify
import math_verify.grader
import math_verify.parser

logger = logging.getLogger(__name__)

# math-verify warns once per process that timeouts are disabled; we enforce them ourselves.
math_verify.parser.TIMEOUT_WARNING_SHOWN = True
math_verify.grader.TIMEOUT_WARNING_SHOWN = True

_ANSWER_LINE_RE = re.compile(r"(?i)\banswer\s*\**\s*:([^\n]*)")
_BOXED_START_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_GSM8K_RE = re.compile(r"####\s*([^\n]*)")
_PLAIN_NUMBER_RE = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?")
_MATH_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))


def _iter_boxed(text: str):
    """Yield ``(start, content)`` for every ``\\boxed{...}`` / ``\\fbox{...}`` with balanced braces.

    ``start`` is the index of the backslash; ``content`` is stripped. Nested braces are handled
    (``\\boxed{\\frac{1}{2}}`` -> ``\\frac{1}{2}``). A box whose braces never close (e.g. a
    truncated response) or whose content is empty is skipped. A box nested in another box is
    yielded too, after (at a larger start than) the outer one.

    One pass over ``text`` with a stack of open braces, so the cost is linear in its length
    (plus a sort of the boxes found), also for thousands of unclosed boxes.
    """
    box_at = {m.end() - 1: m for m in _BOXED_START_RE.finditer(text)}  # index of a box's "{" -> its match
    stack: list[int] = []  # indices of open "{"
    found = []
    for i, c in enumerate(text):
        if c == "{":
            stack.append(i)
        elif c == "}" and stack:
            opened = stack.pop()
            m = box_at.get(opened)
            if m is not None:
                content = text[opened + 1:i].strip()
                if content:
                    found.append((m.start(), content))
    yield from sorted(found)


def _find_last_boxed(text: str) -> str | None:
    """Return the content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (by start) with balanced braces.

    Args:
        text (str): Text to search.

    Returns:
        str | None: The box content, stripped, or None when there is none (see `_iter_boxed`).
    """
    last = None
    for _, content in _iter_boxed(text):
        last = content
    return last


def _clean_answer(answer: str) -> str:
    """Strip whitespace, markdown bold, surrounding math delimiters and a trailing period."""
    answer = answer.strip().strip("*").strip()
    changed = True
    while changed:
        changed = False
        for left, right in _MATH_DELIMITERS:
            if len(answer) >= len(left) + len(right) and answer.startswith(left) and answer.endswith(right):
                answer = answer[len(left) : len(answer) - len(right)].strip()
                changed = True
                break
    if answer.endswith(".") and not answer.endswith(".."):
        answer = answer[:-1].rstrip()
    return answer


def _answer_markers(text: str) -> list[tuple[int, str]]:
    """All final-answer markers of ``text`` as ``(position, answer)``, answers non-empty.

    Markers: ``Answer: ...`` phrases (position of the phrase; the rest of the line, cleaned, or
    the last box in it), ``\\boxed{...}`` / ``\\fbox{...}`` (position of the backslash) and GSM8K
    ``#### ...`` (position of the hashes).
    """
    markers: list[tuple[int, str]] = []
    for match in _ANSWER_LINE_RE.finditer(text):
        answer = _clean_answer(match.group(1))
        boxed = _find_last_boxed(answer)
        if boxed is not None:
            answer = boxed
        if answer:
            markers.append((match.start(), answer))
    markers.extend(_iter_boxed(text))
    for match in _GSM8K_RE.finditer(text):
        answer = _clean_answer(match.group(1))
        if answer:
            markers.append((match.start(), answer))
    return markers


def extract_answer(text: str) -> str | None:
    """Extract the final answer of a model response or worked solution.

    The last final-answer marker by position wins, whatever its kind:

    * ``Answer: ...`` (case-insensitive, e.g. ``Final answer: 5``, ``**Answer:** 5``), the DAPO
      format; surrounding ``$...$`` / ``\\(...\\)`` and a trailing period are stripped, and an
      answer written as ``\\boxed{x}`` gives ``x``; a phrase with nothing after it on its line
      (``we get our answer:`` followed by display math) is not a marker;
    * ``\\boxed{...}`` or ``\\fbox{...}`` (balanced, nested braces; empty or unclosed boxes are
      skipped);
    * ``#### N`` (GSM8K).

    So a solution that says "check our answer: $17 \\cdot 44 = 748$" before its final
    ``\\boxed{44}`` gives ``44``, and ``\\boxed{5}`` followed by ``Answer: 6`` gives ``6``.
    (Earlier versions gave any ``Answer:`` phrase priority over boxes wherever it stood.)

    Args:
        text (str): The response.

    Returns:
        str | None: The answer text, or None when there is no marker.
    """
    markers = _answer_markers(text)
    if not markers:
        return None
    return max(markers, key=lambda m: m[0])[1]


def _as_plain_number(s: str) -> Decimal | None:
    """Return ``s`` as a Decimal if it is a plain number (``-12``, ``1,000``, ``3.50``), else None."""
    s = s.strip()
    if not s or not any(c.isdigit() for c in s) or not _PLAIN_NUMBER_RE.fullmatch(s):
        return None
    try:
        return Decimal(s.replace(",", ""))
    except InvalidOperation:
        return None


def _parse_math(s: str) -> list:
    """Parse an answer string with math-verify, as LaTeX math first, then as a plain expression.

    ``s`` is wrapped in ``$...$`` unless it already carries math delimiters or a box, so both
    plain numbers (``1,000``) and LaTeX (``\\frac{1}{2}``) are read as math.
    """
    has_delimiters = any(tok in s for tok in ("$", "\\(", "\\[", "\\boxed", "\\fbox"))
    wrapped = s if has_delimiters else f"${s}$"
    parsed = math_verify.parse(wrapped, parsing_timeout=None)
    if not parsed and wrapped != s:
        parsed = math_verify.parse(s, parsing_timeout=None)
    return parsed


def verify_answer(predicted: str, ground_truth: str) -> bool:
    """Return True when ``predicted`` is mathematically equal to ``ground_truth``.

    Checks, in order: exact string match (after stripping); when both are plain numbers, exact
    decimal comparison (commas as thousands separators, ``"1,000" == "1000"``,
    ``"18" == "18.0"``); otherwise math-verify ``parse`` + ``verify`` (so ``\\frac{1}{2}`` equals
    ``0.5``). math-verify runs with its timeouts disabled (``parsing_timeout=None``,
    ``timeout_seconds=None``), so this function has no time limit of its own; use
    :class:`MathRewardScorer` for one. Any math-verify error counts as not equal.

    Args:
        predicted (str): The extracted model answer.
        ground_truth (str): The reference answer.

    Returns:
        bool: Whether they are equivalent.
    """
    predicted, ground_truth = predicted.strip(), ground_truth.strip()
    if not predicted or not ground_truth:
        return False
    if predicted == ground_truth:
        return True
    pred_num, gold_num = _as_plain_number(predicted), _as_plain_number(ground_truth)
    if pred_num is not None and gold_num is not None:
        return pred_num == gold_num
    return math_verify_equal(predicted, ground_truth)


def math_verify_equal(predicted: str, ground_truth: str) -> bool:
    """Compare two answer strings with math-verify only (no string or decimal shortcuts).

    Args:
        predicted (str): The extracted model answer.
        ground_truth (str): The reference answer.

    Returns:
        bool: math-verify's verdict; False when either side does not parse or on any error.
    """
    try:
        gold = _parse_math(ground_truth)
        pred = _parse_math(predicted)
        if not gold or not pred:
            return False
        return bool(math_verify.verify(gold, pred, timeout_seconds=None))
    except Exception as e:  # math-verify / sympy can raise on odd input; count as wrong
        logger.debug("math-verify failed on %r vs %r: %s", predicted, ground_truth, e)
        return False


def score_response(response: str, ground_truth: str) -> float:
    """Score a response: 1.0 when its extracted answer equals ``ground_truth``, else 0.0.

    Args:
        response (str): The full model response.
        ground_truth (str): The reference final answer.

    Returns:
        float: 1.0 or 0.0 (0.0 when no answer can be extracted).
    """
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    return 1.0 if verify_answer(answer, ground_truth) else 0.0


def quick_score(response: str, ground_truth: str) -> float | None:
    """``score_response``'s verdict when it needs no math-verify, else None.

    Decided here: no extractable answer (0.0), the same string, or two plain numbers (exact decimal
    comparison, as in ``verify_answer``). Costs time linear in ``len(response)``, so the scorer runs it
    in the calling process before anything goes to its workers.
    """
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    predicted, gold = answer.strip(), ground_truth.strip()
    if not predicted or not gold:
        return 0.0
    if predicted == gold:
        return 1.0
    pred_num, gold_num = _as_plain_number(predicted), _as_plain_number(gold)
    if pred_num is not None and gold_num is not None:
        return 1.0 if pred_num == gold_num else 0.0
    return None


class MathRewardScorer:
    """Score batches of responses in parallel worker processes, with a per-answer time limit and a step budget.

    How a call spends its time (so that slow answers cannot cost other answers their score):

    1. cheap checks first, in this process (``quick_score``: no answer, same string, plain numbers);
       only answers that need math-verify go on (with the default ``score_fn``);
    2. a fair first pass: with ``max_seconds_per_step``, each remaining answer gets at most an equal
       share of the budget, ``budget * num_workers / n_remaining`` (capped by ``timeout_s``), so the
       budget is spread over all answers before any one of them gets more;
    3. a second pass gives the answers that ran past their share their full ``timeout_s``, while the
       budget lasts.

    Each answer is one ``pebble.ProcessPool`` task; pebble kills the worker of an answer past its
    limit. An answer past its own ``timeout_s`` scores 0.0 (``num_timeouts``); answers still unscored
    when the budget runs out get ``nan`` (``num_over_step_budget``): not scored, which is not wrong,
    and the trainer leaves them out of the advantages. With ``num_workers=0`` answers are scored inline,
    without a per-answer limit (debugging only; the run's config refuses it) and the budget is checked
    between answers. Counts of the last call are in ``last_num_timeouts`` / ``last_num_over_budget`` /
    ``last_num_errors``; running totals since :meth:`pop_stats` in ``pop_stats()``.

    The pool is started on the first call; call :meth:`close` (or use ``with``) to stop it.

    Args:
        num_workers (int): Worker processes (0: inline).
        timeout_s (float): Seconds allowed per answer (> 0).
        score_fn (Callable[[str, str], float]): Scores one pair; must be picklable (a
            module-level function). Defaults to :func:`score_response` (then ``quick_score`` runs first).
        mp_context (str | None): multiprocessing start method for the workers (``"fork"``,
            ``"spawn"``, ``"forkserver"``); None uses the platform default.
        max_seconds_per_step (float | None): Seconds allowed per call (None: no limit).

    Raises:
        ValueError: Negative ``num_workers``, non-positive ``timeout_s`` or ``max_seconds_per_step``.
    """

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        *,
        score_fn: Callable[[str, str], float] = score_response,
        mp_context: str | None = None,
        max_seconds_per_step: float | None = None,
    ) -> None:
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_seconds_per_step is not None and max_seconds_per_step <= 0:
            raise ValueError(f"max_seconds_per_step must be > 0 or None, got {max_seconds_per_step}")
        self.max_seconds_per_step = max_seconds_per_step
        self.last_num_over_budget = 0
        self._totals = {"num_timeouts": 0, "num_over_step_budget": 0, "num_errors": 0}
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.score_fn = score_fn
        self.mp_context = mp_context
        self.last_num_timeouts = 0
        self.last_num_errors = 0
        self._pool = None
        self._lock = threading.Lock()

    def _get_pool(self):
        """Return the process pool, starting it on first use."""
        with self._lock:
            if self._pool is None:
                from pebble import ProcessPool

                from nemo_fp8.distributed.teardown import ctrl_c_ignoring_context

                # the workers ignore Ctrl-C from the fork on; this process owns it and stops them (close)
                self._pool = ProcessPool(max_workers=self.num_workers,
                                         context=ctrl_c_ignoring_context(self.mp_context))
            return self._pool

    def __call__(self, responses: list[str], ground_truths: list[str]) -> list[float]:
        """Score each response against its ground truth.

        Args:
            responses (list[str]): Model responses.
            ground_truths (list[str]): Reference answers, same length.

        Returns:
            list[float]: per response, in input order: 1.0 / 0.0 (0.0 also for an answer past
            ``timeout_s`` and for errors), ``nan`` for an answer the step budget left unscored.

        Raises:
            ValueError: The lists have different lengths.
        """
        if len(responses) != len(ground_truths):
            raise ValueError(
                f"responses and ground_truths differ in length: {len(responses)} vs {len(ground_truths)}"
            )
        self.last_num_timeouts = self.last_num_errors = self.last_num_over_budget = 0
        if not responses:
            return []
        deadline = None if self.max_seconds_per_step is None else time.monotonic() + self.max_seconds_per_step
        scores: list[float | None] = [None] * len(responses)
        if self.score_fn is score_response:
            for i, (r, g) in enumerate(zip(responses, ground_truths)):
                scores[i] = quick_score(r, g)
        pending = [i for i, v in enumerate(scores) if v is None]
        if pending and self.num_workers == 0:
            for i in pending:
                if deadline is None or time.monotonic() < deadline:
                    scores[i] = float(self.score_fn(responses[i], ground_truths[i]))
        elif pending:
            share = self.timeout_s if deadline is None else \
                min(self.timeout_s, self.max_seconds_per_step * self.num_workers / len(pending))
            past_share = self._pass(pending, share, responses, ground_truths, scores, deadline)
            if past_share and share < self.timeout_s:
                self._pass(past_share, self.timeout_s, responses, ground_truths, scores, deadline)
        self.last_num_over_budget = sum(v is None for v in scores)
        if self.last_num_timeouts:
            logger.warning("math reward: %d of %d answers timed out after %.1f s and scored 0.0",
                           self.last_num_timeouts, len(responses), self.timeout_s)
        if self.last_num_errors:
            logger.warning("math reward: %d of %d answers failed with an error and scored 0.0",
                           self.last_num_errors, len(responses))
        self._finish(len(responses))
        return [math.nan if v is None else v for v in scores]

    def _pass(self, indices: list[int], limit_s: float, responses, ground_truths, scores: list,
              deadline: float | None) -> list[int]:
        """Score ``indices`` in the pool, each within ``limit_s``, until ``deadline``; fill ``scores`` (None stays
        for answers not done). Returns the answers that ran past ``limit_s`` when it is below ``timeout_s``
        (a later pass may give them more); at ``timeout_s`` they score 0.0 and are counted."""
        pool = self._get_pool()
        futures = {pool.schedule(self.score_fn, args=(responses[i], ground_truths[i]), timeout=limit_s): i
                   for i in indices}
        # a budget longer than the OS can wait (threading.TIMEOUT_MAX, ~292 years) waits as long as it can
        wait = None if deadline is None else min(max(0.0, deadline - time.monotonic()), threading.TIMEOUT_MAX)
        done, not_done = futures_wait(list(futures), timeout=wait)
        for f in not_done:  # the step budget ran out: stop them (pebble kills their workers)
            f.cancel()
        past = []
        for f in done:
            i = futures[f]
            try:
                scores[i] = float(f.result())
            except FuturesTimeoutError:  # pebble's per-answer limit fired
                if limit_s < self.timeout_s:
                    past.append(i)
                else:
                    self.last_num_timeouts += 1
                    scores[i] = 0.0
            except Exception as e:  # worker crashed (pebble ProcessExpired) or score_fn raised
                self.last_num_errors += 1
                logger.debug("reward scoring failed: %r", e)
                scores[i] = 0.0
        return sorted(past)

    def _finish(self, n: int) -> None:
        if self.last_num_over_budget:
            logger.warning("math reward: step budget of %.1f s ran out; %d of %d answers not scored (nan: left "
                           "out of the advantages)",
                           self.max_seconds_per_step, self.last_num_over_budget, n)
        self._totals["num_timeouts"] += self.last_num_timeouts
        self._totals["num_over_step_budget"] += self.last_num_over_budget
        self._totals["num_errors"] += self.last_num_errors

    def pop_stats(self) -> dict[str, float]:
        """Counts since the last call to this: ``num_timeouts`` (per-answer limit),
        ``num_over_step_budget`` (step budget) and ``num_errors``; resets them."""
        out = {k: float(v) for k, v in self._totals.items()}
        self._totals = dict.fromkeys(self._totals, 0)
        return out

    def close(self) -> None:
        """Stop the worker processes (safe to call more than once)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()
            pool.join()

    def __enter__(self) -> MathRewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
