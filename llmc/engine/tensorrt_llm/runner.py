"""llmc's runtime adapter over TensorRT-LLM's ``ModelRunnerCpp`` (TensorRT-LLM 1.0 - 1.2).

TensorRT-LLM batches and samples inside its C++ executor; llmc keeps the parts users see identical
to the torch backend by running every token TensorRT-LLM returns through the torch engine's own
per-request output pipeline, :class:`llmc.request.outputs.RequestOutput` (stop ids ->
IncrementalDetokenizer -> StopStringMatcher -> length limits), which yields the same
:class:`StreamEvent` objects with the same finish reasons and metrics.

Streaming outputs: each item is a dict with ``output_ids`` int32 [batch, beams, max_seq_len] padded with
end_id *including the prompt*, and ``sequence_lengths`` [batch, beams]; the new tokens of request b are
``output_ids[b, 0, prompt_len:sequence_lengths[b, 0]]``. llmc slices from the tokens it has already
emitted, so it does not matter whether TensorRT-LLM sends cumulative or partial outputs.

When TensorRT-LLM's stream ends before llmc's pipeline saw a stop or a length limit, it stopped at
``end_id`` without counting it in ``sequence_lengths``: llmc then feeds ``end_id`` through the pipeline,
which finishes the request with reason "stop" and stop_reason end_id, like the torch backend does when
it samples the eos token. (If TensorRT-LLM does count it, the pipeline sees it first; either way one
finished event per request.)

Early finishes. ``generate`` enqueues every request on the runner's executor and its stream generator
awaits responses until each of *its* requests sent a final one; a response for any other request id makes
it raise (``request_ids.index``). So a request llmc finishes first (stop string, detokenizer, an abandoned
stream, an error) must not stay running in the executor: its responses would reach the next ``generate``.
llmc records the executor request ids (:class:`ExecutorIds`, a proxy around ``runner.executor``), cancels
each request it finishes early (``Executor.cancel_request``; the executor then sends that request's final
response, finish reason CANCELLED) and drains the stream before ``stream_batch`` returns.
"""

from __future__ import annotations

import datetime
import importlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmc.engine.tensorrt_llm.manifest import check_engine_versions
from llmc.engine.tensorrt_llm.sampling import generate_kwargs
from llmc.engine.tensorrt_llm.versions import Importer, require_tensorrt_llm
from llmc.errors import RequestError
from llmc.manifest import read_manifest
from llmc.recipe import Recipe
from llmc.request.metrics import RequestMetrics
from llmc.request.outputs import Completion, RequestOutput, StreamEvent
from llmc.request.params import SamplingParams
from llmc.tokenizer import load_tokenizer


@dataclass(frozen=True)
class TrtllmRunnerConfig:
    """The ``ModelRunnerCpp.from_dir`` arguments, taken from the recipe the engine was built with."""

    engine_dir: Path
    rank: int
    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    kv_cache_free_gpu_memory_fraction: float
    enable_chunked_context: bool

    @classmethod
    def from_recipe(cls, recipe: Recipe, engine_dir: Path, rank: int = 0) -> TrtllmRunnerConfig:
        return cls(Path(engine_dir), rank, recipe.engine.max_batch_size, recipe.engine.max_input_len,
                   recipe.engine.max_seq_len, recipe.kv_cache.memory_fraction,
                   recipe.serving.enable_chunked_context)

    def from_dir_kwargs(self) -> dict[str, Any]:
        """``max_output_len`` = max_seq_len - max_input_len: from_dir sizes sequences as input + output."""
        return {
            "rank": self.rank, "max_batch_size": self.max_batch_size, "max_input_len": self.max_input_len,
            "max_output_len": self.max_seq_len - self.max_input_len,
            "kv_cache_free_gpu_memory_fraction": self.kv_cache_free_gpu_memory_fraction,
            "enable_chunked_context": self.enable_chunked_context,
        }


