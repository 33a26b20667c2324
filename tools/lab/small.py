"""The project's small real model: a Qwen3-shaped LM (~200M parameters) trained from scratch in minutes.

``build_small_model`` makes, with no model hub:

1. the data: synthetic arithmetic (``nemo_fp8.data.synthetic``) and GSM8K (``../shared/data``),
   split into the supervised set, a held-out validation set and an RL training set (problem
   texts never shared between validation and the other two);
2. a byte-level BPE tokenizer trained with ``tokenizers`` on the supervised texts (digits split
   one per token, ChatML special tokens, the chat template below);
3. a ``Qwen3ForCausalLM`` whose hidden size, intermediate size, ``heads x head_dim`` and vocabulary
   are multiples of 128 (the FP8 block size), trained with AdamW on the responses only, within a
   wall-clock budget (``max_minutes``) and a step budget, bf16 autocast on CUDA; with
   ``deterministic`` in PyTorch's strict deterministic mode, so that another host with the same
   stack rebuilds the same bits (``weights_sha256`` in the report says whether it did);
4. a greedy evaluation on the held-out set with the project's reward (``score_response``);
5. an HF checkpoint (bf16 safetensors, ``tokenizer.json``, ``tokenizer_config.json``, chat
   template, ``generation_config.json``), the RL data files ``data/rl_train.jsonl`` and
   ``data/val.jsonl`` (``problem_answer`` schema, read by ``grpo_math_small_parity.yaml``) and
   ``small_model_spec.json`` (shape, parameters, accuracy, throughput, times, ``weights_sha256``
   of the saved bf16 weights, the torch / CUDA versions and the GPU).

Steps 2-5 are :func:`train_and_save`, shared by any task's data (``lab.chains``: the arithmetic-chain task with
long written-out solutions, ``make_small_model.py --task chains``).

The prompt is what GRPO will show the model: ``SMALL_PROMPT_TEMPLATE`` through the chat template
(``data.use_chat_template: true``), so SFT and RL see the same text. Responses end in
``Answer: <number>``, the format ``nemo_fp8.rewards.math_reward`` reads.
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from nemo_fp8.data.prompts import PromptFormatter
from nemo_fp8.data.schema import MathExample
from nemo_fp8.models.sft import (causal_lm_loss, deterministic_training, pad_sft_batch, save_checkpoint_atomically,
                                 state_dict_sha256)
# At import, not inside the evaluation: a missing math-verify then stops the build before the SFT, not after it.
from nemo_fp8.rewards.math_reward import score_response

logger = logging.getLogger(__name__)

PAD, BOS, ENDOFTEXT, IM_START, IM_END = "<|pad|>", "<|bos|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, ENDOFTEXT, IM_START, IM_END]
# ChatML, as Qwen3's template renders a conversation without tools or thinking.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The user turn of every prompt (SFT and GRPO: grpo_math_small_parity.yaml's data.prompt_template).
SMALL_PROMPT_TEMPLATE = "{problem}\nThe last line of your response should be of the form Answer: $Answer"
SPEC_FILE = "small_model_spec.json"
BLOCK = 128  # every model dimension is a multiple of the FP8 block size
_CALC_RE = re.compile(r"<<[^<>]*>>")


@dataclass
class SmallModelSpec:
    """Shape, data and training budget of the small model (defaults: ~200M parameters, 10 minutes on one H200).

    Shape: ``hidden_size``, ``intermediate_size``, ``num_attention_heads * head_dim`` and
    ``vocab_size`` must be multiples of 128 (checked by :func:`check_spec`); the model's vocabulary
    is ``vocab_size`` and the BPE tokenizer is trained to at most that many tokens.
    """

    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 16
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 128
    vocab_size: int = 8192
    max_position_embeddings: int = 2048
    # data
    synthetic_ops: tuple[str, ...] = ("+", "-", "*")
    synthetic_max_operand: int = 199
    num_synthetic_sft: int = 200_000
    num_synthetic_val: int = 256
    num_gsm8k_val: int = 256
    num_synthetic_rl: int = 8192
    # GSM8K train questions among GRPO's problems: few, since the ~200M model solves 1-3% of GSM8K after its SFT
    # (2026-11-23, one H200): their groups are nearly always all wrong (no advantage) while their long responses set
    # the rollout's length. All 7,473: -1.
    num_gsm8k_rl: int = 1024
    gsm8k_fraction: float = 0.3  # share of SFT steps drawn from GSM8K train solutions
    max_seq_len: int = 512  # SFT rows longer than this are dropped
    # training
    batch_size: int = 128
    lr: float = 5e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    max_steps: int = 5000
    max_minutes: float = 10.0
    # evaluation
    eval_max_new_tokens: int = 256
    eval_batch_size: int = 128
    seed: int = 1234
    # PyTorch's deterministic algorithms, strict, for the initialisation and the SFT (not the evaluation, which does
    # not change the weights), and a schedule by steps alone (``nemo_fp8.models.sft.deterministic_training``,
    # ``schedule_progress``): two builds on the same GPU type and software should then give the same weights, so runs
    # split over two hosts (the parity runs) start from one model; weights_sha256 in the report checks it. Off: the
    # faster kernels, and builds that differ a little (held-out accuracy 0.330-0.352 over four builds of the default
    # spec on H200s; two 300-step builds in warn-only deterministic mode differed too, through cuDNN attention).
    deterministic: bool = False

    def parameters_estimate(self) -> int:
        """Parameter count of the Qwen3 this spec builds (tied embeddings), without building it."""
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        layer = h * q * 2 + h * kv * 2 + 3 * h * self.intermediate_size + 2 * h + 2 * self.head_dim
        return self.vocab_size * h + self.num_hidden_layers * layer + h


def check_spec(spec: SmallModelSpec) -> None:
    """Raise ``ValueError`` listing every shape or budget field of ``spec`` that is invalid."""
    errs = []
    for name in ("hidden_size", "intermediate_size", "vocab_size"):
        v = getattr(spec, name)
        if v <= 0 or v % BLOCK:
            errs.append(f"{name}={v} must be a positive multiple of {BLOCK}")
    q = spec.num_attention_heads * spec.head_dim
    if q <= 0 or q % BLOCK:
        errs.append(f"num_attention_heads * head_dim = {q} must be a positive multiple of {BLOCK}")
    if spec.num_key_value_heads <= 0 or spec.num_attention_heads % spec.num_key_value_heads:
        errs.append(f"num_key_value_heads={spec.num_key_value_heads} must divide num_attention_heads="
                    f"{spec.num_attention_heads}")
    if (spec.num_key_value_heads * spec.head_dim) % BLOCK:
        errs.append(f"num_key_value_heads * head_dim = {spec.num_key_value_heads * spec.head_dim} must be a multiple "
                    f"of {BLOCK} (the k/v projections run FP8 in 128x128 blocks)")
    if spec.num_hidden_layers < 1:
        errs.append(f"num_hidden_layers={spec.num_hidden_layers} must be >= 1")
    if spec.vocab_size < 512:
        errs.append(f"vocab_size={spec.vocab_size} must be >= 512 (256 byte tokens + specials + merges)")
    if spec.num_gsm8k_rl < -1:
        errs.append(f"num_gsm8k_rl={spec.num_gsm8k_rl} must be >= 0, or -1 for all GSM8K train questions")
    if not 0.0 <= spec.gsm8k_fraction <= 1.0:
        errs.append(f"gsm8k_fraction={spec.gsm8k_fraction} must be in [0, 1]")
    for name in ("batch_size", "max_steps", "eval_batch_size", "eval_max_new_tokens", "max_seq_len",
                 "num_synthetic_sft"):
        if getattr(spec, name) < 1:
            errs.append(f"{name}={getattr(spec, name)} must be >= 1")
    if spec.max_minutes <= 0:
        errs.append(f"max_minutes={spec.max_minutes} must be > 0")
    if errs:
        raise ValueError("invalid small model spec:\n  - " + "\n  - ".join(errs))


# --------------------------------------------------------------------------- data
@dataclass
class SmallData:
    """The three disjoint problem sets and the SFT texts.

    Attributes:
        sft: (example, response text) pairs for supervised training.
        val: held-out problems (synthetic first, then GSM8K test), for the greedy evaluation and
            as GRPO's validation set.
        rl_train: GRPO's training problems (fresh synthetic + a sample of GSM8K train questions).
    """

    sft: list[tuple[MathExample, str]]
    val: list[MathExample]
    rl_train: list[MathExample]


def gsm8k_response(solution: str) -> str:
    """A GSM8K worked solution as the model's response: calculator spans removed, ``#### N`` -> ``Answer: N``.

    Raises:
        ValueError: the solution has no ``####`` line.
    """
    from nemo_fp8.data.datasets import parse_gsm8k_answer

    answer = parse_gsm8k_answer(solution)
    body = _CALC_RE.sub("", solution.rsplit("####", 1)[0]).rstrip()
    return f"{body}\nAnswer: {answer}"


def _read_gsm8k(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or "question" not in r or "answer" not in r:
            raise ValueError(f"{path}, line {i + 1}: expected a GSM8K record with 'question' and 'answer'")
    return rows


def build_data(spec: SmallModelSpec, gsm8k_dir: str | Path | None) -> SmallData:
    """Make the SFT, validation and RL sets (see :class:`SmallData`), deterministically for ``spec.seed``.

    Synthetic problems come from three seed streams; validation problems are removed from the
    SFT and RL synthetic sets by problem text. GSM8K: train solutions for SFT, ``num_gsm8k_rl``
    train questions (a seeded sample; -1: all) for RL, the first ``num_gsm8k_val`` test problems
    for validation. ``gsm8k_dir=None`` uses
    synthetic problems only.

    Raises:
        FileNotFoundError: ``gsm8k_dir`` lacks ``train.jsonl`` or ``test.jsonl``.
    """
    from nemo_fp8.data.datasets import parse_gsm8k_answer
    from nemo_fp8.data.synthetic import make_arithmetic_problems

    mk = lambda n, s: make_arithmetic_problems(n, seed=s, max_operand=spec.synthetic_max_operand,  # noqa: E731
                                               ops=spec.synthetic_ops)
    val_syn = mk(spec.num_synthetic_val, spec.seed + 1)
    held = {e.problem for e in val_syn}
    sft = [(e, f"Answer: {e.answer}") for e in mk(spec.num_synthetic_sft, spec.seed) if e.problem not in held]
    rl = [e for e in mk(spec.num_synthetic_rl, spec.seed + 2) if e.problem not in held]
    val = list(val_syn)
    if gsm8k_dir is not None:
        d = Path(gsm8k_dir)
        for name in ("train.jsonl", "test.jsonl"):
            if not (d / name).is_file():
                raise FileNotFoundError(f"GSM8K: {d / name} not found (--gsm8k-dir; --no-gsm8k for synthetic only)")
        train_rows, test_rows = _read_gsm8k(d / "train.jsonl"), _read_gsm8k(d / "test.jsonl")
        n_rl = len(train_rows) if spec.num_gsm8k_rl < 0 else min(spec.num_gsm8k_rl, len(train_rows))
        rl_rows = set(random.Random(spec.seed + 3).sample(range(len(train_rows)), n_rl))
        for i, r in enumerate(train_rows):
            ex = MathExample(problem=r["question"], answer=parse_gsm8k_answer(r["answer"]), data_source="gsm8k",
                             index=i)
            sft.append((ex, gsm8k_response(r["answer"])))
            if i in rl_rows:
                rl.append(ex)
        val += [MathExample(problem=r["question"], answer=parse_gsm8k_answer(r["answer"]), data_source="gsm8k",
                            index=i) for i, r in enumerate(test_rows[: spec.num_gsm8k_val])]
    return SmallData(sft=sft, val=val, rl_train=rl)


def examples_jsonl(examples: Sequence[MathExample]) -> str:
    """JSON Lines in the ``problem_answer`` schema (``problem``, ``answer``, ``data_source``, ``index``)."""
    return "".join(json.dumps({"problem": e.problem, "answer": e.answer, "data_source": e.data_source,
                               "index": i}) + "\n" for i, e in enumerate(examples))


# --------------------------------------------------------------------------- tokenizer
def tokenizer_corpus(data: SmallData) -> list[str]:
    """The tokenizer's training texts: every SFT problem with its response, and the prompt template."""
    return [f"{ex.problem}\n{resp}" for ex, resp in data.sft] + [SMALL_PROMPT_TEMPLATE]


