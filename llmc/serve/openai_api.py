"""OpenAI-compatible routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (stream or not).

Request fields map onto :class:`~llmc.request.params.SamplingParams` (``max_tokens`` -> ``max_new_tokens``,
``seed``, ``stop``, penalties, ``top_p``; llmc extras ``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``, ``include_stop_str_in_output``).
Fields OpenAI clients commonly send and llmc does not use (``user``, ``logit_bias: null``, ...) are ignored;
features llmc cannot honour (``n`` > 1, log probs, tools) are a 400.
"""

from __future__ import annotations

import time
import uuid
from contextlib import aclosing
from typing import Any

from aiohttp import web

from llmc.errors import LlmcError, RequestError
from llmc.serve.server import STATE_KEY, ServerState, read_json, send_sse, start_sse

PARAM_MAP = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "temperature": "temperature",
             "top_p": "top_p", "seed": "seed", "stop": "stop", "presence_penalty": "presence_penalty",
             "frequency_penalty": "frequency_penalty", "top_k": "top_k", "min_p": "min_p",
             "repetition_penalty": "repetition_penalty", "min_tokens": "min_tokens", "ignore_eos": "ignore_eos",
             "stop_token_ids": "stop_token_ids", "skip_special_tokens": "skip_special_tokens",
             "include_stop_str_in_output": "include_stop_str_in_output"}
UNSUPPORTED = {"n": 1, "best_of": 1, "logprobs": None, "top_logprobs": None, "echo": False, "suffix": None,
               "tools": None, "functions": None}


def sampling_params(state: ServerState, body: dict[str, Any]) -> Any:
    """SamplingParams from an OpenAI body (recipe defaults for absent fields); RequestError names the field."""
    for key, neutral in UNSUPPORTED.items():
        value = body.get(key)
        if value is not None and value != neutral and not (key == "logprobs" and value is False):
            raise RequestError(key, f"is not supported by llmc (got {value!r}); remove it")
    changes = {target: body[key] for key, target in PARAM_MAP.items() if body.get(key) is not None}
    if isinstance(changes.get("max_new_tokens"), int) and changes["max_new_tokens"] <= 0:
        raise RequestError("max_tokens", f"must be >= 1, got {changes['max_new_tokens']}")
    return state.defaults.replace(**changes).validate(state.vocab_size)


def _check_model(state: ServerState, body: dict[str, Any]) -> str:
    model = body.get("model") or state.model_name
    if not isinstance(model, str) or not state.knows(model):
        raise RequestError("model", f"unknown model {model!r}; this server serves {state.model_name!r}")
    return model


def _usage(event: Any) -> dict[str, int]:
    m = event.metrics
    prompt, completion = (m.prompt_tokens, m.generated_tokens) if m else (0, 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _prompt(body: dict[str, Any]) -> Any:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)):
        return prompt
    raise RequestError("prompt", "must be a string or a list of token ids (one prompt per request)")


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "must be a non-empty list of {\"role\", \"content\"} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}]", "must be an object with role and content")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        out.append({"role": m.get("role"), "content": content})
    return out


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    return web.json_response({"object": "list", "data": [
        {"id": state.model_name, "object": "model", "created": 0, "owned_by": "llmc"}]})


async def completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=True)


async def _complete(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    body = await read_json(request)
    model = _check_model(state, body)
    prompt = _messages(body) if chat else _prompt(body)
    params = sampling_params(state, body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream", f"must be true or false, got {stream!r}")
    meta = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()), "model": model,
            "object": "chat.completion" if chat else "text_completion"}
    events = state.client.stream(prompt, params)
    async with aclosing(events):
        first = await anext(events)
        if stream:
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return await _stream(request, events, first, meta, chat, include_usage)
        parts, event = [first.text], first
        while not event.finished:
            event = await anext(events)
            parts.append(event.text)
    text = "".join(parts)
    choice: dict[str, Any] = {"index": 0, "finish_reason": event.finish_reason, "logprobs": None}
    choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
    return web.json_response({**meta, "choices": [choice], "usage": _usage(event)})


async def _stream(request: web.Request, events: Any, event: Any, meta: dict[str, Any], chat: bool,
                  include_usage: bool) -> web.StreamResponse:
    """SSE chunks (``chat.completion.chunk`` / ``text_completion``), then ``data: [DONE]``."""
    meta = {**meta, "object": "chat.completion.chunk" if chat else "text_completion"}
    response = await start_sse(request)

    def chunk(text: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
        if chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        return {**meta, "choices": [choice]}

    try:
        if chat:
            await send_sse(response, chunk(None, None, first=True))
        while True:
            if event.text or event.finished:
                await send_sse(response, chunk(event.text, event.finish_reason if event.finished else None))
            if event.finished:
                break
            event = await anext(events)
        if include_usage:
            await send_sse(response, {**meta, "choices": [], "usage": _usage(event)})
    except LlmcError as exc:
        await send_sse(response, {"error": {"message": str(exc), "type": type(exc).__name__}})
    await send_sse(response, "[DONE]")
    await response.write_eof()
    return response


def add_openai_routes(app: web.Application) -> None:
    """Register the ``/v1`` routes on ``app`` (which must carry the server state)."""
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
