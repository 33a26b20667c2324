"""What a policy rank needs to build its backend: one typed, frozen spec (the twin of ``GenerationSpec``).

The trainer builds a ``PolicySpec`` once from the config (``nemo_fp8.trainer.policy_spec``); the policy group
(``nemo_fp8.policy.group``) reads its layout from it and sends it unchanged to every rank, and
``build_policy_backend`` hands it to the backend. Facts derived from several keys are computed here, once, and
carried: sequence packing on or off and each budget's bin layout (``train_packing`` / ``logprob_packing``: the
``train_mb_tokens`` / ``logprob_mb_tokens`` capacity, the sequence and FP8 recipe token multiples, the packing
algorithm), and the rank processes' environment (``env_vars``). The driver plans its bins from the same shapes the
ranks pack with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from nemo_fp8.distributed.pipeline import ParallelLayout
from nemo_fp8.policy.config import PolicyConfig, megatron_env_vars
from nemo_fp8.policy.packing import PackingShape


@dataclass(frozen=True)
class PolicySpec:
    """A policy rank's backend arguments (every rank of a run gets the same spec).

    Attributes:
        cfg: the ``policy`` section (model, precision, batch sizes, optimizer, ``megatron_cfg``).
        device: the torch backend's device (``policy.device`` resolved); a Megatron rank uses its own GPU.
        temperature: ``policy.generation.temperature``: logits are divided by it, so trainer and rollout score
            the same distribution.
        keep_reference: keep a frozen copy of the initial weights for the KL penalty
            (``loss_fn.reference_policy_kl_penalty > 0``).
        seed: ``grpo.seed``: megatron-core's model-parallel RNG seed.
        train_packing: the bin layout of training micro-batches (``PolicyConfig.packing_shape("train")``); None
            without ``policy.sequence_packing`` (micro-batches of ``train_micro_batch_size`` rows).
        logprob_packing: the same for log-probs and KV calibration (``logprob_mb_tokens``); None without packing.
        env_vars: the rank processes' extra environment (``megatron_env_vars``: allocator settings of the
            megatron backend), set by Ray when the rank actors start.
    """

    cfg: PolicyConfig
    device: torch.device
    temperature: float = 1.0
    keep_reference: bool = False
    seed: int = 1234
    train_packing: Optional[PackingShape] = None
    logprob_packing: Optional[PackingShape] = None
    env_vars: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: PolicyConfig, device: torch.device, temperature: float = 1.0,
                    keep_reference: bool = False, seed: int = 1234) -> "PolicySpec":
        """The spec of ``cfg`` with its derived facts computed (the config validated them already).

        Raises:
            ValueError: a packing budget that is not a multiple of the recipe's token multiple (``packing_shape``;
                a validated config never has one).
        """
        packing = cfg.sequence_packing.enabled
        return cls(cfg=cfg, device=device, temperature=temperature, keep_reference=keep_reference, seed=seed,
                   train_packing=cfg.packing_shape("train") if packing else None,
                   logprob_packing=cfg.packing_shape("logprobs") if packing else None,
                   env_vars=megatron_env_vars(cfg))

    @property
    def packing(self) -> bool:
        """``policy.sequence_packing.enabled``: micro-batches by token budget."""
        return self.train_packing is not None

    @property
    def megatron(self) -> bool:
        """``policy.megatron_cfg.enabled``: the Megatron-core + TransformerEngine backend."""
        return self.cfg.megatron_cfg.enabled

    @property
    def world_size(self) -> int:
        """Policy ranks: ``data_parallel_size x tensor_model_parallel_size x pipeline_model_parallel_size``."""
        return self.cfg.world_size

    @property
    def pp_size(self) -> int:
        """Pipeline stages per replica (``policy.megatron_cfg.pipeline_model_parallel_size``; both backends)."""
        return self.cfg.pipeline_parallel_size

    @property
    def vpp_size(self) -> Optional[int]:
        """Model chunks per stage (``virtual_pipeline_model_parallel_size``; the megatron backend only), or None."""
        return self.cfg.megatron_cfg.virtual_pipeline_model_parallel_size

    @property
    def layout(self) -> ParallelLayout:
        """The ranks' layout (megatron-core's ``tp-dp-pp`` order, ``nemo_fp8.distributed.pipeline``)."""
        return ParallelLayout(tp=self.tp_size, pp=self.pp_size, dp=self.cfg.data_parallel_size)

    @property
    def tp_size(self) -> int:
        """Tensor-parallel ranks per replica (1 for the torch backend)."""
        return self.cfg.tensor_parallel_size

    @property
    def global_batch_size(self) -> int:
        """``policy.train_global_batch_size``: rows per optimizer step, over all data-parallel ranks."""
        return self.cfg.train_global_batch_size
