"""``llmc bench --url`` against the real ``llmc serve`` (in-process, tiny build) over all three protocols."""

from __future__ import annotations

import pytest

from llmc.bench.client import make_client, run_client
from llmc.bench.plan import plan_levels
from llmc.bench.workload import LengthDist, synthetic_workload
from llmc.request.params import SamplingParams
from tests.serve.conftest import start_server

OSL = 4


@pytest.fixture(scope="module")
def live_server(bench_build_dir):
    server = start_server(bench_build_dir)
    yield {"http": server.http, "grpc": server.grpc, "model": server.model}
    server.close()


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
