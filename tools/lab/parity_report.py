"""Learning-parity report tables: several runs' ``metrics.jsonl`` -> one markdown table (and the side-by-side
tables of ``tools/mission_report.py``).

Used by ``tools/compare_precision.py`` and ``tools/mission_report.py``; the plot is ``nemo_fp8.utils.plots``. A run
is the list of rows of its ``metrics.jsonl`` (``nemo_fp8.utils.logger``): training steps carry
``train/reward_mean``, the mismatch metrics and ``timing/<phase>`` seconds; validation rows (step 0 with
``val_at_start``, then every ``val_period``) carry ``val/accuracy``.
"""

from __future__ import annotations

import math
from pathlib import Path

# the step-series helpers are shared with the plot, which the package keeps for the logger's curves.png
from nemo_fp8.utils.plots import _num, _pair_of, _paired_reward_diffs, _rewards_by_step, _seed_groups, _seed_of

PHASES = ("generation", "refit", "logprobs", "training")



def _ratio(a: float, b: float | None) -> str:
    """``a / b`` for a table cell ("-" without a baseline value)."""
    return f"{a / b:.2f}" if b and _num(a) and _num(b) else "-"



def _step_seconds(row: dict) -> float:
    """A training step's seconds without its validation and checkpoint (they run only some steps)."""
    return row.get("timing/step", 0.0) - row.get("timing/validation", 0.0) - row.get("timing/checkpoint", 0.0)


def timed_steps(rows: list[dict], skip_first_steps: int = 1) -> list[dict]:
    """The training-step rows (those with a number for ``train/reward_mean``) in step order, the first
    ``skip_first_steps`` left out (warm-up: CUDA graphs, first allocations) when more steps than that remain."""
    steps = sorted((r for r in rows if _num(r.get("train/reward_mean"))), key=lambda r: r["step"])
    return steps[skip_first_steps:] if len(steps) > skip_first_steps else steps


def summarize_run(rows: list[dict], skip_first_steps: int = 1) -> dict:
    """Summary of one run.

    Args:
        rows: the run's metrics rows (dicts with ``step``).
        skip_first_steps: training steps left out of the timing means (warm-up: CUDA graphs,
            first allocations), applied only when more steps than that remain.

    Returns:
        dict: ``steps``; ``start_acc`` / ``final_acc`` / ``best_acc`` (first / last / largest
        ``val/accuracy``, NaN when never validated); ``acc_by_source`` ({data_source: (first,
        last)} from ``val/accuracy/<data_source>``, empty when the run logged none); ``reward_mean``;
        ``gen_kl_error`` / ``token_mult_prob_error`` (means over steps); ``<phase>_s`` for generation, refit, logprobs, training (seconds per step: sum
        over the timed steps / their count, 0 for a phase a step did not run); ``step_s`` (the
        step minus its validation and checkpoint time); ``other_s`` (``step_s`` minus those four phases: the FP8 KV
        calibration, rewards, advantages, the driver's own work); ``tokens_per_s`` (mean rollout tokens/s).

    Raises:
        ValueError: no training-step rows (none with ``train/reward_mean``).
    """
    steps = sorted((r for r in rows if _num(r.get("train/reward_mean"))), key=lambda r: r["step"])
    if not steps:
        raise ValueError("no training-step rows (rows with train/reward_mean) in this run")
    vals = [r["val/accuracy"] for r in sorted(rows, key=lambda r: r.get("step", 0)) if _num(r.get("val/accuracy"))]
    timed = timed_steps(steps, skip_first_steps)

    def mean(key: str, rs: list[dict]) -> float:
        xs = [r[key] for r in rs if _num(r.get(key))]
        return sum(xs) / len(xs) if xs else float("nan")

    by_source: dict[str, list[float]] = {}
    for r in sorted(rows, key=lambda r: r.get("step", 0)):
        for k, v in r.items():
            if k.startswith("val/accuracy/") and _num(v):
                by_source.setdefault(k[len("val/accuracy/"):], []).append(v)
    out = {"steps": len(steps), "start_acc": vals[0] if vals else float("nan"),
           "final_acc": vals[-1] if vals else float("nan"),
           "acc_by_source": {src: (v[0], v[-1]) for src, v in sorted(by_source.items())},
           "best_acc": max(vals) if vals else float("nan"), "reward_mean": mean("train/reward_mean", steps),
           "gen_kl_error": mean("mismatch/gen_kl_error", steps),
           "token_mult_prob_error": mean("mismatch/token_mult_prob_error", steps),
           "tokens_per_s": mean("perf/rollout_tokens_per_s", timed)}
    for phase in PHASES:
        out[f"{phase}_s"] = sum(r.get(f"timing/{phase}", 0.0) for r in timed) / len(timed)
    out["step_s"] = sum(_step_seconds(r) for r in timed) / len(timed)
    out["other_s"] = out["step_s"] - sum(out[f"{phase}_s"] for phase in PHASES)
    return out



