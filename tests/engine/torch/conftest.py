"""Fixtures of the portable-engine tests: the tiny model's IR, the loaded engine model and transformers' model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmc.engine.torch.loader import load_model
from tests.engine.torch.helpers import write_ir


@pytest.fixture(scope="session")
def tiny_ir_dir(tiny_hf_dir, tmp_path_factory) -> Path:
    """The float32 IR (tp 1) of the tiny random Llama."""
    return write_ir(tiny_hf_dir, tmp_path_factory.mktemp("tiny_ir") / "checkpoint")


@pytest.fixture(scope="session")
def tiny_model(tiny_ir_dir):
    """The engine's model loaded from the tiny IR on CPU (float32)."""
    return load_model(tiny_ir_dir, "cpu")


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_hf_dir):
    """transformers' own LlamaForCausalLM of the tiny model (float32, eval) as the reference."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_hf_dir, dtype=torch.float32).eval()


@pytest.fixture(params=["here", pytest.param("cuda", marks=pytest.mark.gpu)])
def kernel_device(request) -> str:
    """Where a Triton kernel's test runs its tensors: "here" is the GPU where there is one, else the CPU in Triton's
    interpreter (CI); the "cuda" copy carries the gpu mark, so the device tool's ``-m gpu`` runs select these tests
    too (without it they ran on the GPU only in runs without ``-m``)."""
    return "cuda" if request.param == "cuda" or torch.cuda.is_available() else "cpu"
