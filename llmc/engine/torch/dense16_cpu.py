"""Linears of a 16-bit checkpoint on CPU: decode steps multiply the exact 16-bit copy of the weight.

The CPU engine computes in float32, so a float16 (or bfloat16) checkpoint's weights are widened at load: 4
bytes per weight read per decoded token, where the checkpoint has 2. :class:`Dense16Linear` keeps a copy in the
checkpoint's dtype, packed for llmc's kernel (``csrc/dense16_matmul.cpp``), which widens each value exactly in
registers: the products are the float32 layer's, up to summation order, from half the bytes. Steps of more than
``MAX_ROWS`` rows (prefill) are compute-bound GEMMs, where PyTorch's float32 matmul is faster, so the float32
weight stays too (memory: +1/2 of the float32 weights).

Used by :func:`llmc.engine.torch.loader.load_model` with ``cpu_kernels=True`` for 16-bit checkpoints whose
weights round-trip exactly (:func:`~llmc.engine.torch.cpu_ext.exact_copy16`), when llmc's CPU kernels are
available.
"""

from __future__ import annotations

import torch
from torch import nn

from llmc.engine.torch import cpu_ext

MAX_ROWS = 16  # rows (tokens in the step) up to which the kernel serves the layer


class Dense16Linear(nn.Module):
    """``y = x @ W^T`` for a float32 ``dense`` weight ``[O, K]`` that has an exact 16-bit copy ``narrow`` (build it
    with :meth:`over`, which makes that check once)."""

    def __init__(self, dense: torch.Tensor, narrow: torch.Tensor):
        super().__init__()
        assert narrow.shape == dense.shape and narrow.dtype in (torch.float16, torch.bfloat16)
        self.out_features, self.in_features = dense.shape
        self.register_buffer("dense", dense)
        self.register_buffer("tiles", cpu_ext.pack_tiles16(narrow))  # [O/16, K, 16] in the checkpoint's dtype

    @classmethod
    def over(cls, weight: torch.Tensor, dtype: torch.dtype) -> Dense16Linear | None:
        """The layer over ``weight`` when its ``dtype`` copy is exact (:func:`cpu_ext.exact_copy16`), else None."""
        narrow = cpu_ext.exact_copy16(weight, dtype)
        return None if narrow is None else cls(weight.detach(), narrow)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, O]
        if x.shape[0] > MAX_ROWS or x.dtype != torch.float32:
            return nn.functional.linear(x, self.dense)
        return cpu_ext.dense16_matmul(x.contiguous(), self.tiles)
