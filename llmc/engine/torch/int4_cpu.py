"""W4A16 linears that stay int4 on CPU: a packed-int4 matmul instead of dequantized float weights.

A 135M-parameter model is 540 MB of float32 weights, read once per decoded token; packed int4 is 8x smaller
(it fits this class of CPU's L3 cache). Two int4 matmuls serve steps of at most ``MAX_INT4_ROWS`` tokens:

- llmc's own AVX-512 kernel (:mod:`llmc.engine.torch.cpu_ext`, compiled on first use): float32 activations
  and scales, so the layer computes exactly the dequantized weights the accuracy gate scored. On SmolLM2's
  four layer shapes (2-core Xeon, 2026-11-29) it is on par with PyTorch's op at 1 row and 1.2-1.7x faster at
  4-16 rows (figures in :mod:`llmc.engine.torch.cpu_ext`).
- PyTorch's ``_weight_int4pack_mm_for_cpu`` where that kernel is unavailable (no AVX-512, no compiler):
  activations and group scales rounded to bfloat16 inside the matmul. The IR's symmetric int4 maps onto its
  asymmetric form exactly: ``w = (u - 8) * scale + zero`` with ``u = q + 8`` in [0, 15] and ``zero = 0``.

Larger steps (prefill chunks, big batches) are compute-bound GEMMs, where a dense weight wins: :class:`Int4Linear`
keeps the dequantized weight too, once, in the form its prefill GEMM multiplies
(:class:`~llmc.engine.torch.prefill_cpu.PrefillLinear`): bfloat16 where the CPU has AVX512-BF16, else float32.
Dequantizing per step instead would cost at least the time to write that weight (SmolLM2: 212 MB of bfloat16)
in every prefill step (measured in :mod:`llmc.engine.torch.prefill_cpu`).
The loader stacks each MLP's fc and gate into one Int4Linear (one kernel call instead of two).

Used by :func:`llmc.engine.torch.loader.load_model` with ``cpu_kernels=True`` (the runner's default on CPU)
when an int4 matmul exists and the layer's shape suits it; otherwise layers are dequantized.
"""

from __future__ import annotations

import torch

from llmc.checkpoint.int4 import unpack_int4
from llmc.engine.torch import cpu_ext
from llmc.engine.torch.prefill_cpu import PrefillLinear, SplitLinear

_OPS = ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu")
MAX_INT4_ROWS = 16  # rows (tokens in the step) up to which the int4 kernel beats the float32 GEMM on CPU
# ... and the bfloat16 GEMM, which takes over from 6 rows: SmolLM2's 30 layers of qkv, dense, fc+gate and proj
# (weights out of cache as in a real step), one Zen 4 core, per-thread CPU time, 2026-12-01: int4 kernel vs
# bfloat16 GEMM 9.6 vs 11.6 ms at 4 rows, 11.6 vs 12.0 at 5, 13.6 vs 12.8 at 6, 17.8 vs 14.7 at 8, 36.8 vs 23.8 at 16.
MAX_INT4_ROWS_BF16 = 5


def int4_kernel_available() -> bool:
    """True when this PyTorch build has the CPU packed-int4 ops."""
    return all(hasattr(torch.ops.aten, op) for op in _OPS)


def supports_shape(out_features: int, in_features: int, group_size: int) -> bool:
    """Both kernels need whole groups of 32-256 and output channels in tiles of 16 (PyTorch's packing too)."""
    return group_size in (32, 64, 128, 256) and in_features % group_size == 0 and out_features % 16 == 0


class Int4Linear(SplitLinear):
    """``y = (x * prequant) @ (q * scale)^T`` with ``q`` kept as packed int4 (CPU only).

    ``q`` int8 [O, K] in [-8, 7], ``scale`` [O, K/g], ``prequant`` [K] (ones: AWQ scales folded upstream),
    ``dense`` [O, K] the same layer's dequantized effective weight: steps of more than :attr:`decode_rows` rows
    (``MAX_INT4_ROWS``, or ``MAX_INT4_ROWS_BF16`` in bfloat16) multiply it in the ``prefill`` precision
    (:class:`~llmc.engine.torch.prefill_cpu.PrefillLinear`, which keeps only its bfloat16 form for
    ``"bfloat16"``). Input and output are in the model's compute dtype.

    ``kernel``: ``"llmc"`` is llmc's float32 kernel (:mod:`llmc.engine.torch.cpu_ext`: exact dequantized
    weights, activations not rounded); ``"torch"`` is PyTorch's op (activations and scales rounded to bfloat16);
    ``"auto"`` takes llmc's where it builds. The chosen one is in :attr:`kernel`.
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, prequant: torch.Tensor, group_size: int,
                 dense: torch.Tensor, kernel: str = "auto", prefill: str = "float32"):
        super().__init__()
        out_features, in_features = q.shape
        assert supports_shape(out_features, in_features, group_size), (tuple(q.shape), group_size)
        assert kernel in ("auto", "llmc", "torch"), kernel
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        ext = cpu_ext.load() if kernel != "torch" else None  # supports_shape above covers the kernel's tiles
        if ext is not None:
            self.kernel = "llmc"
            self._ext = ext  # the compiled module, held so a later change of mind cannot unhook it
            packed, tile_scales = cpu_ext.pack_tiles(q, scale, group_size)
            self.register_buffer("packed", packed)  # int8 [O/16, K/2, 16]
            self.register_buffer("tile_scales", tile_scales)  # float32 [O/16, K/g, 16]
        else:
            assert kernel != "llmc", cpu_ext.status()
            self.kernel = "torch"
            unsigned = (q.to(torch.int32) + 8).contiguous()  # [O, K] in [0, 15]
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 1))
            scales_and_zeros = torch.zeros(in_features // group_size, out_features, 2, dtype=torch.bfloat16)
            scales_and_zeros[:, :, 0] = scale.to(torch.float32).t().to(torch.bfloat16)  # [K/g, O]
            self.register_buffer("scales_and_zeros", scales_and_zeros)
        ones = bool(torch.all(prequant == 1))
        self.register_buffer("prequant", None if ones else prequant.to(torch.float32))
        assert tuple(dense.shape) == (out_features, in_features)
        self.prefill = PrefillLinear.over(dense, prefill)  # steps of more than decode_rows rows
        self.decode_rows = MAX_INT4_ROWS_BF16 if self.prefill.precision == "bfloat16" else MAX_INT4_ROWS

    @classmethod
    def from_packed(cls, packed: torch.Tensor, scale: torch.Tensor, prequant: torch.Tensor,
                    group_size: int, dense: torch.Tensor, kernel: str = "auto", prefill: str = "float32"
                    ) -> Int4Linear:
        """From the IR's tensors: ``packed`` int8 [O/2, K] (row 2j low nibble, 2j+1 high)."""
        return cls(unpack_int4(packed), scale, prequant, group_size, dense, kernel, prefill)

    def decode(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, O], T <= MAX_INT4_ROWS
        return self.packed_matmul(x)

    def packed_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The int4 kernel at any row count (``decode``, for steps of up to :attr:`decode_rows` rows)."""
        if self.prequant is not None:
            x = x * self.prequant.to(x.dtype)
        if self.kernel == "llmc":
            y = self._ext.int4_matmul(x.float().contiguous(), self.packed, self.tile_scales, self.group_size)
            return y.to(x.dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.packed, self.group_size, self.scales_and_zeros)
        return y.to(x.dtype)
