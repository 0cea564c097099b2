"""llmc.engine.torch.cpu_gemm: float32 CPU GEMMs (llmc build's passes and gate) through oneDNN where it is faster
than MKL."""

from __future__ import annotations

import copy

import pytest
import torch

from llmc.engine.torch import cpu_gemm


def test_this_pytorch_has_onednns_linear():
    assert cpu_gemm.onednn_available()  # the x86 wheels the install line pins ship it


def test_the_choice_follows_the_environment_and_refuses_unknown_values(gemm_library):
    gemm_library("mkl")
    assert cpu_gemm.choice()["library"] == "mkl"
    gemm_library("fast")
    with pytest.raises(ValueError, match="LLMC_CPU_GEMM='fast': use onednn, mkl or auto"):
        cpu_gemm.choice()


def test_measured_choice_reports_both_libraries(gemm_library):
    gemm_library("auto")
    got = cpu_gemm.choice()
    assert set(got["gflops"]) == {"mkl", "onednn"} and all(v > 0 for v in got["gflops"].values())
    faster = got["gflops"]["onednn"] >= cpu_gemm.MIN_SPEEDUP * got["gflops"]["mkl"]
    assert got["library"] == ("onednn" if faster else "mkl")


def test_fp32_linears_route_nn_linear_through_onednn_and_restore_it(gemm_library, monkeypatch):
    gemm_library("onednn")
    calls = []
    real = cpu_gemm._onednn_linear
    monkeypatch.setattr(cpu_gemm, "_onednn_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    layer = torch.nn.Linear(48, 40)
    x = torch.randn(2, 7, 48)
    with torch.no_grad():
        expected = layer(x)
        with cpu_gemm.fp32_linears(torch.device("cpu")):
            got = layer(x)
            assert layer(x.bfloat16().float()).shape == (2, 7, 40)
            copy.deepcopy(layer).bfloat16()(x.bfloat16())  # other dtypes: PyTorch's own kernel
        after = layer(x)
    assert calls == [(2, 7, 48), (2, 7, 48)]  # only the two float32 calls
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5) and torch.equal(after, expected)
    assert torch.nn.functional.linear is not None and layer(x).grad_fn is not None  # restored, autograd intact


def test_autograd_and_other_devices_keep_pytorchs_linear(gemm_library, monkeypatch):
    gemm_library("onednn")
    monkeypatch.setattr(cpu_gemm, "_onednn_linear", lambda *a: pytest.fail("oneDNN used"))
    layer = torch.nn.Linear(8, 4)
    with cpu_gemm.fp32_linears(torch.device("cpu")):
        layer(torch.randn(3, 8)).sum().backward()  # grad enabled, weight requires grad
    assert layer.weight.grad is not None
    with cpu_gemm.fp32_linears(torch.device("cuda")), torch.no_grad():
        layer(torch.randn(3, 8))  # a GPU build's passes: nothing is routed
