"""The warpgroup kernel of llmc/engine/torch/csrc_cuda/w4a16_mma.cu (``w4a16_wgmma_kernel``, sm_90a) checked on CPU: an
emulation of its lanes over the packed layout (:func:`llmc.engine.torch.int4_layout.pack_mma`): each thread's
16-byte loads of the activations stored as 4-byte words into the 128-byte-swizzled rows of shared memory, the B
operand read back through the matrix descriptor's addressing (K-major, 128-byte swizzle, the k-step's start 32 bytes
on), the A fragments decoded from each word as the kernel does (``q * s`` rounded to 16 bits, times AWQ's input
scale), wgmma's accumulator layout and the epilogue's row index. It must give the product over the rounded weight.
The kernel itself runs on the H200 in tests/engine/torch/test_int4_cuda_gpu.py."""

from __future__ import annotations

import pytest
import torch

from llmc.engine.torch.int4_configs import (MMA_MAX_BLOCK, heuristic_mma_config, is_wgmma, mma_configs, mma_fits,
                                            mma_smem_bytes, split_buffers, wgmma_splits)
from llmc.engine.torch.int4_cuda import Int4CudaLinear, Scratch
from llmc.engine.torch.int4_layout import pack_mma


def swizzle(addr: int) -> int:
    """The 128-byte swizzle: address bits 4-6 XOR bits 7-9 (the pattern repeats every 1,024 bytes)."""
    return addr ^ (((addr >> 7) & 7) << 4)


def layout_address(rr: int, piece: int, q: int) -> int:
    """Where the layout puts pair q (inputs 8 piece + 2q, + 1) of row rr in a stage: ``rr * 128 + ((4 h'' + q) ^
    (rr & 7)) * 16 + 4 t'`` with ``(t', h'') = (piece / 2, piece % 2)``."""
    return rr * 128 + (((4 * (piece & 1) + q) ^ (rr & 7)) << 4) + 4 * (piece >> 1)


def stage_activations(x_chunk: torch.Tensor) -> dict[int, float]:
    """Shared memory of one stage as the kernel fills it: piece f (row f / 8, inputs 8 (f % 8) .. + 7, one 16-byte
    load) is stored as four 4-byte words, pair q at :func:`layout_address`. Bytes to values (2 bytes each)."""
    smem = {}
    for f in range(8 * x_chunk.shape[0]):
        rr, piece = f >> 3, f & 7
        for q in range(4):
            at = layout_address(rr, piece, q)
            assert at not in smem and at + 2 not in smem
            first = 8 * piece + 2 * q
            smem[at], smem[at + 2] = float(x_chunk[rr, first]), float(x_chunk[rr, first + 1])
    return smem