def paired_reward_gap(rows: list[dict], base_rows: list[dict], first: float, last: float) -> dict:
    """Training reward of a run minus its baseline's, paired by step, over a window of the steps both ran.

    Runs with the same data seed draw the same prompts at each step, so most of the step-to-step spread
    of ``train/reward_mean`` (prompt difficulty) cancels in the per-step difference; what is left is
    sampling noise, plus any real difference between the runs. The window is the fraction
    ``[first, last)`` of the steps both runs have (``0.6, 1.0``: the last 40%).

    Returns:
        dict: ``steps`` (pairs in the window), ``diff`` (mean of run - baseline, reward units),
        ``se`` (its standard error: the sample standard deviation of the differences / sqrt(steps),
        steps taken as independent; NaN below 2 pairs), ``z`` (diff / se).

    Raises:
        ValueError: no step in the window that both runs logged ``train/reward_mean`` for.
    """
    steps, diffs = _paired_reward_diffs(rows, base_rows)
    lo, hi = int(first * len(steps)), int(last * len(steps))
    d = diffs[lo:hi]
    if not d:
        raise ValueError(f"no common training steps in [{first}, {last}) of {len(steps)} shared steps")
    n, mean = len(d), sum(d) / len(d)
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n) if n > 1 else float("nan")
    return {"steps": n, "diff": mean, "se": se, "z": mean / se if se > 0 else float("nan")}



def reward_gap_table(runs: dict[str, list[dict]], baseline: str = "bf16",
                     baseline_of: dict[str, str] | None = None,
                     windows: tuple[tuple[float, float], ...] = ((0.0, 0.4), (0.6, 1.0))) -> str:
    """Markdown table: each run's training reward minus its baseline's, paired by step
    (:func:`paired_reward_gap`), in each window of steps; empty when no run has a baseline to pair with.

    ``baseline_of`` maps a run to the row it pairs with (another host's runs: that host's baseline),
    else ``baseline``; another host's baseline pairs with ``baseline`` (how far two hosts' runs of one
    config differ), and ``baseline`` itself is left out.
    """
    head = ["variant", "paired with"] + [f"steps {int(lo * 100)}-{int(hi * 100)}%: diff +- se (z)"
                                         for lo, hi in windows]
    lines = []
    for name, rows in runs.items():
        ref = _pair_of(name, baseline, baseline_of)
        if ref == name or ref not in runs:
            continue
        cells = []
        for lo, hi in windows:
            try:
                g = paired_reward_gap(rows, runs[ref], lo, hi)
                cells.append(f"{g['diff']:+.4f} +- {g['se']:.4f} ({g['z']:+.1f})")
            except ValueError:
                cells.append("-")
        lines.append("| " + " | ".join([name, ref, *cells]) + " |")
    if not lines:
        return ""
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *lines]) + "\n"



def seed_group_table(runs: dict[str, list[dict]], baseline: str = "bf16", window: tuple[float, float] = (0.6, 1.0)) -> str:
    """Markdown table over sampling seeds: runs named ``<variant>`` and ``<variant>-seed<N>`` form one group per
    variant; for each group of two or more seeds, the mean over seeds of each run's mean training reward in the
    ``window`` (fractions of its steps; default the last 40%), its standard deviation across seeds, and the
    difference from the ``baseline`` group with its Welch standard error sqrt(s1^2/n1 + s2^2/n2) and z.

    Every run draws the same prompts (``data.seed``), so the spread across seeds is sampling and trajectory
    noise only: the statistic for "does this variant differ from BF16 by more than seed noise". A run of a
    (variant, seed) already counted (the same seed on another host, ``name@folder``) is left out, as it is
    nearly a copy. Empty when no group has two seeds.
    """
    groups: dict[str, dict[int, float]] = {}
    for base, labels in _seed_groups(runs).items():
        for label in labels:
            rewards = [v for _, v in sorted(_rewards_by_step(runs[label]).items())]
            part = rewards[int(window[0] * len(rewards)):int(window[1] * len(rewards))]
            if part:
                groups.setdefault(base, {})[_seed_of(label)[1]] = sum(part) / len(part)

    def stats(xs):
        m = sum(xs) / len(xs)
        return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))

    multi = {b: sorted(g.items()) for b, g in groups.items() if len(g) >= 2}
    if not multi:
        return ""
    ref = stats([v for _, v in multi[baseline]]) if baseline in multi else None
    lines = ["| variant | seeds | reward, mean over seeds | sd across seeds | diff from " + baseline + " +- se (z) |",
             "|---|---|---|---|---|"]
    for base, g in multi.items():
        m, sd = stats([v for _, v in g])
        cell = "-"
        if ref is not None and base != baseline:
            se = math.sqrt(sd ** 2 / len(g) + ref[1] ** 2 / len(multi[baseline]))
            cell = f"{m - ref[0]:+.4f} +- {se:.4f} ({(m - ref[0]) / se:+.1f})" if se > 0 else f"{m - ref[0]:+.4f}"
        lines.append(f"| {base} | {','.join(str(k) for k, _ in g)} | {m:.4f} | {sd:.4f} | {cell} |")
    return "\n".join(lines) + "\n"



