"""W4A16 linears that stay int4 on CPU: PyTorch's packed-int4 matmul instead of dequantized float weights.

A 135M-parameter model is 540 MB of float32 weights, read once per decoded token; packed int4 is 8x smaller
(it fits this class of CPU's L3 cache) and ``torch.ops.aten._weight_int4pack_mm_for_cpu`` multiplies with
bfloat16 activations directly. The IR's symmetric int4 maps onto the kernel's asymmetric form exactly:
``w = (u - 8) * scale + zero`` with ``u = q + 8`` in [0, 15] and ``zero = 0``, so the weights are the same
``q * scale`` the accuracy gate scored; only the activations are rounded to bfloat16 inside the matmul.

Where it wins depends on the step, measured on whole SmolLM2 model steps on a 2-core Xeon (2026-11-29; a
single layer in isolation stays in the L3 cache and favours the float GEMM): batched decode of 16 sequences
~80 ms with int4 vs ~103 ms with float32 weights, 32 sequences a tie, 64 sequences and prefill chunks of 32
tokens or more faster in float32 (compute-bound GEMMs). So :class:`Int4Linear` keeps the dequantized float
weight too and uses the int4 path for steps of at most ``MAX_INT4_ROWS`` tokens (decode of up to 16
sequences, where reading the weights is most of the cost). Memory: +1/8 of the float weights.
The loader stacks each MLP's fc and gate into one Int4Linear (one kernel call instead of two).

Used by :func:`llmc.engine.torch.loader.load_model` with ``int4_kernel=True`` (the runner's default on CPU)
when the op exists in this PyTorch build and the layer's shape suits it; otherwise layers are dequantized.
"""

from __future__ import annotations

import torch
from torch import nn

from llmc.checkpoint.int4 import unpack_int4

_OPS = ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu")
MAX_INT4_ROWS = 16  # rows (tokens in the step) up to which the int4 kernel beats the float GEMM on CPU


def int4_kernel_available() -> bool:
    """True when this PyTorch build has the CPU packed-int4 ops."""
    return all(hasattr(torch.ops.aten, op) for op in _OPS)


def supports_shape(out_features: int, in_features: int, group_size: int) -> bool:
    """The kernel's layout needs whole groups and, as in its reference use, group sizes of 32-256."""
    return group_size in (32, 64, 128, 256) and in_features % group_size == 0 and out_features % 8 == 0


class Int4Linear(nn.Module):
    """``y = (x * prequant) @ (q * scale)^T`` with ``q`` kept as packed int4 (CPU only).

    ``q`` int8 [O, K] in [-8, 7], ``scale`` [O, K/g], ``prequant`` [K] (ones: AWQ scales folded upstream),
    ``dense`` [O, K] the same layer's dequantized effective weight, used for steps of more than
    ``MAX_INT4_ROWS`` rows. Input and output are in the model's compute dtype; the int4 matmul runs in bfloat16.
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, prequant: torch.Tensor, group_size: int,
                 dense: torch.Tensor):
        super().__init__()
        out_features, in_features = q.shape
        assert supports_shape(out_features, in_features, group_size), (tuple(q.shape), group_size)
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        unsigned = (q.to(torch.int32) + 8).contiguous()  # [O, K] in [0, 15]
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 1))
        scales_and_zeros = torch.zeros(in_features // group_size, out_features, 2, dtype=torch.bfloat16)
        scales_and_zeros[:, :, 0] = scale.to(torch.float32).t().to(torch.bfloat16)  # [K/g, O]
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        ones = bool(torch.all(prequant == 1))
        self.register_buffer("prequant", None if ones else prequant.to(torch.float32))
        assert tuple(dense.shape) == (out_features, in_features)
        self.register_buffer("dense", dense)

    @classmethod
    def from_packed(cls, packed: torch.Tensor, scale: torch.Tensor, prequant: torch.Tensor,
                    group_size: int, dense: torch.Tensor) -> Int4Linear:
        """From the IR's tensors: ``packed`` int8 [O/2, K] (row 2j low nibble, 2j+1 high)."""
        return cls(unpack_int4(packed), scale, prequant, group_size, dense)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, O]
        if x.shape[0] > MAX_INT4_ROWS:
            return nn.functional.linear(x, self.dense)
        if self.prequant is not None:
            x = x * self.prequant.to(x.dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.packed, self.group_size, self.scales_and_zeros)
        return y.to(x.dtype)
