"""Decode steps replayed from CUDA graphs: one captured forward + logits per padded batch size.

A decode step of a large model at small batch is launch-bound in eager PyTorch: hundreds of small kernels per
token, each paying Python and launch overhead while the GPU idles. Capturing the step once and replaying it
launches everything in one call. What makes a decode step capturable: the Triton paged attention
(:mod:`llmc.engine.torch.triton_attention`) reads the cache through fixed-shape block tables, and every
per-step input lives in a static buffer that is overwritten before each replay.

Batch sizes are padded up to the next captured size (powers of two up to ``max_batch_size``, plus
``max_batch_size``). Padding rows decode token 0 at position 0 into a scratch KV block that the block
manager never hands out, so they cannot touch a live sequence's cache; their logits are dropped.

A row is one new token, not one sequence: a step with prompt chunks replays a graph too when its tokens fit
``chunk_rows`` (graphs of 2 * max_batch_size, ... up to it are captured as well) and its rows' contexts add up to
no more than a full decode step's, each prompt token a one-token query over its sequence's cache up to its own
position (each layer writes the step's keys and values before it attends, so a chunk's tokens see each other
causally). Without that, such a step runs eagerly, a thousand-odd launches from Python: a step of 7 decodes and a
4-token chunk of the 8B shape took 26.6 ms for 5.7 ms of GPU work (H200, 2026-12-03). ``LLMC_GRAPH_CHUNKS=0``
keeps prompt chunks out of the graphs. Larger steps run eagerly as before.
"""

from __future__ import annotations

import itertools

import torch

from llmc.engine.torch.attention import AttentionMetadata
from llmc.engine.torch.model import KVCache, LlamaForCausalLM
from llmc.engine.types import ScheduledSequence

CHUNKS_ENV = "LLMC_GRAPH_CHUNKS"  # "0": only pure decode steps replay the graphs (prompt chunks run eagerly)
CHUNK_ROWS = 256  # the largest step of prompt chunks the graphs take (at most engine.max_num_tokens)


