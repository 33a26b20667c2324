"""The GPU suites' recipes (examples/configs/recipes/llm/): each loads and validates through the trainer's loader,
each suite that runs GRPO reads recipes that exist and every recipe has a suite, the FP8 arm fragment is what the
FP8 config changes, and the mission suites compose recipe + arms + host settings into the configs they mean."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from recipe import arm_overrides, main as recipe_main

from nemo_fp8.config import config_diff, load_config

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "examples" / "configs" / "recipes" / "llm"
ARMS = RECIPES / "arms"
SUITES = sorted((REPO / "tests" / "test_suites" / "llm").glob("*.sh"))
CONFIGS = sorted(p for p in RECIPES.rglob("*.yaml") if ARMS not in p.parents)


def _suite_code(suite: Path) -> str:
    """The suite's text and the shared bodies it sources (common.sh, mission.sh)."""
    text = suite.read_text()
    libs = re.findall(r'source "\$\(dirname "\$0"\)/\.\./([\w-]+\.sh)"', text)
    return "\n".join([text, *((suite.parents[1] / lib).read_text() for lib in libs)])


def _recipe_globs(suite: Path) -> list[str]:
    """The recipe paths a suite names, ``$SUITE`` read as the suite's name and any other variable as ``*``;
    ``R=<folder>`` then ``$R/x.yaml`` is followed, and ``{a,b}.yaml`` in a comment names both files."""
    code = _suite_code(suite).replace("$SUITE", suite.stem).replace("${SUITE}", suite.stem)
    folders = dict(re.findall(r"\b(\w+)=(examples/configs/recipes/[\w./-]+)", code))
    for var, folder in folders.items():
        code = code.replace(f"${var}/", f"{folder}/").replace(f"${{{var}}}/", f"{folder}/")
    paths = re.findall(r"examples/configs/recipes/[\w./${}:,-]*\.yaml", code)
    globs = []
    for path in paths:
        alternatives = re.fullmatch(r"(.*)\{([\w,-]+)\}\.yaml", path)
        names = [f"{alternatives.group(1)}{a}.yaml" for a in alternatives.group(2).split(",")] if alternatives \
            else [path]
        globs += [re.sub(r"\$\{[^}]*\}|\$\w+", "*", n) for n in names]
    return globs


def _runs_grpo(suite: Path) -> bool:
    code = suite.read_text()
    return any(k in code for k in ("run_grpo ", "compare_precision.py", "mission_suite "))


def test_there_are_recipes_and_arms():
    assert len(CONFIGS) >= 15 and len(list(ARMS.glob("*.yaml"))) >= 4


@pytest.mark.parametrize("recipe", CONFIGS, ids=lambda p: str(p.relative_to(RECIPES)))
def test_recipe_loads_and_validates(recipe):
    cfg = load_config(recipe)
    assert cfg.grpo.max_num_steps >= 1
    # a recipe is named after its suite: recipes/llm/<suite>/<run or layout>.yaml
    assert (REPO / "tests" / "test_suites" / "llm" / f"{recipe.parent.name}.sh").is_file()


@pytest.mark.parametrize("suite", SUITES, ids=lambda p: p.stem)
def test_suite_reads_recipes_that_exist(suite):
    globs = _recipe_globs(suite)
    missing = [g for g in globs if not list(REPO.glob(g))]
    assert missing == [], f"{suite.name} names recipes that do not exist"
    if _runs_grpo(suite):  # GPU tests, benchmarks and the profiler run no GRPO config
        own = [g for g in globs if g.startswith(f"examples/configs/recipes/llm/{suite.stem}/")]
        assert own, f"{suite.name} runs GRPO but reads no recipe of examples/configs/recipes/llm/{suite.stem}/"
        assert "STEPS" not in suite.read_text(), "a run's step count is its recipe's grpo.max_num_steps"


def test_every_recipe_and_arm_is_read_by_a_suite():
    read = {p for s in SUITES for g in _recipe_globs(s) for p in REPO.glob(g)}
    assert sorted(str(p.relative_to(RECIPES)) for p in set(CONFIGS) - read) == []
    code = "\n".join(_suite_code(s) for s in SUITES)
    unused = [a.stem for a in ARMS.glob("*.yaml") if not re.search(rf"\b{re.escape(a.stem)}\b", code)]
    assert unused == []


