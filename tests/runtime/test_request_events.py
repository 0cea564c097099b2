"""RequestEvents: one request's sink -> queue -> consumer, aborted when the consumer leaves early."""

from __future__ import annotations

import asyncio
import queue
import threading

import pytest

from llmc.request.params import SamplingParams
from llmc.runtime.request_events import RequestEvents
from tests.runtime.engine_helpers import make_engine

LONG = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_build_dir):
    engine = make_engine(tiny_build_dir)
    yield engine
    engine.shutdown()


def blocks_used(engine) -> int:
    return engine.stats()["kv_blocks_used"]


def test_sync_iteration_yields_every_event_up_to_the_finished_one(engine):
    with RequestEvents(engine, "a complete stream", LONG) as events:
        got = list(events)
    assert len(got) == LONG.max_new_tokens and got[-1].finished and not any(e.finished for e in got[:-1])
    assert events.finished and events.close() is False  # nothing left to abort
    assert blocks_used(engine) == 0


def test_leaving_the_block_early_aborts_the_request(engine):
    with RequestEvents(engine, "a stream left early", LONG, request_id="early") as events:
        first = next(iter(events))
        assert not first.finished and blocks_used(engine) > 0
    assert blocks_used(engine) == 0 and engine.abort("early") is False  # already aborted


def test_an_error_event_is_yielded_not_raised(engine, monkeypatch):
    def broken(scheduled):
        raise RuntimeError("simulated device failure")

    monkeypatch.setattr(engine.runner, "execute", broken)
    with RequestEvents(engine, "fails", LONG) as events:
        (event,) = list(events)
    assert event.finish_reason == "error" and "simulated device failure" in event.error
    assert blocks_used(engine) == 0


def test_async_iteration_and_early_exit(engine):
    async def main():
        async with RequestEvents(engine, "async stream", LONG) as events:
            async for event in events:
                assert blocks_used(engine) > 0
                break
        return event

    first = asyncio.run(main())
    assert not first.finished and blocks_used(engine) == 0


def test_a_cancellation_during_submission_still_aborts_the_request(engine, monkeypatch):
    """Tokenization runs in a worker thread; a task cancelled meanwhile must not leave the request queued."""
    release = threading.Event()
    add_request = engine.add_request

    def slow_add_request(*args, **kwargs):
        release.wait(5)
        return add_request(*args, **kwargs)

    monkeypatch.setattr(engine, "add_request", slow_add_request)

    async def main():
        events = RequestEvents(engine, "cancelled while tokenizing", LONG, request_id="cancelled")
        task = asyncio.ensure_future(events.asubmit())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        for _ in range(200):  # the worker thread finishes queueing, then the done callback aborts it
            await asyncio.sleep(0.01)
            if engine.stats()["waiting"] == 0 and "cancelled" not in engine._outputs:
                return True
        return False

    assert asyncio.run(main())
    assert engine.abort("cancelled") is False and blocks_used(engine) == 0


def test_waiting_with_nothing_unfinished_is_an_internal_error(engine):
    """Stepping an idle engine for an event that can never come would spin forever: it is asserted instead (once
    the grace for an event on its way from another thread has passed)."""
    with pytest.raises(AssertionError, match="no request is unfinished"):
        engine.next_event(queue.Queue())

    async def main() -> None:
        await engine.anext_event(asyncio.Queue())

    with pytest.raises(AssertionError, match="no request is unfinished"):
        asyncio.run(main())


def test_a_request_finished_in_another_thread_still_delivers_its_last_event(engine):
    """Shutdown aborts requests from another thread: a request can be finished (nothing unfinished) while its
    last event is still on its way to the stream, whose wait used to fail an assertion there (a server stopping
    after its grace cut such streams off with an internal error instead of their "abort" event)."""
    async def main() -> str:
        inbox: asyncio.Queue = asyncio.Queue()
        asyncio.get_running_loop().call_soon(inbox.put_nowait, "last")  # the sink's put, scheduled on this loop
        return await engine.anext_event(inbox)

    assert engine.stats()["running"] == 0 and asyncio.run(main()) == "last"
    inbox: queue.Queue = queue.Queue()
    threading.Timer(0.05, inbox.put, ["last"]).start()
    assert engine.next_event(inbox) == "last"
