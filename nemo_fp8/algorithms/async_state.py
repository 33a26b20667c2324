"""Asynchronous GRPO's rollouts made ahead of the trainer, saved with a step checkpoint and restored on ``--resume``.

When the checkpoint of step ``s`` is written the collector is paused at a generation-round boundary (the trainer
refits the engines there, ``async_grpo_train``), so what it has made ahead is a fixed state (``AheadState``): the
complete steps in the ``TrajectoryBuffer`` (``s + 1``, ... made with versions ``<= s - 1``), the rounds made so
far of the step in progress (dynamic sampling), the step it makes next and the prompt loader's position after its
last round. The checkpoint keeps them in ``step_<s>/async_rollouts.pt`` (``torch.save`` of plain dicts, lists and
tensors; read back with ``weights_only=True``), written inside ``step_<s>.tmp`` like the rest of the checkpoint,
and ``trainer_state.json`` names the file under ``async_grpo``. ``--resume`` puts them back (``restorable_ahead``
decides whether it may), so the resumed run trains on the rollouts the uninterrupted one trains on.

Not restored, with the reason logged (the collector then makes step ``s + 1``'s rollouts again from the prompts
that follow step ``s``, with the checkpoint's weights): a checkpoint without the file (a synchronous run's, or one
written before the file existed), a checkpoint of its run's last step (nothing was made ahead of it), a new age
limit that a saved round breaks, and a change of a config key that alters how rollouts are made
(``rollout_key_changes``).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from nemo_fp8.algorithms.grpo import Rollout
from nemo_fp8.algorithms.trajectory_buffer import StepRollouts
from nemo_fp8.batch import GenerationOutput, TrainBatch
from nemo_fp8.utils.checkpoint import CheckpointError

logger = logging.getLogger(__name__)

#: The file in a step checkpoint, and the ``trainer_state.json`` key that names it.
ROLLOUTS_FILE = "async_rollouts.pt"
STATE_KEY = "async_grpo"
_FORMAT = 1

#: Config keys (prefixes) under which a change alters how rollouts are made (prompts, sampling, rewards,
#: advantages): saved rollouts made under the old value are dropped on resume ...
ROLLOUT_KEYS = ("grpo.", "policy.generation.", "policy.max_total_sequence_length", "data.", "env.")
#: ... except these: how many steps run, validation, the age rule (checked on the saved rounds themselves) and
#: where the engines live.
NOT_ROLLOUT_KEYS = ("grpo.max_num_steps", "grpo.val_period", "grpo.val_at_start", "grpo.val_at_end",
                    "grpo.max_val_samples", "grpo.val_batch_size", "grpo.val_greedy", "grpo.async_grpo.",
                    "policy.generation.colocated.")


@dataclass
class AheadState:
    """What the collector had made ahead of the trainer at a checkpoint (the collector paused between rounds).

    Attributes:
        steps: the complete steps' rollouts in the buffer, ascending by step.
        partial: the step in progress: its rounds made so far (``StepRollouts`` with ``dataloader_state`` after its
            last round, ``phases`` of those rounds); None between steps.
        next_step: the step the collector makes next (``partial.step`` when there is one).
        dataloader_state: the prompt loader's ``state_dict()`` after the last round drawn (the collector's
            position, ahead of the trained step's).
        max_age: ``effective_max_age`` of the run that made them.
        ended: the collector had made every step of its run (``next_step > grpo.max_num_steps``).
    """

    steps: list[StepRollouts]
    partial: Optional[StepRollouts]
    next_step: int
    dataloader_state: dict
    max_age: int
    ended: bool = False

    def summary(self) -> dict[str, Any]:
        """What ``trainer_state.json`` records under ``async_grpo``: the file and the steps it holds."""
        return {"rollouts_file": ROLLOUTS_FILE, "steps_ahead": [s.step for s in self.steps],
                "partial_step": None if self.partial is None else self.partial.step,
                "partial_rounds": 0 if self.partial is None else len(self.partial.rollouts),
                "next_step": self.next_step, "max_age": self.max_age, "ended": self.ended}


def _tensors(obj) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if getattr(obj, f.name) is not None}


def _step_to_dict(s: StepRollouts) -> dict[str, Any]:
    return {"step": s.step, "versions": list(s.versions), "dataloader_state": s.dataloader_state,
            "phases": dict(s.phases), "parts": [_tensors(p) for p in s.parts],
            "rollouts": [{"output": _tensors(r.output), "responses": list(r.responses), "rewards": r.rewards,
                          "engine_metrics": dict(r.engine_metrics)} for r in s.rollouts]}


def _step_from_dict(d: dict[str, Any]) -> StepRollouts:
    rollouts = [Rollout(GenerationOutput(**r["output"]), r["responses"], r["rewards"], r["engine_metrics"])
                for r in d["rollouts"]]
    return StepRollouts(d["step"], [TrainBatch(**p) for p in d["parts"]], rollouts, d["versions"],
                        d["dataloader_state"], d["phases"])


def save_ahead(path: Path, ahead: AheadState) -> None:
    """Write ``ahead`` to ``path`` (``<the checkpoint being written>/ROLLOUTS_FILE``, ``CheckpointManager.save``'s
    ``extra_files``)."""
    torch.save({"format": _FORMAT, "steps": [_step_to_dict(s) for s in ahead.steps],
                "partial": None if ahead.partial is None else _step_to_dict(ahead.partial),
                "next_step": ahead.next_step, "dataloader_state": ahead.dataloader_state, "max_age": ahead.max_age,
                "ended": ahead.ended}, path)


def load_ahead(checkpoint: Path, start_step: int) -> AheadState:
    """Read the rollouts saved with the checkpoint of step ``start_step``.

    Returns:
        The ``AheadState``; tensors as saved (token ids [B, T] int64, log-probs [B, T] float32, advantages and
        rewards [B] float32, on CPU).

    Raises:
        CheckpointError: the file is missing, unreadable or of another format, or its steps do not follow
            ``start_step`` (names the file and what is wrong).
    """
    f = Path(checkpoint) / ROLLOUTS_FILE
    try:
        d = torch.load(f, map_location="cpu", weights_only=True)
        if d.get("format") != _FORMAT:
            raise ValueError(f"format {d.get('format')!r}, this version reads {_FORMAT}")
        ahead = AheadState([_step_from_dict(s) for s in d["steps"]],
                           None if d["partial"] is None else _step_from_dict(d["partial"]), int(d["next_step"]),
                           d["dataloader_state"], int(d["max_age"]), bool(d["ended"]))
    except Exception as e:  # noqa: BLE001 - any failure to read it is a damaged checkpoint, named
        raise CheckpointError(f"checkpoint {checkpoint}: the rollouts made ahead ({f}) cannot be read: "
                              f"{type(e).__name__}: {e}; resume from an older checkpoint with --resume-from") from None
    want = list(range(start_step + 1, ahead.next_step))
    if [s.step for s in ahead.steps] != want or (ahead.partial is not None and ahead.partial.step != ahead.next_step):
        raise CheckpointError(f"checkpoint {checkpoint}: {f} holds steps {[s.step for s in ahead.steps]} (partial: "
                              f"{None if ahead.partial is None else ahead.partial.step}) and next step "
                              f"{ahead.next_step}; a checkpoint of step {start_step} holds steps {want}")
    return ahead


def rollout_key_changes(changes: dict[str, tuple]) -> list[str]:
    """The changed config keys (``resume_changes``'s) that alter how rollouts are made (``ROLLOUT_KEYS``)."""
    return [k for k in changes if (k.startswith(ROLLOUT_KEYS) or k in ROLLOUT_KEYS)
            and not (k.startswith(NOT_ROLLOUT_KEYS) or k in NOT_ROLLOUT_KEYS)]


def _age_breaks(ahead: AheadState, max_age: int) -> Optional[str]:
    """The first saved round older than ``max_age`` at the step it trains (None: all within)."""
    for s in [*ahead.steps, *([ahead.partial] if ahead.partial is not None else [])]:
        for v in s.versions:
            if s.step - 1 - v > max_age:
                return f"step {s.step}'s rollouts of weight version {v} (age {s.step - 1 - v})"
    return None


def restorable_ahead(checkpoint: Path, trainer_state: dict, start_step: int, max_age: int, max_num_steps: int,
                     changes: dict[str, tuple]) -> Optional[AheadState]:
    """The rollouts made ahead that ``--resume`` of ``checkpoint`` (of step ``start_step``) puts back, or None when
    the collector starts afresh (the reason is logged; module docstring).

    Args:
        checkpoint: the step checkpoint resumed.
        trainer_state: its ``trainer_state.json``.
        start_step: its step.
        max_age: ``effective_max_age`` of the resumed run's config.
        max_num_steps: the resumed run's ``grpo.max_num_steps``; saved steps past it are dropped.
        changes: ``resume_changes`` (the config changes that apply).

    Raises:
        CheckpointError: the file named in the trainer state cannot be read (``load_ahead``).
    """
    replay = f"the collector makes step {start_step + 1}'s rollouts again with the weights of step {start_step}"
    if start_step >= max_num_steps:  # nothing left to train
        return None
    if STATE_KEY not in trainer_state:
        logger.info("--resume: %s holds no rollouts made ahead (a synchronous run's checkpoint, or one written "
                    "before they were saved); %s", checkpoint, replay)
        return None
    ahead = load_ahead(checkpoint, start_step)
    if ahead.ended and not ahead.steps and ahead.partial is None:  # the run's last step: nothing was made after it
        logger.warning("--resume: %s is its run's last step: no rollouts were made ahead of it; %s (age 0, where a "
                       "run that had gone on trains rollouts up to %d step(s) old)", checkpoint, replay, max_age)
        return None
    if keys := rollout_key_changes(changes):
        logger.warning("--resume: %s changed how rollouts are made; the rollouts saved with %s are dropped and %s",
                       ", ".join(keys), checkpoint, replay)
        return None
    if (old := _age_breaks(ahead, max_age)) is not None:
        logger.warning("--resume: %s are older than grpo.async_grpo.max_trajectory_age_steps=%d (0 with "
                       "wait_for_current_weights) allows; the rollouts saved with %s are dropped and %s", old,
                       max_age, checkpoint, replay)
        return None
    ahead.steps = [s for s in ahead.steps if s.step <= max_num_steps]
    if ahead.partial is not None and ahead.partial.step > max_num_steps:
        ahead.partial = None
    logger.info("--resume: restored the rollouts made ahead: steps %s%s; the collector goes on at step %d",
                [s.step for s in ahead.steps] or "none",
                "" if ahead.partial is None else f", {len(ahead.partial.rollouts)} round(s) of step "
                                                 f"{ahead.partial.step}", ahead.next_step)
    return ahead
