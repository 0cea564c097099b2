"""Paged-attention metadata and the reference paged attention against dense causal attention."""

from __future__ import annotations

import pytest
import torch

from llmc.engine.torch.attention import build_attention_metadata, paged_attention
from llmc.engine.types import ScheduledSequence
from llmc.request.params import SamplingParams

P = SamplingParams(temperature=0.0)


def seq(rid, n_new, computed, blocks, sample=True):
    return ScheduledSequence(rid, tuple(range(100, 100 + n_new)), computed, tuple(blocks), sample, P)


def test_metadata_packs_sequences_without_padding():
    seqs = [seq("a", 3, 0, [5]), seq("b", 1, 6, [2, 7]), seq("c", 2, 3, [9, 1], sample=False)]
    meta = build_attention_metadata(seqs, block_size=4, device="cpu")
    assert meta.cu_seqlens_q.tolist() == [0, 3, 4, 6]
    assert meta.context_lens.tolist() == [3, 7, 5]
    assert meta.positions.tolist() == [0, 1, 2, 6, 3, 4]
    assert meta.token_seqs.tolist() == [0, 0, 0, 1, 2, 2]
    # slot = block_id * block_size + offset: b's position 6 is block 7 offset 2; c's 3, 4 are 9:3 and 1:0.
    assert meta.slot_mapping.tolist() == [20, 21, 22, 30, 39, 4]
    assert meta.block_tables.tolist() == [[5, 0], [2, 7], [9, 1]]
    assert meta.logits_indices.tolist() == [2, 3]  # c is a non-final prefill chunk: not sampled
    assert meta.decode_seqs.tolist() == [1] and meta.decode_tokens.tolist() == [3]
    assert meta.prefill_seqs == (0, 2)
    assert (meta.max_query_len, meta.max_context_len, meta.max_decode_context_len) == (3, 7, 7)
    assert meta.cu_seqlens_q.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64
    # The decode batch (b only): its table cut to its blocks, a key mask over them, a mixed step.
    assert meta.decode_tables.tolist() == [[2, 7]] and not meta.all_decode
    assert meta.decode_mask.shape == (1, 1, 1, 8) and meta.decode_mask.flatten().tolist() == [True] * 7 + [False]


def test_metadata_of_a_pure_decode_step():
    seqs = [seq("a", 1, 2, [5, 6]), seq("b", 1, 6, [2, 7])]
    meta = build_attention_metadata(seqs, block_size=4, device="cpu")
    assert meta.all_decode and meta.decode_tables.tolist() == [[5, 6], [2, 7]]
    assert meta.decode_mask[:, 0, 0].tolist() == [[True] * 3 + [False] * 5, [True] * 7 + [False]]
    prefill_only = build_attention_metadata([seq("c", 3, 0, [1])], block_size=4, device="cpu")
    assert not prefill_only.all_decode and prefill_only.decode_tables.shape == (0, 0)


def test_metadata_asserts_the_schedulers_guarantees():
    with pytest.raises(AssertionError, match="need 2 blocks of 4, the scheduler gave 1"):
        build_attention_metadata([seq("a", 5, 0, [1])], block_size=4, device="cpu")
    with pytest.raises(AssertionError, match="no new tokens"):
        build_attention_metadata([seq("a", 0, 0, [1])], block_size=4, device="cpu")


