"""Hugging Face Text Generation Inference (TGI)'s routes, for clients written against TGI (bodies and answers:
:mod:`llmc.serve.tgi_protocol`).

- ``POST /generate``: ``{"generated_text", "details"?}``.
- ``POST /generate_stream``: server-sent events, one per generated token: ``{"index", "token", "top_tokens"?,
  "generated_text", "details"}``, the last with the whole ``generated_text`` (and ``details`` when asked for).
  An error after the first event is an event ``{"error", "error_type"}``, as TGI sends it.
- ``POST /``: either of them by the body's ``stream`` (TGI's compatibility route, which huggingface_hub's
  ``InferenceClient.text_generation`` posts to); its answer is a list of one, and it returns the prompt before the
  generated text unless ``return_full_text`` is false (TGI's default for a text-generation model).
- ``GET /info``: the served model and the limits (TGI's ``Info``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from aiohttp import web

from llmc import __version__
from llmc.errors import LlmcError, RequestError
from llmc.request.outputs import StreamEvent
from llmc.serve.engine_client import PreparedPrompt
from llmc.serve.protocol import MAX_STOP_STRINGS, client_names
from llmc.serve.state import STATE_KEY, ServerState, error_status, prepare, read_json, send_sse, start_sse
from llmc.serve.tgi_protocol import NAMES, TgiRequest, TokenEntries, finish_reason, parse_tgi_request, tgi_error


async def compat_generate(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    return await _generate(request, body, body.get("stream") is True, compat=True)


async def generate(request: web.Request) -> web.StreamResponse:
    return await _generate(request, await read_json(request), False)


async def generate_stream(request: web.Request) -> web.StreamResponse:
    return await _generate(request, await read_json(request), True)


async def info(request: web.Request) -> web.Response:
    """TGI's ``Info``: the served model and the limits a client sizes its requests by."""
    state = request.app[STATE_KEY]
    recipe = state.client.engine.recipe
    return web.json_response({
        "model_id": state.model_name, "model_sha": None, "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": recipe.engine.max_batch_size + recipe.serving.max_queue_size,
        "max_best_of": 1, "max_stop_sequences": MAX_STOP_STRINGS, "max_input_tokens": recipe.engine.max_input_len,
        "max_total_tokens": recipe.engine.max_seq_len, "validation_workers": 1, "max_client_batch_size": 1,
        "router": "llmc", "version": __version__, "sha": None, "docker_label": None})


async def _generate(request: web.Request, body: dict[str, Any], stream: bool, compat: bool = False
                    ) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    limits = state.client.engine.recipe.engine
    req = parse_tgi_request(body, state.defaults, limits.max_seq_len, limits.max_input_len, state.vocab_size)
    if not compat and req.stream not in (None, stream):
        route = "/generate_stream" if req.stream else "/generate"
        raise RequestError("stream", f"is {str(req.stream).lower()} on {request.path}; post to {route} (or to / "
                                     f"with \"stream\") instead")
    if stream and req.decoder_input_details:
        raise RequestError("parameters.decoder_input_details", "is not supported when streaming tokens (as in "
                                                                "TGI); send it without streaming")
    full_text = req.return_full_text if req.return_full_text is not None else compat
    prepared = _check_room(await prepare(request, await _prompt(state, req), req.params, False, NAMES), req)
    tokenizer = state.client.engine.tokenizer
    entries = TokenEntries(tokenizer, frozenset(getattr(tokenizer, "all_special_ids", ()) or ()))
    head = req.inputs if full_text else ""
    async with aclosing(state.client.stream(prepared, req.params)) as events:
        with client_names(NAMES):
            first = await anext(events)  # admission errors surface here, before any byte
        if stream:
            return await _stream(request, events, first, entries, req, prepared, head)
        finals = [first]
        while not finals[-1].finished:
            finals.append(await anext(events))
    final = finals[-1]
    if final.finish_reason == "abort":
        return web.json_response(_incomplete(), status=500)
    answer: dict[str, Any] = {"generated_text": head + "".join(e.text for e in finals)}
    if req.details:
        tokens = [t for e in finals for t in entries.generated(e)]
        answer["details"] = {**_summary(final, req, len(tokens)),
                             "prefill": entries.prefill(prepared.token_ids, first.prompt_logprobs)
                             if req.decoder_input_details else [],
                             "tokens": [token for token, _ in tokens]}
        if req.top_n_tokens:
            answer["details"]["top_tokens"] = [top for _, top in tokens]
    return web.json_response([answer] if compat else answer)


