"""Triton paged decode attention (:mod:`llmc.engine.torch.triton_attention`): split counts and forms, the decode
kernel and its merges against a gathered-context softmax.

The CPU tests run the kernels under Triton's interpreter; the ``gpu`` test runs through the device tool.
"""

from __future__ import annotations

import pytest
import torch

from llmc.engine.torch.attention import decode_attention, gather_blocks
from llmc.engine.torch.triton_attention import kernel_available, num_splits
from tests.engine.torch.helpers import random_decode_batch


def test_splits_keep_the_gpu_busy_without_exceeding_the_blocks():
    from llmc.engine.torch.triton_attention import fused_merge

    assert num_splits(1, 8, 72) == 64 and not fused_merge(1, 8)  # batch 1, 8 kv heads: 512 programs, a block each
    assert num_splits(1, 8, 4) == 4  # never more splits than blocks
    assert num_splits(8, 8, 72) == 8 and fused_merge(8, 8)  # batch 8: 512 programs, merged by the last split
    assert num_splits(8, 8, 20) == 5  # fused form: at least 4 blocks of the table a split
    assert num_splits(64, 8, 72) == 1 and fused_merge(64, 8)


@pytest.mark.parametrize("splits", [None, 1, 2, 3, 8, 12])
def test_decode_kernel_under_the_interpreter_matches_the_reference(splits):
    """The decode kernel itself, run by Triton's interpreter on the CPU in float32: each split's online softmax
    over two blocks per iteration (contexts of 1-333 tokens: partial blocks, empty splits), the merge by the last
    split of each (sequence, kv head) to finish (up to 8 splits; one split writes no partials), the merge kernel
    above 8, equal the gathered-context softmax; the merging programs leave their counters at zero."""
    from llmc.engine.torch import triton_attention, triton_support

    if triton_support.modules() is None or not triton_support.interpreting():
        pytest.skip("needs Triton's CPU interpreter (TRITON_INTERPRET=1, set by the test suite's conftest)")
    q, k_cache, v_cache, meta = random_decode_batch("cpu", torch.float32)
    scale = q.shape[-1] ** -0.5
    got = triton_attention.paged_decode_attention(q, k_cache, v_cache, meta.decode_tables, meta.decode_context_lens,
                                                  scale, splits)
    k = gather_blocks(k_cache, meta.decode_tables).transpose(1, 2)
    v = gather_blocks(v_cache, meta.decode_tables).transpose(1, 2)
    d, nh, hd = q.shape
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.view(d, k.shape[1], -1, hd), k, v, attn_mask=meta.decode_mask, scale=scale).reshape(d, nh, hd)
    assert (got - ref).abs().max().item() < 1e-5
    assert not triton_attention._counters(torch.device("cpu"), 1).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3, 8])
def test_split_merge_kernel_matches_the_torch_merge(dtype, splits):
    """The Triton merge of the decode kernel's split partials (run by Triton's interpreter here; on CUDA by the
    gpu test above through paged_decode_attention) equals the torch ops it replaced, empty splits included."""
    from llmc.engine.torch import triton_support
    from llmc.engine.torch.triton_attention import combine_splits, combine_splits_reference

    if triton_support.modules() is None or not triton_support.interpreting():
        pytest.skip("needs Triton's CPU interpreter (TRITON_INTERPRET=1, set by the test suite's conftest)")
    gen = torch.Generator().manual_seed(splits)
    d, nh, hd = 3, 4, 16
    acc = torch.randn(d, nh, splits, hd, generator=gen) * 5
    m = torch.randn(d, nh, splits, generator=gen) * 3
    l_sum = torch.rand(d, nh, splits, generator=gen) * 10 + 0.5
    written = acc.clone()
    if splits > 1:  # the last split of sequence 0 and head 1 saw no tokens: it stores m = -inf, l = 0 and no acc
        m[0, 1, -1], l_sum[0, 1, -1], acc[0, 1, -1] = float("-inf"), 0.0, 0.0
        written[0, 1, -1] = float("nan")  # whatever the buffer held
    ml = torch.stack([m, l_sum], dim=-1)
    got, ref = combine_splits(written, ml, dtype), combine_splits_reference(acc, ml, dtype)
    assert got.dtype == dtype and got.shape == (d, nh, hd) and torch.isfinite(got).all()
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7  # float32 sums in another order; one bf16 rounding
    assert ((got.float() - ref.float()).abs() <= tol * ref.float().abs().clamp_min(1.0)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [None, 1, 5, 12])
