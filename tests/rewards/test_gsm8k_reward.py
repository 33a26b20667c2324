"""The math reward on the real GSM8K test set: every gold solution scores 1.0."""

import json
import time

from nemo_fp8.data import load_math_dataset
from nemo_fp8.rewards import MathRewardScorer, extract_answer
from nemo_fp8.rewards.math_reward import math_verify_equal


def _load(gsm8k_dir):
    path = gsm8k_dir / "test.jsonl"
    solutions = [json.loads(line)["answer"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    examples = load_math_dataset(path, schema="gsm8k")
    assert len(solutions) == len(examples) == 1319
    return solutions, [ex.answer for ex in examples]


def test_gsm8k_gold_and_mismatched_through_scorer(gsm8k_dir):
    solutions, answers = _load(gsm8k_dir)
    start = time.monotonic()
    with MathRewardScorer(num_workers=2, timeout_s=5.0) as scorer:
        gold_scores = scorer(solutions, answers)
        assert scorer.last_num_timeouts == 0
        # gold of problem i+1 against the answer of problem i, where the values differ
        pairs = [(solutions[i + 1], answers[i]) for i in range(len(answers) - 1) if answers[i] != answers[i + 1]]
        assert len(pairs) > 1200
        mismatch_scores = scorer([p[0] for p in pairs], [p[1] for p in pairs])
    elapsed = time.monotonic() - start
    failed = [(i, extract_answer(solutions[i]), answers[i]) for i, s in enumerate(gold_scores) if s != 1.0]
    assert not failed, f"gold solutions scored 0: {failed[:10]}"
    wrong = [p for p, s in zip(pairs, mismatch_scores) if s != 0.0]
    assert not wrong, f"mismatched pairs scored 1: {wrong[:5]}"
    print(f"GSM8K gold + mismatched ({len(solutions)} + {len(pairs)} answers, 2 workers): {elapsed:.2f} s")
    assert elapsed < 60


def test_gsm8k_gold_with_math_verify_only(gsm8k_dir):
    """The same check without the string/decimal shortcuts of verify_answer."""
    solutions, answers = _load(gsm8k_dir)
    bad = [(i, answers[i]) for i, sol in enumerate(solutions) if not math_verify_equal(extract_answer(sol), answers[i])]
    assert not bad, bad[:10]
    wrong = [i for i in range(len(answers) - 1)
             if answers[i] != answers[i + 1] and math_verify_equal(extract_answer(solutions[i + 1]), answers[i])]
    assert not wrong, wrong[:10]
