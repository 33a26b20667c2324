"""Loading HF-format causal LMs and computing aligned token log-probs (shared by both torch backends)."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor, nn

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def resolve_device(device: str) -> torch.device:
    """``auto`` -> cuda when available else cpu; ``cuda`` without a GPU raises RuntimeError."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("policy.device='cuda' but torch sees no CUDA device (valid here: 'cpu' or 'auto')")
    return torch.device(device)


def load_causal_lm(model_name: str, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Load an HF causal LM from a local folder (no hub downloads here) in ``dtype`` on ``device``.

    Raises:
        FileNotFoundError: ``model_name`` is not a local folder with a ``config.json``.
    """
    from transformers import AutoModelForCausalLM

    path = Path(model_name)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"policy.model_name: {model_name!r} is not a local HF checkpoint folder "
                                "(needs config.json and weights); this machine cannot download from a model hub")
    # use_kernels=False: transformers >= 5.25 kernelizes by default (its `kernels` dependency); a kernelized module in
    # training mode runs its class's forward, so the float64 norms of compute_in_float64 would compute in float32
    # again, and the torch reference would no longer be the plain torch computation the tests pin down
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, use_kernels=False)
    if dtype == torch.float64:
        compute_in_float64(model)
    return model.to(device)


def _rms_norm_in_input_dtype(self, hidden_states: Tensor) -> Tensor:
    """HF's RMSNorm (``Qwen3RMSNorm``, ``LlamaRMSNorm``) without its cast to float32: in the input's dtype."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _rotary_in_float64(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
    """HF's default RoPE (``Qwen3RotaryEmbedding.forward``) with the angles, cos and sin in float64."""
    freqs = position_ids[..., None].to(torch.float64) * self.inv_freq_float64.to(x.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def compute_in_float64(model: nn.Module) -> int:
    """Make a float64 HF model compute in float64 end to end; returns the number of modules changed.

    transformers' RMSNorm computes in float32 whatever the model's dtype (it upcasts for half precision), and its
    RoPE computes the inverse frequencies, angles, cos and sin in float32: in a float64 model these are the only
    float32 steps, and the vectorised float32 ``rsqrt`` / ``cos`` / ``sin`` and sums that torch picks by CPU type
    (``ATEN_CPU_CAPABILITY``) differ in the last bit, which the float64 CPU recipe exists to avoid
    (docs/first-run.md). Norms get ``_rms_norm_in_input_dtype``; default RoPE (``rope_type: default``) gets its
    inverse frequencies ``1 / theta^(2i/d)`` recomputed in float64 (RoFormer, Su et al. 2021) and
    ``_rotary_in_float64``; other RoPE types keep transformers' forward.
    """
    import types

    changed = 0
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_rms_norm_in_input_dtype, module)
            changed += 1
        elif name.endswith("RotaryEmbedding") and getattr(module, "rope_type", None) == "default":
            dim = module.inv_freq.numel() * 2
            theta = module.config.rope_parameters["rope_theta"]
            module.inv_freq_float64 = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
            module.forward = types.MethodType(_rotary_in_float64, module)
            changed += 1
    return changed


def model_config(model_dir: str | Path) -> dict:
    """The HF ``config.json`` of a local checkpoint folder, as a dict.

    Raises:
        FileNotFoundError: no ``config.json`` in ``model_dir``.
    """
    return json.loads((Path(model_dir) / "config.json").read_text())


def iter_checkpoint(model_dir: str | Path) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` of every tensor in the ``*.safetensors`` files of a local checkpoint folder (CPU, the file's
    dtypes), file by file in name order: an engine's initial load through its refit path.

    Raises:
        FileNotFoundError: no ``*.safetensors`` file in ``model_dir``.
    """
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files for the initial refit")
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                yield k, fh.get_tensor(k)


def load_tokenizer(name: str):
    """Load an HF tokenizer from a local folder; the pad token defaults to EOS when missing."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(name)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def attention_mask_for(prompt_lengths: Tensor, response_lengths: Tensor, width: int) -> Tensor:
    """[B, width] int64, 1 on real (prompt + response) tokens of a right-padded batch."""
    cols = torch.arange(width, device=prompt_lengths.device)[None, :]
    return (cols < (prompt_lengths + response_lengths)[:, None]).long()


def token_logprobs(logits: Tensor, token_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-prob of each token under softmax(logits / temperature), aligned to the token.

    Args:
        logits: [B, T, V] (any float dtype; computed in float32).
        token_ids: [B, T] int64.
        temperature: > 0; the same scaling the sampler used (NeMo-RL divides the trainer's
            logits by the generation temperature so both sides score one distribution).

    Returns:
        [B, T] float32 where column t = log p(token_t | tokens_<t); column 0 is 0.
    """
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)  # [B, T-1, V]
    picked = logp.gather(-1, token_ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)  # [B, T]


_CALIBRATION_ATTN = "nemo_fp8_qkv_amax"


def _qkv_amax_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA that first records the amax of q, k, v over real tokens ([B, H, T, D] each)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    valid, out = module.qkv_amax_record  # [B, T] bool (True on real tokens), [3, num_layers] float32
    for row, x in enumerate((query, key, value)):
        per_token = x.detach().abs().amax(dim=(1, 3)).float()  # [B, T]
        amax = torch.where(valid[:, -per_token.shape[1]:], per_token, torch.zeros_like(per_token)).amax()
        out[row, module.layer_idx] = torch.maximum(out[row, module.layer_idx], amax)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@contextlib.contextmanager
def record_qkv_amax(model: nn.Module, attention_mask: Tensor, amax: Tensor) -> Iterator[None]:
    """Within: every forward of ``model`` max-accumulates q/k/v amax per layer into ``amax``.

    q and k are recorded as the attention kernel receives them: after q/k-norm and RoPE (HF
    models apply both before calling the attention function), k and v before GQA repetition.
    Works for HF decoders whose attention modules carry ``layer_idx`` (Qwen3, Qwen3-MoE, Llama).

    Args:
        model: an HF causal LM.
        attention_mask: [B, T] int/bool, 1 on real tokens of the batch about to run.
        amax: [3, num_layers] float32 on the model's device, updated in place (rows q, k, v).

    Raises:
        ValueError: an attention module without ``layer_idx``.
    """
    previous = model.config._attn_implementation
    modules = _use_attention(model, _CALIBRATION_ATTN, _qkv_amax_attention)
    for m in modules:  # read by _qkv_amax_attention, like fp8_kv_scales by _fp8_kv_attention
        m.qkv_amax_record = (attention_mask.bool(), amax)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
        for m in modules:
            del m.qkv_amax_record


_FP8_KV_ATTN = "nemo_fp8_fp8_kv"


def _fp8_kv_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA on q, k, v passed through e4m3 with the layer's static scales (an FP8 KV cache)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from nemo_fp8.fp8.kv_scales import fake_quantize_static

    scales = getattr(module, "fp8_kv_scales", None)  # [3] float32: q, k, v
    if scales is None:
        raise RuntimeError(f"FP8 KV cache: attention layer {module.layer_idx} has no q/k/v scales; they arrive with "
                           "the refit (calibrate_kv_scales), never defaults")
    query, key, value = (fake_quantize_static(x, scales[i]) for i, x in enumerate((query, key, value)))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def enable_fp8_kv_attention(model: nn.Module) -> list[nn.Module]:
    """Make ``model``'s attention run on FP8-quantized q, k, v (static per-layer scales).

    Each attention module then needs ``fp8_kv_scales`` ([3] float32: q, k, v scales) before a
    forward; without them the forward raises (no silent scale = 1). Returns the attention
    modules, indexed by ``layer_idx``.

    Raises:
        ValueError: an attention module without ``layer_idx``.
    """
    return _use_attention(model, _FP8_KV_ATTN, _fp8_kv_attention)


def _use_attention(model: nn.Module, name: str, fn) -> list[nn.Module]:
    """Register ``fn`` as HF attention implementation ``name`` (SDPA masks) and switch ``model`` to it.

    Returns the attention modules sorted by ``layer_idx``.

    Raises:
        ValueError: an attention module without ``layer_idx`` (the functions index layers by it).
    """
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    modules = [m for n, m in model.named_modules() if n.endswith("self_attn")]
    if not modules or any(getattr(m, "layer_idx", None) is None for m in modules):
        raise ValueError(f"{type(model).__name__} has attention modules without layer_idx; {name} needs them")
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)
    model.set_attn_implementation(name)
    return sorted(modules, key=lambda m: m.layer_idx)