def test_fp8_arm_is_what_the_fp8_config_changes():
    configs = REPO / "examples" / "configs"
    want = config_diff(load_config(configs / "grpo_math_8B_megatron.yaml").model_dump(mode="json"),
                       load_config(configs / "grpo_math_8B_megatron_fp8.yaml").model_dump(mode="json"))
    for layout in sorted(RECIPES.glob("mission-8b*/*.yaml")):
        bf16 = load_config(layout).model_dump(mode="json")
        fp8 = load_config(layout, arm_overrides([ARMS / "fp8.yaml"])).model_dump(mode="json")
        got = config_diff(bf16, fp8)
        assert got == {k: v for k, v in want.items() if k not in ("logger.log_dir", "checkpointing.checkpoint_dir")}


def _mission_commands(tmp_path: Path, suite: str, env: str) -> dict[str, list[str]]:
    """Each run's (recipe, overrides) as ``mission_suite`` would start it: run_grpo records its arguments instead
    of starting an 8B job (no GPU here), no random 8B checkpoint is written, CEILING=0."""
    script = (f"PYTHON={sys.executable}; source tests/test_suites/common.sh; source tests/test_suites/mission.sh; "
              f"SUITE={suite}; OUT={tmp_path}; mission_checkpoint() {{ :; }}; "
              'run_grpo() { printf "%s\\n" "$@" > "$OUT/$1.args"; }; report_runs() { :; }; check_runs() { :; }; '
              f"CEILING=0 {env} mission_suite auto")
    res = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    return {p.stem: p.read_text().splitlines()[1:] for p in tmp_path.glob("*.args")}


def test_mission_suite_composes_layout_arms_and_host(tmp_path):
    runs = _mission_commands(tmp_path, "mission-8b-4gpu",
                             "MISSION_LAYOUT=tp1 MISSION_GPUS=2 RUNS='bf16 fp8kv fp8tw' NEMO_FP8_SHARED_DATA=/data")
    assert sorted(runs) == ["bf16", "fp8kv", "fp8tw"]
    assert all(r[0] == "examples/configs/recipes/llm/mission-8b-4gpu/tp1.yaml" for r in runs.values())
    cfgs = {name: load_config(REPO / r[0], r[1:]) for name, r in runs.items()}
    assert {c.cluster.gpus_per_node for c in cfgs.values()} == {2}  # the host's GPUs: data parallel 2 at TP 1
    assert {c.policy.data_parallel_size for c in cfgs.values()} == {2}
    assert {c.data.train_path for c in cfgs.values()} == {"/data/gsm8k/train.jsonl"}
    assert cfgs["bf16"].policy.generation.vllm_cfg.precision == "bfloat16"
    kv = cfgs["fp8kv"].policy.generation.vllm_cfg
    assert (kv.precision, kv.kv_cache_dtype, cfgs["fp8kv"].policy.megatron_cfg.fp8_cfg.fp8_recipe) == \
        ("fp8", "fp8", "blockwise")
    assert cfgs["fp8tw"].policy.megatron_cfg.fp8_cfg.fp8_recipe == "tensorwise"
    assert cfgs["fp8tw"].policy.generation.vllm_cfg.kv_cache_dtype == "auto"


def test_mission_suite_refuses_an_unknown_layout_and_run_before_any_work(tmp_path):
    """Bad input exits 2 before the 16 GB random checkpoint or a run starts: the stand-ins mark whether they ran."""
    for env, says in [("MISSION_LAYOUT=tp3", "valid: pp2 pp4 tp1 tp2 auto"), ("RUNS='bf16 fp4'", "unknown run fp4")]:
        script = (f"PYTHON={sys.executable}; source tests/test_suites/common.sh; source tests/test_suites/mission.sh; "
                  f"SUITE=mission-8b-4gpu; OUT={tmp_path}; mission_checkpoint() {{ touch $OUT/checkpoint.started; }}; "
                  f'run_grpo() {{ touch "$OUT/$1.started"; }}; CEILING=0 {env} mission_suite auto')
        res = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True)
        assert res.returncode == 2 and says in res.stdout + res.stderr
        assert not list(tmp_path.glob("*.started")), res.stdout + res.stderr


