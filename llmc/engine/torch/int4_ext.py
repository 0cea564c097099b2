"""llmc's own CPU W4A16 matmul (``csrc/int4_matmul.cpp``), compiled on first use with the local C++ compiler.

Why a kernel of our own: PyTorch's CPU int4 op (``_weight_int4pack_mm_for_cpu``) rounds activations and group
scales to bfloat16 and re-unpacks the weights for every 4 rows, so a 16-sequence decode step costs 4x a 4-row
one. This kernel unpacks each 16-channel weight column once for up to 16 rows and keeps float32 throughout:
the model computes exactly the dequantized weights the accuracy gate scored (up to summation order).

Measured on SmolLM2's four layer shapes together (qkv, dense, fc+gate, proj; 2-core Xeon, hot loop, 2026-11-29),
this kernel vs PyTorch's op: 1 row 188 vs 220 us, 4 rows 244 vs 311 us, 8 rows 402 vs 571 us, 16 rows 748 vs
1,030 us.

Availability: an x86-64 CPU with AVX-512 (PyTorch's CPU capability ``AVX512``), a C++ compiler and ninja.
The build takes ~30 s once per machine and torch version (cached under ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``); ``llmc build`` does it in its compile step for AWQ builds.
``LLMC_CPU_INT4_KERNEL=torch`` skips it. Whenever it is unavailable, :class:`~llmc.engine.torch.int4_cpu.Int4Linear`
uses PyTorch's op, and :func:`status` says why.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "int4_matmul.cpp"
NAME = "llmc_int4_cpu_v2"  # bump with any change to the source's interface
ENV = "LLMC_CPU_INT4_KERNEL"  # "torch": use PyTorch's int4 op instead
TILE = 16  # output channels per tile (one AVX-512 register of float32)
# -fopenmp: at::parallel_for runs on torch's thread pool; at run time the extension shares torch's own libgomp.
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-fopenmp"]

_why_not: str | None = None


def supports_shape(out_features: int, in_features: int, group_size: int) -> bool:
    """Whole tiles of 16 output channels and whole, even-sized groups."""
    return out_features % TILE == 0 and group_size % 2 == 0 and in_features % group_size == 0


@functools.cache
def load() -> ModuleType | None:
    """The compiled extension, or None (logged once, with the reason, and kept for :func:`status`)."""
    global _why_not
    if os.environ.get(ENV, "").lower() == "torch":
        _why_not = f"{ENV}=torch"
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX512":
        _why_not = f"this CPU's capability is {capability}, the kernel needs AVX512"
        return None
    try:
        from torch.utils.cpp_extension import load as build

        module = build(name=NAME, sources=[str(SOURCE)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                       verbose=False)
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a failed build: fall back, say why
        _why_not = f"building it failed ({type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]})"
        logger.warning("llmc's CPU int4 kernel is unavailable, using PyTorch's int4 op: %s. Fix: install a C++ "
                       "compiler and ninja (pip install ninja)", _why_not)
        return None
    return module


def status() -> str:
    """One line: which CPU int4 matmul this process uses, and why."""
    if load() is not None:
        return "llmc AVX-512 float32 kernel"
    return f"PyTorch's int4 op ({_why_not})"


def pack_tiles(q: torch.Tensor, scale: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` int [N, K] in [-8, 7] and ``scale`` [N, K/g] -> the kernel's ``packed`` uint8 [N/16, K, 8] and
    ``scales`` float32 [N/16, K/g, 16] (see ``csrc/int4_matmul.cpp``)."""
    n, k = q.shape
    assert supports_shape(n, k, group_size), (tuple(q.shape), group_size)
    u = (q.to(torch.int16) + 8).to(torch.uint8).view(n // TILE, TILE, k).transpose(1, 2)  # [T, K, 16] in [0, 15]
    packed = (u[..., 0::2] | (u[..., 1::2] << 4)).contiguous()  # [T, K, 8]: channel 2j low, 2j+1 high
    scales = scale.to(torch.float32).view(n // TILE, TILE, k // group_size).transpose(1, 2).contiguous()
    return packed, scales
