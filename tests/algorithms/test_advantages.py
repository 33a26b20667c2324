"""Hand-computed checks for nemo_fp8.algorithms.advantages."""

import pytest
import torch

from nemo_fp8.algorithms.advantages import (
    dynamic_sampling_keep_mask,
    grpo_advantages,
    overlong_penalty,
)

# group [1, 0, 0, 0]: mean 0.25, unbiased std sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5
R = torch.tensor([1.0, 0.0, 0.0, 0.0])


def _close(a, b, tol=1e-5):
    torch.testing.assert_close(a, torch.tensor(b, dtype=torch.float32), atol=tol, rtol=0)


def test_mean_baseline_without_std():
    _close(grpo_advantages(R, 4, "mean", normalize_std=False), [0.75, -0.25, -0.25, -0.25])


def test_mean_baseline_with_unbiased_std():
    _close(grpo_advantages(R, 4, "mean", normalize_std=True), [1.5, -0.5, -0.5, -0.5])


def test_leave_one_out_without_std():
    # b_i = (1 - r_i) / 3 -> [0, 1/3, 1/3, 1/3]
    _close(grpo_advantages(R, 4, "leave_one_out", normalize_std=False), [1.0, -1 / 3, -1 / 3, -1 / 3])


def test_leave_one_out_with_group_std():
    _close(grpo_advantages(R, 4, "leave_one_out", normalize_std=True), [2.0, -2 / 3, -2 / 3, -2 / 3])


@pytest.mark.parametrize("baseline", ["mean", "leave_one_out"])
@pytest.mark.parametrize("normalize_std", [True, False])
def test_zero_std_group_gives_zeros_and_groups_are_independent(baseline, normalize_std):
    # group0 constant -> 0; group1 [0, 1, 2]: mean 1, unbiased std 1; LOO b = [1.5, 1, 0.5]
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 2.0])
    adv = grpo_advantages(rewards, 3, baseline, normalize_std=normalize_std)
    second = [-1.0, 0.0, 1.0] if baseline == "mean" else [-1.5, 0.0, 1.5]
    _close(adv, [0.0, 0.0, 0.0] + second)
    assert not torch.isnan(adv).any()
    assert adv.dtype == torch.float32


def test_group_size_one_is_zero_not_nan():
    adv = grpo_advantages(torch.tensor([3.0, -1.0]), 1, "mean", normalize_std=True)
    _close(adv, [0.0, 0.0])


def test_integer_rewards_are_accepted():
    _close(grpo_advantages(torch.tensor([1, 0, 0, 0]), 4, normalize_std=False), [0.75, -0.25, -0.25, -0.25])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rewards=torch.zeros(5), group_size=2), "multiple of group_size"),
        (dict(rewards=torch.zeros(4), group_size=0), "group_size"),
        (dict(rewards=torch.zeros(4), group_size=1, baseline="leave_one_out"), "group_size >= 2"),
        (dict(rewards=torch.zeros(4), group_size=2, baseline="median"), "baseline"),
        (dict(rewards=torch.zeros(2, 2), group_size=2), "1-D"),
        (dict(rewards=torch.zeros(4), group_size=2, eps=0.0), "eps"),
    ],
)
def test_grpo_advantages_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        grpo_advantages(**kwargs)


def test_dynamic_sampling_keep_mask():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    keep = dynamic_sampling_keep_mask(rewards, 4)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [True] * 4 + [False] * 8
    assert dynamic_sampling_keep_mask(torch.tensor([1.0, 2.0]), 1).tolist() == [False, False]
    with pytest.raises(ValueError, match="multiple of group_size"):
        dynamic_sampling_keep_mask(torch.zeros(5), 4)


def test_overlong_penalty_by_hand():
    # L_max = 20, L_cache = 4 -> ramp starts after 16; p = 0.5
    lengths = torch.tensor([10, 16, 17, 18, 20, 21, 100])
    out = overlong_penalty(lengths, 20, 4, penalty_factor=0.5)
    _close(out, [0.0, 0.0, -0.125, -0.25, -0.5, -0.5, -0.5])
    assert out.dtype == torch.float32


def test_overlong_penalty_default_factor_and_zero_buffer():
    _close(overlong_penalty(torch.tensor([19, 20]), 20, 2), [-0.5, -1.0])
    _close(overlong_penalty(torch.tensor([20, 21]), 20, 0, penalty_factor=2.0), [0.0, -2.0])


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.tensor([1]), 10, 11), "overlong_buffer_length"),
        ((torch.tensor([1]), 0, 0), "max_response_length"),
        ((torch.tensor([-1]), 10, 2), "response_lengths"),
        ((torch.tensor([[1]]), 10, 2), "response_lengths"),
    ],
)
def test_overlong_penalty_errors(args, match):
    with pytest.raises(ValueError, match=match):
        overlong_penalty(*args)


@pytest.mark.parametrize("value", [0.3, 0.7, 1 / 3, 5.3, -2.1, 0.0, 1.0, 1e-7, 123456.789])
@pytest.mark.parametrize("group_size", [2, 3, 5, 7, 16, 33, 64])
@pytest.mark.parametrize("baseline", ["mean", "leave_one_out"])
@pytest.mark.parametrize("normalize_std", [True, False])
def test_equal_rewards_give_exactly_zero_advantage(value, group_size, baseline, normalize_std):
    # float32(0.3) * G summed and divided by G is not float32(0.3): the old code turned that
    # rounding residue (~1e-8) over a std of the same order into advantages up to 0.48.
    # group 1 is constant, group 0 is not (its values must still be normalised as usual).
    varied = torch.arange(group_size, dtype=torch.float32)
    rewards = torch.cat([varied, torch.full((group_size,), value)])
    adv = grpo_advantages(rewards, group_size, baseline, normalize_std=normalize_std)
    assert (adv[group_size:] == 0).all(), adv[group_size:]
    expected = grpo_advantages(varied, group_size, baseline, normalize_std=normalize_std)
    torch.testing.assert_close(adv[:group_size], expected)
    assert adv[:group_size].abs().max() > 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_equal_rewards_exact_zero_other_dtypes(dtype):
    rewards = torch.full((12,), 0.3, dtype=dtype)
    assert (grpo_advantages(rewards, 6, "mean") == 0).all()
    assert (grpo_advantages(rewards, 4, "leave_one_out") == 0).all()