def test_the_async_suite_refuses_an_unknown_run_before_the_checkpoint(tmp_path):
    """The suite writes its 16 GB random checkpoint before its runs: a bad name must stop it first. Its Python is a
    wrapper that records each command (and does not write a checkpoint)."""
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/bash\necho "$*" >> {tmp_path}/calls\n'
                       f'case "$*" in *write_random_checkpoint*) exit 0 ;; esac\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    env = {**os.environ, "PYTHON": str(wrapper), "OUT": str(tmp_path / "out"), "RUNS": "sync-longtail-bf16 fp4"}
    res = subprocess.run(["bash", "tests/test_suites/llm/async-8b-4gpu.sh"], cwd=REPO, capture_output=True,
                         text=True, env=env, timeout=120)
    assert res.returncode == 2 and "unknown run fp4" in res.stdout, res.stdout + res.stderr
    calls = (tmp_path / "calls").read_text() if (tmp_path / "calls").exists() else ""
    assert "write_random_checkpoint" not in calls and "run_grpo_math" not in calls, calls


def test_recipe_tool_reads_values_and_refuses_bad_input(tmp_path, capsys):
    recipe = RECIPES / "grpo-tiny-megatron-fp8" / "bf16.yaml"
    assert recipe_main(["get", str(recipe), "grpo.max_num_steps", "policy.generation.vllm_cfg.precision",
                        "policy.megatron_cfg.fp8_cfg.enabled"]) == 0
    assert capsys.readouterr().out.split() == ["5", "bfloat16", "false"]
    assert recipe_main(["get", str(recipe), "grpo.max_steps"]) == 2
    assert "no key grpo.max_steps" in capsys.readouterr().err
    assert recipe_main(["get", str(RECIPES / "no-such-suite" / "x.yaml"), "grpo.seed"]) == 2
    assert "config file not found" in capsys.readouterr().err
    assert recipe_main(["overrides", str(ARMS / "fp8.yaml"), str(ARMS / "fp8-kv-cache.yaml")]) == 0
    assert capsys.readouterr().out.splitlines()[-3:] == ["policy.generation.vllm_cfg.use_deep_gemm=true",
                                                          "policy.megatron_cfg.train_expandable_segments=false",
                                                          "policy.generation.vllm_cfg.kv_cache_dtype=fp8"]
    arm = tmp_path / "arm.yaml"
    for text, says in [("defaults: fp8.yaml\n", "defaults"), ("policy:\n  x: [1, 2]\n", "policy.x is a list"),
                       ("- a\n", "mapping")]:
        arm.write_text(text)
        assert recipe_main(["overrides", str(arm)]) == 2
        assert says in capsys.readouterr().err


def _one_gpu_suite(tmp_path: Path, env: dict[str, str], step_s: dict[str, float], host_used_mib: int = 40_000,
                   refit_share: float = 0.003) -> tuple[subprocess.CompletedProcess, dict[str, list[str]]]:
    """``mission-8b-1gpu.sh`` run whole on CPU. Its Python is a wrapper: ``examples/run_grpo_math.py`` records its
    arguments and writes two steps of metrics into the run's ``logger.log_dir`` (step seconds ``step_s[run]``, each
    phase a fixed share of it: the refit ``refit_share``, the engine's wake and sleep 0.05% each), the random
    checkpoint is not written, everything else (tools/recipe.py, the report, the checks) runs for real; ``free``
    reports ``host_used_mib`` used. Returns the suite's result and each run's (recipe, overrides)."""
    bin_dir, fake = tmp_path / "bin", tmp_path / "fake"
    bin_dir.mkdir(parents=True)
    fake.mkdir()
    for run, s in step_s.items():
        rows = [{"step": k, "train/reward_mean": 0.0, "timing/step": s, "timing/generation": 0.4 * s,
                 "timing/refit": refit_share * s, "timing/engine_wake": 0.0005 * s, "timing/engine_sleep": 0.0005 * s,
                 "timing/logprobs": 0.1 * s, "timing/training": 0.4 * s,
                 "perf/rollout_tokens_per_s": 1000.0 / s, "generation/kv_capacity_tokens": 181_552.0 * (
                     2 if run == "fp8kv" else 1), "memory/train_peak_allocated_gib": 109.1} for k in (1, 2)]
        (fake / f"{run}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (bin_dir / "free").write_text("#!/bin/bash\necho '              total        used'\n"
                                  f"echo 'Mem:         131072      {host_used_mib}'\n")
    wrapper = bin_dir / "python"
    wrapper.write_text(f"""#!/bin/bash
case "$*" in
  *write_random_checkpoint*) exit 0 ;;
  *run_grpo_math.py*)
    for a in "$@"; do case $a in logger.log_dir=*) dir=${{a#logger.log_dir=}} ;; esac; done
    run=$(basename "$dir"); printf "%s\\n" "$@" > {tmp_path}/$run.args
    # the host memory sampler's first row, as a real run of minutes would have it
    for _ in $(seq 100); do [ -s "$OUT/host_mem_$run.jsonl" ] && break; sleep 0.1; done
    cp {fake}/$run.jsonl "$dir/metrics.jsonl"; exit 0 ;;
esac
exec {sys.executable} "$@"
""")
    for f in (wrapper, bin_dir / "free"):
        f.chmod(0o755)
    full = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(wrapper),
            "OUT": str(tmp_path / "out"), **env}
    res = subprocess.run(["bash", "tests/test_suites/llm/mission-8b-1gpu.sh"], cwd=REPO, capture_output=True,
                         text=True, env=full, timeout=300)
    runs = {p.stem: p.read_text().splitlines() for p in tmp_path.glob("*.args")}
    return res, {name: [a for a in args if a.endswith(".yaml") and "/recipes/" in a] + [
        a for a in args if "=" in a and not a.startswith(("logger.log_dir=", "checkpointing."))]
        for name, args in runs.items()}


