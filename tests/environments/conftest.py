"""Shared fixtures of the environment tests: the ChatML tokenizer (trained once per session)."""

import pytest

from rlkit.model_presets import shared_tokenizer


@pytest.fixture(scope="session")
def chat_tokenizer():
    """The model presets' byte-level ChatML tokenizer, whose template renders tools (a few seconds, once)."""
    return shared_tokenizer()
