"""``llmc serve`` end to end on the tiny model: KServe v2 HTTP (plain and tritonclient), SSE, gRPC
streaming with tritonclient, OpenAI endpoints, concurrency, disconnects, queue full, timeouts, bad input,
metrics and API keys. Outputs are compared with the offline runtime's greedy outputs."""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from llmc.request.params import SamplingParams
from scripts.client_grpc_stream import stream_once
from tests.serve.conftest import error_text, start_server

PROMPTS = [f"Request {i}: tell me about {w}" for i, w in enumerate(
    "cats dogs rivers mountains stars code music bread rain snow fire glass trains maps books tea".split())]


def greedy(offline, prompts, n):
    return [c.text for c in offline.generate(prompts, SamplingParams(max_new_tokens=n, temperature=0.0))]


def sse(server, path, body, stop_after=None):
    """POST and parse server-sent events with http.client; returns the decoded ``data:`` payloads."""
    url = urllib.parse.urlparse(server.http)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    assert response.getheader("Content-Type").startswith("text/event-stream")
    events = []
    for raw in response:
        line = raw.decode().strip()
        if line.startswith("data:"):
            payload = line[5:].strip()
            events.append(payload if payload == "[DONE]" else json.loads(payload))
            if stop_after is not None and len(events) >= stop_after:
                break
    conn.close()
    return events


def events_until_shutdown(server, path, body, after=1):
    """POST a streaming ``body`` and read its SSE ``data:`` payloads, shutting the server's engine down (every request
    aborted, as a drain past ``--grace`` does) once ``after`` events came; returns them all."""
    url = urllib.parse.urlparse(server.http)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    events = []
    for raw in conn.getresponse():
        line = raw.decode().strip()
        if line.startswith("data:"):
            events.append(json.loads(line[5:]))
            if len(events) == after:
                server.engine.shutdown()
    conn.close()
    return events


def wait_idle(engine, timeout=10.0):
    end = time.time() + timeout
    while time.time() < end:
        stats = engine.stats()
        if stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_blocks_used"] == 0:
            return stats
        time.sleep(0.02)
    raise AssertionError(f"engine not idle: {engine.stats()}")


