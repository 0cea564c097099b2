"""Server benchmark (``llmc bench --url``): the offline closed loop, driven over the network.

Protocols: ``http`` (KServe v2 ``/v2/models/<m>/generate_stream``, server-sent events), ``openai``
(``/v1/completions`` with ``stream: true``) and ``grpc`` (``inference.GRPCInferenceService/ModelStreamInfer``
through ``tritonclient.grpc``, decoupled streaming). TTFT is measured from the moment the request is sent
(the connection is already open), and every streamed chunk is timestamped on arrival.

Token counts: the server's own count when it reports one (OpenAI ``usage.completion_tokens``, requested
with ``stream_options.include_usage``), else the number of streamed chunks that carried output (the servers
stream one chunk per token).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
import uuid
from typing import Any, Callable, Iterator

from llmc.bench.records import LevelResult, PeakMonitor, RequestRecord, closed_loop
from llmc.bench.plan import BenchPlan
from llmc.bench.workload import BenchPrompt
from llmc.errors import EngineError, RequestError
from llmc.request.params import SamplingParams

PROTOCOLS = ("http", "grpc", "openai")


def sampling_fields(params: SamplingParams) -> dict[str, Any]:
    """The JSON fields both HTTP protocols send besides the prompt and the length fields. The output length
    is enforced twice: llmc's ``ignore_eos`` and the standard minimum length (``min_length`` in the Triton
    ensemble, ``min_tokens`` in OpenAI-style servers) set to ``max_tokens``."""
    fields: dict[str, Any] = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                              "ignore_eos": True}
    if params.seed is not None:
        fields["seed"] = params.seed
    return fields


def iter_sse(response: http.client.HTTPResponse) -> Iterator[str]:
    """The ``data:`` payloads of a server-sent-event stream, one per event, as they arrive."""
    data: list[str] = []
    while True:
        raw = response.readline()
        if not raw:
            break
        line = raw.decode("utf-8").rstrip("\r\n")
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif not line and data:
            yield "\n".join(data)
            data = []
    if data:
        yield "\n".join(data)


class HttpStreamClient:
    """KServe ``generate_stream`` (protocol "http") or OpenAI ``/v1/completions`` (protocol "openai") over SSE."""

    def __init__(self, url: str, model: str, protocol: str, params: SamplingParams, timeout_s: float = 300.0):
        parsed = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise RequestError("url", f"{url!r} is not an http(s) URL; pass e.g. --url http://127.0.0.1:8000")
        self.scheme, self.host, self.port = parsed.scheme, parsed.hostname, parsed.port
        self.base = parsed.path.rstrip("/")
        self.model = model
        self.protocol = protocol
        self.params = params
        self.timeout_s = timeout_s

    def _connection(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout_s)

    def _request(self, prompt: BenchPrompt) -> tuple[str, dict[str, Any]]:
        fields = sampling_fields(self.params)
        if self.protocol == "openai":
            body = {"model": self.model, "prompt": prompt.text, "max_tokens": prompt.max_new_tokens, "stream": True,
                    "stream_options": {"include_usage": True}, "min_tokens": prompt.max_new_tokens, **fields}
            return f"{self.base}/v1/completions", body
        body = {"text_input": prompt.text, "max_tokens": prompt.max_new_tokens, "min_length": prompt.max_new_tokens,
                "stream": True, **fields}
        return f"{self.base}/v2/models/{urllib.parse.quote(self.model)}/generate_stream", body

    def run_one(self, prompt: BenchPrompt) -> RequestRecord:
        """Send one streaming request and timestamp every chunk; raises EngineError on an HTTP or stream error."""
        path, body = self._request(prompt)
        conn = self._connection()
        try:
            conn.connect()
            start = time.perf_counter()
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json",
                                                          "Accept": "text/event-stream"})
            response = conn.getresponse()
            if response.status != 200:
                raise EngineError(f"{self.protocol} server answered {response.status} for {path}: "
                                  f"{response.read()[:500].decode('utf-8', 'replace')}")
            times, reported, reason = self._consume(response)
            end = time.perf_counter()
        finally:
            conn.close()
        count = reported if reported is not None else len(times)
        return RequestRecord(prompt.prompt_tokens, count, start, tuple(times), end, reason)

    def _consume(self, response: http.client.HTTPResponse) -> tuple[list[float], int | None, str | None]:
        """Read the stream: arrival time of each chunk with output, the server's token count, finish reason."""
        times: list[float] = []
        reported: int | None = None
        reason: str | None = None
        for payload in iter_sse(response):
            now = time.perf_counter()
            if payload.strip() == "[DONE]":
                break
            event = json.loads(payload)
            if "error" in event:  # KServe: a string; OpenAI: {"message", "type", "param", "code"}
                error = event["error"]
                message = error.get("message", error) if isinstance(error, dict) else error
                raise EngineError(f"the server failed the stream: {message}")
            if self.protocol == "openai":
                usage = event.get("usage") or {}
                if usage.get("completion_tokens") is not None:
                    reported = int(usage["completion_tokens"])
                choices = event.get("choices") or []
                if choices:
                    reason = choices[0].get("finish_reason") or reason
                    if choices[0].get("text"):
                        times.append(now)
            elif event.get("text_output"):
                times.append(now)
                reason = event.get("finish_reason", reason)
        return times, reported, reason

    def close(self) -> None:
        """Nothing is kept open between requests."""


