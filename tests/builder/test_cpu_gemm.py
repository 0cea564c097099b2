"""llmc.builder.cpu_gemm: the calibration passes' float32 GEMMs through oneDNN where it is faster than MKL."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

from llmc.builder import cpu_gemm
from llmc.builder.llmcompressor_driver import hessian_increment

@pytest.fixture
def library(monkeypatch):
    """Force the choice (``onednn`` / ``mkl``) through the environment variable, as a user would."""
    def force(name: str) -> None:
        monkeypatch.setenv(cpu_gemm.ENV, name)
        cpu_gemm.choice.cache_clear()
    yield force
    cpu_gemm.choice.cache_clear()


def test_this_pytorch_has_onednns_linear():
    assert cpu_gemm.onednn_available()  # the x86 wheels the install line pins ship it


def test_the_choice_follows_the_environment_and_refuses_unknown_values(library):
    library("mkl")
    assert cpu_gemm.choice()["library"] == "mkl"
    library("fast")
    with pytest.raises(ValueError, match="LLMC_CPU_GEMM='fast': use onednn, mkl or auto"):
        cpu_gemm.choice()


def test_measured_choice_reports_both_libraries(library):
    library("auto")
    got = cpu_gemm.choice()
    assert set(got["gflops"]) == {"mkl", "onednn"} and all(v > 0 for v in got["gflops"].values())
    faster = got["gflops"]["onednn"] >= cpu_gemm.MIN_SPEEDUP * got["gflops"]["mkl"]
    assert got["library"] == ("onednn" if faster else "mkl")


def test_fp32_linears_route_nn_linear_through_onednn_and_restore_it(library, monkeypatch):
    library("onednn")
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


def test_autograd_and_other_devices_keep_pytorchs_linear(library, monkeypatch):
    library("onednn")
    monkeypatch.setattr(cpu_gemm, "_onednn_linear", lambda *a: pytest.fail("oneDNN used"))
    layer = torch.nn.Linear(8, 4)
    with cpu_gemm.fp32_linears(torch.device("cpu")):
        layer(torch.randn(3, 8)).sum().backward()  # grad enabled, weight requires grad
    assert layer.weight.grad is not None
    with cpu_gemm.fp32_linears(torch.device("cuda")), torch.no_grad():
        layer(torch.randn(3, 8))  # a GPU build's passes: nothing is routed


def test_gptq_hessian_through_onednn_matches_the_librarys(library):
    from llmcompressor.modifiers.gptq.helpers import accumulate_hessian

    library("onednn")
    layer = torch.nn.Linear(24, 16)
    inp = torch.randn(3, 11, 24)
    zeros = (torch.zeros(24, 24), torch.zeros(()))
    ours_h, ours_n = hessian_increment(inp, layer, zeros[0].clone(), zeros[1].clone(), accumulate_hessian)
    lib_h, lib_n = accumulate_hessian(inp, layer, zeros[0].clone(), zeros[1].clone())
    assert torch.allclose(ours_h, lib_h, rtol=1e-5, atol=1e-4) and float(ours_n) == float(lib_n) == 3.0
    assert torch.allclose(cpu_gemm.gram(inp[0]), inp[0].t() @ inp[0], rtol=1e-5, atol=1e-5)
    library("mkl")  # then the library's own function runs, bit for bit
    mkl_h, _ = hessian_increment(inp, layer, zeros[0].clone(), zeros[1].clone(), accumulate_hessian)
    assert torch.equal(mkl_h, lib_h)


def test_a_hessian_increment_keeps_no_reference_to_its_inputs(library):
    """The calibration inputs of every layer pass through here (thousands of batches): holding on to any of them
    grows the build's memory by the whole calibration set per layer (a cached function once did: 24 GB)."""
    from llmcompressor.modifiers.gptq.helpers import accumulate_hessian

    for name in ("onednn", "mkl"):
        library(name)
        layer = torch.nn.Linear(24, 16)
        inp = torch.randn(3, 11, 24)
        alive = weakref.ref(inp)
        hessian, count = hessian_increment(inp, layer, torch.zeros(24, 24), torch.zeros(()), accumulate_hessian)
        del inp
        gc.collect()
        assert alive() is None, name
        assert hessian.shape == (24, 24) and float(count) == 3.0