def metric(server, name):
    _, text = server.get("/metrics")
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{") and line.split(" ")[0] == name:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_health_and_metadata_with_tritonclient_http(tiny_server):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(tiny_server.http.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(tiny_server.model) and client.is_model_ready("ensemble")
    meta = client.get_model_metadata(tiny_server.model)
    assert {i["name"] for i in meta["inputs"]} >= {"text_input", "max_tokens", "stream"}
    assert [o["name"] for o in meta["outputs"]] == ["text_output", "cum_log_probs", "output_log_probs"]
    assert tiny_server.get("/v2/models/nope")[0] == 404


def test_tritonclient_http_infer_matches_offline(tiny_server, offline):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(tiny_server.http.removeprefix("http://"))
    inputs = [httpclient.InferInput("text_input", [1, 1], "BYTES"), httpclient.InferInput("max_tokens", [1, 1], "INT32"),
              httpclient.InferInput("temperature", [1, 1], "FP32")]
    inputs[0].set_data_from_numpy(np.array([[PROMPTS[0].encode()]], dtype=np.object_))
    inputs[1].set_data_from_numpy(np.array([[12]], dtype=np.int32))
    inputs[2].set_data_from_numpy(np.array([[0.0]], dtype=np.float32))
    result = client.infer("ensemble", inputs)
    text = result.as_numpy("text_output").reshape(-1)[0]
    assert (text.decode() if isinstance(text, bytes) else text) == greedy(offline, [PROMPTS[0]], 12)[0]


def test_generate_and_sse_match_offline(tiny_server, offline):
    expected = greedy(offline, [PROMPTS[1]], 10)[0]
    status, body = tiny_server.post(f"/v2/models/{tiny_server.model}/generate",
                                    {"text_input": PROMPTS[1], "max_tokens": 10, "temperature": 0.0})
    assert status == 200 and body["text_output"] == expected and body["finish_reason"] == "length"
    events = sse(tiny_server, "/v2/models/ensemble/generate_stream",
                 {"text_input": PROMPTS[1], "max_tokens": 10, "temperature": 0.0, "stream": True})
    assert "".join(e["text_output"] for e in events) == expected and len(events) > 1
    assert events[-1]["finish_reason"] == "length" and events[-1]["completion_tokens"] == 10
    assert all("finish_reason" not in e for e in events[:-1])


def test_generate_takes_the_extensions_parameters_object_and_returns_the_id(tiny_server, offline):
    """Triton's generate extension: settings may come in "parameters", and a request's "id" comes back in every
    response (the whole one and each streamed event)."""
    expected = greedy(offline, [PROMPTS[1]], 6)[0]
    nested = {"id": "req-7", "text_input": PROMPTS[1], "parameters": {"max_tokens": 6, "temperature": 0.0}}
    status, body = tiny_server.post(f"/v2/models/{tiny_server.model}/generate", nested)
    assert status == 200 and body["id"] == "req-7" and body["text_output"] == expected, body
    events = sse(tiny_server, "/v2/models/ensemble/generate_stream",
                 {**nested, "parameters": {**nested["parameters"], "stream": True}})
    assert "".join(e["text_output"] for e in events) == expected and len(events) > 1
    assert all(e["id"] == "req-7" for e in events), events
    status, body = tiny_server.post(f"/v2/models/{tiny_server.model}/generate",
                                    {"text_input": PROMPTS[1], "max_tokens": 2, "parameters": {"max_tokens": 3}})
    assert status == 400 and body["error"].startswith("parameters.max_tokens:"), body
    status, body = tiny_server.post(f"/v2/models/{tiny_server.model}/generate", {"text_input": PROMPTS[1],
                                                                                 "max_tokens": 2})
    assert status == 200 and "id" not in body  # none asked for, none sent


def test_grpc_streaming_with_tritonclient_matches_offline(tiny_server, offline):
    import io

    result = stream_once(tiny_server.grpc, "ensemble", PROMPTS[2], 10, temperature=0.0, out=io.StringIO())
    assert result["error"] is None
    assert result["text"] == greedy(offline, [PROMPTS[2]], 10)[0]
    assert result["ttft"] is not None and len(result["itls"]) >= 1


def test_grpc_errors_have_status_codes(tiny_server):
    import io

    result = stream_once(tiny_server.grpc, "ensemble", "", 10, out=io.StringIO())
    assert "INVALID_ARGUMENT" in result["error"]
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(tiny_server.grpc)
    assert client.is_server_live() and client.is_model_ready(tiny_server.model)
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.get_model_metadata("nope")


def test_openai_endpoints(tiny_server, offline):
    status, models = tiny_server.get("/v1/models")
    assert status == 200 and models["data"][0]["id"] == tiny_server.model
    card = models["data"][0]  # a real creation time, and the context length clients size their requests by
    assert card["max_model_len"] == offline.recipe.engine.max_seq_len
    assert time.time() - 3600 < card["created"] <= time.time()
    assert tiny_server.get(f"/v1/models/{tiny_server.model}") == (200, card)
    expected = greedy(offline, [PROMPTS[3]], 8)[0]
    status, body = tiny_server.post("/v1/completions", {"model": tiny_server.model, "prompt": PROMPTS[3],
                                                        "max_tokens": 8, "temperature": 0})
    assert status == 200 and body["choices"][0]["text"] == expected
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 8
    chunks = sse(tiny_server, "/v1/completions", {"prompt": PROMPTS[3], "max_tokens": 8, "temperature": 0,
                                                  "stream": True, "stream_options": {"include_usage": True}})
    assert chunks[-1] == "[DONE]" and chunks[-2]["usage"]["completion_tokens"] == 8
    assert "".join(c["choices"][0]["text"] for c in chunks[:-2]) == expected
    messages = [{"role": "user", "content": "Say hi"}]
    expected_chat = [c.text for c in offline.generate([messages], SamplingParams(max_new_tokens=6, temperature=0.0))][0]
    status, body = tiny_server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 6, "temperature": 0})
    assert status == 200 and body["choices"][0]["message"] == {"role": "assistant", "content": expected_chat}
    chunks = sse(tiny_server, "/v1/chat/completions", {"messages": messages, "max_tokens": 6, "temperature": 0,
                                                       "stream": True})
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[-1] == "[DONE]"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == expected_chat
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert tiny_server.post("/v1/completions", {"prompt": "x", "best_of": 2})[0] == 400


def test_sixteen_concurrent_streams_match_offline(tiny_server, offline):
    expected = greedy(offline, PROMPTS, 12)
    body = lambda p: {"text_input": p, "max_tokens": 12, "temperature": 0.0, "stream": True}
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: sse(tiny_server, f"/v2/models/{tiny_server.model}/generate_stream",
                                              body(p)), PROMPTS))
    assert ["".join(e["text_output"] for e in events) for events in results] == expected
    wait_idle(tiny_server.engine)


def test_client_disconnect_aborts_and_frees_blocks(tiny_server):
    aborted = metric(tiny_server, 'llmc_requests_total{finish_reason="abort"}')
    events = sse(tiny_server, f"/v2/models/{tiny_server.model}/generate_stream",
                 {"text_input": PROMPTS[4], "max_tokens": 400, "stream": True}, stop_after=2)
    assert len(events) == 2 and "finish_reason" not in events[-1]
    stats = wait_idle(tiny_server.engine)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert metric(tiny_server, 'llmc_requests_total{finish_reason="abort"}') == aborted + 1
    assert tiny_server.get("/v2/health/ready")[0] == 200
    assert tiny_server.post("/v2/models/ensemble/generate", {"text_input": "hi", "max_tokens": 2})[0] == 200


