"""Fixtures for data tests: the shared data folder and a tiny offline tokenizer."""

import os
import string
from pathlib import Path

import pytest

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def shared_data_dir() -> Path:
    """Return ``$NEMO_FP8_SHARED_DATA`` or ``<repo>/../shared/data``."""
    env = os.environ.get("NEMO_FP8_SHARED_DATA")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "data"


@pytest.fixture(scope="session")
def gsm8k_dir() -> Path:
    path = shared_data_dir() / "gsm8k"
    if not (path / "train.jsonl").is_file() or not (path / "test.jsonl").is_file():
        pytest.skip(f"GSM8K data not found at {path} (set NEMO_FP8_SHARED_DATA to the shared data folder)")
    return path


def make_char_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    """A character-level tokenizer (one token per printable ASCII character), built offline."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[PAD]": 1}
    for ch in sorted(set(string.printable)):
        vocab.setdefault(ch, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


@pytest.fixture
def char_tokenizer():
    return make_char_tokenizer()
