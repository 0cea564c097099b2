"""Paged decode attention as one Triton kernel (CUDA): reads K/V straight from the block-table cache.

The reference decode path (:func:`llmc.engine.torch.attention.decode_attention`) copies every sequence's
context out of the cache (padded to the longest one) before calling SDPA: a copy of the whole context per
layer per step, and shapes that change every step. This kernel walks each sequence's block table instead, so
a decode step reads each cached K/V row once and has fixed-shape inputs (``block_tables [D, max_blocks]``,
``context_lens [D]``), which is what lets a decode step be captured in a CUDA graph
(:mod:`llmc.engine.torch.cuda_graphs`).

Work split (flash-decoding): one program per (sequence, kv head, split); a split takes a contiguous share of
the sequence's blocks and keeps an online softmax for the ``group`` query heads of its kv head (padded to 16
rows for ``tl.dot``). Partial results (running max, sum and weighted values) are merged by a second, small
kernel (one program per (sequence, head); as nine torch ops per layer the merge took ~0.5 ms of a 3.3 ms
batch-1 decode step of the 8B model on an H200: 288 launches of a few microseconds).
More splits keep the GPU busy when there are few sequences (at batch 1 an 8-kv-head model has 8 programs
without splitting); small programs (2 warps, one 16-row dot per block) keep more of them resident.

Triton is imported lazily: :func:`kernel_available` is False without it (CPU builds of PyTorch) and the engine
keeps the reference path.
"""

from __future__ import annotations

import functools

import torch

from llmc.engine.torch import triton_support

MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows: a kv head's query heads are padded to this
# Splits are chosen so that a step launches about TARGET_PROGRAMS programs of NUM_WARPS warps (H200, 8B shape,
# 2,048 cached tokens, 32 layers in a CUDA graph, 2026-12-01: 256 programs of 4 warps took 9.65 / 33.66 / 138.1 us
# per layer at batch 1 / 8 / 64, 512 programs of 2 warps and 3 stages 9.31 / 23.2 / 131.3; the KV bound at 4.2
# TB/s is 2.0 / 16.0 / 127.8 us).
TARGET_PROGRAMS = 512
NUM_WARPS, NUM_STAGES = 2, 3


def kernel_available(device: torch.device | str, block_size: int, head_size: int) -> bool:
    """True when the kernel can serve this cache: CUDA, Triton importable, power-of-two block and head sizes."""
    if torch.device(device).type != "cuda" or triton_support.modules() is None:
        return False
    return _pow2(block_size) and _pow2(head_size) and head_size >= 16 and block_size >= 16


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def num_splits(num_seqs: int, num_kv_heads: int, max_blocks: int) -> int:
    """Context splits per (sequence, kv head): about TARGET_PROGRAMS programs, at most one per block."""
    return max(1, min(max_blocks, -(-TARGET_PROGRAMS // (num_seqs * num_kv_heads))))


@functools.cache
def _kernel():
    triton, tl = triton_support.modules()

    # The step's split count and block-table width change with its batch and contexts: not specialized on (Triton
    # would compile a variant per divisibility class of each, in the middle of serving, on a fresh machine).
    @triton.jit(do_not_specialize=["num_splits", "stride_tb"])
    def paged_decode(
        q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, acc_ptr, ml_ptr, scale, num_splits,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_tb,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD: tl.constexpr, BLOCK: tl.constexpr,
        PRECISION: tl.constexpr, PDL: tl.constexpr,
    ):
        if PDL:  # launched while the previous kernel runs: the merge may launch now; wait for the previous one
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        seq, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        num_kv_heads = tl.num_programs(1)
        ctx = tl.load(lens_ptr + seq)
        blocks = tl.cdiv(ctx, BLOCK)
        per_split = tl.cdiv(blocks, num_splits)
        first, last = split * per_split, tl.minimum((split + 1) * per_split, blocks)
        g, d, j = tl.arange(0, GROUP_P), tl.arange(0, HEAD), tl.arange(0, BLOCK)
        heads = kvh * GROUP + g  # [GROUP_P] query heads of this kv head (rows >= GROUP are padding)
        q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=(g < GROUP)[:, None],
                    other=0.0)  # [GROUP_P, HEAD]
        m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, HEAD], tl.float32)
        for b in range(first, last):
            block = tl.load(tables_ptr + seq * stride_tb + b).to(tl.int64)
            valid = b * BLOCK + j < ctx  # [BLOCK]
            offs = block * stride_kb + j[:, None] * stride_ks + kvh * stride_kh + d[None, :]  # [BLOCK, HEAD]
            k = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0)
            v = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0)
            s = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=PRECISION) * scale  # [GROUP_P, BLOCK] fp32
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        # Partials: acc [D, nh, S, HEAD], ml [D, nh, S, 2] (running max, running sum); padding rows not stored.
        row = (seq * num_kv_heads * GROUP + heads) * num_splits + split  # [GROUP_P]
        keep = g < GROUP
        tl.store(acc_ptr + row[:, None] * HEAD + d[None, :], acc, mask=keep[:, None])
        tl.store(ml_ptr + row * 2, m_i, mask=keep)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=keep)

    return paged_decode