def test_the_one_gpu_suite_composes_its_runs_and_checks_the_issue_targets(tmp_path):
    """The standard workload: bf16, fp8 and fp8kv from the one recipe plus the arms, on the one-GPU configs' layout;
    the report has each run's KV capacity and peak host memory; the checks pass when FP8's step is 0.75x BF16's,
    every phase is as fast and the refit + wake + sleep under 0.5 s, and fail when the host used more than 100 GiB
    or a refit + wake + sleep took longer."""
    res, runs = _one_gpu_suite(tmp_path / "ok", {"NEMO_FP8_SHARED_DATA": "/data"},
                               {"bf16": 100.0, "fp8": 75.0, "fp8kv": 80.0})
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(runs) == ["bf16", "fp8", "fp8kv"]
    recipe = "examples/configs/recipes/llm/mission-8b-1gpu/standard.yaml"
    cfgs = {name: load_config(REPO / r[0], r[1:]) for name, r in runs.items()}
    assert all(r[0] == recipe for r in runs.values())
    layout = load_config(REPO / "examples" / "configs" / "grpo_math_8B_megatron_1gpu.yaml")
    for c in cfgs.values():
        assert c.cluster.gpus_per_node == 1 and c.policy.megatron_cfg.tensor_model_parallel_size == 1
        m = c.policy.megatron_cfg  # the layout's, but for the FP8 keys (the FP8 KV arm's allocator setting too)
        own = {"fp8_cfg": m.fp8_cfg, "train_expandable_segments": m.train_expandable_segments}
        assert m == layout.policy.megatron_cfg.model_copy(update=own)
        assert m.train_expandable_segments == (c.policy.generation.vllm_cfg.kv_cache_dtype != "fp8")
        assert c.data.train_path == "/data/gsm8k/train.jsonl"
    assert cfgs["bf16"].policy.generation.vllm_cfg.precision == "bfloat16"
    assert (cfgs["fp8"].policy.generation.vllm_cfg.precision, cfgs["fp8"].policy.megatron_cfg.fp8_cfg.enabled) == \
        ("fp8", True)
    assert cfgs["fp8kv"].policy.generation.vllm_cfg.kv_cache_dtype == "fp8"
    report = (tmp_path / "ok" / "out" / "report.md").read_text()
    assert "| fp8kv | 363,104 | 2.00 | 109.1 | - | - | - | 39.1 |" in report  # KV x2, free's 40,000 MiB used
    checks = (tmp_path / "ok" / "out" / "checks.md").read_text()
    assert checks.count("| PASS |") == 11 and "FAIL" not in checks  # bf16's steps, 3 hosts, 2 refits, step, 4 phases
    assert "`max(fp8kv_host:host/used_gib) <= 100`" in checks
    assert "| `mean(bf16:timing/refit[1:]) + mean(bf16:timing/engine_wake[1:]) + mean(bf16:timing/engine_sleep[1:]) " \
           "<= 0.5` | 0.4 ; 0.5 | PASS |" in checks
    res, _ = _one_gpu_suite(tmp_path / "host", {"RUNS": "bf16 fp8"}, {"bf16": 100.0, "fp8": 75.0},
                            host_used_mib=120 * 1024, refit_share=0.01)
    assert res.returncode == 1 and "| `max(fp8_host:host/used_gib) <= 100` | 120 ; 100 | FAIL |" in res.stdout
    assert "mean(fp8:timing/engine_sleep[1:]) <= 0.5` | 0.825 ; 0.5 | FAIL |" in res.stdout  # 0.75 + 0.0375 x 2


