"""Where the build's model work runs (``quantization.device``), and what it cost there.

``auto`` resolves to CUDA when torch sees a GPU, else the CPU; ``cuda`` on a machine without one is an error
before any work starts. Quantization (llm-compressor's sequential pipeline, which onloads one decoder layer at a
time), self-generation and the accuracy gate all run on the resolved device; :class:`PeakMemory` measures the
peak GPU memory of each pass for the build report.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from llmc.engine.torch import cpu_gemm
from llmc.errors import BuildError


def resolve_build_device(requested: str) -> torch.device:
    """``auto`` | ``cpu`` | ``cuda`` -> the device; BuildError for ``cuda`` without a usable GPU."""
    if requested == "cpu":
        return torch.device("cpu")
    available = torch.cuda.is_available()
    if requested == "cuda" and not available:
        raise BuildError("quantization.device is cuda, but torch sees no CUDA GPU here (torch.cuda.is_available() "
                         "is False). Fix: run the build on a GPU machine with a CUDA build of torch, or set "
                         "quantization.device: auto (or cpu)")
    if requested not in ("auto", "cuda"):
        raise BuildError(f"unknown quantization.device {requested!r}. Fix: use auto, cpu or cuda")
    return torch.device("cuda", torch.cuda.current_device()) if available else torch.device("cpu")


def describe_device(device: torch.device) -> dict[str, Any]:
    """JSON-able facts about ``device`` for the build report (GPU name and memory on CUDA)."""
    facts: dict[str, Any] = {"type": device.type, "name": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts.update(gpu=props.name, total_memory_bytes=int(props.total_memory))
    else:
        facts["fp32_gemm"] = cpu_gemm.choice()  # the library of the passes' and the gate's float32 GEMMs
    return facts


class PeakMemory:
    """Context manager: the peak GPU memory allocated by torch while it is open (``bytes``; None on CPU).

    Resets CUDA's peak counter on entry, so passes measured one after another each get their own peak.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.bytes: int | None = None

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = int(torch.cuda.max_memory_allocated(self.device))


class PassTimer:
    """Seconds and peak GPU memory of consecutive passes (``start(name)`` ends the previous one); ``passes``
    lists ``{name, seconds, peak_gpu_memory_bytes}`` in order."""

    def __init__(self, device: torch.device):
        self.device = device
        self.passes = []
        self._current: tuple[str, float, PeakMemory] | None = None

    def start(self, name: str) -> None:
        self.stop()
        peak = PeakMemory(self.device).__enter__()
        self._current = (name, time.perf_counter(), peak)

    def stop(self) -> None:
        if self._current is None:
            return
        name, started, peak = self._current
        peak.__exit__(None, None, None)
        self.passes.append({"name": name, "seconds": round(time.perf_counter() - started, 2),
                            "peak_gpu_memory_bytes": peak.bytes})
        self._current = None


def free_gpu_memory(device: torch.device) -> None:
    """Return cached CUDA blocks to the driver between passes (no-op on CPU)."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