def parity_table(summaries: dict[str, dict], baseline: str = "bf16",
                 baseline_of: dict[str, str] | None = None) -> str:
    """Markdown table of :func:`summarize_run` results, one row per variant (input order).

    Columns: steps, first/final/best validation accuracy (and first -> final per data source when
    the runs logged ``val/accuracy/<data_source>``), mean reward, mean gen_kl_error and
    token_mult_prob_error, seconds per step split into generation / refit / log-probs / training,
    the whole step, and the step and generation times as ratios to ``baseline`` ("-" when
    ``baseline`` is not among the variants). ``baseline_of`` maps a variant to another row to take
    its ratios to (runs from another host: that host's own baseline run), overriding ``baseline``.
    """
    baseline_of = baseline_of or {}
    sources = sorted({src for s in summaries.values() for src in s.get("acc_by_source", {})})
    head = ["variant", "steps", "start acc", "final acc", "best acc", *[f"{src} acc" for src in sources], "reward",
            "gen_kl_error", "mult_prob_err", "gen s", "refit s", "logprobs s", "train s", "step s",
            f"step / {baseline}", f"gen / {baseline}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, s in summaries.items():
        base = summaries.get(baseline_of.get(name, baseline))
        per_src = [("{:.3f} -> {:.3f}".format(*s["acc_by_source"][src]) if src in s.get("acc_by_source", {}) else "-")
                   for src in sources]
        cells = [name, str(s["steps"]), f"{s.get('start_acc', float('nan')):.4f}", f"{s['final_acc']:.4f}",
                 f"{s['best_acc']:.4f}", *per_src, f"{s['reward_mean']:.4f}",
                 f"{s['gen_kl_error']:.3e}", f"{s['token_mult_prob_error']:.4f}", f"{s['generation_s']:.2f}",
                 f"{s['refit_s']:.2f}", f"{s['logprobs_s']:.2f}", f"{s['training_s']:.2f}", f"{s['step_s']:.2f}",
                 _ratio(s["step_s"], base and base["step_s"]), _ratio(s["generation_s"], base and base["generation_s"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"



def peak_gpu_memory(csv_path: str | Path) -> dict[int, float]:
    """Peak used memory (GiB) per GPU index from ``nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv``.

    Raises:
        ValueError: a file without the ``index`` and ``memory.used`` columns, or without rows.
    """
    import csv

    with open(csv_path, newline="") as f:
        rows = [[c.strip() for c in r] for r in csv.reader(f) if r]
    if not rows:
        raise ValueError(f"{csv_path}: empty")
    head = [h.split(" [")[0] for h in rows[0]]
    if "index" not in head or "memory.used" not in head:
        raise ValueError(f"{csv_path}: columns {rows[0]}; expected nvidia-smi's timestamp, index, memory.used")
    i, m = head.index("index"), head.index("memory.used")
    peaks: dict[int, float] = {}
    for r in rows[1:]:
        if len(r) > max(i, m) and r[i].isdigit():  # the header repeats when nvidia-smi restarts; skip it
            mib = float(r[m].split()[0])
            peaks[int(r[i])] = max(peaks.get(int(r[i]), 0.0), mib / 1024)
    if not peaks:
        raise ValueError(f"{csv_path}: no rows")
    return peaks



def step_table(rows: list[dict]) -> str:
    """Markdown table of one run's training steps: seconds per phase, the rest of the step (``other s``: FP8 KV
    calibration, rewards, the driver; validation and checkpoints left out), the step, rollout tokens/s."""
    head = ["step", "gen s", "refit s", "logprobs s", "train s", "other s", "step s", "rollout tok/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted((r for r in rows if _num(r.get("train/reward_mean"))), key=lambda r: r["step"]):
        phases = [r.get(f"timing/{p}", 0.0) for p in PHASES]
        cells = [str(r["step"])] + [f"{t:.2f}" for t in phases] + [f"{_step_seconds(r) - sum(phases):.2f}"]
        cells += [f"{r.get('timing/step', 0.0):.2f}", f"{r.get('perf/rollout_tokens_per_s', float('nan')):,.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"



def side_by_side_table(summaries: dict[str, dict], peaks: dict[str, dict[int, float]], baseline: str) -> str:
    """Markdown table, a row per run: :func:`summarize_run` times (first step left out), rollout tokens/s,
    peak GiB per GPU (``peaks``: run -> {GPU index: GiB}) and the ratios to ``baseline``."""
    base = summaries.get(baseline)
    head = ["run", "steps", "gen s", "refit s", "logprobs s", "train s", "other s", "step s", "rollout tok/s", "peak GiB per GPU",
            f"step / {baseline}", f"tok/s / {baseline}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, s in summaries.items():
        mem = ", ".join(f"{i}: {g:.1f}" for i, g in sorted(peaks.get(name, {}).items())) or "-"
        cells = [name, str(s["steps"])] + [f"{s[f'{p}_s']:.2f}" for p in PHASES + ("other",)]
        cells += [f"{s['step_s']:.2f}", f"{s['tokens_per_s']:,.0f}", mem, _ratio(s["step_s"], base and base["step_s"]),
                  _ratio(s["tokens_per_s"], base and base["tokens_per_s"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
