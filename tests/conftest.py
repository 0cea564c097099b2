"""Shared fixtures: one cached conversion of the embedded model per machine, tiny random models per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import factories


@pytest.fixture(scope="session")
def smollm2_hf_dir() -> Path:
    """A Hugging Face folder (float32 safetensors, tokenizer, chat template) of the embedded SmolLM2.

    The GGUF conversion (~35 s) is cached by llmc itself, keyed by the file's hash, so every test session
    after the first reuses it.
    """
    from llmc.build.load import resolve_embedded_source

    return resolve_embedded_source().hf_dir


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory, smollm2_hf_dir) -> Path:
    """A tiny random Llama HF folder with SmolLM2's tokenizer (2 layers, hidden 64, GQA 4/2)."""
    return factories.make_tiny_llama(tmp_path_factory.mktemp("tiny") / "hf", smollm2_hf_dir)