class ExecutorIds:
    """Stands between ``ModelRunnerCpp`` and its ``executor``: remembers the request ids of the last
    ``enqueue_requests`` call (in batch order) and which requests have sent their final response (or an
    error); every other attribute is the executor's own."""

    def __init__(self, executor: Any):
        self._executor = executor
        self.last: list[int] = []
        self.done: set[int] = set()

    def enqueue_requests(self, requests: Any) -> list[int]:
        self.last = list(self._executor.enqueue_requests(requests))
        return self.last

    def await_responses(self, *args: Any, **kwargs: Any) -> list[Any]:
        responses = self._executor.await_responses(*args, **kwargs)
        for response in responses:  # the overloads used here (all ids, one id) return a flat list
            if response.has_error() or response.result.is_final:
                self.done.add(response.request_id)
        return responses

    def cancel_unfinished(self, request_ids: Sequence[int]) -> None:
        """``cancel_request`` each id that has not sent its final response (a finished id would stay in the
        executor's cancelled set for good)."""
        for rid in request_ids:
            if rid not in self.done:
                self._executor.cancel_request(rid)

    def forget(self, request_ids: Sequence[int]) -> None:
        self.done.difference_update(request_ids)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._executor, name)


DRAIN_TIMEOUT = datetime.timedelta(seconds=1)  # per await after the stream itself died (error path only)


