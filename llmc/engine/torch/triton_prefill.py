"""Paged prefill attention as one Triton kernel (CUDA): prompt chunks over their cached context, read in place.

A chunk that continues a cached prompt (a long prompt cut by the step budget, a prompt whose prefix the cache
already holds) attends to every cached key of its sequence and causally to its own. The reference path
(:func:`llmc.engine.torch.attention.paged_attention`) first copies each such sequence's context out of the cache,
repeats its keys and values for the query groups and calls SDPA per chunk: a copy of the whole context per chunk,
layer and step, and a few launches per chunk. This kernel walks the block tables instead, all the step's chunks in
one launch.

Work split: one program per (tile, kv head); a tile is up to ``tokens`` query tokens of one chunk, and the
program takes them with all ``group`` query heads of its kv head as the rows of one matrix (``tokens x group``
rows, the heads padded to a power of two), so each key and value block is loaded once for the whole group. It
streams the keys from position 0 to its last token's position in steps of ``BLOCK_N`` with an online softmax in
float32; query ``j`` of a chunk after ``c`` cached tokens sees the keys at positions ``<= c + j``. The tiles'
table (chunk row, first packed token, first position, tokens) is built on the host from the step's metadata.
"""

from __future__ import annotations

import functools

import torch

from llmc.engine.torch import kv_store, triton_support
from llmc.engine.torch.triton_attention import kernel_available

PREFILL_KERNEL_ENV = "LLMC_PREFILL_KERNEL"  # "0": chunks over a cached context take the gather + SDPA path

# H200, 8B attention shape (32 / 8 heads of 128, blocks of 32), bf16, eager as the engine runs it, us per layer
# (scripts/bench_prefill_attention.py's cases, 2026-12-03 18:22): a 960-token chunk after 1,024 cached / four
# 256-token chunks after 1,500 / 512 after 1,536 and 488 after 600 / 2,048 after 2,048 took 100.1 / 108.4 / 105.4
# / 350.8 with this config (rows, keys per iteration, warps, stages = 128, 128, 8, 2), against 218.4 / 1,351.2 /
# 687.8 / 500.7 for the gather + SDPA path. Chosen from eight configs at 18:02 (an earlier form of the kernel); in
# the 18:22 sweep (128, 128, 8, 3) and (256, 64, 8, 2) were 3-5 % faster in sum, not yet run in the engine.
ROWS = 128  # query rows of a tile (tokens x padded group)
BLOCK_N = 128  # keys per loop iteration
WARPS, STAGES = 8, 2
LOG2E = 1.4426950408889634  # the softmax in base 2: exp(x) = exp2(x log2(e))


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def tiles_of(chunks: list[tuple[int, int, int, int]], tokens: int) -> list[tuple[int, int, int, int]]:
    """The tiles of ``chunks`` (table row, first packed token, new tokens, tokens cached before them), ``tokens``
    query tokens at most each: (table row, first packed token, position of that token, tokens of the tile)."""
    tiles = []
    for row, start, n, cached in chunks:
        for off in range(0, n, tokens):
            tiles.append((row, start + off, cached + off, min(tokens, n - off)))
    return tiles


