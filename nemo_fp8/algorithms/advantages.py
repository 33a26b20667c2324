"""Group-relative advantages and DAPO reward shaping.

Samples are laid out as consecutive groups: for ``group_size = G``, samples
``[k*G, (k+1)*G)`` are the ``G`` responses to prompt ``k`` (the order the
rollout produces them in). All functions here take and return 1-D ``[N]``
tensors, one entry per sample (per response, not per token).

Sources:
    * GRPO group baseline and std normalisation: Shao et al. 2024,
      "DeepSeekMath" (https://arxiv.org/abs/2402.03300).
    * Leave-one-out (RLOO) baseline: Ahmadian et al. 2024, "Back to Basics:
      Revisiting REINFORCE Style Optimization for Learning from Human
      Feedback in LLMs" (https://arxiv.org/abs/2402.14740).
    * Dynamic sampling and soft overlong punishment: Yu et al. 2025, "DAPO"
      (https://arxiv.org/abs/2503.14476).
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = [
    "grpo_advantages",
    "dynamic_sampling_keep_mask",
    "overlong_penalty",
]


def _grouped(values: torch.Tensor, group_size: int, name: str) -> torch.Tensor:
    """Reshape ``values`` [N] to [N // group_size, group_size]; raise on bad input."""
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(values)}")
    if values.dim() != 1:
        raise ValueError(f"{name} must be 1-D [N], got shape {tuple(values.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    n = values.shape[0]
    if n % group_size != 0:
        raise ValueError(
            f"{name} has N={n} samples, which is not a multiple of group_size={group_size}"
        )
    return values.reshape(n // group_size, group_size)


def grpo_advantages(
    rewards: torch.Tensor,
    group_size: int,
    baseline: Literal["mean", "leave_one_out"] = "mean",
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-sample group-relative advantages (GRPO / RLOO).

    For a group of rewards ``r_1..r_G`` of one prompt:

    * ``baseline="mean"`` (GRPO, Shao et al. 2024): ``b_i = mean_j r_j``.
    * ``baseline="leave_one_out"`` (RLOO, Ahmadian et al. 2024):
      ``b_i = (sum_j r_j - r_i) / (G - 1)``, so ``r_i - b_i = G/(G-1) *
      (r_i - mean)``. Needs ``G >= 2``.

    ``A_i = r_i - b_i``; with ``normalize_std`` ``A_i = (r_i - b_i) / (s + eps)``
    where ``s`` is the **unbiased (Bessel, divide by G-1) std of the whole
    group**, the same ``s`` for every sample of the group, for both
    baselines. (NeMo-RL's ``calculate_baseline_and_std_per_prompt`` instead
    uses, with the leave-one-out baseline, the unbiased std of the *other*
    G-1 samples, and skips normalisation where that std is 0; that std is
    undefined for G=2 and makes one sample of ``[1, 0, 0]`` unnormalised while
    the others are divided by 0.707. The whole-group std avoids both.) For
    ``G = 1`` the std is taken as 0 (the advantage is 0 anyway with the mean
    baseline).

    A group whose rewards are all equal gets advantage **exactly 0** (never
    NaN), for both baselines, with or without std normalisation, whatever the
    value and ``G``. In floating point ``mean(r) != r`` in general (e.g.
    ``[0.3] * 3`` in float32), so ``r_i - b_i`` would be a rounding residue
    ~1e-8 and the std the same order, and dividing one by the other gave
    advantages up to ~0.5 before. So constant groups (``max == min``,
    exact) get ``r_i - b_i = 0`` and ``s = 0``, and, as NeMo-RL's
    ``GRPOAdvantageEstimator`` (``nemo_rl/algorithms/advantage_estimator.py``:
    ``advantages[std > 0] /= std[std > 0] + 1e-6``), the division is applied
    only where ``s > 0``. (NeMo-RL computes its std as
    ``sqrt(E[r^2] - E[r]^2)``, which has the same residue problem; the exact
    ``max == min`` test is ours.)

    Args:
        rewards: [N] float (any real dtype; computed in float32), N a
            multiple of ``group_size``, groups consecutive.
        group_size: G >= 1 samples per prompt.
        baseline: ``"mean"`` or ``"leave_one_out"``.
        normalize_std: divide by the group std (+ ``eps``) where that std is > 0.
        eps: added to the std; must be > 0 when ``normalize_std``.

    Returns:
        [N] float32 advantages, no grad.

    Raises:
        ValueError: bad shape, ``N % group_size != 0``, ``group_size < 1``,
            unknown ``baseline``, leave-one-out with ``group_size < 2``,
            non-positive ``eps`` with ``normalize_std``.
    """
    grouped = _grouped(rewards, group_size, "rewards").detach().float()
    if baseline not in ("mean", "leave_one_out"):
        raise ValueError(f"baseline must be 'mean' or 'leave_one_out', got {baseline!r}")
    if baseline == "leave_one_out" and group_size < 2:
        raise ValueError(
            f"baseline='leave_one_out' needs group_size >= 2, got group_size={group_size}"
        )
    if normalize_std and not eps > 0:
        raise ValueError(f"eps must be > 0 when normalize_std=True, got {eps!r}")

    g = group_size
    if baseline == "mean":
        b = grouped.mean(dim=1, keepdim=True).expand_as(grouped)
    else:
        b = (grouped.sum(dim=1, keepdim=True) - grouped) / (g - 1)
    # Exactly-constant groups: no rounding residue (see the docstring).
    constant = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)  # [N // G, 1]
    zero = torch.zeros((), dtype=grouped.dtype, device=grouped.device)
    adv = torch.where(constant, zero, grouped - b)

    if normalize_std:
        if g > 1:
            std = torch.where(constant, zero, grouped.std(dim=1, correction=1, keepdim=True))
        else:
            std = torch.zeros_like(grouped[:, :1])
        adv = torch.where(std > 0, adv / (std + eps), adv)
    return adv.reshape(-1)


def dynamic_sampling_keep_mask(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO dynamic sampling filter (Yu et al. 2025, Sec. 3.2).

    A group whose rewards are all equal (all correct or all wrong) has zero
    group-relative advantage and so no policy gradient; DAPO drops such
    groups (and over-samples to refill the batch). Equality is exact
    (``max == min`` within the group).

    Args:
        rewards: [N] float, consecutive groups of ``group_size``.
        group_size: G >= 1. With G = 1 every group is constant, so all False.

    Returns:
        [N] bool: False for every sample of a constant-reward group, True
        otherwise.

    Raises:
        ValueError: bad shape, ``N % group_size != 0`` or ``group_size < 1``.
    """
    grouped = _grouped(rewards, group_size, "rewards").detach()
    varied = grouped.amax(dim=1) != grouped.amin(dim=1)  # [N // G]
    return varied.unsqueeze(1).expand_as(grouped).reshape(-1).clone()


def overlong_penalty(
    response_lengths: torch.Tensor,
    max_response_length: int,
    overlong_buffer_length: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, Eq. 13), added to the reward.

    With ``L_max = max_response_length``, ``L_cache = overlong_buffer_length``
    and ``p = penalty_factor``::

        R(L) = 0                                   if L <= L_max - L_cache
               p * ((L_max - L_cache) - L) / L_cache  if L_max - L_cache < L <= L_max
               -p                                  if L > L_max

    i.e. 0 up to the start of the buffer, then linearly down to ``-p`` at
    ``L = L_max``, and ``-p`` beyond. With ``L_cache = 0`` it is a step:
    0 for ``L <= L_max``, ``-p`` above.

    Args:
        response_lengths: [N] int (or integral float) response lengths in
            tokens, >= 0.
        max_response_length: L_max >= 1.
        overlong_buffer_length: L_cache with 0 <= L_cache <= L_max.
        penalty_factor: p >= 0.

    Returns:
        [N] float32 penalties (<= 0).

    Raises:
        ValueError: bad shape, negative lengths or out-of-range arguments.
    """
    if not isinstance(response_lengths, torch.Tensor):
        raise TypeError(f"response_lengths must be a torch.Tensor, got {type(response_lengths)}")
    if response_lengths.dim() != 1:
        raise ValueError(
            f"response_lengths must be 1-D [N], got shape {tuple(response_lengths.shape)}"
        )
    if max_response_length < 1:
        raise ValueError(f"max_response_length must be >= 1, got {max_response_length}")
    if not 0 <= overlong_buffer_length <= max_response_length:
        raise ValueError(
            f"overlong_buffer_length must be in [0, max_response_length={max_response_length}], "
            f"got {overlong_buffer_length}"
        )
    if not penalty_factor >= 0:
        raise ValueError(f"penalty_factor must be >= 0, got {penalty_factor}")
    lengths = response_lengths.detach().to(torch.float64)
    if bool((lengths < 0).any()):
        raise ValueError("response_lengths must be >= 0")

    start = float(max_response_length - overlong_buffer_length)
    out = torch.zeros_like(lengths)
    if overlong_buffer_length > 0:
        ramp = (start - lengths) / float(overlong_buffer_length) * penalty_factor
        in_buffer = (lengths > start) & (lengths <= max_response_length)
        out = torch.where(in_buffer, ramp, out)
    out = torch.where(lengths > max_response_length, torch.full_like(out, -penalty_factor), out)
    return out.to(torch.float32)
