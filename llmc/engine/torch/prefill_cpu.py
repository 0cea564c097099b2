"""The GEMMs of CPU prefill steps: bfloat16 products with float32 sums where the CPU has AVX512-BF16.

Prefill is compute-bound: a step of T tokens multiplies every weight T times. In float32 a core does one 16-lane
FMA per instruction; AVX512-BF16's ``vdpbf16ps`` does two bfloat16 products per float32 lane, twice the FLOPs.
:class:`PrefillLinear` holds a layer's weight in the form its large steps multiply:

- ``"bfloat16"``: the weight rounded to bfloat16, packed for llmc's kernel (``csrc/bf16_gemm.cpp``); the
  activations are rounded to bfloat16 inside the kernel, every sum and the output stay float32. For checkpoints
  stored in 16 bits (float16 / bfloat16 IR, AWQ int4 dequantized), on a CPU with AVX512-BF16 and llmc's kernels
  (:func:`~llmc.engine.torch.cpu_ext.bf16_prefill_why_not`); half the memory of the float32 weight.
- ``"float32"``: the float32 weight and ``F.linear`` (float32 checkpoints; CPUs without AVX512-BF16;
  ``LLMC_CPU_PREFILL=float32``).

:class:`SplitLinear` is the base of the CPU linears: steps of at most ``decode_rows`` tokens keep the layer's
decode kernel (int4 or exact 16-bit weight, float32 math), larger ones its ``PrefillLinear``. With bfloat16
prefill the split moves down to where the bfloat16 GEMM measured faster than the decode kernels (more than 5
rows for int4, 3 for 16-bit weights: ``int4_cpu.MAX_INT4_ROWS_BF16``, ``dense16_cpu.MAX_ROWS_BF16``); one-token
decode steps never change precision.

AWQ layers are dequantized to their bfloat16 form once, at load (212 MB for SmolLM2, half the float32 copy the
float32 path keeps): dequantizing per step instead took 1.45 s for SmolLM2's 120 int4 layers with torch ops (one
Zen 4 core, 2026-12-01), and even at memory speed writing 212 MB per step would add ~20 ms to every prefill.

Measured on the embedded model (tests/engine/torch/test_prefill_cpu.py): the bfloat16 prefill's next-token
distributions against the float32 path's, 2,048 held-out tokens of the accuracy gate, mean KL 1.3e-4 (float16
IR; 2.1e-4 for an int4 IR over 512), top-1 agreement 99.1 %; the 16-bit build's greedy answers to the
engine-vs-transformers prompts equal transformers'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmc.engine.torch import cpu_ext

DECODE_ROWS = 16  # MixedLinear: steps of up to this many tokens use float32 F.linear, larger ones the prefill GEMM
PRECISIONS = ("bfloat16", "float32")


def prefill_precision(ir_dtype: str) -> str:
    """The precision of CPU prefill GEMMs for a checkpoint stored in ``ir_dtype``: ``"bfloat16"`` for a 16-bit
    checkpoint where :func:`cpu_ext.bf16_prefill_why_not` allows it, else ``"float32"``."""
    if ir_dtype in ("float16", "bfloat16") and cpu_ext.bf16_prefill_why_not() is None:
        return "bfloat16"
    return "float32"


def prefill_path(ir_dtype: str) -> str:
    """One line for the build report: the CPU prefill precision of a checkpoint stored in ``ir_dtype`` on this
    machine, and why."""
    if ir_dtype not in ("float16", "bfloat16"):
        return f"float32 GEMMs (a {ir_dtype} checkpoint)"
    return cpu_ext.prefill_status()


class PrefillLinear(nn.Module):
    """``y = x @ W^T`` (float32 in and out) for ``weight [O, K]`` in ``precision`` (see the module docstring).

    ``"bfloat16"`` needs a shape :func:`cpu_ext.bf16_gemm_shape` takes; :meth:`over` falls back to float32
    otherwise. ``weight`` is kept as given for ``"float32"`` (no copy: it may be a view of a stacked weight).
    """

    def __init__(self, weight: torch.Tensor, precision: str):
        super().__init__()
        assert precision in PRECISIONS, precision
        self.out_features, self.in_features = weight.shape
        self.precision = precision
        if precision == "bfloat16":
            self.register_buffer("pairs", cpu_ext.pack_bf16_pairs(weight))  # [O/16, K/2, 16, 2] bfloat16
            self.register_buffer("weight", None)
        else:
            self.register_buffer("pairs", None)
            self.register_buffer("weight", weight.detach())

    @classmethod
    def over(cls, weight: torch.Tensor, precision: str) -> PrefillLinear:
        """The layer in ``precision``, or in float32 where the kernel does not take ``weight``'s shape."""
        if precision == "bfloat16" and not cpu_ext.bf16_gemm_shape(*weight.shape):
            precision = "float32"
        return cls(weight, precision)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, O]
        if self.pairs is not None:
            return cpu_ext.bf16_gemm(_float32_rows(x), self.pairs)
        return F.linear(x, self.weight)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, O/2]
        """For a stacked ``[fc; gate]`` weight: ``silu(x @ fc^T) * (x @ gate^T)``; in bfloat16 without the
        ``[T, O]`` intermediate (the kernel applies it as each tile's sums leave the registers)."""
        if self.pairs is not None and self.out_features % (2 * cpu_ext.TILE) == 0:
            return cpu_ext.bf16_gemm_silu_mul(_float32_rows(x), self.pairs)
        return silu_mul(self(x))


class SplitLinear(nn.Module):
    """Base of llmc's CPU linears: ``y = x @ W^T`` by the layer's decode kernel (:meth:`decode`) for steps of at
    most ``decode_rows`` rows, by its :class:`PrefillLinear` ``prefill`` above. Subclasses set both and
    implement :meth:`decode`."""

    decode_rows: int
    prefill: PrefillLinear

    def decode(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, O], T <= decode_rows
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, O]
        return self.prefill(x) if x.shape[0] > self.decode_rows else self.decode(x)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, O/2]
        """For a stacked ``[fc; gate]`` weight (the MLP's): ``silu(x @ fc^T) * (x @ gate^T)``."""
        return self.prefill.silu_mul(x) if x.shape[0] > self.decode_rows else silu_mul(self.decode(x))


def silu_mul(both: torch.Tensor) -> torch.Tensor:
    """``silu(fc) * gate`` of ``both = [fc | gate]`` ``[T, 2I]`` -> ``[T, I]`` (llmc's fused op where it runs)."""
    if cpu_ext.fused_available(both):
        return cpu_ext.silu_mul(both)
    fc, gate = both.chunk(2, dim=-1)
    return F.silu(fc) * gate


def _float32_rows(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32:
        raise TypeError(f"llmc's bfloat16 prefill GEMM takes the CPU engine's float32 activations, got {x.dtype}")
    return x.contiguous()


class MixedLinear(SplitLinear):
    """A linear without a CPU decode kernel: float32 ``F.linear`` for steps of up to ``DECODE_ROWS`` rows, a
    :class:`PrefillLinear` in ``precision`` above (for ``"bfloat16"``, both forms of the weight are kept)."""

    decode_rows = DECODE_ROWS

    def __init__(self, weight: torch.Tensor, precision: str):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.detach())  # [O, K] float32, as given (it may be a view)
        self.prefill = PrefillLinear.over(weight, precision)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)
