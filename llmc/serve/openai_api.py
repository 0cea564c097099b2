"""OpenAI-compatible routes: ``/v1/models[/{model}]``, ``/v1/completions``, ``/v1/chat/completions`` (stream or not).

Routes only: bodies are parsed by :mod:`llmc.serve.openai_protocol`. A request whose ``max_tokens`` is more
than the prompt leaves room for within ``max_seq_len`` is capped, and the response says so in ``warnings``
(top level; in the last chunk when streaming); with ``"strict_max_tokens": true`` it is a 400 instead.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import AsyncExitStack, aclosing
from typing import Any

from aiohttp import web

from llmc.errors import LlmcError, UnknownModelError
from llmc.request.outputs import StreamEvent, TokenLogprob
from llmc.request.params import SamplingParams
from llmc.serve.engine_client import PreparedPrompt
from llmc.serve.openai_logprobs import LogprobFormatter, event_logprobs
from llmc.serve.openai_protocol import OpenAIRequest, parse_openai_request
from llmc.serve.protocol import client_names
from llmc.serve.state import (STATE_KEY, TRITON_ALIASES, error_status, openai_error, prepare, read_json, send_sse,
                              start_sse)


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
    tokenizer = state.client.engine.tokenizer
    choices = [_Choice(i, state.client.stream(prepared, choice_params(req.params, i)), tokenizer, chat,
                       req.params.logprobs) for i in range(req.n)]
    async with AsyncExitStack() as stack:
        for c in choices:
            await stack.enter_async_context(aclosing(c.events))
        with client_names(req.names):  # all submitted at once; admission errors surface here, before any byte
            firsts = await _all([anext(c.events) for c in choices])
        if req.stream:
            return await _stream(request, choices, firsts, meta, chat, req, prepared)
        finals = await _all([c.collect(first) for c, first in zip(choices, firsts)])
    body = {**meta, "choices": [c.whole(chat) for c in choices], "usage": _usage(finals)}
    if prepared.warnings():
        body["warnings"] = prepared.warnings()
    return web.json_response(body)


class _Choice:
    """One of a request's ``n`` completions: its engine stream, its text so far and the log-probabilities not yet
    sent (``asked``: ``SamplingParams.logprobs``; None: none were asked for)."""

    def __init__(self, index: int, events: AsyncIterator[StreamEvent], tokenizer: Any, chat: bool,
                 asked: int | None):
        self.index, self.events, self.asked = index, events, asked
        self.parts: list[str] = []
        self.finish_reason: str | None = None
        self.pending: list[TokenLogprob] = []
        self.formatter = LogprobFormatter(tokenizer, chat)

    def take(self, event: StreamEvent) -> None:
        self.parts.append(event.text)
        self.pending += event_logprobs(event)
        self.finish_reason = event.finish_reason

    async def collect(self, event: StreamEvent) -> StreamEvent:
        """Take ``event`` and the stream's next ones up to the finished one (returned)."""
        self.take(event)
        while not event.finished:
            event = await anext(self.events)
            self.take(event)
        return event

    async def forward(self, event: StreamEvent, queue: asyncio.Queue) -> None:
        """Put ``event`` and the stream's next ones up to the finished one on ``queue`` as ``(choice, event)``."""
        await queue.put((self, event))
        while not event.finished:
            event = await anext(self.events)
            await queue.put((self, event))

    def logprobs(self) -> dict[str, Any] | None:
        """The pending tokens' log-probabilities in OpenAI's shape (None when not asked for); then none pend."""
        out = self.formatter.format(self.pending) if self.asked is not None else None
        self.pending = []
        return out

    def whole(self, chat: bool) -> dict[str, Any]:
        """The choice of a response that is not streamed."""
        text = "".join(self.parts)
        choice: dict[str, Any] = {"index": self.index, "finish_reason": self.finish_reason,
                                  "logprobs": self.logprobs()}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        return choice


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s sampling parameters: a seeded request's choice i samples with ``seed + i`` (mod 2**64),
    so its choices differ and choice 0 is what the request gives with ``n`` = 1."""
    if index == 0 or params.seed is None:
        return params
    return params.replace(seed=(params.seed + index) % 2**64)


async def _all(awaitables: Sequence[Awaitable[Any]]) -> list[Any]:
    """Await them concurrently; their results in order. The first to fail cancels the others (their requests are
    aborted) and its error is raised as itself, so an llmc error reaches the error mapping."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(_awaited(a)) for a in awaitables]
    except BaseExceptionGroup as errors:
        raise _first(errors) from None
    return [t.result() for t in tasks]


async def _awaited(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


def _first(errors: BaseExceptionGroup) -> BaseException:
    for error in errors.exceptions:
        if isinstance(error, BaseExceptionGroup):
            return _first(error)
        if not isinstance(error, asyncio.CancelledError):
            return error
    return errors.exceptions[0]


def _usage(finals: Sequence[StreamEvent]) -> dict[str, int]:
    """The prompt's tokens once, every choice's generated tokens."""
    metrics = [e.metrics for e in finals if e.metrics is not None]
    prompt = metrics[0].prompt_tokens if metrics else 0
    completion = sum(m.generated_tokens for m in metrics)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _stream(request: web.Request, choices: Sequence[_Choice], firsts: Sequence[StreamEvent],
                  meta: dict[str, Any], chat: bool, req: OpenAIRequest, prepared: PreparedPrompt
                  ) -> web.StreamResponse:
    """SSE chunks (``chat.completion.chunk`` / ``text_completion``) of one choice each, in the order the choices'
    tokens arrive, then ``data: [DONE]``. A chunk carries the log-probabilities of its choice's tokens since that
    choice's previous chunk (a token whose text is held back, e.g. part of a multi-byte character, goes with the
    next chunk)."""
    meta = {**meta, "object": "chat.completion.chunk" if chat else "text_completion"}
    response = await start_sse(request)

    def chunk(c: _Choice, event: StreamEvent | None) -> dict[str, Any]:
        """``event``'s chunk (None: the chat's opening chunk, the role)."""
        text, finish = (event.text, event.finish_reason if event.finished else None) if event else (None, None)
        lps = c.logprobs() if event else None
        if chat:
            delta = {"role": "assistant", "content": ""} if event is None else ({"content": text} if text else {})
            choice = {"index": c.index, "delta": delta, "finish_reason": finish, "logprobs": lps}
        else:
            choice = {"index": c.index, "text": text or "", "finish_reason": finish, "logprobs": lps}
        out = {**meta, "choices": [choice]}
        if finish is not None and prepared.warnings():
            out["warnings"] = prepared.warnings()
        return out

    queue: asyncio.Queue[tuple[_Choice, StreamEvent]] = asyncio.Queue()
    finals: list[StreamEvent] = []

    async def send() -> None:
        while len(finals) < len(choices):
            c, event = await queue.get()
            c.take(event)
            if event.text or event.finished:
                await send_sse(response, chunk(c, event))
            if event.finished:
                finals.append(event)

    try:
        if chat:
            for c in choices:
                await send_sse(response, chunk(c, None))
        await _all([send(), *(c.forward(first, queue) for c, first in zip(choices, firsts))])
        if req.include_usage:
            await send_sse(response, {**meta, "choices": [], "usage": _usage(finals)})
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
