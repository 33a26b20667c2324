"""Loading HF-format causal LMs and computing aligned token log-probs (shared by both torch backends)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import Tensor, nn

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.to(device)


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