def test_a_client_leaving_an_n_choice_stream_aborts_every_choice(serve_tiny_build, monkeypatch):
    server = start_server(serve_tiny_build)
    try:
        # Steps of at least 10 ms: the three 300-token choices cannot end by themselves before the server sees the
        # client leave (the tiny model alone makes them in well under a second).
        steps = server.engine._steps
        execute = steps.runner.execute
        monkeypatch.setattr(steps.runner, "execute", lambda scheduled: time.sleep(0.01) or execute(scheduled))
        events = sse(server, "/v1/completions", {"prompt": PROMPTS[5], "max_tokens": 300, "min_tokens": 300,
                                                 "n": 3, "stream": True}, stop_after=4)
        assert len(events) == 4 and all(e["choices"][0]["finish_reason"] is None for e in events)
        stats = wait_idle(server.engine, timeout=30)
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        deadline = time.time() + 5
        while metric(server, 'llmc_requests_total{finish_reason="abort"}') < 3 and time.time() < deadline:
            time.sleep(0.05)
        assert metric(server, 'llmc_requests_total{finish_reason="abort"}') == 3
        assert metric(server, 'llmc_requests_total{finish_reason="length"}') == 0
    finally:
        server.close()


def test_a_refused_choice_aborts_the_others_and_answers_503(serve_tiny_build):
    server = start_server(serve_tiny_build, max_queue_size=1)
    try:
        headers: dict = {}
        status, body = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 50, "n": 8},
                                   reply_headers=headers)
        assert status == 503 and error_text("/v1/completions", body).startswith("the request queue is full"), body
        assert body["error"]["code"] == "queue_full" and int(headers["Retry-After"]) >= 1
        stats = wait_idle(server.engine)
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        assert server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 1})[0] == 200
    finally:
        server.close()


@pytest.mark.parametrize("body, field", [
    ({"max_tokens": 4}, "text_input"),
    ({"text_input": "hi", "max_tokens": "ten"}, "max_tokens"),
    ({"text_input": "hi", "max_tokens": -3}, "max_tokens"),
    ({"text_input": "hi", "max_tokens": 4, "temperature": "hot"}, "temperature"),
    ({"text_input": "word " * 400, "max_tokens": 4}, "max_input_len"),
    ({"text_input": "hi", "max_tokens": 4, "colour": "red"}, "colour"),
    ({"text_input": "hi", "max_tokens": 4, "bad_words": ["x"]}, "bad_words"),
])
def test_malformed_requests_get_400(tiny_server, body, field):
    for path in ("generate", "generate_stream"):
        status, reply = tiny_server.post(f"/v2/models/{tiny_server.model}/{path}", body)
        assert status == 400 and field in reply["error"], reply
    assert tiny_server.post("/v2/models/ensemble/generate", {"text_input": "hi", "max_tokens": 2})[0] == 200


def test_invalid_json_gets_400_and_server_keeps_serving(tiny_server):
    status, reply = tiny_server.post(f"/v2/models/{tiny_server.model}/generate", None, raw=b"{not json")
    assert status == 400 and "JSON" in reply["error"]
    status, reply = tiny_server.post("/v1/chat/completions", None, raw=b"[1, 2]")
    assert status == 400 and "object" in error_text("/v1/chat/completions", reply)
    assert tiny_server.post("/v2/models/ensemble/generate", {"text_input": "hi", "max_tokens": 2})[0] == 200


def test_metrics_counters_move(tiny_server):
    before = {k: metric(tiny_server, k) for k in ('llmc_requests_total{finish_reason="length"}',
                                                 'llmc_time_to_first_token_seconds_count{prompt_tokens="<=128"}',
                                                 "llmc_inter_token_latency_seconds_count",
                                                 "llmc_generation_tokens_total")}
    for _ in range(3):
        assert tiny_server.post("/v2/models/ensemble/generate", {"text_input": "hey", "max_tokens": 5})[0] == 200
    after = {k: metric(tiny_server, k) for k in before}
    keys = list(before)
    assert after[keys[0]] == before[keys[0]] + 3 and after[keys[1]] == before[keys[1]] + 3
    assert after[keys[2]] == before[keys[2]] + 12 and after[keys[3]] == before[keys[3]] + 15
    _, text = tiny_server.get("/metrics")
    for name in ("llmc_num_requests_waiting", "llmc_num_requests_running", "llmc_kv_blocks_used",
                 "llmc_kv_blocks_free", 'llmc_time_to_first_token_seconds_bucket{le="+Inf",prompt_tokens=">512"}',
                 "llmc_request_queue_seconds_count", "llmc_request_tokenize_seconds_count", "llmc_preemptions_total"):
        assert name in text


