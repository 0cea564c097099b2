#!/usr/bin/env python
"""Stream one completion over gRPC with tritonclient (works against llmc serve and tritonserver).

    python scripts/client_grpc_stream.py --url 127.0.0.1:8001 --model ensemble --prompt "Hello" --max-tokens 64

Prints the text as it arrives, then TTFT and inter-token latency (ITL) percentiles measured at the client.
"""

from __future__ import annotations

import argparse
import queue
import sys
import time
import uuid

import numpy as np


def build_inputs(prompt: str, max_tokens: int, temperature: float | None, stop: list[str]) -> list:
    import tritonclient.grpc as grpcclient

    def tensor(name: str, array: np.ndarray, datatype: str):
        t = grpcclient.InferInput(name, list(array.shape), datatype)
        t.set_data_from_numpy(array)
        return t

    inputs = [tensor("text_input", np.array([[prompt.encode()]], dtype=np.object_), "BYTES"),
              tensor("max_tokens", np.array([[max_tokens]], dtype=np.int32), "INT32"),
              tensor("stream", np.array([[True]], dtype=np.bool_), "BOOL")]
    if temperature is not None:
        inputs.append(tensor("temperature", np.array([[temperature]], dtype=np.float32), "FP32"))
    if stop:
        inputs.append(tensor("stop_words", np.array([[s.encode() for s in stop]], dtype=np.object_), "BYTES"))
    return inputs


def stream_once(url: str, model: str, prompt: str, max_tokens: int, temperature: float | None = None,
                stop: list[str] | None = None, headers: dict | None = None, out=sys.stdout) -> dict:
    """Run one streaming request; returns {"text", "ttft", "itls", "error"} (seconds)."""
    import tritonclient.grpc as grpcclient

    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    start = time.perf_counter()
    client.start_stream(callback=lambda result, error: events.put((time.perf_counter(), result, error)),
                        headers=headers)
    client.async_stream_infer(model, build_inputs(prompt, max_tokens, temperature, stop or []),
                              request_id=uuid.uuid4().hex, enable_empty_final_response=True)
    parts, times, error = [], [], None
    while True:
        now, result, err = events.get(timeout=600)
        if err is not None:
            error = str(err)
            break
        response = result.get_response()
        if result.as_numpy("text_output") is not None:
            text = result.as_numpy("text_output").reshape(-1)[0].decode("utf-8")
            if text:
                parts.append(text)
                times.append(now)
                print(text, end="", flush=True, file=out)
        if response.parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    client.close()
    print(file=out)
    itls = [b - a for a, b in zip(times, times[1:])]
    return {"text": "".join(parts), "ttft": times[0] - start if times else None, "itls": itls, "error": error}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="127.0.0.1:8001")
    parser.add_argument("--model", default="ensemble", help="ensemble (tritonserver) or llmc's served name")
    parser.add_argument("--prompt", default="Write one sentence about the sea.")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--stop", action="append", default=[])
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args()
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else None
    result = stream_once(args.url, args.model, args.prompt, args.max_tokens, args.temperature, args.stop, headers)
    if result["error"]:
        print(f"error: {result['error']}", file=sys.stderr)
        return 1
    itls = np.array(result["itls"]) * 1000
    ttft = result["ttft"] * 1000 if result["ttft"] is not None else float("nan")
    summary = f"TTFT {ttft:.1f} ms"
    if len(itls):
        summary += f", ITL p50 {np.percentile(itls, 50):.1f} ms p95 {np.percentile(itls, 95):.1f} ms ({len(itls)} gaps)"
    print(summary, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
