"""The HTTP server (aiohttp): KServe v2 health/metadata, the generate extension, ``/infer``, ``/metrics``.

The OpenAI routes live in :mod:`llmc.serve.openai_api`; both share :class:`ServerState` and
:func:`error_response`. Every error is JSON ``{"error": "..."}`` with a 4xx/5xx status; the server keeps
serving after any bad request.
"""

from __future__ import annotations

import json
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from llmc import __version__
from llmc.errors import EngineError, LlmcError, QueueFullError, RequestError
from llmc.request.params import SamplingParams
from llmc.serve import prom
from llmc.serve.engine_client import EngineClient, RequestTimeoutError, ServerDrainingError
from llmc.serve.protocol import ENSEMBLE_INPUTS, ENSEMBLE_OUTPUTS, GenerateRequest, parse_generate_fields
from llmc.serve.tensors import decode_json_data, deserialize_bytes, tensors_to_fields

# Names that reach the served model: llmc's own name plus Triton's, so unchanged Triton clients work.
TRITON_ALIASES = ("ensemble", "tensorrt_llm_bls")
PUBLIC_PATHS = ("/v2/health/live", "/v2/health/ready")


@dataclass(frozen=True)
class ServerState:
    """What every handler needs: the engine bridge, the served name, request defaults and the API key."""

    client: EngineClient
    model_name: str
    defaults: SamplingParams
    vocab_size: int
    api_key: str | None = None

    def knows(self, model: str) -> bool:
        return model == self.model_name or model in TRITON_ALIASES


STATE_KEY = web.AppKey("llmc_state", ServerState)


def error_response(exc: Exception) -> web.Response:
    """The HTTP response for an exception raised while handling a request."""
    headers = {}
    if isinstance(exc, RequestError):
        status = 400
    elif isinstance(exc, (QueueFullError, ServerDrainingError)):
        status = 503
        headers["Retry-After"] = str(max(1, round(getattr(exc, "retry_after_s", 1.0))))
    elif isinstance(exc, RequestTimeoutError):
        status = 504
    elif isinstance(exc, (EngineError, LlmcError)):
        status = 500
    else:
        raise exc
    return web.json_response({"error": str(exc)}, status=status, headers=headers)


@web.middleware
async def auth_and_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Bearer-token check (all paths except health) and LlmcError -> JSON error response."""
    state = request.app[STATE_KEY]
    if state.api_key is not None and request.path not in PUBLIC_PATHS:
        if request.headers.get("Authorization", "") != f"Bearer {state.api_key}":
            return web.json_response({"error": "missing or wrong API key; send 'Authorization: Bearer <key>'"},
                                     status=401, headers={"WWW-Authenticate": "Bearer"})
    try:
        return await handler(request)
    except LlmcError as exc:
        if isinstance(exc, RequestError):
            state.client.metrics.rejected.inc("invalid")
        return error_response(exc)


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object, or RequestError (400) naming what is wrong."""
    try:
        body = await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError("body", f"is not valid JSON ({exc}); send a JSON object") from None
    if not isinstance(body, dict):
        raise RequestError("body", f"must be a JSON object, got {type(body).__name__}")
    return body


def _model(request: web.Request) -> str:
    state = request.app[STATE_KEY]
    name = request.match_info["model"]
    if not state.knows(name):
        raise web.HTTPNotFound(text=json.dumps({"error": f"unknown model {name!r}; this server serves "
                                                         f"{state.model_name!r}"}),
                               content_type="application/json")
    return name


# ------------------------------------------------------------------------------------- health/metadata
async def live(request: web.Request) -> web.Response:
    return web.json_response({"live": True})


async def ready(request: web.Request) -> web.Response:
    is_ready = not request.app[STATE_KEY].client.draining
    return web.json_response({"ready": is_ready}, status=200 if is_ready else 503)


async def server_metadata(request: web.Request) -> web.Response:
    return web.json_response({"name": "llmc", "version": __version__, "extensions": ["generate"]})


def model_metadata_dict(name: str) -> dict[str, Any]:
    """KServe v2 model metadata of the served model (the ensemble's tensors; dims with the batch dim)."""
    def tensors(specs: Any) -> list[dict[str, Any]]:
        return [{"name": s.name, "datatype": s.datatype, "shape": [-1, *s.dims]} for s in specs]

    return {"name": name, "versions": ["1"], "platform": "llmc",
            "inputs": tensors(ENSEMBLE_INPUTS), "outputs": tensors(ENSEMBLE_OUTPUTS)}


async def model_metadata(request: web.Request) -> web.Response:
    return web.json_response(model_metadata_dict(_model(request)))


async def model_ready(request: web.Request) -> web.Response:
    _model(request)
    return await ready(request)


async def metrics(request: web.Request) -> web.Response:
    text = request.app[STATE_KEY].client.metrics.registry.render()
    return web.Response(text=text, headers={"Content-Type": prom.CONTENT_TYPE})


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
    name, state = _model(request), request.app[STATE_KEY]
    req = _parse(state, await read_json(request))
    parts = [] if req.exclude_input_in_output else [req.prompt]
    async with aclosing(state.client.stream(req.prompt, req.params)) as events:
        async for event in events:
            parts.append(event.text)
    return web.json_response(_generate_body(name, "".join(parts), event))


async def generate_stream(request: web.Request) -> web.StreamResponse:
    """``POST /v2/models/<m>/generate_stream``: server-sent events, one ``data: {...}`` per text delta.

    Errors before the first event are plain JSON responses; later ones a final ``data: {"error": ...}``."""
    name, state = _model(request), request.app[STATE_KEY]
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


async def start_sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


async def send_sse(response: web.StreamResponse, payload: dict[str, Any] | str) -> None:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    await response.write(f"data: {data}\n\n".encode())


# ------------------------------------------------------------------------------------------ /infer
async def infer(request: web.Request) -> web.Response:
    """``POST /v2/models/<m>/infer`` (KServe v2 tensors, JSON or binary-data extension): non-streaming."""
    name, state = _model(request), request.app[STATE_KEY]
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
            values = deserialize_bytes(chunk) if tensor["datatype"] == "BYTES" else _numbers(tensor, chunk)
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


def _numbers(tensor: dict[str, Any], chunk: bytes) -> list[Any]:
    from llmc.serve.tensors import decode_raw

    return decode_raw(tensor.get("name", "?"), tensor.get("datatype", "?"), chunk)


def create_app(state: ServerState) -> web.Application:
    """The aiohttp application with the KServe v2, OpenAI and metrics routes."""
    from llmc.serve.openai_api import add_openai_routes

    app = web.Application(middlewares=[auth_and_errors], client_max_size=16 * 1024 * 1024)
    app[STATE_KEY] = state
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
    r.add_get("/metrics", metrics)
    add_openai_routes(app)
    return app