def dense_causal(q, k, v, scale):
    """Plain causal attention of one whole sequence: q [n, nh, hd], k/v [n, nkv, hd]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    n = q.shape[0]
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_paged_attention_equals_dense_attention_over_chunks():
    torch.manual_seed(0)
    nh, nkv, hd, bs = 6, 2, 8, 4
    lens = {"a": 11, "b": 6, "c": 9}
    full = {rid: (torch.randn(n, nh, hd), torch.randn(n, nkv, hd), torch.randn(n, nkv, hd)) for rid, n in lens.items()}
    k_cache, v_cache = torch.zeros(16, bs, nkv, hd), torch.zeros(16, bs, nkv, hd)
    blocks = {"a": [3, 11, 0], "b": [7, 2], "c": [15, 4, 9]}
    # Three steps: prefill chunks and decodes mixed; every query's output is compared with the dense result.
    steps = [{"a": (0, 5), "b": (0, 6)}, {"a": (5, 10), "b": None, "c": (0, 8)}, {"a": (10, 11), "c": (8, 9)}]
    got = {rid: torch.empty(n, nh, hd) for rid, n in lens.items()}
    for step in steps:
        step = {rid: r for rid, r in step.items() if r}
        seqs = [seq(rid, b - a, a, blocks[rid]) for rid, (a, b) in step.items()]
        meta = build_attention_metadata(seqs, bs, "cpu")
        q, k, v = (torch.cat([full[rid][i][a:b] for rid, (a, b) in step.items()]) for i in range(3))
        out = paged_attention(q, k, v, k_cache, v_cache, meta, scale=hd**-0.5)
        for (rid, (a, b)), start in zip(step.items(), meta.query_starts):
            got[rid][a:b] = out[start : start + b - a]
    for rid, (q, k, v) in full.items():
        torch.testing.assert_close(got[rid], dense_causal(q, k, v, hd**-0.5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_seqs", [1, 5])
def test_gather_blocks_returns_the_listed_blocks_in_order(num_seqs):
    from llmc.engine.torch.attention import gather_blocks

    cache = torch.randn(9, 4, 2, 8)  # [num_blocks, block_size, nkv, hd]
    tables = torch.randint(0, 9, (num_seqs, 3), generator=torch.Generator().manual_seed(num_seqs)).to(torch.int32)
    got = gather_blocks(cache, tables)  # [D, 3 * 4, 2, 8]
    assert got.shape == (num_seqs, 12, 2, 8)
    for d in range(num_seqs):
        for j, block in enumerate(tables[d].tolist()):
            assert torch.equal(got[d, 4 * j:4 * (j + 1)], cache[block])


@pytest.mark.parametrize("n,ctx,nh,nkv", [(5, 37, 8, 2), (64, 64, 4, 4), (1, 10, 6, 3), (100, 700, 8, 2)])
def test_lower_right_causal_chunk_equals_the_masked_path(n, ctx, nh, nkv):
    # The CUDA path for a prefill chunk over a cached context (no mask tensor) against the explicit boolean mask
    # the CPU path builds; on CPU SDPA's math backend computes both.
    from llmc.engine.torch.attention import _prefill_attention, chunk_attention_lower_right

    gen = torch.Generator().manual_seed(n + ctx)
    q, k, v = (torch.randn(length, heads, 64, generator=gen) for length, heads in ((n, nh), (ctx, nkv), (ctx, nkv)))
    masked = _prefill_attention(q, k, v, ctx - n, 0.125)  # q on CPU: the boolean-mask path
    lower_right = chunk_attention_lower_right(q, k.transpose(0, 1), v.transpose(0, 1), 0.125)
    torch.testing.assert_close(lower_right, masked, rtol=1e-5, atol=1e-5)
    # and not merely equal to attention over everything: the last query's row is unmasked, the first is not
    if ctx > n > 1:
        full = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1).repeat_interleave(nh // nkv, 0)[None],
            v.transpose(0, 1).repeat_interleave(nh // nkv, 0)[None], scale=0.125)[0].transpose(0, 1)
        torch.testing.assert_close(lower_right[-1], full[-1], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(lower_right[0], full[0], atol=1e-3)


def test_decode_kernels_are_not_specialized_on_values_that_change_every_step(monkeypatch):
    """On a GPU Triton compiles a variant of a kernel per divisibility class of each integer argument. The split
    count and the block-table width change with a step's batch and contexts, so a fresh machine would compile
    variants in the middle of serving (measured on the H200: one kernel compiled during a concurrency-8 run, its
    TGS 12.5 % below the same run with a warm cache). They are left unspecialized: CUDA-graph capture at load
    compiles every variant a step can need."""
    from llmc.engine.torch import triton_attention, triton_support

    # Triton's own jit helpers (tl.cdiv, ...) take the interpreter switch when Triton is first imported: import it
    # under the tests' setting first, or the interpreted kernels of later tests call compiled helpers and fail.
    triton_support.modules()
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the real JIT functions (the CPU tests interpret them)
    triton_attention._kernel.cache_clear()
    triton_attention._combine_kernel.cache_clear()
    try:
        kernels = {"decode": triton_attention._kernel(), "combine": triton_attention._combine_kernel()}
        unspecialized = {name: {p.name for p in k.params if p.do_not_specialize} for name, k in kernels.items()}
    finally:
        triton_attention._kernel.cache_clear()
        triton_attention._combine_kernel.cache_clear()
    assert unspecialized == {"decode": {"num_splits", "stride_tb"}, "combine": {"num_splits"}}


def test_the_merge_kernels_padded_split_count_follows_the_batch_not_the_tables_width(monkeypatch):
    """``SPLITS_P`` is a compile-time constant of the merge kernel. Eager steps (prompt chunks over short contexts)
    have narrow block tables and so few splits; were it the split count's power of two, each narrow width would
    compile a variant while serving (measured on the H200, 2026-12-03: the first repetition of a concurrency-8
    run of 48-token prompts, its TTFT p50 65 ms and p95 202 ms). It follows the batch alone: the variants the
    CUDA graphs compiled at capture, at every width. Run by Triton's interpreter, the merged output unchanged."""
    from llmc.engine.torch import triton_attention, triton_support

    if triton_support.modules() is None or not triton_support.interpreting():
        pytest.skip("needs Triton's CPU interpreter (TRITON_INTERPRET=1, set by the test suite's conftest)")
    kernel = triton_attention._combine_kernel()
    seen = []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(kwargs["SPLITS_P"])
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(triton_attention, "_combine_kernel", Recorder)
    gen = torch.Generator().manual_seed(0)
    block_size, nkv, group, hd, d = 16, 4, 2, 32, 3
    k_cache = torch.randn(40, block_size, nkv, hd, generator=gen)
    v_cache = torch.randn(40, block_size, nkv, hd, generator=gen)
    q = torch.randn(d, nkv * group, hd, generator=gen)
    outs = []
    for width in (2, 5, 9):  # 2, 5 and 9 splits: one per block of the table
        tables = torch.arange(d * width, dtype=torch.int32).view(d, width) % 40
        lens = torch.full((d,), width * block_size - 3, dtype=torch.int32)
        outs.append(triton_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, hd ** -0.5))
        ref = triton_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, hd ** -0.5, splits=1)
        torch.testing.assert_close(outs[-1], ref, rtol=1e-5, atol=1e-5)  # one split: no merge at all
    cap = triton_attention._split_cap(d, nkv)
    assert cap > 9 and seen == [triton_attention._next_pow2(cap)] * 3


