#!/usr/bin/env python
"""Side by side: runs of the same job in different precisions (the 8B mission command, FP8 vs BF16).

    python tools/mission_report.py fp8=logs/mission_fp8,gpu_mem_fp8.csv bf16=logs/mission_bf16,gpu_mem_bf16.csv \\
        --baseline bf16 --out logs/mission.md

Each run is ``name=log_dir[,nvidia_smi_csv]``: the run's ``logger.log_dir`` (its ``metrics.jsonl``) and, optionally,
an ``nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv -lms 500`` log taken while it ran. Prints (and
writes to ``--out``) one table per run, a row per step (seconds per phase, rollout tokens/s), then one row per
run: mean seconds per phase (first step left out), rollout tokens/s, peak memory per GPU and the ratios to the baseline.

``--ceiling rows.json`` (``tools/bench_rollout.py --out``, one engine per precision on one GPU of the same machine,
at the run's per-engine batch) adds the rollout ceiling: for each FP8 run, the step it would take if its rollout ran
at the engine's own FP8 gain over BF16, the run's other phases as measured. A step target below that bound asks the
rollout for more than the engine gives; ``--targets fp8=0.80,fp8kv=0.72`` puts each target beside its bound.
"""

import argparse
import json
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


# the bench_rollout engine whose FP8 gain bounds each run's rollout: the 8B configs pin vLLM's V2 model runner
# (vllm_cfg.model_runner: v2); the suite's fp8v1 / fp8kvv1 runs pin V1, vLLM's own choice for FP8
ENGINE_OF_RUN = {"fp8": "fp8-deepgemm-v2", "fp8kv": "fp8-deepgemm-kv-v2", "fp8tw": "fp8-deepgemm-v2",
                 "fp8v1": "fp8-deepgemm", "fp8kvv1": "fp8-deepgemm-kv"}


def parse_targets(spec: str | None) -> dict[str, float]:
    """``fp8=0.80,fp8kv=0.72`` -> {run: step / baseline target}.

    Raises:
        ValueError: an item without ``=`` or a value that is not a number.
    """
    out = {}
    for item in filter(None, (spec or "").split(",")):
        name, _, value = item.partition("=")  # no "=": value "" is no number either
        try:
            if not name:
                raise ValueError
            out[name] = float(value)
        except ValueError:
            raise ValueError(f"--targets item {item!r}: expected run=number, e.g. fp8=0.80") from None
    return out


def rollout_bound(run: dict, base: dict, engine_gain: float) -> float:
    """Step / baseline step if ``run``'s rollout ran at ``engine_gain`` x the baseline's rollout speed, its other
    phases as measured (Amdahl over the step's phases):
    ``(step - generation + baseline generation / engine_gain) / baseline step``.

    Args:
        run, base: :func:`summarize_run` summaries (``step_s``, ``generation_s`` in seconds).
        engine_gain: the engine's FP8 tokens/s over BF16's at the run's batch (> 0).

    Raises:
        ValueError: ``engine_gain`` <= 0 or a baseline step of 0.
    """
    if engine_gain <= 0 or not base["step_s"]:
        raise ValueError(f"rollout_bound: engine gain {engine_gain} and baseline step {base['step_s']} must be > 0")
    return (run["step_s"] - run["generation_s"] + base["generation_s"] / engine_gain) / base["step_s"]


def ceiling_table(summaries: dict[str, dict], engine_rows: list[dict], baseline: str,
                  targets: dict[str, float]) -> str:
    """Markdown table, a row per FP8 run with an engine in ``engine_rows`` (``tools/bench_rollout.py`` rows): the
    engine's tokens/s over BF16's (``fixed_seeded_tok_s`` when both rows have it, the GRPO rollout's per-request
    seeds; else ``fixed_tok_s``), the run's rollout and step ratios, the step at the engine's gain
    (:func:`rollout_bound`), the target and whether the engine's gain can reach it.

    Raises:
        ValueError: no BF16 row in ``engine_rows`` or no ``baseline`` run.
    """
    by_precision = {r["precision"]: r for r in engine_rows if "error" not in r}
    if "bf16" not in by_precision or baseline not in summaries:
        raise ValueError(f"rollout ceiling: needs a bf16 engine row (have {sorted(by_precision)}) and the run "
                         f"{baseline!r} (have {sorted(summaries)})")
    base, bf16 = summaries[baseline], by_precision["bf16"]
    head = ["run", "engine", "engine tok/s x bf16", "run rollout x bf16", "run step / bf16", "step at the engine's gain",
            "target", "within the engine's reach"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, s in summaries.items():
        engine = by_precision.get(ENGINE_OF_RUN.get(name, ""))
        if name == baseline or engine is None:
            continue
        key = "fixed_seeded_tok_s" if engine.get("fixed_seeded_tok_s") and bf16.get("fixed_seeded_tok_s") \
            else "fixed_tok_s"
        gain = engine[key] / bf16[key]
        bound = rollout_bound(s, base, gain)
        target = targets.get(name)
        reach = "-" if target is None else ("yes" if bound <= target else f"no: {bound:.2f} > {target:.2f}")
        lines.append("| " + " | ".join([
            name, f"{engine['precision']} ({'seeded' if key == 'fixed_seeded_tok_s' else 'unseeded'})", f"{gain:.3f}",
            f"{s['tokens_per_s'] / base['tokens_per_s']:.3f}", f"{s['step_s'] / base['step_s']:.3f}", f"{bound:.3f}",
            "-" if target is None else f"{target:.2f}", reach]) + " |")
    return "\n".join(lines) + "\n"


def report(specs: list[str], baseline: str, ceiling: str | Path | None = None,
           targets: dict[str, float] | None = None) -> str:
    """The markdown report of ``specs`` (see the module docstring), with the rollout ceiling of ``ceiling``
    (a ``bench_rollout.py --out`` file) when given.

    Raises:
        ValueError: a bad spec, a run without training steps, or a CSV that is not nvidia-smi's (a ceiling file
            that cannot give the table, e.g. without a bf16 row, says so in its section instead).
        FileNotFoundError: a run without ``metrics.jsonl``, a missing CSV or ceiling file.
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
    if ceiling is not None:
        path = Path(ceiling)
        if not path.is_file():
            raise FileNotFoundError(f"--ceiling: no {path}")
        try:  # a failed engine leaves the runs' report whole: the ceiling section says why it is missing
            table = ceiling_table(summaries, json.loads(path.read_text()), baseline, targets or {})
        except (ValueError, KeyError) as e:
            table = f"not computed: {e!r} ({path})\n"
        parts.append("### rollout ceiling (the engine alone, one GPU; the run's other phases as measured)\n\n" + table)
    return "\n".join(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="name=log_dir[,nvidia_smi_csv]")
    p.add_argument("--baseline", default="bf16", help="the run the ratios divide by (default: bf16)")
    p.add_argument("--out", help="also write the report here (markdown)")
    p.add_argument("--ceiling", help="tools/bench_rollout.py --out rows: the engine's own FP8 gain at the run's batch")
    p.add_argument("--targets", help="step / baseline targets per run, e.g. fp8=0.80,fp8kv=0.72")
    args = p.parse_args(argv)
    try:
        md = report(args.runs, args.baseline, args.ceiling, parse_targets(args.targets))
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
