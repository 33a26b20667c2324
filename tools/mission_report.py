#!/usr/bin/env python
"""Side by side: runs of the same job in different precisions (the 8B mission command, FP8 vs BF16).

    python tools/mission_report.py fp8=logs/mission_fp8,gpu_mem_fp8.csv bf16=logs/mission_bf16,gpu_mem_bf16.csv \\
        --baseline bf16 --out logs/mission.md

Each run is ``name=log_dir[,nvidia_smi_csv]``: the run's ``logger.log_dir`` (its ``metrics.jsonl``) and, optionally,
an ``nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv -lms 500`` log taken while it ran. Prints (and
writes to ``--out``) one table per run, a row per step (seconds per phase, rollout tokens/s), then one row per
run: mean seconds per phase (first step left out), rollout tokens/s, peak memory per GPU and the ratios to the baseline.
"""

import argparse
import sys
from pathlib import Path

from nemo_fp8.utils.logger import read_metrics
from lab.parity_report import peak_gpu_memory, side_by_side_table, step_table, summarize_run


def parse_run(spec: str) -> tuple[str, Path, Path | None]:
    """``name=log_dir[,csv]`` -> (name, log_dir, csv or None).

    Raises:
        ValueError: no ``=`` or an empty name.
    """
    name, sep, rest = spec.partition("=")
    if not sep or not name:
        raise ValueError(f"run {spec!r}: expected name=log_dir[,nvidia_smi_csv]")
    log_dir, _, csv = rest.partition(",")
    return name, Path(log_dir), Path(csv) if csv else None


def report(specs: list[str], baseline: str) -> str:
    """The markdown report of ``specs`` (see the module docstring).

    Raises:
        ValueError: a bad spec, a run without training steps, or a CSV that is not nvidia-smi's.
        FileNotFoundError: a run without ``metrics.jsonl`` or a missing CSV.
    """
    parts, summaries, peaks = [], {}, {}
    for name, log_dir, csv in map(parse_run, specs):
        path = log_dir / "metrics.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"run {name}: no {path}")
        rows = read_metrics(path)
        try:
            summaries[name] = summarize_run(rows)
        except ValueError as e:
            raise ValueError(f"run {name} ({path}): {e}") from None
        if csv is not None:
            peaks[name] = peak_gpu_memory(csv)
        parts.append(f"### {name} ({log_dir})\n\n{step_table(rows)}")
    parts.append("### side by side (first step left out: warm-up)\n\n" + side_by_side_table(summaries, peaks, baseline))
    return "\n".join(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="name=log_dir[,nvidia_smi_csv]")
    p.add_argument("--baseline", default="bf16", help="the run the ratios divide by (default: bf16)")
    p.add_argument("--out", help="also write the report here (markdown)")
    args = p.parse_args(argv)
    try:
        md = report(args.runs, args.baseline)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(md)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
