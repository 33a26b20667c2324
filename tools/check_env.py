#!/usr/bin/env python3
"""Print this machine's GPU stack and which precision settings can run here.

    python tools/check_env.py                 # report + table (exit 0)
    python tools/check_env.py --json          # the same, machine-readable
    python tools/check_env.py --config examples/configs/grpo_math_8B_megatron_fp8.yaml [key=value ...]
                                              # exit 1, naming each key, if the config cannot run here

The probing lives in nemo_fp8/env_check.py (the trainer runs the same check before loading a model); installed,
the same report is the command ``nemo-fp8-check-env``.
"""

from nemo_fp8.env_check import main

if __name__ == "__main__":
    raise SystemExit(main())
