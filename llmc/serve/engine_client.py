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
from llmc.request.outputs import StreamEvent
from llmc.request.params import SamplingParams
from llmc.runtime.request_events import RequestEvents
from llmc.serve import prom


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


class ServerMetrics:
    """The ``/metrics`` series: request outcomes, latencies, token counts and engine load (read at scrape)."""

    def __init__(self, engine: Any, in_flight: Any):
        self.registry = prom.Registry()
        add = self.registry.add
        self.requests = add(prom.Counter("llmc_requests_total", "Finished requests by finish reason.",
                                         ("finish_reason",)))
        self.rejected = add(prom.Counter("llmc_requests_rejected_total", "Requests refused before running.",
                                         ("reason",)))
        self.ttft = add(prom.Histogram("llmc_time_to_first_token_seconds",
                                       "Time from request acceptance to its first token."))
        self.itl = add(prom.Histogram("llmc_inter_token_latency_seconds", "Gap between consecutive tokens."))
        self.e2e = add(prom.Histogram("llmc_e2e_request_latency_seconds", "Request acceptance to finish."))
        self.prompt_tokens = add(prom.Counter("llmc_prompt_tokens_total", "Prompt tokens of finished requests."))
        self.generated_tokens = add(prom.Counter("llmc_generation_tokens_total", "Tokens generated."))
        for key, help_text in (("waiting", "Requests waiting in the engine's queue."),
                               ("running", "Requests in the running batch."),
                               ("kv_blocks_used", "KV-cache blocks in use."),
                               ("kv_blocks_free", "Free KV-cache blocks.")):
            name = "llmc_num_requests_" + key if key in ("waiting", "running") else "llmc_" + key
            add(prom.Gauge(name, help_text, lambda key=key: engine.stats()[key]))
        add(prom.Gauge("llmc_requests_in_flight", "Requests the server is handling.", lambda: len(in_flight)))

    def record(self, event: StreamEvent, reason: str | None = None) -> None:
        """Count a finished request (``reason`` overrides the event's finish reason, e.g. "timeout")."""
        self.requests.inc(reason or event.finish_reason or "unknown")
        m = event.metrics
        if m is None:
            return
        self.prompt_tokens.inc(amount=m.prompt_tokens)
        self.generated_tokens.inc(amount=m.generated_tokens)
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        for gap in m.itls:
            self.itl.observe(gap)
        if m.e2e_latency is not None:
            self.e2e.observe(m.e2e_latency)


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
            self.metrics.rejected.inc("draining")
            raise ServerDrainingError()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.request_timeout_s
        events = RequestEvents(self.engine, prompt, params, uuid.uuid4().hex)
        try:
            await events.asubmit()
        except QueueFullError:
            self.metrics.rejected.inc("queue_full")
            raise
        self.in_flight.add(events.request_id)
        reason = "abort"
        try:
            iterator = aiter(events)
            while not events.finished:
                try:
                    event = await asyncio.wait_for(anext(iterator), max(deadline - loop.time(), 0.0))
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
                self.metrics.requests.inc(reason)

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
