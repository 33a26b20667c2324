#!/usr/bin/env python
"""Asynchronous GRPO (one step off policy) against the synchronous loop on the tiny CPU job, over seeds.

    python tools/async_vs_sync_tiny.py --out-dir logs/async-vs-sync                 # seeds 42 43 44, age 1
    python tools/async_vs_sync_tiny.py --out-dir logs/async-vs-sync --max-age 2 grpo.max_num_steps=80
    python tools/async_vs_sync_tiny.py --out-dir logs/async-vs-sync --report-only   # the table again
    python tools/async_vs_sync_tiny.py --out-dir logs/async-vs-sync --modes async \
        --sync-from logs/spread/native-seed{seed}                                     # synchronous runs made already

Each run is ``examples/run_grpo_math.py`` on its embedded default (``examples/configs/grpo_math_tiny_fp8.yaml``, 60
steps, validated on 512 problems at steps 0, 20, 40, 60) with ``grpo.seed`` set, one after the other (they share
the CPUs otherwise); the asynchronous runs add ``grpo.async_grpo.enabled=true``,
``grpo.async_grpo.max_trajectory_age_steps=<age>`` and ``policy.generation.colocated.enabled=false``. Logs go to
``<out-dir>/<sync|async-age<N>>-seed<S>/`` (``run.log``, ``metrics.jsonl``).

The table: per run the final validation accuracy and the wall time; per mode the mean over seeds and its standard
error (sample standard deviation / sqrt(seeds)). The asynchronous mode passes when its mean is at least the
synchronous mean minus one synchronous standard error (issue 53's CPU target: learning at age 1 within one standard
error of the synchronous run; doing better is no failure).
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from pathlib import Path

from nemo_fp8.utils.logger import read_metrics

REPO = Path(__file__).resolve().parents[1]


def run_one(folder: Path, seed: int, extra: list[str]) -> float:
    """Run the job into ``folder``; returns its wall seconds.

    Raises:
        RuntimeError: the run failed (its log named).
    """
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(REPO / "examples" / "run_grpo_math.py"), f"grpo.seed={seed}",
           f"logger.log_dir={folder}", f"checkpointing.checkpoint_dir={folder / 'ckpt'}", "checkpointing.keep_last_k=1",
           "--overwrite", *extra]
    t0 = time.monotonic()
    with open(folder / "run.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}; see {folder / 'run.log'}")
    seconds = time.monotonic() - t0
    (folder / "wall_seconds.txt").write_text(f"{seconds:.1f}\n")
    return seconds


def final_accuracy(folder: Path) -> float:
    """The last ``val/accuracy`` of the run's ``metrics.jsonl``."""
    rows = [r for r in read_metrics(folder / "metrics.jsonl") if "val/accuracy" in r]
    if not rows:
        raise RuntimeError(f"{folder}: no validation row in metrics.jsonl")
    return float(rows[-1]["val/accuracy"])


def mean_se(xs: list[float]) -> tuple[float, float]:
    """(mean, standard error = sample std / sqrt(n)); the error is 0 for one value."""
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, 0.0
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def report(out: Path, seeds: list[int], modes: list[str]) -> tuple[str, bool]:
    """The markdown table of ``out``'s runs and whether the asynchronous mode passes (module docstring)."""
    lines = ["| mode | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | standard error | wall s (mean) |",
             "|---|" + "---|" * len(seeds) + "---|---|---|"]
    stats = {}
    for mode in modes:
        accs = [final_accuracy(out / f"{mode}-seed{s}") for s in seeds]
        walls = [float((out / f"{mode}-seed{s}" / "wall_seconds.txt").read_text())
                 if (out / f"{mode}-seed{s}" / "wall_seconds.txt").is_file() else float("nan") for s in seeds]
        m, se = mean_se(accs)
        stats[mode] = (m, se)
        lines.append(f"| {mode} | " + " | ".join(f"{a:.4f}" for a in accs) + f" | {m:.4f} | {se:.4f} | "
                     f"{sum(walls) / len(walls):.0f} |")
    (ms, ses), (ma, _) = stats[modes[0]], stats[modes[1]]
    ok = ma >= ms - ses
    lines.append("")
    lines.append(f"{modes[1]} - sync: {ma - ms:+.4f} (sync standard error {ses:.4f}); "
                 f"{'PASS' if ok else 'FAIL'}: async mean {'>=' if ok else '<'} sync mean - one sync standard error")
    return "\n".join(lines), ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44])
    p.add_argument("--max-age", type=int, default=1, help="grpo.async_grpo.max_trajectory_age_steps")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--modes", choices=["both", "sync", "async"], default="both", help="which runs to make")
    p.add_argument("--sync-from", help="the synchronous runs' folders, '{seed}' in place of the seed (e.g. "
                   "tools/first_run_spread.py's native-seed{seed}: the same command); linked as sync-seed<S>")
    p.add_argument("overrides", nargs="*", help="key=value for every run")
    args = p.parse_args(argv)
    modes = ["sync", f"async-age{args.max_age}"]
    extra = {"sync": [], modes[1]: ["grpo.async_grpo.enabled=true", "policy.generation.colocated.enabled=false",
                                    f"grpo.async_grpo.max_trajectory_age_steps={args.max_age}"]}
    if args.sync_from:
        for seed in args.seeds:
            link, target = args.out_dir / f"sync-seed{seed}", Path(args.sync_from.format(seed=seed)).resolve()
            if not (target / "metrics.jsonl").is_file():
                raise SystemExit(f"--sync-from: {target} has no metrics.jsonl")
            args.out_dir.mkdir(parents=True, exist_ok=True)
            if not link.exists():
                link.symlink_to(target, target_is_directory=True)
    run_modes = {"both": modes, "sync": modes[:1], "async": modes[1:]}[args.modes]
    if not args.report_only:
        for seed in args.seeds:
            for mode in run_modes:
                seconds = run_one(args.out_dir / f"{mode}-seed{seed}", seed, [*extra[mode], *args.overrides])
                print(f"{mode} seed {seed}: {seconds:.0f} s, final accuracy "
                      f"{final_accuracy(args.out_dir / f'{mode}-seed{seed}'):.4f}", flush=True)
    table, ok = report(args.out_dir, args.seeds, modes)
    print(table)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