def test_the_one_gpu_suites_long_responses_check_fp8_kv_against_bf16(tmp_path):
    """The long-responses workload: responses of 4,096 tokens whose micro-batches hold three whole sequences, and
    the FP8 + FP8 KV step <= 0.70x BF16's (0.75x fails it); bad input stops the suite before any run."""
    res, runs = _one_gpu_suite(tmp_path / "slow", {"WORKLOAD": "long-responses", "RUNS": "bf16 fp8kv"},
                               {"bf16": 200.0, "fp8kv": 150.0})
    assert res.returncode == 1, res.stdout + res.stderr
    assert "| `ratio(mean(fp8kv:timing/step[1:]), mean(bf16:timing/step[1:])) <= 0.70` | 0.75 ; 0.7 | FAIL |" \
        in res.stdout
    cfg = load_config(REPO / runs["fp8kv"][0], runs["fp8kv"][1:])
    assert cfg.policy.generation.response_limits is None and cfg.policy.generation.max_new_tokens == 4096
    assert cfg.policy.sequence_packing.train_mb_tokens >= 3 * cfg.policy.max_total_sequence_length >= 3 * (4096 + 512)
    res, _ = _one_gpu_suite(tmp_path / "fast", {"WORKLOAD": "long-responses", "RUNS": "bf16 fp8kv"},
                            {"bf16": 200.0, "fp8kv": 130.0})
    assert res.returncode == 0, res.stdout + res.stderr
    for env, says in [({"WORKLOAD": "short"}, "valid: standard long-responses"),
                      ({"RUNS": "bf16 fp4"}, "unknown run fp4")]:
        res, runs = _one_gpu_suite(tmp_path / env.get("WORKLOAD", "runs"), env, {})
        assert res.returncode == 2 and says in res.stdout + res.stderr and runs == {}
        assert not (tmp_path / env.get("WORKLOAD", "runs") / "out").exists()  # stopped before suite_init


