"""Fixtures of the builder tests: the tiny model's tokenizer and chat template (SmolLM2's)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer(tiny_hf_dir):
    from llmc.tokenizer import load_tokenizer

    return load_tokenizer(tiny_hf_dir)


@pytest.fixture(scope="session")
def template(tiny_hf_dir) -> str:
    return (tiny_hf_dir / "chat_template.jinja").read_text()
