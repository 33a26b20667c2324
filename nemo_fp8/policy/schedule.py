"""The learning-rate schedule both policy backends follow: a linear warm-up, then constant or a decay.

The megatron backend gets it from megatron-core's ``OptimizerParamScheduler`` (``init_lr``,
``lr_warmup_steps``, ``lr_decay_style``, ``lr_decay_steps``, ``min_lr``, ``wsd_decay_steps``,
``lr_wsd_decay_style``: ``settings.scheduler_kwargs``); the torch reference backend sets each update's
learning rate with :func:`scheduled_lr`, the same formulas, so the two backends train with the same
learning rates (and a resumed run picks the schedule up where it was).
"""

from __future__ import annotations

import math
from typing import Optional

LR_DECAY_STYLES = ("constant", "linear", "cosine", "WSD")
LR_WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


def warmup_lr(num_updates: int, lr: float, warmup_steps: int, init_lr: float = 0.0) -> float:
    """Learning rate of the optimizer update that follows ``num_updates`` completed ones.

    Linear from ``init_lr`` (at 0 completed updates) to ``lr`` (at ``warmup_steps``), then ``lr``:
    megatron-core's ``OptimizerParamScheduler.get_lr`` with ``lr_decay_style="constant"``
    (``init_lr + (lr - init_lr) * num_updates / warmup_steps`` while ``num_updates <= warmup_steps``).

    Args:
        num_updates: optimizer updates completed so far (>= 0).
        lr: the learning rate after the warm-up.
        warmup_steps: updates of linear warm-up; 0: ``lr`` from the first update.
        init_lr: the warm-up's starting learning rate (0 <= init_lr <= lr).

    Raises:
        ValueError: a negative ``num_updates`` or ``warmup_steps``, or ``init_lr`` outside [0, lr].
    """
    if num_updates < 0 or warmup_steps < 0:
        raise ValueError(f"warmup_lr: num_updates ({num_updates}) and warmup_steps ({warmup_steps}) must be >= 0")
    if not 0.0 <= init_lr <= lr:
        raise ValueError(f"warmup_lr: init_lr must be in [0, lr={lr}], got {init_lr}")
    if warmup_steps > 0 and num_updates <= warmup_steps:
        return init_lr + (lr - init_lr) * num_updates / warmup_steps
    return lr


def schedule_errors(lr: float, init_lr: float, warmup_steps: int, decay_style: str, decay_steps: Optional[int],
                    min_lr: float, wsd_decay_steps: Optional[int], wsd_decay_style: str) -> list[str]:
    """What is wrong with a schedule's settings, named by their config keys (``policy.optimizer`` /
    ``policy.megatron_cfg.optimizer``); empty when :func:`scheduled_lr` and megatron-core's
    ``OptimizerParamScheduler`` (whose asserts these mirror) accept them."""
    errs = []
    if init_lr > lr:
        errs.append(f"lr_warmup_init={init_lr:g} must not exceed lr={lr:g} (the warm-up rises from lr_warmup_init to lr)")
    if decay_style not in LR_DECAY_STYLES:
        errs.append(f"lr_decay_style={decay_style!r}; valid: {', '.join(LR_DECAY_STYLES)}")
        return errs
    if decay_style == "constant":
        return errs
    if not 0.0 <= min_lr <= lr:
        errs.append(f"min_lr={min_lr:g} must be in [0, lr={lr:g}] (the decay falls from lr to min_lr)")
    if decay_steps is None or decay_steps <= warmup_steps:
        errs.append(f"lr_decay_style={decay_style!r} needs lr_decay_steps (the update at which the learning rate "
                    f"reaches min_lr, e.g. grpo.max_num_steps x optimizer updates per step) greater than "
                    f"lr_warmup_steps={warmup_steps}; got {decay_steps}")
    if decay_style == "WSD":
        if wsd_decay_steps is None or wsd_decay_steps < 1:
            errs.append(f"lr_decay_style='WSD' needs wsd_decay_steps >= 1 (the last updates before lr_decay_steps, "
                        f"over which the learning rate falls to min_lr); got {wsd_decay_steps}")
        elif decay_steps is not None and wsd_decay_steps > decay_steps - warmup_steps:
            errs.append(f"wsd_decay_steps={wsd_decay_steps} must fit after the warm-up: at most lr_decay_steps - "
                        f"lr_warmup_steps = {decay_steps - warmup_steps}")
        if wsd_decay_style not in LR_WSD_DECAY_STYLES:
            errs.append(f"lr_wsd_decay_style={wsd_decay_style!r}; valid: {', '.join(LR_WSD_DECAY_STYLES)}")
    return errs


