"""Linears of a 16-bit checkpoint on CPU: decode steps multiply the exact 16-bit copy of the weight.

The CPU engine computes in float32, so a float16 (or bfloat16) checkpoint's weights are widened at load: 4
bytes per weight read per decoded token, where the checkpoint has 2. :class:`Dense16Linear` keeps a copy in the
checkpoint's dtype, packed for llmc's kernel (``csrc/dense16_matmul.cpp``), which widens each value exactly in
registers: the products are the float32 layer's, up to summation order, from half the bytes. Larger steps
(prefill; more than ``MAX_ROWS`` rows, or ``MAX_ROWS_BF16`` where the bfloat16 GEMM takes them) are compute-bound,
and :class:`~llmc.engine.torch.prefill_cpu.PrefillLinear` runs them over a second form of the weight: bfloat16
pairs where the CPU has AVX512-BF16 (memory: the same again), else the float32 weight (twice again).

Used by :func:`llmc.engine.torch.loader.load_model` with ``cpu_kernels=True`` for 16-bit checkpoints whose
weights round-trip exactly (:func:`~llmc.engine.torch.cpu_ext.exact_copy16`), when llmc's CPU kernels are
available.
"""

from __future__ import annotations

import torch

from llmc.engine.torch import cpu_ext
from llmc.engine.torch.prefill_cpu import PrefillLinear, SplitLinear

MAX_ROWS = 16  # rows (tokens in the step) up to which the kernel serves the layer, with float32 prefill GEMMs
# With bfloat16 ones, which read as many weight bytes and do twice the FLOPs per instruction, from 4 rows: SmolLM2's
# 30 layers (weights out of cache), one Zen 4 core, per-thread CPU time, 2026-12-01: this kernel vs the bfloat16
# GEMM 11.5 vs 12.3 ms at 3 rows, 12.7 vs 11.6 at 4, 22.1 vs 14.7 at 8, 39.4 vs 23.8 at 16.
MAX_ROWS_BF16 = 3


class Dense16Linear(SplitLinear):
    """``y = x @ W^T`` for a float32 ``dense`` weight ``[O, K]`` that has an exact 16-bit copy ``narrow`` (build it
    with :meth:`over`, which makes that check once)."""

    def __init__(self, dense: torch.Tensor, narrow: torch.Tensor, prefill: str = "float32"):
        super().__init__()
        assert narrow.shape == dense.shape and narrow.dtype in (torch.float16, torch.bfloat16)
        self.out_features, self.in_features = dense.shape
        self.prefill = PrefillLinear.over(dense, prefill)  # steps of more than decode_rows rows
        self.decode_rows = MAX_ROWS_BF16 if self.prefill.precision == "bfloat16" else MAX_ROWS
        self.register_buffer("tiles", cpu_ext.pack_tiles16(narrow))  # [O/16, K, 16] in the checkpoint's dtype

    @classmethod
    def over(cls, weight: torch.Tensor, dtype: torch.dtype, prefill: str = "float32") -> Dense16Linear | None:
        """The layer over ``weight`` when its ``dtype`` copy is exact (:func:`cpu_ext.exact_copy16`), else None;
        ``prefill`` is the precision of its large steps (:class:`PrefillLinear`)."""
        narrow = cpu_ext.exact_copy16(weight, dtype)
        return None if narrow is None else cls(weight.detach(), narrow, prefill)

    def decode(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, O], T <= decode_rows
        return cpu_ext.dense16_matmul(x.contiguous(), self.tiles)