def test_a_warps_stores_of_four_rows_hit_32_distinct_banks():
    """Each of the four 4-byte stores of a warp (lanes f = 32 w' .. 32 w' + 31: rows 4 w' .. 4 w' + 3) writes 32
    distinct banks: no bank conflicts."""
    for first_row in range(0, 64, 4):
        for q in range(4):
            banks = set()
            for lane in range(32):
                rr, piece = first_row + (lane >> 3), lane & 7
                banks.add((layout_address(rr, piece, q) // 4) % 32)
            assert len(banks) == 32, (first_row, q)


def kernel_store_address(tid: int, li: int, q: int, threads: int, xs: int, stage: int) -> int:
    """The kernel's shared address of pair q of thread tid's piece li: one base a thread (``xdst0``: pair 0, stage 0),
    bits 4-5 xor q, then the stage and li x RSTEP rows (RSTEP = threads / 8)."""
    rr0, piece = tid >> 3, tid & 7
    xdst0 = xs + rr0 * 128 + 4 * (piece >> 1) + (((4 * (piece & 1)) ^ (rr0 & 7)) << 4)
    return (xdst0 ^ (q << 4)) + stage + li * (threads // 8) * 128


def test_the_kernels_store_addresses_are_the_swizzled_layout():
    """The xor form of the kernel's store addresses (one base register a thread) lands every pair where the layout
    above puts it, for both block sizes, any 1,024-byte-aligned ring and any stage (a multiple of 128 bytes)."""
    for threads in (128, 256):
        for xs in (0, 1024, 7 * 1024):
            for stage in (0, 8 * 128, 3 * 64 * 128):
                for tid in range(threads):
                    piece = tid & 7
                    for li in range(2):
                        rr = (tid >> 3) + li * (threads // 8)
                        for q in range(4):
                            layout = layout_address(rr, piece, q)
                            assert kernel_store_address(tid, li, q, threads, xs, stage) == xs + stage + layout


def b_operand(smem: dict[int, float], s: int, rows: int) -> torch.Tensor:
    """B [16 k, rows] of k-step s as the tensor cores read it through the descriptor: element (kk, n) at
    ``start + n * 128 + 2 kk`` (8-row groups 1,024 bytes apart), start = the stage + 32 s, then swizzled."""
    out = torch.empty(16, rows, dtype=torch.float64)
    for n in range(rows):
        for kk in range(16):
            out[kk, n] = smem[swizzle(32 * s + (n // 8) * 1024 + (n % 8) * 128 + 2 * kk)]
    return out


def a_operand(words: torch.Tensor, pairs: torch.Tensor, prequant, ct: int, chunk: int, s: int, group: int,
              dtype: torch.dtype) -> torch.Tensor:
    """A [16 columns, 16 k] of column tile ct, k-step s, from its lanes' registers: register r of lane (g, t) is the
    nibble pair (r, r + 4) of word s, decoded to ``round(q * s_col)`` (then times the input scale, rounded), holding
    (row g + 8 (r & 1), k 2 t + 8 (r >> 1) + {0, 1}) as wgmma's (and mma.m16n8k16's) register A layout says."""
    out = torch.empty(16, 16, dtype=torch.float64)
    scale_pairs = pairs[ct, (64 * chunk) // group].view(dtype)  # [8 g x (col g, col g + 8)]
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        word = int(words[ct, chunk, lane, s]) & 0xFFFFFFFF
        for r in range(4):
            row = g + 8 * (r & 1)
            scale = scale_pairs[2 * g + (r & 1)]
            for e in range(2):
                q = ((word >> (4 * (r + 4 * e))) & 0xF) - 8
                value = (torch.tensor(float(q), dtype=dtype) * scale).to(dtype)
                if prequant is not None:  # inputs 16 t + 4 s + 2 (r >> 1) + e of the chunk
                    value = (value * prequant[64 * chunk + 16 * t + 4 * s + 2 * (r >> 1) + e]).to(dtype)
                out[row, 2 * t + 8 * (r >> 1) + e] = float(value)
    return out


@pytest.mark.parametrize("rows,group,with_prequant", [(8, 64, False), (16, 128, True), (24, 128, False)])
def test_wgmma_kernel_emulation_equals_the_product_over_the_rounded_weight(rows, group, with_prequant):
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(rows)
    n, k = 32, 128
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.001).to(dtype)
    prequant = (torch.rand(k, generator=gen) + 0.5).to(dtype) if with_prequant else None
    x = torch.randn(rows, k, generator=gen).to(dtype)
    words, pairs = pack_mma(q, scales, group)

    y = torch.zeros(rows, n, dtype=torch.float64)
    for ct in range(n // 16):  # one warp's column tile
        d = torch.zeros(16, rows, dtype=torch.float64)  # the warp's rows of wgmma's accumulator
        for chunk in range(k // 64):
            smem = stage_activations(x[:, 64 * chunk: 64 * chunk + 64])
            for s in range(4):
                d += a_operand(words, pairs, prequant, ct, chunk, s, group, dtype) @ b_operand(smem, s, rows)
        # accumulator element (row g (+ 8), col 8 jj + 2 t + e) is the lane's acc[4 jj + e] (+ 2): the epilogue
        # writes it to activation row 8 jj + 2 t + e, weight column 16 ct + g (+ 8)
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for jj in range(rows // 8):
                for e in range(2):
                    r = 8 * jj + 2 * t + e
                    y[r, 16 * ct + g] = d[g, 8 * jj + 2 * t + e]
                    y[r, 16 * ct + g + 8] = d[g + 8, 8 * jj + 2 * t + e]

    weight = (q.double() * scales.double().repeat_interleave(group, dim=1)).to(dtype)  # round(q s)
    if prequant is not None:
        weight = (weight * prequant).to(dtype)
    expected = x.double() @ weight.double().T
    torch.testing.assert_close(y, expected, rtol=1e-9, atol=1e-9)


def test_the_warpgroup_configs_are_those_the_library_instantiates():
    """Negative stages select the warpgroup kernel: 3, 4 or 6 stages (4 only from 128 rows a block), (column tiles,
    warps) in {(4, 4), (8, 4), (8, 8), (16, 8)}, at most 256 rows x A tiles a warpgroup (the library returns -1 for
    the others); its shared memory is 1 KB of alignment plus, per stage, 128 bytes a row and 20 bytes a thread's A
    tile, plus the input scale. Split-K: -24, -44, -84 for 2, 4, 8 splits of 4 stages, 64 rows a block."""
    configs = {c for c in mma_configs() if is_wgmma(c)}
    blocks = ((4, 4), (8, 4), (8, 8), (16, 8))
    expected = {(mt, nt, w, s) for mt in (1, 2, 4, 8) for nt, w in blocks for s in (-3, -4, -6)}
    expected |= {(16, nt, w, -4) for nt, w in blocks} | {(32, 4, 4, -4), (32, 8, 8, -4)}
    split = {(8, nt, w, s) for nt, w in blocks for s in (-24, -44, -84)}
    assert configs == expected | split
    assert {wgmma_splits(c) for c in split} == {(2, 4), (4, 4), (8, 4)}
    assert {wgmma_splits(c) for c in expected} == {(1, 3), (1, 4), (1, 6)}
    assert mma_smem_bytes((8, 8, 8, -84)) == mma_smem_bytes((8, 8, 8, -4))
    assert mma_smem_bytes((8, 16, 8, -6)) == 1024 + 6 * (64 * 128 + 256 * 2 * 20)
    assert mma_smem_bytes((32, 8, 8, -4), k=14336, prequant=True) == 1024 + 4 * (256 * 128 + 256 * 20) + 2 * 14336
    assert all(mma_smem_bytes(c, 14336, True) <= MMA_MAX_BLOCK for c in configs)


def test_split_k_buffers_hold_every_blocks_sums_and_one_counter_per_tile():
    """What the library checks before a split-K launch (``launch_wgmma_t``): ``tiles x splits x R x 64 x WG x NA``
    floats (every block's accumulators) and ``tiles`` counters, tiles = row blocks x column blocks; nothing for
    configs that do not split. A layer reserves them for its tuned split configs in the shared scratch."""
    assert split_buffers((8, 8, 8, -4), 64, 4096) == (0, 0) and split_buffers((1, 4, 4, 2), 64, 4096) == (0, 0)
    # 64 rows, 128 columns a block (2 warpgroups of one A tile), 4 splits: 1 x 32 tiles
    assert split_buffers((8, 8, 8, -44), 64, 4096) == (4 * 64 * 4096, 32)
    # 65 rows: two row blocks of 64, their sums padded to whole blocks
    assert split_buffers((8, 8, 8, -84), 65, 4096) == (8 * 128 * 4096, 64)
    for mt, nt, w, s in [c for c in mma_configs() if is_wgmma(c) and wgmma_splits(c)[0] > 1]:
        splits, r, wg, na = wgmma_splits((mt, nt, w, s))[0], 8 * mt, w // 4, nt // w
        tiles = -(-100 // r) * (4096 // (64 * wg * na))
        assert split_buffers((mt, nt, w, s), 100, 4096) == (tiles * splits * r * 64 * wg * na, tiles)
    words = torch.zeros(4096 // 16, 14336 // 64, 32, 4, dtype=torch.int32)
    scales = torch.zeros(4096 // 16, 14336 // 128, 8, dtype=torch.int32)
    scratch = Scratch(torch.bfloat16, torch.device("cpu"))
    table = {"mma": {"buckets": [[16, 2, 2, 8, 4], [64, 8, 8, 8, -84], [128, 8, 4, 4, -24]], "dense_from_m": 96}}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("llmc.engine.torch.int4_cuda.tuned_entry", lambda *args: table)
        Int4CudaLinear(words, scales, None, 14336, 128, scratch, backend="mma")
    # the 128 bucket runs up to dense_from_m - 1 = 95 rows: 2 row blocks of 64, 64 columns a block, 2 splits
    assert scratch.sizes["partials"] == max(8 * 64 * 4096, 2 * 128 * 4096)
    assert scratch.sizes["counters"] == max(4096 // 128, 2 * 4096 // 64)


def split_shares(chunks: int, splits: int) -> list[range]:
    """The kernel's chunks of each split (blockIdx.z): ``share = ceil(chunks / splits)``, ``[min(chunks, z share),
    min(chunks, begin + share))``."""
    share = -(-chunks // splits)
    return [range(min(chunks, z * share), min(chunks, min(chunks, z * share) + share)) for z in range(splits)]


@pytest.mark.parametrize("chunks", [9, 24, 64, 224])
@pytest.mark.parametrize("splits", [2, 4, 8])
def test_split_shares_cover_every_chunk_once_in_order(chunks, splits):
    shares = split_shares(chunks, splits)
    assert [i for share in shares for i in share] == list(range(chunks))
    if chunks == 9 and splits == 8:  # SmolLM2's o and qkv: splits with no chunk (they still count themselves)
        assert [len(s) for s in shares] == [2, 2, 2, 2, 1, 0, 0, 0]


def test_a_tuned_warpgroup_config_is_taken_only_on_sm90():
    words = torch.zeros(28672 // 16, 4096 // 64, 32, 4, dtype=torch.int32)
    scales = torch.zeros(28672 // 16, 4096 // 128, 8, dtype=torch.int32)
    layer = Int4CudaLinear(words, scales, None, 4096, 128, Scratch(torch.bfloat16, torch.device("cpu")),
                           silu_output=True, backend="mma")
    layer._mma_buckets = [(64, (8, 8, 8, -4))]
    assert not layer._sm90 and layer.mma_config_for(64) == heuristic_mma_config(64, 28672, 4096)
    layer._sm90, layer._mma_chosen = True, {}
    assert layer.mma_config_for(64) == (8, 8, 8, -4)
    assert not mma_fits((8, 8, 8, -4), 4096 + 64, 4096, False)  # 260 column tiles: not whole blocks of 8