class GrpcStreamClient:
    """Triton gRPC ``ModelStreamInfer`` through ``tritonclient.grpc``: one client and stream per worker thread."""

    def __init__(self, url: str, model: str, params: SamplingParams, timeout_s: float = 300.0):
        self.url = url.split("://", 1)[-1].rstrip("/")
        self.model = model
        self.params = params
        self.timeout_s = timeout_s
        self._local = threading.local()
        self._clients: list[Any] = []
        self._lock = threading.Lock()

    def _stream(self) -> tuple[Any, Any]:
        """This thread's (client, response queue); the stream is started on first use."""
        import queue

        import tritonclient.grpc as grpcclient

        if getattr(self._local, "client", None) is None:
            inbox: queue.Queue = queue.Queue()
            client = grpcclient.InferenceServerClient(self.url)
            client.start_stream(callback=lambda result, error: inbox.put((time.perf_counter(), result, error)))
            self._local.client, self._local.inbox = client, inbox
            with self._lock:
                self._clients.append(client)
        return self._local.client, self._local.inbox

    def _inputs(self, prompt: BenchPrompt) -> list[Any]:
        import numpy as np
        import tritonclient.grpc as grpcclient

        def tensor(name: str, dtype: str, value: Any, np_dtype: Any) -> Any:
            t = grpcclient.InferInput(name, [1, 1], dtype)
            t.set_data_from_numpy(np.array([[value]], dtype=np_dtype))
            return t

        return [tensor("text_input", "BYTES", prompt.text.encode("utf-8"), object),
                tensor("max_tokens", "INT32", prompt.max_new_tokens, np.int32),
                tensor("min_length", "INT32", prompt.max_new_tokens, np.int32),  # = ignore_eos on Triton too
                tensor("stream", "BOOL", True, bool),
                tensor("temperature", "FP32", self.params.temperature, np.float32),
                tensor("top_p", "FP32", self.params.top_p, np.float32),
                tensor("top_k", "INT32", self.params.top_k, np.int32)]

    def run_one(self, prompt: BenchPrompt) -> RequestRecord:
        """Send one request on this thread's stream and collect its responses until the final one."""
        client, inbox = self._stream()
        request_id = uuid.uuid4().hex
        inputs = self._inputs(prompt)
        start = time.perf_counter()
        client.async_stream_infer(self.model, inputs, request_id=request_id, enable_empty_final_response=True,
                                  parameters={"ignore_eos": True})
        times: list[float] = []
        while True:
            now, result, error = inbox.get(timeout=self.timeout_s)
            if error is not None:
                raise EngineError(f"the gRPC server failed the stream: {error}")
            response = result.get_response()
            text = result.as_numpy("text_output")
            if text is not None and text.size and bytes(text.reshape(-1)[0]):
                times.append(now)
            params = response.parameters
            if "triton_final_response" in params and params["triton_final_response"].bool_param:
                reason = params["finish_reason"].string_param if "finish_reason" in params else None
                return RequestRecord(prompt.prompt_tokens, len(times), start, tuple(times), now, reason)

    def close(self) -> None:
        """Stop every worker's stream and close its client."""
        with self._lock:
            for client in self._clients:
                client.stop_stream()
                client.close()
            self._clients.clear()


def make_client(protocol: str, url: str, model: str, params: SamplingParams) -> Any:
    """The client for ``protocol`` ("http", "grpc" or "openai")."""
    if protocol == "grpc":
        return GrpcStreamClient(url, model, params)
    if protocol in ("http", "openai"):
        return HttpStreamClient(url, model, protocol, params)
    raise RequestError("protocol", f"unknown protocol {protocol!r}; use one of {', '.join(PROTOCOLS)}")


def run_client(client: Any, plan: BenchPlan, on_level: Callable[[LevelResult], None] | None = None,
               ) -> list[LevelResult]:
    """Warm up with ``plan.warmup`` (not measured), then run each level of the plan as a closed loop
    (``on_level`` is called after each)."""
    for prompt in plan.warmup:
        client.run_one(prompt)
    results = []
    for concurrency, prompts in plan.levels:
        with PeakMonitor() as monitor:
            records, wall = closed_loop(list(prompts), concurrency, client.run_one, time.perf_counter)
        memory = {"rss_peak_mb": round(monitor.peaks["rss_mb"], 1), "rss_of": "the benchmark client process",
                  "note": "server memory is not visible to the client; read the server's /metrics"}
        results.append(LevelResult(concurrency, tuple(records), wall, memory))
        if on_level is not None:
            on_level(results[-1])
    return results
