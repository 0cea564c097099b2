"""quantization.device: resolution (auto / cpu / cuda), pass timing and peak-memory bookkeeping."""

from __future__ import annotations

import pytest
import torch

from llmc.builder import devices
from llmc.errors import BuildError


def test_explicit_cpu_stays_on_the_cpu_even_with_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert devices.resolve_build_device("cpu") == torch.device("cpu")


def test_auto_resolves_to_cuda_when_torch_sees_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert devices.resolve_build_device("auto") == torch.device("cuda", 0)
    assert devices.resolve_build_device("cuda") == torch.device("cuda", 0)


def test_auto_resolves_to_the_cpu_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.resolve_build_device("auto") == torch.device("cpu")


def test_cuda_without_a_gpu_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BuildError, match="quantization.device is cuda.*Fix: .*quantization.device: auto"):
        devices.resolve_build_device("cuda")


def test_pass_timer_records_each_pass_in_order_without_gpu_memory_on_cpu():
    timer = devices.PassTimer(torch.device("cpu"))
    timer.start("awq")
    timer.start("gptq")  # ends awq
    timer.stop()
    timer.stop()  # idempotent
    assert [p["name"] for p in timer.passes] == ["awq", "gptq"]
    assert all(p["seconds"] >= 0 and p["peak_gpu_memory_bytes"] is None for p in timer.passes)


def test_describe_device_cpu_names_the_float32_gemm_library(gemm_library):
    gemm_library("mkl")
    facts = devices.describe_device(torch.device("cpu"))
    assert facts["type"] == "cpu" and facts["name"] == "cpu" and facts["fp32_gemm"]["library"] == "mkl"
    assert "LLMC_CPU_GEMM=mkl" in facts["fp32_gemm"]["why"]
