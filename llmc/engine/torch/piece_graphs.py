"""Steps with prompt tokens replayed from CUDA graphs in pieces: each stretch between two attentions is captured
per token-count bucket, the attentions run eagerly.

Under a mixed-step budget (``serving.mixed_step_tokens``) a step holds a prompt chunk and up to
``engine.max_batch_size`` decodes, and such a step is too large for the decode graphs
(:mod:`llmc.engine.torch.cuda_graphs`): a step of 64 decodes and a 960-token chunk of the 8B shape launches about
a thousand kernels from Python: in the engine such steps took 48.0 ms each against 35.9 ms of kernels (H200,
2026-12-03 and 12-02); from the pieces, 37.3 ms.
Everything but the attention has the same shapes for every step of the same token count, so it is captured: piece
0 is the embedding, the RoPE tables, the first norm and layer 0's qkv + RoPE + KV-cache write; piece ``i`` is
layer ``i - 1`` after its attention (dense, residual + norm, MLP, residual + norm) and layer ``i``'s qkv + RoPE +
KV write; the last piece ends with the final norm. Between pieces, each layer's attention runs eagerly over the
step's real tokens and its own metadata (contexts and chunk lengths change every step), reading q, k, v from
static buffers and writing its output to one.

A step of ``n`` tokens replays the smallest bucket ``t >= n``; rows ``n .. t - 1`` are padding: position 0,
token 0, and their keys and values go to the scratch block's first slot (the block the block manager never hands
out, as the decode graphs' padding rows), rewritten every step. Rows never mix in the captured kernels (linears,
norms, RoPE), so padding rows change no real row. ``LLMC_PIECE_GRAPHS=0`` keeps such steps eager.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmc.engine.torch import triton_support
from llmc.engine.torch.attention import AttentionMetadata, planless_sdpa
from llmc.engine.torch.model import KVCache, LlamaForCausalLM

PIECES_ENV = "LLMC_PIECE_GRAPHS"  # "0": steps with prompt tokens run eagerly
MAX_PIECE_TOKENS = 2048  # larger steps are GPU-bound: their launches hide behind their kernels
FINE_STEP, FINE_UP_TO, COARSE_STEP = 128, 1024, 256  # bucket spacing: every 128 tokens up to 1,024, then 256


def pieces_enabled() -> bool:
    """The budget's steps replay the pieces (``LLMC_PIECE_GRAPHS`` is not ``0``; for A/B runs)."""
    return not triton_support.switched_off(PIECES_ENV)


def piece_buckets(budget: int, max_num_tokens: int) -> list[int]:
    """The token counts captured for a mixed-step budget: every 128 tokens up to 1,024, every 256 above, up to
    the budget rounded up to its spacing (at most :data:`MAX_PIECE_TOKENS` and ``max_num_tokens``, which bound a
    step); none without a budget (0)."""
    top = min(budget, MAX_PIECE_TOKENS, max_num_tokens)
    if top <= 0:
        return []
    sizes, size = [], 0
    while size < top:
        size += FINE_STEP if size < FINE_UP_TO else COARSE_STEP
        sizes.append(min(size, max_num_tokens))
    return sizes


