"""KServe v2 HTTP routes: health, server/model metadata, the generate extension (JSON and SSE) and ``/infer``.

Routes only: parsing lives in :mod:`llmc.serve.protocol` and :mod:`llmc.serve.tensors`, the shared state,
errors and SSE framing in :mod:`llmc.serve.state`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from aiohttp import web

from llmc import __version__
from llmc.errors import LlmcError
from llmc.request.outputs import StreamEvent
from llmc.serve.engine_client import PreparedPrompt
from llmc.serve.ensemble_logprobs import EnsembleLogprobs
from llmc.serve.protocol import (ENSEMBLE_NAMES, EXTENSIONS, GenerateRequest, client_names, flatten_generate_parameters,
                                 model_config_dict, model_metadata_dict, parse_generate_fields)
from llmc.serve.state import STATE_KEY, ServerState, prepare, read_body, read_json, send_sse, served_model, start_sse
from llmc.serve.tensors import parse_infer_body, tensors_to_fields


# ------------------------------------------------------------------------------------- health/metadata
async def live(request: web.Request) -> web.Response:
    return web.json_response({"live": True})


async def ready(request: web.Request) -> web.Response:
    is_ready = not request.app[STATE_KEY].client.draining
    return web.json_response({"ready": is_ready}, status=200 if is_ready else 503)


async def server_metadata(request: web.Request) -> web.Response:
    return web.json_response({"name": "llmc", "version": __version__, "extensions": list(EXTENSIONS)})


async def model_metadata(request: web.Request) -> web.Response:
    return web.json_response(model_metadata_dict(served_model(request)))


async def model_config(request: web.Request) -> web.Response:
    return web.json_response(model_config_dict(served_model(request)))


async def model_ready(request: web.Request) -> web.Response:
    served_model(request)
    return await ready(request)


# ----------------------------------------------------------------------------------------- generate
def _parse(state: ServerState, fields: dict[str, Any], allow_extras: bool = True) -> GenerateRequest:
    return parse_generate_fields(fields, state.defaults, state.vocab_size, allow_extras=allow_extras)


async def _open(request: web.Request, req: GenerateRequest) -> tuple[PreparedPrompt, AsyncIterator[StreamEvent]]:
    """Tokenize (errors name ``text_input``, ``max_tokens``) and start the request's event stream."""
    prepared = await prepare(request, req.prompt, req.params, req.strict_max_tokens, ENSEMBLE_NAMES)
    return prepared, request.app[STATE_KEY].client.stream(prepared, req.params)


async def _first(events: AsyncIterator[StreamEvent]) -> StreamEvent:
    """The first event; admission errors (queue full, too long for the KV cache) surface here."""
    with client_names(ENSEMBLE_NAMES):
        return await anext(events)


async def _whole_text(request: web.Request,
                      req: GenerateRequest) -> tuple[str, StreamEvent, PreparedPrompt, EnsembleLogprobs]:
    """Run a request to its end: (the whole text, with the prompt unless excluded; the final event; its prompt;
    its log-probabilities, held only when the request asked for them)."""
    parts = [] if req.exclude_input_in_output else [req.prompt]
    logprobs = EnsembleLogprobs(req.return_log_probs)
    prepared, events = await _open(request, req)
    async with aclosing(events):
        event = await _first(events)
        parts.append(event.text)
        logprobs.add(event)
        while not event.finished:
            event = await anext(events)
            parts.append(event.text)
            logprobs.add(event)
    return "".join(parts), event, prepared, logprobs


def _generate_body(name: str, text: str, event: StreamEvent, prepared: PreparedPrompt, logprobs: EnsembleLogprobs,
                   request_id: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"id": request_id} if request_id else {}  # the generate extension returns a given id
    body.update(model_name=name, model_version="1", text_output=text, **logprobs.json_fields())
    if event.finished:
        m = event.metrics
        body.update(finish_reason=event.finish_reason, stop_reason=event.stop_reason,
                    prompt_tokens=m.prompt_tokens if m else None, completion_tokens=m.generated_tokens if m else None)
        if prepared.warnings():
            body["warnings"] = prepared.warnings()
    return body


async def generate(request: web.Request) -> web.Response:
    """``POST /v2/models/<m>/generate``: one JSON response with the whole text."""
    name, state = served_model(request), request.app[STATE_KEY]
    req = _parse(state, flatten_generate_parameters(await read_json(request)))
    text, event, prepared, logprobs = await _whole_text(request, req)
    return web.json_response(_generate_body(name, text, event, prepared, logprobs, req.request_id))


async def generate_stream(request: web.Request) -> web.StreamResponse:
    """``POST /v2/models/<m>/generate_stream``: server-sent events, one ``data: {...}`` per text delta.

    Errors before the first event are plain JSON responses; later ones a final ``data: {"error": ...}``. With
    ``return_log_probs`` every event carries the log-probabilities of all tokens so far (tensorrtllm_backend's
    streaming semantics, :mod:`llmc.serve.ensemble_logprobs`)."""
    name, state = served_model(request), request.app[STATE_KEY]
    req = _parse(state, flatten_generate_parameters(await read_json(request)))
    prepared, events = await _open(request, req)
    async with aclosing(events):
        first = await _first(events)
        response = await start_sse(request)
        prefix = "" if req.exclude_input_in_output else req.prompt
        logprobs = EnsembleLogprobs(req.return_log_probs)
        try:
            async for text, event in _chunks(first, events, req.stream, prefix, logprobs):
                await send_sse(response, _generate_body(name, text, event, prepared, logprobs, req.request_id))
        except LlmcError as exc:
            await send_sse(response, {"error": str(exc)})
    await response.write_eof()
    return response


async def _chunks(event: StreamEvent, events: AsyncIterator[StreamEvent], stream: bool, prefix: str,
                  logprobs: EnsembleLogprobs) -> AsyncIterator[tuple[str, StreamEvent]]:
    """(text, event) pairs to send: every non-empty delta and the final event when streaming, else one.
    ``logprobs`` takes every event, sent or not, before its pair is yielded."""
    text = prefix
    while True:
        text += event.text
        logprobs.add(event)
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
    request_id, tensors = parse_infer_body(await read_body(request),
                                           request.headers.get("Inference-Header-Content-Length"))
    req = _parse(state, tensors_to_fields(tensors), allow_extras=False)
    text, event, prepared, logprobs = await _whole_text(request, req)
    out = {"name": "text_output", "datatype": "BYTES", "shape": [1, 1], "data": [text]}
    parameters: dict[str, Any] = {"finish_reason": event.finish_reason}
    if prepared.warnings():
        parameters["warnings"] = "; ".join(prepared.warnings())
    return web.json_response({"model_name": name, "model_version": "1", "id": request_id,
                              "outputs": [out, *logprobs.infer_outputs()], "parameters": parameters})


def add_kserve_routes(app: web.Application) -> None:
    """Register the KServe v2 routes on ``app`` (which must carry the server state)."""
    r = app.router
    r.add_get("/v2/health/live", live)
    r.add_get("/v2/health/ready", ready)
    r.add_get("/v2", server_metadata)
    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        r.add_get(prefix, model_metadata)
        r.add_get(prefix + "/ready", model_ready)
        r.add_get(prefix + "/config", model_config)
        r.add_post(prefix + "/generate", generate)
        r.add_post(prefix + "/generate_stream", generate_stream)
        r.add_post(prefix + "/infer", infer)
