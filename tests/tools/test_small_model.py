"""The small model builder (tools/make_small_model.py, tools/lab/small.py) at a CPU-sized shape."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nemo_fp8.data.prompts import PromptFormatter
from nemo_fp8.data.schema import MathExample
from nemo_fp8.models.sft import causal_lm_loss, deterministic_training, pad_sft_batch, state_dict_sha256
from lab.small import (SMALL_PROMPT_TEMPLATE, SmallModelSpec, build_data, check_spec, evaluate_greedy,
                                   gsm8k_response, lr_multiplier, qwen3_config, schedule_progress,
                                   train_bpe_tokenizer, train_sft)
from nemo_fp8.rewards.math_reward import score_response

REPO = Path(__file__).resolve().parents[2]
TINY_FLAGS = ["--hidden-size", "128", "--intermediate-size", "256", "--num-layers", "2", "--num-heads", "1",
              "--num-kv-heads", "1", "--vocab-size", "1024", "--max-steps", "4", "--batch-size", "8", "--device", "cpu",
              "--num-synthetic-sft", "2000", "--num-synthetic-val", "8", "--num-gsm8k-val", "8",
              "--num-synthetic-rl", "64", "--eval-max-new-tokens", "8"]


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory, gsm8k_dir) -> Path:
    out = tmp_path_factory.mktemp("small") / "small-qwen3"
    assert load_tool("make_small_model").main(["--out", str(out), "--gsm8k-dir", str(gsm8k_dir), *TINY_FLAGS]) == 0
    return out


def test_cli_build_loads_with_auto_classes(small_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(small_dir)
    c = model.config
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.dtype == torch.bfloat16
    for v in (c.hidden_size, c.intermediate_size, c.num_attention_heads * c.head_dim, c.vocab_size):
        assert v % 128 == 0, v
    tok = AutoTokenizer.from_pretrained(small_dir)
    assert len(tok) <= c.vocab_size
    assert (tok.pad_token, tok.eos_token, tok.bos_token) == ("<|pad|>", "<|im_end|>", "<|bos|>")
    assert c.eos_token_id == tok.eos_token_id and c.pad_token_id == tok.pad_token_id
    for text in ["Natalia sold 48/2 = 24 clips in May.\nAnswer: 72", "What is 137 * 5?", "naïve café ∑ 1,000.50"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(tok.encode("2024", add_special_tokens=False)) == ["2", "0", "2", "4"]
    # the chat template renders GRPO's prompts as the SFT saw them
    prompt = PromptFormatter(SMALL_PROMPT_TEMPLATE, use_chat_template=True).format(
        MathExample(problem="What is 1 + 2?", answer="3", data_source="t", index=0), tok)
    assert prompt == ("<|im_start|>user\nWhat is 1 + 2?\nThe last line of your response should be of the form Answer: "
                      "$Answer<|im_end|>\n<|im_start|>assistant\n")


def test_cli_build_report_and_data(small_dir):
    report = json.loads((small_dir / "small_model_spec.json").read_text())
    ev = report["eval"]
    assert 0.0 <= ev["accuracy"] <= 1.0 and ev["num_samples"] == 16
    assert set(ev["by_source"]) == {"synthetic_arithmetic", "gsm8k"}
    assert ev["accuracy"] == pytest.approx(sum(ev["by_source"].values()) / 2)  # 8 + 8 samples
    assert report["train"]["steps"] == 4 and report["train"]["tokens_per_s"] > 0
    assert report["parameters"] == SmallModelSpec(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                                  num_attention_heads=1, num_key_value_heads=1,
                                                  vocab_size=1024).parameters_estimate()
    read = lambda p: [json.loads(line) for line in (small_dir / "data" / p).read_text().splitlines()]  # noqa: E731
    val, rl = read("val.jsonl"), read("rl_train.jsonl")
    assert len(val) == 16 and not {r["problem"] for r in val} & {r["problem"] for r in rl}
    assert {r["data_source"] for r in rl} == {"synthetic_arithmetic", "gsm8k"}
    from nemo_fp8.data.datasets import load_math_dataset

    assert [e.answer for e in load_math_dataset(small_dir / "data" / "val.jsonl", "problem_answer")] == \
        [r["answer"] for r in val]


def test_parity_config_uses_the_small_model_prompt():
    from nemo_fp8.config import load_config

    cfg = load_config(REPO / "examples" / "configs" / "grpo_math_small_parity.yaml")
    assert cfg.data.prompt_template == SMALL_PROMPT_TEMPLATE and cfg.data.use_chat_template
    # the data lives in the model's folder; the config's relative paths are the repository's (the model folder
    # stays as written until it exists, since a relative name that does not exist may be a hub id)
    assert Path(cfg.data.train_path).parent.parent == (REPO / cfg.policy.model_name).resolve()
    assert cfg.grpo.max_num_steps >= 100


def test_cli_rejects_bad_shape(tmp_path, capsys):
    assert load_tool("make_small_model").main(["--out", str(tmp_path / "x"), "--hidden-size", "100"]) == 2
    assert "hidden_size=100 must be a positive multiple of 128" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_cli_stops_before_the_sft_without_the_reward_dependency(tmp_path):
    """The evaluation after the SFT scores with math-verify: without it the build must stop at start-up, before any
    training (a GPU build is ~10 minutes of SFT), and write nothing."""
    out = tmp_path / "chains"
    code = ("import runpy, sys; sys.modules['math_verify'] = None; sys.path.insert(0, 'tools'); "
            f"sys.argv = ['make_small_model.py', '--task', 'chains', '--tiny', '--out', {str(out)!r}]; "
            "runpy.run_path('tools/make_small_model.py', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "math_verify" in proc.stderr
    assert "[sft]" not in proc.stdout and "[small]" not in proc.stdout
    assert not out.exists()


def test_check_spec_lists_every_error():
    with pytest.raises(ValueError) as e:
        check_spec(SmallModelSpec(intermediate_size=300, num_attention_heads=3, head_dim=40, num_key_value_heads=2,
                                  gsm8k_fraction=1.5))
    msg = str(e.value)
    for part in ("intermediate_size=300", "num_attention_heads * head_dim = 120", "must divide", "gsm8k_fraction"):
        assert part in msg


def test_parameters_estimate_matches_the_model():
    from transformers import Qwen3ForCausalLM

    spec = SmallModelSpec()
    tok = train_bpe_tokenizer(["What is 1 + 2?\nAnswer: 3"], spec.vocab_size)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(qwen3_config(spec, tok))
    n = sum(p.numel() for p in model.parameters())
    assert n == spec.parameters_estimate() and 100e6 <= n <= 300e6


def test_gsm8k_response_scores_as_the_gold_answer(gsm8k_dir):
    from nemo_fp8.data.datasets import parse_gsm8k_answer

    rows = [json.loads(line) for line in (gsm8k_dir / "train.jsonl").read_text().splitlines()[:40]]
    for r in rows:
        resp = gsm8k_response(r["answer"])
        assert "<<" not in resp and "####" not in resp and resp.splitlines()[-1].startswith("Answer: ")
        assert score_response(resp, parse_gsm8k_answer(r["answer"])) == 1.0
    with pytest.raises(ValueError, match="####"):
        gsm8k_response("no final line")


def test_build_data_is_disjoint_and_deterministic():
    spec = SmallModelSpec(num_synthetic_sft=3000, num_synthetic_val=200, num_synthetic_rl=500, synthetic_max_operand=20)
    a, b = build_data(spec, None), build_data(spec, None)
    assert [e.problem for e in a.val] == [e.problem for e in b.val]
    held = {e.problem for e in a.val}
    assert held and not held & {ex.problem for ex, _ in a.sft} and not held & {e.problem for e in a.rl_train}
    assert all(resp == f"Answer: {ex.answer}" for ex, resp in a.sft)


def test_gsm8k_share_of_the_rl_problems_is_a_seeded_sample(gsm8k_dir):
    """GRPO sees ``num_gsm8k_rl`` GSM8K train questions (the same ones on every build), -1: all of them; the SFT
    keeps every GSM8K train solution either way."""
    base = dict(num_synthetic_sft=200, num_synthetic_val=8, num_gsm8k_val=8, num_synthetic_rl=50, synthetic_max_operand=20)
    n_train = len((gsm8k_dir / "train.jsonl").read_text().splitlines())
    some = build_data(SmallModelSpec(**base, num_gsm8k_rl=100), gsm8k_dir)
    again = build_data(SmallModelSpec(**base, num_gsm8k_rl=100), gsm8k_dir)
    every = build_data(SmallModelSpec(**base, num_gsm8k_rl=-1), gsm8k_dir)
    gsm = lambda d: [e.problem for e in d.rl_train if e.data_source == "gsm8k"]  # noqa: E731
    assert len(gsm(some)) == 100 and gsm(some) == gsm(again) and len(gsm(every)) == n_train
    assert set(gsm(some)) < set(gsm(every)) and gsm(some) != gsm(every)[:100]  # a sample, not the file's head
    assert sum(ex.data_source == "gsm8k" for ex, _ in some.sft) == n_train
    assert "num_gsm8k_rl=-2 must be >= 0" in str(pytest.raises(ValueError, check_spec,
                                                                SmallModelSpec(num_gsm8k_rl=-2)).value)


class _AnswerModel:
    """generate(): appends "Answer: <gold>" for rows whose index is even, "Answer: -1" otherwise (+ EOS)."""

    def __init__(self, tok, golds):
        self.tok, self.golds, self.calls = tok, golds, 0

    def eval(self):
        return self

    def generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, do_sample):
        assert not do_sample and (attention_mask[:, -1] == 1).all()  # left padded
        rows = []
        for i in range(input_ids.shape[0]):
            j = self.calls + i
            ans = self.golds[j] if j % 2 == 0 else "-1"
            rows.append(self.tok.encode(f"Answer: {ans}", add_special_tokens=False) + [eos_token_id])
        self.calls += input_ids.shape[0]
        width = max(map(len, rows))
        out = torch.full((len(rows), input_ids.shape[1] + width), pad_token_id)
        out[:, : input_ids.shape[1]] = input_ids
        for i, r in enumerate(rows):
            out[i, input_ids.shape[1]: input_ids.shape[1] + len(r)] = torch.tensor(r)
        return out


def test_evaluate_greedy_scores_with_the_project_reward():
    tok = train_bpe_tokenizer(["What is 12 + 30?\nAnswer: 42", SMALL_PROMPT_TEMPLATE], 600)
    exs = [MathExample(problem=f"What is {i} + {i}?" + " pad" * (i % 3), answer=str(2 * i),
                       data_source="a" if i < 4 else "b", index=i) for i in range(7)]
    fmt = PromptFormatter(SMALL_PROMPT_TEMPLATE, use_chat_template=True)
    ev = evaluate_greedy(_AnswerModel(tok, [e.answer for e in exs]), tok, exs, fmt, 8, 3, torch.device("cpu"))
    assert ev["accuracy"] == pytest.approx(4 / 7)  # rows 0, 2, 4, 6
    assert ev["by_source"] == {"a": 0.5, "b": pytest.approx(2 / 3)}
    assert ev["samples"][0]["response"] == "Answer: 0"
    with pytest.raises(ValueError):
        evaluate_greedy(None, tok, [], fmt, 8, 3, torch.device("cpu"))


def test_sft_lowers_the_loss_on_arithmetic():
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    spec = SmallModelSpec(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=1,
                          num_key_value_heads=1, vocab_size=512, num_synthetic_sft=2000, synthetic_max_operand=9,
                          batch_size=32, max_steps=60, lr=3e-3, warmup_steps=5)
    data = build_data(spec, None)
    tok = train_bpe_tokenizer([f"{ex.problem}\n{r}" for ex, r in data.sft] + [SMALL_PROMPT_TEMPLATE], spec.vocab_size)
    fmt = PromptFormatter(SMALL_PROMPT_TEMPLATE, use_chat_template=True)
    from lab.small import encode_sft

    prompts, responses, sources = encode_sft(data.sft, tok, fmt, spec.max_seq_len)
    model = Qwen3ForCausalLM(qwen3_config(spec, tok))
    ids, labels, attn = pad_sft_batch(prompts[:64], responses[:64], tok.pad_token_id)
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=attn, labels=labels).loss.item()
    stats = train_sft(model, prompts, responses, sources, spec, tok.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        after = model(input_ids=ids, attention_mask=attn, labels=labels).loss.item()
    assert stats["steps"] == 60 and stats["stopped_by"] == "steps"
    assert after < 0.5 * before, (before, after)


def test_weights_sha256_is_the_saved_weights_and_a_rebuild_repeats_it(small_dir, tmp_path, gsm8k_dir):
    from transformers import AutoModelForCausalLM

    report = json.loads((small_dir / "small_model_spec.json").read_text())
    assert report["weights_sha256"] == state_dict_sha256(AutoModelForCausalLM.from_pretrained(small_dir).state_dict())
    assert report["software"]["torch"] == torch.__version__ and report["spec"]["deterministic"] is False
    # the whole pipeline (data, tokenizer, init, batches, schedule) is seeded: a deterministic rebuild repeats the bits
    again = tmp_path / "again"
    assert load_tool("make_small_model").main(["--out", str(again), "--gsm8k-dir", str(gsm8k_dir), *TINY_FLAGS,
                                               "--deterministic"]) == 0
    report2 = json.loads((again / "small_model_spec.json").read_text())
    assert report2["spec"]["deterministic"] is True and report2["weights_sha256"] == report["weights_sha256"]


def test_state_dict_sha256_covers_names_dtypes_and_every_bit():
    sd = {"b": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "a": torch.ones(4)}
    ref = state_dict_sha256(sd)
    assert ref == state_dict_sha256(dict(reversed(list(sd.items()))))  # insertion order does not matter
    flipped = sd["b"].clone()
    flipped.view(torch.int16)[1, 2] ^= 1  # one bit of one bf16 element
    assert state_dict_sha256({**sd, "b": flipped}) != ref
    assert state_dict_sha256({**sd, "a": torch.ones(4, dtype=torch.float64)}) != ref
    assert state_dict_sha256({**sd, "b": sd["b"].reshape(3, 2)}) != ref
    assert state_dict_sha256({"c": sd["b"], "a": sd["a"]}) != ref


def test_deterministic_training_sets_and_restores_torch_flags(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark)
    with deterministic_training():
        # strict: PyTorch's cuDNN attention backward is deterministic only then
        assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark) == before
    with deterministic_training(enabled=False):
        assert torch.are_deterministic_algorithms_enabled() == before[0]


def test_causal_lm_loss_is_hf_loss_and_gradient():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=32))
    ids, labels, attn = pad_sft_batch([[5, 6, 7], [8]], [[9, 10], [11, 12, 13, 14]], pad_token_id=0)
    hf = model(input_ids=ids, attention_mask=attn, labels=labels).loss
    (hf_grad,) = torch.autograd.grad(hf, [model.model.embed_tokens.weight])
    ours = causal_lm_loss(model(input_ids=ids, attention_mask=attn).logits, labels)
    (our_grad,) = torch.autograd.grad(ours, [model.model.embed_tokens.weight])
    assert ours.dtype == torch.float32 and ours.item() == pytest.approx(hf.item(), rel=1e-6)
    torch.testing.assert_close(our_grad, hf_grad, rtol=1e-5, atol=1e-7)
    # by hand on a 2-token row: only position 0 predicts a labelled token (labels[:, 1])
    logits = torch.tensor([[[0.0, 1.0, 2.0], [5.0, 5.0, 5.0]]])
    assert causal_lm_loss(logits, torch.tensor([[-100, 2]])).item() == pytest.approx(
        -torch.log_softmax(logits[0, 0], -1)[2].item())
    assert causal_lm_loss(logits, torch.tensor([[-100, -100]])).item() == 0.0


def test_deterministic_schedule_ignores_the_clock():
    spec = SmallModelSpec(max_steps=100, max_minutes=1.0)
    assert schedule_progress(10, 30.0, spec) == pytest.approx(0.5)  # the time budget is further along
    assert schedule_progress(60, 30.0, spec) == pytest.approx(0.6)
    assert schedule_progress(10, 30.0, SmallModelSpec(max_steps=100, max_minutes=1.0, deterministic=True)) == \
        pytest.approx(0.1)


def test_lr_multiplier_and_time_budget():
    assert lr_multiplier(0, 0.0, 10, 0.1) == pytest.approx(0.1)
    assert lr_multiplier(9, 0.0, 10, 0.1) == pytest.approx(1.0)
    assert lr_multiplier(50, 0.5, 10, 0.1) == pytest.approx(0.55)
    assert lr_multiplier(50, 1.0, 10, 0.1) == pytest.approx(0.1)
    assert lr_multiplier(50, 3.0, 10, 0.1) == pytest.approx(0.1)


def test_pad_sft_batch_masks_prompts_and_padding():
    ids, labels, attn = pad_sft_batch([[5, 6], [7]], [[8, 9], [10, 11, 12]], pad_token_id=0)
    assert ids.tolist() == [[5, 6, 8, 9], [7, 10, 11, 12]]
    assert labels.tolist() == [[-100, -100, 8, 9], [-100, 10, 11, 12]]
    ids, labels, attn = pad_sft_batch([[5]], [[8]] , pad_token_id=3)
    assert attn.tolist() == [[1, 1]]
    ids, labels, attn = pad_sft_batch([[5], [1, 2, 3]], [[8], [4]], pad_token_id=3)
    assert ids.tolist()[0] == [5, 8, 3, 3] and labels.tolist()[0] == [-100, 8, -100, -100] and attn.tolist()[0] == [1, 1, 0, 0]
    with pytest.raises(ValueError):
        pad_sft_batch([[1]], [], 0)
    with pytest.raises(ValueError):
        pad_sft_batch([], [], 0)
