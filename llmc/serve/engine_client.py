"""The server's bridge to the engine: asyncio streams over ``Engine.add_request``, timeouts, aborts, draining.

Every protocol front end (HTTP, OpenAI, gRPC) goes through :meth:`EngineClient.stream`, so disconnects,
timeouts, queue-full rejections and metrics behave the same on all of them. Tokenization runs in a worker
thread (``Engine.add_request`` tokenizes in its caller's thread), never on the event loop or the step loop.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

from llmc.errors import EngineError, LlmcError, QueueFullError
from llmc.runtime.outputs import StreamEvent
from llmc.runtime.params import SamplingParams
from llmc.serve.metrics import ServerMetrics


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

    async def stream(self, prompt: Any, params: SamplingParams) -> AsyncIterator[StreamEvent]:
        """Yield the request's events; the last is finished. Use inside ``contextlib.aclosing``.

        Raises RequestError / QueueFullError (before the first event), ServerDrainingError,
        RequestTimeoutError or EngineError (request failed). Leaving early aborts the request."""
        if self.draining:
            self.metrics.rejected.labels("draining").inc()
            raise ServerDrainingError()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.request_timeout_s
        inbox: asyncio.Queue[StreamEvent] = asyncio.Queue()
        request_id = uuid.uuid4().hex
        await self._submit(prompt, params, request_id, lambda e: loop.call_soon_threadsafe(inbox.put_nowait, e))
        self.in_flight.add(request_id)
        finished = False
        reason = "abort"
        try:
            while not finished:
                try:
                    event = await asyncio.wait_for(inbox.get(), max(deadline - loop.time(), 0.0))
                except asyncio.TimeoutError:
                    reason = "timeout"
                    raise RequestTimeoutError(self.request_timeout_s) from None
                finished = event.finished
                if finished:
                    self.metrics.record(event)
                    if event.finish_reason == "error":
                        raise EngineError(f"the request failed in the engine: {event.error}")
                yield event
        finally:
            self.in_flight.discard(request_id)
            if not finished and self.engine.abort(request_id):
                self.metrics.requests.labels(reason).inc()

    async def _submit(self, prompt: Any, params: SamplingParams, request_id: str, sink: Any) -> None:
        """``add_request`` in a worker thread; a cancellation during it still aborts the queued request."""
        task = asyncio.ensure_future(asyncio.to_thread(self.engine.add_request, prompt, params, request_id, 0, sink))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(lambda t: t.exception() is None and self.engine.abort(request_id))
            raise
        except QueueFullError:
            self.metrics.rejected.labels("queue_full").inc()
            raise

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
