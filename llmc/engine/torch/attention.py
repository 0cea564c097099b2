"""Paged-attention metadata and the reference attention over a block-table KV cache.

KV cache layout, per layer: ``k_cache, v_cache`` of shape ``[num_blocks, block_size, num_kv_heads, head_size]``.
Token ``p`` of a sequence lives in block ``block_ids[p // block_size]`` at offset ``p % block_size``; its flat
slot is ``block_id * block_size + offset``.

A step runs a *packed* batch: the new tokens of every sequence are concatenated (no padding) into ``T`` tokens.
Each layer first writes the new k/v into the cache (``slot_mapping``), then every query token at absolute
position ``p`` attends to the sequence's cached positions ``<= p``. Sequences with one new token (decodes) are
attended in one batched call; sequences with several new tokens (prefill chunks) one at a time.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from llmc.engine.torch import cpu_ext
from llmc.engine.torch.kv_store import FP8, from_cache, write_kv
from llmc.engine.torch.triton_attention import kernel_available, paged_decode_attention
from llmc.engine.torch.triton_prefill import attend_cached_chunks
from llmc.engine.types import ScheduledSequence

# With float32 prefill, steps whose longest prefill chunk is at most this many tokens run attention through
# llmc's CPU decode kernel, token by token; longer chunks go to SDPA, whose matmuls win there (one 128-token
# prompt, 9/3 heads of 64: kernel 306 vs SDPA 425 us; 256 tokens: 1,299 vs 1,181 us; hot loop, 2-core Xeon,
# 2026-11-29). With bfloat16 prefill (``bf16_prefill``), chunks of any length take llmc's prefill-attention
# kernel: 16 prompts of 128 tokens, one layer, one Zen 4 core: 4.4-5.9 ms vs 7.1-8.5 ms token by token in
# float32 and 12.4-15.9 ms for SDPA (float32 or bfloat16); one prompt of 256 / 512 / 1,024 tokens: 0.8 / 2.4 /
# 8.6 ms vs SDPA's 2.5 / 8.7 / 26.6 ms (per-thread CPU time, 2026-12-01).
CPU_KERNEL_MAX_QUERY_LEN = 128

# SDPA's backends for steps with prompt tokens: every one but cuDNN's. cuDNN's attention builds an execution plan on
# the host for every new (query length, key length) and caches it by shape: inside the engine on an H200, 37-54 ms
# of host time before the first layer's attention of each step with a prompt chunk of a new length (torch 2.11,
# 2026-12-02 profile). Budgeted mixed steps of the bf16 8B build took 64.9 ms on average with it and 47.3 ms without,
# and every prompt of a new length would pay it in TTFT. Flash and memory-efficient attention launch without a plan.
PLANLESS_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)

# Except for whole fresh prompts on CUDA: they attend through cuDNN all the same, padded to a multiple of
# CUDNN_LENGTH_BUCKET tokens, so its plans are bounded to one per bucket (32 up to 8,192 tokens), each built once per
# process (:func:`warm_prompt_buckets` builds those up to the engine's longest prompt at warm-up). Causal attention
# over 2,048 tokens of the 8B shape, 32 layers: 3.3-3.4 ms through cuDNN vs 6.2-6.4 ms through flash attention
# (H200, 2026-12-02 13:50, prefill-step profiles); TTFT p50 of a 2,048-token prompt 52.0 vs 54.9 ms (int4 build),
# 47.0 vs 49.2 ms (bf16). Padding at the end changes nothing for the real queries: a causal query never sees a later
# key. ``LLMC_CUDNN_PROMPTS=0`` sends them to flash attention instead.
CUDNN_PROMPTS_ENV = "LLMC_CUDNN_PROMPTS"
CUDNN_LENGTH_BUCKET = 256


def cudnn_prompts(device: torch.device) -> bool:
    """Whether whole fresh prompts on ``device`` attend through cuDNN at bucketed lengths (CUDA, unless
    ``LLMC_CUDNN_PROMPTS=0``)."""
    return device.type == "cuda" and os.environ.get(CUDNN_PROMPTS_ENV, "1") != "0"


def planless_sdpa():
    """Context for a step's forward: SDPA picks among :data:`PLANLESS_SDPA_BACKENDS` (global torch flags, restored
    on exit; one enter per step, ~17 us)."""
    return sdpa_kernel(list(PLANLESS_SDPA_BACKENDS))


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs for one packed step (B sequences, T new tokens, S sampled ones).

    Device tensors drive the kernels; the host tuples let the per-sequence path slice without a device sync.
    ``block_tables`` rows are padded with block 0: padded entries are only ever read beyond ``context_lens``
    and are masked out.
    """

    cu_seqlens_q: torch.Tensor  # [B + 1] int32: new tokens of sequence i are cu[i] .. cu[i+1]-1
    context_lens: torch.Tensor  # [B] int32: tokens in the cache after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    positions: torch.Tensor  # [T] int64: absolute position of each new token
    token_seqs: torch.Tensor  # [T] int64: the sequence (row of block_tables) of each new token
    logits_indices: torch.Tensor  # [S] int64: packed index of the last new token of each sampled sequence
    decode_seqs: torch.Tensor  # [D] int64: sequences with exactly one new token (batched path)
    decode_tokens: torch.Tensor  # [D] int64: their packed token index
    decode_tables: torch.Tensor  # [D, nb] int32: their block tables, cut to the longest decode context
    decode_mask: torch.Tensor  # [D, 1, 1, nb * block_size] bool: True at their cached positions
    decode_context_lens: torch.Tensor  # [D] int32: their context lengths (cached + this step's token)
    all_decode: bool  # every sequence is a decode: packed tokens are the decode batch in order
    query_lens: tuple[int, ...]  # [B] host copy
    query_starts: tuple[int, ...]  # [B] host: packed index of each sequence's first new token
    num_computed: tuple[int, ...]  # [B] host: tokens already cached before this step
    prefill_seqs: tuple[int, ...]  # sequences with several new tokens (per-sequence path)
    max_query_len: int
    max_context_len: int
    max_decode_context_len: int  # 0 when there are no decodes
    block_size: int

    @functools.cached_property
    def token_tables(self) -> torch.Tensor:
        """``[T, max_blocks]`` int32: each new token's block table (built on first use, once per step)."""
        return self.block_tables.index_select(0, self.token_seqs)

    @functools.cached_property
    def prefill_chunks(self) -> torch.Tensor:
        """``[P, 4]`` int32, one row per prefill sequence: (row of ``block_tables``, packed index of its first new
        token, its new tokens, tokens cached before them); what the CPU prefill-attention kernel takes."""
        rows = [(i, self.query_starts[i], self.query_lens[i], self.num_computed[i]) for i in self.prefill_seqs]
        return torch.tensor(rows, dtype=torch.int32).view(len(rows), 4).to(self.block_tables.device)

    @functools.cached_property
    def token_context_lens(self) -> torch.Tensor:
        """``[T]`` int32: the cached tokens each new token attends to (its position + 1)."""
        return (self.positions + 1).to(torch.int32)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


