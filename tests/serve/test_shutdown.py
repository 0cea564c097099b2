"""``llmc serve`` as a subprocess: SIGTERM drains gracefully (in-flight request completes, exit status 0); it says
how it reads chat answers."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request

from tests.serve.conftest import free_ports


def test_sigterm_finishes_in_flight_and_exits_zero(serve_tiny_build):
    port, grpc_port = free_ports(2)
    proc = subprocess.Popen([sys.executable, "-m", "llmc.cli", "serve", str(serve_tiny_build), "--port", str(port),
                             "--grpc-port", str(grpc_port), "--device", "cpu", "--grace", "20",
                             "--reasoning-syntax", "think"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(base + "/v2/health/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() else "slow"
                time.sleep(0.1)
        events: list[dict] = []
        first = threading.Event()

        def stream() -> None:
            body = json.dumps({"text_input": "Tell me a story", "max_tokens": 200, "min_length": 200,
                               "stream": True}).encode()
            req = urllib.request.Request(base + "/v2/models/ensemble/generate_stream", data=body, method="POST")
            with urllib.request.urlopen(req, timeout=60) as response:
                for raw in response:
                    line = raw.decode().strip()
                    if line.startswith("data:"):
                        events.append(json.loads(line[5:]))
                        first.set()

        client = threading.Thread(target=stream)
        client.start()
        assert first.wait(30)
        proc.send_signal(signal.SIGTERM)
        client.join(60)
        assert proc.wait(60) == 0, proc.stderr.read()
        assert events[-1]["finish_reason"] == "length" and events[-1]["completion_tokens"] == 200
        said = proc.stderr.read()
        assert "stopped" in said
        # how it reads chat answers: the tiny build's template has no tools (llmc's JSON calls), thinking as asked
        assert 'chat tool_choice "auto" read as json calls; <think> split off as reasoning_content' in said
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
