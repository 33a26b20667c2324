"""The learning-parity report (tools/lab/parity_report.py, the plot in nemo_fp8/utils/plots.py) and
tools/compare_precision.py on synthetic metrics."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from lab.parity_report import (
    _paired_cell,
    paired_over_seeds,
    paired_reward_gap,
    parity_table,
    reward_gap_table,
    seed_group_table,
    side_by_side_table,
    summarize_run,
)

REPO = Path(__file__).resolve().parents[2]


def tool():
    spec = importlib.util.spec_from_file_location("compare_precision", REPO / "tools" / "compare_precision.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fake_run(gen_s: float, kl: float, accs: list[float], steps: int = 4) -> list[dict]:
    """Rows as MetricsLogger writes them: a step-0 validation row, then steps with timings; val every 2 steps."""
    rows = [{"step": 0, "val/accuracy": accs[0], "timing/validation": 1.0}]
    for s in range(1, steps + 1):
        r = {"step": s, "train/reward_mean": 0.1 * s, "mismatch/gen_kl_error": kl * s,
             "mismatch/token_mult_prob_error": 1.0 + kl, "timing/generation": gen_s * (10 if s == 1 else 1),
             "timing/logprobs": 0.5, "timing/training": 1.5, "timing/reward": 0.1,
             "perf/rollout_tokens_per_s": 1000.0 / gen_s}
        if s % 2 == 1:
            r["timing/refit"] = 0.2
        r["timing/step"] = sum(v for k, v in r.items() if k.startswith("timing/"))
        if s % 2 == 0:
            r["val/accuracy"] = accs[s // 2]
            r["timing/validation"] = 3.0
            r["timing/step"] += 3.0
        rows.append(r)
    return rows


def test_summarize_run_hand_computed():
    s = summarize_run(fake_run(gen_s=2.0, kl=1e-3, accs=[0.1, 0.4, 0.3]))
    assert s["steps"] == 4 and s["final_acc"] == 0.3 and s["best_acc"] == 0.4
    assert s["reward_mean"] == pytest.approx(0.25)
    assert s["gen_kl_error"] == pytest.approx(2.5e-3)
    # steps 2..4 timed (step 1 is warm-up): refit on step 3 only -> 0.2 / 3
    assert s["generation_s"] == pytest.approx(2.0) and s["refit_s"] == pytest.approx(0.2 / 3)
    assert s["logprobs_s"] == pytest.approx(0.5) and s["training_s"] == pytest.approx(1.5)
    assert s["step_s"] == pytest.approx(2.0 + 0.2 / 3 + 0.5 + 1.5 + 0.1)  # validation left out
    assert s["other_s"] == pytest.approx(0.1)  # the reward: the step's time outside the four phases
    assert s["tokens_per_s"] == pytest.approx(500.0)
    with pytest.raises(ValueError, match="no training-step rows"):
        summarize_run([{"step": 0, "val/accuracy": 0.5}])
    one = summarize_run(fake_run(2.0, 0.0, [0.1, 0.2], steps=1))
    assert one["generation_s"] == pytest.approx(20.0)  # a lone step is timed, warm-up or not
    assert math.isnan(summarize_run([{"step": 1, "train/reward_mean": 0.0}])["final_acc"])


def _table_rows(table: str) -> dict[str, list[str]]:
    """Label -> the cells after it, for each row of a markdown table (its header and rule left out)."""
    return {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in table.splitlines()[2:]}


def test_parity_table_ratios_to_baseline():
    sums = {"bf16": summarize_run(fake_run(2.0, 0.0, [0.1, 0.2, 0.3])),
            "fp8+tis": summarize_run(fake_run(1.0, 1e-3, [0.1, 0.25, 0.2]))}
    table = parity_table(sums)
    rows = _table_rows(table)
    step_bf16, step_fp8 = sums["bf16"]["step_s"], sums["fp8+tis"]["step_s"]
    assert rows["bf16"][-2:] == ["1.00", "1.00"]
    assert rows["fp8+tis"][-2:] == [f"{step_fp8 / step_bf16:.2f}", "0.50"]
    assert rows["fp8+tis"][1:4] == ["0.1000", "0.2000", "0.2500"]
    assert "-" == parity_table(sums, baseline="nope").splitlines()[2].split("|")[-2].strip()


def test_side_by_side_gives_no_ratio_between_a_warm_up_step_and_later_ones():
    """A run stopped after its warm-up step (out of memory at step 2) is timed on that step only: the table says so
    and puts no ratio against a baseline timed on later steps; two warm-up-only runs still compare."""
    sums = {"bf16": summarize_run(fake_run(2.0, 0.0, [0.1, 0.2], steps=2)),
            "fp8": summarize_run(fake_run(1.0, 0.0, [0.1], steps=1))}
    assert sums["fp8"]["warmup_only"] and not sums["bf16"]["warmup_only"]
    rows = _table_rows(side_by_side_table(sums, {}, "bf16"))
    assert rows["fp8"][0] == "1 (warm-up only)" and rows["fp8"][-2:] == ["-", "-"]
    assert rows["bf16"][0] == "2" and rows["bf16"][-2:] == ["1.00", "1.00"]
    both = {"bf16": summarize_run(fake_run(2.0, 0.0, [0.1], steps=1)), "fp8": sums["fp8"]}
    rows = _table_rows(side_by_side_table(both, {}, "bf16"))
    assert rows["fp8"][-1] == "2.00"  # tokens/s: 1000 / 1.0 against 1000 / 2.0, both on the warm-up step


def _reward_rows(rewards: list[float]) -> list[dict]:
    return [{"step": 0, "val/accuracy": 0.1}] + [{"step": i + 1, "train/reward_mean": r} for i, r in enumerate(rewards)]


def test_paired_reward_gap_hand_computed():
    base = _reward_rows([0.1, 0.5, 0.2, 0.4, 0.3])
    run = _reward_rows([0.1, 0.5, 0.1, 0.3, 0.3, 0.9])  # one step more: only the 5 common steps pair
    g = paired_reward_gap(run, base, 0.0, 1.0)
    # differences 0, 0, -0.1, -0.1, 0: mean -0.04, sample sd sqrt(0.012/4) = 0.0548, se 0.0548 / sqrt(5)
    assert g["steps"] == 5 and g["diff"] == pytest.approx(-0.04)
    assert g["se"] == pytest.approx(math.sqrt(0.012 / 4 / 5)) and g["z"] == pytest.approx(-0.04 / g["se"])
    late = paired_reward_gap(run, base, 0.6, 1.0)  # steps 4 and 5 of 5
    assert late["steps"] == 2 and late["diff"] == pytest.approx(-0.05)
    with pytest.raises(ValueError, match="no common training steps"):
        paired_reward_gap(run, _reward_rows([]), 0.0, 1.0)


def test_reward_gap_table_pairs_each_host_with_its_own_baseline():
    runs = {"bf16": _reward_rows([0.1, 0.2, 0.3, 0.4, 0.5]), "fp8": _reward_rows([0.1, 0.2, 0.3, 0.3, 0.4]),
            "bf16@b": _reward_rows([0.2, 0.3, 0.4, 0.5, 0.6]), "fp8kv": _reward_rows([0.2, 0.3, 0.4, 0.5, 0.5])}
    table = reward_gap_table(runs, "bf16", baseline_of={"bf16@b": "bf16@b", "fp8kv": "bf16@b"},
                             windows=((0.0, 0.6), (0.6, 1.0)))
    rows = _table_rows(table)
    assert list(rows) == ["fp8", "bf16@b", "fp8kv"]  # bf16 itself has no row
    assert rows["fp8"][0] == "bf16" and rows["fp8"][1].startswith("+0.0000") and rows["fp8"][2].startswith("-0.1000")
    assert rows["bf16@b"][0] == "bf16" and rows["bf16@b"][2].startswith("+0.1000")
    assert rows["fp8kv"][0] == "bf16@b" and rows["fp8kv"][2].startswith("-0.0500")
    assert reward_gap_table({"fp8": runs["fp8"]}) == ""


def test_seed_group_table_hand_computed():
    """Groups by variant over -seed<N>; late window = last 40% of each run's steps (steps 4-5 of 5)."""
    runs = {"bf16": _reward_rows([0, 0, 0, 0.4, 0.6]),            # late mean 0.5
            "bf16-seed2": _reward_rows([0, 0, 0, 0.6, 0.8]),      # 0.7
            "bf16@gpu-b": _reward_rows([0, 0, 0, 0.9, 0.9]),      # seed 1 again: a near copy, left out
            "fp8+tis": _reward_rows([0, 0, 0, 0.3, 0.3]),         # 0.3
            "fp8+tis-seed3@gpu-b": _reward_rows([0, 0, 0, 0.5, 0.5]),  # 0.5 (seed 3, from another host: counted)
            "fp8kv+tis": _reward_rows([0, 0, 0, 0.1, 0.1])}       # one seed: no row
    table = seed_group_table(runs)
    rows = _table_rows(table)
    assert list(rows) == ["bf16", "fp8+tis"]
    sd = math.sqrt(0.02)  # two values 0.2 apart: sample sd 0.1414
    assert rows["bf16"] == ["1,2", "5", "0.6000", f"{sd:.4f}", "-"]
    se = math.sqrt(sd ** 2 / 2 + sd ** 2 / 2)
    assert rows["fp8+tis"][:4] == ["1,3", "5", "0.4000", f"{sd:.4f}"]
    assert rows["fp8+tis"][4] == f"{-0.2:+.4f} +- {se:.4f} ({-0.2 / se:+.1f})"
    assert seed_group_table({"bf16": runs["bf16"], "fp8": runs["fp8+tis"]}) == ""


