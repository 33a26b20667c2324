#!/usr/bin/env python
"""Run one config under several rollout / training precisions and compare learning: one plot, one table.

    python tools/compare_precision.py [--config FILE] [--variants a,b] [key=value ...]      # CPU (torch backends)
    python tools/compare_precision.py --backend gpu [--variants a,b] [key=value ...]        # GPU host (vLLM + Megatron)
    python tools/compare_precision.py --backend gpu --report-only                           # redraw from existing logs
    python tools/compare_precision.py --backend gpu --dry-run                               # print the commands

Each variant is a full ``examples/run_grpo_math.py`` run with the same config, seed, data and steps,
plus the variant's overrides (``VARIANTS`` / ``GPU_VARIANTS`` below; every variant sets all the
precision keys it depends on, so the base config's precision does not leak in). Logs go to
``<out-dir>/<variant>`` (default ``logs/compare/<backend>``), with the run's output in ``run.log``.
The report, ``<out-dir>/parity.png`` (validation accuracy, reward, gen_kl_error,
token_mult_prob_error; a curve per variant) and ``<out-dir>/parity.md`` (final and best accuracy,
mean mismatch, seconds per step split into generation / refit / log-probs / training, ratios to
``bf16``), is written from whatever variants have a ``metrics.jsonl``; a failed variant is
reported and the others still run.
"""

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nemo_fp8.utils.logger import read_metrics  # noqa: E402
from nemo_fp8.utils.parity import parity_table, plot_parity, summarize_run  # noqa: E402

_BF16 = ["policy.generation.vllm_cfg.precision=bfloat16", "policy.generation.vllm_cfg.kv_cache_dtype=auto"]
_FP8 = ["policy.generation.vllm_cfg.precision=fp8", "policy.generation.vllm_cfg.kv_cache_dtype=auto"]
_FP8_KV = ["policy.generation.vllm_cfg.precision=fp8", "policy.generation.vllm_cfg.kv_cache_dtype=fp8"]
_TIS = ["loss_fn.use_importance_sampling_correction=true", "loss_fn.truncated_importance_sampling_type=tis",
        "loss_fn.truncated_importance_sampling_ratio=2.0"]
_NO_IS = ["loss_fn.use_importance_sampling_correction=false"]
_NO_IS_FP8 = _NO_IS + ["loss_fn.allow_fp8_rollout_without_is_correction=true"]

# CPU: torch reference backends (rollout precision and IS only; the trainer is the config's).
VARIANTS = {
    "bf16": _BF16 + _NO_IS,
    "bf16+tis": _BF16 + _TIS,
    "fp8": _FP8 + _NO_IS_FP8,
    "fp8+tis": _FP8 + _TIS,
    "fp8kv+tis": _FP8_KV + _TIS,
}

# GPU: vLLM rollout + Megatron-core/TransformerEngine training (grpo_math_small_parity.yaml); each variant
# also fixes the trainer's precision.
_TRAIN_BF16 = ["policy.megatron_cfg.fp8_cfg.enabled=false", "policy.megatron_cfg.optimizer.bf16=true",
               "policy.megatron_cfg.optimizer.fp16=false"]
_TRAIN_FP8 = ["policy.megatron_cfg.fp8_cfg.enabled=true", "policy.megatron_cfg.fp8_cfg.fp8=e4m3",
              "policy.megatron_cfg.fp8_cfg.fp8_recipe=blockwise", "policy.megatron_cfg.optimizer.bf16=true",
              "policy.megatron_cfg.optimizer.fp16=false"]
_TRAIN_FP16 = ["policy.megatron_cfg.fp8_cfg.enabled=false", "policy.megatron_cfg.optimizer.bf16=false",
               "policy.megatron_cfg.optimizer.fp16=true"]
GPU_VARIANTS = {
    "bf16": _BF16 + _NO_IS + _TRAIN_BF16,                        # BF16 rollout + BF16 training
    "bf16-seed2": _BF16 + _NO_IS + _TRAIN_BF16 + ["grpo.seed=43"],  # the same, another sampling seed: noise
    "fp8+tis": _FP8 + _TIS + _TRAIN_BF16,                        # FP8 rollout + TIS
    "fp8": _FP8 + _NO_IS_FP8 + _TRAIN_BF16,                      # FP8 rollout, no correction
    "fp8kv+tis": _FP8_KV + _TIS + _TRAIN_BF16,                   # FP8 rollout + FP8 KV cache + TIS
    "fp8-e2e+tis": _FP8 + _TIS + _TRAIN_FP8,                     # FP8 rollout + FP8 training (blockwise e4m3)
    "fp8+fp16-train+tis": _FP8 + _TIS + _TRAIN_FP16,             # FP8 rollout + FP16 training (loss scaling)
}
DEFAULT_CONFIG = {"cpu": REPO / "examples" / "configs" / "grpo_math_tiny_fp8.yaml",
                  "gpu": REPO / "examples" / "configs" / "grpo_math_small_parity.yaml"}


