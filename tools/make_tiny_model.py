#!/usr/bin/env python
"""Build the project's tiny Qwen3 model (character tokenizer + SFT warm start) as an HF checkpoint.

    python tools/make_tiny_model.py --out models/tiny-qwen3-arith [--sft-steps 1500]
    python tools/make_tiny_model.py --out /tmp/tiny --ship tiny-qwen3-arith   # train afresh, then ship the weights

The tiny configs run this automatically when their checkpoint is missing
(``policy.tiny_model.build_if_missing``); when weights built with the same spec are shipped in
``nemo_fp8/models/tiny_weights/`` (``--ship``), they are loaded instead of training.
"""

import argparse
import logging
import sys
from pathlib import Path

from nemo_fp8.models.tiny import SHIPPED_DIR, TinyModelSpec, build_tiny_model, ship_tiny_weights


def main(argv=None) -> int:
    defaults = TinyModelSpec()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output folder (must not exist)")
    p.add_argument("--sft-steps", type=int, default=defaults.sft_steps)
    p.add_argument("--max-operand", type=int, default=defaults.max_operand)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--ship", metavar="NAME",
                   help=f"train from scratch (never load shipped weights), then write the weights and their spec and "
                        f"sha256 to {SHIPPED_DIR.name}/NAME.safetensors / NAME.json, to commit")
    args = p.parse_args(argv)
    if Path(args.out).exists():
        print(f"error: --out {args.out} exists; remove it or pick another folder", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    spec = TinyModelSpec(sft_steps=args.sft_steps, max_operand=args.max_operand, seed=args.seed)
    build_tiny_model(args.out, spec, shipped_dir=None if args.ship else SHIPPED_DIR)
    if args.ship:
        print(f"shipped: {ship_tiny_weights(args.out, args.ship)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
