#!/usr/bin/env python
"""Build the project's tiny Qwen3 model (character tokenizer + SFT warm start) as an HF checkpoint.

    python tools/make_tiny_model.py --out models/tiny-qwen3-arith [--sft-steps 1500]

The tiny configs run this automatically when their checkpoint is missing
(``policy.tiny_model.build_if_missing``).
"""

import argparse
import logging
import sys
from pathlib import Path

from nemo_fp8.models.tiny import TinyModelSpec, build_tiny_model


def main() -> int:
    defaults = TinyModelSpec()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output folder (must not exist)")
    p.add_argument("--sft-steps", type=int, default=defaults.sft_steps)
    p.add_argument("--max-operand", type=int, default=defaults.max_operand)
    p.add_argument("--seed", type=int, default=defaults.seed)
    args = p.parse_args()
    if Path(args.out).exists():
        print(f"error: --out {args.out} exists; remove it or pick another folder", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    build_tiny_model(args.out, TinyModelSpec(sft_steps=args.sft_steps, max_operand=args.max_operand, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
