"""Config loading and validation: every shipped config validates; bad input names the key."""

from pathlib import Path

import pytest

from nemo_fp8.config import ConfigError, load_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "examples" / "configs").glob("*.yaml"))
TINY = next(p for p in CONFIGS if p.name == "grpo_math_tiny_fp8.yaml")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    cfg = load_config(path)
    assert cfg.policy.generation.vllm_cfg.weight_block_size == [128, 128]


def test_fp8_8b_config_is_the_seed_recipe():
    cfg = load_config(TINY.parent / "grpo_math_8B_megatron_fp8.yaml")
    assert cfg.policy.generation.vllm_cfg.precision == "fp8"
    assert cfg.policy.generation.vllm_cfg.use_deep_gemm
    assert cfg.policy.megatron_cfg.fp8_cfg.model_dump() == {"enabled": True, "fp8": "e4m3", "fp8_recipe": "blockwise",
                                                            "fp8_param": False}
    assert cfg.loss_fn.use_importance_sampling_correction
    assert cfg.loss_fn.truncated_importance_sampling_ratio == 2.0
    base = load_config(TINY.parent / "grpo_math_8B_megatron.yaml")
    assert base.policy.generation.vllm_cfg.precision == "bfloat16" and not base.policy.megatron_cfg.fp8_cfg.enabled
    assert base.grpo == cfg.grpo  # only the precision knobs differ


def _error(*overrides):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, list(overrides))
    return str(e.value)


def test_overrides_apply():
    cfg = load_config(TINY, ["grpo.max_num_steps=3", "policy.generation.vllm_cfg.num_last_layers_in_bf16=1"])
    assert cfg.grpo.max_num_steps == 3 and cfg.policy.generation.vllm_cfg.num_last_layers_in_bf16 == 1


def test_unknown_key_lists_valid_keys():
    msg = _error("grpo.num_prompt_per_step=4")
    assert "grpo.num_prompt_per_step: unknown key" in msg and "num_prompts_per_step" in msg


def test_wrong_type_and_literal_name_valid_values():
    msg = _error("policy.generation.vllm_cfg.precision=fp16")
    assert "policy.generation.vllm_cfg.precision" in msg and "'bfloat16' or 'fp8'" in msg and "fp16" in msg
    assert "grpo.max_num_steps" in _error("grpo.max_num_steps=many")
    msg = _error("policy.megatron_cfg.fp8_cfg.fp8_recipe=delayed")
    assert "fp8_recipe" in msg and "'tensorwise' or 'blockwise'" in msg


def test_fp8_kv_cache_needs_fp8_precision():
    msg = _error("policy.generation.vllm_cfg.precision=bfloat16", "policy.generation.vllm_cfg.kv_cache_dtype=fp8")
    assert "policy.generation.vllm_cfg.kv_cache_dtype: 'fp8' needs policy.generation.vllm_cfg.precision='fp8'" in msg


def test_fp8_kv_calibration_cap_leaves_no_rank_without_rows():
    msg = _error("policy.generation.vllm_cfg.precision=fp8", "policy.generation.vllm_cfg.kv_cache_dtype=fp8",
                 "loss_fn.use_importance_sampling_correction=true", "policy.data_parallel_size=2",
                 "policy.generation.vllm_cfg.kv_calibration_max_samples=1")
    assert "policy.generation.vllm_cfg.kv_calibration_max_samples: 1 leaves some of policy.data_parallel_size=2" in msg
    assert "valid: >= 2, or null for the whole batch" in msg
    assert "kv_calibration_max_samples" in _error("policy.generation.vllm_cfg.kv_calibration_max_samples=0")


def test_tensor_parallel_vllm_engine_needs_enough_policy_gpus_when_colocated():
    """A colocated engine of n GPUs runs on those of policy ranks 0..n-1: refused at config time, before any GPU
    work, when the policy has fewer ranks; an engine on GPUs of its own, or enough ranks, is fine."""
    tp2 = ["policy.generation.backend=vllm", "policy.generation.vllm_cfg.tensor_parallel_size=2"]
    msg = _error(*tp2)
    assert "policy.generation.vllm_cfg.tensor_parallel_size: 2 with policy.generation.colocated.enabled=true" in msg
    assert "the policy has 1 rank(s)" in msg and "valid: 1, or a policy world size >= 2" in msg
    assert "policy.generation.colocated.enabled=false" in msg
    cfg = load_config(TINY, [*tp2, "policy.data_parallel_size=2"])
    assert cfg.policy.generation.engine_gpus == 2 and cfg.policy.world_size == 2
    assert load_config(TINY, [*tp2, "policy.generation.colocated.enabled=false"]).policy.generation.engine_gpus == 2
    msg = _error("policy.generation.backend=vllm", "policy.generation.vllm_cfg.tensor_parallel_size=8",
                 "policy.data_parallel_size=4", "policy.train_global_batch_size=32", "policy.train_micro_batch_size=8")
    assert "the policy has 4 rank(s)" in msg and "valid: 1, 2, 4, or a policy world size >= 8" in msg
    msg = _error("policy.generation.backend=vllm", "policy.generation.vllm_cfg.tensor_parallel_size=3",
                 "policy.generation.colocated.enabled=false")
    assert "policy.generation.vllm_cfg.tensor_parallel_size: 3 is not supported (valid: 1, 2, 4, 8)" in msg
    # the torch engine has no tensor parallelism to configure: the key is left alone there
    torch_cfg = load_config(TINY, ["policy.generation.vllm_cfg.tensor_parallel_size=2"])
    assert torch_cfg.policy.generation.backend == "torch" and torch_cfg.policy.generation.engine_gpus == 1


