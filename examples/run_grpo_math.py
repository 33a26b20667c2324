#!/usr/bin/env python
"""GRPO on math problems with FP8 rollout and importance-sampling correction.

    python examples/run_grpo_math.py [--config FILE] [--resume | --resume-from step_N] [--overwrite]
                                     [key.sub=value ...]

With no ``--config`` it runs examples/configs/grpo_math_tiny_fp8.yaml, the embedded CPU default.
A run owns its logger.log_dir and checkpointing.checkpoint_dir: a fresh run into folders holding
another run stops (pass --resume, a new folder, or --overwrite), and a second run on the same
folders stops at once. Exit codes: 0 done, 1 a part failed (a Ray worker or engine died, a full disk, the
reward scorer; named, resumable), 2 configuration / setup error, 130 Ctrl-C (twice: at once), 143 SIGTERM.
"""

import argparse
import logging
import sys
from pathlib import Path

from nemo_fp8.config import ConfigError, load_config
from nemo_fp8.utils.console import configure_console_logging
from nemo_fp8.utils.run_dir import RunFailed, RunSetupError, Terminated, raise_on_sigterm

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "grpo_math_tiny_fp8.yaml"


def main() -> int:
    raise_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config (default: %(default)s)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--resume", action="store_true", help="continue from this run's newest checkpoint")
    group.add_argument("--resume-from", metavar="step_N", help="continue from an older checkpoint of this run")
    parser.add_argument("--overwrite", action="store_true",
                        help="fresh run into folders holding another run: delete its checkpoints, move its metrics "
                             "aside")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. grpo.max_num_steps=5")
    args = parser.parse_intermixed_args()  # overrides may come before and after the flags
    if args.overwrite and (args.resume or args.resume_from):
        parser.error("--overwrite starts a fresh run; it cannot be combined with --resume / --resume-from")
    configure_console_logging(logging.INFO)  # whole lines above the progress bar (nemo_fp8/utils/console.py)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from nemo_fp8.trainer import run

    try:
        final = run(cfg, resume=args.resume, resume_from=args.resume_from, overwrite=args.overwrite)
    except (ConfigError, RunSetupError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Terminated:
        print("terminated (SIGTERM)", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    acc = final.get("val/accuracy")
    print(f"done: {cfg.grpo.max_num_steps} steps; final validation accuracy "
          f"{'n/a' if acc is None else f'{acc:.3f}'}; logs in {cfg.logger.log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
