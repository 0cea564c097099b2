"""Float32 matrix products of the CPU calibration passes (AWQ's search, GPTQ's Hessians) and of the accuracy
gate's forwards through oneDNN where it is faster than PyTorch's default BLAS (MKL).

The AWQ and GPTQ passes on the CPU spend most of their time in float32 GEMMs: a sampling profile of the embedded
recipe's build (2026-12-02, 2-core AMD EPYC) found 63 % of all samples in MKL's ``sgemm`` kernel, half of the
build in ``nn.Linear`` forwards. MKL runs its AVX2 code on AMD processors (about 175 GFLOP/s on those two cores);
oneDNN's float32 kernels, which ship in the same PyTorch, use AVX-512 there (about 370 GFLOP/s on the
calibration shapes, dense tensors in and out). Both accumulate in float32; their results differ only by summation
order (relative difference ~1e-6).

The choice is measured once per process (:func:`choice`: one product of a calibration-sized shape with each
library, oneDNN taken when it is at least 1.2x faster) and can be forced with ``LLMC_CPU_GEMM=onednn|mkl``.
:func:`fp32_linears` routes ``torch.nn.functional.linear`` through oneDNN for float32 CPU tensors without
autograd while it is open; :func:`gram` is ``x^T x``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

ENV = "LLMC_CPU_GEMM"
MIN_SPEEDUP = 1.2
_SHAPE = (2048, 576, 1536)  # rows x inputs x outputs: a calibration batch through SmolLM2's MLP


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight.contiguous(), bias, "none", [], "")


def _gflops(fn, x: torch.Tensor, w: torch.Tensor) -> float:
    fn(x, w)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        fn(x, w)
        best = min(best, time.perf_counter() - start)
    return 2 * x.shape[0] * x.shape[1] * w.shape[0] / best / 1e9


@functools.cache
def choice() -> dict[str, Any]:
    """``{"library": "onednn" | "mkl", "why": ..., "gflops": {library: measured}}`` for this process."""
    forced = os.environ.get(ENV, "").strip().lower()
    if forced not in ("", "auto", "onednn", "mkl"):
        raise ValueError(f"{ENV}={forced!r}: use onednn, mkl or auto")
    if not onednn_available():
        return {"library": "mkl", "why": "this PyTorch has no oneDNN linear", "gflops": {}}
    if forced in ("onednn", "mkl"):
        return {"library": forced, "why": f"{ENV}={forced}", "gflops": {}}
    gen = torch.Generator().manual_seed(0)
    rows, inputs, outputs = _SHAPE
    x = torch.randn(rows, inputs, generator=gen)
    w = torch.randn(outputs, inputs, generator=gen)
    with torch.no_grad():
        gflops = {"mkl": _gflops(torch.nn.functional.linear, x, w), "onednn": _gflops(_onednn_linear, x, w)}
    faster = gflops["onednn"] >= MIN_SPEEDUP * gflops["mkl"]
    return {"library": "onednn" if faster else "mkl", "gflops": {k: round(v, 1) for k, v in gflops.items()},
            "why": f"measured on {rows}x{inputs}x{outputs}, oneDNN taken from {MIN_SPEEDUP}x faster"}


def _eligible(*tensors: torch.Tensor | None) -> bool:
    present = [t for t in tensors if t is not None]
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in present):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in present))


@contextlib.contextmanager
def fp32_linears(device: torch.device) -> Iterator[None]:
    """Within: float32 ``F.linear`` on the CPU (so every ``nn.Linear``) goes through oneDNN when :func:`choice`
    took it and ``device`` is the CPU; anything else (other dtypes and devices, autograd) is untouched."""
    if device.type != "cpu" or choice()["library"] != "onednn":
        yield
        return
    original = torch.nn.functional.linear

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() >= 2 and weight.dim() == 2 and _eligible(x, weight, bias):
            return _onednn_linear(x, weight, bias)
        return original(x, weight, bias)

    torch.nn.functional.linear = linear
    try:
        yield
    finally:
        torch.nn.functional.linear = original


def uses_onednn(x: torch.Tensor) -> bool:
    """Whether :func:`gram` of ``x`` goes through oneDNN."""
    return _eligible(x) and choice()["library"] == "onednn"


def gram(x: torch.Tensor) -> torch.Tensor:
    """``x^T x`` of a float32 ``[rows, n]`` matrix, through oneDNN on the CPU when :func:`choice` took it."""
    if x.dim() == 2 and uses_onednn(x):
        xt = x.t().contiguous()
        return _onednn_linear(xt, xt)
    return x.t() @ x
