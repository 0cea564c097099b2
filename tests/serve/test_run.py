"""``llmc serve`` start-up failures: a port in use is one ``error:`` line and exit status 2, never a traceback."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.serve.conftest import free_port


@pytest.mark.parametrize("which", ["http", "grpc"])
def test_port_in_use_is_one_error_line(serve_tiny_build, which):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        port, grpc_port = (busy, free_port()) if which == "http" else (free_port(), busy)
        proc = subprocess.run([sys.executable, "-m", "llmc.cli", "serve", str(serve_tiny_build), "--device", "cpu",
                               "--port", str(port), "--grpc-port", str(grpc_port)],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: cannot ") and str(busy) in lines[-1], proc.stderr
    assert "Traceback" not in proc.stderr
    assert ("--port" if which == "http" else "--grpc-port") in lines[-1]