def test_seed_group_table_reads_every_run_of_a_comparison_to_the_same_step():
    """A BF16 run that went on to step 10 (a longer recipe) is read to step 5 like the FP8 runs, so its later,
    higher rewards stay out of the window; its row alone reads both BF16 seeds to their common step."""
    runs = {"bf16": _reward_rows([0, 0, 0, 0.4, 0.6, 0.9, 0.9, 0.9, 0.9, 0.9]),  # to 5: 0.5; to 10: 0.9
            "bf16-seed2": _reward_rows([0, 0, 0, 0.6, 0.8, 0.9, 0.9]),           # to 5: 0.7; to 7: (0.8+0.9+0.9)/3
            "fp8": _reward_rows([0, 0, 0, 0.3, 0.3]), "fp8-seed2": _reward_rows([0, 0, 0, 0.5, 0.5])}
    rows = _table_rows(seed_group_table(runs))
    assert rows["fp8"][:3] == ["1,2", "5", "0.4000"] and rows["fp8"][4].startswith("-0.2000 +- ")
    # bf16's own row: both seeds to step 7, the last 40% of 7 steps = steps 5-7: (0.6+0.9+0.9)/3, (0.8+0.9+0.9)/3
    assert rows["bf16"][:3] == ["1,2", "7", f"{(0.8 + 2.6 / 3) / 2:.4f}"]


def test_paired_over_seeds_pairs_each_seed_with_the_baselines_run_of_that_seed():
    """fp8 seed 1 is 0.1 below bf16 seed 1 at every late step with one step 0.2 below; seed 2 sits 0.05 above
    bf16 seed 2: each pair's own se, combined as sqrt(se1^2 + se2^2) / 2; seed 3 has no bf16 run and is left out."""
    runs = {"bf16": _reward_rows([0.5] * 5), "bf16-seed2": _reward_rows([0.4] * 5),
            "fp8": _reward_rows([0.5, 0.5, 0.5, 0.4, 0.3]), "fp8-seed2": _reward_rows([0.45] * 5),
            "fp8-seed3": _reward_rows([0.0] * 5)}
    got = paired_over_seeds(runs, ["fp8", "fp8-seed2", "fp8-seed3"], ["bf16", "bf16-seed2"], step=5)
    g1 = paired_reward_gap(runs["fp8"], runs["bf16"], 0.6, 1.0)   # diffs -0.1, -0.2: mean -0.15, se 0.05
    assert g1["diff"] == pytest.approx(-0.15) and g1["se"] == pytest.approx(0.05)
    assert got["seeds"] == 2 and got["diff"] == pytest.approx((-0.15 + 0.05) / 2)
    assert got["se"] == pytest.approx(math.sqrt(0.05 ** 2 + 0.0) / 2)
    # read up to step 3: seed 1's late steps are then step 3 only (one pair: se NaN), the same for seed 2
    assert paired_over_seeds(runs, ["fp8"], ["bf16"], step=3)["diff"] == pytest.approx(0.0)
    assert paired_over_seeds(runs, ["fp8-seed3"], ["bf16", "bf16-seed2"], step=5) is None
    assert got["seed_se"] is None  # two seeds: the sd across them has one degree of freedom


def test_paired_over_seeds_gives_the_paired_t_tests_se_across_three_seeds():
    """Three seeds whose late gaps are -0.1, -0.2 and 0.0, each flat over its late steps (pooled se 0): the se
    across seeds is their sd / sqrt(3) = 0.1 / sqrt(3), and the table cell reads t and its 2 degrees of freedom."""
    runs = {"bf16": _reward_rows([0.5] * 5), "bf16-seed2": _reward_rows([0.5] * 5),
            "bf16-seed3": _reward_rows([0.5] * 5), "fp8": _reward_rows([0.4] * 5),
            "fp8-seed2": _reward_rows([0.3] * 5), "fp8-seed3": _reward_rows([0.5] * 5)}
    got = paired_over_seeds(runs, ["fp8", "fp8-seed2", "fp8-seed3"], ["bf16", "bf16-seed2", "bf16-seed3"], step=5)
    assert got["seeds"] == 3 and got["diff"] == pytest.approx(-0.1) and got["se"] == pytest.approx(0.0)
    assert got["seed_se"] == pytest.approx(0.1 / math.sqrt(3))
    cell = _paired_cell({"diff_late_reward_paired": got["diff"], "diff_late_reward_paired_se": got["se"],
                         "diff_late_reward_paired_seed_se": got["seed_se"], "paired_seeds": got["seeds"]})
    assert cell == f"-0.1000; seeds +- {0.1 / math.sqrt(3):.4f} (t -1.7, 2 df)"


