"""Answers the reward's step budget left unscored (reward nan) are left out of the advantages, not scored 0."""

from pathlib import Path

import torch

from nemo_fp8.algorithms.advantages import grpo_advantages
from nemo_fp8.algorithms.grpo import Rollout, compute_advantages
from nemo_fp8.config import load_config

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "grpo_math_tiny_fp8.yaml"
NAN = float("nan")


def test_unscored_answers_get_no_advantage_and_no_part_in_the_baseline():
    cfg = load_config(CONFIG, ["grpo.num_generations_per_prompt=4", "grpo.num_prompts_per_step=2",
                               "policy.train_global_batch_size=8", "policy.train_micro_batch_size=8",
                               "grpo.use_dynamic_sampling=false"])  # the default recipe samples dynamically
    rewards = torch.tensor([1.0, 0.0, NAN, 1.0, 0.0, 0.0, NAN, 0.0])
    adv, keep = compute_advantages(Rollout(None, [], rewards), cfg)
    assert not adv.isnan().any()
    assert adv[2] == 0 and adv[6] == 0
    expected = grpo_advantages(torch.tensor([1.0, 0.0, 1.0]), 3, normalize_std=cfg.grpo.normalize_rewards)
    torch.testing.assert_close(adv[[0, 1, 3]], expected)  # the group's baseline is over its 3 scored answers
    assert keep.all()  # the batch keeps its shape; advantage 0 leaves the row out of the update
    dyn = cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"use_dynamic_sampling": True})})
    _, keep = compute_advantages(Rollout(None, [], rewards), dyn)
    assert keep.tolist() == [True, True, False, True, False, False, False, False]
    full = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0])  # all scored: as before
    torch.testing.assert_close(compute_advantages(Rollout(None, [], full), cfg)[0],
                               grpo_advantages(full, 4, normalize_std=cfg.grpo.normalize_rewards))
