#!/usr/bin/env python
"""Side by side: runs of the same job in different precisions (the 8B mission command, FP8 vs BF16).

    python tools/mission_report.py fp8=logs/mission_fp8,gpu_mem_fp8.csv bf16=logs/mission_bf16,gpu_mem_bf16.csv \\
        --baseline bf16 --out logs/mission.md

Each run is ``name=log_dir[,nvidia_smi_csv][,host_memory_jsonl]``: the run's ``logger.log_dir`` (its
``metrics.jsonl``) and, optionally, an ``nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv -lms 500`` log
taken while it ran (``.csv``) and the host's used memory sampled while it ran (``.jsonl``, rows with
``host/used_gib``: ``sample_host_memory`` of ``tests/test_suites/common.sh``). Prints (and writes to ``--out``) one
table per run, a row per step (seconds per phase, rollout tokens/s), then one row per run: mean seconds per phase
(first step left out), rollout tokens/s, peak memory per GPU and the ratios to the baseline; then, where the runs
logged them, each run's memory and KV cache (:func:`memory_table`).

``--ceiling rows.json`` (``tools/bench_rollout.py --out``, one engine per precision on one GPU of the same machine,
at the run's per-engine batch) adds the rollout ceiling: for each FP8 run, the step it would take if its rollout ran
at the engine's own FP8 gain over BF16, the run's other phases as measured. A step target below that bound asks the
rollout for more than the engine gives; ``--targets fp8=0.80,fp8kv=0.72`` puts each target beside its bound.

``--train-ceiling rows.json`` (``tools/bench_train.py --workload rl --rl-packing packed --json``, on a GPU of the same
machine, at the runs' ``train_mb_tokens``) adds the training engine's own gain: BF16's ``raw f+b`` (megatron-core + TE
alone, one packed micro-batch) over the recipe's. The engines' bound of a run is its step with every phase as fast as
the engines allow: rollout at the rollout engine's gain, log-probs and training at the training engine's gain, refit and
the rest at the baseline's time, each phase at the run's own time where that is faster (so no run can beat its bound).
The verdict takes that bound; without a training ceiling, the run's own log-probs and training times stand.

``--scale-from 4=logs/suites/mission-8b-4gpu --gpus 8`` adds the scaling from another GPU count: for each run in
both that folder and these runs, step seconds and rollout tokens/s per GPU at each count, the speed-up and the
scaling efficiency (speed-up over the ratio of GPUs).
"""

import argparse
import json
import sys
from pathlib import Path

from nemo_fp8.utils.logger import read_metrics
from lab.parity_report import (peak_gpu_memory, side_by_side_table, step_table, summarize_run, timed_steps,
                               warmup_only)


def parse_run(spec: str) -> tuple[str, Path, Path | None, Path | None]:
    """``name=log_dir[,csv][,jsonl]`` -> (name, log_dir, the nvidia-smi csv or None, the host memory jsonl or None),
    the two files told apart by their suffix.

    Raises:
        ValueError: no ``=``, an empty name, or an extra item that is not one ``.csv`` and one ``.jsonl``.
    """
    name, sep, rest = spec.partition("=")
    if not sep or not name:
        raise ValueError(f"run {spec!r}: expected name=log_dir[,nvidia_smi_csv][,host_memory_jsonl]")
    log_dir, *extra = rest.split(",")
    files = {Path(e).suffix: Path(e) for e in extra}
    if len(files) != len(extra) or not set(files) <= {".csv", ".jsonl"}:
        raise ValueError(f"run {spec!r}: after the log dir, at most one nvidia-smi .csv and one host memory .jsonl")
    return name, Path(log_dir), files.get(".csv"), files.get(".jsonl")


# the bench_rollout engine whose FP8 gain bounds each run's rollout: the 8B configs pin vLLM's V2 model runner
# (vllm_cfg.model_runner: v2); the suite's fp8v1 / fp8kvv1 runs pin V1, vLLM's own choice for FP8
ENGINE_OF_RUN = {"fp8": "fp8-deepgemm-v2", "fp8kv": "fp8-deepgemm-kv-v2", "fp8tw": "fp8-deepgemm-v2",
                 "fp8v1": "fp8-deepgemm", "fp8kvv1": "fp8-deepgemm-kv"}


