"""Paged decode attention as one Triton kernel (CUDA): reads K/V straight from the block-table cache.

The reference decode path (:func:`llmc.engine.torch.attention.decode_attention`) copies every sequence's
context out of the cache (padded to the longest one) before calling SDPA: a copy of the whole context per
layer per step, and shapes that change every step. This kernel walks each sequence's block table instead, so
a decode step reads each cached K/V row once and has fixed-shape inputs (``block_tables [D, max_blocks]``,
``context_lens [D]``), which is what lets a decode step be captured in a CUDA graph
(:mod:`llmc.engine.torch.cuda_graphs`).

Work split (flash-decoding): one program per (sequence, kv head, split); a split takes a contiguous share of
the sequence's blocks and keeps an online softmax for the ``group`` query heads of its kv head (padded to 16
rows for ``tl.dot``). Splits keep the GPU busy when there are few sequences (at batch 1 an 8-kv-head model has
8 programs without splitting): a step launches about TARGET_PROGRAMS programs. Two forms, chosen by the number
of sequences and kv heads alone (so a decode step from a CUDA graph, whose block tables span max_seq_len, and
the same step run eagerly split every context alike and give the same bits):

- few sequences (more than MAX_FUSED_SPLITS splits each): a split per block, and a second small kernel merges
  the splits' partial results (one program per (sequence, head); as nine torch ops per layer the merge took
  ~0.5 ms of a 3.3 ms batch-1 decode step of the 8B model on an H200);
- more sequences (at most MAX_FUSED_SPLITS splits): at least MIN_BLOCKS_PER_SPLIT blocks a split, two blocks
  per loop iteration, and the last split of a (sequence, kv head) to finish (an atomic counter) merges the
  partials itself, all splits' in one load and a sum in a fixed order (one split writes no partials at all). Splits
  past a short context are empty: they store no partial sums and the merges weigh them 0, so their number does not
  change the result.

Triton is imported lazily: :func:`kernel_available` is False without it (CPU builds of PyTorch) and the engine
keeps the reference path.
"""

from __future__ import annotations

import functools

import torch

from llmc.engine.torch import kv_store, triton_support

MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows: a kv head's query heads are padded to this
# H200, 8B shape (32 q / 8 kv heads of 128), 2,048 cached tokens in blocks of 32, 32 layers' caches in a CUDA
# graph, programmatic launch, us per layer at batch 1 / 8 / 64 (KV bound at 4.29 TB/s: 1.96 / 15.6 / 125.1), the
# split form everywhere (the code before 2026-12-03) vs the fused form at 8 and 64, same data, three runs:
# 9.31-9.41 / 25.96-26.27 / 137.1-139.4 vs 23.40-25.30 / 124.1-127.2. The fused form at batch 1 (8.8-8.9 us at
# 16 splits) needs the split count of the context, which a CUDA graph's tables do not give: from the tables'
# width (72-128 blocks) it took 9.9-10.9 us, so batch 1 keeps the split form. Sweep behind the forms: 1-4
# blocks per iteration, 1-64 splits, 2-4 warps, 2-4 stages, merging in the last program or in the merge kernel.
# 2026-12-04, decode steps of the 8B int4 twin (scripts/decode_steps.py --profile, what attention adds to a step):
# the last program loading every split's partials at once instead of one split after the other took batch 8 from
# 0.856-0.857 to 0.769-0.777 ms a step (26.8 -> 24.0-24.3 us a layer; the step's GPU time -3.1 to -3.2 %) and 16
# from 1.29-1.32 to 1.26-1.29. With that merge, the fused form at batch 1 and 4 (16 splits of >= 4 blocks) was
# still slower than the split form: 0.421 vs 0.338 ms (attention + merge kernel) at 1, 0.546 vs 0.525 at 4.
TARGET_PROGRAMS = 512
MAX_FUSED_SPLITS = 8  # the fused form up to this many splits (a power of two; merging 16 in one program was slower)
MIN_BLOCKS_PER_SPLIT = 4  # fused form: a split's least blocks, of the table's width and of the context found
# (blocks per loop iteration, least blocks a split, warps, stages) of each form
SPLIT_FORM, FUSED_FORM = (1, 1, 2, 3), (2, MIN_BLOCKS_PER_SPLIT, 2, 2)
_COUNTERS: dict = {}  # device -> int32 zeros, one counter per (sequence, kv head); each merging program resets its own


