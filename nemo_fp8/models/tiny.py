"""The project's own tiny model: a few-million-parameter Qwen3 with a character tokenizer.

It exists so that the whole FP8 GRPO pipeline runs on a 2-core CPU machine with no model hub:
``build_tiny_model`` makes the tokenizer (with the ``tokenizers`` library) and a randomly
initialised ``Qwen3ForCausalLM``, then warm-starts it with a short supervised pass on synthetic
arithmetic problems so that GRPO begins with a non-zero reward. The result is an ordinary
HF-format checkpoint (``config.json``, ``model.safetensors``, ``tokenizer.json``) loaded by the
same code as any other local checkpoint. The default spec's weights ship in ``tiny_weights/``
(``tools/make_tiny_model.py --ship``) and are loaded instead of trained: a fresh clone's first run
starts in seconds, with the same model on every machine.
"""

from __future__ import annotations

import json
import logging
import math
import string
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from nemo_fp8.models.sft import pad_sft_batch, save_checkpoint_atomically, state_dict_sha256

logger = logging.getLogger(__name__)

# Weights of the default tiny model shipped in git (a few MB), so a fresh clone skips the warm start:
# ``<name>.safetensors`` beside ``<name>.json`` (the TinyModelSpec it was built with and the weights'
# ``state_dict_sha256``), written by ``tools/make_tiny_model.py --ship``.
SHIPPED_DIR = Path(__file__).resolve().parent / "tiny_weights"

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


def _tiny_config(tokenizer, spec: TinyModelSpec):
    """The ``Qwen3Config`` of ``spec`` over ``tokenizer``'s vocabulary (tied input/output embeddings)."""
    from transformers import Qwen3Config

    return Qwen3Config(
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


def find_shipped_weights(spec: TinyModelSpec, shipped_dir: Path = SHIPPED_DIR) -> tuple[Path, dict] | None:
    """The shipped weights built with exactly ``spec`` (every field equal), as (``.safetensors`` path, its
    record: the spec, ``sha256`` and build facts), or None when none was shipped for this spec."""
    for record_path in sorted(Path(shipped_dir).glob("*.json")) if Path(shipped_dir).is_dir() else []:
        record = json.loads(record_path.read_text())
        weights = record_path.with_suffix(".safetensors")
        if record.get("spec") == asdict(spec) and weights.is_file():
            return weights, record
    return None


def _load_shipped(model, weights: Path, record: dict) -> None:
    """Load the shipped ``weights`` into ``model`` and check them against the record's ``sha256``.

    Raises:
        ValueError: the weights' fingerprint differs from the record (the file was changed without
            re-shipping it with ``tools/make_tiny_model.py --ship``).
    """
    from safetensors.torch import load_model

    load_model(model, str(weights))
    got = state_dict_sha256(model.state_dict())
    if got != record["sha256"]:
        raise ValueError(f"{weights}: weights sha256 {got[:16]}... differ from {weights.with_suffix('.json')}'s "
                         f"{record['sha256'][:16]}...; re-ship them with tools/make_tiny_model.py --ship, or delete "
                         "both files to build the model from scratch")


def ship_tiny_weights(model_dir: str | Path, name: str, shipped_dir: Path = SHIPPED_DIR) -> Path:
    """Copy a built tiny checkpoint's weights into the shipped folder: ``<name>.safetensors`` + ``<name>.json``
    (its ``tiny_model_spec.json`` spec, the weights' ``state_dict_sha256``, torch version, build seconds).
    ``build_tiny_model`` then loads them instead of training whenever it is asked for the same spec.

    Raises:
        FileNotFoundError: ``model_dir`` is not a tiny checkpoint (no ``tiny_model_spec.json``).
    """
    from safetensors.torch import save_model
    from transformers import Qwen3ForCausalLM

    model_dir = Path(model_dir)
    if not (model_dir / "tiny_model_spec.json").is_file():
        raise FileNotFoundError(f"{model_dir}: no tiny_model_spec.json; build it with tools/make_tiny_model.py first")
    built = json.loads((model_dir / "tiny_model_spec.json").read_text())
    spec = TinyModelSpec(**{k: built[k] for k in asdict(TinyModelSpec())})
    model = Qwen3ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    shipped_dir.mkdir(parents=True, exist_ok=True)
    weights = Path(shipped_dir) / f"{name}.safetensors"
    save_model(model, str(weights))
    record = {"spec": asdict(spec), "sha256": state_dict_sha256(model.state_dict()),
              "parameters": built.get("parameters"), "build_seconds": built.get("build_seconds"),
              "torch": torch.__version__, "built_by": "tools/make_tiny_model.py"}
    weights.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    return weights


def build_tiny_model(out_dir: str | Path, spec: TinyModelSpec | None = None, device: str = "cpu",
                     shipped_dir: Path | None = SHIPPED_DIR) -> Path:
    """Make the tiny Qwen3 checkpoint at ``out_dir`` (HF format) and return its path.

    Steps: tokenizer -> random ``Qwen3ForCausalLM`` -> ``spec.sft_steps`` AdamW steps of
    supervised training on fresh synthetic problems (``"Q: What is 37 + 5?\\n"`` ->
    ``"Answer: 42<eos>"``, loss on response tokens only) -> ``save_pretrained``. Writes into a
    temporary sibling folder and renames it, so an interrupted build leaves no half checkpoint.
    When ``shipped_dir`` (None: never) holds weights built with exactly this spec
    (:func:`find_shipped_weights`), they are loaded and checked against their recorded sha256 instead
    of training: about a second. Training the default spec takes 2.5 minutes on 2 idle CPU cores, up
    to 10 on busy ones.

    Raises:
        ValueError: shipped weights for this spec whose fingerprint differs from their record.
    """
    from transformers import Qwen3ForCausalLM

    spec = spec or TinyModelSpec()
    out_dir = Path(out_dir)
    torch.manual_seed(spec.seed)
    tokenizer = build_char_tokenizer()
    model = Qwen3ForCausalLM(_tiny_config(tokenizer, spec)).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    t0 = time.time()
    shipped = find_shipped_weights(spec, shipped_dir) if shipped_dir is not None else None
    if shipped is not None:
        _load_shipped(model, *shipped)
        logger.info("tiny model: the shipped weights %s (sha256 %s..., built by tools/make_tiny_model.py with "
                    "this spec)", shipped[0], shipped[1]["sha256"][:12])
        build = {"shipped_weights": shipped[0].name, "sha256": shipped[1]["sha256"]}
    else:
        logger.info("tiny model: %.2fM parameters, warm start for %d steps", n_params / 1e6, spec.sft_steps)
        _warm_start(model, tokenizer, spec, device)
        build = {"build_seconds": round(time.time() - t0, 1)}
    model.eval()
    save_checkpoint_atomically(out_dir, model, tokenizer, "tiny_model_spec.json",
                               {**asdict(spec), "parameters": n_params, **build})
    logger.info("tiny model written to %s in %.0f s", out_dir, time.time() - t0)
    return out_dir


def _warm_start(model, tokenizer, spec: TinyModelSpec, device: str) -> None:
    """``spec.sft_steps`` AdamW steps of supervised training on synthetic arithmetic (in place)."""
    from nemo_fp8.data.synthetic import make_arithmetic_problems

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
