"""The wired application under hostile input (issue 18): every bad request is a 4xx with a JSON error naming the
client's field, huge prompts are refused before tokenization, max_tokens is capped and said so, requests closed
before their first event count as aborted, slow or idle sockets are closed, and the API key is compared in
constant time. The server keeps serving afterwards."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.parse

import pytest

from tests.serve.conftest import error_text, start_server
from tests.serve.test_server import metric, sse, wait_idle

ENDPOINTS = ("/v2/models/ensemble/generate", "/v2/models/ensemble/generate_stream", "/v2/models/ensemble/infer",
             "/v1/completions", "/v1/chat/completions")


def still_serves(server) -> None:
    assert server.post("/v2/models/ensemble/generate", {"text_input": "hi", "max_tokens": 2})[0] == 200


@pytest.mark.parametrize("path", ENDPOINTS)
def test_deeply_nested_json_is_a_400_on_every_endpoint(tiny_server, path):
    status, reply = tiny_server.post(path, None, raw=b"[" * 100_000 + b"]" * 100_000)
    assert status == 400 and "nests deeper" in error_text(path, reply), reply
    status, reply = tiny_server.post(path, None, raw=b'{"x": ' + b"[" * 40 + b"]" * 40 + b"}")
    assert status == 400 and error_text(path, reply).startswith("x: nests deeper"), reply
    still_serves(tiny_server)


@pytest.mark.parametrize("path, body, field", [
    ("/v2/models/ensemble/generate", '{"text_input": "a\\ud800b", "max_tokens": 2}', "text_input"),
    ("/v1/completions", '{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages[0].content"),
])
def test_lone_surrogates_are_a_400_naming_the_field(tiny_server, path, body, field):
    status, reply = tiny_server.post(path, None, raw=body.encode())
    message = error_text(path, reply)
    assert status == 400 and message.startswith(field + ":") and "surrogate" in message, reply


@pytest.mark.parametrize("body, field", [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": [1, "x", None]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream": True, "stream_options": "x"}, "stream_options"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "min_tokens": 5}, "min_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": ["x"] * 100}, "stop"),
])
def test_bad_chat_requests_are_a_400_naming_the_clients_field(tiny_server, body, field):
    status, reply = tiny_server.post("/v1/chat/completions", body)
    message = error_text("/v1/chat/completions", reply)
    assert status == 400 and message.startswith(field + ":") and reply["error"]["param"] == field, reply
    assert "max_new_tokens" not in message and "prompt[" not in message


def test_kserve_errors_name_the_ensembles_fields(tiny_server):
    status, reply = tiny_server.post("/v2/models/ensemble/generate", {"text_input": "hi", "max_tokens": 2,
                                                                      "min_length": 9})
    assert status == 400 and reply["error"].startswith("min_length:") and "max_tokens=2" in reply["error"], reply


def infer_raw(server, body: dict, binary: bytes = b"") -> tuple[int, dict]:
    head = json.dumps(body).encode()
    return server.post("/v2/models/ensemble/infer", None, raw=head + binary,
                       headers={"Inference-Header-Content-Length": str(len(head))} if binary else None)


@pytest.mark.parametrize("body, binary, field", [
    ({"inputs": [1, 2]}, b"", "inputs[0]"),
    ({"inputs": [{"name": "text_input", "shape": [1, 1], "data": ["hi"]}]}, b"", "inputs[0].datatype"),
    ({"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1, 1],
                  "parameters": {"binary_data_size": "6"}}]}, b"\x02\0\0\0hi", "inputs[0].parameters.binary_data_size"),
    ({"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1, 1],
                  "parameters": {"binary_data_size": 600}}]}, b"\x02\0\0\0hi", "inputs[0].parameters.binary_data_size"),
    ({"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1, 1],
                  "parameters": {"binary_data_size": 6}}]}, b"\x02\0\0\0hi!!", "body"),
    ({"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1, 1],
                  "parameters": {"binary_data_size": 3}}]}, b"\x02\0\0", "text_input"),
])
def test_malformed_infer_requests_are_a_400_naming_the_part(tiny_server, body, binary, field):
    status, reply = infer_raw(tiny_server, body, binary)
    assert status == 400 and reply["error"].startswith(field + ":"), reply
    still_serves(tiny_server)


def test_five_megabyte_prompt_is_refused_before_tokenizing(tiny_server, monkeypatch):
    calls = []
    tokenizer = tiny_server.engine.tokenizer
    original = type(tokenizer).__call__
    monkeypatch.setattr(type(tokenizer), "__call__", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    big = "word " * 1_000_000
    started = time.perf_counter()
    for path, body, field in [
            ("/v2/models/ensemble/generate", {"text_input": big, "max_tokens": 2}, "text_input"),
            ("/v1/completions", {"prompt": big, "max_tokens": 2}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": big}]}, "messages")]:
        status, reply = tiny_server.post(path, body)
        assert status == 400 and error_text(path, reply).startswith(field + ": has 5000000 characters"), reply
    assert calls == [] and time.perf_counter() - started < 20
    monkeypatch.undo()
    still_serves(tiny_server)


def test_huge_max_tokens_is_capped_and_said_so(tiny_server):
    for max_tokens in (10**9, 2**70):
        status, body = tiny_server.post("/v2/models/ensemble/generate", {"text_input": "hi", "max_tokens": max_tokens,
                                                                         "temperature": 0.0})
        assert status == 200 and body["finish_reason"] in ("length", "stop"), body
        assert f"max_tokens={max_tokens} is more than" in body["warnings"][0] and "capped to" in body["warnings"][0]
    status, body = tiny_server.post("/v1/completions", {"prompt": "hi", "max_tokens": 10**9, "temperature": 0})
    assert status == 200 and "capped to" in body["warnings"][0]
    chunks = sse(tiny_server, "/v1/completions", {"prompt": "hi", "max_tokens": 10**9, "stream": True})
    assert "capped to" in chunks[-2]["warnings"][0] and all("warnings" not in c for c in chunks[:-2])
    status, body = tiny_server.post("/v2/models/ensemble/generate", {"text_input": "hi", "max_tokens": 5})
    assert status == 200 and "warnings" not in body


def test_strict_max_tokens_is_a_400(tiny_server):
    status, reply = tiny_server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                              "max_tokens": 10**9, "strict_max_tokens": True})
    message = error_text("/v1/chat/completions", reply)
    assert status == 400 and message.startswith("max_tokens: is 1000000000, but this prompt"), reply
    status, reply = tiny_server.post("/v2/models/ensemble/generate", {"text_input": "hi", "max_tokens": 10**9,
                                                                      "strict_max_tokens": True})
    assert status == 400 and reply["error"].startswith("max_tokens:"), reply


def test_requests_closed_before_their_first_event_are_counted(tiny_server):
    url = urllib.parse.urlparse(tiny_server.http)
    _, text = tiny_server.get("/metrics")

    def totals() -> tuple[float, float]:
        _, text = tiny_server.get("/metrics")
        counts = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("llmc_requests_total{")]
        return sum(counts), metric(tiny_server, 'llmc_requests_total{finish_reason="abort"}')

    before_all, before_abort = totals()
    body = json.dumps({"text_input": "word " * 200, "max_tokens": 300, "min_length": 300}).encode()
    for i in range(20):
        with socket.create_connection((url.hostname, url.port)) as sock:
            sock.sendall(b"POST /v2/models/ensemble/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                         b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            time.sleep(0.005 + 0.01 * (i % 5))  # read by the server; left while tokenizing, queued or in prefill
    wait_idle(tiny_server.engine, timeout=30)
    deadline = time.time() + 10
    while totals()[0] < before_all + 20 and time.time() < deadline:
        time.sleep(0.1)
    counted, aborted = totals()
    # Every request the server read is counted once; nearly all as aborted (18-20 of 20 here: a close that
    # arrives while aiohttp is not reading the socket is noticed only when the answer is written).
    assert counted == before_all + 20 and aborted >= before_abort + 10, (counted, aborted)


def test_unknown_routes_and_methods_answer_json(tiny_server):
    status, reply = tiny_server.get("/nope")
    assert status == 404 and "Not Found" in error_text("/nope", reply)
    status, reply = tiny_server.get("/v1/completions")
    assert status == 405 and "Method Not Allowed" in error_text("/v1/completions", reply)
    status, reply = tiny_server.post("/v1/embeddings", {"input": "hi"})
    assert status == 404 and "Not Found" in error_text("/v1/embeddings", reply)


def test_api_key_is_compared_in_constant_time(serve_tiny_build, monkeypatch):
    import hmac

    from llmc.serve import state

    seen, compare = [], hmac.compare_digest
    monkeypatch.setattr(state.hmac, "compare_digest", lambda a, b: seen.append((a, b)) or compare(a, b))
    server = start_server(serve_tiny_build, api_key="s3cret")
    try:
        assert server.get("/v1/models", {"Authorization": "Bearer s3creX"})[0] == 401
        assert server.get("/v1/models", {"Authorization": "Bearer s3cret"})[0] == 200
        assert seen == [(b"Bearer s3creX", b"Bearer s3cret"), (b"Bearer s3cret", b"Bearer s3cret")]
    finally:
        server.close()


def _closed_after(sock: socket.socket, limit_s: float) -> float:
    """Seconds until the server closes ``sock`` (reads EOF or a response); fails past ``limit_s``."""
    sock.settimeout(limit_s)
    started = time.perf_counter()
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return time.perf_counter() - started
        data += chunk


def test_slow_idle_and_lying_clients_are_cut_off(serve_tiny_build):
    server = start_server(serve_tiny_build, keepalive_timeout_s=1.0, body_timeout_s=1.0)
    url = urllib.parse.urlparse(server.http)
    try:
        idle = socket.create_connection((url.hostname, url.port))
        assert _closed_after(idle, 10) < 5
        slow_headers = socket.create_connection((url.hostname, url.port))
        stop = threading.Event()

        def trickle() -> None:  # one header byte every 0.3 s, never finishing the head
            for byte in b"POST /v2/models/ensemble/generate HTTP/1.1\r\nHost: x\r\n":
                if stop.is_set():
                    return
                try:
                    slow_headers.send(bytes([byte]))
                except OSError:
                    return
                time.sleep(0.3)

        threading.Thread(target=trickle, daemon=True).start()
        assert _closed_after(slow_headers, 10) < 5
        stop.set()
        slow_body = socket.create_connection((url.hostname, url.port))
        slow_body.sendall(b"POST /v2/models/ensemble/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        slow_body.settimeout(10)
        assert b" 408 " in slow_body.recv(65536).split(b"\r\n")[0]
        huge = socket.create_connection((url.hostname, url.port))
        huge.sendall(b"POST /v2/models/ensemble/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000000\r\n\r\n")
        huge.settimeout(10)
        started = time.perf_counter()
        assert b" 413 " in huge.recv(65536).split(b"\r\n")[0] and time.perf_counter() - started < 2
        for sock in (idle, slow_headers, slow_body, huge):
            sock.close()
        still_serves(server)
    finally:
        server.close()


def test_grpc_refuses_huge_prompts_and_fp16_contents_with_invalid_argument(tiny_server):
    import io

    import grpc
    import numpy as np
    import tritonclient.grpc as grpcclient

    from scripts.client_grpc_stream import stream_once

    started = time.perf_counter()
    result = stream_once(tiny_server.grpc, "ensemble", "word " * 1_000_000, 4, out=io.StringIO())
    assert "INVALID_ARGUMENT" in result["error"] and "text_input: has 5000000 characters" in result["error"]
    assert time.perf_counter() - started < 20
    client = grpcclient.InferenceServerClient(tiny_server.grpc)
    inputs = [grpcclient.InferInput("text_input", [1, 1], "BYTES"), grpcclient.InferInput("max_tokens", [1, 1], "INT32"),
              grpcclient.InferInput("temperature", [1, 1], "FP16")]
    inputs[0].set_data_from_numpy(np.array([[b"hi"]], dtype=np.object_))
    inputs[1].set_data_from_numpy(np.array([[10**9]], dtype=np.int32))
    inputs[2].set_data_from_numpy(np.array([[0.0]], dtype=np.float16))
    result = client.infer("ensemble", inputs)  # raw contents: FP16 is fine, and max_tokens is capped
    assert "capped to" in result.get_response().parameters["warnings"].string_param
    request = grpcclient.service_pb2.ModelInferRequest(model_name="ensemble")
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1, 1]).contents.bytes_contents.append(b"hi")
    request.inputs.add(name="max_tokens", datatype="INT32", shape=[1, 1]).contents.int_contents.append(4)
    request.inputs.add(name="temperature", datatype="FP16", shape=[1, 1])
    with pytest.raises(grpc.RpcError) as info:  # typed contents, as a hand-written client might send them
        client._client_stub.ModelInfer(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "temperature: a FP16 input must be sent in raw_input_contents"
    client.close()
