"""The learning-rate schedule both policy backends follow (``nemo_fp8.policy.schedule``)."""

from __future__ import annotations

import math

import pytest

from nemo_fp8.policy.schedule import schedule_warnings, scheduled_lr, warmup_lr


def test_linear_from_init_to_lr_then_constant():
    # megatron-core's OptimizerParamScheduler: lr at n completed updates = init + (lr - init) * n / W while n <= W
    assert [warmup_lr(n, 1e-4, 4) for n in range(7)] == pytest.approx([0, 2.5e-5, 5e-5, 7.5e-5, 1e-4, 1e-4, 1e-4])
    assert warmup_lr(2, 1e-4, 4, init_lr=2e-5) == pytest.approx(6e-5)
    assert warmup_lr(0, 1e-4, 0) == warmup_lr(10, 1e-4, 0) == 1e-4  # no warm-up


@pytest.mark.parametrize("args", [(-1, 1e-4, 4), (0, 1e-4, -1), (0, 1e-4, 4, 2e-4), (0, 1e-4, 4, -1e-6)])
def test_bad_arguments_are_refused(args):
    with pytest.raises(ValueError):
        warmup_lr(*args)


def _meg_get_lr(n, lr, warmup, init, style, decay_steps, min_lr, wsd_steps=None, wsd_style=None):
    """megatron-core 0.18 ``OptimizerParamScheduler.get_lr`` written out independently of ``scheduled_lr``'s code
    paths: the reference the two backends must agree with."""
    if warmup > 0 and n <= warmup:
        return init + (lr - init) * n / warmup
    if style == "constant":
        return lr
    if n > decay_steps:
        return min_lr
    r = (n - warmup) / (decay_steps - warmup)
    if style == "linear":
        c = 1 - r
    elif style == "cosine":
        c = 0.5 * (math.cos(math.pi * r) + 1)
    else:
        start = decay_steps - wsd_steps
        s = max(0.0, (n - start) / wsd_steps)
        c = {"linear": 1 - s, "cosine": 0.5 * (math.cos(math.pi * s) + 1), "exponential": 2 * 0.5**s - 1,
             "minus_sqrt": 1 - math.sqrt(s)}[wsd_style]
    return min_lr + c * (lr - min_lr)


@pytest.mark.parametrize("style, wsd_style", [("linear", None), ("cosine", None), ("WSD", "linear"), ("WSD", "cosine"),
                                              ("WSD", "exponential"), ("WSD", "minus_sqrt")])
def test_decay_matches_megatron_core(style, wsd_style):
    kw = dict(warmup_steps=3, init_lr=1e-6, decay_style=style, decay_steps=20, min_lr=2e-6, wsd_decay_steps=8,
              wsd_decay_style=wsd_style or "linear")
    got = [scheduled_lr(n, 3e-5, **kw) for n in range(25)]
    want = [_meg_get_lr(n, 3e-5, 3, 1e-6, style, 20, 2e-6, 8, wsd_style or "linear") for n in range(25)]
    assert got == pytest.approx(want, rel=1e-12)
    assert got[3] == pytest.approx(3e-5) and got[20] == pytest.approx(2e-6) and got[24] == 2e-6  # peak, floor, after
    assert all(a >= b for a, b in zip(got[3:], got[4:]))  # never rises after the warm-up


def test_wsd_holds_lr_until_its_last_steps_then_falls_linearly():
    lrs = [scheduled_lr(n, 4e-5, decay_style="WSD", decay_steps=40, wsd_decay_steps=20) for n in range(41)]
    assert lrs[:21] == [4e-5] * 21
    assert lrs[30] == pytest.approx(2e-5) and lrs[39] == pytest.approx(2e-6) and lrs[40] == 0.0


def test_constant_is_the_warmup_schedule():
    assert [scheduled_lr(n, 1e-4, warmup_steps=4, init_lr=1e-5) for n in range(8)] == \
        [warmup_lr(n, 1e-4, 4, 1e-5) for n in range(8)]


@pytest.mark.parametrize("kw, match", [
    (dict(decay_style="linear"), "needs lr_decay_steps"),
    (dict(decay_style="cosine", decay_steps=4, warmup_steps=4), "greater than lr_warmup_steps"),
    (dict(decay_style="linear", decay_steps=10, min_lr=1e-3), "min_lr"),
    (dict(decay_style="WSD", decay_steps=10), "wsd_decay_steps"),
    (dict(decay_style="WSD", decay_steps=10, warmup_steps=4, wsd_decay_steps=7), "fit after the warm-up"),
    (dict(decay_style="WSD", decay_steps=10, wsd_decay_steps=5, wsd_decay_style="step"), "lr_wsd_decay_style"),
    (dict(decay_style="exp"), "lr_decay_style"),
])
def test_bad_decay_settings_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        scheduled_lr(0, 1e-4, **kw)


def test_schedules_a_run_never_reaches_are_warned_with_the_numbers(tmp_path):
    from pathlib import Path

    from nemo_fp8.config import load_config
    from nemo_fp8.preflight import schedule_warnings

    config = Path(__file__).resolve().parents[2] / "examples" / "configs" / "grpo_math_tiny_fp8.yaml"

    def warnings(*overrides):
        return schedule_warnings(load_config(config, [f"logger.log_dir={tmp_path}", *overrides]))

    assert warnings() == []  # the shipped recipe: 60 steps x 1 update, WSD over updates 40-60
    # the shipped WSD decay with a shorter run: it starts at update 40, after the 30th
    (w,) = warnings("grpo.max_num_steps=30")
    assert w.startswith("policy.optimizer.lr_decay_steps=60") and "starts at update 40" in w and "never decays" in w
    # a decay that starts but does not end: the rate of the last update is given
    (w,) = warnings("grpo.max_num_steps=50")
    assert "past the run's last update" in w and "learning rate 1.65e-05" in w, w
    # a warm-up longer than the run (lr 0, then 3e-8 in the probe)
    (w,) = warnings("grpo.max_num_steps=2", "policy.optimizer.lr_decay_style=constant",
                    "policy.optimizer.lr_warmup_steps=1000")
    assert w.startswith("policy.optimizer.lr_warmup_steps=1000 is longer than the run") and "3e-08" in w, w
    assert warnings("policy.optimizer.lr_decay_style=constant") == []


def test_schedule_warnings_units():
    assert schedule_warnings(10, 1e-3) == []
    assert schedule_warnings(10, 1e-3, decay_style="cosine", decay_steps=10) == []
    (w,) = schedule_warnings(4, 1e-3, decay_style="linear", decay_steps=8, min_lr=0.0)
    assert "lr_decay_steps=8" in w and f"{scheduled_lr(3, 1e-3, decay_style='linear', decay_steps=8):.3g}" in w
    assert schedule_warnings(4, 1e-3, decay_style="linear", decay_steps=None) == []  # an error, not a warning
