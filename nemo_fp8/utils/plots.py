"""Learning curves of one or several runs' ``metrics.jsonl``: the 4-panel PNG (validation accuracy, train reward,
``gen_kl_error``, ``token_mult_prob_error``), plus the paired reward difference and seed-mean panels.

The logger draws one run's ``curves.png`` with it at the end of a run; ``tools/compare_precision.py`` draws the
parity report's ``parity.png`` (its tables are in ``tools/lab/parity_report.py``). A run is the list of rows of its
``metrics.jsonl`` (``nemo_fp8.utils.logger``): training steps carry ``train/reward_mean`` and the mismatch
metrics; validation rows carry ``val/accuracy``.
"""

from __future__ import annotations

import math
from pathlib import Path

PANELS = [("val/accuracy", "validation accuracy"), ("train/reward_mean", "train reward"),
          ("mismatch/gen_kl_error", "gen_kl_error (KL gen || train)"),
          ("mismatch/token_mult_prob_error", "token_mult_prob_error")]



def _num(v) -> bool:
    return isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v))



def _by_step(rows: list[dict], key: str) -> dict[int, float]:
    """Step -> ``key`` of the rows that logged a number for it (``train/reward_mean``: the training steps)."""
    return {r["step"]: r[key] for r in rows if _num(r.get(key)) and "step" in r}



def _rewards_by_step(rows: list[dict]) -> dict[int, float]:
    """Step -> ``train/reward_mean`` of a run's training steps."""
    return _by_step(rows, "train/reward_mean")



def _trailing_mean(steps: list[int], values: list[float], smooth: int) -> list[tuple[int, float]]:
    """(step, mean of the last ``smooth`` values up to it) for each step: the plots' smoothing of per-step differences."""
    windows = (values[max(0, i - smooth + 1):i + 1] for i in range(len(steps)))
    return [(st, sum(w) / len(w)) for st, w in zip(steps, windows)]



def _paired_reward_diffs(rows: list[dict], base_rows: list[dict]) -> tuple[list[int], list[float]]:
    """The steps both runs logged ``train/reward_mean`` for (ascending) and run - baseline at each."""
    a, b = _rewards_by_step(rows), _rewards_by_step(base_rows)
    steps = sorted(set(a) & set(b))
    return steps, [a[s] - b[s] for s in steps]



def _pair_of(name: str, baseline: str, baseline_of: dict[str, str] | None) -> str:
    """The run ``name`` is compared with: ``baseline_of[name]`` (another host's runs: that host's baseline), else
    ``baseline``; a host's own baseline pairs with ``baseline`` (how far two hosts' runs of one config differ)."""
    ref = (baseline_of or {}).get(name, baseline)
    return baseline if ref == name else ref



def split_seed(name: str) -> tuple[str, int]:
    """A variant name's sampling seed: ``"fp8+tis-seed3"`` -> ``("fp8+tis", 3)``; a name without a ``-seed<N>``
    suffix (N in ASCII digits) is seed 1, the config's own: ``("fp8+tis", 1)``."""
    base, _, n = name.rpartition("-seed")
    return (base, int(n)) if base and n.isascii() and n.isdigit() else (name, 1)



def _seed_of(label: str) -> tuple[str, int]:
    """A report label's variant and seed: ``"fp8+tis-seed3@gpu-b"`` -> ``("fp8+tis", 3)`` (``@folder`` dropped)."""
    return split_seed(label.split("@", 1)[0])



def _line_styles(names: list[str]) -> dict[str, tuple[str, str]]:
    """One (matplotlib colour, line style) per run, the same in every panel: one colour per variant (its
    ``-seed<N>`` and ``@folder`` suffixes dropped), so a variant's seeds and hosts read as one family, told apart by
    line style (solid, dashed, dotted, dash-dot in order of appearance). Colours cycle after ten variants."""
    families: dict[str, int] = {}
    members: dict[str, int] = {}
    out = {}
    for name in names:
        base = _seed_of(name)[0]
        fam = families.setdefault(base, len(families))
        k = members[base] = members.get(base, -1) + 1
        out[name] = (f"C{fam % 10}", ("-", "--", ":", "-.")[k % 4])
    return out



def _seed_groups(labels) -> dict[str, list[str]]:
    """Variant -> its runs over distinct sampling seeds (``_seed_of``): the first run of each (variant, seed) in
    ``labels`` order; a later run of a seed already counted (the same seed on another host, ``name@folder``) is
    left out, as it is nearly a copy."""
    groups: dict[str, dict[int, str]] = {}
    for label in labels:
        base, seed = _seed_of(label)
        groups.setdefault(base, {}).setdefault(seed, label)
    return {base: [g[k] for k in sorted(g)] for base, g in groups.items()}



def _seed_mean_by_step(runs: dict[str, list[dict]], labels: list[str], key: str) -> dict[int, float]:
    """Step -> the mean of ``key`` over the runs ``labels``, at the steps every one of them logged it."""
    per = [_by_step(runs[lab], key) for lab in labels]
    common = set.intersection(*(set(p) for p in per)) if per else set()
    return {st: sum(p[st] for p in per) / len(per) for st in sorted(common)}



def val_accuracy_with_se(rows: list[dict]) -> list[tuple[int, float, float]]:
    """(step, ``val/accuracy``, its binomial standard error sqrt(p (1 - p) / n)) of each validation row, by step;
    n is the row's ``val/num_samples`` (NaN standard error where the row has none). With 256 problems and p
    near 0.5 one standard error is about 0.03: a change smaller than that is noise."""
    out = []
    for r in sorted((r for r in rows if _num(r.get("val/accuracy")) and "step" in r), key=lambda r: r["step"]):
        p, n = r["val/accuracy"], r.get("val/num_samples")
        out.append((r["step"], p, math.sqrt(p * (1 - p) / n) if _num(n) and n > 0 else float("nan")))
    return out