def _refit_suite(tmp_path: Path, env: dict[str, str], total_s: dict[str, float],
                 growth_gib: float = 0.0) -> tuple[subprocess.CompletedProcess, dict[str, list[str]]]:
    """``refit-8b-1gpu.sh`` run whole on CPU: its Python is a wrapper for which ``tools/bench_refit.py`` records its
    arguments and writes one row per refit into ``--out`` (the first 3 s of warm-up, then ``total_s[run]`` each, the
    device's memory growing by ``growth_gib`` over the run); the checks run for real. Returns the suite's result and
    each run's arguments."""
    bin_dir, fake = tmp_path / "bin", tmp_path / "fake"
    bin_dir.mkdir(parents=True)
    fake.mkdir()
    for run, s in total_s.items():
        rows = [{"step": k, "timing/refit_total": 3.0 if k == 1 else s, "refit/gbytes": 9.4,
                 "memory/device_used_gib": 40.0 + growth_gib * (k - 1) / 3} for k in (1, 2, 3, 4)]
        (fake / f"{run}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    wrapper = bin_dir / "python"
    wrapper.write_text(f"""#!/bin/bash
case "$*" in
  *write_random_checkpoint*) exit 0 ;;
  *bench_refit.py*)
    prev=""; for a in "$@"; do [ "$prev" = --out ] && dir=$a; prev=$a; done
    run=$(basename "$dir"); printf "%s\\n" "$@" > {tmp_path}/$run.args
    [ -f {fake}/$run.jsonl ] || exit 1
    cp {fake}/$run.jsonl "$dir/metrics.jsonl"; exit 0 ;;
esac
exec {sys.executable} "$@"
""")
    wrapper.chmod(0o755)
    full = {**os.environ, "PYTHON": str(wrapper), "OUT": str(tmp_path / "out"), "REFITS": "4", **env}
    res = subprocess.run(["bash", "tests/test_suites/llm/refit-8b-1gpu.sh"], cwd=REPO, capture_output=True,
                         text=True, env=full, timeout=300)
    return res, {p.stem: p.read_text().splitlines() for p in tmp_path.glob("*.args")}


def test_the_refit_suite_benches_both_configs_and_checks_issue_70s_targets(tmp_path):
    """refit-8b-1gpu.sh: bench_refit on the one-GPU BF16 and FP8 configs with the random 8B checkpoint and the shared
    data, in vLLM's checkpoint format and in the engine's kernel format; a refit + wake + sleep of 0.4 s after the
    warm-up passes, 0.6 s fails, so does memory that grows by 2 GiB or a run that wrote nothing; bad input stops it
    before any run."""
    res, runs = _refit_suite(tmp_path / "ok", {"NEMO_FP8_SHARED_DATA": "/data"}, {"bf16": 0.4, "fp8": 0.45})
    assert res.returncode == 0, res.stdout + res.stderr
    configs = {name: args[args.index("--config") + 1] for name, args in runs.items()}
    assert configs == {"bf16": "examples/configs/grpo_math_8B_megatron_1gpu.yaml",
                       "fp8": "examples/configs/grpo_math_8B_megatron_fp8_1gpu.yaml"}
    for args in runs.values():
        assert args[args.index("--refits") + 1] == "4" and "policy.model_name=models/qwen3-8b-random" in args
        assert "data.train_path=/data/gsm8k/train.jsonl" in args and "data.dataset=gsm8k" in args
    checks = (tmp_path / "ok" / "out" / "checks.md").read_text()
    assert checks.count("| PASS |") == 4 and "`mean(fp8:timing/refit_total[1:]) <= 0.5` | 0.45 ; 0.5 | PASS" in checks
    # FP8 on CUTLASS in every run; the kernel-format runs add vllm_cfg.refit_format=kernel
    assert "policy.generation.vllm_cfg.use_deep_gemm=false" in runs["fp8"]
    assert not any("refit_format" in a for a in runs["fp8"] + runs["bf16"])
    res, runs = _refit_suite(tmp_path / "kernel", {"RUNS": "bf16-kernel fp8-kernel"},
                             {"bf16-kernel": 0.3, "fp8-kernel": 0.35})
    assert res.returncode == 0, res.stdout + res.stderr
    assert runs["fp8-kernel"][runs["fp8-kernel"].index("--config") + 1].endswith("grpo_math_8B_megatron_fp8_1gpu.yaml")
    for name in ("bf16-kernel", "fp8-kernel"):
        assert "policy.generation.vllm_cfg.refit_format=kernel" in runs[name]
    assert ("policy.generation.vllm_cfg.use_deep_gemm=false" in runs["fp8-kernel"],
            "policy.generation.vllm_cfg.use_deep_gemm=false" in runs["bf16-kernel"]) == (True, False)
    assert "`mean(fp8-kernel:timing/refit_total[1:]) <= 0.5` | 0.35 ; 0.5 | PASS" in res.stdout
    assert not any("pack_in_place" in a for args in runs.values() for a in args)
    # the kernel format with its buckets filled in place
    res, runs = _refit_suite(tmp_path / "inplace", {"RUNS": "bf16-inplace fp8-inplace"},
                             {"bf16-inplace": 0.2, "fp8-inplace": 0.25})
    assert res.returncode == 0, res.stdout + res.stderr
    for name in ("bf16-inplace", "fp8-inplace"):
        assert {"policy.generation.vllm_cfg.refit_format=kernel", "policy.weight_sync.pack_in_place=true"} <= \
            set(runs[name])
    assert ("policy.generation.vllm_cfg.use_deep_gemm=false" in runs["fp8-inplace"],
            "policy.generation.vllm_cfg.use_deep_gemm=false" in runs["bf16-inplace"]) == (True, False)
    res, _ = _refit_suite(tmp_path / "slow", {"RUNS": "fp8"}, {"fp8": 0.6}, growth_gib=2.0)
    assert res.returncode == 1
    assert "`mean(fp8:timing/refit_total[1:]) <= 0.5` | 0.6 ; 0.5 | FAIL" in res.stdout
    assert "| `last(fp8:memory/device_used_gib) - first(fp8:memory/device_used_gib) <= 1.0` | 2 ; 1 | FAIL |" \
        in res.stdout
    res, _ = _refit_suite(tmp_path / "lost", {}, {"bf16": 0.4})  # the FP8 run crashed before its rows
    assert res.returncode == 1 and "FAIL" in res.stdout
    for env, says in [({"RUNS": "bf16 fp4"}, "unknown run fp4"), ({"REFITS": "1"}, "need 2 or more")]:
        res, runs = _refit_suite(tmp_path / says.split()[0], env, {})
        assert res.returncode == 2 and says in res.stdout and runs == {}


def test_the_long_responses_rollout_outgrows_bf16s_kv_cache_and_fits_fp8_kvs():
    """The long-responses recipe's arithmetic, from the project's own functions: every request's limit is the same
    4,096 tokens (``step_sampling``, ``request_max_new_tokens``: no drawn limits), so all sequences are alive at the
    last decode step and the peak demand is the total; at Qwen3-8B's KV bytes per token, the engine's 0.3 share on
    one H200 (by the bench's capacity at 0.6, less 0.3 of the GPU) holds less than half of it in BF16, about half in
    FP8 (BF16 KV) and all of it in FP8 + FP8 KV, for prompts of 100-200 tokens; the calibration keeps every prompt group."""
    from lab.random_checkpoint import QWEN3_SHAPES

    from nemo_fp8.algorithms.grpo import step_sampling
    from nemo_fp8.generation.interfaces import request_max_new_tokens

    cfg = load_config(RECIPES / "mission-8b-1gpu" / "long-responses.yaml")
    rows = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    assert cfg.policy.generation.response_limits is None
    for step in range(1, cfg.grpo.max_num_steps + 1):
        assert request_max_new_tokens(step_sampling(cfg, step, 0), rows) == [4096] * rows
    shape = QWEN3_SHAPES["qwen3-8b"]
    bf16_bytes = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * 2
    assert bf16_bytes == 147_456
    share_tokens = (0.6 - cfg.policy.generation.vllm_cfg.gpu_memory_utilization) * 139.8 * 2**30 / bf16_bytes
    bf16, fp8, fp8kv = 486_832 - share_tokens, 528_336 - share_tokens, 1_056_688 - 2 * share_tokens
    assert (round(bf16, -3), round(fp8, -3), round(fp8kv, -3)) == (181_000, 223_000, 446_000)
    need = [rows * (4096 + prompt) for prompt in (100, 200)]
    assert (min(need), max(need)) == (402_816, 412_416)
    assert 2 * bf16 < min(need) and fp8 < min(need) and max(need) < fp8kv
    samples = cfg.policy.generation.vllm_cfg.kv_calibration_max_samples
    assert cfg.grpo.num_prompts_per_step <= samples < rows


@pytest.mark.parametrize("config", ["grpo_math_8B_megatron_1gpu.yaml", "grpo_math_8B_megatron_fp8_1gpu.yaml"])
def test_the_refit_suites_data_overrides_load_gsm8k(gsm8k_dir, config):
    """The data overrides refit-8b-1gpu.sh gives bench_refit make the one-GPU configs read the shared GSM8K files
    (their own data are the user's DAPO files, whose schema GSM8K's records do not have: the preflight refused
    the suite's first GPU run)."""
    from nemo_fp8.config import load_config
    from nemo_fp8.data.datasets import load_math_file

    text = (REPO / "tests/test_suites/llm/refit-8b-1gpu.sh").read_text()
    assert 'data=(data.dataset=gsm8k data.train_path="$shared/gsm8k/train.jsonl"' in text
    shared = gsm8k_dir.parent
    cfg = load_config(REPO / "examples/configs" / config,
                      ["data.dataset=gsm8k", f"data.train_path={shared}/gsm8k/train.jsonl",
                       f"data.val_path={shared}/gsm8k/test.jsonl"])
    for path in (cfg.data.train_path, cfg.data.val_path):
        assert len(load_math_file(path, schema=cfg.data.dataset, limit=2).examples) == 2
