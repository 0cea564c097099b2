"""``llmc bench --url``: the closed-loop client over HTTP SSE (KServe, OpenAI) and gRPC against stub servers."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from llmc.bench.client import make_client, run_client
from llmc.bench.commands import bench_cmd
from llmc.bench.plan import BenchPlan
from llmc.bench.workload import BenchPrompt
from llmc.request.params import SamplingParams
from tests.bench.stub_servers import StreamStats, start_grpc_server, start_sse_server

DELAY, GAP, OSL = 0.1, 0.01, 5


@pytest.fixture
def stats() -> StreamStats:
    return StreamStats(DELAY, GAP)


@pytest.fixture
def sse_url(stats):
    server, url = start_sse_server(stats)
    yield url
    server.shutdown()


@pytest.fixture
def grpc_url(stats):
    server, url = start_grpc_server(stats)
    yield url
    server.stop(None)


def plan() -> BenchPlan:
    prompts = tuple(BenchPrompt(f"prompt number {i}", (1,) * (10 + i), OSL) for i in range(9))
    return BenchPlan(warmup=prompts[:1], levels=((1, prompts[1:3]), (3, prompts[3:9])))


@pytest.mark.parametrize("protocol", ["http", "openai", "grpc"])
def test_client_measures_every_chunk(protocol, stats, request):
    url = request.getfixturevalue("grpc_url" if protocol == "grpc" else "sse_url")
    client = make_client(protocol, url, "m", SamplingParams(temperature=0.0))
    try:
        levels = run_client(client, plan())
    finally:
        client.close()
    assert [len(lv.records) for lv in levels] == [2, 6]
    for lv in levels:
        assert sum(r.generated_tokens for r in lv.records) == len(lv.records) * OSL
        for r in lv.records:
            assert len(r.token_times) == OSL
            assert DELAY * 0.9 <= r.ttft < DELAY + 1.0
            # Chunks are timed as they arrive (not all at the end); the sum is robust to a loaded machine
            # delivering two chunks back to back.
            assert sum(r.itls) >= (OSL - 1) * GAP * 0.5
    assert stats.peak == 3  # the closed loop kept three streams open at once
    assert len(stats.requests) == 1 + 2 + 6
    first = stats.requests[0]
    assert first["max_tokens"] == OSL and first["temperature"] == 0.0
    assert first["min_tokens" if protocol == "openai" else "min_length"] == OSL
    if protocol == "grpc":
        assert first["text_input"] == "prompt number 0" and first["parameters"]["ignore_eos"] is True
        assert first["stream"] is True
    else:
        assert first["ignore_eos"] is True and first["stream"] is True
        key = "prompt" if protocol == "openai" else "text_input"
        assert first[key] == "prompt number 0"


def test_url_cli_end_to_end(sse_url, smollm2_hf_dir, tmp_path, stats):
    out = tmp_path / "r.json"
    result = CliRunner().invoke(bench_cmd, ["--url", sse_url, "--tokenizer", str(smollm2_hf_dir), "--model", "m",
                                            "--isl", "16", "--osl", str(OSL), "--num-prompts", "2",
                                            "--concurrency", "1,2", "--json", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["mode"] == "server" and report["protocol"] == "http"
    assert [lv["generated_tokens"] for lv in report["levels"]] == [2 * OSL, 2 * OSL]
    assert report["levels"][0]["ttft_s"]["p50"] >= DELAY * 0.9
    assert report["prompt_lengths"]["prompt_tokens"]["min"] == 16
    assert all(r["path"] == "/v2/models/m/generate_stream" for r in stats.requests)


def test_http_error_is_reported(sse_url):
    from llmc.errors import EngineError

    client = make_client("openai", sse_url + "/nowhere", "m", SamplingParams())
    with pytest.raises(EngineError, match="404"):
        client.run_one(BenchPrompt("x", (1,), 2))


@pytest.mark.parametrize("protocol, error", [
    ("http", "max_tokens: too many"),
    ("openai", {"message": "max_tokens: too many", "type": "server_error", "param": "max_tokens", "code": None}),
])
def test_a_stream_error_is_reported_with_the_servers_message(protocol, error, sse_url, stats):
    from llmc.errors import EngineError

    stats.stream_error = error
    client = make_client(protocol, sse_url, "m", SamplingParams())
    with pytest.raises(EngineError, match=r"the server failed the stream: max_tokens: too many$"):
        client.run_one(BenchPrompt("x", (1,), 2))
