#!/usr/bin/env python
"""GRPO on math problems with FP8 rollout and importance-sampling correction.

    python examples/run_grpo_math.py [--config FILE] [--resume] [key.sub=value ...]

With no ``--config`` it runs examples/configs/grpo_math_tiny_fp8.yaml, the embedded CPU default.
"""

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from nemo_fp8.config import ConfigError, load_config  # noqa: E402
from nemo_fp8.trainer import run  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "grpo_math_tiny_fp8.yaml"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config (default: %(default)s)")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. grpo.max_num_steps=5")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        final = run(cfg, resume=args.resume)
    except KeyboardInterrupt:
        return 130
    acc = final.get("val/accuracy")
    print(f"done: {cfg.grpo.max_num_steps} steps; final validation accuracy "
          f"{'n/a' if acc is None else f'{acc:.3f}'}; logs in {cfg.logger.log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
