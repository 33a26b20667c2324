"""Hand-computed checks for nemo_fp8.algorithms.metrics."""

import math

import pytest
import torch

from nemo_fp8.algorithms.metrics import masked_mean, masked_sum, mismatch_metrics

LN2 = math.log(2.0)


def test_masked_sum_and_mean_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    assert masked_sum(x, mask).item() == pytest.approx(4.0)
    assert masked_mean(x, mask).item() == pytest.approx(2.0)
    torch.testing.assert_close(masked_sum(x, mask, dim=-1), torch.tensor([4.0, 0.0]))
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), torch.tensor([2.0, 0.0]))
    torch.testing.assert_close(masked_mean(x, mask, dim=0), torch.tensor([1.0, 0.0, 3.0]))
    # bool masks work the same
    assert masked_mean(x, mask.bool()).item() == pytest.approx(2.0)


def test_masked_mean_all_zero_mask_is_zero_not_nan():
    x = torch.tensor([[1.0, 2.0]], requires_grad=True)
    mask = torch.zeros(1, 2)
    out = masked_mean(x, mask)
    assert out.item() == 0.0
    out.backward()
    torch.testing.assert_close(x.grad, torch.zeros(1, 2))
    assert masked_sum(x, mask).item() == 0.0


def test_masked_reductions_ignore_inf_nan_at_masked_positions():
    x = torch.tensor([[1.0, float("inf"), float("nan"), 3.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    out = masked_mean(x, mask)
    assert out.item() == pytest.approx(2.0)
    out.backward()
    torch.testing.assert_close(x.grad, torch.tensor([[0.5, 0.0, 0.0, 0.5]]))


def test_masked_mean_shape_error():
    with pytest.raises(ValueError, match="mask shape"):
        masked_mean(torch.zeros(2, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match="mask shape"):
        masked_mean(torch.zeros(3), torch.ones(2, 3))


def _case():
    # valid tokens: log r = prev - gen = [ln 2, -ln 2] -> r = [2, 0.5]; third token masked.
    gen = torch.tensor([[-1.0, -2.0, -3.0]])
    prev = torch.tensor([[-1.0 + LN2, -2.0 - LN2, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    return prev, gen, mask


def test_mismatch_metrics_by_hand():
    prev, gen, mask = _case()
    m = mismatch_metrics(prev, gen, mask)
    # k3: (2 - 1 - ln2 + 0.5 - 1 + ln2) / 2 = 0.25
    assert m["gen_kl_error"] == pytest.approx(0.25, abs=1e-6)
    # NeMo-RL policy_kl: k3 with ratio 1/r: (0.5 - 1 + ln2 + 2 - 1 - ln2) / 2 = 0.25
    assert m["policy_kl_error"] == pytest.approx(0.25, abs=1e-6)
    # r log r: (2 ln2 - 0.5 ln2) / 2 = 0.75 ln2
    assert m["policy_kl_error_is"] == pytest.approx(0.75 * LN2, abs=1e-6)
    # exp(|ln 2|) = 2 on both tokens
    assert m["token_mult_prob_error"] == pytest.approx(2.0, abs=1e-6)
    # (2-1)^2 = 1, (0.5-1)^2 = 0.25 -> 0.625
    assert m["chi2_token"] == pytest.approx(0.625, abs=1e-6)
    # one sequence: mean gen = -1.5 = mean prev
    assert m["log_ppl_diff"] == pytest.approx(0.0, abs=1e-6)
    assert m["num_valid_tokens"] == 2.0
    assert all(isinstance(v, float) for v in m.values())


def test_js_divergence_by_hand():
    # p_train = 0.5, p_gen = 0.25 -> m = 0.375
    prev = torch.tensor([[math.log(0.5)]])
    gen = torch.tensor([[math.log(0.25)]])
    m = mismatch_metrics(prev, gen, torch.ones(1, 1))
    a, b = math.log(0.5 / 0.375), math.log(0.25 / 0.375)  # ln(4/3), ln(2/3)
    expected = 0.5 * (4 / 3 - 1 - a) + 0.5 * (2 / 3 - 1 - b)  # = 0.058892
    assert expected == pytest.approx(0.058892, abs=1e-6)
    assert m["js_divergence_error"] == pytest.approx(expected, abs=1e-6)


def test_log_ppl_diff_is_per_sequence_mean():
    # row0: mean gen -1, mean prev -2 -> +1 ; row1 (one token): gen -3, prev -1 -> -2
    gen = torch.tensor([[-1.0, -1.0, 0.0], [-3.0, 0.0, 0.0]])
    prev = torch.tensor([[-2.0, -2.0, 0.0], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    m = mismatch_metrics(prev, gen, mask)
    assert m["log_ppl_diff"] == pytest.approx(-0.5, abs=1e-6)  # token-pooled would be 0


def test_identical_logprobs_give_perfect_scores():
    lp = torch.tensor([[-0.3, -1.2, -4.0]])
    m = mismatch_metrics(lp, lp.clone(), torch.ones(1, 3))
    for key in ("gen_kl_error", "policy_kl_error", "policy_kl_error_is", "js_divergence_error",
                "log_ppl_diff", "chi2_token"):
        assert m[key] == pytest.approx(0.0, abs=1e-7), key
    assert m["token_mult_prob_error"] == pytest.approx(1.0)


def test_mismatch_metrics_empty_mask_and_masked_garbage():
    prev, gen, mask = _case()
    m0 = mismatch_metrics(prev, gen, torch.zeros_like(mask))
    assert all(v == 0.0 for v in m0.values())
    prev2 = prev.clone()
    prev2[0, 2] = float("inf")
    gen2 = gen.clone()
    gen2[0, 2] = float("nan")
    assert mismatch_metrics(prev2, gen2, mask) == mismatch_metrics(prev, gen, mask)


def test_mismatch_metrics_clamps_huge_log_ratios():
    prev = torch.tensor([[0.0]])
    gen = torch.tensor([[-1000.0]])
    m = mismatch_metrics(prev, gen, torch.ones(1, 1))
    assert all(math.isfinite(v) for v in m.values())
    # log r clamped to 20: k3 = e^20 - 21
    assert m["gen_kl_error"] == pytest.approx(math.exp(20) - 21, rel=1e-5)


def test_mismatch_metrics_shape_error():
    with pytest.raises(ValueError, match="generation_logprobs"):
        mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="token_mask"):
        mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3))
