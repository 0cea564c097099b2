"""The server's bridge to the engine: asyncio streams over ``Engine.add_request``, timeouts, aborts, draining.

Every protocol front end (HTTP, OpenAI, gRPC) goes through :meth:`EngineClient.stream`, so disconnects,
timeouts, queue-full rejections and metrics behave the same on all of them. Tokenization runs in a worker
thread (``Engine.add_request`` tokenizes in its caller's thread), never on the event loop or the step loop.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from llmc.errors import EngineError, LlmcError, QueueFullError, RequestError
from llmc.request.metrics import PromptTiming
from llmc.request.outputs import StreamEvent
from llmc.request.params import SamplingParams
from llmc.runtime.request_events import RequestEvents
from llmc.serve.metrics import ServerMetrics

T = TypeVar("T")


async def before(awaitable: Awaitable[T], when: float) -> T:
    """``await awaitable``, raising asyncio.TimeoutError at loop time ``when``. A cancellation of the caller always
    propagates: ``asyncio.wait_for`` before Python 3.12 returns the result instead when both land in one loop turn,
    so a handler whose client had left went on streaming (and its request was never aborted)."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout_at(when):  # no inner task: the cancellation reaches the awaitable itself
            return await awaitable
    return await _before_by_wait(awaitable, when)


async def _before_by_wait(awaitable: Awaitable[T], when: float) -> T:
    """:func:`before` for Python 3.10 (no ``asyncio.timeout_at``): ``asyncio.wait`` raises the caller's
    cancellation whatever the inner task did meanwhile."""
    inner = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait([inner], timeout=max(when - asyncio.get_running_loop().time(), 0.0))
    except BaseException:
        inner.cancel()
        raise
    if not done:
        inner.cancel()
        raise asyncio.TimeoutError()
    return inner.result()


