"""tools/write_random_checkpoint.py: Qwen3-shaped random checkpoints, streamed in shards, at tiny shapes on CPU."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lab.random_checkpoint import QWEN3_SHAPES, iter_random_shards, shard_plan, tensor_plan

REPO = Path(__file__).resolve().parents[2]
TINY = ["num_hidden_layers=2", "hidden_size=128", "intermediate_size=256", "num_attention_heads=2",
        "num_key_value_heads=1"]


def tool():
    spec = importlib.util.spec_from_file_location("write_random_checkpoint", REPO / "tools" / "write_random_checkpoint.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tokenizer():
    from lab.small import SMALL_PROMPT_TEMPLATE, train_bpe_tokenizer

    return train_bpe_tokenizer(["What is 12 + 30?\nAnswer: 42", SMALL_PROMPT_TEMPLATE], 600)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, tokenizer):
    d = tmp_path_factory.mktemp("tok")
    tokenizer.save_pretrained(d)
    return d


def _sets(*items):
    return [a for kv in items for a in ("--set", kv)]


def test_dense_checkpoint_loads_and_matches_the_files(tmp_path, tok_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "dense"
    assert tool().main(["--out", str(out), "--tokenizer-from", str(tok_dir), "--max-shard-gib", "0.02",
                        *_sets(*TINY)]) == 0
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(idx["weight_map"].values()))
    assert len(shards) >= 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    files = {}
    for s in shards:
        files.update(load_file(out / s))
        assert (out / s).stat().st_size <= 0.02 * 2**30 + 2**20 or len(load_file(out / s)) == 1
    assert idx["metadata"]["total_size"] == sum(t.numel() * 2 for t in files.values())
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.vocab_size == 151936
    sd = model.state_dict()
    assert set(sd) == set(files)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.down_proj.weight",
                 "model.layers.0.self_attn.k_norm.weight"):
        assert torch.equal(sd[name], files[name]), name
    w = files["model.layers.1.self_attn.q_proj.weight"].float()
    assert w.dtype == torch.float32 and abs(w.std().item() - 0.02) < 0.002
    assert torch.equal(files["model.norm.weight"], torch.ones(128, dtype=torch.bfloat16))
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) < model.config.vocab_size
    assert model.config.eos_token_id == tok.eos_token_id
    report = json.loads((out / "random_checkpoint.json").read_text())
    assert report["parameters"] == sum(p.numel() for p in model.parameters())


def test_moe_checkpoint_loads_with_per_expert_files(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    from lab.random_checkpoint import write_random_checkpoint

    cfg = {**QWEN3_SHAPES["qwen3-30b-a3b"], "num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256,
           "moe_intermediate_size": 128, "num_experts": 4, "num_experts_per_tok": 2, "num_attention_heads": 2,
           "num_key_value_heads": 1, "vocab_size": 1024}
    out = tmp_path / "moe"
    write_random_checkpoint(out, cfg, tokenizer, max_shard_gib=1.0, progress=False)
    files = load_file(out / "model-00001-of-00001.safetensors")
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in files and "model.layers.0.mlp.gate.weight" in files
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    sd = model.state_dict()
    fused = [k for k in sd if "experts" in k]
    if any(k.endswith("gate_up_proj") for k in fused):  # transformers >= 5 fuses the experts on load
        e = 3
        gate, up = (files[f"model.layers.1.mlp.experts.{e}.{p}_proj.weight"] for p in ("gate", "up"))
        assert torch.equal(sd["model.layers.1.mlp.experts.gate_up_proj"][e], torch.cat([gate, up]))
    else:
        assert torch.equal(sd["model.layers.1.mlp.experts.3.down_proj.weight"],
                           files["model.layers.1.mlp.experts.3.down_proj.weight"])
    with pytest.raises(FileExistsError):
        write_random_checkpoint(out, cfg, tokenizer, progress=False)


def test_full_qwen3_8b_plan_matches_transformers():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = QWEN3_SHAPES["qwen3-8b"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    plan = dict(tensor_plan(cfg))
    assert plan == {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert 8.1e9 < sum(torch.Size(s).numel() for s in plan.values()) < 8.3e9  # Qwen3-8B: 8.19B


def test_full_qwen3_30b_a3b_plan_size():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = QWEN3_SHAPES["qwen3-30b-a3b"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    n_plan = sum(torch.Size(s).numel() for _, s in tensor_plan(cfg))
    assert n_plan == sum(p.numel() for p in model.parameters())
    assert 30.0e9 < n_plan < 31.0e9  # Qwen3-30B-A3B: 30.5B


def test_shards_are_bounded_and_streamed():
    cfg = {**QWEN3_SHAPES["qwen3-8b"], "num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256,
           "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 4096}
    limit = 300_000
    plan = tensor_plan(cfg)
    shards = shard_plan(plan, limit)
    assert [t for s in shards for t in s] == plan
    for s in shards:
        size = sum(torch.Size(shape).numel() * 2 for _, shape in s)
        assert size <= limit or len(s) == 1
    seen = list(iter_random_shards(cfg, limit, seed=3))
    assert [i for i, _, _ in seen] == list(range(len(shards))) and all(n == len(shards) for _, n, _ in seen)
    again = list(iter_random_shards(cfg, limit, seed=3))
    assert all(torch.equal(a[2][k], b[2][k]) for a, b in zip(seen, again) for k in a[2])
    with pytest.raises(ValueError):
        shard_plan(plan, 0)


def test_cli_errors(tmp_path, capsys):
    t = tool()
    assert t.main(["--out", str(tmp_path / "a"), "--set", "hidden=1"]) == 2
    assert "unknown key" in capsys.readouterr().err
    assert t.main(["--out", str(tmp_path / "a"), "--set", "hidden_size"]) == 2
    with pytest.raises(ValueError, match="model_type"):
        tensor_plan({"model_type": "llama"})


def test_generation_decode_tolerates_ids_past_the_tokenizer(tokenizer):
    """The model's vocabulary (151,936) exceeds the tokenizer's: sampled ids past it decode to nothing."""
    from nemo_fp8.algorithms.grpo import decode_responses
    from nemo_fp8.batch import GenerationOutput

    good = tokenizer.encode("Answer: 42", add_special_tokens=False)
    ids = torch.tensor([[1, 2] + good[:3] + [151935, 100000] + good[3:]])
    out = GenerationOutput(token_ids=ids, prompt_lengths=torch.tensor([2]), response_lengths=torch.tensor([ids.shape[1] - 2]),
                           generation_logprobs=torch.zeros(ids.shape), truncated=torch.tensor([False]))
    assert decode_responses(out, tokenizer) == ["Answer: 42"]
