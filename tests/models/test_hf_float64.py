"""A float64 HF model computes in float64 end to end (``nemo_fp8.models.hf.compute_in_float64``): transformers'
RMSNorm and RoPE would compute in float32, whose vectorised kernels differ by CPU type."""

import torch

from nemo_fp8.models.hf import load_causal_lm


def test_norms_and_rope_of_a_float64_model_compute_in_float64(tiny_model_dir):
    model = load_causal_lm(str(tiny_model_dir), torch.float64, torch.device("cpu"))
    x = torch.randn(3, 5, model.config.hidden_size, dtype=torch.float64)
    norm = model.model.norm
    want = norm.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    for mode in ("eval", "train"):  # a hub-kernelized module (transformers' use_kernels) ignores the patch in train
        getattr(model, mode)()
        got = norm(x)
        assert got.dtype == torch.float64
        assert (got - want).abs().max() < 1e-14, mode  # float32 arithmetic would be ~1e-7 off
    fp32 = load_causal_lm(str(tiny_model_dir), torch.float32, torch.device("cpu")).model.norm
    assert (fp32(x.float()).double() - want).abs().max() > 1e-9  # the float32 model keeps transformers' norm

    rope = model.model.rotary_emb
    positions = torch.arange(40)[None]
    cos, sin = rope(x, positions)
    dim = cos.shape[-1]
    inv = 1.0 / (model.config.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angles = positions[..., None].double() * inv
    assert cos.dtype == torch.float64
    assert (cos - torch.cat([angles, angles], -1).cos()).abs().max() < 1e-14
    assert (sin - torch.cat([angles, angles], -1).sin()).abs().max() < 1e-14
