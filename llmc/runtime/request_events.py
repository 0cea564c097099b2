"""One request's events, from its sink in the stepping thread through a queue to one consumer.

The one place that submits a request with a sink, iterates its events up to the finished one, and aborts it
when the consumer leaves early: :meth:`llmc.runtime.api.Engine.stream`, :meth:`~llmc.runtime.api.Engine.astream`
and the server's :class:`~llmc.serve.engine_client.EngineClient` use it.
"""

from __future__ import annotations

import asyncio
import queue
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Protocol

from llmc.request.inputs import Prompt
from llmc.request.metrics import PromptTiming
from llmc.request.outputs import StreamEvent
from llmc.request.params import SamplingParams


class EventEngine(Protocol):
    """What :class:`RequestEvents` needs of an engine (:class:`llmc.runtime.api.Engine`)."""

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, sink: Callable[[StreamEvent], None] | None = None,
                    timing: PromptTiming | None = None) -> str: ...

    def abort(self, request_id: str) -> bool: ...

    def next_event(self, inbox: queue.Queue) -> StreamEvent: ...

    async def anext_event(self, inbox: asyncio.Queue) -> StreamEvent: ...


class RequestEvents:
    """One request's events (see the module docstring).

    Synchronous use: ``with RequestEvents(...) as events: for event in events``. Asynchronous use (tokenization in
    a worker thread, events through an asyncio queue): ``async with ...: async for event in events``. Every
    event is yielded, an "error" one included (the callers decide what it raises). Leaving the ``with`` block
    before the finished event -- ``break``, an exception, a cancellation, a timeout -- aborts the request and
    frees its KV blocks; so does a cancellation while it is being submitted.
    """

    def __init__(self, engine: EventEngine, prompt: Prompt, params: SamplingParams | None = None,
                 request_id: str | None = None, priority: int = 0, timing: PromptTiming | None = None):
        self.engine, self.prompt, self.params, self.priority = engine, prompt, params, priority
        self.timing = timing  # a prompt tokenized before: when it was accepted, its template and tokenizing
        self.request_id = request_id if request_id is not None else uuid.uuid4().hex
        self.finished = False
        self._submitted = False
        self._inbox: queue.Queue[StreamEvent] | asyncio.Queue[StreamEvent] | None = None

    def submit(self) -> None:
        """Queue the request (RequestError, QueueFullError as :meth:`~llmc.runtime.api.Engine.add_request`);
        events go to a queue."""
        inbox: queue.Queue[StreamEvent] = queue.Queue()
        self._inbox = inbox
        self.engine.add_request(self.prompt, self.params, self.request_id, self.priority, inbox.put, self.timing)
        self._submitted = True

    async def asubmit(self) -> None:
        """:meth:`submit` from a coroutine: tokenization runs in a worker thread, events go to an asyncio queue."""
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self._inbox = inbox

        def sink(event: StreamEvent) -> None:
            loop.call_soon_threadsafe(inbox.put_nowait, event)

        task = asyncio.ensure_future(asyncio.to_thread(self.engine.add_request, self.prompt, self.params,
                                                       self.request_id, self.priority, sink, self.timing))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:  # the worker thread still queues it: abort it as soon as it has
            task.add_done_callback(lambda t: t.exception() is None and self.engine.abort(self.request_id))
            raise
        self._submitted = True

    def close(self) -> bool:
        """Abort the request unless its finished event was taken; True when this aborted a live request."""
        return self._submitted and not self.finished and self.engine.abort(self.request_id)

    def _take(self, event: StreamEvent) -> StreamEvent:
        self.finished = event.finished
        return event

    def __iter__(self) -> Iterator[StreamEvent]:
        assert isinstance(self._inbox, queue.Queue), "iterate after submit()"
        while not self.finished:
            yield self._take(self.engine.next_event(self._inbox))

    async def __aiter__(self) -> AsyncIterator[StreamEvent]:
        assert isinstance(self._inbox, asyncio.Queue), "iterate after asubmit()"
        while not self.finished:
            yield self._take(await self.engine.anext_event(self._inbox))

    def __enter__(self) -> RequestEvents:
        self.submit()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> RequestEvents:
        await self.asubmit()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
