"""Serving test fixtures: tiny / embedded build folders and in-process servers on free loopback ports."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from llmc.errors import ServeError
from llmc.serve.run import ServeOptions, load_engine, serve_async


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: every socket stays bound until all are picked (two separate picks could return
    one port, and the gRPC server then failed to bind the HTTP server's)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


@dataclass
class RunningServer:
    """A server running on a background thread's event loop; ``engine`` is the served Engine."""

    engine: Any
    http: str  # "http://127.0.0.1:PORT"
    grpc: str  # "127.0.0.1:PORT"
    model: str
    loop: asyncio.AbstractEventLoop
    stop: asyncio.Event
    thread: threading.Thread

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)
        assert not self.thread.is_alive(), "the server did not shut down"

    def post(self, path: str, body: Any, headers: dict | None = None, raw: bytes | None = None,
             reply_headers: dict | None = None) -> tuple[int, Any]:
        """POST JSON (or ``raw`` bytes); returns (status, parsed JSON or text); fills ``reply_headers``."""
        data = raw if raw is not None else json.dumps(body).encode()
        req = urllib.request.Request(self.http + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
        return _send(req, reply_headers)

    def get(self, path: str, headers: dict | None = None) -> tuple[int, Any]:
        return _send(urllib.request.Request(self.http + path, headers=headers or {}))


def _send(req: urllib.request.Request, reply_headers: dict | None = None) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, text, headers = r.status, r.read().decode(), dict(r.headers)
    except urllib.error.HTTPError as exc:
        status, text, headers = exc.code, exc.read().decode(), dict(exc.headers)
    if reply_headers is not None:
        reply_headers.update(headers)
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def error_text(path: str, reply: dict) -> str:
    """The message of an error reply, after checking the route's shape: OpenAI's error object under ``/v1/`` (the
    ``message`` OpenAI's client libraries show), ``{"error": "..."}`` elsewhere."""
    error = reply["error"]
    if path.startswith("/v1/"):
        assert set(error) == {"message", "type", "param", "code"}, reply
        assert error["type"] in ("invalid_request_error", "server_error") and isinstance(error["message"], str)
        return error["message"]
    assert isinstance(error, str), reply
    return error


def start_server(build_dir: Path, max_queue_size: int | None = None, request_timeout_s: float = 60.0,
                 api_key: str | None = None, grace_s: float = 5.0, keepalive_timeout_s: float = 30.0,
                 body_timeout_s: float = 60.0, tool_call_syntax: str | None = None,
                 reasoning_syntax: str | None = None, allowed_origins: tuple[str, ...] = ()) -> RunningServer:
    engine = load_engine(build_dir, "cpu", max_queue_size)
    for _ in range(3):  # a port picked free can be taken by another process before the server binds it
        options = ServeOptions("127.0.0.1", *free_ports(2), api_key, request_timeout_s, grace_s,
                               keepalive_timeout_s, body_timeout_s, tool_call_syntax, reasoning_syntax,
                               allowed_origins)
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        holder: dict[str, Any] = {}

        def run() -> None:
            asyncio.set_event_loop(loop)
            holder["stop"] = asyncio.Event()
            try:
                loop.run_until_complete(serve_async(engine, options, holder["stop"], ready.set))
            except ServeError as exc:  # a port taken meanwhile: try others
                holder["error"] = exc
                ready.set()
            loop.close()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        assert ready.wait(30), "the server did not start"
        if "error" not in holder:
            return RunningServer(engine, f"http://127.0.0.1:{options.port}", f"127.0.0.1:{options.grpc_port}",
                                 engine.recipe.served_model_name, loop, holder["stop"], thread)
        thread.join(10)
    raise AssertionError(f"the server did not start: {holder['error']}")


@pytest.fixture(scope="session")
def serve_tiny_build(tiny_build_dir) -> Path:
    """The session's tiny build (tests/conftest.py: torch backend, greedy defaults, 16 new tokens)."""
    return tiny_build_dir


@pytest.fixture(scope="session")
def serve_smollm2_build(smollm2_build_dir) -> Path:
    return smollm2_build_dir


@pytest.fixture(scope="module")
def tiny_server(serve_tiny_build):
    server = start_server(serve_tiny_build)
    yield server
    server.close()


@pytest.fixture(scope="module")
def offline(serve_tiny_build):
    """The tiny build in an offline engine (CPU): what the server's answers must equal."""
    from llmc.runtime.api import Engine

    return Engine.from_dir(serve_tiny_build, device="cpu")


@pytest.fixture(scope="module")
def client(tiny_server):
    """OpenAI's own client against the module's tiny server."""
    import openai

    return openai.OpenAI(base_url=tiny_server.http + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def script(monkeypatch):
    """``script(server, answer)``: from now on (this test) the model writes ``answer`` for every request: the runner's
    sampled tokens are replaced by the answer's tokens, then the end token. Tests of how the server reads an answer
    (tool calls, reasoning) use it, since a model cannot be made to write a given text."""

    def scripted(server, answer: str) -> None:
        engine = server.engine
        ids = [*engine.tokenizer(answer, add_special_tokens=False)["input_ids"], engine.eos_token_ids[0]]
        made: dict[str, int] = {}
        execute = engine._steps.runner.execute

        def run(scheduled):
            out = execute(scheduled)
            for request_id in out.sampled_token_ids:
                k = made[request_id] = made.get(request_id, -1) + 1
                out.sampled_token_ids[request_id] = ids[min(k, len(ids) - 1)]
            return out

        monkeypatch.setattr(engine._steps.runner, "execute", run)
    return scripted