def plot_parity(runs: dict[str, list[dict]], png_path: str | Path, title: str = "learning parity",
                baseline: str | None = None, baseline_of: dict[str, str] | None = None, smooth: int = 10) -> Path:
    """One figure, a curve per run: four panels (validation accuracy, reward, gen_kl_error,
    token_mult_prob_error), plus one panel of validation accuracy per data source when the runs logged
    ``val/accuracy/<data_source>``, plus, when ``baseline`` is among the runs, one panel of each run's
    training reward minus its baseline's paired by step (``baseline_of``, else ``baseline``; the same
    prompts at each step, so prompt difficulty cancels), as a trailing ``smooth``-step mean. When some variants
    ran over several sampling seeds (``<variant>-seed<N>``), one panel of their validation accuracy averaged
    over seeds and, when ``baseline`` is one of them, one of their seed-averaged training reward minus the
    baseline's (seed noise shrinks by the square root of the seeds). Runs of a variant share its colour. Each
    validation point carries its binomial standard error (:func:`val_accuracy_with_se`) as a bar and a band.

    Raises:
        ValueError: no runs.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not runs:
        raise ValueError("plot_parity: no runs")
    sources = sorted({k[len("val/accuracy/"):] for rows in runs.values() for r in rows for k in r
                      if k.startswith("val/accuracy/")})
    panels = PANELS + [(f"val/accuracy/{src}", f"validation accuracy: {src}") for src in sources]
    paired = baseline is not None and baseline in runs
    if paired:
        panels.insert(2, ("paired", f"train reward - {baseline}, paired by step ({smooth}-step mean)"))
    seeds = {b: labs for b, labs in _seed_groups(runs).items() if len(labs) >= 2}
    if seeds:  # variants run over several sampling seeds: their means over seeds, where seed noise averages out
        panels.insert(1, ("seed_val", "validation accuracy, mean over seeds"))
        if baseline in seeds and len(seeds) > 1:
            panels.insert(4, ("seed_gap", f"train reward - {baseline}, means over seeds ({smooth}-step mean)"))
    cols = (len(panels) + 1) // 2
    fig, axes = plt.subplots(2, cols, figsize=(6.5 * cols, 9), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    style = _line_styles(list(runs))
    for ax, (key, label) in zip(axes.flat, panels):
        if key in ("seed_val", "seed_gap"):
            _plot_seed_means(ax, key, runs, seeds, baseline, style, smooth)
            ax.set_title(label)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
            continue
        for name, rows in runs.items():
            if key == "paired":
                ref = _pair_of(name, baseline, baseline_of)
                steps, d = _paired_reward_diffs(rows, runs[ref]) if ref != name and ref in runs else ([], [])
                pts = _trailing_mean(steps, d, smooth)
            else:
                pts = sorted(_by_step(rows, key).items())
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, label=name, color=style[name][0], linestyle=style[name][1],
                        marker="o" if len(pts) < 30 else None, markersize=3, linewidth=1.2)
            se = [(x, y, e) for x, y, e in val_accuracy_with_se(rows) if key == "val/accuracy" and e == e]
            if se:  # binomial standard error of each validation point: a band of +- 1 se, and error bars
                xs, ys, es = zip(*se)
                ax.fill_between(xs, [y - e for y, e in zip(ys, es)], [y + e for y, e in zip(ys, es)],
                                color=style[name][0], alpha=0.15, linewidth=0)
                ax.errorbar(xs, ys, yerr=es, fmt="none", ecolor=style[name][0], elinewidth=0.8, capsize=2)
        if key == "val/accuracy":
            ax.text(0.01, 0.01, "band, bars: +- 1 standard error, sqrt(p(1-p)/n)", transform=ax.transAxes,
                    fontsize=7, alpha=0.7)
        if key == "paired":
            ax.axhline(0.0, color="black", linewidth=0.6)
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    # the legend on the first panel that drew a labelled line (a run without validation leaves the first empty:
    # matplotlib warns "No artists with labels found" on an empty one)
    labelled = [ax for ax in axes.flat[:len(panels)] if ax.get_legend_handles_labels()[0]]
    if labelled:
        labelled[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path



def _plot_seed_means(ax, key: str, runs: dict[str, list[dict]], seeds: dict[str, list[str]], baseline: str | None,
                     style: dict[str, tuple[str, str]], smooth: int) -> None:
    """The seed-mean panels of :func:`plot_parity`: ``seed_val``, each multi-seed variant's validation accuracy
    averaged over its seeds; ``seed_gap``, its training reward averaged over its seeds minus the baseline's
    average, by step, as a trailing ``smooth``-step mean."""
    base_mean = _seed_mean_by_step(runs, seeds[baseline], "train/reward_mean") if baseline in seeds else {}
    for variant, labs in seeds.items():
        if key == "seed_val":
            pts = sorted(_seed_mean_by_step(runs, labs, "val/accuracy").items())
        else:
            if variant == baseline:
                continue
            mean = _seed_mean_by_step(runs, labs, "train/reward_mean")
            steps = [st for st in mean if st in base_mean]
            pts = _trailing_mean(steps, [mean[st] - base_mean[st] for st in steps], smooth)
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, label=f"{variant} ({len(labs)} seeds)", color=style[labs[0]][0], linewidth=1.8,
                    marker="o" if len(pts) < 30 else None, markersize=3)
    if key == "seed_gap":
        ax.axhline(0.0, color="black", linewidth=0.6)