def variant_command(backend: str, name: str, config: str, out_dir: Path, overrides: list[str]) -> list[str]:
    """The ``run_grpo_math.py`` command of one variant (``--overwrite``: each comparison starts it afresh).

    Raises:
        KeyError: unknown variant for ``backend``.
    """
    table = GPU_VARIANTS if backend == "gpu" else VARIANTS
    return [sys.executable, str(REPO / "examples" / "run_grpo_math.py"), "--overwrite", "--config", str(config),
            *table[name], f"logger.log_dir={out_dir / name}",
            f"checkpointing.checkpoint_dir={REPO / 'results' / 'compare' / backend / name}", *overrides]


def write_report(out_dir: Path, names: list[str], baseline: str = "bf16") -> tuple[Path, Path] | None:
    """``parity.png`` + ``parity.md`` in ``out_dir`` from ``<out_dir>/<name>/metrics.jsonl``; None when none exist.

    Variants without metrics, or without a training step, are listed below the table as missing.
    """
    runs, summaries, missing = {}, {}, []
    for name in names:
        path = out_dir / name / "metrics.jsonl"
        rows = read_metrics(path) if path.is_file() else []
        try:
            summaries[name] = summarize_run(rows)
        except ValueError as e:
            missing.append(f"{name}: {e if rows else 'no ' + str(path)}")
            continue
        runs[name] = rows
    if not runs:
        return None
    png = plot_parity(runs, out_dir / "parity.png", title=f"learning parity ({out_dir})")
    table = parity_table(summaries, baseline)
    notes = ("\nTimes are seconds per training step (first step left out: warm-up); `step s` excludes validation "
             "and checkpointing. Accuracy: `val/accuracy` (greedy when `grpo.val_greedy`).\n")
    if missing:
        notes += "\nMissing: " + "; ".join(missing) + "\n"
    md = out_dir / "parity.md"
    md.write_text(table + notes)
    print("\n" + table + notes)
    return png, md


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--config", help="default: grpo_math_tiny_fp8.yaml (cpu), grpo_math_small_parity.yaml (gpu)")
    p.add_argument("--variants", help="comma-separated subset (default: all of the backend's)")
    p.add_argument("--out-dir", help="default: logs/compare/<backend>")
    p.add_argument("--report-only", action="store_true", help="no runs: redraw the report from existing logs")
    p.add_argument("--dry-run", action="store_true", help="print each variant's command and exit")
    p.add_argument("overrides", nargs="*", help="key=value overrides for every variant")
    args = p.parse_args(argv)
    table = GPU_VARIANTS if args.backend == "gpu" else VARIANTS
    names = args.variants.split(",") if args.variants else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        print(f"error: unknown {args.backend} variant(s) {unknown}; valid: {', '.join(table)}", file=sys.stderr)
        return 2
    config = args.config or str(DEFAULT_CONFIG[args.backend])
    out_dir = Path(args.out_dir or REPO / "logs" / "compare" / args.backend).resolve()
    failed = []
    if not args.report_only:
        for name in names:
            cmd = variant_command(args.backend, name, config, out_dir, args.overrides)
            print(f"[{name}] {' '.join(cmd[1:])}", flush=True)
            if args.dry_run:
                continue
            (out_dir / name).mkdir(parents=True, exist_ok=True)
            with open(out_dir / name / "run.log", "w") as log:
                rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
            if rc != 0:
                tail = (out_dir / name / "run.log").read_text(errors="replace")[-3000:]
                print(f"[{name}] failed (exit {rc}); last output:\n{tail}", file=sys.stderr, flush=True)
                failed.append(name)
        if args.dry_run:
            return 0
    written = write_report(out_dir, names)
    if written is None:
        print(f"error: no variant has metrics under {out_dir}", file=sys.stderr)
        return 1
    print(f"report: {written[0]}, {written[1]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