@pytest.mark.parametrize("n", [1, 5, 64, 100])
@pytest.mark.parametrize("cudnn_before", [True, False])
def test_fresh_prompt_attention_padded_to_a_bucket_equals_plain_causal_attention(n, cudnn_before, monkeypatch):
    from llmc.engine.torch import attention

    torch.manual_seed(n)
    nh, nkv, hd = 6, 2, 16
    q, k, v = torch.randn(n, nh, hd), torch.randn(nkv, n, hd), torch.randn(nkv, n, hd)
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(query, key, value, **kwargs):
        seen.append((query.shape[-2], key.shape[-2], torch.backends.cuda.cudnn_sdp_enabled()))
        assert query.is_contiguous() and key.is_contiguous() and value.is_contiguous()  # one stride set per bucket
        return sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording)
    torch.backends.cuda.enable_cudnn_sdp(cudnn_before)
    try:
        got = attention.bucketed_causal_attention(q, k, v, 0.25, bucket=64)
        assert torch.backends.cuda.cudnn_sdp_enabled() is cudnn_before  # restored after the call
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
    padded = -(-n // 64) * 64
    assert seen == [(padded, padded, True)]  # one bucketed length, cuDNN allowed for this call
    ref = sdpa(q.transpose(0, 1), k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0),
               is_causal=True, scale=0.25).transpose(0, 1)
    assert got.shape == (n, nh, hd)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_cudnn_prompt_buckets_are_on_for_cuda_and_warmed_up_to_the_longest_prompt_chunk(monkeypatch):
    from llmc.engine.torch import attention

    monkeypatch.delenv(attention.CUDNN_PROMPTS_ENV, raising=False)
    assert attention.cudnn_prompts(torch.device("cuda")) and not attention.cudnn_prompts(torch.device("cpu"))
    monkeypatch.setenv(attention.CUDNN_PROMPTS_ENV, "0")
    assert not attention.cudnn_prompts(torch.device("cuda"))
    calls = []

    def recording(q, k, v, scale, bucket):
        calls.append((tuple(q.shape), tuple(k.shape), v is k, scale, bucket))
        return q

    monkeypatch.setattr(attention, "bucketed_causal_attention", recording)
    cpu = torch.device("cpu")
    assert attention.warm_prompt_buckets(4, 2, 16, torch.bfloat16, cpu, 2000) == [] and calls == []  # off: nothing
    monkeypatch.setattr(attention, "cudnn_prompts", lambda device: True)
    lengths = [256 * j for j in range(1, 9)]
    assert attention.warm_prompt_buckets(4, 2, 16, torch.bfloat16, cpu, 2000) == lengths
    assert calls == [((n, 4, 16), (2, n, 16), True, 0.25, 256) for n in lengths]
    assert attention.warm_prompt_buckets(4, 2, 16, torch.bfloat16, cpu, 256) == [256]
    assert attention.warm_prompt_buckets(4, 2, 16, torch.bfloat16, cpu, 257, bucket=128) == [128, 256, 384]


def test_metadata_slots_and_positions_follow_each_sequences_blocks_token_by_token():
    import random

    from llmc.engine.torch.attention import build_attention_metadata

    rng = random.Random(0)
    greedy = SamplingParams(temperature=0.0)
    for _ in range(200):
        bs = rng.choice([1, 4, 16, 32])
        seqs = []
        for i in range(rng.randint(1, 5)):  # chunks that start and end mid-block, tables with spare blocks
            cached, new = rng.randint(0, 100), rng.randint(1, 70)
            blocks = tuple(rng.sample(range(1000), -(-(cached + new) // bs) + rng.randint(0, 2)))
            seqs.append(ScheduledSequence(f"r{i}", tuple(range(new)), cached, blocks, True, greedy,
                                          prompt_token_ids=tuple(range(cached + new))))
        meta = build_attention_metadata(seqs, bs, "cpu")
        expected = [(p, s.block_ids[p // bs] * bs + p % bs, i) for i, s in enumerate(seqs)
                    for p in range(s.num_computed, s.num_computed + len(s.token_ids))]
        assert list(zip(meta.positions.tolist(), meta.slot_mapping.tolist(), meta.token_seqs.tolist())) == expected
