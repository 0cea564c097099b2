#!/usr/bin/env python3
"""Soak test of ``llmc serve``: N minutes of mixed traffic at concurrency 32, then checks that nothing leaked.

Starts ``llmc serve BUILD`` as a subprocess, warms it up (one request of every kind), records its resident
memory (RSS) and open file descriptors, then runs CONCURRENCY client threads for the duration. Each request is drawn
from a mix: KServe generate (JSON and SSE), OpenAI chat (also n = 3 choices with log-probabilities, JSON schemas,
function calls named or "auto"), streaming completions and prompts scored as lm-eval's loglikelihood requests are
(echo, logprobs, max_tokens 0), gRPC ModelInfer and ModelStreamInfer (tritonclient), HTTP clients that disconnect
mid-stream or before the answer, gRPC streams cancelled after their first response, and a few hostile requests (deep
JSON, lone surrogates, malformed chat and /infer bodies, an oversized prompt) that must get their 4xx.
Afterwards it waits for the server to drain and checks, printing one report (``--json`` writes it too):

- zero unexpected outcomes (a 5xx, a dropped connection, a wrong status, a stream without its final event);
- KV blocks in use back to 0 and no request in flight;
- RSS growth under 5 % from the end of the warm-up phase to the end (``--warmup`` seconds of load first);
- open file descriptors back to their count after the warm-up.

Exit status 0 when every check holds, 1 otherwise. Example (README): ``python scripts/soak.py
build/smollm2-135m --minutes 30 --json soak.json``; CI runs ``--seconds 60`` on a tiny build.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

HOSTILE: list[tuple[str, bytes, int]] = [  # (path, raw body, expected status)
    ("/v2/models/ensemble/generate", b"[" * 100_000 + b"]" * 100_000, 400),
    ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 4}', 400),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}', 400),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "hi"}]}', 400),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "stream_options": "x"}', 400),
    ("/v2/models/ensemble/infer", b'{"inputs": [1, 2]}', 400),
    ("/v2/models/ensemble/generate", json.dumps({"text_input": "word " * 100_000, "max_tokens": 4}).encode(), 400),
    ("/v2/models/ensemble/generate", b'{"text_input": "hi", "max_tokens": 4, "colour": "red"}', 400),
]
WORDS = "the river mountain code star bread rain glass train map book tea cat dog music fire snow".split()


class Server:
    """``llmc serve`` in a subprocess; RSS and fd counts read from /proc."""

    def __init__(self, build: Path, device: str, log: Path):
        self.port, self.grpc_port = _free_port(), _free_port()
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llmc.cli", "serve", str(build), "--device", device, "--port", str(self.port),
             "--grpc-port", str(self.grpc_port)], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 300
        while not self._ready():
            if self.proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"llmc serve did not start; see {log}")
            time.sleep(0.5)

    def _ready(self) -> bool:
        try:
            return http_json(self.port, "GET", "/v2/health/ready")[0] == 200
        except OSError:
            return False

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return kb / 1024

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def metrics(self) -> dict[str, float]:
        _, text = http_json(self.port, "GET", "/metrics")
        samples = (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
        return {name: float(value) for name, value in samples}

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(120)
        self.log.close()
        return code


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(port: int, method: str, path: str, body: bytes | None = None, timeout: float = 600) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        text = response.read().decode()
        try:
            return response.status, json.loads(text)
        except json.JSONDecodeError:
            return response.status, text
    finally:
        conn.close()


class Client:
    """One client thread's request kinds; each returns an outcome: "ok", "expected:<why>" or "unexpected:<why>"."""

    def __init__(self, server: Server, rng: random.Random, max_tokens: int):
        import tritonclient.grpc as grpcclient

        self.server, self.rng, self.max_tokens = server, rng, max_tokens
        self.grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")

    def prompt(self) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(3, 40)))

    def tokens(self) -> int:
        return self.rng.randint(4, self.max_tokens)

    def generate(self) -> str:
        status, body = http_json(self.server.port, "POST", "/v2/models/ensemble/generate",
                                 json.dumps({"text_input": self.prompt(), "max_tokens": self.tokens()}).encode())
        return "ok" if status == 200 and body.get("finish_reason") in ("length", "stop") else f"unexpected:{status}"

    def _sse(self, path: str, body: dict, stop_after: int | None = None) -> str:
        conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=600)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                return f"unexpected:{response.status}"
            events = 0
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                events += 1
                payload = line[5:].strip()
                if stop_after is not None and events >= stop_after:
                    return "expected:disconnect"
                if payload == "[DONE]" or '"finish_reason": "length"' in payload or '"finish_reason": "stop"' in payload:
                    return "ok"
                if '"error"' in payload:
                    return "unexpected:stream-error"
            return "unexpected:stream-ended-early" if stop_after is None else "expected:disconnect"
        finally:
            conn.close()

    def generate_stream(self) -> str:
        return self._sse("/v2/models/ensemble/generate_stream",
                         {"text_input": self.prompt(), "max_tokens": self.tokens(), "stream": True})

    def openai_chat(self) -> str:
        body = {"messages": [{"role": "user", "content": self.prompt()}], "max_tokens": self.tokens()}
        status, reply = http_json(self.server.port, "POST", "/v1/chat/completions", json.dumps(body).encode())
        return "ok" if status == 200 and reply["choices"][0]["finish_reason"] else f"unexpected:{status}"

    def openai_choices(self) -> str:
        """Three choices of one chat request, each with its tokens' log-probabilities."""
        body = {"messages": [{"role": "user", "content": self.prompt()}], "max_tokens": self.tokens(), "n": 3,
                "temperature": 0.8, "logprobs": True, "top_logprobs": 2}
        status, reply = http_json(self.server.port, "POST", "/v1/chat/completions", json.dumps(body).encode())
        ok = status == 200 and [c["index"] for c in reply["choices"]] == [0, 1, 2] and all(
            c["finish_reason"] and len(c["logprobs"]["content"]) >= 1 for c in reply["choices"])
        return "ok" if ok else f"unexpected:choices-{status}"

    def openai_score(self) -> str:
        """Two prompts scored as lm-eval's loglikelihood requests are (echo, their tokens' log-probabilities, no
        completion): each prompt comes back with a null first entry and a log-probability <= 0 for every other."""
        body = {"prompt": [self.prompt(), self.prompt()], "max_tokens": 0, "echo": True, "logprobs": 1}
        status, reply = http_json(self.server.port, "POST", "/v1/completions", json.dumps(body).encode())
        ok = status == 200 and len(reply["choices"]) == 2 and all(
            c["logprobs"]["token_logprobs"][0] is None and all(v <= 0 for v in c["logprobs"]["token_logprobs"][1:])
            for c in reply["choices"]) and reply["usage"]["completion_tokens"] == 0
        return "ok" if ok else f"unexpected:score-{status}"

    def openai_json(self) -> str:
        """A chat answer constrained to a JSON schema (structured outputs): it parses and follows the schema."""
        fmt = {"type": "json_schema", "json_schema": {"name": "soak", "schema": SIDE}}
        choice = self._chat({"max_tokens": 32, "temperature": 0.8, "response_format": fmt})
        if isinstance(choice, str) or choice["finish_reason"] == "length":  # an error, or a JSON prefix cut short
            return choice if isinstance(choice, str) else "ok"
        return "ok" if json.loads(choice["message"]["content"])["side"] in ("left", "right") else "unexpected:json"

    def openai_tools(self) -> str:
        """A named function call (its arguments follow the function's schema) or tool_choice "auto" (text or calls)."""
        tool, auto = {"type": "function", "function": {"name": "pick", "parameters": SIDE}}, self.rng.random() < 0.5
        named = {} if auto else {"tool_choice": {"type": "function", "function": {"name": "pick"}}}
        choice = self._chat({"max_tokens": 32, "tools": [tool], **named})
        if isinstance(choice, str):
            return choice
        calls = choice["message"].get("tool_calls") or []
        if auto:
            ok = all(c["function"]["name"] == "pick" for c in calls) and bool(calls or choice["message"]["content"])
        else:
            ok = len(calls) == 1 and json.loads(calls[0]["function"]["arguments"])["side"] in ("left", "right")
        return "ok" if ok else "unexpected:tools-call"

    def _chat(self, extra: dict) -> dict | str:
        """The first choice of a chat request with ``extra`` fields, or an "unexpected:" outcome."""
        body = {"messages": [{"role": "user", "content": self.prompt()}], **extra}
        status, reply = http_json(self.server.port, "POST", "/v1/chat/completions", json.dumps(body).encode())
        return reply["choices"][0] if status == 200 else f"unexpected:chat-{status}"

    def openai_stream(self) -> str:
        return self._sse("/v1/completions", {"prompt": self.prompt(), "max_tokens": self.tokens(), "stream": True})

    def disconnect_mid_stream(self) -> str:
        return self._sse("/v2/models/ensemble/generate_stream", {"text_input": self.prompt(), "max_tokens": 200,
                                                                 "stream": True}, stop_after=self.rng.randint(1, 4))

    def close_before_answer(self) -> str:
        body = json.dumps({"text_input": self.prompt(), "max_tokens": 200}).encode()
        with socket.create_connection(("127.0.0.1", self.server.port)) as sock:
            sock.sendall(b"POST /v2/models/ensemble/generate HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json"
                         b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            time.sleep(self.rng.uniform(0.0, 0.5))
        return "expected:closed-early"

    def _grpc_inputs(self, max_tokens: int) -> list:
        import numpy as np
        import tritonclient.grpc as grpcclient

        inputs = [grpcclient.InferInput("text_input", [1, 1], "BYTES"),
                  grpcclient.InferInput("max_tokens", [1, 1], "INT32"), grpcclient.InferInput("stream", [1, 1], "BOOL")]
        inputs[0].set_data_from_numpy(np.array([[self.prompt().encode()]], dtype=np.object_))
        inputs[1].set_data_from_numpy(np.array([[max_tokens]], dtype=np.int32))
        inputs[2].set_data_from_numpy(np.array([[True]], dtype=np.bool_))
        return inputs

    def grpc_infer(self) -> str:
        result = self.grpc.infer("ensemble", self._grpc_inputs(self.tokens()))
        return "ok" if result.as_numpy("text_output") is not None else "unexpected:grpc-no-output"

    def grpc_stream(self, cancel: bool = False) -> str:
        import queue

        events: queue.Queue = queue.Queue()
        self.grpc.start_stream(callback=lambda result, error: events.put((result, error)))
        try:
            self.grpc.async_stream_infer("ensemble", self._grpc_inputs(200 if cancel else self.tokens()),
                                         enable_empty_final_response=True)
            while True:
                result, error = events.get(timeout=600)
                if error is not None:
                    return f"unexpected:grpc:{str(error)[:60]}"
                if cancel:
                    return "expected:grpc-cancel"
                if result.get_response().parameters["triton_final_response"].bool_param:
                    return "ok"
        finally:
            self.grpc.stop_stream(cancel_requests=cancel)

    def grpc_cancel(self) -> str:
        return self.grpc_stream(cancel=True)

    def hostile(self) -> str:
        path, body, expected = self.rng.choice(HOSTILE)
        status, reply = http_json(self.server.port, "POST", path, body)
        ok = status == expected and isinstance(reply, dict) and "error" in reply
        return "expected:hostile" if ok else f"unexpected:hostile-{status}"


SIDE = {"type": "object", "properties": {"side": {"enum": ["left", "right"]}}, "required": ["side"],
        "additionalProperties": False}
MIX: dict[str, tuple[float, Callable[[Client], str]]] = {  # kind -> (weight, call)
    "generate": (0.15, Client.generate), "generate_stream": (0.15, Client.generate_stream),
    "openai_chat": (0.10, Client.openai_chat), "openai_stream": (0.10, Client.openai_stream),
    "openai_choices": (0.05, Client.openai_choices), "openai_score": (0.05, Client.openai_score),
    "openai_json": (0.05, Client.openai_json), "openai_tools": (0.04, Client.openai_tools),
    "grpc_infer": (0.10, Client.grpc_infer), "grpc_stream": (0.10, Client.grpc_stream),
    "disconnect_mid_stream": (0.08, Client.disconnect_mid_stream),
    "close_before_answer": (0.05, Client.close_before_answer), "grpc_cancel": (0.07, Client.grpc_cancel),
    "hostile": (0.05, Client.hostile),
}


def run_load(server: Server, seconds: float, concurrency: int, seed: int, max_tokens: int,
             outcomes: Counter, kinds: Counter, examples: list[str]) -> None:
    """CONCURRENCY threads issuing mixed requests until ``seconds`` have passed."""
    end = time.time() + seconds
    lock = threading.Lock()
    names, weights = list(MIX), [w for w, _ in MIX.values()]

    def worker(index: int) -> None:
        client = Client(server, random.Random(seed * 1000 + index), max_tokens)
        while time.time() < end:
            kind = client.rng.choices(names, weights)[0]
            try:
                outcome = MIX[kind][1](client)
            except Exception as exc:  # noqa: BLE001 - a client-side failure is an unexpected outcome, reported
                outcome = f"unexpected:{type(exc).__name__}:{str(exc)[:60]}"
            with lock:
                kinds[kind] += 1
                outcomes[outcome.split(":")[0] if outcome.startswith("ok") else outcome] += 1
                if outcome.startswith("unexpected") and len(examples) < 20:
                    examples.append(f"{kind}: {outcome}")
        client.grpc.close()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def wait_drained(server: Server, timeout: float = 120.0) -> dict[str, float]:
    """Poll /metrics until no request runs, waits or is in flight, and no KV block is in use."""
    deadline = time.time() + timeout
    while True:
        m = server.metrics()
        busy = [m.get(k, 0.0) for k in ("llmc_kv_blocks_used", "llmc_requests_in_flight", "llmc_num_requests_running",
                                        "llmc_num_requests_waiting")]
        if not any(busy) or time.time() > deadline:
            return m
        time.sleep(0.5)


def settled_fds(server: Server, baseline: int, timeout: float = 30.0, stable_s: float = 3.0) -> tuple[int, float]:
    """The server's fd count once the clients' closed connections are gone: the server releases the sockets of
    connections the clients just closed (HTTP, gRPC channels) a moment later, so poll until the count is at most
    ``baseline``, or has not changed for ``stable_s`` seconds, or ``timeout`` passed (a leaked fd never goes).
    Returns the count and the seconds it took."""
    started = time.time()
    last, since = server.open_fds(), started
    while last > baseline and time.time() - since < stable_s and time.time() - started < timeout:
        time.sleep(0.5)
        count = server.open_fds()
        if count != last:
            last, since = count, time.time()
    return last, round(time.time() - started, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("build", type=Path, help="build folder to serve (llmc build output)")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--minutes", type=float, help="load duration in minutes")
    length.add_argument("--seconds", type=float, help="load duration in seconds (default 60)")
    parser.add_argument("--warmup", type=float, default=None,
                        help="seconds of load before the RSS / fd baseline (default: 10%% of the run, 10-180 s)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48, help="upper bound of each request's max_tokens")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument("--log", type=Path, default=Path("soak-server.log"), help="the server's output")
    args = parser.parse_args()
    seconds = args.minutes * 60 if args.minutes else (args.seconds or 60.0)
    warmup = args.warmup if args.warmup is not None else min(max(0.1 * seconds, 10.0), 180.0)

    server = Server(args.build, args.device, args.log)
    report: dict[str, Any] = {"build": str(args.build), "seconds": seconds, "warmup_s": warmup,
                              "concurrency": args.concurrency, "fds_at_start": server.open_fds(),
                              "rss_mb_at_start": round(server.rss_mb(), 1), "load_average_start": os.getloadavg()}
    outcomes, kinds, examples = Counter(), Counter(), []
    run_load(server, warmup, args.concurrency, args.seed, args.max_tokens, outcomes, kinds, examples)
    wait_drained(server)
    report.update(fds_after_warmup=settled_fds(server, report["fds_at_start"])[0],
                  rss_mb_after_warmup=round(server.rss_mb(), 1))
    started = time.time()
    run_load(server, seconds, args.concurrency, args.seed + 1, args.max_tokens, outcomes, kinds, examples)
    report["load_s"] = round(time.time() - started, 1)
    drained = wait_drained(server)
    fds_at_end, fds_settle_s = settled_fds(server, report["fds_after_warmup"])
    report.update(
        requests=sum(kinds.values()), requests_by_kind=dict(kinds), outcomes=dict(outcomes),
        unexpected=sum(n for k, n in outcomes.items() if k.startswith("unexpected")), unexpected_examples=examples,
        kv_blocks_used_after_drain=drained.get("llmc_kv_blocks_used"),
        requests_in_flight_after_drain=drained.get("llmc_requests_in_flight"),
        server_requests_total={k: v for k, v in drained.items() if k.startswith("llmc_requests_total")},
        fds_at_end=fds_at_end, fds_settle_s=fds_settle_s, rss_mb_at_end=round(server.rss_mb(), 1),
        load_average_end=os.getloadavg())
    report["rss_growth_pct"] = round(100 * (report["rss_mb_at_end"] / report["rss_mb_after_warmup"] - 1), 2)
    report["server_exit_status"] = server.stop()
    report["checks"] = {
        "no unexpected outcomes": report["unexpected"] == 0,
        "KV blocks back to 0": report["kv_blocks_used_after_drain"] == 0,
        "nothing in flight": report["requests_in_flight_after_drain"] == 0,
        "RSS growth < 5 % after warm-up": report["rss_growth_pct"] < 5.0,
        "fds back to the warm-up count": report["fds_at_end"] <= report["fds_after_warmup"],
        "server exits 0 on SIGTERM": report["server_exit_status"] == 0,
    }
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0 if all(report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
