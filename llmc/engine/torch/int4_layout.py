"""The packed layouts of W4A16 weights on CUDA, made once at load from the IR's tensors (the IR on disk is unchanged).

- :func:`pack_for_cuda`: llmc's Triton kernels' layout (:mod:`llmc.engine.torch.int4_triton`): words
  ``[Kp/8, N]``, inputs in tiles of 128 = 8 chunks of 16.
- :func:`pack_mma`: llmc's CUDA tensor-core kernels' layout (``csrc_cuda/w4a16_mma.cu``): tiles of 16 columns x
  64 inputs in mma fragment order; :func:`unpack_mma` inverts it; :func:`interleave_tiles` orders fc and gate
  for the fused ``silu(fc) * gate`` epilogue, :func:`interleave_halves` a qkv layer's heads for the RoPE epilogue.
"""

from __future__ import annotations

import torch

from llmc.checkpoint.int4 import unpack_int4
from llmc.errors import CheckpointError

# The Triton kernels' layout (see llmc/engine/torch/int4_triton.py): input features in tiles of 128 = 8 chunks of 16.
TILE, CHUNK = 128, 16
WORDS_PER_TILE = TILE // 8
GROUP_SIZES = (64, 128)


def pack_for_cuda(packed: torch.Tensor, scales: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """IR tensors of one linear -> the kernels' ``(words int32 [Kp/8, N], scales [K/g, N])`` on packed's device.

    ``packed`` int8 [N/2, K] (two's-complement nibble pairs along the output dim), ``scales`` [N, K/g]. See
    :mod:`llmc.engine.torch.int4_triton` for the layout.
    """
    q = unpack_int4(packed)  # [N, K] int8 in [-8, 7]
    n, k = q.shape
    if group_size not in GROUP_SIZES or k % group_size:
        raise CheckpointError(f"W4A16 group size {group_size} with {k} input features is not supported on CUDA. "
                              f"Fix: use group size 64 or 128 dividing the input features")
    if tuple(scales.shape) != (n, k // group_size):
        raise CheckpointError(f"weights_scaling_factor has shape {tuple(scales.shape)}, expected "
                              f"{(n, k // group_size)}. Fix: re-run the quantization with `llmc build --force`")
    tiles = -(-k // TILE)
    u = torch.full((tiles * TILE, n), 8, dtype=torch.int64, device=q.device)  # pad inputs: q = 0
    u[:k] = q.t().to(torch.int64) + 8  # [Kp, N] offset binary
    chunks = u.view(tiles, 8, CHUNK, n)  # input 128 t + 16 j + i -> [t, j, i, N]
    shifts = (4 * torch.arange(8, device=q.device, dtype=torch.int64)).view(1, 8, 1, 1)
    words = (chunks << shifts).sum(dim=1)  # [t, i, N], nibble j of word (t, i); < 2^32
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # same bits, as int32
    return words.reshape(tiles * WORDS_PER_TILE, n).contiguous(), scales.t().contiguous()


MMA_COLS, MMA_INPUTS = 16, 64  # the mma layout's tile: 16 output columns x 64 inputs
# Nibble j of a lane's word: column half h = j & 1 (column g + 8 h) and input kk = 2 ((j >> 1) & 1) + (j >> 2) of
# the lane's four inputs 16 t + 4 s + kk; as an index into a trailing [h, kk] axis of 8: 4 h + kk.
_MMA_NIBBLE_SOURCE = [4 * (j & 1) + 2 * ((j >> 1) & 1) + (j >> 2) for j in range(8)]  # index into [h, kk]


def mma_supported(n: int, k: int, group_size: int) -> bool:
    """Whole mma tiles: columns a multiple of 16, inputs of 64, group size 64 or 128."""
    return n % MMA_COLS == 0 and k % MMA_INPUTS == 0 and group_size in GROUP_SIZES


def interleave_halves(rows: torch.Tensor, period: int) -> torch.Tensor:
    """Rows ``[N, ...]`` reordered in blocks of 8 within each segment of ``period`` rows: rows 8i..8i+7 of the
    segment's first half, then rows 8i..8i+7 of its second half, for each i. Each 16-column mma tile then holds
    row ``c`` of a half and the same row of the other half in its columns ``c`` and ``c + 8``, the same lane's
    results: fc and gate (:func:`interleave_tiles`), or both halves of a NeoX rotation pair with a head's size as
    the period (the qkv layer's RoPE epilogue). The kernels write the columns back in their own order."""
    n = rows.shape[0]
    assert period % 16 == 0 and n % period == 0, (n, period)
    return rows.reshape(n // period, 2, period // 16, 8, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def interleave_tiles(fc: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Rows of fc and gate ``[I, ...]`` -> ``[2I, ...]`` in blocks of 8 (fc 8i..8i+7, then gate 8i..8i+7): each
    16-column mma tile holds a feature's fc in column c and its gate in column c + 8, the same lane's results."""
    return interleave_halves(torch.cat([fc, gate]), 2 * fc.shape[0])


def pack_mma(q: torch.Tensor, scales: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 values ``q`` int8 ``[N, K]`` in [-8, 7] and ``scales`` ``[N, K/g]`` (16-bit) -> the mma kernel's
    ``(words int32 [N/16, K/64, 32, 4], scale pairs int32 [N/16, K/g, 8])`` on q's device.

    Tile (nt, kt) lane (g, t) word s holds in nibble j the value ``q + 8`` of column ``16 nt + g + 8 (j & 1)``,
    input ``64 kt + 16 t + 4 s + 2 ((j >> 1) & 1) + (j >> 2)`` (see ``csrc_cuda/w4a16_mma.cu``); scale pair
    (nt, grp, g) is ``(s[16 nt + g], s[16 nt + g + 8])`` of group grp: a column tile's scales are contiguous, like its
    weight tiles.
    """
    n, k = q.shape
    if not mma_supported(n, k, group_size):
        raise CheckpointError(f"the mma int4 layout needs columns in 16s, inputs in 64s and group size 64 or 128, "
                              f"got {n} x {k} g{group_size}. Fix: use the Triton layout (pack_for_cuda)")
    if tuple(scales.shape) != (n, k // group_size) or scales.element_size() != 2:
        raise CheckpointError(f"scales of shape {tuple(scales.shape)} {scales.dtype}, expected "
                              f"{(n, k // group_size)} 16-bit. Fix: re-run the quantization with `llmc build --force`")
    u = (q.to(torch.int64) + 8).view(n // 16, 2, 8, k // 64, 4, 4, 4)  # [nt, h, g, kt, t, s, kk]
    u = u.permute(0, 3, 2, 4, 5, 1, 6).reshape(n // 16, k // 64, 8, 4, 4, 8)  # [nt, kt, g, t, s, h*4 + kk]
    nibbles = u[..., _MMA_NIBBLE_SOURCE]  # [..., j]
    shifts = 4 * torch.arange(8, device=q.device, dtype=torch.int64)
    words = (nibbles << shifts).sum(dim=-1)  # < 2^32
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    words = words.reshape(n // 16, k // 64, 32, 4).contiguous()  # lane = 4 g + t
    pairs = scales.reshape(n // 16, 2, 8, k // group_size).permute(0, 3, 2, 1).contiguous()  # [nt, grp, g, h]
    return words, pairs.view(torch.int32).reshape(n // 16, k // group_size, 8)


def unpack_mma(words: torch.Tensor, pairs: torch.Tensor, group_size: int, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_mma` (for tests and checks): ``(q int8 [N, K], scales [N, K/g])``."""
    ntiles, ktiles = words.shape[:2]
    w = words.to(torch.int64) & 0xFFFFFFFF
    nib = torch.stack([(w >> (4 * j)) & 0xF for j in range(8)], dim=-1)  # [nt, kt, 32, 4 (s), 8 (j)]
    out = torch.empty_like(nib).view(ntiles, ktiles, 8, 4, 4, 8)  # [nt, kt, g, t, s, h*4 + kk]
    out[..., _MMA_NIBBLE_SOURCE] = nib.view(ntiles, ktiles, 8, 4, 4, 8)
    q = out.view(ntiles, ktiles, 8, 4, 4, 2, 4).permute(0, 5, 2, 1, 3, 4, 6)  # [nt, h, g, kt, t, s, kk]
    q = (q.reshape(ntiles * 16, ktiles * 64) - 8).to(torch.int8)
    scales = pairs.view(dtype).view(ntiles, -1, 8, 2).permute(0, 3, 2, 1).reshape(ntiles * 16, -1)
    return q, scales.contiguous()
