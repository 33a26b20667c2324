#!/usr/bin/env python
"""Build the project's small Qwen3-shaped model (BPE tokenizer, SFT on arithmetic + GSM8K) as an HF checkpoint.

    python tools/make_small_model.py --out models/small-qwen3            # GPU host: ~200M params, <= 10 min of training
    python tools/make_small_model.py --out models/small-qwen3 --max-steps 2000 --deterministic   # the same bits on
                                                                         # every host of the same GPU type and stack
    python tools/make_small_model.py --out /tmp/s --hidden-size 128 --intermediate-size 256 --num-layers 2 \\
        --num-heads 1 --num-kv-heads 1 --vocab-size 1024 --max-steps 5 --device cpu   # a CPU smoke build
    python tools/make_small_model.py --task chains --out models/reasoning-qwen3 --deterministic
                                        # the reasoning start point (issue 51): arithmetic chains, long solutions
    python tools/make_small_model.py --task chains --tiny --out /tmp/r   # the same path on CPU in seconds

``--task chains`` (``tools/lab/chains.py``): SFT on multi-step arithmetic chains written out step by step
(``--chain-sft-steps``, default 2-10 steps) by a teacher that drops an addition's carry with probability
``--chain-slip-prob``; validation and RL problems of ``--chain-steps`` (default 6-10) with correct answers; no GSM8K.
The ``--num-synthetic-*`` flags count chains; the evaluation reports accuracy by number of steps
(``eval.by_group``) and the mean response length. ``--tiny``: a CPU-sized shape and data, any flag given wins.

Writes ``config.json``, ``model.safetensors`` (bf16), ``tokenizer.json``, ``tokenizer_config.json`` (+ chat
template), ``generation_config.json``, ``data/{rl_train,val}.jsonl`` (GRPO's data in
``examples/configs/grpo_math_small_parity.yaml``) and ``small_model_spec.json`` (parameters, held-out greedy
accuracy, training tokens/s, seconds per phase). Every dimension is a multiple of 128.
"""

import argparse
import logging
import os
import sys
import time
from dataclasses import asdict, fields, replace
from pathlib import Path

from lab.chains import ChainTask, build_chain_data, check_task, steps_of
from lab.small import SmallModelSpec, build_small_model, check_spec, train_and_save

REPO = Path(__file__).resolve().parents[1]
# flag -> SmallModelSpec field (the flags a user is likely to change)
FLAGS = {"hidden_size": "hidden_size", "intermediate_size": "intermediate_size", "num_layers": "num_hidden_layers",
         "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
         "vocab_size": "vocab_size", "batch_size": "batch_size", "lr": "lr", "max_steps": "max_steps",
         "max_minutes": "max_minutes", "warmup_steps": "warmup_steps", "gsm8k_fraction": "gsm8k_fraction",
         "num_synthetic_sft": "num_synthetic_sft", "num_synthetic_val": "num_synthetic_val",
         "num_gsm8k_val": "num_gsm8k_val", "num_synthetic_rl": "num_synthetic_rl",
         "num_gsm8k_rl": "num_gsm8k_rl",
         "synthetic_max_operand": "synthetic_max_operand", "max_seq_len": "max_seq_len",
         "eval_max_new_tokens": "eval_max_new_tokens", "eval_batch_size": "eval_batch_size", "seed": "seed"}


# a task's defaults over SmallModelSpec's (the chains' solutions are ~100-300 tokens: longer rows, longer evaluation)
TASK_DEFAULTS = {"arithmetic": {},
                 "chains": {"num_synthetic_val": 1024, "max_seq_len": 768, "eval_max_new_tokens": 512,
                            "max_steps": 2000, "eval_batch_size": 256}}
# --tiny: a CPU-sized shape and data (seconds), for tests and smoke builds
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_layers": 2, "num_heads": 1, "num_kv_heads": 1,
        "vocab_size": 512, "batch_size": 8, "max_steps": 4, "num_synthetic_sft": 300, "num_synthetic_val": 8,
        "num_gsm8k_val": 8, "num_synthetic_rl": 32, "eval_max_new_tokens": 16, "eval_batch_size": 8}


