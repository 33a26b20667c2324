#!/usr/bin/env python
"""Write a Qwen3-8B-shaped (or Qwen3-30B-A3B-shaped) HF checkpoint with random bf16 weights, shard by shard.

    python tools/write_random_checkpoint.py --out models/qwen3-8b-random --tokenizer-from models/small-qwen3
    python tools/write_random_checkpoint.py --shape qwen3-30b-a3b --out models/qwen3-30b-a3b-random \\
        --tokenizer-from models/small-qwen3
    python tools/write_random_checkpoint.py --out /tmp/r --set num_hidden_layers=2 --set hidden_size=128 \\
        --set intermediate_size=256 --set num_attention_heads=2 --set num_key_value_heads=1   # a tiny one

The model's vocabulary stays Qwen3's 151,936 rows; the tokenizer (``--tokenizer-from`` a folder, default: a
byte-level BPE trained here on synthetic arithmetic + GSM8K train, 8,192 tokens) may be smaller. Host memory
stays about one shard (``--max-shard-gib``). Qwen3-8B: 16.4 GB on disk.
"""

import argparse
import json
import os
import sys
from pathlib import Path

from lab.random_checkpoint import QWEN3_SHAPES, write_random_checkpoint

REPO = Path(__file__).resolve().parents[1]


def parse_set(items: list[str], cfg: dict) -> dict:
    """Apply ``key=value`` overrides (values parsed as JSON: ints, floats, lists, booleans) to a copy of ``cfg``.

    Raises:
        ValueError: an item without ``=``, or a key the shape does not have.
    """
    out = dict(cfg)
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r} is not key=value")
        if key not in cfg:
            raise ValueError(f"--set {key}: unknown key for this shape (valid: {', '.join(sorted(cfg))})")
        out[key] = json.loads(value)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output folder (must not exist)")
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(QWEN3_SHAPES))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--tokenizer-from", help="folder with an HF tokenizer (e.g. the small model's)")
    shared = Path(os.environ.get("NEMO_FP8_SHARED_DATA") or REPO.parent / "shared" / "data")
    p.add_argument("--gsm8k-dir", default=str(shared / "gsm8k"), help="GSM8K for the default tokenizer")
    p.add_argument("--max-shard-gib", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if Path(args.out).exists():
        print(f"error: --out {args.out} exists; remove it or pick another folder", file=sys.stderr)
        return 2
    try:
        cfg = parse_set(args.set, QWEN3_SHAPES[args.shape])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.tokenizer_from:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_from)
    else:
        from lab.small import SmallModelSpec, build_data, tokenizer_corpus, train_bpe_tokenizer

        spec = SmallModelSpec()
        gsm8k = Path(args.gsm8k_dir) if (Path(args.gsm8k_dir) / "train.jsonl").is_file() else None
        print(f"[random-ckpt] training a {spec.vocab_size}-token BPE tokenizer on synthetic arithmetic"
              f"{' + GSM8K train' if gsm8k else ' (GSM8K not found at ' + args.gsm8k_dir + ')'}", flush=True)
        tokenizer = train_bpe_tokenizer(tokenizer_corpus(build_data(spec, gsm8k)), spec.vocab_size)
    report = write_random_checkpoint(args.out, cfg, tokenizer, max_shard_gib=args.max_shard_gib, seed=args.seed)
    print(f"[random-ckpt] {report['parameters'] / 1e9:.2f}B parameters, {report['bytes'] / 1e9:.1f} GB in "
          f"{report['shards']} shards, tokenizer {report['tokenizer_vocab']} / vocab {report['vocab_size']}, "
          f"{report['seconds']} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