class RequestTimeoutError(LlmcError):
    """A request ran past the server's request timeout; it was aborted and its KV blocks freed."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        super().__init__(f"the request did not finish within the server's request timeout of {timeout_s:g} s and "
                         f"was aborted; ask for fewer tokens or start the server with a larger --request-timeout")


class ServerDrainingError(LlmcError):
    """The server is shutting down and accepts no new requests."""

    retry_after_s = 5.0

    def __init__(self) -> None:
        super().__init__("the server is shutting down and accepts no new requests; retry on another replica")


@dataclass(frozen=True)
class PreparedPrompt:
    """A prompt tokenized before submission: its ids, and the max_new_tokens the engine can honour for it.

    ``capped`` is set when the request asked for more new tokens than ``max_seq_len`` leaves after the prompt;
    the engine stops at the cap (finish_reason "length") and :meth:`warnings` says so in the response."""

    token_ids: tuple[int, ...]
    requested: int
    capped: int | None = None
    max_seq_len: int = 0
    timing: PromptTiming | None = None  # when the server took the request in; its template and tokenizing

    def warnings(self) -> list[str]:
        if self.capped is None:
            return []
        return [f"max_tokens={self.requested} is more than this prompt leaves room for: capped to {self.capped} "
                f"(max_seq_len {self.max_seq_len} - {len(self.token_ids)} prompt tokens)"]


class EngineClient:
    """Async access to a started :class:`~llmc.runtime.api.Engine` for concurrent server requests.

    ``request_timeout_s`` bounds each request from acceptance to its last event.
    """

    def __init__(self, engine: Any, request_timeout_s: float):
        self.engine = engine
        self.request_timeout_s = request_timeout_s
        self.in_flight: set[str] = set()
        self.draining = False
        self.metrics = ServerMetrics(engine, self.in_flight)

    async def prepare(self, prompt: Any, params: SamplingParams, strict: bool = False) -> PreparedPrompt:
        """Tokenize ``prompt`` in a worker thread (refused by size first, then by ``max_input_len``) and check
        ``params.max_new_tokens`` against the room ``max_seq_len`` leaves: capped, or with ``strict`` a
        RequestError("max_new_tokens"). A cancellation here (the client left) counts as an aborted request."""
        if self.draining:
            self.metrics.rejected.labels("draining").inc()
            raise ServerDrainingError()
        accepted, timings = self.engine.clock(), {}
        try:
            ids = await asyncio.to_thread(self.engine.tokenize, prompt, timings)
        except asyncio.CancelledError:
            self.metrics.requests.labels("abort").inc()
            raise
        timing = PromptTiming(accepted, timings.get("template", 0.0), timings.get("tokenize", 0.0))
        max_seq_len = self.engine.recipe.engine.max_seq_len
        room = max_seq_len - len(ids)
        if params.max_new_tokens <= room:
            return PreparedPrompt(ids, params.max_new_tokens, timing=timing)
        if strict:
            raise RequestError("max_new_tokens", f"is {params.max_new_tokens}, but this prompt of {len(ids)} tokens "
                                                 f"leaves room for {room} within max_seq_len={max_seq_len}; ask "
                                                 f"for at most {room} or drop strict_max_tokens to get a cap")
        return PreparedPrompt(ids, params.max_new_tokens, max(room, 0), max_seq_len, timing)

    async def count(self, prompt: Any, add_special_tokens: bool | None = None) -> tuple[int, ...]:
        """The token ids a request with ``prompt`` would run on (tokenized in a worker thread), also past
        ``max_input_len``: for clients that count tokens (``/tokenize``). Nothing is submitted."""
        return await asyncio.to_thread(self.engine.tokenize, prompt, None, add_special_tokens, False)

    async def stream(self, prompt: Any, params: SamplingParams) -> AsyncIterator[StreamEvent]:
        """Yield the request's events; the last is finished. Use inside ``contextlib.aclosing``. ``prompt``: a
        :class:`PreparedPrompt` (its metrics then count from when :meth:`prepare` took it in, template and
        tokenizing included) or any prompt the engine takes.

        Raises RequestError / QueueFullError (before the first event), ServerDrainingError,
        RequestTimeoutError or EngineError (request failed). Leaving early aborts the request."""
        if self.draining:
            self.metrics.rejected.labels("draining").inc()
            raise ServerDrainingError()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.request_timeout_s
        timing = None
        if isinstance(prompt, PreparedPrompt):
            prompt, timing = prompt.token_ids, prompt.timing
        events = RequestEvents(self.engine, prompt, params, uuid.uuid4().hex, timing=timing)
        try:
            await events.asubmit()
        except asyncio.CancelledError:  # the client left while the request was being queued (it is aborted)
            self.metrics.requests.labels("abort").inc()
            raise
        except QueueFullError:
            self.metrics.rejected.labels("queue_full").inc()
            raise
        self.in_flight.add(events.request_id)
        reason = "abort"
        try:
            iterator = aiter(events)
            while not events.finished:
                try:
                    event = await before(anext(iterator), deadline)
                except asyncio.TimeoutError:
                    reason = "timeout"
                    raise RequestTimeoutError(self.request_timeout_s) from None
                if event.finished:
                    self.metrics.record(event)
                    if event.finish_reason == "error":
                        raise EngineError(f"the request failed in the engine: {event.error}")
                yield event
        finally:
            self.in_flight.discard(events.request_id)
            if events.close():
                self.metrics.requests.labels(reason).inc()

    async def drain(self, grace_s: float) -> None:
        """Stop accepting requests, wait up to ``grace_s`` for in-flight ones, then abort the rest."""
        self.draining = True
        loop = asyncio.get_running_loop()
        end = loop.time() + grace_s
        while self.in_flight and loop.time() < end:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(self.engine.shutdown)
        while self.in_flight and loop.time() < end + 5.0:  # let handlers write their closing "abort" events
            await asyncio.sleep(0.02)