class TrtllmRunner:
    """Generate with a TensorRT-LLM engine, streaming llmc :class:`StreamEvent` objects.

    ``model_runner_cls`` is ``tensorrt_llm.runtime.ModelRunnerCpp`` by default (imported through
    :func:`require_tensorrt_llm`); tests pass a recording test double with the same methods.
    """

    def __init__(self, config: TrtllmRunnerConfig, tokenizer: Any, eos_token_ids: Sequence[int],
                 model_runner_cls: Any = None, importer: Importer = importlib.import_module):
        if not eos_token_ids:
            raise RequestError("eos_token_ids", "the engine records no eos id; rebuild with llmc build --force")
        if model_runner_cls is None:
            require_tensorrt_llm(importer)
            model_runner_cls = importer("tensorrt_llm.runtime").ModelRunnerCpp
        self.config, self.tokenizer = config, tokenizer
        self.vocab_size = len(tokenizer)  # the ids the tokenizer can produce: what requests are checked against
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else self.eos_token_ids[0]
        self.runner = model_runner_cls.from_dir(str(config.engine_dir), **config.from_dir_kwargs())
        self.executor_ids = ExecutorIds(self.runner.executor)
        self.runner.executor = self.executor_ids

    @classmethod
    def from_build_dir(cls, build_dir: Path, rank: int = 0, model_runner_cls: Any = None,
                       found_versions: dict[str, str | None] | None = None,
                       importer: Importer = importlib.import_module) -> TrtllmRunner:
        """Open ``build_dir`` (llmc build folder): refuse engines built under other TensorRT versions
        (:func:`check_engine_versions`; ``found_versions`` defaults to the installed ones), then load."""
        build_dir = Path(build_dir)
        engine_dir = build_dir / "engine"
        if model_runner_cls is None:
            require_tensorrt_llm(importer)  # a missing library says so before any version comparison
        check_engine_versions(engine_dir, found_versions)
        manifest = read_manifest(build_dir)
        config = TrtllmRunnerConfig.from_recipe(manifest.recipe_obj(), engine_dir, rank)
        return cls(config, load_tokenizer(build_dir / "tokenizer"), manifest.eos_token_ids,
                   model_runner_cls, importer)

    def _max_new_tokens(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> int:
        longest = max(len(p) for p in prompts)
        if longest > self.config.max_input_len or min(len(p) for p in prompts) == 0:
            raise RequestError("prompt", f"prompts must have 1..{self.config.max_input_len} tokens "
                                         f"(engine.max_input_len); got {longest}. Shorten the prompt")
        if len(prompts) > self.config.max_batch_size:
            raise RequestError("prompt", f"{len(prompts)} prompts exceed engine.max_batch_size "
                                         f"{self.config.max_batch_size}; send fewer at once")
        room = self.config.max_seq_len - longest
        if room < 1:
            raise RequestError("prompt", f"a {longest}-token prompt leaves no room to generate within "
                                         f"engine.max_seq_len {self.config.max_seq_len}; shorten the prompt")
        return min(params.max_new_tokens, room)

    def stream_batch(self, prompts: Sequence[Sequence[int]], params: SamplingParams | None = None,
                     request_ids: Sequence[str] | None = None) -> Iterator[StreamEvent]:
        """Run ``prompts`` (token ids) as one batch; yield each request's events as tokens arrive.

        One event per generated token (like the torch backend); every request ends with exactly one
        event whose ``finished`` is True. However the iteration ends (all finished, the caller stops
        iterating, an error), no request of this batch is left running in TensorRT-LLM's executor.
        """
        import torch

        params = params or SamplingParams()
        request_ids = list(request_ids or [f"trt-{i}" for i in range(len(prompts))])
        max_new = self._max_new_tokens(prompts, params)
        kwargs = generate_kwargs(self.tokenizer, params, self.eos_token_ids, self.pad_id, len(prompts), max_new)
        arrival = time.perf_counter()
        outputs = [
            RequestOutput(rid, tuple(p), params, self.tokenizer, self.eos_token_ids, self.config.max_seq_len,
                          RequestMetrics(arrival_time=arrival, prompt_tokens=len(p)))
            for rid, p in zip(request_ids, prompts)
        ]
        finished = [False] * len(prompts)
        batch_input_ids = [torch.tensor(list(p), dtype=torch.int32) for p in prompts]  # each [prompt_len]
        stream = self.runner.generate(batch_input_ids, **kwargs)
        executor_ids = list(self.executor_ids.last)  # generate enqueued the batch before returning its stream
        assert len(executor_ids) == len(prompts), "generate enqueued a different number of requests"
        for out in outputs:
            out.metrics.record_scheduled()  # TensorRT-LLM's executor queues internally; llmc sees submit time
        steps, stream_alive, stream_done = iter(stream), True, False
        try:
            while not all(finished):
                try:
                    step = next(steps)
                except StopIteration:
                    stream_done = True
                    break
                except BaseException:
                    stream_alive = False
                    raise
                yield from self._step_events(step, outputs, finished, executor_ids)
            for b, out in enumerate(outputs):
                if not finished[b]:
                    finished[b] = True
                    yield out.on_token(self.eos_token_ids[0], time.perf_counter())
        except BaseException:
            self._cancel(executor_ids)
            self._drain(steps if stream_alive else None, executor_ids)
            self.executor_ids.forget(executor_ids)
            raise
        if not stream_done:
            self._drain(steps, executor_ids)
        self.executor_ids.forget(executor_ids)

    def _step_events(self, step: dict, outputs: list[RequestOutput], finished: list[bool],
                     executor_ids: list[int]) -> Iterator[StreamEvent]:
        """The events of one streamed step; cancels in the executor each request llmc finishes here."""
        output_ids = step["output_ids"]  # [batch, beams, max_seq_len] int32, includes the prompt
        lengths = step["sequence_lengths"]  # [batch, beams]
        now = time.perf_counter()
        for b, out in enumerate(outputs):
            start = out.num_prompt + out.num_generated
            for token in output_ids[b, 0, start:int(lengths[b, 0])].tolist():
                if finished[b]:
                    break
                event = out.on_token(int(token), now)
                finished[b] = event.finished
                if event.finished:
                    self._cancel([executor_ids[b]])  # llmc's stop may come before TensorRT-LLM's own
                yield event

    def _cancel(self, executor_ids: list[int]) -> None:
        self.executor_ids.cancel_unfinished(executor_ids)

    def _drain(self, steps: Iterator[dict] | None, executor_ids: list[int]) -> None:
        """Consume the rest of this batch's responses so none reaches the next ``generate``.

        Every request llmc did not finish is cancelled by now, so the stream ends after their final
        responses. A stream that raised (``steps`` None) cannot be resumed: then each unfinished request's
        responses are awaited directly until its final one (DRAIN_TIMEOUT bounds each wait).
        """
        if steps is not None:
            try:
                for _ in steps:
                    pass
                return
            except Exception:  # noqa: BLE001 - the stream died while draining; drained by id below
                pass
        for rid in executor_ids:
            while rid not in self.executor_ids.done:
                if not self.executor_ids.await_responses(rid, DRAIN_TIMEOUT):
                    break

    def stream(self, prompt: Sequence[int], params: SamplingParams | None = None,
               request_id: str = "trt-0") -> Iterator[StreamEvent]:
        """One request's events (see :meth:`stream_batch`)."""
        return self.stream_batch([prompt], params, [request_id])

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | None = None
                 ) -> list[Completion]:
        """Non-streaming: one :class:`Completion` per prompt (``prompt`` = its token ids), in order."""
        ids = [f"trt-{i}" for i in range(len(prompts))]
        events: dict[str, list[StreamEvent]] = {i: [] for i in ids}
        for event in self.stream_batch(prompts, params, ids):
            events[event.request_id].append(event)
        return [Completion.from_events(list(p), events[i]) for i, p in zip(ids, prompts)]
