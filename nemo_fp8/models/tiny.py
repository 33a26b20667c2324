"""The project's own tiny model: a few-million-parameter Qwen3 with a character tokenizer.

It exists so that the whole FP8 GRPO pipeline runs on a 2-core CPU machine with no model hub:
``build_tiny_model`` makes the tokenizer (with the ``tokenizers`` library) and a randomly
initialised ``Qwen3ForCausalLM``, then warm-starts it with a short supervised pass on synthetic
arithmetic problems so that GRPO begins with a non-zero reward. The result is an ordinary
HF-format checkpoint (``config.json``, ``model.safetensors``, ``tokenizer.json``) loaded by the
same code as any other local checkpoint.
"""

from __future__ import annotations

import logging
import math
import string
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from nemo_fp8.models.sft import pad_sft_batch, save_checkpoint_atomically

logger = logging.getLogger(__name__)

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
# The plain prompt/response format the tiny model is warm-started on; the tiny configs use
# the same template (``data.prompt_template``) so that GRPO sees what SFT taught.
TINY_PROMPT_TEMPLATE = "Q: {problem}\n"
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@dataclass
class TinyModelSpec:
    """Shape of the tiny model and its warm-start schedule (defaults: ~1.8M parameters)."""

    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 1024
    sft_steps: int = 400
    sft_batch_size: int = 128
    sft_lr: float = 3e-3
    sft_min_lr_ratio: float = 0.1
    max_operand: int = 49
    seed: int = 1234


def build_char_tokenizer():
    """A character-level tokenizer over printable ASCII, built with ``tokenizers``.

    Every printable ASCII character is one token, so any English math text (GSM8K, DAPO)
    tokenizes; other characters map to ``<unk>``. Returns a ``PreTrainedTokenizerFast`` with
    pad/bos/eos/unk set and a small chat template (for ``data.use_chat_template``).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, BOS, EOS, UNK]
    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def _sft_batch(tokenizer, problems, device):
    """Right-padded [B, T] ids with labels masked (-100) outside the response."""
    prompts = [tokenizer.encode(TINY_PROMPT_TEMPLATE.format(problem=ex.problem), add_special_tokens=False)
               for ex in problems]
    responses = [tokenizer.encode(f"Answer: {ex.answer}", add_special_tokens=False) + [tokenizer.eos_token_id]
                 for ex in problems]
    return pad_sft_batch(prompts, responses, tokenizer.pad_token_id, device)


def build_tiny_model(out_dir: str | Path, spec: TinyModelSpec | None = None, device: str = "cpu") -> Path:
    """Make the tiny Qwen3 checkpoint at ``out_dir`` (HF format) and return its path.

    Steps: tokenizer -> random ``Qwen3ForCausalLM`` -> ``spec.sft_steps`` AdamW steps of
    supervised training on fresh synthetic problems (``"Q: What is 37 + 5?\\n"`` ->
    ``"Answer: 42<eos>"``, loss on response tokens only) -> ``save_pretrained``. Writes into a
    temporary sibling folder and renames it, so an interrupted build leaves no half checkpoint.
    Takes about 2.5 minutes on 2 CPU cores with the default spec (139 s measured).
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from nemo_fp8.data.synthetic import make_arithmetic_problems

    spec = spec or TinyModelSpec()
    out_dir = Path(out_dir)
    torch.manual_seed(spec.seed)
    tokenizer = build_char_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = Qwen3ForCausalLM(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("tiny model: %.2fM parameters, warm start for %d steps", n_params / 1e6, spec.sft_steps)

    # Warm-start data is drawn from its own seed stream (offset), disjoint in seed from the
    # GRPO train/validation sets, which use data.seed.
    problems = make_arithmetic_problems(spec.sft_steps * spec.sft_batch_size, seed=spec.seed + 10_000,
                                        max_operand=spec.max_operand)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.sft_lr, weight_decay=0.0, betas=(0.9, 0.98))
    # Linear warm-up, then cosine decay to a floor of sft_min_lr_ratio * sft_lr (not to zero): a model
    # annealed to lr=0 sits in a sharp spot where the first steps of a fresh RL optimizer (Adam's
    # early updates are about lr * sign(grad)) lose accuracy; ending at a floor above the RL lr
    # leaves it where GRPO's updates are small by comparison.
    warmup = max(1, spec.sft_steps // 20)

    def lr_mult(s: int) -> float:
        cosine = 0.5 * (1 + math.cos(math.pi * min(s, spec.sft_steps) / max(1, spec.sft_steps)))
        return min(1.0, (s + 1) / warmup) * (spec.sft_min_lr_ratio + (1 - spec.sft_min_lr_ratio) * cosine)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_mult)
    model.train()
    t0 = time.time()
    bar = tqdm(range(spec.sft_steps), desc="tiny model warm start", unit="step", mininterval=2.0)
    for step in bar:
        chunk = problems[step * spec.sft_batch_size : (step + 1) * spec.sft_batch_size]
        ids, labels, attn = _sft_batch(tokenizer, chunk, device)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()

    save_checkpoint_atomically(out_dir, model, tokenizer, "tiny_model_spec.json",
                               {**asdict(spec), "parameters": n_params, "build_seconds": round(time.time() - t0, 1)})
    logger.info("tiny model written to %s in %.0f s", out_dir, time.time() - t0)
    return out_dir
