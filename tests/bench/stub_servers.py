"""Tiny in-process streaming servers for the client tests: KServe generate_stream and OpenAI completions over
server-sent events, and Triton's gRPC ModelStreamInfer. Each streams ``max_tokens`` chunks, the first after
``first_delay_s`` and the rest ``gap_s`` apart, and records the requests it received and its peak concurrency."""

from __future__ import annotations

import json
import struct
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class StreamStats:
    """What a stub server saw: request bodies and the peak number of streams open at once."""

    def __init__(self, first_delay_s: float, gap_s: float):
        self.first_delay_s, self.gap_s = first_delay_s, gap_s
        self.stream_error: Any = None  # when set, the SSE streams end with this ``error`` after their first chunk
        self.requests: list[dict[str, Any]] = []
        self.active = 0
        self.peak = 0
        self.lock = threading.Lock()

    def enter(self, body: dict[str, Any]) -> None:
        with self.lock:
            self.requests.append(body)
            self.active += 1
            self.peak = max(self.peak, self.active)

    def leave(self) -> None:
        with self.lock:
            self.active -= 1

    def chunks(self, n: int):
        """Yield ``(index, text)`` paced like a model: first delay, then one chunk per gap."""
        time.sleep(self.first_delay_s)
        for i in range(n):
            if i:
                time.sleep(self.gap_s)
            yield i, f" tok{i}"


def start_sse_server(stats: StreamStats) -> tuple[ThreadingHTTPServer, str]:
    """Serve ``/v2/models/<m>/generate_stream`` and ``/v1/completions`` on 127.0.0.1; returns (server, url)."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            openai = self.path == "/v1/completions"
            if not openai and not self.path.endswith("/generate_stream"):
                self.send_error(404)
                return
            stats.enter({"path": self.path, **body})
            left = False
            try:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for i, text in stats.chunks(body["max_tokens"]):
                    event = {"choices": [{"index": 0, "text": text, "finish_reason": None}]} if openai \
                        else {"model_name": "m", "text_output": text}
                    self._send(event)
                    if stats.stream_error is not None:
                        self._send({"error": stats.stream_error})
                        return
                if openai:
                    self._send({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
                    self._send({"choices": [], "usage": {"completion_tokens": body["max_tokens"]}})
                    # The client starts its next request as soon as it reads [DONE]: leave first, or the
                    # stream would still count as open when that request enters.
                    stats.leave()
                    left = True
                    self.wfile.write(b"data: [DONE]\n\n")
            finally:
                if not left:
                    stats.leave()

        def _send(self, event: dict[str, Any]) -> None:
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.flush()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def start_grpc_server(stats: StreamStats) -> tuple[Any, str]:
    """Serve Triton's ``ModelStreamInfer`` (decoupled: one response per chunk, then an empty final one)."""
    import grpc
    import numpy as np
    from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc as pb_grpc

    def inputs_of(request: Any) -> dict[str, Any]:
        out = {}
        for tensor, raw in zip(request.inputs, request.raw_input_contents):
            if tensor.datatype == "BYTES":
                (length,) = struct.unpack("<I", raw[:4])
                out[tensor.name] = raw[4:4 + length].decode()
            else:
                dtype = {"INT32": np.int32, "FP32": np.float32, "BOOL": np.bool_}[tensor.datatype]
                out[tensor.name] = np.frombuffer(raw, dtype=dtype)[0].item()
        out["parameters"] = {k: v.bool_param for k, v in request.parameters.items()}
        return out

    def response(request: Any, text: str | None, final: bool) -> Any:
        r = pb.ModelInferResponse(model_name=request.model_name, id=request.id)
        r.parameters["triton_final_response"].bool_param = final
        if text is not None:
            data = text.encode()
            r.outputs.add(name="text_output", datatype="BYTES", shape=[1, 1])
            r.raw_output_contents.append(struct.pack("<I", len(data)) + data)
        return pb.ModelStreamInferResponse(infer_response=r)

    class Servicer(pb_grpc.GRPCInferenceServiceServicer):
        def ModelStreamInfer(self, request_iterator: Any, context: Any):  # noqa: N802 (Triton's name)
            for request in request_iterator:
                body = inputs_of(request)
                stats.enter(body)
                left = False
                try:
                    for _, text in stats.chunks(body["max_tokens"]):
                        yield response(request, text, False)
                    # The generator stays suspended at the final yield while the client already starts its
                    # next request: leave first (see the SSE handler).
                    stats.leave()
                    left = True
                    yield response(request, None, True)
                finally:
                    if not left:
                        stats.leave()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"
