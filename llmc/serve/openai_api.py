"""OpenAI-compatible routes: ``/v1/models[/{model}]``, ``/v1/completions``, ``/v1/chat/completions`` (stream or not).

Routes only: bodies are parsed by :mod:`llmc.serve.openai_protocol`. A request whose ``max_tokens`` is more
than the prompt leaves room for within ``max_seq_len`` is capped, and the response says so in ``warnings``
(top level; in the last chunk when streaming); with ``"strict_max_tokens": true`` it is a 400 instead.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from aiohttp import web

from llmc.errors import LlmcError, UnknownModelError
from llmc.request.outputs import StreamEvent, TokenLogprob
from llmc.serve.engine_client import PreparedPrompt
from llmc.serve.openai_logprobs import LogprobFormatter, event_logprobs
from llmc.serve.openai_protocol import OpenAIRequest, parse_openai_request
from llmc.serve.protocol import client_names
from llmc.serve.state import (STATE_KEY, TRITON_ALIASES, error_status, openai_error, prepare, read_json, send_sse,
                              start_sse)


def _usage(event: StreamEvent) -> dict[str, int]:
    m = event.metrics
    prompt, completion = (m.prompt_tokens, m.generated_tokens) if m else (0, 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _model(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "llmc"}


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model(request.app[STATE_KEY].model_name)]})


async def retrieve_model(request: web.Request) -> web.Response:
    """``/v1/models/{model}``: the served model (or a Triton alias, which requests accept too), else a 404."""
    state, name = request.app[STATE_KEY], request.match_info["model"]
    if not state.knows(name):
        raise UnknownModelError("model", f"unknown model {name!r}; this server serves {state.model_name!r}")
    return web.json_response(_model(name))


async def completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=True)


async def _complete(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    req = parse_openai_request(await read_json(request), chat, (state.model_name, *TRITON_ALIASES), state.defaults,
                               state.vocab_size)
    meta = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
            "model": req.model, "object": "chat.completion" if chat else "text_completion"}
    prepared = await prepare(request, req.prompt, req.params, req.strict_max_tokens, req.names)
    events = state.client.stream(prepared, req.params)
    logprobs = LogprobFormatter(state.client.engine.tokenizer, chat) if req.params.logprobs is not None else None
    async with aclosing(events):
        with client_names(req.names):
            first = await anext(events)
        if req.stream:
            return await _stream(request, events, first, meta, chat, req, prepared, logprobs)
        parts, event, lps = [first.text], first, list(event_logprobs(first))
        while not event.finished:
            event = await anext(events)
            parts.append(event.text)
            lps += event_logprobs(event)
    text = "".join(parts)
    choice: dict[str, Any] = {"index": 0, "finish_reason": event.finish_reason,
                              "logprobs": logprobs.format(lps) if logprobs else None}
    choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
    body = {**meta, "choices": [choice], "usage": _usage(event)}
    if prepared.warnings():
        body["warnings"] = prepared.warnings()
    return web.json_response(body)


async def _stream(request: web.Request, events: AsyncIterator[StreamEvent], event: StreamEvent,
                  meta: dict[str, Any], chat: bool, req: OpenAIRequest, prepared: PreparedPrompt,
                  logprobs: LogprobFormatter | None) -> web.StreamResponse:
    """SSE chunks (``chat.completion.chunk`` / ``text_completion``), then ``data: [DONE]``. A chunk carries the
    log-probabilities of the tokens since the previous chunk (a token whose text is held back, e.g. part of a
    multi-byte character, goes with the next chunk)."""
    meta = {**meta, "object": "chat.completion.chunk" if chat else "text_completion"}
    response = await start_sse(request)
    pending: list[TokenLogprob] = []

    def chunk(text: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
        lps = logprobs.format(pending) if logprobs is not None and not first else None
        pending.clear()
        if chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lps}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": lps}
        out = {**meta, "choices": [choice]}
        if finish is not None and prepared.warnings():
            out["warnings"] = prepared.warnings()
        return out

    try:
        if chat:
            await send_sse(response, chunk(None, None, first=True))
        while True:
            pending += event_logprobs(event)
            if event.text or event.finished:
                await send_sse(response, chunk(event.text, event.finish_reason if event.finished else None))
            if event.finished:
                break
            event = await anext(events)
        if req.include_usage:
            await send_sse(response, {**meta, "choices": [], "usage": _usage(event)})
    except LlmcError as exc:
        status, code = error_status(exc)  # the status the headers could no longer carry
        await send_sse(response, openai_error(str(exc), status, getattr(exc, "field", None), code))
    await send_sse(response, "[DONE]")
    await response.write_eof()
    return response


def add_openai_routes(app: web.Application) -> None:
    """Register the ``/v1`` routes on ``app`` (which must carry the server state)."""
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", retrieve_model)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