async def _prompt(state: ServerState, req: TgiRequest) -> Any:
    """The prompt to submit: the text, or its token ids when the body sets ``add_special_tokens`` or ``truncate``
    (the last ``truncate`` tokens)."""
    if req.truncate is None and req.add_special_tokens is None:
        return req.inputs
    with client_names(NAMES):
        ids = await state.client.count(req.inputs, req.add_special_tokens)
    return list(ids[-req.truncate:] if req.truncate is not None else ids)


def _check_room(prepared: PreparedPrompt, req: TgiRequest) -> PreparedPrompt:
    """TGI's length rule: ``max_new_tokens`` given must fit in ``max_seq_len`` after the prompt (absent, it is the
    room left, which must not be none)."""
    if prepared.capped is None or (prepared.capped > 0 and not req.strict):
        return prepared
    n, room = len(prepared.token_ids), prepared.capped
    if not req.strict:
        raise RequestError("inputs", f"has {n} tokens, which leave no room for a new token within max_seq_len="
                                     f"{prepared.max_seq_len}; shorten it (parameters.truncate keeps its last tokens)")
    raise RequestError("parameters.max_new_tokens", f"is {prepared.requested}, but this prompt of {n} tokens leaves "
                                                    f"room for {room} within max_seq_len={prepared.max_seq_len} "
                                                    f"(inputs tokens + max_new_tokens); ask for at most {room}")


def _summary(final: StreamEvent, req: TgiRequest, count: int) -> dict[str, Any]:
    """The details' finish reason, generated tokens (``count`` without the engine's figure) and seed (sampling)."""
    generated = final.metrics.generated_tokens if final.metrics is not None else count
    return {"finish_reason": finish_reason(final), "generated_tokens": generated,
            "seed": req.params.seed if not req.params.greedy else None}


def _incomplete() -> dict[str, str]:
    """An aborted request's answer (the server is shutting down): TGI's ``incomplete_generation``."""
    return {"error": "the request was aborted before it finished (the server is shutting down); send it again",
            "error_type": "incomplete_generation"}


async def _stream(request: web.Request, events: AsyncIterator[StreamEvent], first: StreamEvent,
                  entries: TokenEntries, req: TgiRequest, prepared: PreparedPrompt, head: str) -> web.StreamResponse:
    """One event per generated token; the last carries the whole text (and the details when asked for)."""
    response = await start_sse(request)
    index, parts, event = 0, [head], first
    try:
        while True:
            parts.append(event.text)
            if event.finished and event.finish_reason == "abort":
                await send_sse(response, _incomplete())
                break
            tokens = entries.generated(event)
            for k, (token, top) in enumerate(tokens):
                index += 1
                out: dict[str, Any] = {"index": index, "token": token}
                if req.top_n_tokens:
                    out["top_tokens"] = top
                last = event.finished and k == len(tokens) - 1
                out["generated_text"] = "".join(parts) if last else None
                out["details"] = ({**_summary(event, req, index), "input_length": len(prepared.token_ids)}
                                  if last and req.details else None)
                await send_sse(response, out)
            if event.finished:
                break
            event = await anext(events)
    except LlmcError as exc:  # the status the headers could no longer carry goes in the event
        status, code = error_status(exc)
        await send_sse(response, tgi_error(status, str(exc), code)[1])
    await response.write_eof()
    return response


def add_tgi_routes(app: web.Application) -> None:
    """Register TGI's routes on ``app`` (which must carry the server state)."""
    app.router.add_routes([web.post("/", compat_generate), web.post("/generate", generate),
                           web.post("/generate_stream", generate_stream), web.get("/info", info)])
