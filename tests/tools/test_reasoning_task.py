"""Issue 51's reasoning start point on CPU: the arithmetic-chain generator (tools/lab/chains.py), the builder's
``--task chains`` path (tools/make_small_model.py), the arms' recipes and the suite's report (parity.json)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from lab.chains import (CHAIN_DATA_SOURCE, Chain, ChainTask, build_chain_data, check_task, make_chain_problems,
                        steps_of, teacher_solutions)
from lab.small import SMALL_PROMPT_TEMPLATE, tokenizer_corpus, train_bpe_tokenizer
from nemo_fp8.rewards.math_reward import score_response

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "examples" / "configs" / "recipes" / "llm"
STEP_RE = re.compile(r"Step (\d+): (?:add|subtract|multiply) .*\. (-?\d+) ([-+*]) (\d+) = (-?\d+)$")


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generator_is_seeded_and_pinned():
    a, b = make_chain_problems(200, 7, ChainTask()), make_chain_problems(200, 7, ChainTask())
    assert [e for e, _ in a] == [e for e, _ in b] and [c for _, c in a] == [c for _, c in b]
    assert [e.problem for e, _ in make_chain_problems(200, 8, ChainTask())] != [e.problem for e, _ in a]
    # Python's Mersenne Twister and randint are the same on every machine: pin the first problem and a digest of 200
    assert a[0][0].problem == ("Start with 21. Subtract 3. Add 70. Add 48. Multiply by 2. Multiply by 2. Add 13. "
                               "Subtract 55. Add 32. What number do you end with?") and a[0][0].answer == "534"
    digest = hashlib.sha256("".join(e.problem + e.answer for e, _ in a).encode()).hexdigest()[:16]
    assert digest == DIGEST, digest
    sols = [c for _, c in a]
    assert teacher_solutions(sols, 3, 0.7) == teacher_solutions(sols, 3, 0.7) != teacher_solutions(sols, 4, 0.7)


DIGEST = "4cf0103efdbac852"  # sha256 of the 200 problems and answers, seed 7, the default task


def test_chains_respect_the_difficulty_knobs():
    task = ChainTask(min_steps=3, max_steps=12, max_operand=40, max_multiplier=4, max_value=300)
    for e, c in make_chain_problems(500, 1, task):
        assert 3 <= len(c.steps) <= 12 and 2 <= c.start <= 40 and e.data_source == CHAIN_DATA_SOURCE
        assert all(0 <= v <= 300 for v in c.values()) and e.answer == str(c.values()[-1])
        for op, x in c.steps:
            assert (2 <= x <= 4) if op == "*" else (2 <= x <= 40)
        assert steps_of(e) == f"steps={len(c.steps):02d}"
    ops = {op for _, c in make_chain_problems(200, 1, replace(task, ops=("+", "-"))) for op, _ in c.steps}
    assert ops == {"+", "-"}


def test_correct_solutions_score_one_and_slipped_ones_zero():
    pairs = make_chain_problems(300, 2, ChainTask())
    chains = [c for _, c in pairs]
    for (e, c), sol in zip(pairs, teacher_solutions(chains, 5, 0.0)):
        assert score_response(sol, e.answer) == 1.0
        assert score_response(sol.rsplit("Answer:", 1)[0] + f"Answer: {int(e.answer) + 1}", e.answer) == 0.0
        for line in sol.splitlines()[1:-1]:  # every step line is right arithmetic on the previous result
            i, a, op, x, r = STEP_RE.fullmatch(line).groups()
            assert int(r) == {"+": int(a) + int(x), "-": int(a) - int(x), "*": int(a) * int(x)}[op]
    # every carry dropped: the teacher's chain leaves the correct one at its first carry addition, 10 below, and
    # stays below (adding, subtracting and multiplying keep the offset negative): wrong exactly when it has a carry
    slipped = teacher_solutions(chains, 5, 1.0)
    assert [score_response(s, e.answer) for (e, _), s in zip(pairs, slipped)] == \
        [0.0 if c.carry_steps() else 1.0 for c in chains]
    assert 0 < sum(not c.carry_steps() for c in chains) < len(chains)


def test_slips_drop_a_carry_at_the_rate_asked():
    chains = [c for _, c in make_chain_problems(2000, 3, ChainTask())]
    carries = slips = 0
    for sol in teacher_solutions(chains, 9, 0.7):
        for line in sol.splitlines()[1:-1]:
            _, a, op, x, r = STEP_RE.fullmatch(line).groups()
            if op == "+" and int(a) % 10 + int(x) % 10 >= 10:
                carries += 1
                slips += int(r) == int(a) + int(x) - 10
            else:
                assert int(r) == {"+": int(a) + int(x), "-": int(a) - int(x), "*": int(a) * int(x)}[op]
    assert carries > 1000 and abs(slips / carries - 0.7) < 0.03
    # one chain by hand: 47 + 38 carries (7 + 8 = 15); the slip writes 75 and goes on from it
    c = Chain(47, (("+", 38), ("*", 2)))
    assert c.solution(random.Random(0), 1.0).splitlines()[1:] == [
        "Step 1: add 38 to 47. 47 + 38 = 75", "Step 2: multiply 75 by 2. 75 * 2 = 150", "Answer: 150"]
    assert c.answer() == 170 and c.carry_steps() == [0]


def test_solutions_are_100_to_400_tokens_with_the_builders_tokenizer():
    data = build_chain_data(ChainTask(2, 10, slip_prob=0.7), ChainTask(), 3000, 400, 100, seed=11)
    tok = train_bpe_tokenizer(tokenizer_corpus(data), 8192)  # as train_and_save does
    lengths = []
    for e, c in make_chain_problems(400, 12, ChainTask()):
        lengths.append(len(tok.encode(c.solution(), add_special_tokens=False)) + 1)  # + EOS
    assert 100 <= min(lengths) and max(lengths) <= 400, (min(lengths), max(lengths))
    assert 150 <= sum(lengths) / len(lengths) <= 300
    prompt = len(tok.encode(SMALL_PROMPT_TEMPLATE.format(problem=data.val[0].problem), add_special_tokens=False))
    assert prompt < 256  # the recipe's data.max_input_seq_length


def test_chain_data_is_disjoint_and_answers_are_correct():
    data = build_chain_data(ChainTask(2, 10, slip_prob=0.7), ChainTask(), 2000, 300, 500, seed=1)
    held = {e.problem for e in data.val}
    assert len(data.val) == 300 and not held & {e.problem for e, _ in data.sft}
    assert not held & {e.problem for e in data.rl_train} and len(data.rl_train) <= 500
    assert {steps_of(e) for e in data.val} == {f"steps={k:02d}" for k in range(6, 11)}
    assert {steps_of(e) for e, _ in data.sft} == {f"steps={k:02d}" for k in range(2, 11)}
    # the teacher slips, so some SFT responses end wrong; validation answers are the correct ones
    right = sum(score_response(r, e.answer) for e, r in data.sft)
    assert 0.2 * len(data.sft) < right < 0.9 * len(data.sft)


def test_check_task_lists_every_error():
    with pytest.raises(ValueError) as e:
        check_task(ChainTask(min_steps=5, max_steps=3, max_operand=1, ops=("+", "/"), slip_prob=1.5, max_value=1))
    for part in ("min_steps=5", "max_operand=1", "max_value=1", "ops='+/'", "slip_prob=1.5"):
        assert part in str(e.value), part


@pytest.fixture(scope="module")
def tiny_reasoning_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reasoning") / "reasoning-qwen3"
    assert load_tool("make_small_model").main(["--task", "chains", "--tiny", "--out", str(out)]) == 0
    return out


def test_tiny_build_writes_a_loadable_model_and_its_data(tiny_reasoning_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nemo_fp8.data.datasets import load_math_dataset

    d = tiny_reasoning_model
    model, tok = AutoModelForCausalLM.from_pretrained(d), AutoTokenizer.from_pretrained(d)
    assert type(model).__name__ == "Qwen3ForCausalLM" and len(tok) <= model.config.vocab_size == 512
    report = json.loads((d / "small_model_spec.json").read_text())
    assert report["task"]["name"] == "chains" and report["task"]["sft"]["slip_prob"] == 0.7
    assert report["task"]["eval"]["slip_prob"] == 0.0 and report["train"]["steps"] == 4
    ev = report["eval"]
    assert ev["num_samples"] == 8 and set(ev["by_group"]) <= {f"steps={k:02d}" for k in range(6, 11)}
    assert 0 < ev["response_tokens_mean"] <= 16  # --tiny evaluates 16 new tokens
    val = load_math_dataset(d / "data" / "val.jsonl", "problem_answer")
    rl = load_math_dataset(d / "data" / "rl_train.jsonl", "problem_answer")
    assert len(val) == 8 and 0 < len(rl) <= 32 and {e.data_source for e in val + rl} == {CHAIN_DATA_SOURCE}
    sol = make_chain_problems(1, 0, ChainTask())[0][1].solution()
    assert tok.decode(tok.encode(sol, add_special_tokens=False)) == sol


def test_builder_rejects_bad_chain_flags(tmp_path, capsys):
    tool = load_tool("make_small_model")
    assert tool.main(["--task", "chains", "--tiny", "--out", str(tmp_path / "x"), "--chain-steps", "9-4"]) == 2
    assert "min_steps=9" in capsys.readouterr().err and not (tmp_path / "x").exists()
    with pytest.raises(SystemExit):
        tool.main(["--task", "chains", "--out", str(tmp_path / "y"), "--chain-steps", "six"])


# --------------------------------------------------------------------------- recipes and report
ARMS = {"fp8+tis": "fp8-tis", "fp8": "fp8", "fp8kv+tis": "fp8kv-tis", "fp8kv": "fp8kv", "fp8-e2e+tis": "fp8-e2e-tis"}


def test_recipes_load_and_each_arm_is_the_base_plus_its_compare_precision_keys():
    from nemo_fp8.config import load_config

    cp = load_tool("compare_precision")
    base_path = RECIPES / "parity-reasoning" / "bf16.yaml"
    base = load_config(base_path)
    assert base.policy.generation.max_new_tokens == 512 and base.grpo.max_val_samples == 1024
    assert base.data.max_input_seq_length + base.policy.generation.max_new_tokens <= \
        base.policy.max_total_sequence_length <= base.policy.generation.vllm_cfg.max_model_len
    assert base.data.prompt_template == SMALL_PROMPT_TEMPLATE and base.data.use_chat_template
    assert Path(base.data.val_path).parent.parent == (REPO / base.policy.model_name).resolve()
    assert base.model_dump() == load_config(base_path, cp.variant_overrides("gpu", "bf16")).model_dump()
    for arm, stem in ARMS.items():
        recipe = load_config(RECIPES / "parity-reasoning" / f"{stem}.yaml")
        assert recipe.model_dump() == load_config(base_path, cp.variant_overrides("gpu", arm)).model_dump(), arm
    assert {p.name for p in (RECIPES / "parity-reasoning").glob("*.yaml")} == \
        {"bf16.yaml", *(f"{s}.yaml" for s in ARMS.values())}


def _run_rows(start: float, final: float, kl: float, length: float, trunc: float | None, steps: int = 20):
    rows = [{"step": 0, "val/accuracy": start, "val/num_samples": 1024.0}]
    for s in range(1, steps + 1):
        r = {"step": s, "train/reward_mean": 0.2 + final * s / steps, "mismatch/gen_kl_error": kl,
             "mismatch/token_mult_prob_error": 0.01, "train/response_length_mean": length + s}
        if trunc is not None:
            r["loss/is_frac_tokens_truncated"] = trunc if s % 2 else 0.0
        rows.append(r)
    rows.append({"step": steps, "val/accuracy": final, "val/num_samples": 1024.0})
    return rows


def test_seed_summaries_and_the_suites_checks(tmp_path):
    """The report's parity.json through tools/check_metrics.py, as the suite reads it."""
    cp = load_tool("compare_precision")
    finals = {"bf16": (0.50, 0.52, 0.48), "fp8+tis": (0.50, 0.51, 0.49), "fp8": (0.40, 0.45, 0.35),
              "fp8kv+tis": (0.5, 0.5, 0.5), "fp8-e2e+tis": (0.5, 0.5, 0.5), "fp8kv": (0.5, 0.5, 0.5)}
    names = []
    for arm, accs in finals.items():
        for seed, acc in enumerate(accs, start=1):
            name = arm if seed == 1 else f"{arm}-seed{seed}"
            names.append(name)
            (tmp_path / name).mkdir()
            rows = _run_rows(0.25, acc, 1e-4 if arm == "bf16" else 5e-4, 200.0, None if arm == "bf16" else 0.001)
            (tmp_path / name / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert cp.write_report(tmp_path, names) is not None
    rows = {r["label"]: r for r in json.loads((tmp_path / "parity.json").read_text())}
    bf = rows["bf16"]
    assert bf["seeds"] == 3 and bf["gain"] == pytest.approx(0.25) and bf["final_acc_sd"] == pytest.approx(0.02)
    se = (0.25 * 0.75 / 1024 + 0.25 / 1024 + 0.02 ** 2 / 3) ** 0.5
    assert bf["gain_se"] == pytest.approx(se) and bf["gain_z"] == pytest.approx(0.25 / se)
    assert rows["fp8"]["diff_final"] == pytest.approx(-0.1)
    assert rows["fp8"]["diff_final_se"] == pytest.approx((0.05 ** 2 / 3 + 0.02 ** 2 / 3) ** 0.5)
    assert rows["fp8+tis"]["is_steps_truncating"] == pytest.approx(0.5) and bf["is_frac_tokens_truncated"] is None
    assert bf["response_length_first"] == pytest.approx(201.5) and bf["response_length_last"] == pytest.approx(219.5)
    assert "| bf16 | 3 | 20 | 0.2500 | 0.5000 +- " in (tmp_path / "parity.md").read_text()
    # the suite's own checks (every quoted check after its check_metrics.py), on this report
    suite = (REPO / "tests" / "test_suites" / "llm" / "parity-reasoning.sh").read_text()
    checks = re.findall(r'"([^"$]+ (?:<=|>=) [^"]+)"', suite.split("tools/check_metrics.py", 1)[1])
    assert len(checks) == 15 and "last(bf16/gain) >= 0.15" in checks and "last(fp8kv/seeds) >= 3" in checks
    assert "last(fp8-e2e_tis/diff_final) >= -0.015" in checks and "last(fp8kv_tis/gen_kl_error) <= 1e-3" in checks
    ok = subprocess.run([sys.executable, str(REPO / "tools" / "check_metrics.py"), str(tmp_path / "parity.json"),
                         "--by", "variant", *checks], capture_output=True, text=True, cwd=REPO)
    assert ok.returncode == 0 and "15/15 checks passed" in ok.stdout, ok.stdout + ok.stderr
    bad = subprocess.run([sys.executable, str(REPO / "tools" / "check_metrics.py"), str(tmp_path / "parity.json"),
                          "--by", "variant", "abs(last(fp8/diff_final)) <= 0.015"], capture_output=True, text=True,
                         cwd=REPO)
    assert bad.returncode == 1 and "0.1 ; 0.015" in bad.stdout


def test_run_variants_puts_each_run_on_one_device(tmp_path):
    cp = load_tool("compare_precision")
    show = [sys.executable, "-c", "import os, time; time.sleep(0.3); print('dev', os.environ['CUDA_VISIBLE_DEVICES'])"]
    failed = cp.run_variants({f"v{i}": show for i in range(5)}, tmp_path, parallel=1, poll_s=0.05,
                             devices=["2", "5"])
    assert failed == []
    devs = [(tmp_path / f"v{i}" / "run.log").read_text().split("dev ")[1].strip() for i in range(5)]
    assert set(devs) == {"2", "5"} and devs[:2] == ["2", "5"]
    assert (tmp_path / "v0" / "run.log").read_text().startswith("[compare_precision] CUDA_VISIBLE_DEVICES=2\n")


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs 2 CPUs to split")
def test_run_variants_binds_each_run_side_by_side_to_its_own_cpus(tmp_path, capsys):
    """Two runs at a time on two CPUs: each run (and what it starts) runs on one CPU, never the other run's, with
    OMP_NUM_THREADS set to its share; a freed block goes to the next run; too few CPUs a run leaves them unbound."""
    cp = load_tool("compare_precision")
    two = sorted(os.sched_getaffinity(0))[:2]
    show = [sys.executable, "-c", "import os, subprocess, sys, time; time.sleep(0.4); "
            "child = subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'], "
            "capture_output=True, text=True).stdout.strip(); "
            "print('cpus', sorted(os.sched_getaffinity(0)), 'child', child, 'omp', os.environ.get('OMP_NUM_THREADS'))"]
    env_omp = os.environ.pop("OMP_NUM_THREADS", None)
    try:
        failed = cp.run_variants({f"v{i}": show for i in range(3)}, tmp_path, parallel=2, poll_s=0.05, cpus=two,
                                 min_cpus_per_run=1)
    finally:
        if env_omp is not None:
            os.environ["OMP_NUM_THREADS"] = env_omp
    assert failed == []
    seen = []
    for i in range(3):
        log = (tmp_path / f"v{i}" / "run.log").read_text()
        cpus = log.split("cpus ")[1].split(" child")[0]
        assert cpus in (f"[{two[0]}]", f"[{two[1]}]"), log
        assert f"child {cpus} omp 1" in log, log  # the run's own children inherit the binding
        assert f"[compare_precision] CPUs {cpus[1:-1]} (OMP_NUM_THREADS=1)" in log
        seen.append(cpus)
    assert seen[0] != seen[1]  # the first two ran at once, each on its own CPU
    # with devices, a device's runs get neighbouring blocks; here one block a device
    failed = cp.run_variants({"d0": show, "d1": show}, tmp_path, parallel=1, poll_s=0.05, devices=["0", "1"],
                             cpus=two, min_cpus_per_run=1)
    assert failed == []
    assert f"cpus [{two[0]}]" in (tmp_path / "d0" / "run.log").read_text()
    assert f"cpus [{two[1]}]" in (tmp_path / "d1" / "run.log").read_text()
    capsys.readouterr()
    failed = cp.run_variants({"u0": show, "u1": show}, tmp_path, parallel=2, poll_s=0.05, cpus=two)
    assert failed == [] and "fewer than 4 each, so the runs are not bound" in capsys.readouterr().out
    assert "[compare_precision] CPUs" not in (tmp_path / "u0" / "run.log").read_text()


def test_seed_summaries_compare_each_arm_with_bf16_at_the_last_validation_both_reached(tmp_path):
    """A comparison cut short (bf16 and fp8-e2e+tis validated at step 20, fp8+tis only at 10, fp8 cut before its
    first validation): bf16's and fp8-e2e+tis's rows read them to step 20; fp8+tis's row and its difference from
    bf16 read both to step 10 (the report names the bf16 run whose later steps that comparison left out); the run
    with nothing to compare is left out instead of pulling every run back to step 0."""
    cp = load_tool("compare_precision")
    long = _run_rows(0.25, 0.30, 1e-4, 200.0, None, steps=10)[:-1] + [
        {"step": 10, "val/accuracy": 0.30, "val/num_samples": 1024.0}]
    long += [{"step": s, "train/reward_mean": 0.9, "mismatch/gen_kl_error": 1e-4, "train/response_length_mean": 300.0}
             for s in range(11, 21)] + [{"step": 20, "val/accuracy": 0.60, "val/num_samples": 1024.0}]
    short = _run_rows(0.25, 0.29, 5e-4, 200.0, 0.001, steps=10)
    barely = _run_rows(0.25, 0.29, 5e-4, 200.0, 0.001, steps=10)[:4]  # cut at step 3: no validation after its start
    e2e = long[:-1] + [{"step": 20, "val/accuracy": 0.58, "val/num_samples": 1024.0}]  # ran as far as bf16
    for name, rows in (("bf16", long), ("fp8+tis", short), ("fp8", barely), ("fp8-e2e+tis", e2e)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert cp.write_report(tmp_path, ["bf16", "fp8+tis", "fp8", "fp8-e2e+tis"]) is not None
    rows = {r["label"]: r for r in json.loads((tmp_path / "parity.json").read_text())}
    assert set(rows) == {"bf16", "fp8+tis", "fp8-e2e+tis"}
    bf, tis, e2e_row = rows["bf16"], rows["fp8+tis"], rows["fp8-e2e+tis"]
    # fp8+tis's early end moves only its own comparison back: fp8-e2e+tis meets bf16 at step 20
    assert e2e_row["final_step"] == 20 and e2e_row["diff_final"] == pytest.approx(-0.02) and e2e_row["cut_runs"] == []
    assert bf["final_step"] == 20 and bf["final_acc"] == pytest.approx(0.60) and bf["cut_runs"] == []
    assert bf["gain"] == pytest.approx(0.35) and bf["response_length_last"] == pytest.approx(300.0)
    assert tis["final_step"] == 10 and tis["final_acc"] == pytest.approx(0.29) and tis["cut_runs"] == ["bf16"]
    # against bf16 at step 10 (0.30 and its reward to step 10), not at its step 20 (0.60, reward 0.9)
    assert tis["diff_final"] == pytest.approx(-0.01)
    bf16_late_10 = sum(0.2 + 0.30 * s / 10 for s in range(7, 11)) / 4  # run_stats' last 40% of steps 1-10
    assert tis["diff_late_reward"] == pytest.approx(tis["late_reward"] - bf16_late_10)
    md = (tmp_path / "parity.md").read_text()
    assert "up to `step`, the last validation all of them reached (later steps of bf16 left out)" in md
    assert "| bf16 | 1 | 20 | 0.2500 | 0.6000 +- " in md and "| fp8+tis | 1 | 10 | 0.2500 | 0.2900 +- " in md
