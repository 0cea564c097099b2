"""``llmc bench --url`` against the real ``llmc serve`` (in-process, tiny build) over all three protocols."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from llmc.bench.client import make_client, run_client
from llmc.bench.workload import LengthDist, plan_levels, synthetic_workload
from llmc.runtime.params import SamplingParams

OSL = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def live_server(bench_build_dir):
    from llmc.serve.run import ServeOptions, load_engine, serve_async

    engine = load_engine(bench_build_dir, "cpu")
    options = ServeOptions("127.0.0.1", _free_port(), _free_port(), None, 60.0, 2.0)
    loop = asyncio.new_event_loop()
    ready, stop = threading.Event(), {}

    def run() -> None:
        asyncio.set_event_loop(loop)
        stop["event"] = asyncio.Event()
        loop.run_until_complete(serve_async(engine, options, stop["event"], ready.set))
        loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(30), "llmc serve did not start"
    yield {"http": f"http://127.0.0.1:{options.port}", "grpc": f"127.0.0.1:{options.grpc_port}",
           "model": engine.recipe.served_model_name}
    loop.call_soon_threadsafe(stop["event"].set)
    thread.join(30)


@pytest.mark.parametrize("protocol", ["http", "openai", "grpc"])
def test_bench_against_llmc_serve(live_server, protocol, tokenizer, corpus):
    workload = synthetic_workload(tokenizer, LengthDist("fixed", 12), LengthDist("fixed", OSL), 1 + 2 + 4, seed=2,
                                  corpus=corpus)
    plan = plan_levels(workload, [1, 4], per_level=2, warmup=1)
    url = live_server["grpc" if protocol == "grpc" else "http"]
    client = make_client(protocol, url, live_server["model"], SamplingParams(temperature=0.0))
    try:
        levels = run_client(client, plan)
    finally:
        client.close()
    for lv in levels:
        assert sum(r.generated_tokens for r in lv.records) == len(lv.records) * OSL
        assert all(r.ttft > 0 and r.e2e >= r.ttft for r in lv.records)
