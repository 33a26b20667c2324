"""Unit tests for answer extraction, verification and the parallel scorer."""

import threading
import time

import pytest

from nemo_fp8.rewards import MathRewardScorer, extract_answer, score_response, verify_answer


def _slow_score(response: str, ground_truth: str) -> float:
    """A picklable score function that hangs on the response "slow"."""
    if response == "slow":
        time.sleep(60)
    return 1.0


def _failing_score(response: str, ground_truth: str) -> float:
    raise RuntimeError("boom")


# ---------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the result is 5.\nAnswer: 42", "42"),
        ("Answer: $42$", "42"),
        ("answer:   -7 ", "-7"),
        ("ANSWER: \\frac{3}{4}.", "\\frac{3}{4}"),
        ("**Answer:** 12", "12"),
        ("Final Answer: $\\boxed{9}$", "9"),
        ("Answer: 1\nwait, no.\nAnswer: 2", "2"),
        ("Answer: \\(x+1\\)", "x+1"),
    ],
)
def test_extract_answer_lines(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is \\boxed{5}.", "5"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),
        ("\\boxed{ {a}_{1} }", "{a}_{1}"),
        ("\\fbox{-3}", "-3"),
        ("\\boxed {7}", "7"),
        ("\\boxed{4} and a truncated \\boxed{\\frac{1}{", "4"),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_answer(text) == expected


def test_extract_gsm8k_and_none():
    assert extract_answer("3 + 4 = <<3+4=7>>7\n#### 7") == "7"
    assert extract_answer("#### -1,250") == "-1,250"
    assert extract_answer("no final answer here") is None
    assert extract_answer("") is None
    assert extract_answer("\\boxed{}") is None


def test_extract_last_marker_by_position_wins():
    # Was "Answer: beats \boxed beats #### regardless of position": a mid-text "answer:" phrase
    # then hid the final box. Now the last marker by position wins, whatever its kind.
    assert extract_answer("Answer: 1\n\\boxed{2}\n#### 3") == "3"
    assert extract_answer("#### 3\n\\boxed{2}") == "2"
    assert extract_answer("\\boxed{2}\n#### 3") == "3"
    assert extract_answer("\\boxed{2}\nAnswer: 3") == "3"  # answer phrase after boxed
    assert extract_answer("Answer: 3\nso \\boxed{2}") == "2"  # boxed after answer phrase
    # An empty Answer: line is not a marker.
    assert extract_answer("\\boxed{2}\nAnswer:") == "2"


@pytest.mark.parametrize(
    "text, expected",
    [
        # worked solutions that say "answer:" mid-text before their final box (the reported bug)
        (
            "Multiply: 17 * 44 = 748. Let's check our answer: $17 \\cdot 44 = 748$, and "
            "748 / 17 = 44.\nSo the number is \\boxed{44}.",
            "44",
        ),
        (
            "First we solve the small case and we get our answer:\n\\[ x = \\boxed{1} \\]\n"
            "Scaling up, the answer to the problem is \\boxed{44}.",
            "44",
        ),
        ("we get our answer: \\[ x = \\boxed{1} \\] and finally \\boxed{44}", "44"),
        # nested braces, multiple boxes
        ("\\boxed{1}, \\boxed{2}, then \\boxed{\\frac{\\sqrt{3}}{\\sqrt{2}}}", "\\frac{\\sqrt{3}}{\\sqrt{2}}"),
        ("\\boxed{\\text{x = \\boxed{7}}}", "7"),
        # the DAPO last-line format still wins when it is last
        ("so the value is \\boxed{12}.\n\nAnswer: 12", "12"),
        ("I think \\boxed{11} is wrong.\nAnswer: $\\boxed{12}$", "12"),
    ],
)
def test_extract_answer_mid_text_answer_phrase(text, expected):
    assert extract_answer(text) == expected


def test_score_response_final_box_after_answer_phrase():
    text = "Let's check our answer: $17 \\cdot 44 = 748$. Therefore \\boxed{44}."
    assert score_response(text, "44") == 1.0


# ---------------------------------------------------------------- verification


@pytest.mark.parametrize(
    "pred, gold",
    [
        ("1000", "1000"),
        ("1,000", "1000"),
        ("1000", "1,000"),
        ("18.0", "18"),
        ("0.5", "\\frac{1}{2}"),
        ("\\frac{1}{2}", "0.5"),
        ("1/2", "\\frac{1}{2}"),
        ("-3", "-3"),
        ("\\dfrac{3}{4}", "0.75"),
        ("$10", "10"),
        ("x^2 + 1", "1 + x^2"),
        ("2\\sqrt{2}", "\\sqrt{8}"),
    ],
)
def test_verify_equal(pred, gold):
    assert verify_answer(pred, gold)


@pytest.mark.parametrize(
    "pred, gold",
    [
        ("3", "-3"),
        ("18", "81"),
        ("2", "2,000"),
        ("0.5", "\\frac{1}{3}"),
        ("", "5"),
        ("abc", "5"),
        ("5", ""),
    ],
)
def test_verify_not_equal(pred, gold):
    assert not verify_answer(pred, gold)


def test_score_response():
    assert score_response("We get 6 * 7 = 42.\nAnswer: 42", "42") == 1.0
    assert score_response("The result is \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert score_response("#### -4", "-4") == 1.0
    assert score_response("Answer: 41", "42") == 0.0
    assert score_response("I think it is 42", "42") == 0.0  # nothing to extract


# ---------------------------------------------------------------- scorer


def test_scorer_inline_and_pool_agree():
    responses = ["Answer: 42", "\\boxed{0.5}", "#### 7", "nothing", "Answer: 3"]
    truths = ["42", "\\frac{1}{2}", "7", "1", "-3"]
    expected = [1.0, 1.0, 1.0, 0.0, 0.0]
    assert MathRewardScorer(num_workers=0)(responses, truths) == expected
    with MathRewardScorer(num_workers=2) as scorer:
        assert scorer(responses, truths) == expected
        assert scorer([], []) == []


def test_scorer_length_mismatch():
    with MathRewardScorer(num_workers=0) as scorer:
        with pytest.raises(ValueError, match="length"):
            scorer(["a", "b"], ["a"])


def test_scorer_bad_args():
    with pytest.raises(ValueError):
        MathRewardScorer(num_workers=-1)
    with pytest.raises(ValueError):
        MathRewardScorer(timeout_s=0)


def test_scorer_timeout_scores_zero(caplog):
    with MathRewardScorer(num_workers=2, timeout_s=1.0, score_fn=_slow_score) as scorer:
        start = time.monotonic()
        with caplog.at_level("WARNING"):
            scores = scorer(["fast", "slow", "fast", "fast"], ["1", "1", "1", "1"])
        elapsed = time.monotonic() - start
        assert scores == [1.0, 0.0, 1.0, 1.0]
        assert scorer.last_num_timeouts == 1
        assert elapsed < 15, f"timeout did not fire promptly ({elapsed:.1f} s)"
        assert "timed out" in caplog.text
        # the killed worker is replaced: the pool still works
        assert scorer(["fast"] * 3, ["1"] * 3) == [1.0, 1.0, 1.0]


def test_scorer_error_scores_zero():
    with MathRewardScorer(num_workers=1, score_fn=_failing_score) as scorer:
        assert scorer(["x", "y"], ["1", "2"]) == [0.0, 0.0]
        assert scorer.last_num_errors == 2


def test_scorer_from_non_main_thread():
    results = {}

    def work():
        try:
            with MathRewardScorer(num_workers=2, timeout_s=1.0) as scorer:
                results["real"] = scorer(["Answer: 12", "\\boxed{\\frac{2}{4}}"], ["12", "0.5"])
            with MathRewardScorer(num_workers=1, timeout_s=1.0, score_fn=_slow_score) as scorer:
                results["slow"] = scorer(["slow", "fast"], ["1", "1"])
        except BaseException as e:  # surface in the main thread
            results["error"] = e

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "scorer hung in a non-main thread"
    assert "error" not in results, results.get("error")
    assert results["real"] == [1.0, 1.0]
    assert results["slow"] == [0.0, 1.0]


def test_scorer_close_is_idempotent():
    scorer = MathRewardScorer(num_workers=1)
    assert scorer(["Answer: 1"], ["1"]) == [1.0]
    scorer.close()
    scorer.close()
    # a closed scorer starts a new pool when used again
    assert scorer(["Answer: 2"], ["2"]) == [1.0]
    scorer.close()
