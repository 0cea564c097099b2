"""The process's compute thread: every model call of an engine (load, warm-up, steps) runs on one thread."""

from __future__ import annotations

import threading

import pytest

from llmc.runtime.compute import compute_thread_ident, on_compute_thread, run_compute
from tests.runtime.engine_helpers import make_engine


def test_run_compute_uses_one_thread_and_runs_nested_calls_inline():
    first = run_compute(threading.get_ident)
    assert first != threading.get_ident() and first == compute_thread_ident()
    assert run_compute(lambda: run_compute(threading.get_ident)) == first  # nested: inline, no deadlock
    results = []
    workers = [threading.Thread(target=lambda: results.append(run_compute(threading.get_ident))) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert results == [first] * 4
    assert not on_compute_thread() and run_compute(on_compute_thread)


def test_run_compute_propagates_exceptions():
    def boom():
        raise ValueError("bad step")

    with pytest.raises(ValueError, match="bad step"):
        run_compute(boom)
    assert run_compute(lambda: 7) == 7  # the thread survives


def test_engine_runs_every_model_step_on_the_compute_thread(tiny_build_dir):
    engine = make_engine(tiny_build_dir)
    threads = set()
    execute = engine.runner.execute

    def recording_execute(scheduled):
        threads.add(threading.get_ident())
        return execute(scheduled)

    engine.runner.execute = recording_execute  # the runner is shared by the session's engines: undone below
    try:
        engine.generate(["hello there"], None)
        engine.start()
        list(engine.stream("and again"))
    finally:
        engine.shutdown()
        del engine.runner.execute
    assert threads == {compute_thread_ident()}


def test_engine_loads_and_warms_up_on_the_compute_thread(tiny_build_dir, monkeypatch):
    import llmc.runtime.api as api
    from llmc.runtime.api import Engine

    threads = []
    load_runner = api.load_runner

    def recording_load(*args, **kwargs):
        threads.append(threading.get_ident())
        return load_runner(*args, **kwargs)

    monkeypatch.setattr(api, "load_runner", recording_load)
    engine = Engine.from_dir(tiny_build_dir, device="cpu")
    engine.shutdown()
    assert threads == [compute_thread_ident()]
