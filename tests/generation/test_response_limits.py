"""Long-tailed per-request response limits (``policy.generation.response_limits``): the draws and the config."""

import statistics

import pytest

from nemo_fp8.algorithms.grpo import step_sampling
from nemo_fp8.generation.interfaces import ResponseLimits, SamplingParams, request_max_new_tokens, request_seed


def test_limits_are_lognormal_draws_clamped_to_their_bounds():
    lim = ResponseLimits(median_tokens=512, sigma=1.0, min_tokens=256)
    draws = [lim.limit(request_seed(7, i), 4096) for i in range(4000)]
    assert min(draws) == 256 and max(draws) == 4096  # both clamps reached
    assert 460 <= statistics.median(draws) <= 570  # the lognormal's median, 512
    # the tail: P(draw > 4096) = P(z > ln 8) = 1.9%; P(draw > 2048) = P(z > ln 4) = 8.3%
    assert 0.01 <= sum(d == 4096 for d in draws) / len(draws) <= 0.03
    assert 0.065 <= sum(d > 2048 for d in draws) / len(draws) <= 0.10
    assert draws == [lim.limit(request_seed(7, i), 4096) for i in range(4000)]  # a request's seed fixes its limit


def test_each_request_gets_the_limit_of_its_seed():
    lim = ResponseLimits(median_tokens=64, sigma=0.8, min_tokens=8)
    sampling = SamplingParams(max_new_tokens=256, seed=11, response_limits=lim)
    one_engine = request_max_new_tokens(sampling, 6)
    # a data-parallel group hands each engine its rows with their global seeds: the same limits, in any split
    rows = [4, 1, 5]
    assert request_max_new_tokens(sampling, 3, [request_seed(11, r) for r in rows]) == [one_engine[r] for r in rows]
    assert len(set(one_engine)) > 1 and all(8 <= n <= 256 for n in one_engine)
    assert request_max_new_tokens(SamplingParams(max_new_tokens=256, seed=11), 3) == [256, 256, 256]
    with pytest.raises(ValueError, match="2 request_seeds for 3 requests"):
        request_max_new_tokens(sampling, 3, [1, 2])


def test_the_config_key_reaches_the_rollouts_not_validation(tiny_cfg):
    cfg = tiny_cfg("policy.generation.max_new_tokens=32", "policy.generation.response_limits.median_tokens=8",
                   "policy.generation.response_limits.sigma=1.5", "policy.generation.response_limits.min_tokens=2")
    s = step_sampling(cfg, step=3, round_idx=0)
    assert s.response_limits == ResponseLimits(median_tokens=8, sigma=1.5, min_tokens=2)
    assert step_sampling(tiny_cfg(), step=3, round_idx=0).response_limits is None


@pytest.mark.parametrize("override, key", [
    ("policy.generation.response_limits.median_tokens=64", "median_tokens=64 <= max_new_tokens=32"),
    ("policy.generation.response_limits.min_tokens=16", "min_tokens=16 <= median_tokens=8"),
])
def test_impossible_limits_are_refused_by_name(tiny_cfg, override, key):
    with pytest.raises(Exception, match="response_limits") as err:
        tiny_cfg("policy.generation.max_new_tokens=32", "policy.generation.response_limits.median_tokens=8", override)
    assert key.split(" <= ")[0] in str(err.value)
