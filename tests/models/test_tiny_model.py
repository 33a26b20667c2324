"""The tiny model's shipped weights (nemo_fp8/models/tiny.py, tools/make_tiny_model.py --ship)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nemo_fp8.models.sft import state_dict_sha256
from nemo_fp8.models.tiny import (SHIPPED_DIR, TinyModelSpec, _load_shipped, _tiny_config, build_char_tokenizer,
                                  build_tiny_model, find_shipped_weights, ship_tiny_weights)

REPO = Path(__file__).resolve().parents[2]
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
             head_dim=16, sft_steps=2, sft_batch_size=4)


def weights_of(model_dir: Path) -> str:
    from transformers import Qwen3ForCausalLM

    return state_dict_sha256(Qwen3ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).state_dict())


def test_shipped_weights_are_loaded_for_their_spec_only(tmp_path):
    spec = TinyModelSpec(**SMALL)
    trained = build_tiny_model(tmp_path / "trained", spec, shipped_dir=None)
    ship = tmp_path / "ship"
    weights = ship_tiny_weights(trained, "small", ship)
    record = json.loads(weights.with_suffix(".json").read_text())
    built = json.loads((trained / "tiny_model_spec.json").read_text())
    assert built | record["spec"] == built and record["parameters"] == built["parameters"]
    assert find_shipped_weights(spec, ship) == (weights, record)
    assert find_shipped_weights(TinyModelSpec(**{**SMALL, "seed": 7}), ship) is None  # another spec: train
    loaded = build_tiny_model(tmp_path / "loaded", spec, shipped_dir=ship)
    assert json.loads((loaded / "tiny_model_spec.json").read_text())["shipped_weights"] == "small.safetensors"
    assert weights_of(loaded) == weights_of(trained) == record["sha256"]
    assert (loaded / "tokenizer.json").read_text() == (trained / "tokenizer.json").read_text()


def test_changed_shipped_weights_are_refused(tmp_path):
    from safetensors.torch import save_file

    spec = TinyModelSpec(**SMALL)
    weights = ship_tiny_weights(build_tiny_model(tmp_path / "trained", spec, shipped_dir=None), "small", tmp_path / "s")
    tensors = load_file(weights)
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, weights)
    with pytest.raises(ValueError, match="re-ship"):
        build_tiny_model(tmp_path / "loaded", spec, shipped_dir=tmp_path / "s")
    assert not (tmp_path / "loaded").exists()


def test_the_default_configs_tiny_model_is_shipped():
    """README command 1 loads the shipped weights instead of a minutes-long warm start: the tiny configs'
    ``policy.tiny_model`` spec (as the trainer builds it) has shipped weights, and they match their record."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from nemo_fp8.config import load_config

    for name in ("grpo_math_tiny_fp8.yaml", "grpo_math_tiny.yaml"):
        tiny = load_config(REPO / "examples" / "configs" / name, []).policy.tiny_model
        spec = TinyModelSpec(sft_steps=tiny.sft_steps, max_operand=tiny.max_operand, seed=tiny.seed)
        found = find_shipped_weights(spec, SHIPPED_DIR)
        assert found is not None, f"{name}: no shipped weights for {spec}; tools/make_tiny_model.py --ship"
        model = Qwen3ForCausalLM(_tiny_config(build_char_tokenizer(), spec))
        _load_shipped(model, *found)  # raises on a fingerprint mismatch
        assert isinstance(model.config, Qwen3Config) and found[0].stat().st_size < 10 * 2**20
