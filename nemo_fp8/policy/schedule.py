"""The learning-rate schedule both policy backends follow: a linear warm-up, then constant.

The megatron backend gets it from megatron-core's ``OptimizerParamScheduler`` (``init_lr``,
``lr_warmup_steps``, constant decay style: ``settings.scheduler_kwargs``); the torch reference
backend sets each update's learning rate with :func:`warmup_lr`, the same formula, so the two
backends train with the same learning rates (and a resumed run picks the schedule up where it was).
"""

from __future__ import annotations


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