# the bench_train recipe each run trains with (the FP8 config's TE blockwise recipe; fp8tw: tensorwise)
RECIPE_OF_RUN = {"fp8": "e4m3-blockwise", "fp8kv": "e4m3-blockwise", "fp8tw": "e4m3-tensorwise",
                 "fp8v1": "e4m3-blockwise", "fp8kvv1": "e4m3-blockwise"}


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


def engines_bound(run: dict, base: dict, rollout_gain: float, train_gain: float | None) -> float:
    """Step / baseline step with every phase as fast as the engines allow (Amdahl over the step's phases):
    generation at the rollout engine's ``rollout_gain``, log-probs and training at the training engine's
    ``train_gain`` (``None``: no training ceiling), refit and the rest (``other_s``) at the baseline's time, each
    phase at the run's own time where that is faster:
    ``(min(g, bg / rollout_gain) + min(l + t, (bl + bt) / train_gain) + min(r, b_refit) + min(o, b_other))
    / b_step``, ``b*`` the baseline's seconds. No phase is slower than the run's own, so no run beats its bound, and
    the training engine's ``raw f+b`` gain also covers the optimizer step, which FP8 does not speed up: the bound
    is optimistic, and a target above it is out of the engines' reach.

    Args:
        run, base: :func:`summarize_run` summaries (``<phase>_s``, ``other_s``, ``step_s``: seconds).
        rollout_gain, train_gain: FP8 over BF16 speed of each engine (> 0).

    Raises:
        ValueError: a gain <= 0 or a baseline step of 0.
    """
    if rollout_gain <= 0 or (train_gain is not None and train_gain <= 0) or not base["step_s"]:
        raise ValueError(f"engines_bound: gains {rollout_gain}, {train_gain} and baseline step {base['step_s']} "
                         "must be > 0")
    generated = min(run["generation_s"], base["generation_s"] / rollout_gain)
    trained = run["logprobs_s"] + run["training_s"]
    if train_gain is not None:
        trained = min(trained, (base["logprobs_s"] + base["training_s"]) / train_gain)
    rest = min(run["refit_s"], base["refit_s"]) + min(run["other_s"], base["other_s"])
    return (generated + trained + rest) / base["step_s"]


def train_gains(train_rows: list[dict]) -> dict[str, float]:
    """{recipe: BF16 ``raw_ms`` / the recipe's} of ``tools/bench_train.py --workload rl`` packed rows (rows with an
    error or no ``raw_ms`` left out; empty without a BF16 row)."""
    raw = {r["recipe"]: r["raw_ms"] for r in train_rows if r.get("packed") and r.get("raw_ms") and "error" not in r}
    return {recipe: raw["bf16"] / ms for recipe, ms in raw.items()} if "bf16" in raw else {}


