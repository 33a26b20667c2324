"""Policy (trainer) backends: ``torch`` (reference, pure torch) and ``megatron`` (Megatron-core + TE)."""

from typing import Optional

from nemo_fp8.policy.interfaces import LossFn, PolicyBackend

__all__ = ["LossFn", "PolicyBackend", "build_policy_backend"]


def build_policy_backend(megatron: bool, rank: int = 0, world_size: int = 1, dist_init_method: Optional[str] = None,
                         seed: int = 1234, **kwargs) -> PolicyBackend:
    """One policy rank: Megatron when ``policy.megatron_cfg.enabled``, else the torch reference.

    ``kwargs``: ``cfg``, ``device``, ``temperature``, ``keep_reference`` (both backends).
    ``rank`` / ``world_size``: this rank of ``policy.world_size``; ``dist_init_method``: rank 0's
    ``tcp://host:port``; ``seed``: megatron-core's model-parallel RNG seed.
    """
    if megatron:
        from nemo_fp8.policy.megatron.backend import MegatronPolicyBackend

        return MegatronPolicyBackend(**kwargs, rank=rank, world_size=world_size, dist_init_method=dist_init_method,
                                     seed=seed)
    from nemo_fp8.policy.torch_backend import TorchPolicyBackend

    return TorchPolicyBackend(**kwargs, dp_rank=rank, dp_size=world_size, dist_init_method=dist_init_method)
