"""NeMo-RL's GRPO configs (fixtures shaped like its grpo_math_* files) load, map to our keys, and run here."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from nemo_fp8.config import ConfigError, config_to_yaml, load_config
from nemo_fp8.utils.nemo_rl_rules import prompt_template

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "nemo_rl"
NAMES = ["grpo_math_1B", "grpo_math_1B_megatron", "grpo_math_8B_megatron", "grpo_math_8B_megatron_fp8"]
CPU = ["policy.megatron_cfg.enabled=false", "policy.generation.backend=torch"]


@pytest.fixture
def local_data(tmp_path) -> list[str]:
    """A local problem/answer train and validation file, as NeMo-RL's ResponseDataset overrides name them."""
    for name in ("train", "val"):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            for i in range(40):
                f.write(json.dumps({"problem": f"What is {i} + 3?", "answer": str(i + 3)}) + "\n")
    return ["data.train.dataset_name=ResponseDataset", f"data.train.data_path={tmp_path / 'train.jsonl'}",
            "data.train.input_key=problem", "data.train.output_key=answer",
            f"data.validation.data_path={tmp_path / 'val.jsonl'}"]


def _load(name: str, *overrides: str, model="models/tiny-qwen3-arith"):
    return load_config(FIXTURES / f"{name}.yaml", [f"policy.model_name={model}", *overrides])


def _lines(err: ConfigError) -> list[str]:
    return [line[4:] for line in str(err).splitlines() if line.startswith("  - ")]


@pytest.mark.parametrize("name", NAMES)
def test_nemo_rl_configs_load_with_zero_errors_and_keep_their_meaning(name, local_data):
    cfg = _load(name, *local_data, *CPU)
    assert cfg.data.dataset == "problem_answer" and cfg.data.train_path.endswith("train.jsonl")
    assert cfg.data.use_chat_template  # math_hf_data_processor: the prompt file in the chat template
    assert cfg.data.prompt_template.endswith("inside \\boxed{}.\n\n{problem}\n")  # examples/prompts/cot.txt
    assert cfg.policy.sequence_packing.enabled
    total = cfg.policy.max_total_sequence_length
    assert cfg.policy.sequence_packing.train_mb_tokens == total * cfg.policy.train_micro_batch_size  # ${mul:...}
    assert cfg.data.max_input_seq_length == total  # NeMo-RL's upper bound, accepted
    assert cfg.loss_fn.truncated_importance_sampling_type == "tis"  # NeMo-RL's null
    assert cfg.loss_fn.truncated_importance_sampling_ratio is None and cfg.loss_fn.reference_policy_kl_penalty == 0.01
    assert cfg.grpo.use_leave_one_out_baseline and not cfg.grpo.val_greedy  # val_temperature = temperature
    assert cfg.checkpointing.keep_last_k == 3
    fp8 = name.endswith("fp8")
    assert cfg.policy.generation.vllm_cfg.precision == ("fp8" if fp8 else "bfloat16")
    assert cfg.policy.megatron_cfg.fp8_cfg.enabled == fp8 and cfg.loss_fn.use_importance_sampling_correction == fp8
    if name == "grpo_math_1B":  # the torch optimizer and its LinearLR warm-up (50 GRPO steps of one update each)
        assert cfg.policy.optimizer.lr == 5e-6 and cfg.policy.optimizer.lr_warmup_steps == 50
        assert cfg.policy.optimizer.lr_warmup_init == pytest.approx(5e-7)
    if "megatron" in name:  # megatron's scheduler keys live in our megatron optimizer section
        assert cfg.policy.megatron_cfg.optimizer.lr_warmup_steps == 13
        assert cfg.policy.megatron_cfg.fuse_wgrad_accumulation is True  # the file's value is inert while disabled


def test_resolved_config_shows_only_our_keys(local_data):
    cfg = _load("grpo_math_8B_megatron_fp8", *local_data, *CPU)
    text = config_to_yaml(cfg)
    for nemo_rl_key in ("in_flight_weight_updates", "dtensor_cfg", "scheduler", "dynamic_batching", "max_rollout_turns",
                        "dataset_name", "prompt_file", "keep_top_k", "mlflow", "val_temperature", "data_plane"):
        assert nemo_rl_key not in text, nemo_rl_key
    assert load_config(_write(local_data, text)).model_dump() == cfg.model_dump()  # config.yaml loads as itself


def _write(local_data, text: str) -> Path:
    path = Path(local_data[1].split("=", 1)[1]).parent / "config.yaml"
    path.write_text(text)
    return path


def test_unchanged_nemo_rl_configs_are_refused_only_for_what_cannot_run_here():
    """The 128 errors of NeMo-RL's 8B FP8 file are down to its data (nothing is downloaded here), named with what
    would be accepted; its pipeline parallelism (TP 1 x PP 2) is accepted."""
    with pytest.raises(ConfigError) as e:
        _load("grpo_math_8B_megatron_fp8")
    lines = _lines(e.value)
    assert len(lines) == 1, lines
    assert lines[0].startswith('data.train.dataset_name: "OpenMathInstruct-2": nemo-fp8 reads local files')
    assert "ResponseDataset" in lines[0]
    with pytest.raises(ConfigError) as e:
        _load("grpo_math_1B", "data.train.dataset_name=ResponseDataset")
    (line,) = _lines(e.value)
    assert "set data.train.input_key=problem" in line and "NeMo-RL's default is \"input\"" in line