@functools.cache
def _combine_kernel():
    triton, tl = triton_support.modules()

    @triton.jit(do_not_specialize=["num_splits"])
    def paged_decode_combine(acc_ptr, ml_ptr, out_ptr, num_splits, stride_ot, stride_oh,
                             HEAD: tl.constexpr, SPLITS_P: tl.constexpr, EARLY_LAUNCH: tl.constexpr,
                             PDL: tl.constexpr):
        """One program per (sequence, head): out = sum_s acc_s w_s / sum_s l_s w_s, w_s = exp(m_s - max m)."""
        if EARLY_LAUNCH:  # the int4 o projection after this may start loading its weights (it waits for out)
            tl.extra.cuda.gdc_launch_dependents()
        if PDL:  # launched while the attention kernel runs: wait for its partials
            tl.extra.cuda.gdc_wait()
        seq, head = tl.program_id(0), tl.program_id(1)
        row0 = (seq * tl.num_programs(1) + head) * num_splits
        s, d = tl.arange(0, SPLITS_P), tl.arange(0, HEAD)
        ok = s < num_splits
        m = tl.load(ml_ptr + (row0 + s) * 2, mask=ok, other=float("-inf"))
        l_sum = tl.load(ml_ptr + (row0 + s) * 2 + 1, mask=ok, other=0.0)
        w = tl.exp(m - tl.max(m, axis=0))  # empty splits (m = -inf) weigh 0; a context has >= 1 token
        acc = tl.load(acc_ptr + (row0 + s)[:, None] * HEAD + d[None, :], mask=ok[:, None], other=0.0)
        out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_sum * w, axis=0)
        tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))

    return paged_decode_combine


def combine_splits(acc: torch.Tensor, ml: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Merge the per-split partials ``acc [D, nh, S, hd]``, ``ml [D, nh, S, 2]`` (running max, running sum) of
    :func:`paged_decode_attention` into ``[D, nh, hd]`` in ``dtype`` (one Triton launch)."""
    d, nh, splits, head = acc.shape
    out = torch.empty(d, nh, head, dtype=dtype, device=acc.device)
    if d:
        _combine_kernel()[(d, nh)](acc, ml, out, splits, out.stride(0), out.stride(1), HEAD=head,
                                   SPLITS_P=max(2, _next_pow2(splits)),
                                   EARLY_LAUNCH=triton_support.early_launch(acc.device),
                                   **triton_support.pdl_kwargs(acc.device))
    return out


def combine_splits_reference(acc: torch.Tensor, ml: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`combine_splits` as torch ops (the tests' reference)."""
    m, s = ml.unbind(-1)  # [D, nh, S] each; empty splits have m = -inf and s = 0
    weight = torch.exp(m - m.amax(dim=-1, keepdim=True))  # [D, nh, S]
    out = (acc * weight[..., None]).sum(dim=2) / (s * weight).sum(dim=-1)[..., None]
    return out.to(dtype)


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, splits: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence ``q [D, nh, hd]`` over its cached context -> ``[D, nh, hd]``.

    ``k_cache, v_cache [num_blocks, block_size, nkv, hd]``; ``block_tables [D, max_blocks]`` int32 (entries
    past a sequence's blocks are never read); ``context_lens [D]`` int32, each >= 1 (this step's key is already
    in the cache). Fixed shapes and no host synchronisation, so it can be captured in a CUDA graph.
    """
    d, num_heads, head_size = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    splits = splits or num_splits(d, num_kv_heads, block_tables.shape[1])
    assert q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous(), "unexpected layout"
    acc = torch.empty(d, num_heads, splits, head_size, dtype=torch.float32, device=q.device)
    ml = torch.empty(d, num_heads, splits, 2, dtype=torch.float32, device=q.device)
    _kernel()[(d, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, acc, ml, scale, splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_P=max(MIN_DOT_ROWS, _next_pow2(group)), HEAD=head_size, BLOCK=block_size,
        PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",  # exact fp32 dots; 16-bit inputs ignore it
        num_warps=num_warps or NUM_WARPS, num_stages=num_stages or NUM_STAGES,
        **triton_support.pdl_kwargs(q.device),
    )
    return combine_splits(acc, ml, q.dtype)


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()