class PieceGraphs:
    """The pieces of ``model`` (a CUDA-fused model, :meth:`LlamaForCausalLM.use_cuda_fused`) over ``kv_caches``
    for every token count in ``buckets``. ``scratch_slot``: a cache slot no sequence owns (padding rows write
    there). :meth:`capture` records them as CUDA graphs; ``capture(graphs=False)`` keeps them as plain calls, the
    same pieces run eagerly (CPU tests of the decomposition, under Triton's interpreter)."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache], buckets: list[int], scratch_slot: int,
                 device: torch.device):
        assert buckets == sorted(buckets) and buckets, "buckets: increasing token counts"
        self.model, self.kv_caches, self.buckets, self.scratch_slot = model, kv_caches, buckets, scratch_slot
        self.device = torch.device(device)
        cfg = model.config
        n, dtype = buckets[-1], model.transformer.ln_f.weight.dtype
        # Static buffers: bucket t uses rows [:t]. Inputs, overwritten before every replay:
        self._ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        self._positions = torch.zeros(n, dtype=torch.int64, device=self.device)
        self._slots = torch.full((n,), scratch_slot, dtype=torch.int64, device=self.device)
        # What the pieces hand on: the residual stream, the RoPE tables, q / k / v for the attention, its output,
        # the final normed hidden states.
        self._h = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=self.device)
        self._cos = torch.zeros(n, 1, cfg.head_size, dtype=dtype, device=self.device)
        self._sin = torch.zeros_like(self._cos)
        self._q = torch.zeros(n, cfg.num_heads, cfg.head_size, dtype=dtype, device=self.device)
        self._k = torch.zeros(n, cfg.num_kv_heads, cfg.head_size, dtype=dtype, device=self.device)
        self._v = torch.zeros_like(self._k)
        self._attended = torch.zeros_like(self._q)
        self._out = torch.zeros_like(self._h)
        self._pieces: dict[int, list[Callable[[], None]]] = {}
        self._graphs: list[torch.cuda.CUDAGraph] = []  # kept alive: the pieces replay them

    def can_run(self, num_tokens: int) -> bool:
        """True for a step of ``num_tokens`` new tokens that fits a captured bucket."""
        return bool(self._pieces) and 0 < num_tokens <= self.buckets[-1]

    def _piece(self, t: int, j: int) -> None:
        """Piece ``j`` of bucket ``t`` (see the module's docstring), over the static buffers' rows ``[:t]``."""
        model = self.model
        layers = model.transformer.layers
        h = self._h[:t]
        if j == 0:
            h.copy_(model.transformer.vocab_embedding(self._ids[:t]))
            cos, sin = model.rope_tables(self._positions[:t], h.dtype)
            self._cos[:t].copy_(cos)
            self._sin[:t].copy_(sin)
            normed = model.fused_first_norm(h)
        else:
            normed = model.fused_after_attention(j - 1, h, self._attended[:t])
        if j == len(layers):
            self._out[:t].copy_(normed)
            return
        q, k, v = layers[j].attention.project(normed, self._cos[:t], self._sin[:t], self.kv_caches[j],
                                              self._slots[:t], decode=False)
        self._q[:t].copy_(q)
        self._k[:t].copy_(k)
        self._v[:t].copy_(v)

    @torch.inference_mode()
    def capture(self, graphs: bool = True) -> None:
        """Run every piece of every bucket once (Triton compiles, cuBLAS workspaces), then capture it (largest
        bucket first, one memory pool: a piece's temporaries die with it, so the pieces share that memory).
        Writes only the scratch slot of the cache."""
        count = len(self.model.transformer.layers) + 1
        self._slots.fill_(self.scratch_slot)
        if not graphs:
            for t in self.buckets:
                self._pieces[t] = [lambda t=t, j=j: self._piece(t, j) for j in range(count)]
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for t in reversed(self.buckets):
                for j in range(count):
                    self._piece(t, j)
                pieces = []
                for j in range(count):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        self._piece(t, j)
                    self._graphs.append(graph)
                    pieces.append(graph.replay)
                self._pieces[t] = pieces
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def run(self, input_ids: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """The step's final normed hidden states ``[n, H]`` (a view of a static buffer, valid until the next
        run) for its ``n`` packed tokens ``input_ids`` (on the device) and their attention metadata."""
        n = input_ids.shape[0]
        t = next(size for size in self.buckets if size >= n)
        self._ids[:n].copy_(input_ids)
        self._positions[:n].copy_(attn.positions)
        self._slots[:n].copy_(attn.slot_mapping)
        self._slots[n:t].fill_(self.scratch_slot)  # rows a larger step left there would write its slots again
        pieces = self._pieces[t]
        with planless_sdpa():  # prompt chunks never attend through a backend that plans per shape
            for j, layer in enumerate(self.model.transformer.layers):
                pieces[j]()
                attention = layer.attention
                self._attended[:n].copy_(attention.attend(self._q[:n], self._k[:n], self._v[:n], attn,
                                                          self.kv_caches[j]))
            pieces[-1]()
        return self._out[:n]