@pytest.mark.parametrize("name", NAMES)
def test_a_feature_switched_on_is_refused_by_name(name, local_data):
    with pytest.raises(ConfigError) as e:
        _load(name, *local_data, *CPU, "grpo.async_grpo.in_flight_weight_updates=true", "grpo.max_rollout_turns=2",
              "policy.dynamic_batching.enabled=true", "loss_fn.use_cispo=true")
    assert sorted(_lines(e.value)) == [
        "grpo.async_grpo.in_flight_weight_updates: true: in-flight weight updates (new weights reach the engines "
        "between generation rounds) is not supported by nemo-fp8; set it to false",
        "grpo.max_rollout_turns: 2: multi-turn rollouts is not supported by nemo-fp8; set it to 1",
        "loss_fn.use_cispo: true: CISPO is not supported by nemo-fp8; set it to false",
        "policy.dynamic_batching.enabled: true: dynamic batching (policy.sequence_packing packs by token budget) is "
        "not supported by nemo-fp8; set it to false"]


@pytest.mark.parametrize("name", NAMES)
def test_typos_are_still_caught_with_the_nearest_key(name, local_data):
    with pytest.raises(ConfigError) as e:
        _load(name, *local_data, *CPU, "grpo.num_prompt_per_step=4", "grpo.async_grpo.enable=true",
              "policy.generation.vllm_cfg.use_tqmd=false", "policy.dtensor_cfg.tensor_paralel_size=2")
    lines = sorted(_lines(e.value))
    assert len(lines) == 4, lines
    assert lines[0].startswith("grpo.async_grpo.enable: unknown key (did you mean 'enabled'?)")
    assert lines[1].startswith("grpo.num_prompt_per_step: unknown key (did you mean 'num_prompts_per_step'?)")
    assert lines[2].startswith("policy.dtensor_cfg.tensor_paralel_size: unknown key (did you mean "
                               "'tensor_parallel_size'?)")
    assert lines[3].startswith("policy.generation.vllm_cfg.use_tqmd: unknown key (did you mean 'use_tqdm'?)")


def test_aliases_and_our_keys_disagreeing_are_refused(local_data):
    with pytest.raises(ConfigError) as e:
        _load("grpo_math_1B", *local_data, *CPU, "data.train_path=/elsewhere.jsonl")
    (line,) = _lines(e.value)
    assert line.startswith("data.train.data_path: ") and "but data.train_path is also set to \"/elsewhere.jsonl\"" in line


def test_megatron_settings_on_the_command_line_stay_checked_without_the_backend(local_data):
    """Inert in the files while the megatron backend is off (NeMo-RL reads megatron_cfg only when enabled); typed on
    the command line, the schema's refusal stands."""
    with pytest.raises(ConfigError, match="env_vars: the environment of the megatron backend"):
        _load("grpo_math_8B_megatron_fp8", *local_data, *CPU, "policy.megatron_cfg.env_vars.A=x")


def test_nemo_rl_prompt_files_become_templates():
    assert prompt_template("Q: {}\nAnswer inside \\boxed{{}}") == "Q: {problem}\nAnswer inside \\boxed{}"
    for bad in ("no field", "{name}", "{"):
        with pytest.raises(ValueError):
            prompt_template(bad)


def test_defaults_may_be_a_list(tmp_path):
    (tmp_path / "a.yaml").write_text("grpo:\n  max_num_steps: 3\n  seed: 1\n")
    (tmp_path / "b.yaml").write_text("grpo:\n  seed: 2\n")
    (tmp_path / "c.yaml").write_text("defaults: [a.yaml, b.yaml]\npolicy:\n  model_name: m\n  "
                                     "train_global_batch_size: 16\n")
    cfg = load_config(tmp_path / "c.yaml")
    assert (cfg.grpo.max_num_steps, cfg.grpo.seed) == (3, 2)


def test_docs_table_is_generated_from_the_rules():
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "nemo_rl_keys.py"), "--check"], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ------------------------------------------------------------------ the CPU job
# the first step small enough for two CPU cores; every other key as the NeMo-RL file has it
SMALL = ["grpo.max_num_steps=1", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4",
         "policy.train_global_batch_size=8", "policy.max_total_sequence_length=256", "checkpointing.enabled=true",
         "logger.tensorboard_enabled=false", "cluster.num_cpus=2"]


def _run(config: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "examples" / "run_grpo_math.py"), "--config", str(config), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_nemo_rl_config_runs_its_first_step_on_cpu_and_resumes(name, tiny_model_dir, local_data, tmp_path):
    out = [f"logger.log_dir={tmp_path / 'logs'}", f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}"]
    args = [f"policy.model_name={tiny_model_dir}", *local_data, *CPU, *SMALL, *out]
    proc = _run(FIXTURES / f"{name}.yaml", *args)
    assert "done: 1 steps" in proc.stdout
    saved = OmegaConf.to_container(OmegaConf.load(tmp_path / "logs" / "config.yaml"))
    assert "dtensor_cfg" not in saved["policy"] and "in_flight_weight_updates" not in saved["grpo"]["async_grpo"]
    assert saved["data"]["dataset"] == "problem_answer" and saved["data"]["use_chat_template"] is True
    if name != "grpo_math_1B":
        return  # one resume is enough for the CPU budget
    proc = _run(FIXTURES / f"{name}.yaml", *args[:-len(out) - len(SMALL)], *SMALL[1:], *out, "grpo.max_num_steps=2",
                "--resume")
    assert "resumed from" in proc.stderr and "done: 2 steps" in proc.stdout
    # the run's own config.yaml (our keys only) resumes it too
    proc = _run(tmp_path / "logs" / "config.yaml", "grpo.max_num_steps=3", "--resume")
    assert "done: 3 steps" in proc.stdout
