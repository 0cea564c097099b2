"""TorchModelRunner: the portable engine's implementation of the scheduler -> runner contract.

One ``execute`` call runs one engine step: build the packed paged-attention metadata, run the forward pass
under ``torch.inference_mode``, compute logits only for the sequences that sample this step, sample on the
device and bring the sampled ids to the host with a single ``.tolist()``. On CUDA the step can also be split:
``launch`` queues the step's GPU work and the copy of its sampled ids to pinned host memory and returns at once;
``PendingStep.result()`` waits for them (the engine plans and launches the next step in between, its placeholder
tokens taken from this step's ids on the device, and processes this step's tokens while that one runs).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from llmc.checkpoint.convert import torch_dtype
from llmc.engine.torch import attention, cpu_ext, drafts, prompt_logprobs
from llmc.engine.torch.attention import build_attention_metadata
from llmc.engine.torch.compile import read_engine_config
from llmc.engine.torch.cuda_graphs import CHUNK_ROWS, CHUNKS_ENV, DecodeGraphs, last_rows, verify_rows
from llmc.engine.torch.drafts import DraftRows
from llmc.engine.torch.kv_alloc import allocate_kv_cache, kv_bytes_per_token, plan_num_blocks, runtime_kv_dtype
from llmc.engine.torch.int4_install import config_sources
from llmc.engine.torch.loader import host_weight_bytes, load_model, weight_bytes
from llmc.engine.torch.piece_graphs import PieceGraphs, piece_buckets, pieces_enabled
from llmc.engine.torch.prompt_logprobs import PromptRows
from llmc.engine.torch.sampler import LogprobRows, Sampler, token_logprobs
from llmc.engine.torch.triton_attention import kernel_available
from llmc.engine.types import PLACEHOLDER, ModelRunnerOutput, ScheduledSequence, SchedulerOutput
from llmc.errors import EngineError
from llmc.manifest import read_manifest
from llmc.request.outputs import TokenLogprob
from llmc.request.params import SamplingParams

WARMUP_REQUEST_ID = "__llmc_warmup__"
logger = logging.getLogger(__name__)
CUDA_GRAPHS_ENV = "LLMC_CUDA_GRAPHS"  # "0" turns the captured decode steps off (debugging, A/B measurements)
WARMUP_LONG_PROMPT = 512  # CUDA: tokens of the warm-up's second prompt, at least every int4 layer's dense_from_m
WARMUP_TOP_P = SamplingParams(temperature=1.0, top_p=0.9, seed=0, max_new_tokens=2)  # CUDA: a top-p decode
WARMUP_CONTINUATION = 16  # CUDA: its last tokens, a chunk over the cached rest (the paged prefill kernel's path)


def resolve_device(device: torch.device | str) -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU; anything else as given."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class TorchModelRunner:
    """Loads a build folder's torch engine and executes scheduler steps over a paged KV cache.

    Attributes: ``device``, ``weight_bytes`` (by dtype, as held on the device), ``host_weight_bytes`` (by dtype:
    an untied input embedding kept in page-locked host memory on CUDA), ``int4_config_sources`` (whose kernel
    configs each int4 CUDA layer shape runs), ``block_size`` (recipe
    ``kv_cache.tokens_per_block``), ``num_blocks`` (given, or
    from the recipe's KV budget: ``cpu_budget_mb`` on CPU, ``memory_fraction`` of free CUDA memory after the
    weights), ``vocab_size``, ``kv_dtype`` (the cache's; ``kv_fallback``: why the recipe's fp8 runs as 16-bit
    here, else None), ``kv_bytes_per_token``, ``model``, ``kv_caches``, ``graphs`` (the captured
    decode steps on CUDA, else None), ``pieces`` (steps with prompt tokens under a mixed-step budget, from graphs in
    pieces: :meth:`capture_pieces`, else None).

    On CUDA with Triton, decode steps of up to ``engine.max_batch_size`` sequences and steps with up to 256 prompt
    tokens (unless ``LLMC_GRAPH_CHUNKS=0``) replay CUDA graphs (:mod:`llmc.engine.torch.cuda_graphs`);
    ``cuda_graphs=False`` or ``LLMC_CUDA_GRAPHS=0`` runs them eagerly.
    The cache then holds one extra block, after the ``num_blocks`` the block manager hands out: the padding
    rows' scratch block.
    """

    def __init__(self, build_dir: str | Path, device: torch.device | str = "cpu", num_blocks: int | None = None,
                 cuda_graphs: bool = True):
        build_dir = Path(build_dir)
        manifest = read_manifest(build_dir)
        recipe = manifest.recipe_obj()
        engine = read_engine_config(build_dir / "engine")
        self.device = resolve_device(device)
        # On CPU: W4A16 layers stay packed int4 (8x fewer weight bytes per token) and llmc's CPU kernels run.
        self.model = load_model(build_dir / "engine" / engine["checkpoint"], self.device, cpu_kernels=True)
        config = self.model.config
        self.weight_bytes = weight_bytes(self.model)  # {dtype: bytes} of the weights as held on the device
        self.host_weight_bytes = host_weight_bytes(self.model)  # {dtype: bytes}: an input embedding in host memory
        self.int4_config_sources = config_sources(self.model)  # {int4 CUDA layer shape: whose kernel configs}
        # `auto` = the checkpoint's dtype (docs/RECIPE.md), also where CPU computes in float32: the CPU attention
        # kernel widens float16/bfloat16 caches exactly, and engine.json's kv_bytes_per_token holds on every device
        # (fp8: where the GPU runs it, else the checkpoint's dtype, said in the log).
        self.block_size = recipe.kv_cache.tokens_per_block
        kv_dtype, self.kv_fallback = runtime_kv_dtype(recipe.kv_cache.dtype, torch_dtype(config.dtype), self.device,
                                                      self.block_size, config.head_size)
        if self.kv_fallback:
            logger.warning("%s", self.kv_fallback)
        self.kv_dtype = kv_dtype
        self.max_prompt_chunk = min(recipe.engine.max_input_len, recipe.engine.max_num_tokens)
        self.max_num_tokens = recipe.engine.max_num_tokens
        self.vocab_size = config.vocab_size
        self.kv_bytes_per_token = kv_bytes_per_token(config, kv_dtype)
        self.num_blocks = num_blocks or plan_num_blocks(
            self.kv_bytes_per_token,
            self.block_size,
            self.device,
            recipe.kv_cache.cpu_budget_mb,
            recipe.kv_cache.memory_fraction,
        )
        use_graphs = (cuda_graphs and os.environ.get(CUDA_GRAPHS_ENV, "1") != "0"
                      and kernel_available(self.device, self.block_size, config.head_size))
        self.kv_caches = allocate_kv_cache(config, self.num_blocks + int(use_graphs), self.block_size, kv_dtype,
                                           self.device)
        fast_argmax = cpu_ext.argmax_rows if self.device.type == "cpu" and cpu_ext.load() is not None else None
        self.sampler = Sampler(self.device, eos_token_ids=manifest.eos_token_ids, argmax=fast_argmax)
        self.graphs: DecodeGraphs | None = None
        self.pieces: PieceGraphs | None = None
        if use_graphs:
            self.graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size,
                                       -(-recipe.engine.max_seq_len // self.block_size), recipe.engine.max_batch_size,
                                       scratch_block=self.num_blocks, device=self.device,
                                       chunk_rows=0 if os.environ.get(CHUNKS_ENV, "1") == "0" else max(
                                           recipe.engine.max_batch_size,
                                           min(CHUNK_ROWS, recipe.engine.max_num_tokens)))
            self.graphs.capture()

    late_masks = True  # launch() takes output-format masks after queuing the forward pass (its ``masks``)
    verifies_drafts = True  # steps may carry draft tokens (ScheduledSequence.num_draft): llmc.engine.torch.drafts

    @property
    def draft_limits(self) -> tuple[int, int] | None:
        """With CUDA graphs, the rows and row contexts a step with draft tokens may have and still replay one (the
        scheduler keeps drafts within them); None: eager steps, no bound."""
        return self.graphs.draft_limits() if self.graphs is not None else None

    @property
    def async_steps(self) -> bool:
        """True when :meth:`launch` returns before the step's GPU work is done (CUDA)."""
        return self.device.type == "cuda"

    def execute(self, scheduled: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; returns the sampled token of every sequence with ``sample=True``.

        Raises EngineError when a sequence references a block outside ``0 .. num_blocks - 1``.
        """
        return self.launch(scheduled).result()

    def launch(self, scheduled: SchedulerOutput, previous: PendingStep | None = None,
               masks: Callable[[], SchedulerOutput] | None = None) -> PendingStep:
        """Queue one step (see :meth:`execute`); on CUDA the sampled ids travel to pinned host memory behind the
        step's kernels and :meth:`PendingStep.result` waits for them, so the caller's host work overlaps the GPU.
        A :data:`PLACEHOLDER` token is the id ``previous`` (the step launched just before, possibly still running)
        sampled for that request: it is copied on the device, so this step can be queued before that one ends.
        Call ``previous.result()`` before launching the step after this one. ``masks`` (late output-format masks):
        called once the step's forward pass is queued and before its sampler, it returns the same step with the
        sequences' ``token_mask`` set (computed on the host while the GPU runs the forward pass)."""
        seqs = scheduled.sequences
        if not seqs:
            if masks is not None:
                masks()
            return PendingStep(())
        self._check_blocks(seqs)
        fill = _placeholder_fill(seqs, previous)
        sampled = tuple(s for s in seqs if s.sample)
        draft_rows = verify_rows(seqs)  # rows whose chosen tokens check draft tokens (none without speculation)
        score = prompt_logprobs.wanted(seqs)  # prompt log-probabilities need every row's hidden state: eager
        if self.graphs is not None and not score and self.graphs.can_run(seqs):
            with torch.inference_mode():
                logits, greedy = self.graphs.run(seqs, fill)
                verify = drafts.choose(self.sampler, seqs, *self.graphs.rows_at(draft_rows)) if draft_rows else None
                sampled = _late_masks(masks, sampled)
                if draft_rows:
                    sampled = drafts.after_drafts(sampled)
                if not sampled:  # prompt chunks that end no prompt
                    return PendingStep(())
                # Plain greedy rows need nothing the graph did not compute: no sampler kernels for the step.
                token_ids = greedy if self.sampler.plain_greedy(sampled) else self.sampler(logits, list(sampled))
                logprobs = token_logprobs(logits, token_ids, sampled)
            return PendingStep(sampled, token_ids, logprobs, drafts=verify)
        meta = build_attention_metadata(seqs, self.block_size, self.device)
        input_ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.int64).to(self.device,
                                                                                              non_blocking=True)
        with torch.inference_mode():
            if fill is not None:  # placeholders at their packed rows of the flat input
                at = torch.tensor(fill[0], dtype=torch.int64).to(self.device, non_blocking=True)
                input_ids.index_copy_(0, at, fill[1].to(input_ids.dtype))
            if self.pieces is not None and self.pieces.can_run(input_ids.shape[0]):
                hidden = self.pieces.run(input_ids, meta)  # [T, H]
            else:
                hidden = self.model(input_ids, meta.positions, meta, self.kv_caches)  # [T, H]
            scored = prompt_logprobs.prompt_rows(self.model.compute_logits, hidden, seqs) if score else None
            sampled = _late_masks(masks, sampled)
            if draft_rows:
                sampled = drafts.after_drafts(sampled)
            if not sampled:
                return PendingStep((), prompt=scored)
            rows = meta.logits_indices
            if draft_rows:  # the drafted rows' logits in the same product (one read of the lm_head)
                rows = torch.cat([rows, torch.tensor(draft_rows, dtype=torch.int64).to(self.device, non_blocking=True)])
            logits = self.model.compute_logits(hidden.index_select(0, rows))  # [S (+ R), V] float32
            verify = drafts.choose(self.sampler, seqs, logits[len(sampled):]) if draft_rows else None
            logits = logits[:len(sampled)]
            token_ids = self.sampler(logits, list(sampled))  # [S] on device
            logprobs = token_logprobs(logits, token_ids, sampled)  # None unless a request asks for them
        return PendingStep(sampled, token_ids, logprobs, scored, verify)

    def capture_pieces(self, budget: int) -> list[int]:
        """CUDA with the decode graphs: capture the steps a mixed-step ``budget`` (``serving.mixed_step_tokens``;
        0: none) makes, in pieces by token count (:mod:`llmc.engine.torch.piece_graphs`). Returns the buckets
        captured (none on CPU, without the graphs, with ``LLMC_PIECE_GRAPHS=0``, or, with a warning, when they do
        not fit in the GPU memory the KV cache left). Call it after :meth:`warmup`: it writes only the scratch
        block."""
        buckets = piece_buckets(budget, self.max_num_tokens)
        if self.graphs is None or not self.model.cuda_fused or not buckets or not pieces_enabled():
            return []
        pieces = PieceGraphs(self.model, self.kv_caches, buckets, self.num_blocks * self.block_size, self.device)
        try:
            pieces.capture()
        except torch.cuda.OutOfMemoryError as exc:  # the KV cache took the memory first: the steps stay eager
            reason = str(exc).splitlines()[0]
        else:
            self.pieces = pieces
            return buckets
        pieces = None  # its graphs and buffers are freed (the exception that held them is gone)
        torch.cuda.empty_cache()
        logger.warning("the mixed-step budget's CUDA graphs (%d-%d tokens) did not fit in GPU memory (%s); those "
                       "steps run eagerly. Fix: lower kv_cache.memory_fraction or serving.mixed_step_tokens",
                       buckets[0], buckets[-1], reason)
        return []

    def warmup(self, prompt_len: int = 8) -> None:
        """Tiny prefills and a decode (greedy) so the first real request does not pay the first-call costs (Triton
        compiles, cuBLAS workspaces), and on CUDA cuDNN's attention plans for every prompt length bucket up to the
        longest prompt chunk (:func:`attention.warm_prompt_buckets`). The prefills run eagerly, the path of
        prompts longer than the graphs' rows; on CUDA a second one of up to :data:`WARMUP_LONG_PROMPT` tokens
        takes the int4 layers' prefill path too (dequantize + cuBLAS from their ``dense_from_m`` rows), and its
        last :data:`WARMUP_CONTINUATION` tokens come as a chunk over the cached rest, so the paged prefill kernel
        (:mod:`llmc.engine.torch.triton_prefill`) is compiled here, not at the first prompt cut while serving.

        Writes into the first blocks only; that is harmless: a sequence only ever reads slots it wrote itself.
        """
        config = self.model.config
        attention.warm_prompt_buckets(config.num_heads, config.num_kv_heads, config.head_size,
                                      torch_dtype(config.dtype), self.device, self.max_prompt_chunk)
        greedy = SamplingParams(temperature=0.0, max_new_tokens=2)
        short = min(prompt_len, self.block_size - 1)
        prompts = [(0, short)]  # each prompt's chunk bounds
        if self.device.type == "cuda":
            long = min(WARMUP_LONG_PROMPT, self.max_prompt_chunk, self.num_blocks * self.block_size - 1)
            cut = long - WARMUP_CONTINUATION
            prompts.append((0, cut, long) if cut > WARMUP_CONTINUATION else (0, long))
        graphs, self.graphs = self.graphs, None  # the eager path first
        try:
            for bounds in prompts:
                length = bounds[-1]
                prompt = tuple(i % config.vocab_size for i in range(length))
                blocks = tuple(range(-(-(length + 1) // self.block_size)))
                for start, end in zip(bounds, bounds[1:]):
                    chunk = ScheduledSequence(WARMUP_REQUEST_ID, prompt[start:end], start, blocks, end == length,
                                              greedy, prompt_token_ids=prompt)
                    first = self.execute(SchedulerOutput(step=-2, sequences=(chunk,)))
        finally:
            self.graphs = graphs
        token = first.sampled_token_ids[WARMUP_REQUEST_ID]
        decode = ScheduledSequence(WARMUP_REQUEST_ID, (token,), len(prompt), blocks, True, greedy,
                                   prompt_token_ids=prompt, output_token_ids=(token,))
        self.execute(SchedulerOutput(step=-1, sequences=(decode,)))
        if self.device.type == "cuda":  # compiled here too: the sampler's masked greedy kernel and its top-p cut
            self.warm_masks(decode)
            self.execute(SchedulerOutput(step=-1, sequences=(dataclasses.replace(decode, params=WARMUP_TOP_P),)))

    def warm_masks(self, decode: ScheduledSequence) -> ModelRunnerOutput:
        """Run the warm-up's ``decode`` again under an output-format mask that allows every id (the same slot is
        written again), so a greedy step under masks has run once (on CUDA: ``masked_argmax``'s Triton compile)."""
        every = np.full(-(-self.vocab_size // 32), -1, dtype=np.int32)
        return self.execute(SchedulerOutput(step=-1, sequences=(dataclasses.replace(decode, token_mask=every),)))

    def _check_blocks(self, seqs: tuple[ScheduledSequence, ...]) -> None:
        for s in seqs:
            if s.block_ids and (max(s.block_ids) >= self.num_blocks or min(s.block_ids) < 0):
                raise EngineError(
                    f"request {s.request_id} references blocks {min(s.block_ids)}..{max(s.block_ids)} but the "
                    f"KV cache has {self.num_blocks} blocks. Fix: size the block manager with runner.num_blocks"
                )


def _late_masks(masks: Callable[[], SchedulerOutput] | None, sampled: tuple[ScheduledSequence, ...]
                ) -> tuple[ScheduledSequence, ...]:
    """The sampled sequences with their late output-format masks (:meth:`TorchModelRunner.launch`'s ``masks``: the
    same sequences, in the same order, ``token_mask`` set); ``sampled`` itself without them."""
    if masks is None:
        return sampled
    late = tuple(s for s in masks().sequences if s.sample)
    if [s.request_id for s in late] != [s.request_id for s in sampled]:
        raise EngineError("the late output-format masks came back for other rows than the step's")
    return late


def _placeholder_fill(seqs: tuple[ScheduledSequence, ...], previous: PendingStep | None
                      ) -> tuple[list[int], torch.Tensor] | None:
    """For the sequences whose token is a :data:`PLACEHOLDER` (a sequence's last new token): its row among the
    step's packed tokens (the eager input's and the graphs' alike, :func:`last_rows`) and the ids ``previous``
    sampled for them (a tensor on the device, in that order); None when there is none."""
    placeholders = [i for i, s in enumerate(seqs) if s.token_ids and s.token_ids[-1] == PLACEHOLDER]
    if not placeholders:
        return None
    if previous is None or previous.device_ids is None:
        raise EngineError("a step has placeholder tokens but no previous step on the device to take them from")
    src = [previous.row_of[seqs[i].request_id] for i in placeholders]
    index = torch.tensor(src, dtype=torch.int64).to(previous.device_ids.device, non_blocking=True)
    ends = last_rows(seqs)
    return [ends[i] for i in placeholders], previous.device_ids.index_select(0, index)


class PendingStep:
    """A launched step's sampled ids (and log-probabilities; ``prompt``: its prompt chunks' own): on CUDA an
    asynchronous copy to pinned host memory and its event; ``device_ids`` and ``row_of`` (request id -> row) let
    the next step take the ids on the device."""

    def __init__(self, seqs: tuple[ScheduledSequence, ...], token_ids: torch.Tensor | None = None,
                 logprobs: LogprobRows | None = None, prompt: PromptRows | None = None,
                 drafts: DraftRows | None = None):
        self._ids = tuple(s.request_id for s in seqs)
        self._drafts = drafts
        self._event: torch.cuda.Event | None = None
        self._host = token_ids
        self.device_ids = token_ids
        self.row_of = {rid: i for i, rid in enumerate(self._ids)}
        self._result: ModelRunnerOutput | None = None
        self._logprobs = logprobs
        self._prompt = prompt
        # the tensors result() reads: on CUDA, copies to page-locked host memory behind the step's kernels
        self._lp_host = (logprobs.chosen, logprobs.top_logprobs, logprobs.top_ids) if logprobs else ()
        self._prompt_host = prompt.tensors() if prompt else ()
        self._drafts_host = drafts.tensors() if drafts else ()
        if (token_ids is not None and token_ids.is_cuda) or (prompt is not None and prompt.chosen.is_cuda):
            self._host = _to_host(token_ids) if token_ids is not None else None
            self._lp_host = tuple(_to_host(t) for t in self._lp_host)
            self._prompt_host = tuple(_to_host(t) for t in self._prompt_host)
            self._drafts_host = tuple(_to_host(t) for t in self._drafts_host)
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> ModelRunnerOutput:
        """Wait for the step; the sampled token of every sequence that samples."""
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()  # releases the GIL while the GPU finishes
            prompt = self._prompt.entries(self._prompt_host) if self._prompt is not None else {}
            if self._host is None:
                self._result = ModelRunnerOutput(prompt_logprobs=prompt)
            else:
                ids = self._host.tolist()
                verify, verify_lps = self._drafts.entries(self._drafts_host) if self._drafts else ({}, {})
                self._result = ModelRunnerOutput(sampled_token_ids=dict(zip(self._ids, ids, strict=True)),
                                                 logprobs=self._token_logprobs(ids), prompt_logprobs=prompt,
                                                 verify_token_ids=verify, verify_logprobs=verify_lps)
        return self._result

    def _token_logprobs(self, ids: list[int]) -> dict[str, TokenLogprob]:
        if self._logprobs is None:
            return {}
        chosen, top_lps, top_ids = (t.tolist() for t in self._lp_host)
        out = {}
        for j, (row, count) in enumerate(zip(self._logprobs.rows, self._logprobs.counts)):
            top = tuple(zip(top_ids[j][:count], top_lps[j][:count]))
            out[self._ids[row]] = TokenLogprob(ids[row], chosen[j], top)
        return out


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """An asynchronous copy of a CUDA tensor to page-locked host memory (ready once the step's event is)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