def _steps_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    try:
        return (int(lo), int(hi)) if sep else (int(lo), int(lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN-MAX steps, e.g. 6-10; got {text!r}") from None


def main(argv=None) -> int:
    defaults = SmallModelSpec()
    types = {f.name: f.type for f in fields(SmallModelSpec)}
    chain_defaults = ChainTask()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output folder (must not exist)")
    p.add_argument("--task", choices=list(TASK_DEFAULTS), default="arithmetic",
                   help="arithmetic: one-line answers (+ GSM8K); chains: multi-step chains, long solutions")
    p.add_argument("--tiny", action="store_true", help="CPU-sized shape and data (seconds); given flags win")
    p.add_argument("--chain-sft-steps", type=_steps_range, default=(2, 10), help="chains: SFT chain steps, MIN-MAX")
    p.add_argument("--chain-steps", type=_steps_range, default=(chain_defaults.min_steps, chain_defaults.max_steps),
                   help="chains: validation and RL chain steps, MIN-MAX (default %(default)s)")
    p.add_argument("--chain-max-operand", type=int, default=chain_defaults.max_operand)
    p.add_argument("--chain-max-multiplier", type=int, default=chain_defaults.max_multiplier)
    p.add_argument("--chain-max-value", type=int, default=chain_defaults.max_value)
    p.add_argument("--chain-ops", default="".join(chain_defaults.ops), help="chains: operators, '+-' or '+-*'")
    p.add_argument("--chain-slip-prob", type=float, default=0.7,
                   help="chains: the SFT teacher drops a carry with this probability (0: clean solutions)")
    shared = Path(os.environ.get("NEMO_FP8_SHARED_DATA") or REPO.parent / "shared" / "data")
    p.add_argument("--gsm8k-dir", default=str(shared / "gsm8k"),
                   help="folder with GSM8K train.jsonl/test.jsonl (default: $NEMO_FP8_SHARED_DATA/gsm8k, else "
                        "../shared/data/gsm8k beside the checkout)")
    p.add_argument("--no-gsm8k", action="store_true", help="synthetic arithmetic only")
    p.add_argument("--synthetic-ops", default="".join(defaults.synthetic_ops), help="operators, e.g. '+-*'")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--deterministic", action="store_true",
                   help="PyTorch's deterministic algorithms and a step-only schedule: the same weights "
                        "(weights_sha256 in small_model_spec.json) from every build on the same GPU type and software")
    for flag, name in FLAGS.items():
        kind = float if types[name] in (float, "float") else int
        p.add_argument("--" + flag.replace("_", "-"), type=kind, default=None,
                       help=f"(default {getattr(defaults, name)}; --task and --tiny may change it)")
    args = p.parse_args(argv)
    preset = {**TASK_DEFAULTS[args.task], **(TINY if args.tiny else {})}
    for flag, name in FLAGS.items():  # a flag given wins over --tiny, which wins over the task's defaults
        if getattr(args, flag) is None:
            setattr(args, flag, preset.get(flag, preset.get(name, getattr(defaults, name))))
    if args.tiny and args.device == "auto":
        args.device = "cpu"
    if Path(args.out).exists():
        print(f"error: --out {args.out} exists; remove it or pick another folder", file=sys.stderr)
        return 2
    spec = SmallModelSpec(**{name: getattr(args, flag) for flag, name in FLAGS.items()},
                          synthetic_ops=tuple(args.synthetic_ops), deterministic=args.deterministic)
    sft_task = ChainTask(*args.chain_sft_steps, max_operand=args.chain_max_operand,
                         max_multiplier=args.chain_max_multiplier, max_value=args.chain_max_value,
                         ops=tuple(args.chain_ops), slip_prob=args.chain_slip_prob)
    eval_task = replace(sft_task, min_steps=args.chain_steps[0], max_steps=args.chain_steps[1], slip_prob=0.0)
    try:
        check_spec(spec)
        if args.task == "chains":
            check_task(sft_task)
            check_task(eval_task)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[small] about {spec.parameters_estimate() / 1e6:.1f}M parameters", flush=True)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.task == "arithmetic":
        build_small_model(args.out, spec, gsm8k_dir=None if args.no_gsm8k else args.gsm8k_dir, device=args.device)
        return 0
    t = time.perf_counter()
    data = build_chain_data(sft_task, eval_task, spec.num_synthetic_sft, spec.num_synthetic_val,
                            spec.num_synthetic_rl, spec.seed)
    task = {"name": "chains", "sft": asdict(sft_task), "eval": asdict(eval_task)}
    train_and_save(args.out, spec, data, args.device, times={"data_s": round(time.perf_counter() - t, 1)},
                   extra_report={"task": task}, group_of=steps_of)
    return 0


if __name__ == "__main__":
    sys.exit(main())