@functools.cache
def _kernel():
    triton, tl = triton_support.modules()

    @triton.jit(do_not_specialize=["stride_tb"])
    def paged_prefill(
        q_ptr, k_ptr, v_ptr, tables_ptr, tiles_ptr, out_ptr, qk_scale, kv_scale,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_tb, stride_ot, stride_oh,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, TOKENS: tl.constexpr, HEAD: tl.constexpr,
        BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
        F16_DOTS: tl.constexpr, PDL: tl.constexpr,
    ):
        if PDL:  # launched while the previous kernel runs: the next may launch now; wait for the previous one
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        if FP8:  # the cache holds k / kv_scale and v / kv_scale: the scale goes into the logits and the output
            qk_scale = qk_scale * kv_scale
        tile, kvh = tl.program_id(0), tl.program_id(1)
        row = tl.load(tiles_ptr + tile * 4)
        q0 = tl.load(tiles_ptr + tile * 4 + 1)
        pos0 = tl.load(tiles_ptr + tile * 4 + 2)
        count = tl.load(tiles_ptr + tile * 4 + 3)
        r = tl.arange(0, TOKENS * GROUP_P)  # row r: token r // GROUP_P of the tile, head r % GROUP_P of the group
        tok, hh = r // GROUP_P, r % GROUP_P
        keep = (tok < count) & (hh < GROUP)
        head = kvh * GROUP + hh
        d = tl.arange(0, HEAD)
        q = tl.load(q_ptr + (q0 + tok)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=keep[:, None], other=0.0)  # [R, HEAD]
        if F16_DOTS:  # float16 dots over an fp8 cache (kv_store.f16_dots): q clamped to +-kv_store.F16_MAX
            q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
        q_pos = pos0 + tok  # [R]; padding rows see the tile's keys too (finite sums, never stored)
        end = pos0 + count  # keys at positions < end
        m_i = tl.full([TOKENS * GROUP_P], float("-inf"), tl.float32)
        l_i = tl.zeros([TOKENS * GROUP_P], tl.float32)
        acc = tl.zeros([TOKENS * GROUP_P, HEAD], tl.float32)
        j = tl.arange(0, BLOCK_N)
        # Two passes: the keys before the tile's first position, visible to all its rows (no masks), then the rest.
        full = (pos0 // BLOCK_N) * BLOCK_N
        for masked in tl.static_range(2):
            if masked == 0:
                lo, hi = 0, full
            else:
                lo, hi = full, end
            for start in range(lo, hi, BLOCK_N):
                k_pos = start + j  # [BLOCK_N]
                inside = k_pos < end
                if masked == 0:
                    block = tl.load(tables_ptr + row * stride_tb + k_pos // BLOCK).to(tl.int64)
                else:
                    block = tl.load(tables_ptr + row * stride_tb + k_pos // BLOCK, mask=inside, other=0).to(tl.int64)
                offs = block[:, None] * stride_kb + (k_pos % BLOCK)[:, None] * stride_ks + kvh * stride_kh + d[None, :]
                if masked == 0:
                    k = tl.load(k_ptr + offs)
                    v = tl.load(v_ptr + offs)
                else:
                    k = tl.load(k_ptr + offs, mask=inside[:, None], other=0.0)
                    v = tl.load(v_ptr + offs, mask=inside[:, None], other=0.0)
                if FP8:  # e4m3 values are exact in 16 bits (to float16: one instruction for two values)
                    k, v = k.to(q.dtype), v.to(q.dtype)
                s = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=PRECISION) * qk_scale  # [R, BLOCK_N] fp32
                if masked == 1:
                    s = tl.where((k_pos[None, :] <= q_pos[:, None]) & inside[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: key 0 is visible to every row
                alpha = tl.exp2(m_i - m_new)  # base 2: qk_scale holds log2(e)
                p = tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                m_i = m_new
        if FP8:
            acc = acc * kv_scale
        out_rows = out_ptr + (q0 + tok)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(out_rows, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=keep[:, None])

    return paged_prefill


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, chunks: list[tuple[int, int, int, int]], scale: float,
                            out: torch.Tensor, rows: int = ROWS, block_n: int = BLOCK_N, num_warps: int = WARPS,
                            num_stages: int = STAGES, kv_scale: float = 1.0) -> torch.Tensor:
    """Attention of the prompt chunks ``chunks`` (row of ``block_tables``, packed index of its first new token, its
    new tokens, tokens cached before them) of the packed queries ``q [T, nh, hd]`` over each chunk's cache, whose
    keys and values (the chunk's own included) are already written. Writes those rows of ``out [T, nh, hd]`` and
    returns it. ``k_cache, v_cache [num_blocks, block_size, nkv, hd]`` (fp8: keys and values divided by
    ``kv_scale``); ``block_tables [B, max_blocks]`` int32."""
    _, num_heads, head_size = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    group_p = _next_pow2(group)
    tokens = max(1, rows // group_p)
    table = _tile_table(tuple(chunks), tokens, q.device)
    if table is None:
        return out
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    _kernel()[(table.shape[0], num_kv_heads)](
        q, k_cache, v_cache, block_tables, table, out, scale * LOG2E, kv_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_P=group_p, TOKENS=tokens, HEAD=head_size, BLOCK=block_size, BLOCK_N=block_n,
        PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",  # exact fp32 dots; 16-bit inputs ignore it
        FP8=k_cache.dtype == torch.float8_e4m3fn, F16_DOTS=kv_store.f16_dots(k_cache.dtype, q.dtype),
        num_warps=num_warps, num_stages=num_stages,
        **triton_support.pdl_kwargs(q.device),
    )
    return out


@functools.lru_cache(maxsize=16)
def _tile_table(chunks: tuple[tuple[int, int, int, int], ...], tokens: int, device: torch.device
                ) -> torch.Tensor | None:
    """:func:`tiles_of` as an int32 ``[tiles, 4]`` tensor on ``device`` (None without tiles), built and uploaded
    once for all the layers of a step (they attend the same chunks); only ever read by the kernel."""
    tiles = tiles_of(list(chunks), tokens)
    return torch.tensor(tiles, dtype=torch.int32).to(device, non_blocking=True) if tiles else None


def prefill_kernel_enabled() -> bool:
    """The kernel takes chunks over a cached context (``LLMC_PREFILL_KERNEL`` is not ``0``; for A/B runs)."""
    return not triton_support.switched_off(PREFILL_KERNEL_ENV)


def attend_cached_chunks(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, chunks: list[tuple[int, int, int, int]], scale: float,
                         out: torch.Tensor, kv_scale: float = 1.0) -> frozenset[int]:
    """On CUDA with Triton: a step's prompt chunks that continue a cached context (as :func:`paged_prefill_attention`
    takes them; chunks without cached tokens are left out) through the kernel, into ``out``; returns their table
    rows (none elsewhere, or with ``LLMC_PREFILL_KERNEL=0``: the caller's reference path takes them)."""
    if not prefill_kernel_enabled() or not kernel_available(q.device, k_cache.shape[1], q.shape[-1]):  # CUDA only
        return frozenset()
    chunks = [chunk for chunk in chunks if chunk[3] > 0]
    paged_prefill_attention(q, k_cache, v_cache, block_tables, chunks, scale, out, kv_scale=kv_scale)
    return frozenset(chunk[0] for chunk in chunks)
