#!/usr/bin/env python
"""Run one config under several rollout / training precisions and compare learning: one plot, one table.

    python tools/compare_precision.py [--config FILE] [--variants a,b] [key=value ...]      # CPU (torch backends)
    python tools/compare_precision.py --backend gpu [--variants a,b] [key=value ...]        # GPU host (vLLM + Megatron)
    python tools/compare_precision.py --backend gpu --report-only                           # redraw from existing logs
    python tools/compare_precision.py --backend gpu --dry-run                               # print the commands
    python tools/compare_precision.py --backend gpu --report-only --also logs/compare/gpu-b  # + another host's runs
    python tools/compare_precision.py --backend gpu --parallel 8                            # all variants at once, one GPU
    python tools/compare_precision.py --backend gpu --variants fp8+tis-seed2,bf16-seed3     # any variant, another seed
    python tools/compare_precision.py --backend gpu --devices 0,1,2,3 \\
        --config examples/configs/recipes/llm/parity-reasoning/bf16.yaml   # one GPU per run, four at once

Each variant is a full ``examples/run_grpo_math.py`` run with the same config, seed, data and steps,
plus the variant's overrides (``VARIANTS`` / ``GPU_VARIANTS`` below; every variant sets all the
precision keys it depends on, so the base config's precision does not leak in). Logs go to
``<out-dir>/<variant>`` (default ``logs/compare/<backend>``), with the run's output in ``run.log``.
The report, ``<out-dir>/parity.png`` (validation accuracy, reward, gen_kl_error,
token_mult_prob_error; a curve per variant) and ``<out-dir>/parity.md`` (final and best accuracy,
mean mismatch, seconds per step split into generation / refit / log-probs / training, ratios to
``bf16``; below it each run's training reward minus ``bf16``'s, paired by step), is written from
whatever variants have a ``metrics.jsonl``; a failed variant is reported and the others still run. With several
seeds of a variant the report adds validation accuracy over seeds with standard errors, the gain over the run, the
difference from ``bf16``, TIS truncation and response length over training, also written to ``parity.json`` for
``tools/check_metrics.py <out-dir>/parity.json --by variant 'bf16/gain >= 0.15'``.

Runs side by side are bound each to its own block of the CPUs (``--no-cpu-bind`` to leave them unbound): each run
sizes its torch threads and its local Ray cluster to the CPUs it may run on, not to the whole machine.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from nemo_fp8.utils.cpus import affinity_cpus, split_cpus
from nemo_fp8.utils.logger import read_metrics
from lab.parity_report import (parity_table, reward_gap_table, seed_group_table, seed_summaries, seed_summary_table,
                               summarize_run)
from nemo_fp8.utils.plots import plot_parity, split_seed

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
    "fp8kv": _FP8_KV + _NO_IS_FP8 + _TRAIN_BF16,                 # FP8 rollout + FP8 KV cache, no correction
    "fp8-e2e+tis": _FP8 + _TIS + _TRAIN_FP8,                     # FP8 rollout + FP8 training (blockwise e4m3)
    "fp8+fp16-train+tis": _FP8 + _TIS + _TRAIN_FP16,             # FP8 rollout + FP16 training (loss scaling)
}


def variant_overrides(backend: str, name: str) -> list[str]:
    """The overrides of variant ``name``: its table entry, or ``<variant>-seed<N>`` (N >= 2) for any variant
    with another sampling seed, ``grpo.seed=41+N`` (the configs' seed is 42: ``-seed2`` is 43, as in
    ``bf16-seed2``). Prompts and their order follow ``data.seed`` and stay the same, so a second seed of an
    FP8 variant is a second, independent rollout stream to set against BF16's seeds.

    Raises:
        KeyError: not a variant of ``backend``'s table, nor one of them with a ``-seed<N>`` suffix (N >= 2).
    """
    table = GPU_VARIANTS if backend == "gpu" else VARIANTS
    if name in table:
        return list(table[name])
    base, seed = split_seed(name)
    if base in table and seed >= 2:
        return [*table[base], f"grpo.seed={41 + seed}"]
    raise KeyError(name)


DEFAULT_CONFIG = {"cpu": REPO / "examples" / "configs" / "grpo_math_tiny_fp8.yaml",
                  "gpu": REPO / "examples" / "configs" / "grpo_math_small_parity.yaml"}


def variant_command(backend: str, name: str, config: str, out_dir: Path, overrides: list[str]) -> list[str]:
    """The ``run_grpo_math.py`` command of one variant (``--overwrite``: each comparison starts it afresh).

    Raises:
        KeyError: unknown variant for ``backend``.
    """
    return [sys.executable, str(REPO / "examples" / "run_grpo_math.py"), "--overwrite", "--config", str(config),
            *variant_overrides(backend, name), f"logger.log_dir={out_dir / name}",
            f"checkpointing.checkpoint_dir={checkpoint_dir(out_dir) / name}", *overrides]


def checkpoint_dir(out_dir: Path) -> Path:
    """Where a comparison's variants checkpoint: ``results/<out_dir below logs/>`` (``logs/compare/gpu`` ->
    ``results/compare/gpu``), else ``<out_dir>/checkpoints``; one per ``--out-dir``, so two comparisons
    with different ``--out-dir`` never share (and lock) a checkpoint folder."""
    out_dir = Path(out_dir).resolve()
    try:
        return REPO / "results" / out_dir.relative_to(REPO / "logs")
    except ValueError:
        return out_dir / "checkpoints"


_GPU_MEM_KEY = "policy.generation.vllm_cfg.gpu_memory_utilization"
_KV_BYTES_KEY = "policy.generation.vllm_cfg.kv_cache_memory_bytes"


def shared_gpu_memory_utilization(parallel: int, engines_share: float = 0.45) -> float:
    """Each vLLM engine's ``gpu_memory_utilization`` when ``parallel`` variants share one GPU.

    vLLM sizes its KV cache to this fraction of the whole GPU at start and takes it back on every
    wake-up; the engines together get ``engines_share`` of the GPU, the rest is left to the
    ``parallel`` Megatron trainers (weights, gradients, Adam state and activations of the small model).
    """
    return round(engines_share / parallel, 3)


def parallel_overrides(overrides: list[str], parallel: int, kv_cache_gib: float) -> list[str]:
    """``overrides`` plus each engine's memory keys when ``parallel`` > 1 GPU variants share one GPU.

    ``gpu_memory_utilization`` (vLLM's start-up check: that much must be free) is set to
    :func:`shared_gpu_memory_utilization`, and ``kv_cache_memory_bytes`` to ``kv_cache_gib`` GiB: a
    fixed KV cache skips vLLM's memory profiling, whose measure of the engine's own use is the GPU's
    free memory before and after (``vllm/v1/worker/gpu_worker.py``, ``determine_available_memory``)
    and fails when another variant's engine sleeps or its trainer offloads meanwhile. A key given
    in ``overrides`` wins.
    """
    out = list(overrides)
    if parallel <= 1:
        return out
    given = {o.split("=", 1)[0] for o in out}
    if _GPU_MEM_KEY not in given:
        out.append(f"{_GPU_MEM_KEY}={shared_gpu_memory_utilization(parallel)}")
    if _KV_BYTES_KEY not in given:
        out.append(f"{_KV_BYTES_KEY}={int(kv_cache_gib * 2**30)}")
    return out


def run_variants(commands: dict[str, list[str]], out_dir: Path, parallel: int = 1,
                 stagger_s: float = 0.0, poll_s: float = 1.0, devices: list[str] | None = None,
                 cpus: list[int] | None = None, min_cpus_per_run: int = 4) -> list[str]:
    """Run each variant's command, starts ``stagger_s`` apart; returns the failed.

    Without ``devices`` at most ``parallel`` run at once and see every GPU of the machine. With ``devices`` (GPU
    indices) each run sees one of them (``CUDA_VISIBLE_DEVICES``, the least loaded at its start), at most
    ``parallel`` runs per device: ``devices=["0", "1", "2", "3"]``, ``parallel=1`` runs four variants at once, one
    GPU each. Each run's output goes to ``<out_dir>/<variant>/run.log`` (its first line names its device); a
    failed variant's last output is printed and the others go on.

    With ``cpus`` (CPU ids, e.g. this process's affinity) and more than one run at once, the CPUs are split into
    one block per concurrent run (:func:`nemo_fp8.utils.cpus.split_cpus`; a device's runs get neighbouring
    blocks) and each run is bound to a free block (its affinity, inherited by its Ray cluster, engines and
    trainer, which size their threads and Ray CPUs to it) with ``OMP_NUM_THREADS`` set to the block's size
    unless the environment sets it: otherwise each run sizes its thread pools to the whole machine. Blocks of
    fewer than ``min_cpus_per_run`` CPUs leave the runs unbound (said once).
    """
    pending, running, failed = list(commands), {}, []
    load = {d: 0 for d in devices or []}
    capacity = parallel * len(load) if load else parallel
    blocks = None
    if cpus and capacity > 1:
        blocks = split_cpus(cpus, capacity, min_cpus_per_run)
        if blocks is None:
            print(f"[compare_precision] {len(cpus)} CPUs for {capacity} runs at once: fewer than {min_cpus_per_run} "
                  "each, so the runs are not bound to CPUs", flush=True)
    free_blocks = set(range(capacity)) if blocks else set()
    last_start = -float("inf")
    while pending or running:
        for name, (proc, log, dev, block) in list(running.items()):
            rc = proc.poll()
            if rc is None:
                continue
            log.close()
            del running[name]
            if dev is not None:
                load[dev] -= 1
            if block is not None:
                free_blocks.add(block)
            if rc != 0:
                tail = (out_dir / name / "run.log").read_text(errors="replace")[-3000:]
                print(f"[{name}] failed (exit {rc}); last output:\n{tail}", file=sys.stderr, flush=True)
                failed.append(name)
            else:
                print(f"[{name}] done", flush=True)
        if pending and len(running) < capacity and time.monotonic() - last_start >= stagger_s:
            name = pending.pop(0)
            (out_dir / name).mkdir(parents=True, exist_ok=True)
            log = open(out_dir / name / "run.log", "w")
            dev, env, block, bind = None, dict(os.environ), None, None
            if load:
                dev = min(load, key=load.get)
                load[dev] += 1
                env["CUDA_VISIBLE_DEVICES"] = dev
                log.write(f"[compare_precision] CUDA_VISIBLE_DEVICES={dev}\n")
            if blocks:
                # device i owns blocks i*parallel .. i*parallel+parallel-1 and runs at most parallel at once
                block = min(b for b in free_blocks if dev is None or b // parallel == list(load).index(dev))
                free_blocks.discard(block)
                bind = blocks[block]
                env.setdefault("OMP_NUM_THREADS", str(len(bind)))
                log.write(f"[compare_precision] CPUs {_cpu_ranges(bind)} (OMP_NUM_THREADS={env['OMP_NUM_THREADS']})\n")
            log.flush()
            proc = subprocess.Popen(commands[name], cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    preexec_fn=(lambda cpus=bind: os.sched_setaffinity(0, cpus)) if bind else None)
            running[name] = (proc, log, dev, block)
            last_start = time.monotonic()
            print(f"[{name}] started{'' if dev is None else ' on GPU ' + dev} ({len(running)} running, "
                  f"{len(pending)} waiting)", flush=True)
            continue
        time.sleep(poll_s)
    return failed


def _cpu_ranges(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (taskset's notation)."""
    spans, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            spans.append(f"{start}-{c}" if c != start else str(c))
            start = None
    return ",".join(spans)


def _cut_note(over_seeds: list[dict]) -> str:
    """``" (later steps of a, b left out)"`` for the runs :func:`seed_summaries` read only in part, else ``""``."""
    cut = list(dict.fromkeys(label for row in over_seeds for label in row["cut_runs"]))
    return f" (later steps of {', '.join(cut)} left out)" if cut else ""


def report_sources(out_dir: Path, names: list[str], also: list[Path] = ()) -> dict[str, Path]:
    """Label -> ``metrics.jsonl`` of each run in the report: ``<out_dir>/<name>`` for ``names``, then every
    variant folder with metrics under each ``also`` folder (another comparison's ``--out-dir``: runs split
    over two hosts), labelled ``<name>@<folder name>`` when the name is taken already."""
    sources = {name: out_dir / name / "metrics.jsonl" for name in names}
    for extra in also:
        for sub in sorted(Path(extra).iterdir()) if Path(extra).is_dir() else []:
            if (sub / "metrics.jsonl").is_file():
                label = sub.name if sub.name not in sources else f"{sub.name}@{Path(extra).name}"
                sources[label] = sub / "metrics.jsonl"
    return sources


def _baseline_runs(sources: dict[str, Path], baseline: str, present) -> dict[Path, dict[int, str]]:
    """Folder -> {sampling seed: label} of the ``baseline`` runs in ``present`` (those with a training step)."""
    runs: dict[Path, dict[int, str]] = {}
    for label, path in sources.items():
        name, seed = split_seed(path.parent.name)
        if label in present and name == baseline:
            runs.setdefault(path.parent.parent, {})[seed] = label
    return runs


def baseline_pairs(sources: dict[str, Path], baseline: str, present) -> dict[str, str]:
    """Label -> the baseline run it is set against in the reward pairing and the plot: the run of ``baseline`` with
    the same sampling seed in the same folder (``fp8-seed2`` -> ``bf16-seed2``: the same host, and the same sampling
    random numbers, so the per-step reward difference is tightest), else that folder's seed-1 ``baseline`` run, else
    the ``baseline`` run of the same seed in another folder (a lease that ran no BF16 of that seed: the same prompts
    and sampling seed on another host). Only runs in ``present`` (those with a training step) pair. A baseline run
    maps to itself, which :func:`~nemo_fp8.utils.plots._pair_of` sets against the report's own ``baseline``
    (another seed or host of BF16: the size of the noise). A run with none of these is absent: it pairs with
    ``baseline``. The time ratios take :func:`host_baseline_pairs` instead.
    """
    by_folder = _baseline_runs(sources, baseline, present)
    pairs = {}
    for label, path in sources.items():
        if label not in present:
            continue
        folder, seed = path.parent.parent, split_seed(path.parent.name)[1]
        here = by_folder.get(folder, {})
        ref = here.get(seed) or here.get(1) or next(
            (runs[seed] for f, runs in sorted(by_folder.items(), key=lambda kv: str(kv[0]))
             if f != folder and seed in runs), None)
        if ref is not None:
            pairs[label] = ref
    return pairs


def host_baseline_pairs(sources: dict[str, Path], baseline: str, present) -> dict[str, str | None]:
    """Label -> the baseline run it takes its time ratios to: the run of ``baseline`` in its own folder (the same
    host) with the same sampling seed, else that folder's lowest seed of ``baseline``; None where the folder has no
    ``baseline`` run (no ratio: seconds compare only between runs that shared one host and lease, and co-tenancy on
    the GPU differs between leases). The seed does not matter to the time ratios, where it does to the reward
    pairing (:func:`baseline_pairs`): a lease that ran ``bf16-seed3`` beside ``fp8-e2e+tis`` times the latter
    against the former, but pairs its rewards with seed 1's ``bf16`` from another folder."""
    by_folder = _baseline_runs(sources, baseline, present)
    out = {}
    for label, path in sources.items():
        here = by_folder.get(path.parent.parent)
        if label in present:
            out[label] = (here.get(split_seed(path.parent.name)[1]) or here[min(here)]) if here else None
    return out


def _shown(path: Path) -> str:
    """``path`` relative to the working directory where it lies below it (plot titles, notes), else as is."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def write_report(out_dir: Path, names: list[str], baseline: str = "bf16",
                 concurrency: int = 1, also: list[Path] = ()) -> tuple[Path, Path] | None:
    """``parity.png`` + ``parity.md`` in ``out_dir`` from ``<out_dir>/<name>/metrics.jsonl`` (and the ``also``
    folders' runs, :func:`report_sources`); None when none exist.

    Variants without metrics, or without a training step, are listed below the table as missing.
    ``concurrency`` > 1 (variants that ran at once on one device) is stated under the table.
    """
    runs, summaries, missing = {}, {}, []
    sources = report_sources(out_dir, names, also)
    for name, path in sources.items():
        rows = read_metrics(path) if path.is_file() else []
        try:
            summaries[name] = summarize_run(rows)
        except ValueError as e:
            missing.append(f"{name}: {e if rows else 'no ' + str(path)}")
            continue
        runs[name] = rows
    if not runs:
        return None
    baseline_of = baseline_pairs(sources, baseline, runs)
    png = plot_parity(runs, out_dir / "parity.png", title=f"learning parity ({_shown(out_dir)})", baseline=baseline,
                      baseline_of=baseline_of)
    table = parity_table(summaries, baseline, baseline_of=host_baseline_pairs(sources, baseline, runs))
    notes = ("\nTimes are seconds per training step (first step left out: warm-up); `step s` excludes validation "
             "and checkpointing. Accuracy: `val/accuracy` (greedy when `grpo.val_greedy`).\n")
    gaps = reward_gap_table(runs, baseline, baseline_of)
    if gaps:
        notes += ("\nTraining reward minus the paired " + baseline + " run's, step by step (the same prompts at each "
                  "step), in the first 40% and the last 40% of the steps; se: standard error of the mean difference, "
                  "steps taken as independent; a second BF16 seed shows the size of sampling noise. Runs with the same "
                  "`grpo.seed` share their sampling random numbers, so their rollouts overlap and their differences "
                  "from the baseline move together: count independent seeds, not variants:\n\n" + gaps)
    seeds = seed_group_table(runs, baseline)
    if seeds:
        notes += ("\nOver sampling seeds (`<variant>-seed<N>`), each run's mean training reward over the last 40% of "
                  "its steps up to `step` (the last training step that the row's runs and " + baseline + "'s all "
                  "logged); the difference from " + baseline + " with Welch's standard error across seeds (with two "
                  "seeds each sd rests on one degree of freedom; the paired column below holds then):\n\n" + seeds)
    over_seeds = seed_summaries(runs, baseline)
    if over_seeds:
        notes += ("\nValidation over sampling seeds (each variant's runs `<variant>`, `<variant>-seed<N>`): means over "
                  "seeds; se of the final accuracy: the validation set's binomial error and the spread across seeds; "
                  "gain: final minus start; the difference from " + baseline + ": Welch's se across seeds (the set's "
                  "error is shared); paired by seed and step: the late reward minus that of " + baseline + "'s run of "
                  "the same seed, step by step, averaged over seeds, se sqrt(sum se_i^2) / seeds, and from three seeds "
                  "the paired t-test's se across seeds, sd(diff_i) / sqrt(seeds), which assumes nothing about the "
                  "steps; TIS-clamped "
                  "tokens: fraction of tokens whose IS weight was clamped (and of steps with any); also in "
                  "parity.json (`tools/check_metrics.py parity.json --by variant`). Each row "
                  f"reads its runs, and for its difference {baseline}'s, up to `step`, the last validation all of "
                  "them reached" + _cut_note(over_seeds) + ":\n\n" + seed_summary_table(over_seeds, baseline))
        (out_dir / "parity.json").write_text(json.dumps(over_seeds, indent=1))
    if concurrency > 1:
        notes += (f"\nUp to {concurrency} variants ran at once on the same device: step times include that sharing, "
                  "so compare them within this table only; a timing claim comes from a run with --parallel 1.\n")
    if also:
        notes += ("\nRuns from other comparisons (" + ", ".join(_shown(a) for a in also) + ") are in the table; a "
                  "`name@folder` label is that folder's run of a variant also run here. A folder's runs take their "
                  f"`/ {baseline}` ratios to that folder's own {baseline} run (the same host), and a folder without "
                  "one has none (\"-\"): seconds compare only within one lease.\n")
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
    p.add_argument("--also", action="append", default=[], metavar="DIR",
                   help="another comparison's --out-dir whose runs join the report (variants split over two hosts; "
                        "a variant run in both is labelled name@<DIR's folder name>); repeatable")
    p.add_argument("--parallel", type=int, default=1,
                   help="variants run at once (GPU: on the same GPU, each engine's gpu_memory_utilization "
                        "set to 0.45/N and its KV cache to --kv-cache-gib unless given; step times then include "
                        "the sharing)")
    p.add_argument("--devices", help="GPU indices, e.g. 0,1,2,3: each run on one of them (CUDA_VISIBLE_DEVICES), at "
                                     "most --parallel runs per device (default: every run sees every GPU)")
    p.add_argument("--stagger-s", type=float, default=None,
                   help="seconds between two starts (default: 45 on gpu, to spread the engines' start-up work: "
                        "compilation, CUDA graph capture; 0 on cpu)")
    p.add_argument("--cpu-bind", action=argparse.BooleanOptionalAction, default=True,
                   help="with several runs at once, bind each to its own block of this process's CPUs (OMP_NUM_THREADS "
                        "too), at least 4 CPUs a run, else unbound (default: on)")
    p.add_argument("--kv-cache-gib", type=float, default=4.0,
                   help="GPU with --parallel > 1: each engine's fixed KV cache (vLLM kv_cache_memory_bytes) in GiB, "
                        "instead of vLLM's memory profiling, which other variants' sleep/wake on the same GPU upset "
                        "(default %(default)s: a step's 16 prompts x 8 x 512 tokens of the small model need 2 GiB; "
                        "what does not fit, vLLM queues)")
    p.add_argument("overrides", nargs="*", help="key=value overrides for every variant")
    args = p.parse_args(argv)
    if args.parallel < 1:
        p.error(f"--parallel must be >= 1, got {args.parallel}")
    devices = [d.strip() for d in args.devices.split(",")] if args.devices else None
    if devices is not None and (not all(d.isdigit() for d in devices) or len(set(devices)) != len(devices)):
        p.error(f"--devices must be distinct GPU indices separated by commas, e.g. 0,1,2,3; got {args.devices!r}")
    if args.stagger_s is None:
        args.stagger_s = 45.0 if args.backend == "gpu" and (args.parallel > 1 or devices) else 0.0
    table = GPU_VARIANTS if args.backend == "gpu" else VARIANTS
    names = args.variants.split(",") if args.variants else list(table)
    unknown = []
    for n in names:
        try:
            variant_overrides(args.backend, n)
        except KeyError:
            unknown.append(n)
    if unknown:
        print(f"error: unknown {args.backend} variant(s) {unknown}; valid: {', '.join(table)}, and any of them "
              "with -seed<N> (N >= 2: another sampling seed)", file=sys.stderr)
        return 2
    config = args.config or str(DEFAULT_CONFIG[args.backend])
    out_dir = Path(args.out_dir or REPO / "logs" / "compare" / args.backend).resolve()
    failed = []
    if not args.report_only:
        overrides = list(args.overrides)
        if args.backend == "gpu":
            overrides = parallel_overrides(overrides, args.parallel, args.kv_cache_gib)
        commands = {name: variant_command(args.backend, name, config, out_dir, overrides) for name in names}
        for name, cmd in commands.items():
            print(f"[{name}] {' '.join(cmd[1:])}", flush=True)
        if args.dry_run:
            return 0
        cpus = affinity_cpus() if args.cpu_bind else None
        failed = run_variants(commands, out_dir, args.parallel, args.stagger_s, devices=devices, cpus=cpus)
    also = [Path(a).resolve() for a in args.also]
    bad = [str(a) for a in also if not a.is_dir()]
    if bad:
        print(f"error: --also {bad}: no such folder (give another comparison's --out-dir)", file=sys.stderr)
        return 2
    written = write_report(out_dir, names, concurrency=args.parallel, also=also)
    if written is None:
        print(f"error: no variant has metrics under {out_dir}", file=sys.stderr)
        return 1
    print(f"report: {written[0]}, {written[1]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
