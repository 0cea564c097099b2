"""EngineClient.stream's request lifetime: a cancellation (the client left) aborts the request whenever it comes,
also in the same loop turn as the request's next event; a request past its deadline is a timeout."""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

import pytest

from llmc.request.outputs import StreamEvent
from llmc.request.params import SamplingParams
from llmc.serve.engine_client import EngineClient, RequestTimeoutError, _before_by_wait, before
from llmc.serve.metrics import ENGINE_COUNTERS, ENGINE_GAUGES


class EventsByHand:
    """An engine whose events the test emits through the request's sink, as the stepping thread would."""

    def __init__(self) -> None:
        self.sink = None
        self.request_id: str | None = None
        self.aborted: list[str] = []

    def clock(self) -> float:
        return time.monotonic()

    def add_request(self, prompt, params, request_id, priority, sink, timing) -> str:
        self.sink, self.request_id = sink, request_id
        return request_id

    def stats(self) -> dict[str, float]:
        return dict.fromkeys([*ENGINE_GAUGES, *ENGINE_COUNTERS], 0.0)

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return True

    async def anext_event(self, inbox: asyncio.Queue) -> StreamEvent:
        return await inbox.get()

    def emit(self, text: str) -> None:
        self.sink(StreamEvent(self.request_id, text, (1,)))


def aborted_count(client: EngineClient) -> float:
    return client.metrics.requests.labels("abort")._value.get()


async def _consumer(client: EngineClient, got: list[StreamEvent]) -> None:
    async with aclosing(client.stream([1, 2, 3], SamplingParams(max_new_tokens=100))) as stream:
        async for event in stream:
            got.append(event)


async def _until(predicate, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.001)


@pytest.mark.parametrize("with_event", [False, True])
def test_a_cancellation_aborts_the_request_even_with_its_next_event_ready(with_event):
    """The client leaves (its handler task is cancelled) while the request's next event is already on its way:
    the request is still aborted and counted once, and the handler ends cancelled instead of going on streaming.
    (Python 3.11's asyncio.wait_for returns the inner result when both land in one loop turn and drops the
    cancellation: an n-choice stream then ran its other choices to the end after the client had gone.)"""
    engine = EventsByHand()

    async def scenario() -> tuple[bool, list[StreamEvent], float]:
        client = EngineClient(engine, request_timeout_s=60.0)
        got: list[StreamEvent] = []
        task = asyncio.create_task(_consumer(client, got))
        await _until(lambda: engine.sink is not None)
        engine.emit("a")
        await _until(lambda: len(got) == 1)
        await asyncio.sleep(0.01)  # the consumer waits for the next event
        if with_event:
            engine.emit("b")  # its put lands in the next loop turn, ahead of the cancellation's wake-up
            await asyncio.sleep(0)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=2.0)
        ended_cancelled = bool(done) and task.cancelled()
        if not done:
            task.cancel()
            await asyncio.wait([task], timeout=2.0)
        return ended_cancelled, got, aborted_count(client)

    ended_cancelled, got, aborted = asyncio.run(scenario())
    assert ended_cancelled
    assert engine.aborted == [engine.request_id]
    assert aborted == 1
    assert [e.text for e in got] == ["a"]


def test_a_request_past_its_deadline_is_a_timeout_and_is_aborted():
    engine = EventsByHand()

    async def scenario() -> tuple[BaseException | None, EngineClient]:
        client = EngineClient(engine, request_timeout_s=0.2)
        got: list[StreamEvent] = []
        task = asyncio.create_task(_consumer(client, got))
        await _until(lambda: engine.sink is not None)
        engine.emit("a")
        await asyncio.wait([task], timeout=5.0)
        return task.exception(), client

    error, client = asyncio.run(scenario())
    assert isinstance(error, RequestTimeoutError)
    assert engine.aborted == [engine.request_id]
    assert client.metrics.requests.labels("timeout")._value.get() == 1
    assert aborted_count(client) == 0


@pytest.mark.parametrize("wait", [before, _before_by_wait], ids=["before", "before_by_wait"])
def test_before_gives_the_result_times_out_and_never_drops_a_cancellation(wait):
    """Both forms (asyncio.timeout_at from Python 3.11, asyncio.wait on 3.10): the awaited value in time,
    asyncio.TimeoutError at the deadline, and the caller's cancellation raised even when the value arrived in the
    same loop turn."""

    async def scenario() -> tuple[object, object, object]:
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[str] = asyncio.Queue()
        inbox.put_nowait("ready")
        value = await wait(inbox.get(), loop.time() + 5.0)
        try:
            await wait(inbox.get(), loop.time() + 0.05)
            timed_out = False
        except asyncio.TimeoutError:
            timed_out = True
        task = asyncio.create_task(wait(inbox.get(), loop.time() + 5.0))
        await asyncio.sleep(0.01)
        loop.call_soon(inbox.put_nowait, "raced")
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.wait([task], timeout=2.0)
        return value, timed_out, task.cancelled()

    assert asyncio.run(scenario()) == ("ready", True, True)