def test_fp8_rollout_without_is_correction_needs_explicit_allow():
    msg = _error("loss_fn.use_importance_sampling_correction=false")
    assert "loss_fn.use_importance_sampling_correction" in msg and "allow_fp8_rollout_without_is_correction" in msg
    cfg = load_config(TINY, ["loss_fn.use_importance_sampling_correction=false",
                             "loss_fn.allow_fp8_rollout_without_is_correction=true"])
    assert not cfg.loss_fn.use_importance_sampling_correction


def test_block_size_other_than_128():
    assert "weight_block_size: [64, 64] is not supported (valid: [128, 128]" in _error(
        "policy.generation.vllm_cfg.weight_block_size=[64,64]")


def test_icepop_needs_a_window():
    msg = _error("loss_fn.truncated_importance_sampling_type=icepop")
    assert "truncated_importance_sampling_ratio_min" in msg
    cfg = load_config(TINY, ["loss_fn.truncated_importance_sampling_type=icepop",
                             "loss_fn.truncated_importance_sampling_ratio_min=0.5"])
    assert cfg.loss_fn.truncated_importance_sampling_type == "icepop"


def test_batch_divisibility_and_missing_paths():
    assert "policy.train_global_batch_size: 100 must divide" in _error("policy.train_global_batch_size=100")
    assert "data.train_path: required" in _error("data.dataset=gsm8k")


def test_missing_file_and_bad_override():
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(TINY.parent / "nope.yaml")
    with pytest.raises(ConfigError, match="not of the form key.sub=value"):
        load_config(TINY, ["grpo.max_num_steps"])


def test_override_values_yaml_cannot_parse_are_text_or_clear_errors():
    """``key=value`` values YAML reads as a mapping (``Answer: x``) or cannot parse: the text typed for a key that
    holds a string, else one error naming the key, what it takes and a valid value (no bare ScannerError /
    ParserError; no advice to quote a number into text)."""
    assert load_config(TINY, ["data.response_prefix=Answer: x"]).data.response_prefix == "Answer: x"
    assert load_config(TINY, ["data.response_prefix=Answer: "]).data.response_prefix == "Answer: "
    assert load_config(TINY, ["data.response_prefix=[a,"]).data.response_prefix == "[a,"
    assert load_config(TINY, ['data.response_prefix="Answer: "']).data.response_prefix == "Answer: "
    for bad, why in (("grpo.max_num_steps=[1,", "not valid YAML: did not find expected node content"),
                     ("grpo.max_num_steps=a: b", "a mapping")):
        msg = _error(bad)
        assert msg == (f"override {bad!r}: grpo.max_num_steps expects an integer (such as 1000), got "
                       f"{bad.split('=', 1)[1]!r} ({why}); e.g. grpo.max_num_steps=1000"), msg
        assert "quote it" not in msg
    msg = _error("policy.generation.vllm_cfg.weight_block_size=[1,")
    assert "weight_block_size expects a list (such as [128,128]), got '[1,'" in msg
    assert "e.g. policy.generation.vllm_cfg.weight_block_size=[128,128]" in msg
    assert "data.nope: unknown key" in _error("data.nope=x: y")  # a mapping for a key we lack: the schema says so
    # a mapping where the key holds one still parses as YAML; Hydra's ++key= means key=
    cfg = load_config(TINY, ["++policy.megatron_cfg.env_vars={A: b}", "policy.megatron_cfg.enabled=true",
                             "policy.shared_prefix_forward=false"])
    assert cfg.policy.megatron_cfg.env_vars == {"A": "b"}


