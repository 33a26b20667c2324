"""Fixtures for data tests: the project's offline tokenizer (``gsm8k_dir`` comes from the root conftest)."""

import pytest


def make_char_tokenizer(chat_template: bool = True):
    """The project's own character tokenizer (``nemo_fp8.models.tiny``), optionally without its chat template."""
    from nemo_fp8.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    if not chat_template:
        tokenizer.chat_template = None
    return tokenizer


@pytest.fixture
def char_tokenizer():
    return make_char_tokenizer()
