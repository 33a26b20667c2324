"""The reward's step budget: a batch of pathological answers cannot hold a step past it, nor cost other
answers their score."""

import math
import time

import pytest

from nemo_fp8.rewards import MathRewardScorer


def _hang(response: str, ground_truth: str) -> float:
    """Picklable: the answer "slow" takes 30 s, anything else scores 1.0 at once."""
    if response == "slow":
        time.sleep(30)
    return 1.0


def test_step_budget_cuts_off_pathological_answers_and_counts_them():
    # per-answer limit 20 s, one worker, 4 hanging answers: 80 s without a step budget. With a 6 s budget each
    # answer's fair share is 1 s: the 4 slow ones are cut after 4 s (plus a worker restart each, slow on a loaded
    # machine: a 1.5 s budget left too little for them and lost the last answer under a busy test run).
    with MathRewardScorer(num_workers=1, timeout_s=20.0, score_fn=_hang, mp_context="fork",
                          max_seconds_per_step=6.0) as scorer:
        t0 = time.monotonic()
        scores = scorer(["ok", "slow", "slow", "slow", "slow", "ok"], ["1"] * 6)
        elapsed = time.monotonic() - t0
        assert elapsed < 10, elapsed
        assert scores[0] == 1.0 and all(math.isnan(x) for x in scores[1:5])  # not scored: nan, not wrong
        assert scores[5] == 1.0  # the budget is shared: the answer after the slow ones is scored
        assert scorer.last_num_over_budget >= 4 and scorer.last_num_timeouts == 0
        stats = scorer.pop_stats()
        assert stats["num_over_step_budget"] == scorer.last_num_over_budget
        assert scorer.pop_stats()["num_over_step_budget"] == 0
        assert scorer(["ok"], ["1"]) == [1.0]  # the pool still works after the cut


def test_step_budget_inline_checked_between_answers():
    with MathRewardScorer(num_workers=0, score_fn=lambda r, g: (time.sleep(0.3), 1.0)[1],
                          max_seconds_per_step=0.5) as scorer:
        scores = scorer(["a"] * 6, ["1"] * 6)
    assert scores.count(1.0) <= 3 and scorer.last_num_over_budget == 6 - scores.count(1.0)
    assert sum(math.isnan(x) for x in scores) == scorer.last_num_over_budget


NESTED_FRAC = "\\frac{" * 50 + "1" + "}{2}" * 50  # math-verify needs minutes on it in-process


def test_pathological_answers_first_do_not_zero_the_correct_ones():
    # 4 pathological answers first, 3 s each: 12 s in order, past the 6 s budget. Cheap checks score the
    # plain-number answers in this process first; the slow ones share the budget and end unscored (nan).
    responses = [f"Answer: ${NESTED_FRAC}$"] * 4 + ["so the answer is \\boxed{42}"] * 20 + ["Answer: 41"] * 4
    with MathRewardScorer(num_workers=1, timeout_s=3.0, mp_context="fork", max_seconds_per_step=6.0) as scorer:
        t0 = time.monotonic()
        scores = scorer(responses, ["42"] * len(responses))
        elapsed = time.monotonic() - t0
    assert scores[4:24] == [1.0] * 20 and scores[24:] == [0.0] * 4
    assert all(math.isnan(x) or x == 0.0 for x in scores[:4])
    assert elapsed < 12, elapsed


def test_slow_answer_costs_at_most_its_own_limit():
    # no step budget: the slow answer is stopped at timeout_s and scores 0.0; the others keep their score
    with MathRewardScorer(num_workers=1, timeout_s=1.0, score_fn=_hang, mp_context="fork") as scorer:
        t0 = time.monotonic()
        assert scorer(["slow", "ok", "ok"], ["1"] * 3) == [0.0, 1.0, 1.0]
        assert time.monotonic() - t0 < 8 and scorer.last_num_timeouts == 1


def test_box_extraction_is_linear_in_the_input():
    from nemo_fp8.rewards.math_reward import extract_answer

    t0 = time.monotonic()
    assert extract_answer("\\boxed{" * 28_000) is None  # quadratic before: minutes
    assert extract_answer("(" * 100_000 + "\\boxed{7}") == "7"
    assert time.monotonic() - t0 < 3


def test_config_default_budget():
    from nemo_fp8.rewards.config import MathEnvConfig

    assert MathEnvConfig().max_seconds_per_step == 60.0 and MathEnvConfig(max_seconds_per_step=None)


def test_inline_scoring_without_a_time_limit_is_refused_by_config():
    from nemo_fp8.config import ConfigError, load_config
    from tests.utils.test_run_safety_units import CONFIG

    with pytest.raises(ConfigError, match=r"env\.math\.num_workers.*timeout_s"):
        load_config(CONFIG, ["env.math.num_workers=0"])


@pytest.mark.parametrize("budget", [1e12, math.inf])
def test_a_budget_longer_than_the_os_can_wait_scores_normally(budget):
    # 1e12 s (or inf, through the API) used to end in OverflowError ("timestamp out of range") once an answer
    # went to the workers: the wait for them was longer than threading.TIMEOUT_MAX.
    with MathRewardScorer(num_workers=1, timeout_s=20.0, score_fn=_hang, mp_context="fork",
                          max_seconds_per_step=budget) as scorer:
        assert scorer(["ok", "ok"], ["1", "1"]) == [1.0, 1.0]
        assert scorer.last_num_over_budget == 0


@pytest.mark.parametrize("key,value", [("max_seconds_per_step", "inf"), ("max_seconds_per_step", ".inf"),
                                       ("max_seconds_per_step", "nan"), ("timeout_s", "inf")])
def test_config_refuses_a_time_limit_that_is_not_finite(key, value):
    from pathlib import Path

    from nemo_fp8.config import ConfigError, load_config

    config = Path(__file__).resolve().parents[2] / "examples" / "configs" / "grpo_math_tiny_fp8.yaml"
    with pytest.raises(ConfigError) as e:
        load_config(config, [f"env.math.{key}={value}"])
    lines = [ln for ln in str(e.value).splitlines() if f"env.math.{key}" in ln]
    assert len(lines) == 1, str(e.value)
    if value != "nan":  # nan fails pydantic's "> 0" first, which names the key too
        assert "finite" in lines[0]
    if key == "max_seconds_per_step" and value != "nan":
        assert "null" in lines[0]  # the way to say "no budget"