def scheduled_lr(num_updates: int, lr: float, *, warmup_steps: int = 0, init_lr: float = 0.0,
                 decay_style: str = "constant", decay_steps: Optional[int] = None, min_lr: float = 0.0,
                 wsd_decay_steps: Optional[int] = None, wsd_decay_style: str = "linear") -> float:
    """Learning rate of the optimizer update that follows ``num_updates`` completed ones.

    megatron-core's ``OptimizerParamScheduler.get_lr`` (learning-rate decay from Loshchilov & Hutter,
    SGDR, arXiv:1608.03983; WSD, warm-up / stable / decay, from Hu et al., MiniCPM, arXiv:2404.06395):
    the warm-up of :func:`warmup_lr` while ``num_updates <= warmup_steps``; then, with
    ``r = (num_updates - warmup_steps) / (decay_steps - warmup_steps)``, ``min_lr + c * (lr - min_lr)``
    where ``c`` is 1 (``"constant"``, no ``min_lr``), ``1 - r`` (``"linear"``), ``(1 + cos(pi r)) / 2``
    (``"cosine"``), or for ``"WSD"`` 1 until ``decay_steps - wsd_decay_steps`` and then the
    ``wsd_decay_style`` curve of ``s = (num_updates - (decay_steps - wsd_decay_steps)) / wsd_decay_steps``:
    ``1 - s``, ``(1 + cos(pi s)) / 2``, ``2 * 0.5**s - 1`` (``"exponential"``) or ``1 - sqrt(s)``
    (``"minus_sqrt"``); ``min_lr`` after ``decay_steps``.

    Args:
        num_updates: optimizer updates completed so far (>= 0).
        lr: the peak learning rate (after the warm-up).
        warmup_steps: updates of linear warm-up from ``init_lr``; 0: none.
        init_lr: the warm-up's starting learning rate (0 <= init_lr <= lr).
        decay_style: one of ``LR_DECAY_STYLES``.
        decay_steps: the update count at which the decay reaches ``min_lr`` (> ``warmup_steps``); needed
            unless ``decay_style == "constant"``.
        min_lr: the learning rate the decay ends at (0 <= min_lr <= lr).
        wsd_decay_steps: for ``"WSD"``, the number of updates before ``decay_steps`` the decay takes.
        wsd_decay_style: for ``"WSD"``, one of ``LR_WSD_DECAY_STYLES``.

    Raises:
        ValueError: a negative ``num_updates`` or ``warmup_steps``, or settings :func:`schedule_errors` names.
    """
    if num_updates < 0 or warmup_steps < 0:
        raise ValueError(f"scheduled_lr: num_updates ({num_updates}) and warmup_steps ({warmup_steps}) must be >= 0")
    errs = schedule_errors(lr, init_lr, warmup_steps, decay_style, decay_steps, min_lr, wsd_decay_steps,
                           wsd_decay_style)
    if errs:
        raise ValueError(f"scheduled_lr: {'; '.join(errs)}")
    if decay_style == "constant" or (warmup_steps > 0 and num_updates <= warmup_steps):
        return warmup_lr(num_updates, lr, warmup_steps, init_lr)
    if num_updates > decay_steps:
        return min_lr
    ratio = (num_updates - warmup_steps) / (decay_steps - warmup_steps)
    if decay_style == "linear":
        coeff = 1.0 - ratio
    elif decay_style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:  # WSD
        anneal_start = decay_steps - wsd_decay_steps
        if num_updates <= anneal_start:
            coeff = 1.0
        else:
            s = (num_updates - anneal_start) / wsd_decay_steps
            coeff = {"linear": lambda: 1.0 - s, "cosine": lambda: 0.5 * (math.cos(math.pi * s) + 1.0),
                     "exponential": lambda: 2.0 * 0.5**s - 1.0, "minus_sqrt": lambda: 1.0 - math.sqrt(s)}[
                         wsd_decay_style]()
    return min_lr + coeff * (lr - min_lr)


def schedule_warnings(run_updates: int, lr: float, *, warmup_steps: int = 0, init_lr: float = 0.0,
                      decay_style: str = "constant", decay_steps: Optional[int] = None, min_lr: float = 0.0,
                      wsd_decay_steps: Optional[int] = None, wsd_decay_style: str = "linear") -> list[str]:
    """Parts of a valid schedule that a run of ``run_updates`` optimizer updates never reaches, with the numbers.

    A warm-up longer than the run (the rate never reaches ``lr``), a WSD decay that starts after the last
    update (the rate never decays), a decay that ends after it (the rate ends above ``min_lr``). Each line names
    the setting (``lr_warmup_steps``, ``lr_decay_steps``) and the learning rate of the run's last update
    (:func:`scheduled_lr`). Empty when the run sees the whole schedule, or with settings
    :func:`schedule_errors` refuses (those are errors, not warnings).

    Args:
        run_updates: optimizer updates in the whole run (``grpo.max_num_steps`` x updates per step, >= 1).
        lr, warmup_steps, init_lr, decay_style, decay_steps, min_lr, wsd_decay_steps, wsd_decay_style: as in
            :func:`scheduled_lr`.
    """
    if schedule_errors(lr, init_lr, warmup_steps, decay_style, decay_steps, min_lr, wsd_decay_steps,
                       wsd_decay_style):
        return []
    last = scheduled_lr(run_updates - 1, lr, warmup_steps=warmup_steps, init_lr=init_lr, decay_style=decay_style,
                        decay_steps=decay_steps, min_lr=min_lr, wsd_decay_steps=wsd_decay_steps,
                        wsd_decay_style=wsd_decay_style)
    ends = f"the run's {run_updates} optimizer updates end at learning rate {last:.3g}"
    if warmup_steps >= run_updates:
        return [f"lr_warmup_steps={warmup_steps} is longer than the run: {ends}, below lr={lr:g}"]
    if decay_style == "constant" or decay_steps <= run_updates:
        return []
    if decay_style == "WSD" and decay_steps - wsd_decay_steps >= run_updates:
        return [f"lr_decay_steps={decay_steps} with wsd_decay_steps={wsd_decay_steps}: the decay starts at update "
                f"{decay_steps - wsd_decay_steps}, after the run's last ({run_updates}); the learning rate never "
                f"decays (set lr_decay_steps to the run's {run_updates} updates)"]
    return [f"lr_decay_steps={decay_steps} is past the run's last update: {ends}, not min_lr={min_lr:g} (set "
            f"lr_decay_steps to the run's {run_updates} updates)"]
