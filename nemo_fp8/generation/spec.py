"""What an engine actor needs to build its generation backend: one typed, frozen spec.

The trainer builds a ``GenerationSpec`` from the config (``nemo_fp8.trainer.generation_spec``), the Ray
engine actors receive it unchanged (``nemo_fp8.generation.group.GenerationWorker``) and
``build_generation_backend`` reads it field by field, so each knob can be followed from the YAML key to the
backend's argument.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

import torch

from nemo_fp8.generation.config import VllmConfig
from nemo_fp8.generation.sglang.config import SglangConfig


@dataclass(frozen=True)
class GenerationSpec:
    """The generation backend's arguments (one engine; every engine of a run gets the same spec).

    Attributes:
        backend: ``policy.generation.backend`` (``"torch"``, ``"vllm"`` or ``"sglang"``).
        model_name: ``policy.model_name``, a local HF folder (architecture and initial weights).
        vllm_cfg: ``policy.generation.vllm_cfg`` (precision, FP8 layer policy, tensor parallelism, KV cache).
        sglang_cfg: ``policy.generation.sglang_cfg`` (the SGLang engine's knobs; the default for other backends).
        device: the torch engine's device (``policy.device`` resolved); a vLLM or SGLang engine runs on its GPUs.
        pad_token_id, eos_token_id: from the tokenizer.
        max_total_sequence_length: ``policy.max_total_sequence_length`` (prompt + response tokens).
        batch_size: ``policy.generation_batch_size``: rows per forward pass of the torch engine (vLLM schedules
            its own batches).
        offload_when_idle: ``policy.generation.colocated.enabled``: sleep between rollouts (vLLM's sleep mode,
            the torch engine moves its model to host memory).
        reference_dtype: ``policy.generation.reference_dtype``, the torch engine's high-precision dtype name.
        weight_transfer: vLLM's ``weight_transfer_config`` backend: ``"nccl"`` for
            ``policy.weight_sync.method: nccl`` (broadcast from the trainer, no initial load), else ``"ipc"``;
            None for the torch engine.
    """

    backend: Literal["torch", "vllm", "sglang"]
    model_name: str
    vllm_cfg: VllmConfig
    device: Optional[torch.device]
    pad_token_id: int
    eos_token_id: int
    max_total_sequence_length: int
    batch_size: int = 64
    offload_when_idle: bool = False
    weight_transfer: Optional[Literal["ipc", "nccl"]] = None
    reference_dtype: Literal["bfloat16", "float64"] = "bfloat16"
    sglang_cfg: SglangConfig = field(default_factory=SglangConfig)
