#!/usr/bin/env python
"""Build the project's small Qwen3-shaped model (BPE tokenizer, SFT on arithmetic + GSM8K) as an HF checkpoint.

    python tools/make_small_model.py --out models/small-qwen3            # GPU host: ~200M params, <= 10 min of training
    python tools/make_small_model.py --out models/small-qwen3 --max-steps 2000 --deterministic   # the same bits on
                                                                         # every host of the same GPU type and stack
    python tools/make_small_model.py --out /tmp/s --hidden-size 128 --intermediate-size 256 --num-layers 2 \\
        --num-heads 1 --num-kv-heads 1 --vocab-size 1024 --max-steps 5 --device cpu   # a CPU smoke build

Writes ``config.json``, ``model.safetensors`` (bf16), ``tokenizer.json``, ``tokenizer_config.json`` (+ chat
template), ``generation_config.json``, ``data/{rl_train,val}.jsonl`` (GRPO's data in
``examples/configs/grpo_math_small_parity.yaml``) and ``small_model_spec.json`` (parameters, held-out greedy
accuracy, training tokens/s, seconds per phase). Every dimension is a multiple of 128.
"""

import argparse
import logging
import os
import sys
from dataclasses import fields
from pathlib import Path

from lab.small import SmallModelSpec, build_small_model, check_spec

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


def main(argv=None) -> int:
    defaults = SmallModelSpec()
    types = {f.name: f.type for f in fields(SmallModelSpec)}
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output folder (must not exist)")
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
        p.add_argument("--" + flag.replace("_", "-"), type=kind, default=getattr(defaults, name),
                       help=f"(default {getattr(defaults, name)})")
    args = p.parse_args(argv)
    if Path(args.out).exists():
        print(f"error: --out {args.out} exists; remove it or pick another folder", file=sys.stderr)
        return 2
    spec = SmallModelSpec(**{name: getattr(args, flag) for flag, name in FLAGS.items()},
                          synthetic_ops=tuple(args.synthetic_ops), deterministic=args.deterministic)
    try:
        check_spec(spec)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[small] about {spec.parameters_estimate() / 1e6:.1f}M parameters", flush=True)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    build_small_model(args.out, spec, gsm8k_dir=None if args.no_gsm8k else args.gsm8k_dir, device=args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
