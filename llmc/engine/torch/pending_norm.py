"""The residual add + RMSNorm between an int4 o or down projection and the next int4 layer, without a kernel of its
own (CUDA, llmc's mma kernels).

In a decode step every residual add joins the following RMSNorm in one Triton kernel
(:func:`llmc.engine.torch.fused_triton.add_rms_norm_`): 64 small kernels a step for Llama-3.1-8B, each a launch, a
wait for the previous kernel and a pass over the rows. Here the producer, an o or down projection, adds its product
to the residual stream in its epilogue, writes the new rows times the norm's weight and stores each row's sum of
squares over its block's columns (:func:`add_residual`); the consumer, the next qkv or fc + gate layer, multiplies
those scaled rows and, in its epilogue, each row's products by ``rsqrt(mean square + eps)`` from the sums (a few
hundred bytes a row; :func:`takes_input_norm`): the norm's factor is the same for all of a row's inputs, so it comes
out of the products. No block waits for another (a producer whose last block norms the rows pays a kernel
boundary's latency again) and the consumer's main loop is unchanged (finishing the norm on its inputs there made
it slower than the separate kernel). Roundings: the separate kernel rounds ``h * rstd`` and then its product with
the weight; here ``h * weight`` is rounded once and the factor applied in float32 (an error of the same size).
Where the consumer cannot finish the norm (another kernel family, prefill sizes, a 16-bit layer, the final norm
before the logits) it is computed by :meth:`PendingNorm.materialize` first.

``LLMC_NORM_EPILOGUE``: the largest step (rows) that does this (default 8: on the H200 decode steps of 1 and 8 rows
took 2.0-2.6 % less GPU time, of 16 rows 2.8-2.9 % more, of 32 and 64 the same; ``0`` switches it off).
docs/GPU_INT4_LOG.md has the runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from llmc.engine.torch import cuda_ext

NORM_EPILOGUE_ENV = "LLMC_NORM_EPILOGUE"
NORM_EPILOGUE_ROWS_DEFAULT = 8
RING_STAGES = (2, 4)  # the ring kernel's configs that have the epilogue and the input norm


def norm_epilogue_rows() -> int:
    """Steps of at most this many rows leave the norm after an o or down projection pending
    (``LLMC_NORM_EPILOGUE``: a row count, ``0`` / off for the separate kernel)."""
    value = os.environ.get(NORM_EPILOGUE_ENV, "").strip().lower()
    if not value:
        return NORM_EPILOGUE_ROWS_DEFAULT
    if value in ("0", "false", "off"):
        return 0
    if not value.isdigit():
        raise ValueError(f"{NORM_EPILOGUE_ENV}={value!r}: give a row count (e.g. 64) or 0 to switch it off")
    return int(value)


@dataclass(frozen=True)
class PendingNorm:
    """``RMSNorm(h) * weight`` not yet computed: ``h [T, H]`` the residual stream (final), ``scaled`` ``h * weight``
    rounded (the next layer's input, before the norm's per-row factor), ``sums`` the producer's float32 sums of
    squares, ``blocks`` per row (row-major)."""

    h: torch.Tensor
    scaled: torch.Tensor
    sums: torch.Tensor
    blocks: int
    weight: torch.Tensor
    eps: float

    @property
    def shape(self) -> torch.Size:
        return self.h.shape

    def materialize(self) -> torch.Tensor:
        """The normed rows ``[T, H]`` (llmc's Triton norm kernel over ``h``)."""
        from llmc.engine.torch import fused_triton  # optional dependency: Triton (the fused decoder's)

        return fused_triton.rms_norm(self.h, self.weight, self.eps)


def materialized(x: torch.Tensor | PendingNorm) -> torch.Tensor:
    """``x``'s normed rows: itself for a tensor."""
    return x.materialize() if isinstance(x, PendingNorm) else x


def _ring_config(layer, m: int) -> tuple[int, int, int, int] | None:
    """The layer's config for ``m`` rows where it is the ring kernel's at a decode size, else None."""
    if layer.backend != "mma" or m == 0 or m >= layer.dense_from_m or m > norm_epilogue_rows():
        return None
    config = layer.mma_config_for(m)
    return config if config[3] in RING_STAGES else None


def add_residual(layer, x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float) -> PendingNorm | None:
    """An int4 o or down ``layer`` (:class:`~llmc.engine.torch.int4_cuda.Int4CudaLinear`): ``h += x @ W^T`` in
    place, rounded like the separate add + norm kernel (the same bits), and the norm ``(weight, eps)`` of the new
    ``h`` left pending. None (nothing done) where it does not apply: another kernel family or config, a fc + gate
    or qkv layer, more rows than :func:`norm_epilogue_rows`."""
    m = x.shape[0]
    config = None if layer.silu_output or layer.period else _ring_config(layer, m)
    if (config is None or h.shape != (m, layer.columns) or h.dtype != x.dtype or weight.dtype != x.dtype
            or not cuda_ext.rows_aligned(h)):
        return None
    blocks = layer.columns // (16 * config[1])
    sums = layer.scratch.buffer("norm_sums", m * blocks)
    scaled = torch.empty_like(h)
    weight = weight.contiguous()
    cuda_ext.w4a16_mma_add(cuda_ext.aligned_rows(x), layer.words, layer.scales, layer.prequant, layer.columns,
                           layer.in_features, layer.group_size, config, h, scaled, weight, sums)
    return PendingNorm(h, scaled, sums, blocks, weight, eps)


def takes_input_norm(layer, x: PendingNorm) -> bool:
    """Whether an int4 qkv or fc + gate ``layer`` multiplies ``x.scaled`` and finishes the norm in its epilogue
    (:func:`kernel_args`); where not (an unfolded input scale: AWQ's is folded into the norm's weight by the loader;
    another kernel family or config; another dtype) the caller runs ``x.materialize()`` first."""
    config = None if layer.prequant is not None else _ring_config(layer, x.shape[0])
    return (config is not None and x.h.shape[1] == layer.in_features and x.scaled.dtype == layer.scratch.dtype
            and cuda_ext.rows_aligned(x.scaled))


def kernel_args(x: PendingNorm) -> dict:
    """The pending norm as :func:`llmc.engine.torch.cuda_ext.w4a16_mma` takes it (with ``x.scaled`` as the
    input)."""
    return {"in_sums": x.sums, "in_blocks": x.blocks, "in_eps": x.eps}