def kernel_available(device: torch.device | str, block_size: int, head_size: int) -> bool:
    """True when the kernel can serve this cache: CUDA, Triton importable, power-of-two block and head sizes."""
    if torch.device(device).type != "cuda" or triton_support.modules() is None:
        return False
    return _pow2(block_size) and _pow2(head_size) and head_size >= 16 and block_size >= 16


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def num_splits(num_seqs: int, num_kv_heads: int, max_blocks: int) -> int:
    """Context splits per (sequence, kv head) for block tables of width ``max_blocks``: about TARGET_PROGRAMS
    programs; at most one per block in the split form, one per MIN_BLOCKS_PER_SPLIT blocks in the fused form
    (:func:`fused_merge`)."""
    per = MIN_BLOCKS_PER_SPLIT if fused_merge(num_seqs, num_kv_heads) else 1
    return max(1, min(-(-max_blocks // per), _split_cap(num_seqs, num_kv_heads)))


def fused_merge(num_seqs: int, num_kv_heads: int) -> bool:
    """Whether the attention kernel merges its splits itself (the fused form): at most MAX_FUSED_SPLITS splits,
    i.e. at least TARGET_PROGRAMS / MAX_FUSED_SPLITS (sequence, kv head) pairs."""
    return _split_cap(num_seqs, num_kv_heads) <= MAX_FUSED_SPLITS


def _split_cap(num_seqs: int, num_kv_heads: int) -> int:
    """Splits per (sequence, kv head) that make about TARGET_PROGRAMS programs."""
    return -(-TARGET_PROGRAMS // (num_seqs * num_kv_heads))


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` zeroed int32 counters on ``device`` (kept for the process: CUDA graphs hold their address)."""
    key = (device.type, device.index)
    have = _COUNTERS.get(key)
    if have is None or have[-1].numel() < n:
        have = (*(have or ()), torch.zeros(max(n, 4096), dtype=torch.int32, device=device))
        _COUNTERS[key] = have
    return have[-1]


@functools.cache
def _kernel():
    triton, tl = triton_support.modules()

    # The step's split count and block-table width change with its batch and contexts: not specialized on (Triton
    # would compile a variant per divisibility class of each, in the middle of serving, on a fresh machine).
    @triton.jit(do_not_specialize=["num_splits", "stride_tb"])
    def paged_decode(
        q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, acc_ptr, ml_ptr, cnt_ptr, out_ptr, scale, kv_scale, num_splits,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_tb, stride_ot, stride_oh,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, GROUP_R: tl.constexpr, HEAD: tl.constexpr, BLOCK: tl.constexpr,
        PER_ITER: tl.constexpr, MIN_PER_SPLIT: tl.constexpr, FUSED: tl.constexpr, SPLITS_P: tl.constexpr,
        PRECISION: tl.constexpr, FP8: tl.constexpr, F16_DOTS: tl.constexpr, PDL: tl.constexpr,
    ):
        if PDL:  # launched while the previous kernel runs: the next may launch now; wait for the previous one
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        if FP8:  # the cache holds k / kv_scale and v / kv_scale: the scale goes into the logits and the output
            scale = scale * kv_scale
        seq, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        num_kv_heads = tl.num_programs(1)
        ctx = tl.load(lens_ptr + seq)
        blocks = tl.cdiv(ctx, BLOCK)
        per_split = tl.maximum(tl.cdiv(blocks, num_splits), MIN_PER_SPLIT)
        first, last = split * per_split, tl.minimum((split + 1) * per_split, blocks)
        g, d = tl.arange(0, GROUP_P), tl.arange(0, HEAD)
        j = tl.arange(0, PER_ITER * BLOCK)  # PER_ITER blocks' tokens
        jb, jt = j // BLOCK, j % BLOCK
        heads = kvh * GROUP + g  # [GROUP_P] query heads of this kv head (rows >= GROUP are padding)
        keep = g < GROUP
        q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=keep[:, None],
                    other=0.0)  # [GROUP_P, HEAD]
        if F16_DOTS:  # float16 dots over an fp8 cache (kv_store.f16_dots): q clamped to +-kv_store.F16_MAX
            q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
        m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, HEAD], tl.float32)
        for b in range(first, last, PER_ITER):
            bi = b + jb  # [PER_ITER * BLOCK] block of each token
            real = bi < last
            block = tl.load(tables_ptr + seq * stride_tb + bi, mask=real, other=0).to(tl.int64)
            valid = real & (bi * BLOCK + jt < ctx)
            offs = block[:, None] * stride_kb + jt[:, None] * stride_ks + kvh * stride_kh + d[None, :]
            k = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0)
            v = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0)
            if FP8:  # e4m3 values are exact in 16 bits (to float16: one instruction for two values)
                k, v = k.to(q.dtype), v.to(q.dtype)
            s = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=PRECISION) * scale  # [GROUP_P, tokens] fp32
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        if FP8:
            acc = acc * kv_scale
        if FUSED and num_splits == 1:  # the whole context in this program: no partials
            out_rows = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :]
            tl.store(out_rows, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=keep[:, None])
        else:
            # Partials: acc [D, nh, S, HEAD], ml [D, nh, S, 2] (running max, running sum); padding rows not stored.
            base = (seq * num_kv_heads * GROUP + heads) * num_splits  # [GROUP_P]
            row = base + split
            # An empty split (a context shorter than the splits' minimum blocks) stores its m = -inf only: its acc
            # is not written (the merges weigh a split whose m is -inf 0, whatever its acc holds).
            written = keep & (g * 0 + first < last)  # [GROUP_P]
            tl.store(acc_ptr + row[:, None] * HEAD + d[None, :], acc, mask=written[:, None])
            tl.store(ml_ptr + row * 2, m_i, mask=keep)
            tl.store(ml_ptr + row * 2 + 1, l_i, mask=keep)
            if FUSED:
                counter = cnt_ptr + seq * num_kv_heads + kvh
                arrived = tl.atomic_add(counter, 1, sem="acq_rel")  # release: this program's partials first
                if arrived == num_splits - 1:  # the last split to finish merges all of them, at once
                    # Every split's partials in one round trip ([splits x heads] rows; an empty split's acc is
                    # whatever the buffer held, weighed 0), then each head's sum over the splits in a fixed tree of
                    # SPLITS_P terms (empty splits add exact zeros: the same bits whatever the tables' width).
                    r = tl.arange(0, SPLITS_P * GROUP_R)
                    sp, gr = r // GROUP_R, r % GROUP_R
                    ok = (sp < num_splits) & (gr < GROUP)
                    rows = (seq * num_kv_heads * GROUP + kvh * GROUP + gr) * num_splits + sp
                    m_s = tl.load(ml_ptr + rows * 2, mask=ok, other=float("-inf"), cache_modifier=".cg")
                    l_s = tl.load(ml_ptr + rows * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
                    a_s = tl.load(acc_ptr + rows[:, None] * HEAD + d[None, :], mask=ok[:, None], other=0.0,
                                  cache_modifier=".cg")
                    m_s, l_s = tl.reshape(m_s, [SPLITS_P, GROUP_R]), tl.reshape(l_s, [SPLITS_P, GROUP_R])
                    seen = m_s > float("-inf")  # padding heads and empty splits: none
                    w = tl.where(seen, tl.exp(m_s - tl.max(m_s, axis=0)[None, :]), 0.0)
                    a_s = tl.where(seen[:, :, None], tl.reshape(a_s, [SPLITS_P, GROUP_R, HEAD]), 0.0)
                    a_all = tl.sum(a_s * w[:, :, None], axis=0)  # [GROUP_R, HEAD]
                    l_all = tl.sum(l_s * w, axis=0)
                    gh = tl.arange(0, GROUP_R)
                    kept = gh < GROUP
                    l_all = tl.where(kept, l_all, 1.0)
                    out_rows = out_ptr + seq * stride_ot + (kvh * GROUP + gh)[:, None] * stride_oh + d[None, :]
                    tl.store(out_rows, (a_all / l_all[:, None]).to(out_ptr.dtype.element_ty), mask=kept[:, None])
                    tl.atomic_xchg(counter, 0)  # ready for the next launch (stream order: none is running)

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
        seen = ok & (m > float("-inf"))  # empty splits store no acc
        acc = tl.load(acc_ptr + (row0 + s)[:, None] * HEAD + d[None, :], mask=seen[:, None], other=0.0)
        out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_sum * w, axis=0)
        tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))

    return paged_decode_combine


def combine_splits(acc: torch.Tensor, ml: torch.Tensor, dtype: torch.dtype,
                   out: torch.Tensor | None = None, most_splits: int = 0) -> torch.Tensor:
    """Merge the per-split partials ``acc [D, nh, S, hd]``, ``ml [D, nh, S, 2]`` (running max, running sum) of
    :func:`paged_decode_attention` into ``[D, nh, hd]`` in ``dtype`` (one Triton launch), into ``out`` if given.
    ``most_splits``: the most splits calls like this one can have; the kernel is compiled per power of two at
    least that (and ``S``), so a call with fewer splits reuses it instead of compiling while serving."""
    d, nh, splits, head = acc.shape
    out = torch.empty(d, nh, head, dtype=dtype, device=acc.device) if out is None else out
    if d:
        _combine_kernel()[(d, nh)](acc, ml, out, splits, out.stride(0), out.stride(1), HEAD=head,
                                   SPLITS_P=max(2, _next_pow2(max(splits, most_splits))),
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
    num_stages: int | None = None, kv_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of one query per sequence ``q [D, nh, hd]`` over its cached context -> ``[D, nh, hd]``.

    ``k_cache, v_cache [num_blocks, block_size, nkv, hd]``; ``block_tables [D, max_blocks]`` int32 (entries
    past a sequence's blocks are never read); ``context_lens [D]`` int32, each >= 1 (this step's key is already
    in the cache). Fixed shapes and no host synchronisation, so it can be captured in a CUDA graph. An fp8 cache
    (``torch.float8_e4m3fn``) holds keys and values divided by ``kv_scale``.
    """
    d, num_heads, head_size = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    if splits is None:
        splits, fused = num_splits(d, num_kv_heads, block_tables.shape[1]), fused_merge(d, num_kv_heads)
    else:  # a given split count (tests, sweeps) picks the form by itself
        fused = splits <= MAX_FUSED_SPLITS
    per_iter, min_per_split, warps, stages = FUSED_FORM if fused else SPLIT_FORM
    assert q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous(), "unexpected layout"
    out = torch.empty(d, num_heads, head_size, dtype=q.dtype, device=q.device)
    if not d:
        return out
    partials = 1 if fused and splits == 1 else d * num_heads * splits  # one split writes no partials
    acc = torch.empty(partials, head_size, dtype=torch.float32, device=q.device)
    ml = torch.empty(partials, 2, dtype=torch.float32, device=q.device)
    counters = _counters(q.device, d * num_kv_heads)
    _kernel()[(d, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, acc, ml, counters, out, scale, kv_scale, splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_P=max(MIN_DOT_ROWS, _next_pow2(group)), GROUP_R=_next_pow2(group), HEAD=head_size,
        BLOCK=block_size, PER_ITER=per_iter, MIN_PER_SPLIT=min_per_split, FUSED=fused, SPLITS_P=MAX_FUSED_SPLITS,
        PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",  # exact fp32 dots; 16-bit inputs ignore it
        FP8=k_cache.dtype == torch.float8_e4m3fn, F16_DOTS=kv_store.f16_dots(k_cache.dtype, q.dtype),
        num_warps=num_warps or warps, num_stages=num_stages or stages,
        **triton_support.pdl_kwargs(q.device),
    )
    if fused:
        return out
    # The merge kernel's padded split count follows the batch alone, not the tables' width: eager steps (prompt
    # chunks over short contexts: narrow tables, few splits) then reuse what the CUDA graphs compiled at capture.
    return combine_splits(acc.view(d, num_heads, splits, head_size), ml.view(d, num_heads, splits, 2), q.dtype, out,
                          most_splits=_split_cap(d, num_kv_heads))


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()
