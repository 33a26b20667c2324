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


def warmup_only(rows: list[dict], skip_first_steps: int = 1) -> bool:
    """Whether ``timed_steps`` had to keep the warm-up: the run made no step beyond its first ``skip_first_steps``
    (a run cut short). Its times are not comparable with a run timed on later steps."""
    steps = sum(1 for r in rows if _num(r.get("train/reward_mean")))
    return 0 < steps <= skip_first_steps


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
        calibration, rewards, advantages, the driver's own work); ``tokens_per_s`` (mean rollout tokens/s);
        ``warmup_only`` (``warmup_only``: the times include the warm-up, the run made no later step).

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
           "tokens_per_s": mean("perf/rollout_tokens_per_s", timed),
           "warmup_only": warmup_only(steps, skip_first_steps)}
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
    nearly a copy. Each row reads its runs, and for its difference the baseline's, up to ``step``, the last
    training step all of them logged: a run that went on longer (another lease, a longer recipe) would otherwise
    put later, higher-reward steps in its window. Empty when no group has two seeds.
    """
    groups = {base: labels for base, labels in _seed_groups(runs).items() if len(labels) >= 2}
    last = {lb: max(_rewards_by_step(runs[lb]), default=0) for labels in groups.values() for lb in labels}

    def late(labels: list[str], upto: int) -> list[tuple[int, float]]:  # (seed, mean reward in the window)
        out = []
        for label in labels:
            rewards = [v for st, v in sorted(_rewards_by_step(runs[label]).items()) if st <= upto]
            part = rewards[int(window[0] * len(rewards)):int(window[1] * len(rewards))]
            if part:
                out.append((_seed_of(label)[1], sum(part) / len(part)))
        return out

    if not groups:
        return ""
    lines = ["| variant | seeds | step | reward, mean over seeds | sd across seeds | diff from " + baseline +
             " +- se (z) |", "|---|---|---|---|---|---|"]
    for base, labels in groups.items():
        ref_labels = groups.get(baseline, []) if base != baseline else []
        upto = min(last[lb] for lb in labels + ref_labels)
        g = late(labels, upto)
        if len(g) < 2:
            continue
        m, sd = _mean_sd([v for _, v in g])
        ref = [v for _, v in late(ref_labels, upto)]
        cell = "-"
        if len(ref) >= 2:
            rm, rsd = _mean_sd(ref)
            se = math.sqrt(sd ** 2 / len(g) + rsd ** 2 / len(ref))
            cell = f"{m - rm:+.4f} +- {se:.4f} ({(m - rm) / se:+.1f})" if se > 0 else f"{m - rm:+.4f}"
        lines.append(f"| {base} | {','.join(str(k) for k, _ in g)} | {upto} | {m:.4f} | {sd:.4f} | {cell} |")
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""



def parity_table(summaries: dict[str, dict], baseline: str = "bf16",
                 baseline_of: dict[str, str | None] | None = None) -> str:
    """Markdown table of :func:`summarize_run` results, one row per variant (input order).

    Columns: steps, first/final/best validation accuracy (and first -> final per data source when
    the runs logged ``val/accuracy/<data_source>``), mean reward, mean gen_kl_error and
    token_mult_prob_error, seconds per step split into generation / refit / log-probs / training,
    the whole step, and the step and generation times as ratios to ``baseline`` ("-" when
    ``baseline`` is not among the variants). ``baseline_of`` maps a variant to another row to take
    its ratios to (runs from another host: that host's own baseline run), overriding ``baseline``; a variant
    mapped to None has no ratios ("-": a host that ran no baseline).
    """
    baseline_of = baseline_of or {}
    sources = sorted({src for s in summaries.values() for src in s.get("acc_by_source", {})})
    head = ["variant", "steps", "start acc", "final acc", "best acc", *[f"{src} acc" for src in sources], "reward",
            "gen_kl_error", "mult_prob_err", "gen s", "refit s", "logprobs s", "train s", "step s",
            f"step / {baseline}", f"gen / {baseline}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, s in summaries.items():
        base = summaries.get(baseline_of.get(name, baseline))  # None (no baseline run on that host): no ratio
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
    peak GiB per GPU (``peaks``: run -> {GPU index: GiB}) and the ratios to ``baseline``. A run timed on its warm-up
    step only (``warmup_only``: it stopped after it) says so in its steps cell, and its ratios are "-" unless the
    baseline's times are its warm-up too: a warm-up step against a later one is not a comparison."""
    base = summaries.get(baseline)
    head = ["run", "steps", "gen s", "refit s", "logprobs s", "train s", "other s", "step s", "rollout tok/s", "peak GiB per GPU",
            f"step / {baseline}", f"tok/s / {baseline}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, s in summaries.items():
        mem = ", ".join(f"{i}: {g:.1f}" for i, g in sorted(peaks.get(name, {}).items())) or "-"
        like = base and bool(s.get("warmup_only")) == bool(base.get("warmup_only")) and base
        steps = f"{s['steps']} (warm-up only)" if s.get("warmup_only") else str(s["steps"])
        cells = [name, steps] + [f"{s[f'{p}_s']:.2f}" for p in PHASES + ("other",)]
        cells += [f"{s['step_s']:.2f}", f"{s['tokens_per_s']:,.0f}", mem, _ratio(s["step_s"], like and like["step_s"]),
                  _ratio(s["tokens_per_s"], like and like["tokens_per_s"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def run_stats(rows: list[dict], window: tuple[float, float] = (0.6, 1.0)) -> dict:
    """One run's learning and mismatch numbers for :func:`seed_summaries` (None where the run logged no such metric).

    Returns:
        dict: ``start_acc`` / ``final_acc`` (first / last ``val/accuracy``), ``val_samples`` (last
        ``val/num_samples``), ``late_reward`` (mean ``train/reward_mean`` over ``window`` of the training steps),
        ``gen_kl_error`` / ``gen_kl_error_max`` / ``token_mult_prob_error`` (mean / max over steps),
        ``response_length_mean`` / ``_first`` / ``_last`` (mean ``train/response_length_mean`` over all steps, the
        first 10% and the last 10%: tokens per response over training), ``is_frac_tokens_truncated`` (mean over
        steps of the fraction of tokens whose IS weight TIS clamped) and ``is_steps_truncating`` (fraction of steps
        with any such token).

    Raises:
        ValueError: no training-step rows, or no ``val/accuracy``.
    """
    steps = sorted((r for r in rows if _num(r.get("train/reward_mean"))), key=lambda r: r["step"])
    vals = [r for r in sorted(rows, key=lambda r: r.get("step", 0)) if _num(r.get("val/accuracy"))]
    if not steps or not vals:
        raise ValueError("a run needs training steps (train/reward_mean) and validations (val/accuracy)")

    def series(key: str, part: tuple[float, float] = (0.0, 1.0)) -> list[float]:
        sel = steps[int(part[0] * len(steps)):max(int(part[1] * len(steps)), int(part[0] * len(steps)) + 1)]
        return [r[key] for r in sel if _num(r.get(key))]

    def mean(xs: list[float]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    trunc = series("loss/is_frac_tokens_truncated")
    return {"start_acc": vals[0]["val/accuracy"], "final_acc": vals[-1]["val/accuracy"],
            "val_samples": vals[-1].get("val/num_samples"), "late_reward": mean(series("train/reward_mean", window)),
            "gen_kl_error": mean(series("mismatch/gen_kl_error")),
            "gen_kl_error_max": max(series("mismatch/gen_kl_error"), default=None),
            "token_mult_prob_error": mean(series("mismatch/token_mult_prob_error")),
            "response_length_mean": mean(series("train/response_length_mean")),
            "response_length_first": mean(series("train/response_length_mean", (0.0, 0.1))),
            "response_length_last": mean(series("train/response_length_mean", (0.9, 1.0))),
            "is_frac_tokens_truncated": mean(trunc),
            "is_steps_truncating": mean([float(x > 0) for x in trunc])}


def _upto(rows: list[dict], step: int) -> list[dict]:
    """A run's rows up to and including ``step``: the run as it stood then."""
    return [r for r in rows if r.get("step", 0) <= step]


def _mean_sd(xs: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0


def paired_over_seeds(runs: dict[str, list[dict]], labels: list[str], base_labels: list[str], step: int,
                      window: tuple[float, float] = (0.6, 1.0)) -> dict | None:
    """Late training reward of a variant minus the baseline's, paired by seed and by step: for each sampling seed
    both ran, :func:`paired_reward_gap` of the two runs (read up to ``step``, over ``window`` of the steps), then the
    mean over those seeds.

    With few seeds the spread across seeds (Welch's se) rests on one or two degrees of freedom and can come out far
    too small or large; each seed's pair also measures its own sampling noise from its ~16 late steps, so
    ``se`` = sqrt(sum se_i^2) / k (seeds independent, steps taken as independent within a pair).
    From three seeds on, ``seed_se`` = sd(diff_i) / sqrt(k) is the paired t-test's se across seeds (k - 1
    degrees of freedom; Student's paired t, as in any paired comparison of seeds): it makes no assumption about
    the steps, so a reward that drifts together over neighbouring steps, which the pooled ``se`` misses, shows
    in it.

    Returns:
        dict ``diff`` (reward units), ``se``, ``seed_se`` (None below three seeds), ``seeds`` (k, the seeds
        paired), or None when no seed of ``labels`` has a baseline run of the same seed with a common step in
        the window.
    """
    base_by_seed = {_seed_of(lb)[1]: lb for lb in base_labels}
    gaps = []
    for label in labels:
        ref = base_by_seed.get(_seed_of(label)[1])
        if ref is None or ref == label:
            continue
        try:
            gaps.append(paired_reward_gap(_upto(runs[label], step), _upto(runs[ref], step), *window))
        except ValueError:
            continue
    if not gaps:
        return None
    k = len(gaps)
    diff, sd = _mean_sd([g["diff"] for g in gaps])
    return {"diff": diff, "se": math.sqrt(sum(g["se"] ** 2 for g in gaps)) / k,
            "seed_se": sd / math.sqrt(k) if k >= 3 else None, "seeds": k}


def seed_summaries(runs: dict[str, list[dict]], baseline: str = "bf16") -> list[dict]:
    """One row per variant over its sampling seeds (``<variant>``, ``<variant>-seed<N>``): issue 51's numbers.

    Standard errors. Validation is greedy on a fixed set of ``n`` problems, so a run's accuracy ``p`` carries the
    set's sampling error ``p(1 - p) / n`` (binomial) besides the spread across seeds. ``final_acc_se`` =
    sqrt(p(1-p)/n + sd^2/seeds) (sd: across seeds); the gain (final minus start, each run's own start) has
    ``gain_se`` = sqrt(p0(1-p0)/n + p1(1-p1)/n + sd_gain^2/seeds), the two validations counted as independent
    (conservative: the same problems are scored twice). Between two variants on the same set the binomial part
    is shared, so ``diff_final_se`` is Welch's across seeds, sqrt(sd_a^2/n_a + sd_b^2/n_b) (None below two seeds
    each); the same for ``diff_late_reward``.

    Returns:
        list of dicts, input order of first appearance: ``variant`` (``+`` written ``_``, the run-name convention
        of ``tools/check_metrics.py``), ``label`` (as named), ``seeds``, the means over seeds of
        :func:`run_stats`' numbers, ``final_acc_sd``, ``final_acc_se``, ``gain``, ``gain_se``, ``gain_z`` and,
        for variants other than ``baseline`` when it ran, ``diff_final`` / ``diff_final_se`` /
        ``diff_late_reward`` / ``diff_late_reward_se``, and where seeds pair with the baseline's
        ``diff_late_reward_paired`` / ``diff_late_reward_paired_se`` / ``diff_late_reward_paired_seed_se`` /
        ``paired_seeds`` (:func:`paired_over_seeds`: the se that holds with two seeds, and from three seeds the
        paired t-test's se across seeds); ``final_step``, the step the row's numbers are taken up
        to, and ``cut_runs``, the runs (the variant's, or the baseline's for this comparison) that validated later
        than that (their later steps left out). A run with no validation after its start is left out.

    Every run of a row is read up to its ``final_step``: the last validation step that every run of the variant
    reached and, for a variant set against ``baseline``, every baseline run too; the difference reads the baseline's
    runs up to the same step. A comparison cut short (a lease's end, a crash) then compares like with like, one
    arm's step 20 never against another's step 10, and an arm cut early moves only its own comparison back.
    """
    val_steps = {label: [r.get("step", 0) for r in rows if _num(r.get("val/accuracy"))] for label, rows in runs.items()}
    last_val = {label: max(steps) for label, steps in val_steps.items() if len(steps) >= 2}
    labels_of = {base: [lb for lb in labels if lb in last_val] for base, labels in _seed_groups(runs).items()}
    labels_of = {base: labels for base, labels in labels_of.items() if labels}

    def stats_at(labels: list[str], step: int) -> list[dict]:  # run_stats of each run read up to `step`
        found = []
        for label in labels:
            try:
                found.append(run_stats(_upto(runs[label], step)))
            except ValueError:
                continue
        return found

    base_labels = labels_of.get(baseline, [])
    out, groups = [], {}
    for base, labels in labels_of.items():
        pair = labels if base == baseline else labels + base_labels
        step = min(last_val[lb] for lb in pair)
        stats = stats_at(labels, step)
        if not stats:
            continue
        groups[base] = stats
        row: dict = {"variant": base.replace("+", "_"), "label": base, "seeds": len(stats), "final_step": step,
                     "cut_runs": [lb for lb in pair if last_val[lb] > step]}
        for key in stats[0]:
            xs = [s[key] for s in stats if s[key] is not None]
            row[key] = sum(xs) / len(xs) if xs else None
        n = row["val_samples"] or float("inf")
        p0, p1 = row["start_acc"], row["final_acc"]
        _, sd = _mean_sd([s["final_acc"] for s in stats])
        gain, sd_gain = _mean_sd([s["final_acc"] - s["start_acc"] for s in stats])
        row["final_acc_sd"] = sd
        row["final_acc_se"] = math.sqrt(p1 * (1 - p1) / n + sd ** 2 / len(stats))
        row["gain"] = gain
        row["gain_se"] = math.sqrt(p0 * (1 - p0) / n + p1 * (1 - p1) / n + sd_gain ** 2 / len(stats))
        row["gain_z"] = gain / row["gain_se"] if row["gain_se"] > 0 else None
        out.append(row)
    if baseline not in groups:
        return out
    for row in out:
        if row["label"] == baseline:
            continue
        ref = stats_at(base_labels, row["final_step"])
        for key, diff in (("final_acc", "diff_final"), ("late_reward", "diff_late_reward")):
            a = [s[key] for s in groups[row["label"]] if s[key] is not None]
            b = [s[key] for s in ref if s[key] is not None]
            if not a or not b:
                continue
            row[diff] = sum(a) / len(a) - sum(b) / len(b)
            row[diff + "_se"] = (math.sqrt(_mean_sd(a)[1] ** 2 / len(a) + _mean_sd(b)[1] ** 2 / len(b))
                                 if len(a) > 1 and len(b) > 1 else None)
        paired = paired_over_seeds(runs, labels_of[row["label"]], base_labels, row["final_step"])
        if paired is not None:
            row["diff_late_reward_paired"], row["diff_late_reward_paired_se"] = paired["diff"], paired["se"]
            row["diff_late_reward_paired_seed_se"] = paired["seed_se"]
            row["paired_seeds"] = paired["seeds"]
    return out


def _paired_cell(row: dict) -> str:
    """``"-0.0097 +- 0.0035 (-2.8)"``: a :func:`seed_summaries` row's paired late-reward difference, or ``"-"``;
    from three seeds on, the se across seeds follows: ``"; seeds +- 0.0022 (t -3.4, 2 df)"``."""
    d, se = row.get("diff_late_reward_paired"), row.get("diff_late_reward_paired_se")
    if d is None:
        return "-"
    cell = f"{d:+.4f} +- {se:.4f} ({d / se:+.1f})" if se and se > 0 else f"{d:+.4f}"
    seed_se, k = row.get("diff_late_reward_paired_seed_se"), row.get("paired_seeds")
    if seed_se:
        cell += f"; seeds +- {seed_se:.4f} (t {d / seed_se:+.1f}, {k - 1} df)"
    return cell


def seed_summary_table(rows: list[dict], baseline: str = "bf16") -> str:
    """Markdown table of :func:`seed_summaries`: validation accuracy with standard errors, the gain, the difference
    from ``baseline``, the mismatch, TIS truncation and response length over training; empty without rows."""
    if not rows:
        return ""

    def f(v, fmt: str = "{:.4f}") -> str:
        return "-" if v is None else fmt.format(v)

    def pm(v, se, fmt: str = "{:+.4f}") -> str:
        return "-" if v is None else fmt.format(v) + ("" if se is None else f" +- {se:.4f}")

    head = ["variant", "seeds", "step", "start acc", "final acc +- se", "gain +- se (z)",
            f"final - {baseline} +- se",
            f"late reward - {baseline} +- se", "paired by seed and step +- se (z)", "gen_kl_error (max)",
            "mult_prob_err", "TIS-clamped tokens (steps)", "response tokens first -> last"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["label"], str(r["seeds"]), str(r["final_step"]), f(r["start_acc"]),
                 pm(r["final_acc"], r["final_acc_se"], "{:.4f}"),
                 pm(r["gain"], r["gain_se"]) + ("" if r["gain_z"] is None else f" ({r['gain_z']:+.1f})"),
                 pm(r.get("diff_final"), r.get("diff_final_se")),
                 pm(r.get("diff_late_reward"), r.get("diff_late_reward_se")),
                 _paired_cell(r),
                 f(r["gen_kl_error"], "{:.2e}") + f" ({f(r['gen_kl_error_max'], '{:.1e}')})",
                 f(r["token_mult_prob_error"]),
                 f(r["is_frac_tokens_truncated"], "{:.2e}") + f" ({f(r['is_steps_truncating'], '{:.0%}')})",
                 f"{f(r['response_length_first'], '{:.0f}')} -> {f(r['response_length_last'], '{:.0f}')}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
