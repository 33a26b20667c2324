"""Tests for prompt formatting and prompt tokenization."""

import pytest

from nemo_fp8.data import MathExample, PromptFormatter, PromptSample, make_arithmetic_problems, tokenize_prompts

from .conftest import make_char_tokenizer

PLAIN = MathExample(problem="What is 2 + 3?", answer="5", data_source="synthetic_arithmetic", index=0)
DAPO = MathExample(
    problem="Solve x. Answer: $Answer",
    answer="1",
    data_source="math_dapo",
    index=7,
    messages=({"role": "user", "content": "Solve x. Answer: $Answer"},),
)


def test_plain_mode():
    assert PromptFormatter().format(PLAIN) == "What is 2 + 3?"
    formatter = PromptFormatter(template="Q: {problem}\nPut the result in \\boxed{}.\nA:")
    assert formatter.format(PLAIN) == "Q: What is 2 + 3?\nPut the result in \\boxed{}.\nA:"
    # plain mode with a DAPO example uses the user message text
    assert PromptFormatter().format(DAPO) == "Solve x. Answer: $Answer"


def test_template_needs_placeholder():
    with pytest.raises(ValueError, match="problem"):
        PromptFormatter(template="no placeholder")


def test_chat_mode(char_tokenizer):
    formatter = PromptFormatter(template="{problem} Think.", use_chat_template=True, system_prompt="Be brief.")
    assert formatter.format(PLAIN, char_tokenizer) == "<system>Be brief.\n<user>What is 2 + 3? Think.\n<assistant>"
    no_system = PromptFormatter(use_chat_template=True)
    assert no_system.format(PLAIN, char_tokenizer) == "<user>What is 2 + 3?\n<assistant>"
    # DAPO examples use their messages verbatim (template not applied)
    assert formatter.format(DAPO, char_tokenizer) == "<system>Be brief.\n<user>Solve x. Answer: $Answer\n<assistant>"
    assert no_system.format(DAPO, char_tokenizer) == "<user>Solve x. Answer: $Answer\n<assistant>"


def test_chat_mode_errors():
    formatter = PromptFormatter(use_chat_template=True)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        formatter.format(PLAIN)
    with pytest.raises(ValueError, match="chat_template"):
        formatter.format(PLAIN, make_char_tokenizer(chat_template=False))


def test_tokenize_prompts_drops_long(char_tokenizer):
    examples = [
        MathExample(problem="1+1", answer="2", data_source="t", index=0),
        MathExample(problem="x" * 50, answer="0", data_source="t", index=1),
        MathExample(problem="22+22", answer="44", data_source="t", index=2),
        MathExample(problem="y" * 11, answer="0", data_source="t", index=3),
    ]
    samples, dropped = tokenize_prompts(examples, char_tokenizer, PromptFormatter(), max_prompt_tokens=10)
    assert dropped == 2
    assert [s.example.index for s in samples] == [0, 2]
    assert all(isinstance(s, PromptSample) for s in samples)
    assert samples[0].prompt == "1+1"
    assert samples[0].prompt_token_ids == char_tokenizer("1+1", add_special_tokens=False)["input_ids"]
    assert len(samples[1].prompt_token_ids) == 5
    # exactly at the limit is kept
    _, dropped_at_limit = tokenize_prompts(examples[3:], char_tokenizer, PromptFormatter(), max_prompt_tokens=11)
    assert dropped_at_limit == 0


def test_tokenize_prompts_chat(char_tokenizer):
    examples = make_arithmetic_problems(20, seed=0)
    formatter = PromptFormatter(use_chat_template=True)
    samples, dropped = tokenize_prompts(examples, char_tokenizer, formatter, max_prompt_tokens=1000)
    assert dropped == 0 and len(samples) == 20
    for sample in samples:
        assert sample.prompt == formatter.format(sample.example, char_tokenizer)
        assert len(sample.prompt_token_ids) == len(sample.prompt)  # one token per character
    with pytest.raises(ValueError):
        tokenize_prompts(examples, char_tokenizer, formatter, max_prompt_tokens=0)
    assert tokenize_prompts([], char_tokenizer, formatter, max_prompt_tokens=5) == ([], 0)


def test_response_prefix_ends_every_prompt_and_travels_with_the_sample(char_tokenizer):
    plain = PromptFormatter(template="Q: {problem}\n", response_prefix="Answer: ")
    assert plain.format(PLAIN) == "Q: What is 2 + 3?\nAnswer: "
    chat = PromptFormatter(use_chat_template=True, response_prefix="Answer: ")
    assert chat.format(PLAIN, char_tokenizer) == "<user>What is 2 + 3?\n<assistant>Answer: "  # after the template
    samples, _ = tokenize_prompts([PLAIN], char_tokenizer, plain, max_prompt_tokens=100)
    assert samples[0].response_prefix == "Answer: " and samples[0].prompt.endswith("Answer: ")
    assert samples[0].prompt_token_ids == char_tokenizer("Q: What is 2 + 3?\nAnswer: ",
                                                         add_special_tokens=False)["input_ids"]
    assert tokenize_prompts([PLAIN], char_tokenizer, PromptFormatter(), 100)[0][0].response_prefix == ""


def test_gsm8k_prompts(gsm8k_dir, char_tokenizer):
    from nemo_fp8.data import load_math_dataset

    examples = load_math_dataset(gsm8k_dir / "test.jsonl", limit=100)
    formatter = PromptFormatter(template="{problem}\nLet's think step by step.", use_chat_template=True)
    samples, dropped = tokenize_prompts(examples, char_tokenizer, formatter, max_prompt_tokens=300)
    assert dropped > 0 and len(samples) + dropped == 100
    assert all(len(s.prompt_token_ids) <= 300 for s in samples)


def test_a_prompt_past_the_character_bound_is_dropped_without_being_tokenized(char_tokenizer):
    """A 10 MB row was tokenized in full (24 s) before being dropped as too long. Past ``max_prompt_tokens x
    MAX_CHARS_PER_TOKEN`` characters it cannot fit: dropped, counted, never handed to the tokenizer. At the bound
    it is still tokenized (the character tokenizer's 1 character per token then drops it by its token count)."""
    import time

    from nemo_fp8.data.prompts import MAX_CHARS_PER_TOKEN

    seen = []

    def recording(texts, **kw):
        seen.extend(texts)
        return char_tokenizer(texts, **kw)

    bound = 48 * MAX_CHARS_PER_TOKEN
    examples = [MathExample(problem="1" * 10 * 2**20, answer="2", data_source="t", index=0),
                MathExample(problem="2+2", answer="4", data_source="t", index=1),
                MathExample(problem="3" * (bound + 1), answer="3", data_source="t", index=2),
                MathExample(problem="4" * bound, answer="4", data_source="t", index=3)]
    t0 = time.monotonic()
    samples, dropped = tokenize_prompts(examples, recording, PromptFormatter(), max_prompt_tokens=48)
    assert time.monotonic() - t0 < 2.0
    assert [s.example.index for s in samples] == [1] and dropped == 3
    assert seen == ["2+2", "4" * bound]
    assert tokenize_prompts(examples[:1], recording, PromptFormatter(), max_prompt_tokens=48) == ([], 1)
