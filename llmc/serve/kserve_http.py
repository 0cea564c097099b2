"""KServe v2 HTTP routes: health, server/model metadata, the generate extension (JSON and SSE) and ``/infer``.

Routes only: parsing lives in :mod:`llmc.serve.protocol` and :mod:`llmc.serve.tensors`, the shared state,
errors and SSE framing in :mod:`llmc.serve.state`.
"""

from __future__ import annotations

import json
from contextlib import aclosing
from typing import Any

from aiohttp import web

from llmc import __version__
from llmc.errors import LlmcError, RequestError
from llmc.serve.protocol import GenerateRequest, model_metadata_dict, parse_generate_fields
from llmc.serve.state import STATE_KEY, ServerState, read_json, send_sse, served_model, start_sse
from llmc.serve.tensors import decode_json_data, decode_raw, deserialize_bytes, tensors_to_fields


# ------------------------------------------------------------------------------------- health/metadata
async def live(request: web.Request) -> web.Response:
    return web.json_response({"live": True})


async def ready(request: web.Request) -> web.Response:
    is_ready = not request.app[STATE_KEY].client.draining
    return web.json_response({"ready": is_ready}, status=200 if is_ready else 503)


async def server_metadata(request: web.Request) -> web.Response:
    return web.json_response({"name": "llmc", "version": __version__, "extensions": ["generate"]})


async def model_metadata(request: web.Request) -> web.Response:
    return web.json_response(model_metadata_dict(served_model(request)))


async def model_ready(request: web.Request) -> web.Response:
    served_model(request)
    return await ready(request)


# ----------------------------------------------------------------------------------------- generate
def _parse(state: ServerState, fields: dict[str, Any], allow_extras: bool = True) -> GenerateRequest:
    return parse_generate_fields(fields, state.defaults, state.vocab_size, allow_extras=allow_extras)


def _generate_body(name: str, text: str, event: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model_name": name, "model_version": "1", "text_output": text}
    if event.finished:
        m = event.metrics
        body.update(finish_reason=event.finish_reason, stop_reason=event.stop_reason,
                    prompt_tokens=m.prompt_tokens if m else None, completion_tokens=m.generated_tokens if m else None)
    return body


async def generate(request: web.Request) -> web.Response:
    """``POST /v2/models/<m>/generate``: one JSON response with the whole text."""
    name, state = served_model(request), request.app[STATE_KEY]
    req = _parse(state, await read_json(request))
    parts = [] if req.exclude_input_in_output else [req.prompt]
    async with aclosing(state.client.stream(req.prompt, req.params)) as events:
        async for event in events:
            parts.append(event.text)
    return web.json_response(_generate_body(name, "".join(parts), event))


async def generate_stream(request: web.Request) -> web.StreamResponse:
    """``POST /v2/models/<m>/generate_stream``: server-sent events, one ``data: {...}`` per text delta.

    Errors before the first event are plain JSON responses; later ones a final ``data: {"error": ...}``."""
    name, state = served_model(request), request.app[STATE_KEY]
    req = _parse(state, await read_json(request))
    events = state.client.stream(req.prompt, req.params)
    async with aclosing(events):
        first = await anext(events)  # queue-full / bad prompt surface here as a normal error response
        response = await start_sse(request)
        prefix = "" if req.exclude_input_in_output else req.prompt
        try:
            async for text, event in _chunks(first, events, req.stream, prefix):
                await send_sse(response, _generate_body(name, text, event))
        except LlmcError as exc:
            await send_sse(response, {"error": str(exc)})
    await response.write_eof()
    return response


async def _chunks(event: Any, events: Any, stream: bool, prefix: str) -> Any:
    """(text, event) pairs to send: every non-empty delta and the final event when streaming, else one."""
    text = prefix
    while True:
        text += event.text
        if event.finished or (stream and text):
            yield text, event
            text = ""
        if event.finished:
            return
        event = await anext(events)


# ------------------------------------------------------------------------------------------ /infer
async def infer(request: web.Request) -> web.Response:
    """``POST /v2/models/<m>/infer`` (KServe v2 tensors, JSON or binary-data extension): non-streaming."""
    name, state = served_model(request), request.app[STATE_KEY]
    header_len = request.headers.get("Inference-Header-Content-Length")
    raw = await request.read()
    try:
        split = int(header_len) if header_len is not None else len(raw)
        body = json.loads(raw[:split])
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError("body", f"is not a valid inference request ({exc})") from None
    if not isinstance(body, dict) or not isinstance(body.get("inputs"), list):
        raise RequestError("inputs", "the body must be a JSON object with an 'inputs' list")
    tensors, offset = {}, split
    for tensor in body["inputs"]:
        size = (tensor.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            chunk, offset = raw[offset:offset + size], offset + size
            values = deserialize_bytes(chunk) if tensor["datatype"] == "BYTES" else \
                decode_raw(tensor.get("name", "?"), tensor.get("datatype", "?"), chunk)
        else:
            values = decode_json_data(tensor.get("name", "?"), tensor.get("datatype", "?"), tensor.get("data"))
        tensors[tensor.get("name")] = values
    req = _parse(state, tensors_to_fields(tensors), allow_extras=False)
    parts = [] if req.exclude_input_in_output else [req.prompt]
    async with aclosing(state.client.stream(req.prompt, req.params)) as events:
        async for event in events:
            parts.append(event.text)
    out = {"name": "text_output", "datatype": "BYTES", "shape": [1, 1], "data": ["".join(parts)]}
    return web.json_response({"model_name": name, "model_version": "1", "id": body.get("id", ""),
                              "outputs": [out], "parameters": {"finish_reason": event.finish_reason}})


def add_kserve_routes(app: web.Application) -> None:
    """Register the KServe v2 routes on ``app`` (which must carry the server state)."""
    r = app.router
    r.add_get("/v2/health/live", live)
    r.add_get("/v2/health/ready", ready)
    r.add_get("/v2", server_metadata)
    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        r.add_get(prefix, model_metadata)
        r.add_get(prefix + "/ready", model_ready)
        r.add_post(prefix + "/generate", generate)
        r.add_post(prefix + "/generate_stream", generate_stream)
        r.add_post(prefix + "/infer", infer)
