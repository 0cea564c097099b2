"""Fixtures for the benchmark tests: a tiny build made by the real pipeline, its tokenizer and corpus, and a
word-level tokenizer like scripts/make_random_llama.py's (which cannot encode the corpus)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def bench_build_dir(tmp_path_factory, tiny_hf_dir) -> Path:
    """A float32 torch-backend build of the tiny random Llama (SmolLM2's tokenizer), built by ``llmc build``."""
    from llmc.builder.pipeline import build
    from llmc.recipe import recipe_from_dict

    recipe = recipe_from_dict({
        "name": "bench-tiny",
        "model": {"source": str(tiny_hf_dir), "dtype": "float32"},
        "engine": {"max_batch_size": 8, "max_input_len": 256, "max_seq_len": 512, "max_num_tokens": 128},
        "kv_cache": {"tokens_per_block": 8, "cpu_budget_mb": 16},
        "runtime": {"sampling": {"max_new_tokens": 16, "temperature": 0.0}},
    })
    return build(recipe, tmp_path_factory.mktemp("bench") / "bench-tiny").build_dir


@pytest.fixture(scope="session")
def tokenizer(smollm2_hf_dir):
    from llmc.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_hf_dir)


@pytest.fixture(scope="session")
def corpus(tokenizer):
    from llmc.bench.workload import TextCorpus

    return TextCorpus(tokenizer)


@pytest.fixture(scope="session")
def word_tokenizer():
    from tests.bench.word_tokenizer import word_level_tokenizer

    return word_level_tokenizer(300, 299)
