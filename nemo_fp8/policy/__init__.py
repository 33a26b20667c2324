"""Policy (trainer) backends: ``torch`` (reference, here) and ``megatron`` (a later issue)."""

from nemo_fp8.policy.interfaces import LossFn, PolicyBackend

__all__ = ["LossFn", "PolicyBackend", "build_policy_backend"]


def build_policy_backend(megatron: bool, **kwargs) -> PolicyBackend:
    """Build the torch reference policy, or Megatron when ``policy.megatron_cfg.enabled``.

    Raises:
        NotImplementedError: Megatron-core + TransformerEngine is not part of this build yet.
    """
    if megatron:
        raise NotImplementedError("policy.megatron_cfg.enabled=true: the Megatron-core + TransformerEngine backend is "
                                  "not in this build yet; valid now: false (the torch reference backend, which "
                                  "emulates the same FP8 recipes)")
    from nemo_fp8.policy.torch_backend import TorchPolicyBackend

    return TorchPolicyBackend(**kwargs)  # cfg, device, temperature, keep_reference, dp_rank, dp_size, dist_init_method
