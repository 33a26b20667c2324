"""The GPU suites' recipes (examples/configs/recipes/llm/): each loads and validates through the trainer's loader,
each suite that runs GRPO reads recipes that exist and every recipe has a suite, the FP8 arm fragment is what the
FP8 config changes, and the mission suites compose recipe + arms + host settings into the configs they mean."""

from __future__ import annotations

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
    assert capsys.readouterr().out.splitlines()[-2:] == ["policy.generation.vllm_cfg.use_deep_gemm=true",
                                                          "policy.generation.vllm_cfg.kv_cache_dtype=fp8"]
    arm = tmp_path / "arm.yaml"
    for text, says in [("defaults: fp8.yaml\n", "defaults"), ("policy:\n  x: [1, 2]\n", "policy.x is a list"),
                       ("- a\n", "mapping")]:
        arm.write_text(text)
        assert recipe_main(["overrides", str(arm)]) == 2
        assert says in capsys.readouterr().err