def test_report_pairs_each_seed_with_bf16_of_that_seed_in_its_own_folder(tmp_path):
    """Runs split over two leases: folder b holds seed 2 of every arm, folder a seed 1. Each FP8 run pairs with the
    BF16 run of its own seed and folder; b's BF16 pairs with a's (seed 1: the size of seed noise)."""
    cp = tool()
    a, b = tmp_path / "a", tmp_path / "b"
    for folder, names in ((a, ["bf16", "fp8"]), (b, ["bf16-seed2", "fp8-seed2"])):
        for name in names:
            (folder / name).mkdir(parents=True)
            rows = fake_run(2.0, 1e-4, [0.1, 0.2, 0.3])
            (folder / name / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    sources = cp.report_sources(b, ["bf16-seed2", "fp8-seed2"], [a])
    pairs = cp.baseline_pairs(sources, "bf16", set(sources))
    assert pairs == {"bf16-seed2": "bf16-seed2", "fp8-seed2": "bf16-seed2", "bf16": "bf16", "fp8": "bf16"}
    assert cp.baseline_pairs(sources, "bf16", {"fp8-seed2", "fp8", "bf16"}) == {"bf16": "bf16", "fp8": "bf16"}
    _, md = cp.write_report(b, ["bf16-seed2", "fp8-seed2"], also=[a])
    gaps = md.read_text().split("steps 60-100%")[1]
    assert "| fp8-seed2 | bf16-seed2 |" in gaps and "| bf16-seed2 | bf16 |" in gaps and "| fp8 | bf16 |" in gaps


def test_a_folder_without_bf16_pairs_each_seed_with_bf16_of_that_seed_elsewhere(tmp_path):
    """A lease that ran only FP8 KV arms: its seed-2 run pairs with the BF16 seed-2 run of another folder, not with
    the report's seed-1 BF16; a seed that no folder's BF16 ran still falls back to the report's baseline."""
    cp = tool()
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for folder, name in ((a, "bf16"), (b, "bf16-seed2"), (b, "fp8-seed2"), (c, "fp8kv-seed2"), (c, "fp8kv-seed3")):
        _write_run(folder / name, fake_run(2.0, 1e-4, [0.1, 0.2, 0.3]))
    sources = cp.report_sources(a, ["bf16"], [b, c])
    assert cp.baseline_pairs(sources, "bf16", set(sources)) == {
        "bf16": "bf16", "bf16-seed2": "bf16-seed2", "fp8-seed2": "bf16-seed2", "fp8kv-seed2": "bf16-seed2"}
    _, md = cp.write_report(a, ["bf16"], also=[b, c])
    gaps = md.read_text().split("steps 60-100%")[1]
    assert "| fp8kv-seed2 | bf16-seed2 |" in gaps and "| fp8kv-seed3 | bf16 |" in gaps


def test_time_ratios_take_the_bf16_run_of_the_same_folder_whatever_its_seed(tmp_path):
    """A lease that ran ``bf16-seed3`` beside ``fp8-e2e+tis`` (seed 1): the FP8 run's rewards pair with seed 1's
    BF16 in another folder (the same sampling numbers), but its time ratios take the BF16 run of its own host."""
    cp = tool()
    a, c = tmp_path / "a", tmp_path / "c"
    for folder, name, gen_s in ((a, "bf16", 1.0), (c, "bf16-seed3", 2.0), (c, "fp8-e2e+tis", 3.0),
                                (c, "fp8-seed3", 3.0)):
        _write_run(folder / name, fake_run(gen_s, 1e-4, [0.1, 0.2, 0.3]))
    sources = cp.report_sources(c, ["bf16-seed3", "fp8-e2e+tis", "fp8-seed3"], [a])
    pairs = cp.baseline_pairs(sources, "bf16", set(sources))
    assert pairs["fp8-e2e+tis"] == "bf16" and pairs["fp8-seed3"] == "bf16-seed3"
    hosts = cp.host_baseline_pairs(sources, "bf16", set(sources))
    assert hosts == {"bf16": "bf16", "bf16-seed3": "bf16-seed3", "fp8-e2e+tis": "bf16-seed3",
                     "fp8-seed3": "bf16-seed3"}
    _, md = cp.write_report(c, ["bf16-seed3", "fp8-e2e+tis", "fp8-seed3"], also=[a])
    rows = {k: cells[-2:] for k, cells in _table_rows(md.read_text().split("\n\n")[0]).items()}
    assert rows["fp8-e2e+tis"] == rows["fp8-seed3"] and rows["fp8-e2e+tis"][1] == "1.50"  # gen 3.0 s / 2.0 s
    assert "| fp8-e2e+tis | bf16 |" in md.read_text().split("steps 60-100%")[1]  # rewards: seed 1's BF16


def test_a_lease_without_bf16_gets_no_time_ratios_though_its_rewards_pair_across_folders(tmp_path):
    """A lease that ran only FP8 arms: its seconds are not set against another lease's BF16 (another host, other
    runs sharing the GPU), so its ratio cells are "-"; its rewards still pair with the same seed's BF16."""
    cp = tool()
    a, d = tmp_path / "a", tmp_path / "d"
    for folder, name, gen_s in ((a, "bf16", 1.0), (a, "bf16-seed2", 1.0), (d, "fp8kv", 3.0),
                                (d, "fp8kv-seed2", 3.0)):
        _write_run(folder / name, fake_run(gen_s, 1e-4, [0.1, 0.2, 0.3]))
    sources = cp.report_sources(d, ["fp8kv", "fp8kv-seed2"], [a])
    assert cp.baseline_pairs(sources, "bf16", set(sources))["fp8kv-seed2"] == "bf16-seed2"
    assert cp.host_baseline_pairs(sources, "bf16", set(sources)) == {
        "bf16": "bf16", "bf16-seed2": "bf16-seed2", "fp8kv": None, "fp8kv-seed2": None}
    _, md = cp.write_report(d, ["fp8kv", "fp8kv-seed2"], also=[a])
    rows = {k: cells[-2:] for k, cells in _table_rows(md.read_text().split("\n\n")[0]).items()}
    assert rows["fp8kv"] == rows["fp8kv-seed2"] == ["-", "-"] and rows["bf16-seed2"] == ["1.00", "1.00"]
    assert "| fp8kv-seed2 | bf16-seed2 |" in md.read_text().split("steps 60-100%")[1]


def test_accuracy_per_data_source_first_and_last():
    rows = fake_run(2.0, 0.0, [0.1, 0.4, 0.3])
    for r, (a, b) in zip([r for r in rows if "val/accuracy" in r], [(0.2, 0.0), (0.7, 0.1), (0.6, 0.0)]):
        r["val/accuracy/synthetic_arithmetic"], r["val/accuracy/gsm8k"] = a, b
    s = summarize_run(rows)
    assert s["start_acc"] == 0.1 and s["acc_by_source"] == {"gsm8k": (0.0, 0.0), "synthetic_arithmetic": (0.2, 0.6)}
    table = parity_table({"bf16": s, "old": summarize_run(fake_run(2.0, 0.0, [0.1, 0.2, 0.3]))})
    lines = table.splitlines()
    head, bf16, old = ([c.strip() for c in line.split("|")[1:-1]] for line in lines[:1] + lines[2:])
    assert head[2:7] == ["start acc", "final acc", "best acc", "gsm8k acc", "synthetic_arithmetic acc"]
    assert bf16[5:7] == ["0.000 -> 0.000", "0.200 -> 0.600"] and old[5:7] == ["-", "-"]


def test_plot_adds_a_panel_per_data_source(tmp_path):
    import struct

    from nemo_fp8.utils.plots import plot_parity

    def width(path):  # PNG IHDR: width, height (big-endian) after the 16-byte signature + chunk header
        return struct.unpack(">II", path.read_bytes()[16:24])[0]

    plain = {"bf16": fake_run(2.0, 0.0, [0.1, 0.4, 0.3])}
    rows = fake_run(2.0, 0.0, [0.1, 0.4, 0.3])
    for r in rows:
        if "val/accuracy" in r:
            r["val/accuracy/synthetic_arithmetic"], r["val/accuracy/gsm8k"] = 2 * r["val/accuracy"], 0.0
    two = plot_parity(plain, tmp_path / "a.png")
    three = plot_parity({"bf16": rows, "old": plain["bf16"]}, tmp_path / "b.png")
    assert width(three) == pytest.approx(width(two) * 1.5, rel=0.02)  # 2 x 2 panels -> 2 x 3 (two sources)


def test_line_styles_give_a_variant_one_colour_and_each_run_its_own_line():
    from nemo_fp8.utils.plots import _line_styles

    names = ["bf16", "bf16-seed2", "fp8+tis", "fp8", "bf16@gpu-b", "fp8kv+tis", "fp8-e2e+tis", "fp8+fp16-train+tis",
             "bf16-seed3", "fp8+tis-seed2", "fp8+tis-seed3", "fp8-seed2"]
    style = _line_styles(names)
    assert len(set(style.values())) == len(names)  # 12 runs: no two drawn alike (a 10-colour cycle alone repeats)
    assert {style[n][0] for n in ("bf16", "bf16-seed2", "bf16@gpu-b", "bf16-seed3")} == {style["bf16"][0]}
    assert style["fp8+tis-seed3"][0] == style["fp8+tis"][0] != style["bf16"][0]
    assert [style[n][1] for n in ("bf16", "bf16-seed2", "bf16@gpu-b", "bf16-seed3")] == ["-", "--", ":", "-."]


def test_seed_means_average_distinct_seeds_at_common_steps(tmp_path):
    import struct

    from nemo_fp8.utils.plots import _seed_groups, _seed_mean_by_step, plot_parity

    runs = {"bf16": fake_run(2.0, 0.0, [0.1, 0.2, 0.3]), "bf16-seed2": fake_run(2.0, 0.0, [0.1, 0.4, 0.5], steps=2),
            "bf16@gpu-b": fake_run(2.0, 0.0, [0.9, 0.9, 0.9]), "fp8+tis": fake_run(1.0, 1e-3, [0.1, 0.2, 0.2]),
            "fp8+tis-seed2": fake_run(1.0, 1e-3, [0.1, 0.3, 0.4]), "fp8": fake_run(1.0, 1e-3, [0.1, 0.2, 0.2])}
    groups = _seed_groups(runs)
    assert groups == {"bf16": ["bf16", "bf16-seed2"], "fp8+tis": ["fp8+tis", "fp8+tis-seed2"], "fp8": ["fp8"]}
    # bf16-seed2 stopped at step 2: the mean covers steps 0 and 2 only; bf16@gpu-b (seed 1 again) is not counted
    assert _seed_mean_by_step(runs, groups["bf16"], "val/accuracy") == pytest.approx({0: 0.1, 2: 0.3})

    def width(path):
        return struct.unpack(">II", path.read_bytes()[16:24])[0]

    plain = {k: runs[k] for k in ("bf16", "fp8+tis", "fp8")}
    three = plot_parity(plain, tmp_path / "a.png", baseline="bf16")  # 4 panels + paired: 2 x 3
    four = plot_parity(runs, tmp_path / "b.png", baseline="bf16")  # + two seed-mean panels: 2 x 4
    assert width(four) == pytest.approx(width(three) * 4 / 3, rel=0.02)


def test_report_only_writes_png_and_table(tmp_path, capsys):
    runs = {"bf16": fake_run(2.0, 0.0, [0.1, 0.2, 0.3]), "bf16-seed2": fake_run(2.1, 0.0, [0.1, 0.22, 0.28]),
            "fp8+tis": fake_run(1.0, 1e-3, [0.1, 0.25, 0.2])}
    for name, rows in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9, "tr')
    (tmp_path / "fp8").mkdir()  # a variant that failed before its first step
    (tmp_path / "fp8" / "metrics.jsonl").write_text(json.dumps({"step": 0, "val/accuracy": 0.1}) + "\n")
    rc = tool().main(["--backend", "gpu", "--report-only", "--out-dir", str(tmp_path),
                      "--variants", "bf16,bf16-seed2,fp8+tis,fp8,fp8kv+tis"])
    assert rc == 0
    png = (tmp_path / "parity.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    md = (tmp_path / "parity.md").read_text()
    assert md.splitlines()[0].startswith("| variant | steps | start acc | final acc | best acc |")
    assert [line.split("|")[1].strip() for line in md.splitlines()[2:5]] == ["bf16", "bf16-seed2", "fp8+tis"]
    assert "Missing: fp8: no training-step rows" in md and "fp8kv+tis: no " in md
    assert md.splitlines()[2] in capsys.readouterr().out


def test_report_joins_another_hosts_runs_with_also(tmp_path, capsys):
    a, b = tmp_path / "gpu", tmp_path / "gpu-b"
    # host b's GPU is twice as slow: its runs' ratios must be to its own bf16, not to host a's
    for d, name, acc, gen_s in ((a, "bf16", 0.3, 1.0), (a, "fp8+tis", 0.31, 1.0), (b, "bf16", 0.29, 2.0),
                                (b, "fp8kv+tis", 0.32, 1.0)):
        _write_run(d / name, fake_run(gen_s, 1e-3, [0.1, 0.2, acc]))
    (b / "fp8-e2e+tis").mkdir()  # started, no metrics yet: not a run
    rc = tool().main(["--backend", "gpu", "--report-only", "--out-dir", str(a), "--variants", "bf16,fp8+tis",
                      "--also", str(b)])
    assert rc == 0
    md = (a / "parity.md").read_text()
    first_table = md.split("\n\n")[0]
    rows = _table_rows(first_table)
    assert list(rows) == ["bf16", "fp8+tis", "bf16@gpu-b", "fp8kv+tis"]
    assert "0.3200" in rows["fp8kv+tis"] and "0.2900" in rows["bf16@gpu-b"]
    assert "name@folder" in md and "own bf16 run" in md
    assert "| fp8kv+tis | bf16@gpu-b |" in md and "| bf16@gpu-b | bf16 |" in md  # the paired reward table
    gen_ratio = {k: cells[-1] for k, cells in rows.items()}
    assert gen_ratio == {"bf16": "1.00", "fp8+tis": "1.00", "bf16@gpu-b": "1.00", "fp8kv+tis": "0.50"}
    assert tool().main(["--backend", "gpu", "--report-only", "--out-dir", str(a), "--also", str(tmp_path / "x")]) == 2
    assert "--also" in capsys.readouterr().err


def test_also_folder_without_a_usable_baseline_pairs_with_ours_everywhere(tmp_path):
    a, b, c = tmp_path / "gpu", tmp_path / "gpu-b", tmp_path / "gpu-c"
    for d, name, gen_s in ((a, "bf16", 1.0), (b, "fp8kv+tis", 0.5), (c, "fp8+tis-seed2", 0.25)):
        _write_run(d / name, fake_run(gen_s, 1e-3, [0.1, 0.2, 0.3]))
    (b / "bf16").mkdir()  # host b's bf16 failed before its first training step; host c ran no bf16 at all
    (b / "bf16" / "metrics.jsonl").write_text(json.dumps({"step": 0, "val/accuracy": 0.1}) + "\n")
    assert tool().main(["--backend", "gpu", "--report-only", "--out-dir", str(a), "--variants", "bf16",
                        "--also", str(b), "--also", str(c)]) == 0
    md = (a / "parity.md").read_text()
    assert {k: cells[-1] for k, cells in _table_rows(md.split("\n\n")[0]).items()} == {
        "bf16": "1.00", "fp8kv+tis": "-", "fp8+tis-seed2": "-"}  # gen / bf16: no BF16 timed on hosts b and c
    assert "| fp8kv+tis | bf16 |" in md and "| fp8+tis-seed2 | bf16 |" in md  # rewards: paired with host a's
    assert "bf16@gpu-b: no training-step rows" in md


def test_report_only_without_any_metrics_fails(tmp_path):
    assert tool().main(["--backend", "gpu", "--report-only", "--out-dir", str(tmp_path)]) == 1


def test_unknown_variant_is_refused(capsys):
    assert tool().main(["--backend", "gpu", "--variants", "bf16,fp9", "--dry-run"]) == 2
    assert "fp9" in capsys.readouterr().err


# (ids: a test id "gpu" would be taken for the gpu marker and skipped without CUDA)
@pytest.mark.parametrize("backend", ["cpu", "gpu"], ids=["torch-backends", "vllm-megatron"])
def test_every_variant_is_a_valid_config(backend):
    """Each variant's overrides pass the config checks on the backend's default config and set what they say."""
    from nemo_fp8.config import load_config

    cp = tool()
    table = cp.GPU_VARIANTS if backend == "gpu" else cp.VARIANTS
    expect = {  # name: (rollout precision, kv cache, IS on, FP8 training, FP16 training, seed)
        "bf16": ("bfloat16", "auto", False, False, False, 42), "bf16-seed2": ("bfloat16", "auto", False, False, False, 43),
        "bf16+tis": ("bfloat16", "auto", True, False, False, 42), "fp8": ("fp8", "auto", False, False, False, 42),
        "fp8+tis": ("fp8", "auto", True, False, False, 42), "fp8kv+tis": ("fp8", "fp8", True, False, False, 42),
        "fp8kv": ("fp8", "fp8", False, False, False, 42),
        "fp8-e2e+tis": ("fp8", "auto", True, True, False, 42), "fp8+fp16-train+tis": ("fp8", "auto", True, False, True, 42)}
    for name, overrides in table.items():
        cfg = load_config(cp.DEFAULT_CONFIG[backend], overrides)
        v, m = cfg.policy.generation.vllm_cfg, cfg.policy.megatron_cfg
        got = (v.precision, v.kv_cache_dtype, cfg.loss_fn.use_importance_sampling_correction, m.fp8_cfg.enabled,
               m.optimizer.fp16, cfg.grpo.seed)
        assert got == expect[name], name
        if backend == "gpu":
            assert cfg.policy.generation.backend == "vllm" and m.enabled
            if m.fp8_cfg.enabled:
                assert (m.fp8_cfg.fp8, m.fp8_cfg.fp8_recipe) == ("e4m3", "blockwise")
    if backend == "gpu":
        assert set(table) == {"bf16", "bf16-seed2", "fp8+tis", "fp8", "fp8kv+tis", "fp8kv", "fp8-e2e+tis",
                              "fp8+fp16-train+tis"}


def test_any_variant_with_another_sampling_seed(capsys):
    """``<variant>-seed<N>``: the variant's overrides plus grpo.seed=41+N (a second FP8 rollout stream)."""
    from nemo_fp8.config import load_config

    cp = tool()
    assert cp.variant_overrides("gpu", "fp8+tis-seed3") == [*cp.GPU_VARIANTS["fp8+tis"], "grpo.seed=44"]
    assert cp.variant_overrides("gpu", "bf16-seed2") == cp.GPU_VARIANTS["bf16-seed2"]  # the listed one: 43
    cfg = load_config(cp.DEFAULT_CONFIG["gpu"], cp.variant_overrides("gpu", "fp8kv+tis-seed2"))
    assert (cfg.grpo.seed, cfg.policy.generation.vllm_cfg.kv_cache_dtype, cfg.data.seed) == (43, "fp8", 0)
    assert load_config(cp.DEFAULT_CONFIG["cpu"], cp.variant_overrides("cpu", "fp8-seed2")).grpo.seed == 43
    for bad in ("fp8-seed1", "fp8-seed", "fp9-seed2", "bf16-seed2-seed3x"):
        with pytest.raises(KeyError):
            cp.variant_overrides("gpu", bad)
    assert cp.main(["--backend", "gpu", "--variants", "fp8+tis-seed2,fp8-seed1", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "fp8-seed1" in err and "fp8+tis-seed2" not in err.split("valid:")[0] and "-seed<N>" in err


def test_dry_run_prints_one_command_per_variant(tmp_path, capsys):
    assert tool().main(["--backend", "gpu", "--dry-run", "--out-dir", str(tmp_path), "grpo.max_num_steps=5"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert len(lines) == len(tool().GPU_VARIANTS) and all(line.endswith("grpo.max_num_steps=5") for line in lines)
    assert f"logger.log_dir={tmp_path}/fp8kv+tis" in lines[4]
    assert not list(tmp_path.iterdir())


def test_parallel_dry_run_shares_the_gpu_between_engines(tmp_path, capsys):
    assert tool().main(["--backend", "gpu", "--dry-run", "--parallel", "3", "--out-dir", str(tmp_path)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert len(lines) == len(tool().GPU_VARIANTS)
    assert all("policy.generation.vllm_cfg.gpu_memory_utilization=0.15" in line for line in lines)
    # a value given on the command line wins
    assert tool().main(["--backend", "gpu", "--dry-run", "--parallel", "3", "--out-dir", str(tmp_path),
                        "policy.generation.vllm_cfg.gpu_memory_utilization=0.1"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert all(line.count("gpu_memory_utilization") == 1 and "gpu_memory_utilization=0.1 " in line for line in lines)


def test_parallel_engines_get_a_fixed_kv_cache_instead_of_profiling():
    """Sharing the GPU, each engine's KV cache is fixed (vLLM's profiling reads the GPU's free memory, which the
    other variants change); one variant at a time keeps vLLM's own sizing; a given key wins."""
    po = tool().parallel_overrides
    assert po(["a=1"], 1, 4.0) == ["a=1"]
    out = po(["a=1"], 7, 4.0)
    assert "policy.generation.vllm_cfg.kv_cache_memory_bytes=4294967296" in out
    assert "policy.generation.vllm_cfg.gpu_memory_utilization=0.064" in out
    mine = po(["policy.generation.vllm_cfg.kv_cache_memory_bytes=1000"], 7, 4.0)
    assert [o for o in mine if "kv_cache_memory_bytes" in o] == ["policy.generation.vllm_cfg.kv_cache_memory_bytes=1000"]


def test_run_variants_overlaps_runs_and_reports_failures(tmp_path, capsys):
    """Two 1.5 s runs at a time: the three runs overlap, each log holds its output, the failure is listed."""
    import sys
    import time

    script = ("import sys, time; print('start', time.time(), flush=True); time.sleep(1.5); "
              "print('end', time.time()); sys.exit(int(sys.argv[1]))")
    commands = {name: [sys.executable, "-c", script, rc] for name, rc in (("a", "0"), ("b", "3"), ("c", "0"))}
    t0 = time.monotonic()
    failed = tool().run_variants(commands, tmp_path, parallel=2, poll_s=0.05)
    elapsed = time.monotonic() - t0
    assert failed == ["b"] and "[b] failed (exit 3)" in capsys.readouterr().err
    spans = {}
    for name in commands:
        words = (tmp_path / name / "run.log").read_text().split()
        spans[name] = (float(words[1]), float(words[3]))
    assert spans["a"][0] < spans["b"][1] and spans["b"][0] < spans["a"][1]  # a and b ran at the same time
    assert spans["c"][0] >= min(spans["a"][1], spans["b"][1]) - 0.05          # c waited for a free slot
    assert elapsed < 4.4  # three 1.5 s runs one after another would take >= 4.5 s


def test_report_states_concurrency(tmp_path):
    for name, gen_s in (("bf16", 2.0), ("fp8+tis", 1.5)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in fake_run(gen_s, 1e-3, [0.1, 0.2, 0.3])))
    _, md = tool().write_report(tmp_path, ["bf16", "fp8+tis"], concurrency=4)
    assert "Up to 4 variants ran at once" in md.read_text()
    _, md = tool().write_report(tmp_path, ["bf16", "fp8+tis"])
    assert "ran at once" not in md.read_text()


def mission_tool():
    spec = importlib.util.spec_from_file_location("mission_report", REPO / "tools" / "mission_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write_run(d: Path, rows: list[dict]) -> Path:
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def test_peak_gpu_memory_reads_nvidia_smi_csv_per_gpu(tmp_path):
    from lab.parity_report import peak_gpu_memory

    csv = tmp_path / "mem.csv"
    csv.write_text("timestamp, index, memory.used [MiB]\n2026/11/23 21:50:13.379, 0, 117926 MiB\n"
                   "2026/11/23 21:50:13.379, 1, 2048 MiB\n2026/11/23 21:50:16.380, 0, 86726 MiB\n"
                   "timestamp, index, memory.used [MiB]\n2026/11/23 21:51:28.393, 1, 4096 MiB\n")
    assert peak_gpu_memory(csv) == {0: pytest.approx(117926 / 1024), 1: 4.0}
    (tmp_path / "bad.csv").write_text("time, used\n1, 2\n")
    with pytest.raises(ValueError, match="expected nvidia-smi's timestamp, index, memory.used"):
        peak_gpu_memory(tmp_path / "bad.csv")


def test_mission_report_puts_runs_side_by_side_with_ratios_and_peaks(tmp_path):
    fp8 = _write_run(tmp_path / "mission_fp8", fake_run(gen_s=2.0, kl=1e-3, accs=[0.1, 0.2, 0.3]))
    bf16 = _write_run(tmp_path / "mission_bf16", fake_run(gen_s=4.0, kl=1e-4, accs=[0.1, 0.2, 0.3]))
    (tmp_path / "fp8.csv").write_text("timestamp, index, memory.used [MiB]\nt, 0, 61440 MiB\nt, 1, 30720 MiB\n")
    out = tmp_path / "mission.md"
    rc = mission_tool().main([f"fp8={fp8},{tmp_path / 'fp8.csv'}", f"bf16={bf16}", "--out", str(out)])
    md = out.read_text()
    assert rc == 0 and "### fp8" in md and "### bf16" in md
    # steps 2-4: gen 2.0 vs 4.0 s, refit every other step (0.2 at step 3: mean 0.067), tokens/s 500 vs 250
    fp8_row = next(line for line in md.splitlines() if line.startswith("| fp8 |"))
    cells = [c.strip() for c in fp8_row.strip("|").split("|")]
    # other s (cell 6): the reward's 0.1 s, the step outside the four phases
    assert cells[:4] == ["fp8", "4", "2.00", "0.07"] and cells[6] == "0.10" and cells[8] == "500"
    assert cells[9] == "0: 60.0, 1: 30.0"
    step_ratio = (2.0 + 0.2 / 3 + 0.5 + 1.5 + 0.1) / (4.0 + 0.2 / 3 + 0.5 + 1.5 + 0.1)
    assert cells[10] == f"{step_ratio:.2f}" and cells[11] == "2.00"
    bf16_row = next(line for line in md.splitlines() if line.startswith("| bf16 |"))
    assert bf16_row.split("|")[10].strip() == "-"  # no memory log given
    assert mission_tool().main([f"x={tmp_path / 'none'}"]) == 2


def test_mission_report_rollout_ceiling_bounds_each_fp8_step(tmp_path):
    """--ceiling: the step an FP8 run would take at the engine's own FP8 gain (its other phases as measured), and the
    engines' bound (rollout at the engine's gain, log-probs + training at the run's own or, with --train-ceiling, the
    training engine's gain, refit and the rest at BF16's time, each phase at the run's own where faster) beside its
    target; the seeded rate when both engine rows have it (the GRPO rollout seeds each request)."""
    tool = mission_tool()
    fp8_rows = fake_run(gen_s=2.0, kl=1e-3, accs=[0.1, 0.2, 0.3])
    for r in fp8_rows[1:]:  # FP8 trains faster (1.5 -> 1.0 s) and refits slower (0.2 -> 0.5 s)
        r["timing/training"], r["timing/step"] = 1.0, r["timing/step"] - 0.5
        if "timing/refit" in r:
            r["timing/refit"], r["timing/step"] = 0.5, r["timing/step"] + 0.3
    fp8 = _write_run(tmp_path / "fp8", fp8_rows)
    bf16 = _write_run(tmp_path / "bf16", fake_run(gen_s=4.0, kl=1e-4, accs=[0.1, 0.2, 0.3]))
    engines = [{"model": "dense", "precision": "bf16", "fixed_tok_s": 1000.0, "fixed_seeded_tok_s": 800.0},
               {"model": "dense", "precision": "fp8-deepgemm-v2", "fixed_tok_s": 1300.0, "fixed_seeded_tok_s": 1000.0},
               {"model": "dense", "precision": "fp8-deepgemm-kv-v2", "error": "skipped"}]
    (tmp_path / "ceiling.json").write_text(json.dumps(engines))
    out = tmp_path / "mission.md"
    assert tool.main([f"fp8={fp8}", f"bf16={bf16}", "--ceiling", str(tmp_path / "ceiling.json"),
                      "--targets", "fp8=0.80,fp8kv=0.72", "--out", str(out)]) == 0
    md = out.read_text().split("### rollout ceiling")[1]
    row = next(line for line in md.splitlines() if line.startswith("| fp8 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # steps 2..4 timed; the refit runs on step 3 only
    step_fp8, step_bf16 = 2.0 + 0.5 / 3 + 0.5 + 1.0 + 0.1, 4.0 + 0.2 / 3 + 0.5 + 1.5 + 0.1
    bound = (step_fp8 - 2.0 + 4.0 / 1.25) / step_bf16  # seeded gain 1000 / 800
    # the run's own rollout (2x) beats the engine's 1.25x and stays; its training; BF16's refit and reward
    engines_bound = (2.0 + 0.5 + 1.0 + 0.2 / 3 + 0.1) / step_bf16
    assert cells == ["fp8", "fp8-deepgemm-v2 (seeded)", "1.250", "2.000", f"{step_fp8 / step_bf16:.3f}", f"{bound:.3f}",
                     "-", f"{2.0 / 1.5:.3f}", f"{engines_bound:.3f}", "0.80", "yes"]
    assert bound > 0.80 >= engines_bound  # the rollout alone at its engine's gain misses; without FP8's refit cost not
    # --train-ceiling: log-probs and training at the training engine's raw f+b gain (BF16 100 ms / blockwise 50 ms)
    train_rows = [{"recipe": "bf16", "packed": True, "raw_ms": 100.0},
                  {"recipe": "e4m3-blockwise", "packed": True, "raw_ms": 50.0},
                  {"recipe": "e4m3-blockwise", "packed": False, "raw_ms": None},
                  {"recipe": "e4m3-tensorwise", "packed": True, "error": "out of memory"}]
    (tmp_path / "train.json").write_text(json.dumps(train_rows))
    assert tool.main([f"fp8={fp8}", f"bf16={bf16}", "--ceiling", str(tmp_path / "ceiling.json"), "--train-ceiling",
                      str(tmp_path / "train.json"), "--targets", "fp8=0.80", "--out", str(out)]) == 0
    row = next(line for line in out.read_text().split("### rollout ceiling")[1].splitlines()
               if line.startswith("| fp8 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    engines_bound = (2.0 + 2.0 / 2.0 + 0.2 / 3 + 0.1) / step_bf16
    assert cells[6:] == ["e4m3-blockwise 2.000", f"{2.0 / 1.5:.3f}", f"{engines_bound:.3f}", "0.80", "yes"]
    assert tool.train_gains(train_rows) == {"bf16": 1.0, "e4m3-blockwise": 2.0}
    assert tool.train_gains(train_rows[1:]) == {}  # no BF16 row: no gains
    # a phase the run already does faster than its engine's gain keeps the run's time: the bound stays optimistic
    phases = {"logprobs_s": 0.5, "training_s": 1.0, "refit_s": 0.5, "other_s": 0.1, "generation_s": 2.0}
    base = {"logprobs_s": 0.5, "training_s": 1.5, "refit_s": 0.2, "other_s": 0.1, "generation_s": 4.0, "step_s": 10.0}
    assert tool.engines_bound(phases, base, 1.5, 1.1) == pytest.approx((2.0 + 1.5 + 0.2 + 0.1) / 10.0)
    assert tool.engines_bound(phases, base, 4.0, 4.0) == pytest.approx((1.0 + 0.5 + 0.2 + 0.1) / 10.0)
    # a run whose refit and other time beat the baseline's keeps them: no run is faster than its bound
    fast = {**phases, "refit_s": 0.1, "other_s": 0.05}
    assert tool.engines_bound(fast, base, 1.5, 1.1) == pytest.approx((2.0 + 1.5 + 0.1 + 0.05) / 10.0)
    s_fp8 = {"step_s": step_fp8, "generation_s": 2.0}
    s_bf16 = {"step_s": step_bf16, "generation_s": 4.0}
    assert tool.rollout_bound(s_fp8, s_bf16, 4.0 / 2.0) == pytest.approx(step_fp8 / step_bf16)  # the run's own gain
    phases = {"logprobs_s": 0.5, "training_s": 1.5, "refit_s": 0.2, "other_s": 0.1}
    same = {**phases, "generation_s": 2.0, "step_s": 4.3}
    assert tool.engines_bound(same, same, 1.0, 1.0) == pytest.approx(1.0)  # gains of 1: the baseline itself
    with pytest.raises(ValueError, match="must be > 0"):
        tool.engines_bound(s_fp8, s_bf16, 1.2, 0.0)
    assert tool.main([f"fp8={fp8}", f"bf16={bf16}", "--ceiling", str(tmp_path / "ceiling.json"),
                      "--train-ceiling", str(tmp_path / "none.json")]) == 2
    # without seeded rates on both rows, the unseeded ones; no target: no verdict
    for r in engines:
        r.pop("fixed_seeded_tok_s", None)
    summaries = {"bf16": {**s_bf16, **phases, "tokens_per_s": 250.0},
                 "fp8": {**s_fp8, **phases, "tokens_per_s": 500.0}}
    table = tool.ceiling_table(summaries, engines, "bf16", {})
    assert "| fp8 | fp8-deepgemm-v2 (unseeded) | 1.300 |" in table and table.rstrip().endswith("| - | - |")
    # the configs pin vLLM's V2 runner; a run pinned to V1 (the suite's fp8v1) is bounded by the V1 engine's row
    v1 = [*engines, {"model": "dense", "precision": "fp8-deepgemm", "fixed_tok_s": 1100.0}]
    table = tool.ceiling_table({**summaries, "fp8v1": summaries["fp8"]}, v1, "bf16", {})
    assert "| fp8v1 | fp8-deepgemm (unseeded) | 1.100 |" in table and "| fp8 | fp8-deepgemm-v2 (unseeded) |" in table
    with pytest.raises(ValueError, match="needs a bf16 engine row"):
        tool.ceiling_table(summaries, engines[1:], "bf16", {})
    with pytest.raises(ValueError, match="expected run=number"):
        tool.parse_targets("fp8:0.8")
    assert tool.main([f"fp8={fp8}", f"bf16={bf16}", "--ceiling", str(tmp_path / "none.json")]) == 2
    (tmp_path / "failed.json").write_text(json.dumps([{"precision": "bf16", "error": "engine died"}]))
    md = tool.report([f"fp8={fp8}", f"bf16={bf16}"], "bf16", tmp_path / "failed.json")
    assert "### side by side" in md and "not computed" in md and "needs a bf16 engine row" in md


def test_mission_report_times_the_refit_and_the_other_time_by_part(tmp_path):
    """The refit's parts and the engine's wake / sleep (timing/refit/*, timing/engine_*): mean seconds per step over
    the timed steps and each one's ratio to the baseline's, and the other time no timer covers; no such table for
    runs that logged none."""
    tool = mission_tool()

    def with_parts(rows, transfer, wake, untimed):
        for r in rows[1:]:  # the wake and the untimed seconds lengthen the step outside the four phases
            r.update({"timing/refit/transfer": transfer * r["step"], "timing/engine_wake": wake})
            r["timing/step"] += wake + untimed
        return rows

    fp8 = _write_run(tmp_path / "fp8", with_parts(fake_run(gen_s=2.0, kl=1e-3, accs=[0.1, 0.2, 0.3]), 0.2, 0.5, 0.2))
    bf16 = _write_run(tmp_path / "bf16", with_parts(fake_run(gen_s=4.0, kl=1e-4, accs=[0.1, 0.2, 0.3]), 0.1, 0.5, 0.8))
    md = tool.report([f"bf16={bf16}", f"fp8={fp8}"], "bf16")
    table = md.split("### the refit and the other time by part")[1]
    assert "| run | refit/transfer s | engine_wake s | reward s | untimed s |" in table
    # steps 2..4: transfer 0.1 x (2+3+4)/3 = 0.3 (bf16), 0.6 (fp8); other = wake + reward + untimed
    assert "| bf16 | 0.30 | 0.50 | 0.10 | 0.80 |" in table
    assert "| fp8 | 0.60 (2.00x) | 0.50 (1.00x) | 0.10 (1.00x) | 0.20 (0.25x) |" in table
    plain = tool.report([f"bf16={_write_run(tmp_path / 'b2', fake_run(gen_s=4.0, kl=0.0, accs=[0.1, 0.2, 0.3]))}"],
                        "bf16")
    assert "by part" not in plain


def test_mission_report_puts_the_refits_bytes_beside_its_floor(tmp_path):
    """refit/gbytes and the transfer's seconds: GB/s, the HBM floor (2 x GB at the copy bandwidth) and the ratio,
    and refit + wake + sleep a step; steps that sent nothing (no refit) are left out of the means."""
    tool = mission_tool()
    rows = fake_run(gen_s=2.0, kl=1e-3, accs=[0.1, 0.2, 0.3])
    for r in rows:
        if r.get("timing/refit"):
            r.update({"refit/gbytes": 9.0, "timing/refit/transfer": 0.9, "timing/engine_wake": 0.1,
                      "timing/engine_sleep": 0.05})
    run = _write_run(tmp_path / "fp8", rows)
    table = tool.report([f"fp8={run}"], "fp8").split("### the refit's bytes against its floor")[1]
    refits = [r for r in tool.timed_steps(rows) if r.get("timing/refit")]
    total = sum(r["timing/refit"] for r in refits) / len(refits) + 0.15
    # 9 GB in 0.9 s: 10 GB/s; floor 2 x 9 GB / 4,300 GB/s = 4.2 ms; 0.9 s is 215x that
    assert f"| fp8 | {len(refits)} | 9.00 | 0.900 | 10.0 | 4.2 | 215x | {total:.2f} |" in table
    assert tool.refit_bytes_table({"x": fake_run(gen_s=2.0, kl=0.0, accs=[0.1, 0.2, 0.3])}) == ""


def test_each_out_dir_checkpoints_in_its_own_folder(tmp_path):
    """Two comparisons with different --out-dir (a sweep beside the parity run) must not share a checkpoint folder:
    the run lock of one stopped the other."""
    mod = tool()

    def ckpt(out_dir):
        cmd = mod.variant_command("gpu", "bf16", "cfg.yaml", out_dir, [])
        return next(a.split("=", 1)[1] for a in cmd if a.startswith("checkpointing.checkpoint_dir="))

    assert ckpt(REPO / "logs" / "compare" / "gpu") == str(REPO / "results" / "compare" / "gpu" / "bf16")
    assert ckpt(REPO / "logs" / "sweep" / "a") == str(REPO / "results" / "sweep" / "a" / "bf16")
    assert ckpt(REPO / "logs" / "sweep" / "a") != ckpt(REPO / "logs" / "sweep" / "b")
    assert ckpt(tmp_path / "x") == str(tmp_path / "x" / "checkpoints" / "bf16")


def test_validation_points_carry_their_binomial_standard_error(tmp_path):
    from nemo_fp8.utils.plots import plot_parity, val_accuracy_with_se

    rows = [{"step": 10, "val/accuracy": 0.5, "val/num_samples": 256.0}, {"step": 0, "val/accuracy": 0.25,
            "val/num_samples": 256.0}, {"step": 5, "train/reward_mean": 0.3}, {"step": 20, "val/accuracy": 0.4}]
    got = val_accuracy_with_se(rows)
    assert [(s, p) for s, p, _ in got] == [(0, 0.25), (10, 0.5), (20, 0.4)]
    assert got[0][2] == pytest.approx(math.sqrt(0.25 * 0.75 / 256)) and got[1][2] == pytest.approx(1 / 32)
    assert math.isnan(got[2][2])  # no val/num_samples: no standard error to draw
    # the plot draws the error bars / band from val/num_samples: the same run without it is drawn differently
    with_n = fake_run(2.0, 0.0, [0.1, 0.4, 0.3])
    for r in with_n:
        if "val/accuracy" in r:
            r["val/num_samples"] = 16.0
    a = plot_parity({"bf16": fake_run(2.0, 0.0, [0.1, 0.4, 0.3])}, tmp_path / "a.png").read_bytes()
    b = plot_parity({"bf16": with_n}, tmp_path / "b.png").read_bytes()
    assert a != b


def test_mission_report_scaling_from_another_gpu_count(tmp_path):
    """--scale-from 4=DIR --gpus 8: each run in both suites' folders, step seconds and rollout tokens/s per GPU at
    each count, the speed-up and the scaling efficiency (speed-up over the GPUs' ratio)."""
    tool = mission_tool()
    for run in ("bf16", "fp8"):  # 4 GPUs: a 2 s rollout; 8 GPUs: 1 s, the other phases alike
        _write_run(tmp_path / "m4" / run, fake_run(gen_s=2.0, kl=1e-4, accs=[0.1, 0.2, 0.3]))
    eight = _write_run(tmp_path / "m8" / "bf16", fake_run(gen_s=1.0, kl=1e-4, accs=[0.1, 0.2, 0.3]))
    md = tool.report([f"bf16={eight}"], "bf16", scale_from=(4, tmp_path / "m4"), gpus=8)
    table = md.split("### scaling from 4 to 8 GPUs")[1]
    step4, step8 = (4.1 + 4.3 + 4.1) / 3, (3.1 + 3.3 + 3.1) / 3  # steps 2-4, the refit on step 3
    speedup = step4 / step8
    assert (f"| bf16 | {step4:.2f} | {step8:.2f} | {speedup:.2f} | {speedup / 2:.2f} | 125 | 125 | 1.00 |"
            in table)  # 500 tok/s on 4 GPUs, 1,000 on 8: the same per GPU
    assert "| fp8 |" not in table  # only in the 4-GPU folder
    assert tool.parse_scale_from("4=logs/m4") == (4, Path("logs/m4"))
    for bad in ("logs/m4", "four=logs/m4", "0=logs/m4", "4="):
        with pytest.raises(ValueError, match="expected GPUS=DIR"):
            tool.parse_scale_from(bad)
    with pytest.raises(FileNotFoundError, match="no <run>/metrics.jsonl"):
        tool.report([f"bf16={eight}"], "bf16", scale_from=(4, tmp_path / "nothing"), gpus=8)
    with pytest.raises(ValueError, match="scale_from needs gpus"):
        tool.report([f"bf16={eight}"], "bf16", scale_from=(4, tmp_path / "m4"))
    with pytest.raises(SystemExit):  # --scale-from without --gpus
        tool.main([f"bf16={eight}", "--scale-from", f"4={tmp_path / 'm4'}"])
    assert tool.main([f"bf16={eight}", "--scale-from", f"4={tmp_path / 'm4'}", "--gpus", "8"]) == 0