def ceiling_table(summaries: dict[str, dict], engine_rows: list[dict], baseline: str,
                  targets: dict[str, float], train_rows: list[dict] | None = None) -> str:
    """Markdown table, a row per FP8 run with an engine in ``engine_rows`` (``tools/bench_rollout.py`` rows): the
    engine's tokens/s over BF16's (``fixed_seeded_tok_s`` when both rows have it, the GRPO rollout's per-request
    seeds; else ``fixed_tok_s``), the run's rollout and step ratios, the step at the engine's gain
    (:func:`rollout_bound`), the training engine's gain from ``train_rows`` (``tools/bench_train.py`` rows; "-":
    none), the engines' bound (:func:`engines_bound`), the target and whether the engines can reach it.

    Raises:
        ValueError: no BF16 row in ``engine_rows`` or no ``baseline`` run.
    """
    by_precision = {r["precision"]: r for r in engine_rows if "error" not in r}
    if "bf16" not in by_precision or baseline not in summaries:
        raise ValueError(f"rollout ceiling: needs a bf16 engine row (have {sorted(by_precision)}) and the run "
                         f"{baseline!r} (have {sorted(summaries)})")
    base, bf16 = summaries[baseline], by_precision["bf16"]
    trains = train_gains(train_rows or [])
    head = ["run", "engine", "engine tok/s x bf16", "run rollout x bf16", "run step / bf16",
            "step at the engine's gain", "train engine x bf16", "run train x bf16", "engines' bound", "target",
            "within the engines' reach"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, s in summaries.items():
        engine = by_precision.get(ENGINE_OF_RUN.get(name, ""))
        if name == baseline or engine is None:
            continue
        key = "fixed_seeded_tok_s" if engine.get("fixed_seeded_tok_s") and bf16.get("fixed_seeded_tok_s") \
            else "fixed_tok_s"
        gain = engine[key] / bf16[key]
        train_gain = trains.get(RECIPE_OF_RUN.get(name, ""))
        bound = engines_bound(s, base, gain, train_gain)
        target = targets.get(name)
        reach = "-" if target is None else ("yes" if bound <= target else f"no: {bound:.2f} > {target:.2f}")
        run_train = (base["logprobs_s"] + base["training_s"]) / (s["logprobs_s"] + s["training_s"])
        lines.append("| " + " | ".join([
            name, f"{engine['precision']} ({'seeded' if key == 'fixed_seeded_tok_s' else 'unseeded'})", f"{gain:.3f}",
            f"{s['tokens_per_s'] / base['tokens_per_s']:.3f}", f"{s['step_s'] / base['step_s']:.3f}",
            f"{rollout_bound(s, base, gain):.3f}",
            "-" if train_gain is None else f"{RECIPE_OF_RUN[name]} {train_gain:.3f}", f"{run_train:.3f}",
            f"{bound:.3f}", "-" if target is None else f"{target:.2f}", reach]) + " |")
    return "\n".join(lines) + "\n"


# the parts of the refit and of the step's "other" time the trainer times (timing/<part>, seconds)
PARTS = ("refit/offload_trainer_state", "refit/transfer", "refit/offload_weights", "engine_wake", "engine_sleep",
         # inside the transfer (SyncStats.parts): the engines' update frame, the sender's export, the engines' loads
         "refit/transfer/start", "refit/transfer/export", "refit/transfer/load", "refit/transfer/finish",
         "kv_calibration", "reward", "data_processing",
         # inside the refit's parts: what the trainer's cache releases took (colocated, offload_trainer=false)
         "release_before/free_rebuilt", "release_before/gc", "release_before/empty_cache",
         "release_after/gc", "release_after/empty_cache")
# the timed parts of other_s
OTHER_PARTS = ("engine_wake", "engine_sleep", "kv_calibration", "reward", "advantages", "data_processing")


def parts_table(rows_by_run: dict[str, list[dict]], baseline: str, summaries: dict[str, dict] | None = None) -> str:
    """Markdown table, a row per run: mean seconds per step of each of ``PARTS`` over the timed steps (the first left
    out when more remain: ``timed_steps``, as ``summarize_run``), and each part's ratio to the baseline run's; "" when
    no run logged any part (runs of an older trainer). With ``summaries`` (``summarize_run`` of each run), a last
    column ``untimed s``: the run's ``other_s`` less its timed parts (``OTHER_PARTS``), the driver's work between
    the phases that no timer covers. No ratio where one of the two runs is timed on its warm-up only
    (``warmup_only``)."""
    means = {}
    for name, rows in rows_by_run.items():
        timed = timed_steps(rows)
        means[name] = {k: sum(r.get(f"timing/{k}", 0.0) for r in timed) / max(len(timed), 1) for k in PARTS
                       if any(f"timing/{k}" in r for r in timed)}
        if summaries and name in summaries:
            timed_other = sum(r.get(f"timing/{k}", 0.0) for r in timed for k in OTHER_PARTS) / max(len(timed), 1)
            means[name]["untimed"] = summaries[name]["other_s"] - timed_other
    parts = [k for k in PARTS + ("untimed",) if any(k in m for m in means.values())]
    if not any(k.startswith("refit/") or k.startswith("engine_") for k in parts):
        return ""
    base = means.get(baseline, {})
    base_warmup = warmup_only(rows_by_run.get(baseline, []))
    lines = ["| run | " + " | ".join(f"{k} s" for k in parts) + " |", "|---|" + "---|" * len(parts)]
    for name, m in means.items():
        cells, like = [], warmup_only(rows_by_run[name]) == base_warmup
        for k in parts:
            v, b = m.get(k), base.get(k) if like else None
            cells.append("-" if v is None else f"{v:.2f}" + (f" ({v / b:.2f}x)" if name != baseline and b else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# The H200's device-to-device copy bandwidth (GB/s), the refit transfer's floor (issue 70's arithmetic)
HBM_COPY_GBPS = 4300.0


def refit_bytes_table(rows_by_run: dict[str, list[dict]], hbm_gbps: float = HBM_COPY_GBPS) -> str:
    """Markdown table, a row per run that logged ``refit/gbytes``: over the timed steps (``timed_steps``) that refit,
    the mean GB sent (``refit/gbytes``), the transfer's seconds (``timing/refit/transfer``), its GB/s, and its floor:
    reading what was sent and writing it into the engine once each at ``hbm_gbps``, 2 x GB / ``hbm_gbps`` (ms), with
    the transfer's ratio to it; then refit + engine wake + sleep seconds a step (what issue 70 bounds); "" when no run
    logged the refit's bytes. A lower bound: the FP8 export also reads the bf16 weights it quantizes."""
    lines = []
    for name, rows in rows_by_run.items():
        timed = [r for r in timed_steps(rows) if r.get("refit/gbytes") and r.get("timing/refit/transfer")]
        if not timed:
            continue
        mean = lambda key: sum(r.get(key, 0.0) for r in timed) / len(timed)  # noqa: E731
        gb, transfer = mean("refit/gbytes"), mean("timing/refit/transfer")
        floor_s = 2 * gb / hbm_gbps
        total = mean("timing/refit") + mean("timing/engine_wake") + mean("timing/engine_sleep")
        steps = f"{len(timed)} (warm-up only)" if warmup_only(rows) else str(len(timed))
        lines.append(f"| {name} | {steps} | {gb:.2f} | {transfer:.3f} | {gb / transfer:.1f} | "
                     f"{floor_s * 1e3:.1f} | {transfer / floor_s:.0f}x | {total:.2f} |")
    if not lines:
        return ""
    head = ("| run | steps | GB sent | transfer s | GB/s | floor ms (2 x GB at "
            f"{hbm_gbps:,.0f} GB/s) | transfer / floor | refit + wake + sleep s |")
    return "\n".join([head, "|---|" + "---|" * 7, *lines]) + "\n"


def peak_host_memory(path: str | Path) -> float:
    """The largest ``host/used_gib`` of a host memory log (``sample_host_memory``'s JSON lines).

    Raises:
        ValueError: no row with a number for ``host/used_gib``.
    """
    values = [r["host/used_gib"] for r in read_metrics(Path(path)) if isinstance(r.get("host/used_gib"), (int, float))]
    if not values:
        raise ValueError(f"{path}: no host/used_gib row (expected sample_host_memory's JSON lines)")
    return max(values)


def _last(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return values[-1] if values else None


def _most(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return max(values) if values else None


def memory_table(rows_by_run: dict[str, list[dict]], gpu_peaks: dict[str, dict[int, float]],
                 host_peaks: dict[str, float], baseline: str) -> str:
    """Markdown table, a row per run: the engines' KV capacity in tokens (``generation/kv_capacity_tokens``, its
    last value; the ratio to the baseline run's), the trainer's peak allocated and reserved GiB
    (``memory/train_peak_*``, the largest over steps), what the trainer reserved beside the woken engine
    (``memory/beside_engine_reserved_gib``, colocated with its state kept; the largest over steps), the largest
    nvidia-smi reading over the GPUs (``gpu_peaks``: run -> {GPU: GiB}) and the host's peak used GiB
    (``host_peaks``); "-" where a run has no such record. "" when no run has any of them."""
    keys = ("generation/kv_capacity_tokens", "memory/train_peak_allocated_gib", "memory/train_peak_reserved_gib",
            "memory/beside_engine_reserved_gib")
    if not (gpu_peaks or host_peaks or any(_last(rows, k) is not None for rows in rows_by_run.values()
                                           for k in keys)):
        return ""
    base_kv = _last(rows_by_run.get(baseline, []), keys[0])
    head = ["run", "KV capacity tokens", f"KV / {baseline}", "trainer peak allocated GiB",
            "trainer peak reserved GiB", "trainer beside engine GiB", "peak GPU GiB (nvidia-smi)", "peak host GiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, rows in rows_by_run.items():
        kv = _last(rows, keys[0])
        alloc, reserved, beside = (_most(rows, k) for k in keys[1:])
        gpu, host = gpu_peaks.get(name), host_peaks.get(name)
        cells = [name, "-" if kv is None else f"{kv:,.0f}", f"{kv / base_kv:.2f}" if kv and base_kv else "-",
                 "-" if alloc is None else f"{alloc:.1f}", "-" if reserved is None else f"{reserved:.1f}",
                 "-" if beside is None else f"{beside:.1f}", f"{max(gpu.values()):.1f}" if gpu else "-",
                 "-" if host is None else f"{host:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_scale_from(spec: str) -> tuple[int, Path]:
    """``GPUS=DIR`` (``--scale-from 4=logs/suites/m4``) -> (GPUs, the other suite's output folder).

    Raises:
        ValueError: no ``=``, or a GPU count that is not a positive integer.
    """
    gpus, sep, folder = spec.partition("=")
    if not sep or not folder or not gpus.isdigit() or int(gpus) < 1:
        raise ValueError(f"--scale-from {spec!r}: expected GPUS=DIR, e.g. 4=logs/suites/mission-8b-4gpu")
    return int(gpus), Path(folder)


def scaling_table(here: dict[str, dict], gpus: int, there: dict[str, dict], there_gpus: int) -> str:
    """Markdown table, a row per run in both ``here`` (``gpus`` GPUs) and ``there`` (``there_gpus``), each a
    :func:`summarize_run` summary: step seconds and rollout tokens/s per GPU at each count, the step's speed-up
    (``there`` step / ``here`` step) and the scaling efficiency, speed-up / (``gpus`` / ``there_gpus``): 1.0 when
    twice the GPUs halve the step (strong scaling: both suites run the same step); "" when no run is in both."""
    names = [n for n in here if n in there]
    if not names:
        return ""
    head = ["run", f"step s ({there_gpus} GPUs)", f"step s ({gpus} GPUs)", "speed-up", "scaling efficiency",
            f"rollout tok/s per GPU ({there_gpus})", f"rollout tok/s per GPU ({gpus})", "per GPU ratio"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in names:
        a, b = there[n], here[n]
        speedup = a["step_s"] / b["step_s"]
        per_a, per_b = a["tokens_per_s"] / there_gpus, b["tokens_per_s"] / gpus
        lines.append(f"| {n} | {a['step_s']:.2f} | {b['step_s']:.2f} | {speedup:.2f} | "
                     f"{speedup / (gpus / there_gpus):.2f} | {per_a:,.0f} | {per_b:,.0f} | {per_b / per_a:.2f} |")
    return "\n".join(lines) + "\n"


def summarize_folder(folder: Path) -> dict[str, dict]:
    """{run: summarize_run} of every ``<folder>/<run>/metrics.jsonl`` (a suite's output folder).

    Raises:
        FileNotFoundError: no run with ``metrics.jsonl`` under ``folder``.
    """
    dirs = sorted(d for d in Path(folder).iterdir() if (d / "metrics.jsonl").is_file()) if Path(folder).is_dir() else []
    if not dirs:
        raise FileNotFoundError(f"--scale-from: no <run>/metrics.jsonl under {folder}")
    return {d.name: summarize_run(read_metrics(d / "metrics.jsonl")) for d in dirs}


def report(specs: list[str], baseline: str, ceiling: str | Path | None = None,
           targets: dict[str, float] | None = None, train_ceiling: str | Path | None = None,
           scale_from: tuple[int, Path] | None = None, gpus: int | None = None) -> str:
    """The markdown report of ``specs`` (see the module docstring), with the rollout ceiling of ``ceiling``
    (a ``bench_rollout.py --out`` file) and the training engine's gains of ``train_ceiling`` (a
    ``bench_train.py --json`` file) when given, and with ``scale_from`` (GPUs, another suite's output folder) and
    ``gpus`` (these runs' GPUs) the scaling from that count to this one (:func:`scaling_table`).

    Raises:
        ValueError: a bad spec, a run without training steps, a CSV that is not nvidia-smi's, a host memory log
            without ``host/used_gib`` (a ceiling file that cannot give the table, e.g. without a bf16 row, says so
            in its section instead), or ``scale_from`` without ``gpus``.
        FileNotFoundError: a run without ``metrics.jsonl``, a missing CSV, host memory log or ceiling file.
    """
    if scale_from is not None and not gpus:
        raise ValueError("scale_from needs gpus, the GPUs of these runs (--gpus)")
    parts, summaries, peaks, host_peaks, rows_by_run = [], {}, {}, {}, {}
    for name, log_dir, csv, host in map(parse_run, specs):
        path = log_dir / "metrics.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"run {name}: no {path}")
        rows = rows_by_run[name] = read_metrics(path)
        try:
            summaries[name] = summarize_run(rows)
        except ValueError as e:
            raise ValueError(f"run {name} ({path}): {e}") from None
        if csv is not None:
            peaks[name] = peak_gpu_memory(csv)
        if host is not None:
            host_peaks[name] = peak_host_memory(host)
        parts.append(f"### {name} ({log_dir})\n\n{step_table(rows)}")
    parts.append("### side by side (first step left out: warm-up)\n\n" + side_by_side_table(summaries, peaks, baseline))
    memory = memory_table(rows_by_run, peaks, host_peaks, baseline)
    if memory:
        parts.append("### memory and KV cache (largest over the run; KV capacity as last logged)\n\n" + memory)
    by_part = parts_table(rows_by_run, baseline, summaries)
    if by_part:
        parts.append("### the refit and the other time by part (seconds per step, first step left out)\n\n" + by_part)
    by_bytes = refit_bytes_table(rows_by_run)
    if by_bytes:
        parts.append("### the refit's bytes against its floor (first step left out)\n\n" + by_bytes)
    if ceiling is not None:
        path = Path(ceiling)
        if not path.is_file():
            raise FileNotFoundError(f"--ceiling: no {path}")
        train_rows = None
        if train_ceiling is not None:
            if not Path(train_ceiling).is_file():
                raise FileNotFoundError(f"--train-ceiling: no {train_ceiling}")
            train_rows = json.loads(Path(train_ceiling).read_text())
        try:  # a failed engine leaves the runs' report whole: the ceiling section says why it is missing
            table = ceiling_table(summaries, json.loads(path.read_text()), baseline, targets or {}, train_rows)
        except (ValueError, KeyError) as e:
            table = f"not computed: {e!r} ({path})\n"
        parts.append("### rollout ceiling (each engine alone on one GPU; the engines' bound: every phase at its "
                     "engine's gain, refit and the rest at the baseline's time, each at the run's own where "
                     "faster)\n\n" + table)
    if scale_from is not None:
        there_gpus, folder = scale_from
        table = scaling_table(summaries, gpus, summarize_folder(folder), there_gpus)
        parts.append(f"### scaling from {there_gpus} to {gpus} GPUs ({folder})\n\n"
                     + (table or "no run of the same name in both\n"))
    return "\n".join(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="name=log_dir[,nvidia_smi_csv][,host_memory_jsonl]")
    p.add_argument("--baseline", default="bf16", help="the run the ratios divide by (default: bf16)")
    p.add_argument("--out", help="also write the report here (markdown)")
    p.add_argument("--ceiling", help="tools/bench_rollout.py --out rows: the engine's own FP8 gain at the run's batch")
    p.add_argument("--targets", help="step / baseline targets per run, e.g. fp8=0.80,fp8kv=0.72")
    p.add_argument("--train-ceiling", help="tools/bench_train.py --workload rl --json rows: the training engine's "
                   "own FP8 gain (raw f+b) at the runs' train_mb_tokens")
    p.add_argument("--scale-from", help="GPUS=DIR: the same suite's runs at another GPU count (its output folder), "
                   "for the scaling table; needs --gpus")
    p.add_argument("--gpus", type=int, help="the GPUs these runs used (with --scale-from)")
    args = p.parse_args(argv)
    if args.train_ceiling and not args.ceiling:
        p.error("--train-ceiling needs --ceiling (the rollout engine's rows)")
    if args.scale_from and not args.gpus:
        p.error("--scale-from needs --gpus (the GPUs of these runs)")
    try:
        scale_from = parse_scale_from(args.scale_from) if args.scale_from else None
        md = report(args.runs, args.baseline, args.ceiling, parse_targets(args.targets), args.train_ceiling,
                    scale_from, args.gpus)
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