def test_prefix_cache_hits_and_kv_totals_are_read_from_the_engine(tiny_server):
    name = "llmc_prefix_cache_hit_tokens_total"
    before, queried = metric(tiny_server, name), metric(tiny_server, "llmc_prefix_cache_queried_tokens_total")
    prompt = " ".join(f"item{i}" for i in range(30))  # several full 8-token KV blocks
    for _ in range(2):
        assert tiny_server.post("/v2/models/ensemble/generate", {"text_input": prompt, "max_tokens": 2})[0] == 200
    stats = wait_idle(tiny_server.engine)
    block = tiny_server.engine.runner.block_size
    assert metric(tiny_server, name) == stats["prefix_cache_hit_tokens"] >= before + block
    assert metric(tiny_server, "llmc_prefix_cache_queried_tokens_total") > queried
    assert metric(tiny_server, "llmc_kv_blocks_total") == stats["kv_blocks_total"] > 0


def test_queue_full_gets_503_with_retry_after(serve_tiny_build):
    server = start_server(serve_tiny_build, max_queue_size=1)
    try:
        def call(i):
            headers: dict = {}
            status, body = server.post("/v2/models/ensemble/generate", {"text_input": PROMPTS[i % 16],
                                       "max_tokens": 150, "min_length": 150}, reply_headers=headers)
            return status, body, headers
        with ThreadPoolExecutor(24) as pool:
            results = list(pool.map(call, range(24)))
        statuses = [s for s, _, _ in results]
        assert 503 in statuses and 200 in statuses, statuses
        rejected = [(body, headers) for s, body, headers in results if s == 503]
        assert all("queue is full" in body["error"] and int(h["Retry-After"]) >= 1 for body, h in rejected)
        wait_idle(server.engine)
    finally:
        server.close()


def test_ttft_counts_from_acceptance_with_the_template_and_tokenizing(serve_tiny_build, monkeypatch):
    """The server tokenizes before it submits a request: its TTFT must still start when it took the request in
    (it once started at submission, leaving the template and tokenizing out), and /metrics says where it went."""
    server = start_server(serve_tiny_build)
    try:
        tokenizer = server.engine.tokenizer
        call, render = type(tokenizer).__call__, type(tokenizer).apply_chat_template
        monkeypatch.setattr(type(tokenizer), "__call__", lambda self, *a, **k: time.sleep(0.3) or call(self, *a, **k))
        monkeypatch.setattr(type(tokenizer), "apply_chat_template",
                            lambda self, *a, **k: time.sleep(0.1) or render(self, *a, **k))
        assert server.post("/v2/models/ensemble/generate", {"text_input": "hi", "max_tokens": 2})[0] == 200
        assert server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 2})[0] == 200
        monkeypatch.undo()
        bucket = 'llmc_time_to_first_token_seconds_bucket{le="%s",prompt_tokens="<=128"}'
        assert metric(server, bucket % "+Inf") == 2 and metric(server, bucket % "0.25") == 0
        assert metric(server, "llmc_request_tokenize_seconds_count") == 2
        assert metric(server, "llmc_request_tokenize_seconds_sum") >= 0.6
        assert metric(server, "llmc_request_template_seconds_count") == 1  # the chat request only
        assert 0.1 <= metric(server, "llmc_request_template_seconds_sum") < 0.3
        assert metric(server, "llmc_request_queue_seconds_sum") < 0.3  # the wait before queueing is not queueing
        assert metric(server, "llmc_request_prompt_tokens_count") == 2
    finally:
        server.close()


def test_request_timeout_aborts(serve_tiny_build):
    server = start_server(serve_tiny_build, request_timeout_s=0.3)
    try:
        status, body = server.post("/v2/models/ensemble/generate", {"text_input": "hi", "max_tokens": 400,
                                                                    "min_length": 400})
        assert status == 504 and "timeout" in body["error"]
        wait_idle(server.engine)
        assert metric(server, 'llmc_requests_total{finish_reason="timeout"}') == 1
    finally:
        server.close()


def test_api_key_required_except_health(serve_tiny_build):
    server = start_server(serve_tiny_build, api_key="s3cret")
    try:
        assert server.get("/v2/health/live")[0] == 200
        assert server.get("/v1/models")[0] == 401
        assert server.post("/v2/models/ensemble/generate", {"text_input": "hi", "max_tokens": 2})[0] == 401
        auth = {"Authorization": "Bearer s3cret"}
        assert server.get("/v1/models", auth)[0] == 200
        assert server.post("/v2/models/ensemble/generate", {"text_input": "hi", "max_tokens": 2}, auth)[0] == 200
    finally:
        server.close()
