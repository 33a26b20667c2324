"""A resumed policy keeps the optimizer state but takes the new config's lr schedule and weight decay."""

import torch

from nemo_fp8.policy.torch_backend import TorchPolicyBackend
from nemo_fp8.policy.spec import PolicySpec


def test_load_applies_the_configs_lr_and_weight_decay(tiny_cfg, tmp_path):
    old = TorchPolicyBackend(PolicySpec.from_config(tiny_cfg().policy, torch.device("cpu")))
    old.save(tmp_path / "policy")
    new_cfg = tiny_cfg("policy.optimizer.lr=1e-3", "policy.optimizer.weight_decay=0.05").policy
    new = TorchPolicyBackend(PolicySpec.from_config(new_cfg, torch.device("cpu")))
    new.load(tmp_path / "policy")
    assert {(g["lr"], g["weight_decay"]) for g in new.optimizer.param_groups} == {(1e-3, 0.05)}
