"""The Python API: ``Engine.from_dir(build_dir)`` -> ``generate`` / ``stream`` / ``astream`` / ``abort``.

Each engine step (:mod:`llmc.runtime.step_cycle`) turns the scheduler's plan into a runner call and every new
token into a :class:`StreamEvent` delivered to its request's sink; on CUDA a decode step is planned and launched
before the previous step's tokens reach the host, and those tokens are processed while the GPU runs it.

Threading: request preparation (tokenization, chat templates, validation) runs in the caller's thread;
scheduler state is guarded by one lock that is *not* held while the model runs, so callers can add and
abort requests during a step. ``start()`` runs steps in a background thread for concurrent callers
(threads or asyncio, e.g. the server); without it, ``generate``/``stream`` drive the steps themselves.
Either way the model itself (loading, warm-up, ``runner.execute``) runs on the process's one compute thread
(:mod:`llmc.runtime.compute`), which keeps torch's CPU thread team from being throttled.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from llmc.engine.base import load_runner
from llmc.engine.tensorrt_llm.engine import TrtllmEngine
from llmc.engine.types import StepRunner
from llmc.errors import EngineError, QueueFullError, RequestError
from llmc.manifest import read_manifest
from llmc.recipe import Recipe
from llmc.request.detokenize import byte_fallback_token_ids
from llmc.request.inputs import Prompt, check_prompt_length, max_prompt_chars, prompt_to_token_ids
from llmc.request.metrics import MetricsLog, PromptTiming, RequestMetrics
from llmc.request.outputs import Completion, RequestOutput, StreamEvent
from llmc.request.params import SamplingParams
from llmc.request.structured import Grammars
from llmc.runtime.engine_loop import EngineLoop
from llmc.runtime.kv_cache import BlockManager
from llmc.runtime.compute import run_compute
from llmc.runtime.request_events import RequestEvents
from llmc.runtime.step_cycle import StepCycle
from llmc.runtime.scheduler import Request, Scheduler
from llmc.runtime.scheduler.speculate import MAX_DRAFT_TOKENS, PromptLookup
from llmc.tokenizer import load_tokenizer

log = logging.getLogger(__name__)
Sink = Callable[[StreamEvent], None]
_LAST_EVENT_WAIT_S = 1.0  # a request finished in another thread: how long its last event may take to reach a stream


class Engine:
    """A loaded engine serving requests with continuous batching over a paged KV cache.

    ``runner`` is a :class:`~llmc.engine.types.StepRunner` (``block_size``, ``num_blocks``, ``vocab_size``,
    ``execute(SchedulerOutput) -> ModelRunnerOutput``); EngineError for any other runner (a TensorRT-LLM runner
    batches by itself: ``Engine.from_dir`` opens such a build). Default sampling parameters are the recipe's
    ``runtime.sampling``. ``num_blocks`` uses only part of the runner's KV cache (tests force preemption
    with it); ``max_wait_s`` bounds how long a low-priority request waits before it is served first;
    ``prefix_caching`` overrides the recipe's ``serving.enable_kv_cache_reuse`` (None keeps it), and
    ``mixed_step_tokens`` its ``serving.mixed_step_tokens`` (None keeps it; 0 = no budget for steps with decodes),
    ``speculative_tokens`` its ``serving.speculative_tokens`` (None keeps it; 0 = no draft tokens): requests
    then verify up to that many tokens looked up in their own context each step (:mod:`llmc.runtime.scheduler.
    speculate`; ``stats()`` counts the drafted and accepted tokens).
    """

    def __init__(self, runner: StepRunner, tokenizer: Any, recipe: Recipe, eos_token_ids: Sequence[int],
                 metrics_log: str | Path | None = None, max_wait_s: float | None = None,
                 num_blocks: int | None = None, clock: Callable[[], float] = time.perf_counter,
                 prefix_caching: bool | None = None, mixed_step_tokens: int | None = None,
                 speculative_tokens: int | None = None):
        if not isinstance(runner, StepRunner):
            raise EngineError(f"Engine drives step runners (block_size, num_blocks, execute), not a "
                              f"{type(runner).__name__}. Fix: open the build folder with Engine.from_dir, which "
                              f"picks the engine its backend needs")
        self.runner = runner
        self.tokenizer = tokenizer
        self.recipe = recipe
        self.eos_token_ids = tuple(eos_token_ids)
        self.default_params = recipe.runtime.sampling
        self._byte_token_ids = byte_fallback_token_ids(tokenizer)
        self.grammars = Grammars(tokenizer, runner.vocab_size, self.eos_token_ids)  # SamplingParams.structured
        self.max_prompt_chars = max_prompt_chars(tokenizer, recipe.engine.max_input_len)
        self.clock = clock
        limits = recipe.engine
        if num_blocks is not None and not 0 < num_blocks <= runner.num_blocks:
            raise ValueError(f"num_blocks must be in 1..{runner.num_blocks} (the runner's KV cache), got {num_blocks}")
        self.block_manager = BlockManager(num_blocks or runner.num_blocks, runner.block_size,
                                          enable_prefix_caching=recipe.serving.enable_kv_cache_reuse
                                          if prefix_caching is None else prefix_caching)
        if mixed_step_tokens is not None and mixed_step_tokens < 0:
            raise ValueError(f"mixed_step_tokens must be >= 0 (0: no budget), got {mixed_step_tokens}")
        self.scheduler = Scheduler(self.block_manager, limits.max_batch_size, limits.max_num_tokens,
                                   limits.max_seq_len, recipe.serving.max_queue_size, max_wait_s, clock,
                                   max_mixed_tokens=recipe.serving.mixed_step_tokens
                                   if mixed_step_tokens is None else mixed_step_tokens,
                                   speculator=_speculator(runner, recipe.serving, speculative_tokens),
                                   draft_limits=getattr(runner, "draft_limits", None))
        self._outputs: dict[str, RequestOutput] = {}
        self._lock = threading.RLock()  # scheduler + outputs; re-entrant so a sink may call abort()
        self._steps = StepCycle(self.scheduler, runner, self._outputs, self._lock, clock,
                                MetricsLog(metrics_log) if metrics_log else None)
        self._loop = EngineLoop(self.step, self.scheduler.has_unfinished)

    @classmethod
    def from_dir(cls, path: str | Path, device: str = "auto", num_blocks: int | None = None,
                 metrics_log: str | Path | None = None, max_wait_s: float | None = None,
                 warmup: bool = True, prefix_caching: bool | None = None,
                 mixed_step_tokens: int | None = None, speculative_tokens: int | None = None,
                 prepare_formats: bool = True) -> Engine:
        """Load a build folder (``llmc build`` output). ``device``: "auto" (CUDA if available), "cpu", "cuda".

        A ``backend: tensorrt_llm`` build returns a :class:`~llmc.engine.tensorrt_llm.engine.TrtllmEngine`
        (``generate``/``stream`` over TensorRT-LLM's ModelRunnerCpp; concurrency belongs to Triton there).

        ``num_blocks`` overrides the KV-cache size planned from the recipe. ``warmup`` runs the runner's
        warm-up (when it has one) before any request, so the first request is not the slow one, and with
        ``prepare_formats`` builds the structured outputs' tokenizer index before returning
        (:meth:`~llmc.request.structured.Grammars.prepare`); without it, the first request with a format builds it.
        ``prefix_caching``, ``mixed_step_tokens`` and ``speculative_tokens`` override the recipe's
        ``serving.enable_kv_cache_reuse``, ``serving.mixed_step_tokens`` and ``serving.speculative_tokens`` (torch
        backend only)."""
        build_dir = Path(path)
        manifest = read_manifest(build_dir)
        if manifest.backend == "tensorrt_llm":
            if prefix_caching is not None:  # TensorRT-LLM fixes KV-cache reuse when its engine is built
                raise RequestError("prefix_caching", "a tensorrt_llm build reuses KV blocks as its recipe's "
                                   "serving.enable_kv_cache_reuse says; change it there and rebuild")
            if mixed_step_tokens is not None:  # TensorRT-LLM's own scheduler batches the steps
                raise RequestError("mixed_step_tokens", "a tensorrt_llm build schedules its steps in TensorRT-LLM's "
                                   "batch manager; mixed_step_tokens applies to the torch backend only")
            if speculative_tokens:
                raise RequestError("speculative_tokens", "a tensorrt_llm build decodes in TensorRT-LLM's batch "
                                   "manager; prompt-lookup speculation applies to the torch backend only")
            return TrtllmEngine.from_build_dir(build_dir)  # type: ignore[return-value]
        recipe = manifest.recipe_obj()
        tokenizer = load_tokenizer(build_dir / "tokenizer")

        budget = recipe.serving.mixed_step_tokens if mixed_step_tokens is None else mixed_step_tokens

        def load() -> Any:
            runner = load_runner(build_dir, device, num_blocks)
            runner_warmup = getattr(runner, "warmup", None)
            if warmup and runner_warmup is not None:
                runner_warmup()  # before the block manager exists: no request's blocks can be touched
            capture_pieces = getattr(runner, "capture_pieces", None)
            if capture_pieces is not None and budget:
                capture_pieces(budget)  # the budget's steps from CUDA graphs in pieces (CUDA only)
            return runner

        runner = run_compute(load)  # loading, warm-up and steps share one thread (llmc/runtime/compute.py)
        engine = cls(runner, tokenizer, recipe, manifest.eos_token_ids, metrics_log=metrics_log,
                     max_wait_s=max_wait_s, prefix_caching=prefix_caching, mixed_step_tokens=mixed_step_tokens,
                     speculative_tokens=speculative_tokens)
        if warmup and prepare_formats:  # structured outputs' tokenizer index, off every request's path
            engine.grammars.prepare()
        return engine

    # ----------------------------------------------------------------------------------------- requests
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, sink: Sink | None = None, timing: PromptTiming | None = None) -> str:
        """Validate and queue a request; returns its id. ``priority``: lower number = served first.

        Raises RequestError (bad prompt or params, naming the field) or QueueFullError (retry later).
        ``sink`` (optional) receives this request's events from the stepping thread. ``timing``: for a prompt
        tokenized before (a server's, as token ids), when it was accepted and what its template and tokenizing
        took; the request's metrics (TTFT from acceptance) use it instead of this call's own."""
        arrival = self.clock()
        params = self.default_params if params is None else params
        params.validate(self.runner.vocab_size)
        timings: dict[str, float] = {}
        ids = self.tokenize(prompt, timings)
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        if timing is None:
            timing = PromptTiming(arrival, timings.get("template", 0.0), timings.get("tokenize", 0.0))
        compile_start = self.clock()
        constraint = self.grammars.compile(params.structured) if params.structured is not None else None
        compile_time = self.clock() - compile_start if constraint is not None else 0.0
        metrics = RequestMetrics(arrival_time=timing.arrival_time, prompt_tokens=len(ids),
                                 template_time=timing.template_time, tokenize_time=timing.tokenize_time,
                                 format_compile_time=compile_time, queued_time=self.clock())
        output = RequestOutput(request_id, ids, params, self.tokenizer, self.eos_token_ids,
                               self.recipe.engine.max_seq_len, metrics, sink, self._byte_token_ids, constraint)
        with self._lock:
            if request_id in self._outputs:
                raise RequestError("request_id", f"{request_id!r} is already in flight; use a unique id")
            self.scheduler.add(Request(request_id, ids, params, priority=priority))
            self._outputs[request_id] = output
        self._loop.wake()
        return request_id

    def tokenize(self, prompt: Prompt, timings: dict[str, float] | None = None, add_special_tokens: bool | None = None,
                 check_length: bool = True) -> tuple[int, ...]:
        """The prompt's token ids, as :meth:`add_request` computes them (any thread). RequestError for a
        prompt longer than ``max_input_len`` (refused by size before tokenizing when it is far too long).
        ``timings`` (optional) gets the seconds of the chat template and of tokenizing (``"template"``,
        ``"tokenize"``). For counting tokens (a server's ``/tokenize``): ``add_special_tokens`` overrides the
        recipe's ``model.add_special_tokens`` for text, and ``check_length=False`` returns the ids of a prompt
        over ``max_input_len`` too (the size limit still holds)."""
        special = self.recipe.model.add_special_tokens if add_special_tokens is None else add_special_tokens
        ids = prompt_to_token_ids(self.tokenizer, prompt, special, self.runner.vocab_size, self.max_prompt_chars,
                                  timings)
        if check_length:
            check_prompt_length(len(ids), self.recipe.engine.max_input_len)
        return ids

    def abort(self, request_id: str) -> bool:
        """Cancel a request from any thread: frees its KV blocks and ends its stream with finish_reason
        "abort". Returns False when the request is unknown or already finished."""
        with self._lock:
            output = self._outputs.get(request_id)
            if output is None:
                return False
            self._steps.emit(output, output.terminal(self.clock(), "abort"))
            self._steps.retire(request_id)
        return True

    # --------------------------------------------------------------------------------------------- step
    def step(self) -> list[StreamEvent]:
        """Run one engine step (:class:`~llmc.runtime.step_cycle.StepCycle`); returns the events it produced (also
        delivered to each request's sink). An exception in the step fails the requests it scheduled (an "error"
        event each, blocks freed); the other requests keep going."""
        return self._steps.step()

    @property
    def overlapped_steps(self) -> bool:
        """True when a step's tokens are processed while the next step runs (a runner with ``async_steps``)."""
        return self._steps.overlapped_steps

    def flush_metrics(self) -> None:
        """Wait for the step in progress, then write every metrics record so far to the metrics log's file
        (readers of the log call this first: records are buffered between steps)."""
        self._steps.flush_metrics()

    # --------------------------------------------------------------------------------- high-level API
    def generate(self, prompts: Sequence[Prompt] | Prompt,
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Completion]:
        """Generate for a batch of prompts (continuous batching across them); returns completions in order.

        ``params``: one SamplingParams for all, one per prompt, or None (recipe defaults). Requests beyond
        the queue's capacity are submitted as room frees up. Raises EngineError if a request fails."""
        if isinstance(prompts, (str, bytes)) or (prompts and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]
        per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise RequestError("params", f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        for p in per_prompt:  # fail fast before anything is queued
            (self.default_params if p is None else p).validate(self.runner.vocab_size)
        inbox: queue.Queue[StreamEvent] = queue.Queue()
        events: dict[str, list[StreamEvent]] = {}
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, per_prompt):
                ids.append(self._submit_when_room(prompt, p, inbox.put))
                events[ids[-1]] = []
            done = 0
            while done < len(ids):
                event = self.next_event(inbox)
                events[event.request_id].append(event)
                done += event.finished
        except BaseException:
            for request_id in ids:
                self.abort(request_id)
            raise
        for request_id in ids:
            _raise_if_error(events[request_id][-1])
        return [Completion.from_events(prompt, events[i]) for prompt, i in zip(prompts, ids)]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
               priority: int = 0) -> Iterator[StreamEvent]:
        """Yield the request's events as tokens arrive; the last has ``finished=True``.

        Closing the iterator early aborts the request (its blocks are freed). Raises EngineError if the
        request fails in the step loop."""
        with RequestEvents(self, prompt, params, request_id, priority) as events:
            for event in events:
                _raise_if_error(event)
                yield event

    async def astream(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                      priority: int = 0) -> AsyncIterator[StreamEvent]:
        """Async version of :meth:`stream`. Tokenization runs in a worker thread, never on the event loop;
        with ``start()`` the background loop steps, otherwise steps run in a worker thread."""
        async with RequestEvents(self, prompt, params, request_id, priority) as events:
            async for event in events:
                _raise_if_error(event)
                yield event

    def _submit_when_room(self, prompt: Prompt, params: SamplingParams | None, sink: Sink) -> str:
        """add_request, waiting (or stepping) while the waiting queue is full."""
        while True:
            try:
                return self.add_request(prompt, params, sink=sink)
            except QueueFullError:
                if self._loop.running:
                    time.sleep(0.005)
                else:
                    self.step()

    async def anext_event(self, inbox: asyncio.Queue[StreamEvent]) -> StreamEvent:
        """The next event a sink put into ``inbox`` (see :meth:`next_event`), from a coroutine: steps run in a
        worker thread when no background loop runs."""
        while inbox.empty() and not self._loop.running:
            if not self.scheduler.has_unfinished():  # finished in another thread (shutdown's aborts): its last
                try:  # event's put is scheduled on this event loop, which runs it once this coroutine waits
                    return await asyncio.wait_for(inbox.get(), _LAST_EVENT_WAIT_S)
                except asyncio.TimeoutError:
                    raise AssertionError("a stream waits for an event, but no request is unfinished") from None
            await asyncio.to_thread(self.step)
            await asyncio.sleep(0)  # let the sink callbacks scheduled by that step run
        return await inbox.get()

    def next_event(self, inbox: queue.Queue) -> StreamEvent:
        """The next event a request's sink (``inbox.put``) delivered, stepping the engine in this thread when no
        background loop runs."""
        while True:
            try:
                return inbox.get_nowait()
            except queue.Empty:
                pass
            if self._loop.running:
                try:
                    return inbox.get(timeout=0.1)
                except queue.Empty:
                    continue
            if not self.scheduler.has_unfinished():  # finished in another thread since the check above: its last
                try:  # event went in first (emitted before the request was retired)
                    return inbox.get(timeout=_LAST_EVENT_WAIT_S)
                except queue.Empty:
                    raise AssertionError("a stream waits for an event, but no request is unfinished") from None
            self.step()

    # ------------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Run the step loop in a background thread (for concurrent callers, e.g. the server)."""
        self._loop.start()

    def shutdown(self) -> None:
        """Stop the background loop, abort every unfinished request (their streams end with "abort") and close
        the metrics log."""
        self._loop.stop()
        with self._lock:
            ids = list(self._outputs)
        for request_id in ids:
            self.abort(request_id)
        self._steps.close_metrics()  # later steps (the engine stays usable synchronously) are not logged

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def stats(self) -> dict[str, float]:
        """Current load: running / waiting requests, KV blocks used / free / total, preemptions so far, the
        prompt tokens looked up in the prefix cache / served from cached blocks so far, and the output-format masks
        computed so far and the host seconds they took (``structured_masks``, ``structured_mask_seconds``)."""
        with self._lock:
            return {
                "running": self.scheduler.num_running,
                "waiting": self.scheduler.num_waiting,
                "kv_blocks_used": self.block_manager.num_used_blocks,
                "kv_blocks_free": self.block_manager.num_free_blocks,
                "kv_blocks_total": self.block_manager.num_blocks,
                "preemptions": self.scheduler.num_preemptions_total,
                "prefix_cache_queried_tokens": self.block_manager.queried_tokens,
                "prefix_cache_hit_tokens": self.block_manager.hit_tokens,
                "structured_masks": self._steps.masks_total,
                "structured_mask_seconds": self._steps.mask_seconds_total,
                "draft_tokens": self.scheduler.drafted_tokens_total,
                "accepted_draft_tokens": self.scheduler.accepted_tokens_total,
            }


def _speculator(runner: StepRunner, serving: Any, speculative_tokens: int | None) -> PromptLookup | None:
    """The scheduler's draft-token proposer (``serving.speculative_tokens``, overridden by ``speculative_tokens``;
    None when 0)."""
    count = serving.speculative_tokens if speculative_tokens is None else speculative_tokens
    if not 0 <= count <= MAX_DRAFT_TOKENS:
        raise ValueError(f"speculative_tokens must be in 0..{MAX_DRAFT_TOKENS} (0: off), got {count}")
    if not count:
        return None
    if not getattr(runner, "verifies_drafts", False):
        raise EngineError(f"{type(runner).__name__} cannot verify draft tokens. Fix: set serving.speculative_tokens "
                          "to 0 (or pass speculative_tokens=0)")
    return PromptLookup(count, serving.prompt_lookup_min, serving.prompt_lookup_max)


def _raise_if_error(event: StreamEvent) -> None:
    if event.finish_reason == "error":
        raise EngineError(f"request {event.request_id} failed in the engine step: {event.error}")