def build_attention_metadata(
    seqs: Sequence[ScheduledSequence], block_size: int, device: torch.device | str
) -> AttentionMetadata:
    """Turn the scheduler's per-sequence work into packed tensors on ``device`` (built on the host, copied once).

    The scheduler guarantees every sequence has new tokens and blocks for them (asserted: a failure is a bug).
    """
    query_lens = tuple(len(s.token_ids) for s in seqs)
    num_computed = tuple(s.num_computed for s in seqs)
    context_lens = [c + q for c, q in zip(num_computed, query_lens)]
    for s, ctx in zip(seqs, context_lens):
        assert s.token_ids, f"request {s.request_id} was scheduled with no new tokens"
        assert len(s.block_ids) * block_size >= ctx, (
            f"request {s.request_id}: {len(s.token_ids)} new tokens after {s.num_computed} cached need "
            f"{-(-ctx // block_size)} blocks of {block_size}, the scheduler gave {len(s.block_ids)}")
    max_blocks = max(-(-ctx // block_size) for ctx in context_lens)
    tables = [list(s.block_ids[:max_blocks]) + [0] * (max_blocks - min(len(s.block_ids), max_blocks)) for s in seqs]
    positions: list[int] = []
    slots: list[int] = []
    token_seqs: list[int] = []
    for i, s in enumerate(seqs):  # runs of consecutive slots, one per block: no per-token Python on long prompts
        start, end = s.num_computed, s.num_computed + len(s.token_ids)
        positions.extend(range(start, end))
        token_seqs.extend([i] * (end - start))
        for b in range(start // block_size, -(-end // block_size)):
            base = s.block_ids[b] * block_size
            slots.extend(range(base + max(start - b * block_size, 0), base + min(end - b * block_size, block_size)))
    cu = [0]
    for q in query_lens:
        cu.append(cu[-1] + q)
    logits_idx = [cu[i + 1] - 1 for i, s in enumerate(seqs) if s.sample]
    decodes = [i for i, s in enumerate(seqs) if s.is_decode]

    def dev(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    # The decode batch's block tables and key mask, built once per step instead of once per layer.
    decode_blocks = max((-(-context_lens[i] // block_size) for i in decodes), default=0)
    decode_lens = dev([context_lens[i] for i in decodes], torch.int32)  # [D]
    decode_mask = torch.arange(decode_blocks * block_size, device=device)[None, :] < decode_lens[:, None]

    return AttentionMetadata(
        cu_seqlens_q=dev(cu, torch.int32),
        context_lens=dev(context_lens, torch.int32),
        block_tables=dev(tables, torch.int32),
        slot_mapping=dev(slots, torch.int64),
        positions=dev(positions, torch.int64),
        token_seqs=dev(token_seqs, torch.int64),
        logits_indices=dev(logits_idx, torch.int64),
        decode_seqs=dev(decodes, torch.int64),
        decode_tokens=dev([cu[i] for i in decodes], torch.int64),
        decode_tables=dev([tables[i][:decode_blocks] for i in decodes], torch.int32).view(len(decodes), decode_blocks),
        decode_mask=decode_mask[:, None, None, :],
        decode_context_lens=decode_lens,
        all_decode=len(decodes) == len(seqs),
        query_lens=query_lens,
        query_starts=tuple(cu[:-1]),
        num_computed=num_computed,
        prefill_seqs=tuple(i for i, s in enumerate(seqs) if not s.is_decode),
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
        max_decode_context_len=max((context_lens[i] for i in decodes), default=0),
        block_size=block_size,
    )


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float, bf16_prefill: bool = False, kv_written: bool = False,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of the packed queries ``q [T, nh, hd]`` over each sequence's cached context.

    ``k, v [T, nkv, hd]`` are this step's keys/values; they are written to the cache first (``kv_written``: the
    caller's fused RoPE kernel wrote them already); ``kv_scale``: an fp8 cache's scale
    (:func:`llmc.engine.torch.kv_store.to_cache`). Returns ``[T, nh, hd]``. On CUDA, prompt chunks that continue a
    cached context attend through one Triton kernel (:mod:`llmc.engine.torch.triton_prefill`).
    ``bf16_prefill`` (CPU, a model whose prefill GEMMs run in bfloat16): prefill chunks attend in bfloat16 products
    with float32 sums too, through llmc's kernel where it runs (:func:`cpu_ext.prefill_attention_available`).
    """
    if not kv_written:
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping, kv_scale)
    if meta.all_decode:  # pure decode step: no packing to undo
        return decode_attention(q, k_cache, v_cache, meta, scale, kv_scale)
    if bf16_prefill and cpu_ext.prefill_attention_available(q, k_cache):
        return _bf16_prefill_attention(q, k_cache, v_cache, meta, scale)
    if meta.max_query_len <= CPU_KERNEL_MAX_QUERY_LEN and cpu_ext.decode_attention_available(q, k_cache):
        # Every packed token is a one-token query over its own sequence's cache up to its position (this step's
        # k/v are in the cache already): one call for prefill chunks and decodes alike, no gather.
        return cpu_ext.paged_decode_attention(q, k_cache, v_cache, meta.token_tables, meta.token_context_lens,
                                              scale)
    out = torch.empty_like(q)
    if meta.decode_seqs.numel() > 0:
        q_dec = q.index_select(0, meta.decode_tokens)  # [D, nh, hd]
        out.index_copy_(0, meta.decode_tokens, decode_attention(q_dec, k_cache, v_cache, meta, scale, kv_scale))
    chunks = [(i, meta.query_starts[i], meta.query_lens[i], meta.num_computed[i]) for i in meta.prefill_seqs]
    done = attend_cached_chunks(q, k_cache, v_cache, meta.block_tables, chunks, scale, out,  # CUDA: those over a cache
                                kv_scale)
    for i in (i for i in meta.prefill_seqs if i not in done):
        start, end = meta.query_starts[i], meta.query_starts[i] + meta.query_lens[i]
        if meta.num_computed[i] == 0:
            # Fresh prefill: the whole context is this step's k/v, no need to read the cache back.
            k_ctx, v_ctx = k[start:end], v[start:end]
        else:
            k_ctx, v_ctx = (from_cache(c, q.dtype, kv_scale) for c in _gather_context(k_cache, v_cache, meta, i))
        out[start:end] = _prefill_attention(q[start:end], k_ctx, v_ctx, meta.num_computed[i], scale)
    return out


def _bf16_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """CPU: the step's prefill chunks through llmc's bfloat16 kernel (each chunk and kv head reads its context
    once, in place), its decodes through the float32 decode path. Returns ``[T, nh, hd]``."""
    out = torch.empty(q.shape, dtype=q.dtype)
    if meta.decode_seqs.numel() > 0:
        q_dec = q.index_select(0, meta.decode_tokens)  # [D, nh, hd]
        out.index_copy_(0, meta.decode_tokens, decode_attention(q_dec, k_cache, v_cache, meta, scale))
    cpu_ext.prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.prefill_chunks, scale, out)
    return out


def _gather_context(
    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, i: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence ``i``'s cached keys and values, ``[context_len, nkv, hd]`` each."""
    ctx = meta.num_computed[i] + meta.query_lens[i]
    blocks = meta.block_tables[i : i + 1, : -(-ctx // meta.block_size)]  # [1, nb]
    k_ctx = gather_blocks(k_cache, blocks)[0, :ctx]  # [ctx, nkv, hd]
    v_ctx = gather_blocks(v_cache, blocks)[0, :ctx]
    return k_ctx, v_ctx


def gather_blocks(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """The cache blocks listed in ``tables [D, nb]``, as ``[D, nb * block_size, nkv, hd]`` (a copy).

    On CPU this is one ``index_select`` over whole blocks viewed as rows (each a contiguous memcpy), measured
    ~2.7x faster than advanced indexing for one sequence and ~5x for 16; CUDA keeps advanced indexing.
    """
    if cache.dtype == FP8:  # gathered as bytes: float8 has no indexing kernels everywhere
        return gather_blocks(cache.view(torch.uint8), tables).view(FP8)
    d, nb = tables.shape
    num_blocks, block_size, num_kv_heads, head_size = cache.shape
    if cache.device.type != "cpu":
        return cache[tables].flatten(1, 2)
    rows = cache.view(num_blocks, -1).index_select(0, tables.reshape(-1))  # [D * nb, block_size * nkv * hd]
    return rows.view(d, nb * block_size, num_kv_heads, head_size)


def _prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_computed: int, scale: float
) -> torch.Tensor:
    """One sequence: queries ``[n, nh, hd]`` at positions ``num_computed + j`` over keys ``[ctx, nkv, hd]``."""
    n, num_heads, head_size = q.shape
    ctx, num_kv_heads = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    k_t, v_t = k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype)  # [nkv, ctx, hd]
    # Inputs are 4-D ([1, heads, len, hd]) throughout: 3-D inputs make PyTorch's CPU SDPA fall back to its
    # unfused math path (measured 1.5-2.5x slower for a 128-token prompt).
    if q.is_cuda and num_computed == 0 and ctx == n:
        # A whole fresh prompt on CUDA: causal attention with the kv heads shared by their query groups in the
        # kernel (no repeated k/v): 0.096 vs 0.189 ms per 2,048-token layer of the 8B shape on an H200 (cuDNN's
        # flash kernel either way; equal outputs).
        if cudnn_prompts(q.device):
            return bucketed_causal_attention(q, k_t, v_t, scale)
        return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k_t[None], v_t[None], is_causal=True,
                                              scale=scale, enable_gqa=True)[0].transpose(0, 1)
    if (num_computed == 0 and ctx == n) or q.is_cuda:
        # A whole fresh prompt (plain causal attention), or on CUDA any chunk: no mask tensor.
        return chunk_attention_lower_right(q, k_t, v_t, scale)
    # GQA without copying k/v: fold the `group` query heads of each kv head into the query axis.
    q_g = q.view(n, num_kv_heads, group, head_size).permute(1, 2, 0, 3).reshape(num_kv_heads, group * n, head_size)
    q_pos = torch.arange(num_computed, num_computed + n, device=q.device)  # [n]
    k_pos = torch.arange(ctx, device=q.device)  # [ctx]
    mask = (k_pos[None, :] <= q_pos[:, None]).repeat(group, 1)  # [group * n, ctx]
    out = F.scaled_dot_product_attention(q_g[None], k_t[None], v_t[None], attn_mask=mask[None, None], scale=scale)[0]
    return out.view(num_kv_heads, group, n, head_size).permute(2, 0, 1, 3).reshape(n, num_heads, head_size)


def bucketed_causal_attention(q: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor, scale: float,
                              bucket: int = CUDNN_LENGTH_BUCKET) -> torch.Tensor:
    """Causal attention of a whole fresh prompt, queries ``[n, nh, hd]``, keys/values ``[nkv, n, hd]`` (kv heads
    shared by their query groups in the kernel) -> ``[n, nh, hd]``, with cuDNN's attention allowed (where the
    device has it) on contiguous copies zero-padded to a multiple of ``bucket``: SDPA then sees a bounded set of
    shapes and strides, so cuDNN builds one plan per bucket, not one per prompt length
    (:data:`CUDNN_LENGTH_BUCKET`)."""
    n = q.shape[0]
    pad = -n % bucket
    q_h, k_t, v_t = (F.pad(t, (0, 0, 0, pad)).contiguous() for t in (q.transpose(0, 1), k_t, v_t))
    cudnn_was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)  # inside the step's planless_sdpa: for this call only
    try:
        out = F.scaled_dot_product_attention(q_h[None], k_t[None], v_t[None], is_causal=True, scale=scale,
                                             enable_gqa=True)[0]  # [nh, n + pad, hd]
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn_was)
    return out[:, :n].transpose(0, 1)


def warm_prompt_buckets(num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype, device: torch.device,
                        max_len: int, bucket: int = CUDNN_LENGTH_BUCKET) -> list[int]:
    """Run :func:`bucketed_causal_attention` once at every bucketed length up to ``max_len`` (zeros), so cuDNN
    builds those plans now (37-54 ms of host time each on an H200) and no prompt pays one in its TTFT. Returns the
    lengths; none where :func:`cudnn_prompts` is off."""
    if not cudnn_prompts(device):
        return []
    lengths = [bucket * j for j in range(1, -(-max_len // bucket) + 1)]
    with planless_sdpa():
        for length in lengths:
            q = torch.zeros(length, num_heads, head_size, dtype=dtype, device=device)
            kv = torch.zeros(num_kv_heads, length, head_size, dtype=dtype, device=device)
            bucketed_causal_attention(q, kv, kv, head_size**-0.5, bucket)
    return lengths


def chunk_attention_lower_right(q: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor, scale: float) -> torch.Tensor:
    """A prefill chunk over its cached context: queries ``[n, nh, hd]`` are the last ``n`` of ``ctx`` positions,
    keys/values ``[nkv, ctx, hd]``; returns ``[n, nh, hd]``.

    Causal attention aligned to the lower right (query ``j`` sees keys ``<= ctx - n + j``) is a structured bias
    that SDPA's fused kernels (memory-efficient attention on CUDA) take without a mask tensor; an explicit boolean
    ``[n, ctx]`` mask sends the call to a slower masked path that reads the mask too. With ``n == ctx`` (a whole
    fresh prompt) SDPA runs it as plain ``is_causal`` attention. Kv heads are repeated for their queries (fused
    kernels want equal head counts); the copy is small next to the attention itself.
    """
    from torch.nn.attention.bias import causal_lower_right

    n, num_heads, _ = q.shape
    ctx, group = k_t.shape[1], num_heads // k_t.shape[0]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k_t.repeat_interleave(group, 0)[None], v_t.repeat_interleave(group, 0)[None],
        attn_mask=causal_lower_right(n, ctx), scale=scale,
    )[0]  # [nh, n, hd]
    return out.transpose(0, 1)


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """All one-token sequences at once: queries ``[D, nh, hd]`` over their contexts -> ``[D, nh, hd]`` (this step's
    keys and values must be in the cache already).

    One kernel reads the blocks in place: on CUDA with Triton (:mod:`llmc.engine.torch.triton_attention`), on
    CPU llmc's C++ kernel for float32 queries (:mod:`llmc.engine.torch.cpu_ext`). Otherwise the contexts are
    gathered, padded to the longest, and attended with SDPA under a key mask (the reference both kernels are
    tested against).
    """
    d, num_heads, head_size = q.shape
    if q.is_cuda and kernel_available(q.device, meta.block_size, head_size):
        return paged_decode_attention(q, k_cache, v_cache, meta.decode_tables, meta.decode_context_lens, scale,
                                      kv_scale=kv_scale)
    if cpu_ext.decode_attention_available(q, k_cache):  # not for fp8 caches
        return cpu_ext.paged_decode_attention(q, k_cache, v_cache, meta.decode_tables, meta.decode_context_lens,
                                              scale)
    return reference_decode_attention(q, k_cache, v_cache, meta, scale, kv_scale)


def reference_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """The portable decode path: gather each context, pad to the longest, SDPA under the key mask."""
    d, num_heads, head_size = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    k = from_cache(gather_blocks(k_cache, meta.decode_tables).transpose(1, 2), q.dtype, kv_scale)  # [D, nkv, L, hd]
    v = from_cache(gather_blocks(v_cache, meta.decode_tables).transpose(1, 2), q.dtype, kv_scale)
    q_g = q.view(d, num_kv_heads, group, head_size)  # query heads of one kv head share its keys
    out = F.scaled_dot_product_attention(q_g, k, v, attn_mask=meta.decode_mask, scale=scale)
    return out.reshape(d, num_heads, head_size)