def test_float64_is_the_torch_reference_and_the_engines_keep_their_dtypes():
    cfg = load_config(TINY)  # the CPU default: float64 trainer and reference engine
    assert cfg.policy.precision == "float64" and cfg.policy.generation.reference_dtype == "float64"
    import torch

    from nemo_fp8.policy.megatron.settings import train_dtype

    on_gpu = ["policy.megatron_cfg.enabled=true", "policy.shared_prefix_forward=false",
              "policy.generation.backend=vllm"]
    for bf16 in ("true", "false"):  # megatron trains the CPU default's float64 as it trained float32
        gpu = load_config(TINY, [*on_gpu, f"policy.megatron_cfg.optimizer.bf16={bf16}"])
        was = load_config(TINY, [*on_gpu, f"policy.megatron_cfg.optimizer.bf16={bf16}", "policy.precision=float32"])
        assert train_dtype(gpu.policy) == train_dtype(was.policy) == (torch.bfloat16 if bf16 == "true" else
                                                                      torch.float32)


@pytest.mark.parametrize("value", ["2.0.0", "1e", "1e+", "2,0", "1.5x", "--1"])
def test_a_malformed_float_names_the_type_the_value_and_a_valid_one(value):
    """YAML reads these as text; the key takes a float: the line says so, shows the value and a valid override
    (quoting the value, as the message used to say for some of them, would not make it a number)."""
    key = "loss_fn.truncated_importance_sampling_ratio"
    msg = _error(f"{key}={value}")
    assert f"  - {key}: expects a float (a number such as 2.0) or null, got {value!r}; e.g. {key}=2.0" in msg, msg
    assert "quote" not in msg
    assert load_config(TINY, [f"{key}=2.0"]).loss_fn.truncated_importance_sampling_ratio == 2.0
    assert "  - grpo.max_num_steps: expects an integer (such as 1000), got 3.5; e.g. grpo.max_num_steps=1000" in \
        _error("grpo.max_num_steps=3.5")


def test_a_directory_or_a_fifo_as_config_is_named_as_such(tmp_path):
    import os

    msg = _error_of(TINY.parent)
    listing = "(it holds grpo_math_8B_megatron.yaml, "
    assert msg.startswith(f"{TINY.parent} is a directory, not a config file {listing}"), msg
    assert msg.endswith("; valid: a YAML file such as examples/configs/grpo_math_tiny_fp8.yaml"), msg
    assert "not found" not in msg
    os.mkfifo(tmp_path / "cfg.yaml")  # never opened: reading it would block
    assert _error_of(tmp_path / "cfg.yaml") == (f"{tmp_path / 'cfg.yaml'} is a FIFO (named pipe), not a config file; "
                                                "valid: a YAML file such as examples/configs/grpo_math_tiny_fp8.yaml")


def _error_of(path):
    with pytest.raises(ConfigError) as e:
        load_config(path)
    return str(e.value)


def test_a_yaml_past_omegaconfs_node_limit_names_the_limit_and_the_variable(tmp_path, monkeypatch):
    """A valid YAML with a 9,995-item list was a "YAML syntax error": it is OmegaConf's limit on a file's nodes
    (10,000), which OMEGACONF_MAX_YAML_EXPANDED_NODES raises."""
    big = tmp_path / "big.yaml"
    big.write_text(f"defaults: {TINY}\npolicy:\n  generation:\n    vllm_cfg:\n      fp8_ignore_patterns:\n"
                   + "".join(f"        - layer_{i}\n" for i in range(9995)))
    monkeypatch.delenv("OMEGACONF_MAX_YAML_EXPANDED_NODES", raising=False)
    assert _error_of(big) == (
        f"{big}: not a syntax error: the file has more YAML nodes than OmegaConf's limit of 10000 (every mapping key, "
        "value and list item counts, an alias at each use). For a file you trust, raise the limit in the "
        "environment: OMEGACONF_MAX_YAML_EXPANDED_NODES=100000 (or OMEGACONF_MAX_YAML_EXPANDED_NODES=none for no "
        "limit)")
    monkeypatch.setenv("OMEGACONF_MAX_YAML_EXPANDED_NODES", "100000")  # what the message says works
    assert len(load_config(big).policy.generation.vllm_cfg.fp8_ignore_patterns) == 9995
    bomb = tmp_path / "bomb.yaml"  # aliases: only "none" lifts the ratio limit
    bomb.write_text("a: &a [" + ",".join(["x"] * 20) + "]\nb: &b [" + ",".join(["*a"] * 20) + "]\n"
                    "c: [" + ",".join(["*b"] * 20) + "]\n")
    msg = _error_of(bomb)
    assert msg.startswith(f"{bomb}: not a syntax error: its YAML aliases expand the file from ") and \
        msg.endswith("lift it in the environment: OMEGACONF_MAX_YAML_EXPANDED_NODES=none"), msg
