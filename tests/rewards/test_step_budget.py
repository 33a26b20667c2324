"""The reward's step budget: a batch of pathological answers cannot hold a step past it."""

import time

from nemo_fp8.rewards import MathRewardScorer


def _hang(response: str, ground_truth: str) -> float:
    """Picklable: the answer "slow" takes 30 s, anything else scores 1.0 at once."""
    if response == "slow":
        time.sleep(30)
    return 1.0


def test_step_budget_cuts_off_pathological_answers_and_counts_them():
    # per-answer limit 20 s, one worker, 4 hanging answers: 80 s without a step budget.
    with MathRewardScorer(num_workers=1, timeout_s=20.0, score_fn=_hang, mp_context="fork",
                          max_seconds_per_step=1.5) as scorer:
        t0 = time.monotonic()
        scores = scorer(["ok", "slow", "slow", "slow", "slow", "ok"], ["1"] * 6)
        elapsed = time.monotonic() - t0
        assert elapsed < 8, elapsed
        assert scores[0] == 1.0 and scores[1:5] == [0.0] * 4
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


def test_config_default_budget():
    from nemo_fp8.rewards.config import MathEnvConfig

    assert MathEnvConfig().max_seconds_per_step == 60.0 and MathEnvConfig(max_seconds_per_step=None)