def test_kernel_matches_the_reference_decode_attention(dtype, splits):
    from llmc.engine.torch.triton_attention import paged_decode_attention

    q, k_cache, v_cache, meta = random_decode_batch("cuda", dtype)
    assert kernel_available("cuda", meta.block_size, q.shape[-1])
    scale = q.shape[-1] ** -0.5
    got = paged_decode_attention(q, k_cache, v_cache, meta.decode_tables, meta.decode_context_lens, scale, splits)
    # Reference: gather + masked SDPA in float32 (the CPU path's math), on the same inputs.
    k = gather_blocks(k_cache.float(), meta.decode_tables).transpose(1, 2)
    v = gather_blocks(v_cache.float(), meta.decode_tables).transpose(1, 2)
    d, nh, hd = q.shape
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float().view(d, k.shape[1], -1, hd), k, v, attn_mask=meta.decode_mask, scale=scale).reshape(d, nh, hd)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype and got.shape == q.shape
    assert (got.float() - ref).abs().max().item() < tol
    if splits is None:  # the engine's decode path picks the kernel on CUDA, with the default splits
        assert torch.equal(decode_attention(q, k_cache, v_cache, meta, scale), got)


def test_fused_form_gives_the_same_bits_whatever_the_tables_width(monkeypatch):
    """A decode step from a CUDA graph reads block tables as wide as max_seq_len; the same step run eagerly, tables
    as wide as its longest context. In the fused form the wider tables make more splits, all past the contexts'
    ends: empty splits store nothing and the in-order merge skips them, so the output is the same bits (Triton's
    interpreter, float32; the gpu test of int4 decode steps checks graph against eager tokens on the GPU)."""
    from llmc.engine.torch import triton_attention, triton_support

    if triton_support.modules() is None or not triton_support.interpreting():
        pytest.skip("needs Triton's CPU interpreter (TRITON_INTERPRET=1, set by the test suite's conftest)")
    monkeypatch.setattr(triton_attention, "TARGET_PROGRAMS", 160)  # 5 sequences x 4 kv heads: at most 8 splits
    q, k_cache, v_cache, meta = random_decode_batch("cpu", torch.float32)
    d, nkv = q.shape[0], k_cache.shape[2]
    assert triton_attention.fused_merge(d, nkv)
    tables = meta.decode_tables
    wide = torch.cat([tables, torch.zeros(d, 64, dtype=tables.dtype)], dim=1)
    assert triton_attention.num_splits(d, nkv, tables.shape[1]) < triton_attention.num_splits(d, nkv, wide.shape[1])
    scale = q.shape[-1] ** -0.5
    exact = triton_attention.paged_decode_attention(q, k_cache, v_cache, tables, meta.decode_context_lens, scale)
    graph = triton_attention.paged_decode_attention(q, k_cache, v_cache, wide, meta.decode_context_lens, scale)
    assert torch.equal(exact, graph)


def test_the_last_split_merges_over_empty_splits_whatever_their_buffer_holds(monkeypatch):
    """The merging program loads every split's partials at once, those of empty splits (never written) included, and
    weighs them 0: NaN left in the partials buffer by an earlier launch must not reach the output (interpreter)."""
    from llmc.engine.torch import triton_attention, triton_support

    if triton_support.modules() is None or not triton_support.interpreting():
        pytest.skip("needs Triton's CPU interpreter (TRITON_INTERPRET=1, set by the test suite's conftest)")
    q, k_cache, v_cache, meta = random_decode_batch("cpu", torch.float32)
    d, scale = q.shape[0], q.shape[-1] ** -0.5
    wide = torch.cat([meta.decode_tables, torch.zeros(d, 64, dtype=meta.decode_tables.dtype)], dim=1)
    clean = triton_attention.paged_decode_attention(q, k_cache, v_cache, wide, meta.decode_context_lens, scale, 8)
    real_empty = torch.empty

    def stale(*shape, dtype=None, device=None):  # the partials buffers as an earlier launch may have left them
        out = real_empty(*shape, dtype=dtype, device=device)
        return out.fill_(float("nan")) if dtype == torch.float32 else out

    monkeypatch.setattr(triton_attention.torch, "empty", stale)
    got = triton_attention.paged_decode_attention(q, k_cache, v_cache, wide, meta.decode_context_lens, scale, 8)
    assert torch.isfinite(got).all() and torch.equal(got, clean)  # contexts of 1-333 tokens: most splits empty
