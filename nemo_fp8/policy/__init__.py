"""Policy (trainer) backends: ``torch`` (reference, pure torch) and ``megatron`` (Megatron-core + TE)."""

from typing import Optional

from nemo_fp8.policy.interfaces import LossFn, PolicyBackend
from nemo_fp8.policy.spec import PolicySpec

__all__ = ["LossFn", "PolicyBackend", "PolicySpec", "build_policy_backend"]


def build_policy_backend(spec: PolicySpec, rank: int = 0, world_size: int = 1,
                         dist_init_method: Optional[str] = None) -> PolicyBackend:
    """One policy rank from the run's ``spec``: Megatron when ``policy.megatron_cfg.enabled``, else the torch
    reference.

    With ``policy.megatron_cfg.pipeline_model_parallel_size > 1`` and the megatron backend off, the torch
    backend's pipeline stages (``nemo_fp8.policy.torch_pipeline``).
    ``rank`` / ``world_size``: this rank of ``policy.world_size`` (``spec.layout``'s order); ``dist_init_method``: rank 0's
    ``tcp://host:port``.
    """
    if spec.megatron:
        from nemo_fp8.policy.megatron.backend import MegatronPolicyBackend

        return MegatronPolicyBackend(spec, rank=rank, world_size=world_size, dist_init_method=dist_init_method)
    if spec.pp_size > 1:  # the torch backend's pipeline stages (megatron_cfg.pipeline_model_parallel_size)
        from nemo_fp8.policy.torch_pipeline import TorchPipelineBackend

        return TorchPipelineBackend(spec, rank=rank, world_size=world_size, dist_init_method=dist_init_method)
    from nemo_fp8.policy.torch_backend import TorchPolicyBackend

    return TorchPolicyBackend(spec, dp_rank=rank, dp_size=world_size, dist_init_method=dist_init_method)