def train_bpe_tokenizer(texts: Sequence[str], vocab_size: int):
    """Train a byte-level BPE tokenizer on ``texts`` (``tokenizers``), digits one per token.

    Args:
        texts: training corpus.
        vocab_size: upper bound of the vocabulary, specials included (the trainer stops earlier
            when the corpus has no more merges).

    Returns:
        ``PreTrainedTokenizerFast`` with pad ``<|pad|>``, bos ``<|bos|>``, eos ``<|im_end|>`` (the end
        of an assistant turn), ``<|endoftext|>``/``<|im_start|>`` as specials, the ChatML
        template, and no automatically added special tokens. Any text round-trips (byte level).

    Raises:
        ValueError: empty corpus or ``vocab_size`` too small for the 256 byte tokens + specials.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if not texts:
        raise ValueError("train_bpe_tokenizer: empty corpus")
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} < 256 byte tokens + {len(SPECIAL_TOKENS)} specials")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=IM_END,
                                 additional_special_tokens=[ENDOFTEXT, IM_START])
    hf.chat_template = CHAT_TEMPLATE
    return hf


# --------------------------------------------------------------------------- model
def qwen3_config(spec: SmallModelSpec, tokenizer):
    """``Qwen3Config`` of ``spec`` (tied embeddings, bf16), special token ids from ``tokenizer``.

    Raises:
        ValueError: invalid spec (:func:`check_spec`), or a tokenizer larger than ``spec.vocab_size``.
    """
    from transformers import Qwen3Config

    check_spec(spec)
    if len(tokenizer) > spec.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens > vocab_size={spec.vocab_size}")
    return Qwen3Config(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, torch_dtype="bfloat16",
    )


def encode_sft(pairs: Sequence[tuple[MathExample, str]], tokenizer, formatter: PromptFormatter,
               max_seq_len: int) -> tuple[list[list[int]], list[list[int]], list[str]]:
    """(prompt ids, response ids + EOS, data_source) per pair, rows longer than ``max_seq_len`` dropped.

    The prompt is the GRPO prompt (``formatter`` with the tokenizer's chat template), encoded
    without added special tokens; the response is encoded on its own, as GRPO samples it after
    the prompt.
    """
    prompts = tokenizer([formatter.format(ex, tokenizer) for ex, _ in pairs], add_special_tokens=False)["input_ids"]
    responses = tokenizer([resp for _, resp in pairs], add_special_tokens=False)["input_ids"]
    keep = [i for i in range(len(pairs)) if len(prompts[i]) + len(responses[i]) + 1 <= max_seq_len]
    return ([prompts[i] for i in keep], [responses[i] + [tokenizer.eos_token_id] for i in keep],
            [pairs[i][0].data_source for i in keep])


def lr_multiplier(step: int, progress: float, warmup_steps: int, min_ratio: float) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine from 1 to ``min_ratio`` as ``progress`` goes 0 -> 1.

    ``progress`` is the larger of the step and time fractions of the budget, so the schedule
    ends when either budget does.
    """
    cosine = 0.5 * (1 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
    return min(1.0, (step + 1) / max(1, warmup_steps)) * (min_ratio + (1 - min_ratio) * cosine)


def schedule_progress(step: int, elapsed_s: float, spec: SmallModelSpec) -> float:
    """How far the SFT schedule is, 0 -> 1: the larger of ``step / max_steps`` and ``elapsed_s / (max_minutes * 60)``,
    so the cosine ends with whichever budget ends first; with ``spec.deterministic`` the step fraction alone (the
    clock is not the same on two hosts, nor twice on one)."""
    by_steps = step / spec.max_steps
    return by_steps if spec.deterministic else max(by_steps, elapsed_s / (spec.max_minutes * 60))


def train_sft(model, prompts: list[list[int]], responses: list[list[int]], sources: list[str],
              spec: SmallModelSpec, pad_token_id: int, device: torch.device) -> dict:
    """AdamW on response tokens until ``spec.max_steps`` or ``spec.max_minutes``, whichever comes first.

    Each step's batch comes from one source (GSM8K with probability ``spec.gsm8k_fraction`` when
    there is any, else synthetic), drawn without replacement within an epoch of that source, so
    batches are padded to similar lengths. bf16 autocast on CUDA (fp32 weights and optimizer).
    The cosine schedule follows :func:`schedule_progress` (with ``spec.deterministic`` the steps
    alone; the time budget then only stops the run).

    Returns:
        dict: steps, seconds, final loss (mean of the last 20 steps), tokens (real tokens
        processed), tokens_per_s, stopped_by (``steps`` or ``time``).
    """
    rng = random.Random(spec.seed)
    pools: dict[str, list[int]] = {}
    for i, s in enumerate(sources):
        pools.setdefault("gsm8k" if s == "gsm8k" else "synthetic", []).append(i)
    order: dict[str, list[int]] = {k: [] for k in pools}
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": spec.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=spec.lr, betas=(0.9, 0.95),
                            fused=device.type == "cuda")
    budget_s = spec.max_minutes * 60
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast(
        "cpu", enabled=False)
    model.train()
    t0 = time.perf_counter()
    tokens, losses, step, stopped_by = 0, [], 0, "steps"
    last_log = t0
    while step < spec.max_steps:
        elapsed = time.perf_counter() - t0
        if elapsed >= budget_s:
            stopped_by = "time"
            break
        src = "gsm8k" if "gsm8k" in pools and ("synthetic" not in pools or rng.random() < spec.gsm8k_fraction) \
            else "synthetic"
        if len(order[src]) < spec.batch_size:
            perm = pools[src][:]
            rng.shuffle(perm)
            order[src].extend(perm * max(1, math.ceil(spec.batch_size / len(perm))))
        rows, order[src] = order[src][: spec.batch_size], order[src][spec.batch_size:]
        ids, labels, attn = pad_sft_batch([prompts[i] for i in rows], [responses[i] for i in rows], pad_token_id,
                                          device)
        for g in opt.param_groups:
            g["lr"] = spec.lr * lr_multiplier(step, schedule_progress(step, elapsed, spec), spec.warmup_steps,
                                              spec.min_lr_ratio)
        with autocast:
            logits = model(input_ids=ids, attention_mask=attn).logits
        loss = causal_lm_loss(logits, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens += int(attn.sum())
        step += 1
        losses.append(loss.detach())
        if len(losses) > 20:
            losses.pop(0)
        now = time.perf_counter()
        if now - last_log >= 15 or step == spec.max_steps or step == 1:
            last_log = now
            print(f"[sft] step {step:>6} src {src:<9} loss {loss.item():.4f} lr {opt.param_groups[0]['lr']:.2e} "
                  f"{tokens / (now - t0):>10,.0f} tok/s  {now - t0:>6.0f} s / {budget_s:.0f} s budget", flush=True)
    seconds = time.perf_counter() - t0
    model.eval()
    return {"steps": step, "seconds": round(seconds, 1), "final_loss": float(torch.stack(losses).mean()) if losses
            else float("nan"), "tokens": tokens, "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
            "stopped_by": stopped_by}


@torch.no_grad()
def evaluate_greedy(model, tokenizer, examples: Sequence[MathExample], formatter: PromptFormatter,
                    max_new_tokens: int, batch_size: int, device: torch.device,
                    group_of: Callable[[MathExample], str] | None = None) -> dict:
    """Greedy accuracy of ``model`` on ``examples`` with the project's reward (``score_response``).

    Prompts are formatted as in GRPO, left-padded, decoded with ``skip_special_tokens``; a
    response is correct when its extracted final answer equals the example's answer.

    Returns:
        dict: ``accuracy`` in [0, 1], ``num_samples``, ``by_source`` ({data_source: accuracy}),
        ``seconds``, ``samples`` (the first 3 (prompt, response, gold, reward) for a look); with
        ``group_of`` also ``by_group`` ({group_of(example): accuracy}, e.g. by number of steps) and
        ``response_tokens_mean`` (generated tokens per response, EOS included).

    Raises:
        ValueError: no examples.
    """
    if not examples:
        raise ValueError("evaluate_greedy: no examples")
    t0 = time.perf_counter()
    model.eval()
    scores, samples, groups, lengths = [], [], [], []
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    for s in range(0, len(examples), batch_size):
        chunk = examples[s: s + batch_size]
        texts = [formatter.format(ex, tokenizer) for ex in chunk]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        width = max(map(len, ids))
        inp = torch.full((len(ids), width), pad, dtype=torch.long)
        attn = torch.zeros_like(inp)
        for i, row in enumerate(ids):  # left padding: generation continues every row at column `width`
            inp[i, width - len(row):] = torch.tensor(row)
            attn[i, width - len(row):] = 1
        out = model.generate(input_ids=inp.to(device), attention_mask=attn.to(device), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad)
        for ex, text, row in zip(chunk, texts, out[:, width:].tolist()):
            response = tokenizer.decode(row, skip_special_tokens=True)
            r = score_response(response, ex.answer)
            scores.append((ex.data_source, r))
            groups.append((group_of(ex) if group_of else None, r))
            lengths.append(row.index(eos) + 1 if eos in row else len(row))
            if len(samples) < 3:
                samples.append({"prompt": text, "response": response, "gold": ex.answer, "reward": r})
    out = {"accuracy": sum(r for _, r in scores) / len(scores), "num_samples": len(scores),
           "by_source": _mean_by_key(scores), "seconds": round(time.perf_counter() - t0, 1), "samples": samples}
    if group_of is not None:
        out["by_group"] = _mean_by_key(groups)
        out["response_tokens_mean"] = sum(lengths) / len(lengths)
    return out


def _mean_by_key(pairs: list[tuple[str, float]]) -> dict[str, float]:
    """(key, value) pairs -> {key: mean value}, keys in sorted order."""
    by: dict[str, list[float]] = {}
    for k, v in pairs:
        by.setdefault(k, []).append(v)
    return {k: sum(by[k]) / len(by[k]) for k in sorted(by)}


def software_versions(device: torch.device) -> dict:
    """torch and CUDA versions and the GPU's name: what two builds must share to give the same bits."""
    out = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    return out


def build_small_model(out_dir: str | Path, spec: SmallModelSpec | None = None,
                      gsm8k_dir: str | Path | None = "../shared/data/gsm8k", device: str = "auto") -> dict:
    """Build the small model at ``out_dir`` (see the module docstring) and return its report.

    Args:
        out_dir: output folder; must not exist (written atomically through ``<out_dir>.tmp``).
        spec: shape, data and budgets (default :class:`SmallModelSpec`).
        gsm8k_dir: folder with GSM8K ``train.jsonl`` / ``test.jsonl``; None: synthetic only.
        device: ``auto`` (CUDA when available), ``cpu`` or ``cuda``.

    Returns:
        dict: the report also written to ``small_model_spec.json`` (:func:`train_and_save`).

    Raises:
        FileExistsError: ``out_dir`` exists. ValueError: invalid spec. FileNotFoundError: GSM8K
        files missing. RuntimeError: ``device='cuda'`` without CUDA.
    """
    spec = spec or SmallModelSpec()
    check_spec(spec)
    if Path(out_dir).exists():
        raise FileExistsError(f"{out_dir} exists; remove it or pick another folder")
    t = time.perf_counter()
    data = build_data(spec, gsm8k_dir)
    return train_and_save(out_dir, spec, data, device, times={"data_s": round(time.perf_counter() - t, 1)})


def train_and_save(out_dir: str | Path, spec: SmallModelSpec, data: SmallData, device: str = "auto",
                   times: dict | None = None, extra_report: dict | None = None,
                   group_of: Callable[[MathExample], str] | None = None) -> dict:
    """From data to checkpoint: the BPE tokenizer, the SFT of a fresh Qwen3 of ``spec``'s shape on ``data.sft``,
    the greedy evaluation on ``data.val`` and the save (module docstring, steps 2-5), for any task's data.

    Args:
        out_dir: output folder; must not exist.
        spec: shape and training budgets (its data fields are the caller's business).
        data: the task's SFT pairs, validation and RL problems (:class:`SmallData`).
        device: ``auto`` (CUDA when available), ``cpu`` or ``cuda``.
        times: seconds of the caller's phases (``data_s``), joined to the report's ``times``.
        extra_report: more entries of the report (a task's description).
        group_of: groups of the evaluation (``eval.by_group``), e.g. a chain's number of steps.

    Returns:
        dict: the report also written to ``small_model_spec.json`` (spec, parameters, tokenizer
        size, training stats, held-out accuracy, seconds per phase, ``weights_sha256``, software).

    Raises:
        FileExistsError: ``out_dir`` exists. ValueError: invalid spec, or every SFT row longer than
        ``spec.max_seq_len``. RuntimeError: ``device='cuda'`` without CUDA.
    """
    from transformers import GenerationConfig, Qwen3ForCausalLM

    from nemo_fp8.models.hf import resolve_device

    check_spec(spec)
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists; remove it or pick another folder")
    dev = resolve_device(device)
    times = dict(times or {})
    torch.manual_seed(spec.seed)
    t = time.perf_counter()
    formatter = PromptFormatter(SMALL_PROMPT_TEMPLATE, use_chat_template=True)
    tokenizer = train_bpe_tokenizer(tokenizer_corpus(data), spec.vocab_size)
    times["tokenizer_s"] = round(time.perf_counter() - t, 1)

    t = time.perf_counter()
    prompts, responses, sources = encode_sft(data.sft, tokenizer, formatter, spec.max_seq_len)
    if not prompts:
        raise ValueError(f"every SFT row is longer than max_seq_len={spec.max_seq_len}")
    times["encode_s"] = round(time.perf_counter() - t, 1)
    config = qwen3_config(spec, tokenizer)
    with deterministic_training(spec.deterministic):
        model = Qwen3ForCausalLM(config).to(dev)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"[small] {n_params / 1e6:.1f}M parameters, tokenizer {len(tokenizer)} tokens (model vocab "
              f"{spec.vocab_size}), {len(prompts)} SFT rows ({sources.count('gsm8k')} GSM8K), device {dev}, budget "
              f"{spec.max_steps} steps / {spec.max_minutes} min{', deterministic' if spec.deterministic else ''}",
              flush=True)
        train = train_sft(model, prompts, responses, sources, spec, tokenizer.pad_token_id, dev)
    print(f"[small] trained {train['steps']} steps in {train['seconds']} s ({train['tokens_per_s']:,.0f} tok/s, "
          f"stopped by {train['stopped_by']}), loss {train['final_loss']:.4f}", flush=True)
    if spec.deterministic and train["stopped_by"] == "time":
        logger.warning("deterministic build stopped by the time budget (max_minutes=%s) at step %d of %d: "
                       "another host may stop at another step; give a max_steps that fits the budget",
                       spec.max_minutes, train["steps"], spec.max_steps)

    model = model.to(torch.bfloat16)  # evaluate what is saved (bf16 weights)
    weights_sha256 = state_dict_sha256(model.state_dict())
    print(f"[small] weights sha256 {weights_sha256}", flush=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(ENDOFTEXT)], do_sample=False)
    ev = evaluate_greedy(model, tokenizer, data.val, formatter, spec.eval_max_new_tokens, spec.eval_batch_size, dev,
                         group_of=group_of)
    print(f"[small] held-out greedy accuracy {ev['accuracy']:.4f} on {ev['num_samples']} "
          f"({', '.join(f'{k} {v:.4f}' for k, v in {**ev['by_source'], **ev.get('by_group', {})}.items())}) "
          f"in {ev['seconds']} s", flush=True)
    report = {"spec": asdict(spec), "parameters": n_params, "tokenizer_vocab": len(tokenizer),
              "prompt_template": SMALL_PROMPT_TEMPLATE, "use_chat_template": True, "train": train,
              "eval": ev, "times": times, "device": str(dev),
              "weights_sha256": weights_sha256, "software": software_versions(dev),
              "data": {"sft_rows": len(prompts), "val": len(data.val), "rl_train": len(data.rl_train)},
              **(extra_report or {})}
    save_checkpoint_atomically(out_dir, model, tokenizer, SPEC_FILE, report,
                               extra_files={"data/val.jsonl": examples_jsonl(data.val),
                                            "data/rl_train.jsonl": examples_jsonl(data.rl_train)})
    print(f"[small] written to {out_dir}", flush=True)
    return report
