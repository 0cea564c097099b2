"""GPTQ's Hessian increments (llmc.builder.llmcompressor_driver.hessian_increment) through the chosen float32 GEMM
library."""

from __future__ import annotations

import gc
import weakref

import torch

from llmc.builder.llmcompressor_driver import hessian_increment
from llmc.engine.torch import cpu_gemm


def test_gptq_hessian_through_onednn_matches_the_librarys(gemm_library):
    from llmcompressor.modifiers.gptq.helpers import accumulate_hessian

    gemm_library("onednn")
    layer = torch.nn.Linear(24, 16)
    inp = torch.randn(3, 11, 24)
    zeros = (torch.zeros(24, 24), torch.zeros(()))
    ours_h, ours_n = hessian_increment(inp, layer, zeros[0].clone(), zeros[1].clone(), accumulate_hessian)
    lib_h, lib_n = accumulate_hessian(inp, layer, zeros[0].clone(), zeros[1].clone())
    assert torch.allclose(ours_h, lib_h, rtol=1e-5, atol=1e-4) and float(ours_n) == float(lib_n) == 3.0
    assert torch.allclose(cpu_gemm.gram(inp[0]), inp[0].t() @ inp[0], rtol=1e-5, atol=1e-5)
    gemm_library("mkl")  # then the library's own function runs, bit for bit
    mkl_h, _ = hessian_increment(inp, layer, zeros[0].clone(), zeros[1].clone(), accumulate_hessian)
    assert torch.equal(mkl_h, lib_h)


def test_a_hessian_increment_keeps_no_reference_to_its_inputs(gemm_library):
    """The calibration inputs of every layer pass through here (thousands of batches): holding on to any of them
    grows the build's memory by the whole calibration set per layer (a cached function once did: 24 GB)."""
    from llmcompressor.modifiers.gptq.helpers import accumulate_hessian

    for name in ("onednn", "mkl"):
        gemm_library(name)
        layer = torch.nn.Linear(24, 16)
        inp = torch.randn(3, 11, 24)
        alive = weakref.ref(inp)
        hessian, count = hessian_increment(inp, layer, torch.zeros(24, 24), torch.zeros(()), accumulate_hessian)
        del inp
        gc.collect()
        assert alive() is None, name
        assert hessian.shape == (24, 24) and float(count) == 3.0

