#!/usr/bin/env python
"""README command 1 on several seeds and CPU kernel variants: does the first run's claim hold on every machine?

    python tools/first_run_spread.py                                   # seeds 42 43 44 x kernels native, aten-default, mkl-compatible
    python tools/first_run_spread.py --seeds 42 43 --kernels native,aten-avx2 grpo.max_num_steps=80
    python tools/first_run_spread.py --report-only                     # the table again, from the runs' logs

A run's numbers depend on which CPU kernels torch picks: MKL and oneDNN choose kernels (and with them
summation orders) by CPU type, and RL amplifies last-bit differences through sampling, so the same seed is a
different run on another CPU. The variables below make any x86-64 machine run the kernels of another one:
``ATEN_CPU_CAPABILITY`` (torch's own vectorized kernels: ``default`` = no SIMD, ``avx2``, ``avx512``) and
``MKL_CBWR`` (MKL's conditional numerical reproducibility branch: ``COMPATIBLE``, ``AVX2``, ``AVX512``); a
branch above what the CPU has is not a variant this machine can show (``--kernels`` refuses it).

Each run is ``examples/run_grpo_math.py`` on its embedded default (the CPU config) with ``grpo.seed`` set and
the overrides given, logs in ``<out-dir>/<kernels>-seed<N>/`` (``run.log``, ``metrics.jsonl``). The table: the
validation accuracies, the gain (last - first), how far the last is below the best, one standard error of the
best (``sqrt(p (1 - p) / n)``, n = validated problems), and whether the run passes the first run's claim: a
gain of at least ``--min-gain`` and a last point within one standard error of the best.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from nemo_fp8.utils.logger import read_metrics

# name -> environment of the run (on top of this process's; a variable set to None is removed)
KERNELS: dict[str, dict[str, str | None]] = {
    "native": {"ATEN_CPU_CAPABILITY": None, "MKL_CBWR": None},
    "aten-default": {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": None},
    "aten-avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": None},
    "aten-avx512": {"ATEN_CPU_CAPABILITY": "avx512", "MKL_CBWR": None},
    "mkl-compatible": {"ATEN_CPU_CAPABILITY": None, "MKL_CBWR": "COMPATIBLE"},
    "mkl-avx2": {"ATEN_CPU_CAPABILITY": None, "MKL_CBWR": "AVX2"},
    "mkl-avx512": {"ATEN_CPU_CAPABILITY": None, "MKL_CBWR": "AVX512"},
}
DEFAULT_KERNELS = ("native", "aten-default", "mkl-compatible")


def cpu_flags() -> set[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def unsupported_kernels(names: list[str], flags: set[str]) -> list[str]:
    """The kernel variants of ``names`` this CPU cannot run, each as ``name: why``; unknown names too."""
    bad = []
    for name in names:
        if name not in KERNELS:
            bad.append(f"{name}: unknown (valid: {', '.join(KERNELS)})")
        elif name.endswith("avx512") and "avx512f" not in flags:
            bad.append(f"{name}: this CPU has no AVX-512")
        elif name.endswith("avx2") and "avx2" not in flags:
            bad.append(f"{name}: this CPU has no AVX2")
    return bad


def run_env(kernels: str) -> dict[str, str]:
    """This process's environment with the variables of kernel variant ``kernels``."""
    env = dict(os.environ)
    for key, value in KERNELS[kernels].items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run_one(out: Path, kernels: str, seed: int, overrides: list[str]) -> int:
    """Run README command 1 once into ``out``; returns its exit code (its output is in ``out/run.log``)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(REPO / "examples" / "run_grpo_math.py"), "--overwrite", f"grpo.seed={seed}",
           f"logger.log_dir={out}", f"checkpointing.checkpoint_dir={out / 'checkpoints'}",
           "checkpointing.enabled=false", *overrides]
    with open(out / "run.log", "w") as log:
        return subprocess.run(cmd, env=run_env(kernels), stdout=log, stderr=subprocess.STDOUT, cwd=REPO).returncode


def summarize(rows: list[dict], min_gain: float) -> dict | None:
    """The validation points of one run and its verdict; None when it validated fewer than twice.

    Returns:
        dict: ``accs`` (validation accuracies in step order), ``n`` (problems validated), ``gain`` (last - first),
        ``below_best`` (best - last), ``se_best`` (one standard error of the best, binomial), ``passed``.
    """
    vals = sorted((r for r in rows if isinstance(r.get("val/accuracy"), (int, float))), key=lambda r: r["step"])
    if len(vals) < 2:
        return None
    accs = [float(r["val/accuracy"]) for r in vals]
    n = int(vals[-1].get("val/num_samples") or 0)
    best = max(accs)
    se = math.sqrt(best * (1 - best) / n) if n else float("nan")
    gain, below = accs[-1] - accs[0], best - accs[-1]
    return {"accs": accs, "n": n, "gain": gain, "below_best": below, "se_best": se,
            "passed": gain >= min_gain and below <= se}


def table(out_dir: Path, runs: list[tuple[str, int]], min_gain: float) -> str:
    """The markdown table of ``runs`` ((kernels, seed) pairs) from their logs in ``out_dir``, with a summary line."""
    lines = ["| kernels | seed | validation accuracy | gain | best - last (1 se) | pass |", "|---|---|---|---|---|---|"]
    gains, passed = [], 0
    for kernels, seed in runs:
        metrics = out_dir / f"{kernels}-seed{seed}" / "metrics.jsonl"
        s = summarize(read_metrics(metrics), min_gain) if metrics.is_file() else None
        if s is None:
            lines.append(f"| {kernels} | {seed} | (no run: {metrics}) | | | no |")
            continue
        gains.append(s["gain"])
        passed += s["passed"]
        lines.append(f"| {kernels} | {seed} | {' '.join(f'{a:.3f}' for a in s['accs'])} | {s['gain']:+.3f} | "
                     f"{s['below_best']:.3f} ({s['se_best']:.3f}) | {'yes' if s['passed'] else 'no'} |")
    if gains:
        mean = sum(gains) / len(gains)
        lines.append(f"\n{passed} of {len(runs)} pass (gain >= {min_gain:+.2f} and last within 1 se of best); "
                     f"gains {min(gains):+.3f} to {max(gains):+.3f}, mean {mean:+.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44])
    p.add_argument("--kernels", default=",".join(DEFAULT_KERNELS),
                   help=f"comma-separated kernel variants (valid: {', '.join(KERNELS)})")
    p.add_argument("--out-dir", type=Path, default=REPO / "logs" / "first-run-spread")
    p.add_argument("--min-gain", type=float, default=0.10)
    p.add_argument("--report-only", action="store_true", help="print the table from existing logs")
    p.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = p.parse_args(argv)
    kernels = [k for k in args.kernels.split(",") if k]
    bad = unsupported_kernels(kernels, cpu_flags())
    if bad and not args.report_only:
        p.error("--kernels: " + "; ".join(bad))
    runs = [(k, s) for k in kernels for s in args.seeds]
    if not args.report_only:
        for i, (k, seed) in enumerate(runs, 1):
            t0 = time.monotonic()
            rc = run_one(args.out_dir / f"{k}-seed{seed}", k, seed, args.overrides)
            print(f"[{i}/{len(runs)}] {k} seed {seed}: rc {rc}, {time.monotonic() - t0:.0f} s", flush=True)
    report = table(args.out_dir, runs, args.min_gain)
    print(report)
    (args.out_dir / "table.md").parent.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "table.md").write_text(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
