#!/usr/bin/env python
"""Call the KServe v2 generate extension over plain HTTP (works against llmc serve and tritonserver).

    python scripts/client_http.py --url http://127.0.0.1:8000 --model ensemble --prompt "Hello" --stream

Without --stream: POST /v2/models/<m>/generate (one JSON response). With --stream: POST .../generate_stream
(server-sent events, printed as they arrive). Prints timings (TTFT and ITL for streams) at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request


def _request(url: str, body: dict, api_key: str | None) -> urllib.request.Request:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")


def generate(base: str, model: str, body: dict, api_key: str | None = None) -> dict:
    """POST /generate; returns the JSON response (raises urllib.error.HTTPError on 4xx/5xx)."""
    with urllib.request.urlopen(_request(f"{base}/v2/models/{model}/generate", body, api_key), timeout=600) as r:
        return json.loads(r.read())


def generate_stream(base: str, model: str, body: dict, api_key: str | None = None):
    """POST /generate_stream; yields (arrival_time, event dict) for every ``data:`` line."""
    req = _request(f"{base}/v2/models/{model}/generate_stream", {**body, "stream": True}, api_key)
    with urllib.request.urlopen(req, timeout=600) as response:
        for raw in response:
            line = raw.decode("utf-8").strip()
            if line.startswith("data:"):
                yield time.perf_counter(), json.loads(line[5:].strip())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="ensemble", help="ensemble (tritonserver) or llmc's served name")
    parser.add_argument("--prompt", default="Write one sentence about the sea.")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args()
    body = {"text_input": args.prompt, "max_tokens": args.max_tokens}
    if args.temperature is not None:
        body["temperature"] = args.temperature
    start = time.perf_counter()
    try:
        if not args.stream:
            result = generate(args.url, args.model, body, args.api_key)
            print(result["text_output"])
            print(f"latency {1000 * (time.perf_counter() - start):.1f} ms", file=sys.stderr)
            return 0
        times = []
        for now, event in generate_stream(args.url, args.model, body, args.api_key):
            if "error" in event:
                print(f"\nerror: {event['error']}", file=sys.stderr)
                return 1
            if event.get("text_output"):
                times.append(now)
                print(event["text_output"], end="", flush=True)
        print()
    except urllib.error.HTTPError as exc:
        print(f"error: HTTP {exc.code}: {exc.read().decode(errors='replace')}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        print(f"error: cannot reach the server at {args.url} ({reason}). Fix: start it (llmc serve BUILD, or "
              f"tritonserver --model-repository BUILD/model_repo) or pass --url", file=sys.stderr)
        return 1
    gaps = sorted(1000 * (b - a) for a, b in zip(times, times[1:]))
    ttft = 1000 * (times[0] - start) if times else float("nan")
    p50 = gaps[len(gaps) // 2] if gaps else float("nan")
    print(f"TTFT {ttft:.1f} ms, ITL p50 {p50:.1f} ms ({len(gaps)} gaps)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
