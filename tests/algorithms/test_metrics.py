"""Hand-computed checks for nemo_fp8.algorithms.metrics and nemo_fp8.utils.metrics."""

import math
import pickle
import random

import pytest
import torch

from nemo_fp8.algorithms.loss import ClippedPGLossConfig, ClippedPGLossFn, clipped_pg_loss
from nemo_fp8.algorithms.metrics import LOSS_METRIC_REDUCTIONS, masked_mean, masked_sum, mismatch_metrics
from nemo_fp8.utils.metrics import REDUCTION_KINDS, MetricAccumulator

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


# --------------------------------------------------------------------------- #
# MetricAccumulator / LOSS_METRIC_REDUCTIONS
# --------------------------------------------------------------------------- #

RED = {"s": "sum", "tm": "token_mean", "sm": "seq_mean", "lo": "min", "hi": "max",
       "num_valid_tokens": "sum", "num_valid_seqs": "sum"}


def mb(s, tm, sm, lo, hi, ntok, nseq):
    return {k: torch.tensor(float(v)) for k, v in
            dict(s=s, tm=tm, sm=sm, lo=lo, hi=hi, num_valid_tokens=ntok, num_valid_seqs=nseq).items()}


def test_accumulator_by_hand():
    acc = MetricAccumulator(RED)
    acc.add(mb(1.0, 0.5, 1.0, -2.0, 3.0, ntok=2, nseq=1))
    acc.add(mb(2.0, 0.2, 0.0, -1.0, 9.0, ntok=3, nseq=2))
    # an all-masked micro-batch: its (arbitrary, even nan/inf) means and min/max are ignored
    acc.add(mb(0.0, float("nan"), float("inf"), -100.0, 100.0, ntok=0, nseq=0))
    out = acc.result()
    assert out == pytest.approx({"s": 3.0, "tm": (0.5 * 2 + 0.2 * 3) / 5, "sm": 1 / 3, "lo": -2.0, "hi": 9.0,
                                 "num_valid_tokens": 5.0, "num_valid_seqs": 3.0})
    assert list(out) == list(RED)  # reductions order


def test_accumulator_empty_and_zero_weight_give_zero():
    assert MetricAccumulator(RED).result() == {}
    acc = MetricAccumulator(RED)
    acc.add(mb(0.0, 0.7, 0.7, -5.0, 5.0, ntok=0, nseq=0))
    assert acc.result() == {k: 0.0 for k in RED}
    # a metric never added is absent; python numbers are accepted
    acc = MetricAccumulator(RED)
    acc.add({"s": 1.5})
    assert acc.result() == {"s": 1.5}


def test_accumulator_errors():
    with pytest.raises(ValueError, match="'x'.*median"):
        MetricAccumulator({"x": "median"})
    acc = MetricAccumulator(RED)
    with pytest.raises(ValueError, match="unknown_metric"):
        acc.add({"unknown_metric": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="num_valid_tokens"):
        acc.add({"tm": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="scalar"):
        acc.add({"s": torch.ones(2)})
    with pytest.raises(ValueError, match="different reductions"):
        acc.merge(MetricAccumulator({"s": "sum"}))
    assert set(REDUCTION_KINDS) == {"sum", "token_mean", "seq_mean", "min", "max"}


def _loss_micro_batches(seed=0, n=7):
    """Per-micro-batch metrics of clipped_pg_loss (every option on) + the full-batch metrics."""
    g = torch.Generator().manual_seed(seed)
    B, T = 3 * n, 6
    prev = -torch.rand(B, T, generator=g) * 3
    lp = prev + torch.randn(B, T, generator=g) * 0.3
    gen = prev + torch.randn(B, T, generator=g) * 0.3
    ref = prev + torch.randn(B, T, generator=g) * 0.3
    adv = torch.randn(B, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.4).float()
    mask[3:6] = 0.0  # one micro-batch with no valid token at all
    mask[7] = 0.0
    cfg = ClippedPGLossConfig(ratio_clip_max=0.28, ratio_clip_c=3.0, reference_policy_kl_penalty=0.05,
                              use_importance_sampling_correction=True, truncated_importance_sampling_type="icepop",
                              truncated_importance_sampling_ratio=1.3, truncated_importance_sampling_ratio_min=0.8)
    n_tok, n_seq = mask.sum(), (mask.sum(-1) > 0).sum()
    parts = []
    for i in range(n):
        s = slice(3 * i, 3 * i + 3)
        _, m = clipped_pg_loss(lp[s], prev[s], gen[s], adv[s], mask[s], cfg, reference_logprobs=ref[s],
                               global_valid_tokens=n_tok, global_valid_seqs=n_seq)
        parts.append(m)
    _, full = clipped_pg_loss(lp, prev, gen, adv, mask, cfg, reference_logprobs=ref)
    return parts, {k: v.item() for k, v in full.items()}


def test_loss_metric_reductions_reproduce_full_batch_metrics():
    # Every metric, accumulated over micro-batches with LOSS_METRIC_REDUCTIONS, equals the metric
    # of one call on the whole batch: this checks the reduction kind chosen for each metric.
    parts, full = _loss_micro_batches()
    acc = MetricAccumulator(ClippedPGLossFn(ClippedPGLossConfig()).metric_reductions)
    for m in parts:
        acc.add(m)
    out = acc.result()
    assert set(out) == set(full) == set(LOSS_METRIC_REDUCTIONS)
    for k in full:
        assert out[k] == pytest.approx(full[k], rel=1e-5, abs=1e-6), k
    assert 0 < out["is_frac_seqs_masked"] < 1 and 0 < out["clip_fraction"] < 1  # non-trivial case


@pytest.mark.parametrize("seed", range(5))
def test_merge_of_any_split_equals_one_accumulator(seed):
    parts, _ = _loss_micro_batches(seed=seed)
    one = MetricAccumulator(LOSS_METRIC_REDUCTIONS)
    for m in parts:
        one.add(m)
    expected = one.result()
    rng = random.Random(seed)
    order = list(range(len(parts)))
    rng.shuffle(order)
    cuts = sorted(rng.sample(range(1, len(parts)), 3))
    groups = [order[a:b] for a, b in zip([0] + cuts, cuts + [len(parts)])] + [[]]  # plus an empty rank
    accs = []
    for grp in groups:
        a = MetricAccumulator(LOSS_METRIC_REDUCTIONS)
        for i in grp:
            a.add(parts[i])
        accs.append(pickle.loads(pickle.dumps(a.cpu())))  # as a data-parallel rank would send it
    merged = accs[-1]
    for a in accs[:-1]:
        merged = merged.merge(a)
    out = merged.result()
    assert set(out) == set(expected)
    for k in expected:
        assert out[k] == pytest.approx(expected[k], rel=1e-12, abs=1e-12), k
    # merge does not change its operands
    assert accs[0].result() == accs[0].result()
    before = accs[1].result()
    accs[1].merge(accs[2])
    assert accs[1].result() == before