def decode_rows(seqs: tuple[ScheduledSequence, ...], rows: int, block_size: int, max_blocks: int,
                scratch_block: int) -> list[list[int]]:
    """The static-buffer rows of a step, padded to ``rows``: one per new token, ``[token, position, cache slot,
    context length (position + 1), block table (max_blocks entries)]``, sequence after sequence, then padding
    rows that decode token 0 at position 0 into the scratch block. Table entries past a sequence's blocks point
    at the scratch block (never read)."""
    pad = [scratch_block] * max_blocks
    out = []
    for s in seqs:
        block_ids = s.block_ids
        table = [*block_ids[:max_blocks], *pad[len(block_ids):]]
        for j, token in enumerate(s.token_ids):
            pos = s.num_computed + j
            out.append([token, pos, block_ids[pos // block_size] * block_size + pos % block_size, pos + 1, *table])
    return out + [[0, 0, scratch_block * block_size, 1, *pad] for _ in range(rows - len(out))]


def last_rows(seqs: tuple[ScheduledSequence, ...]) -> list[int]:
    """The row (see :func:`decode_rows`) of each sequence's last new token: the one it samples from."""
    return [end - 1 for end in itertools.accumulate(len(s.token_ids) for s in seqs)]


def verify_rows(seqs: tuple[ScheduledSequence, ...]) -> list[int]:
    """The rows whose chosen tokens verify draft tokens (``ScheduledSequence.num_draft``): of each sequence with
    drafts, the rows of its new tokens but the last (its decode token and every draft but the last), in order."""
    if not any(s.num_draft for s in seqs):
        return []
    return [row for end, s in zip(last_rows(seqs), seqs) for row in range(end - s.num_draft, end)]


def graph_rows(seqs: tuple[ScheduledSequence, ...], block_size: int, max_blocks: int, max_decodes: int,
               chunk_rows: int) -> int:
    """The rows a step takes in the graphs (its new tokens), or 0 where it cannot replay them: no sequences, a
    block table wider than ``max_blocks``; a pure decode step (every sequence one sampled token) of more than
    ``max_decodes`` sequences; a step with prompt chunks of more than ``chunk_rows`` tokens (0: none), or whose
    rows read more context than ``max_decodes`` full-length decodes (each row reads its sequence's cache up to its
    position: a long chunk after a long context is cheaper eagerly, its queries sharing one read)."""
    rows = sum(len(s.token_ids) for s in seqs)
    if not seqs or any(-(-(s.num_computed + len(s.token_ids)) // block_size) > max_blocks for s in seqs):
        return 0
    if all(s.is_decode and s.sample for s in seqs):
        return rows if rows <= max_decodes else 0
    context = sum(len(s.token_ids) * s.num_computed + len(s.token_ids) * (len(s.token_ids) + 1) // 2 for s in seqs)
    return rows if rows <= chunk_rows and context <= max_decodes * max_blocks * block_size else 0


def graph_batch_sizes(max_batch_size: int, chunk_rows: int = 0) -> list[int]:
    """1, 2, 4, ... below ``max_batch_size``, then ``max_batch_size`` itself; then, for prompt chunks, twice that,
    ... below ``chunk_rows`` and ``chunk_rows`` itself."""
    sizes, size = [], 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    sizes.append(max_batch_size)
    size = 2 * max_batch_size
    while size < chunk_rows:
        sizes.append(size)
        size *= 2
    return sizes + ([chunk_rows] if chunk_rows > max_batch_size else [])


class DecodeGraphs:
    """Captured decode steps of ``model`` over ``kv_caches`` for batch sizes up to ``max_batch_size``.

    ``scratch_block`` is a cache block outside the block manager's range (padding rows write there);
    ``max_blocks`` is the block-table width (``ceil(max_seq_len / block_size)``); ``chunk_rows``: the largest
    step with prompt chunks that replays a graph (0: none; see the module's docstring).
    """

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache], block_size: int, max_blocks: int,
                 max_batch_size: int, scratch_block: int, device: torch.device, chunk_rows: int = 0):
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.block_size, self.max_blocks, self.scratch_block = block_size, max_blocks, scratch_block
        self.max_batch_size, self.chunk_rows = max_batch_size, chunk_rows
        self.sizes = graph_batch_sizes(max_batch_size, chunk_rows)
        n = self.sizes[-1]
        # Static inputs, overwritten before every replay; graph b uses rows [:b]. Pinned host mirrors, one copy
        # each; two of them, alternating, because the next step is filled in while the last one may still wait
        # for its copy (the engine launches at most one step ahead of the one it waits for).
        self._hosts = [torch.zeros(n, 4 + max_blocks, dtype=torch.int64).pin_memory() for _ in range(2)]
        self._turn = 0
        self._dev = torch.zeros(n, 4 + max_blocks, dtype=torch.int64, device=device)
        self._tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self._lens = torch.ones(n, dtype=torch.int32, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self._argmax: dict[int, torch.Tensor] = {}  # greedy token of each row, computed inside the graph
        self._replayed = 0  # the rows of the graph run() replayed last
        self._pad_all()

    def _pad_all(self) -> None:
        """Every row a padding row (see :func:`decode_rows`), so capture writes only the scratch block."""
        n = self.sizes[-1]
        self._upload(torch.tensor(decode_rows((), n, self.block_size, self.max_blocks, self.scratch_block)))

    def _upload(self, rows_host: torch.Tensor) -> None:
        """Copy ``rows_host`` (int64 ``[rows, 4 + max_blocks]``) through the next pinned mirror to the device."""
        rows = rows_host.shape[0]
        host = self._hosts[self._turn]
        self._turn ^= 1
        host[:rows] = rows_host
        self._dev[:rows].copy_(host[:rows], non_blocking=True)
        self._tables[:rows].copy_(self._dev[:rows, 4:])
        self._lens[:rows].copy_(self._dev[:rows, 3])

    def _metadata(self, b: int) -> AttentionMetadata:
        """A pure-decode step of ``b`` rows over the static buffers (only the decode path reads it)."""
        rows = torch.arange(b, device=self.device)
        tables, lens = self._tables[:b], self._lens[:b]
        return AttentionMetadata(
            cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32, device=self.device), context_lens=lens,
            block_tables=tables, slot_mapping=self._dev[:b, 2], positions=self._dev[:b, 1], token_seqs=rows,
            logits_indices=rows, decode_seqs=rows, decode_tokens=rows, decode_tables=tables,
            decode_mask=torch.ones(b, 1, 1, 1, dtype=torch.bool, device=self.device), decode_context_lens=lens,
            all_decode=True, query_lens=(1,) * b, query_starts=tuple(range(b)), num_computed=(0,) * b,
            prefill_seqs=(), max_query_len=1, max_context_len=self.max_blocks * self.block_size,
            max_decode_context_len=self.max_blocks * self.block_size, block_size=self.block_size,
        )

    def _forward(self, b: int, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(self._dev[:b, 0], meta.positions, meta, self.kv_caches)  # [b, H]
        logits = self.model.compute_logits(hidden)  # [b, V] float32
        # The sampler's greedy answer (NaN -> -inf first, as Sampler sanitizes), so an all-greedy step needs no
        # sampler kernels after the replay.
        return logits, torch.nan_to_num(logits, nan=float("-inf")).argmax(dim=-1)  # [b] int64

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every batch size (largest first, sharing one memory pool); writes only the scratch block."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for b in reversed(self.sizes):
                meta = self._metadata(b)
                for _ in range(2):  # warm-up: Triton compilation, cuBLAS workspaces, allocator growth
                    self._forward(b, meta)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._logits[b], self._argmax[b] = self._forward(b, meta)
                self._graphs[b] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def draft_limits(self) -> tuple[int, int]:
        """The rows and the row contexts (tokens each row attends to, summed) a step may have and still replay a
        graph (:func:`graph_rows`): what the scheduler's draft tokens must stay within."""
        return self.chunk_rows, self.max_batch_size * self.max_blocks * self.block_size

    def can_run(self, seqs: tuple[ScheduledSequence, ...]) -> bool:
        """True for a step the captured graphs can run (:func:`graph_rows`)."""
        return bool(self._graphs) and graph_rows(seqs, self.block_size, self.max_blocks, self.max_batch_size,
                                                 self.chunk_rows) > 0

    def run(self, seqs: tuple[ScheduledSequence, ...], fill: tuple[list[int], torch.Tensor] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the smallest graph that fits; returns the logits ``[S, V]`` and argmax ``[S]`` of the ``S``
        sequences that sample, in order (views or copies, valid until the next replay). ``fill`` = (rows, token ids
        on the device): the input tokens of those rows (placeholders on the host), written on the device before
        the replay."""
        ends = last_rows(seqs)
        b = next(size for size in self.sizes if size >= ends[-1] + 1)
        self._upload(torch.tensor(decode_rows(seqs, b, self.block_size, self.max_blocks, self.scratch_block),
                                  dtype=torch.int64))
        if fill is not None:
            at = torch.tensor(fill[0], dtype=torch.int64).to(self.device, non_blocking=True)
            self._dev[:, 0].index_copy_(0, at, fill[1].to(torch.int64))
        self._graphs[b].replay()
        self._replayed = b
        if len(ends) == ends[-1] + 1 and all(s.sample for s in seqs):  # a row per sequence: the first rows
            return self._logits[b][: len(ends)], self._argmax[b][: len(ends)]
        picked = [end for end, s in zip(ends, seqs, strict=True) if s.sample]
        index = torch.tensor(picked, dtype=torch.int64).to(self.device, non_blocking=True)
        return self._logits[b].index_select(0, index), self._argmax[b].index_select(0, index)

    def rows_at(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits ``[R, V]`` and greedy tokens ``[R]`` of those rows of the last :meth:`run` (every row's are
        computed in the graph: draft tokens are verified without running the model again)."""
        index = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
        return self._logits[self._replayed].index_select(0, index), self._argmax[self._replayed].index_select(0, index)
