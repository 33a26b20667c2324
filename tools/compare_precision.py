#!/usr/bin/env python
"""Run one config under several rollout precisions / IS settings and print a comparison table.

    python tools/compare_precision.py [--config FILE] [key=value ...]

Each variant is a full ``examples/run_grpo_math.py`` run (same seed, data and steps) with
overrides; the table reports, per variant, the mean ``gen_kl_error`` and
``token_mult_prob_error`` over all steps, the IS-weight range, and validation accuracy at the
start and at the end. Logs land in ``logs/compare/<variant>``.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {
    "bf16": ["policy.generation.vllm_cfg.precision=bfloat16", "loss_fn.use_importance_sampling_correction=false"],
    "bf16+tis": ["policy.generation.vllm_cfg.precision=bfloat16", "loss_fn.use_importance_sampling_correction=true"],
    "fp8": ["policy.generation.vllm_cfg.precision=fp8", "loss_fn.use_importance_sampling_correction=false",
            "loss_fn.allow_fp8_rollout_without_is_correction=true"],
    "fp8+tis": ["policy.generation.vllm_cfg.precision=fp8", "loss_fn.use_importance_sampling_correction=true"],
    "fp8kv+tis": ["policy.generation.vllm_cfg.precision=fp8", "policy.generation.vllm_cfg.kv_cache_dtype=fp8",
                  "loss_fn.use_importance_sampling_correction=true"],
}


def summarize(jsonl: Path) -> dict:
    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "mismatch/gen_kl_error" in r]
    vals = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    mean = lambda k: sum(r[k] for r in steps) / len(steps)  # noqa: E731
    return {"gen_kl_error": mean("mismatch/gen_kl_error"), "token_mult_prob_error": mean("mismatch/token_mult_prob_error"),
            "is_min": min(r["loss/is_weight_min"] for r in steps), "is_max": max(r["loss/is_weight_max"] for r in steps),
            "val_start": vals[0], "val_end": vals[-1], "reward_mean": mean("train/reward_mean")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "examples" / "configs" / "grpo_math_tiny_fp8.yaml"))
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {list(VARIANTS)}")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    results = {}
    for name in args.variants.split(","):
        if name not in VARIANTS:
            print(f"error: unknown variant {name!r}; valid: {', '.join(VARIANTS)}", file=sys.stderr)
            return 2
        out = REPO / "logs" / "compare" / name
        # --overwrite: each comparison starts its variants afresh (a run refuses another run's folders)
        cmd = [sys.executable, str(REPO / "examples" / "run_grpo_math.py"), "--overwrite", "--config", args.config,
               *VARIANTS[name],
               f"logger.log_dir={out}", f"checkpointing.checkpoint_dir={REPO / 'results' / 'compare' / name}",
               *args.overrides]
        print(f"[{name}] {' '.join(cmd[2:])}", flush=True)
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-2000:] + proc.stderr[-4000:], file=sys.stderr)
            return proc.returncode
        results[name] = summarize(out / "metrics.jsonl")
    cols = ["gen_kl_error", "token_mult_prob_error", "is_min", "is_max", "reward_mean", "val_start", "val_end"]
    print(f"\n{'variant':<10}" + "".join(f"{c:>23}" for c in cols))
    for name, r in results.items():
        print(f"{name:<10}" + "".join(f"{r[c]:>23.3e}" if c == "gen_kl_error" else f"{r[c]:>23.4f}" for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
