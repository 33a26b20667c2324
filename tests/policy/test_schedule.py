"""The learning-rate warm-up both policy backends follow (``nemo_fp8.policy.schedule``)."""

from __future__ import annotations

import pytest

from nemo_fp8.policy.schedule import warmup_lr


def test_linear_from_init_to_lr_then_constant():
    # megatron-core's OptimizerParamScheduler: lr at n completed updates = init + (lr - init) * n / W while n <= W
    assert [warmup_lr(n, 1e-4, 4) for n in range(7)] == pytest.approx([0, 2.5e-5, 5e-5, 7.5e-5, 1e-4, 1e-4, 1e-4])
    assert warmup_lr(2, 1e-4, 4, init_lr=2e-5) == pytest.approx(6e-5)
    assert warmup_lr(0, 1e-4, 0) == warmup_lr(10, 1e-4, 0) == 1e-4  # no warm-up


@pytest.mark.parametrize("args", [(-1, 1e-4, 4), (0, 1e-4, -1), (0, 1e-4, 4, 2e-4), (0, 1e-4, 4, -1e-6)])
def test_bad_arguments_are_refused(args):
    with pytest.raises(ValueError):
        warmup_lr(*args)
