"""The paged prefill-attention kernel (llmc/engine/torch/triton_prefill.py): run by Triton's interpreter on the CPU
in float32 against the gather + SDPA path; on CUDA (``gpu``) in 16 bits, and inside the engine's steps."""

from __future__ import annotations

import random

import pytest
import torch

from llmc.engine.torch import triton_support
from llmc.engine.torch.attention import _gather_context, _prefill_attention, build_attention_metadata
from llmc.engine.torch.triton_prefill import attend_cached_chunks, paged_prefill_attention, tiles_of
from llmc.engine.types import ScheduledSequence
from llmc.request.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def test_tiles_cut_each_chunk_at_the_tile_size_and_carry_its_positions():
    # (table row, first packed token, new tokens, cached before) -> (row, first token, its position, tokens)
    assert tiles_of([(0, 0, 5, 7), (2, 9, 2, 30)], 2) == [(0, 0, 7, 2), (0, 2, 9, 2), (0, 4, 11, 1), (2, 9, 30, 2)]
    assert tiles_of([(1, 3, 16, 0)], 16) == [(1, 3, 0, 16)]


def _step(num_heads: int, num_kv_heads: int, head: int, block: int, work: list[tuple[int, int]], dtype, device):
    """A step of sequences (new tokens, tokens cached before them), blocks handed out scrambled; random q and cache
    (every slot a sequence owns, this step's own written). Returns q, caches, metadata."""
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    total_blocks = sum(-(-(n + c) // block) for n, c in work) + 3
    free = list(range(total_blocks))
    rng.shuffle(free)
    seqs = []
    for i, (n, cached) in enumerate(work):
        blocks = tuple(free.pop() for _ in range(-(-(n + cached) // block)))
        seqs.append(ScheduledSequence(f"s{i}", tuple(range(n)), cached, blocks, True, GREEDY))
    meta = build_attention_metadata(seqs, block, device)
    shape = (total_blocks, block, num_kv_heads, head)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    q = torch.randn(meta.num_tokens, num_heads, head, generator=gen).to(dtype).to(device)
    return q, k_cache, v_cache, meta


def _reference(q, k_cache, v_cache, meta, scale, i):
    start, n = meta.query_starts[i], meta.query_lens[i]
    k_ctx, v_ctx = _gather_context(k_cache, v_cache, meta, i)
    return _prefill_attention(q[start:start + n], k_ctx, v_ctx, meta.num_computed[i], scale)


@pytest.mark.parametrize("num_heads,num_kv_heads,head,block,rows", [(8, 2, 64, 16, 64), (9, 3, 64, 32, 32),
                                                                    (4, 4, 128, 16, 16)])
def test_kernel_under_the_interpreter_equals_gather_and_sdpa(num_heads, num_kv_heads, head, block, rows):
    """Chunks after 0, 5, 37 and 70 cached tokens (tiles ending mid-block, several tiles a chunk, a group of 3 padded
    to 4, one head per kv head), with a decode between them: each chunk's rows equal the gather + SDPA path
    (float32), and rows outside the chunks are left as they were."""
    if triton_support.modules() is None or not triton_support.interpreting():
        pytest.skip("needs Triton's CPU interpreter (TRITON_INTERPRET=1, set by the test suite's conftest)")
    work = [(21, 37), (1, 50), (6, 5), (9, 0), (40, 70)]
    q, k_cache, v_cache, meta = _step(num_heads, num_kv_heads, head, block, work, torch.float32, "cpu")
    scale = head**-0.5
    chunks = [(i, meta.query_starts[i], meta.query_lens[i], meta.num_computed[i]) for i in meta.prefill_seqs]
    assert len(chunks) == 4  # the decode (1 token) is not a prefill sequence
    out = torch.full_like(q, 7.0)
    paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, chunks, scale, out, rows=rows, block_n=32)
    covered = torch.zeros(q.shape[0], dtype=torch.bool)
    for i, start, n, _ in chunks:
        want = _reference(q, k_cache, v_cache, meta, scale, i)
        got = out[start:start + n]
        assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), (i, (got - want).abs().max())
        covered[start:start + n] = True
    assert (out[~covered] == 7.0).all()


def _three_chunks():
    q, k_cache, v_cache, meta = _step(4, 2, 64, 16, [(5, 9), (4, 0), (3, 20)], torch.float32, "cpu")
    chunks = [(i, meta.query_starts[i], meta.query_lens[i], meta.num_computed[i]) for i in meta.prefill_seqs]
    return q, k_cache, v_cache, meta, chunks


def test_the_engine_keeps_the_reference_path_off_cuda():
    """attend_cached_chunks takes nothing on the CPU: the CPU kernels and SDPA do."""
    q, k_cache, v_cache, meta, chunks = _three_chunks()
    out = torch.zeros_like(q)
    assert attend_cached_chunks(q, k_cache, v_cache, meta.block_tables, chunks, 0.125, out) == frozenset()
    assert not out.any()


def test_where_the_kernel_runs_it_takes_the_chunks_with_a_cache_unless_switched_off(monkeypatch):
    """Where the kernel is available (stood in for by Triton's interpreter), attend_cached_chunks takes the chunks
    with cached tokens and leaves fresh prompts' rows to the caller; LLMC_PREFILL_KERNEL=0 leaves all of them."""
    from llmc.engine.torch import triton_prefill

    if triton_support.modules() is None or not triton_support.interpreting():
        pytest.skip("needs Triton's CPU interpreter (the gpu test covers CUDA)")
    q, k_cache, v_cache, meta, chunks = _three_chunks()
    out = torch.zeros_like(q)
    monkeypatch.setattr(triton_prefill, "kernel_available", lambda device, block_size, head_size: True)
    assert attend_cached_chunks(q, k_cache, v_cache, meta.block_tables, chunks, 0.125, out) == {0, 2}
    fresh = slice(meta.query_starts[1], meta.query_starts[1] + 4)
    assert out[fresh].abs().sum() == 0 and out[:5].abs().sum() > 0 and out[-3:].abs().sum() > 0
    monkeypatch.setenv("LLMC_PREFILL_KERNEL", "0")
    assert attend_cached_chunks(q, k_cache, v_cache, meta.block_tables, chunks, 0.125, out) == frozenset()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_on_cuda_equals_gather_and_sdpa_and_serves_the_engines_chunks(dtype, monkeypatch):
    """The 8B attention shape (32 / 8 heads of 128, blocks of 32) in 16 bits: chunks of 1-300 tokens after 0-1,500
    cached ones against the gather + SDPA path (within 16-bit rounding of the output), through the engine's
    dispatch (attend_cached_chunks takes every chunk with a cache, not fresh prompts), and off with
    LLMC_PREFILL_KERNEL=0."""
    work = [(300, 1500), (1, 700), (17, 33), (128, 0), (64, 960)]
    q, k_cache, v_cache, meta = _step(32, 8, 128, 32, work, dtype, "cuda")
    scale = 128**-0.5
    out = torch.zeros_like(q)
    chunks = [(i, meta.query_starts[i], meta.query_lens[i], meta.num_computed[i]) for i in meta.prefill_seqs]
    done = attend_cached_chunks(q, k_cache, v_cache, meta.block_tables, chunks, scale, out)
    assert done == {0, 2, 4}
    for i in done:
        start, n = meta.query_starts[i], meta.query_lens[i]
        want = _reference(q, k_cache, v_cache, meta, scale, i).float()
        assert (out[start:start + n].float() - want).abs().max().item() < 2e-2, i
    monkeypatch.setenv("LLMC_PREFILL_KERNEL", "0")
    assert attend_cached_chunks(q, k_cache, v_cache, meta.block_tables, chunks, scale, out) == frozenset()
