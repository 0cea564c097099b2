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
from datetime import datetime, timezone
from typing import Any

from aiohttp import web

from llmc.errors import LlmcError, UnknownModelError
from llmc.request.outputs import StreamEvent, TokenLogprob, output_logprobs
from llmc.request.params import SamplingParams
from llmc.serve.engine_client import PreparedPrompt
from llmc.serve.openai_logprobs import LogprobFormatter
from llmc.serve.openai_protocol import OpenAIRequest, parse_openai_request
from llmc.serve.openai_tools import openai_calls
from llmc.serve.protocol import client_names
from llmc.serve.reasoning import ReasoningStream, prompt_opens_thinking
from llmc.serve.state import (STATE_KEY, ServerState, error_status, openai_error, prepare, read_json, send_sse,
                              start_sse)
from llmc.serve.tool_syntax import CallStream, ParsedCalls


def _model(state: ServerState, name: str) -> dict[str, Any]:
    """A model card: OpenAI's fields, plus ``max_model_len`` (vLLM's name) so clients can size their requests, and
    Anthropic's (``type``, ``display_name``, ``created_at``), which its client's ``models.list`` reads."""
    created_at = datetime.fromtimestamp(state.created, timezone.utc).isoformat().replace("+00:00", "Z")
    card = {"id": name, "object": "model", "created": state.created, "owned_by": "llmc", "type": "model",
            "display_name": name, "created_at": created_at}
    return card if state.max_model_len is None else {**card, "max_model_len": state.max_model_len}


async def list_models(request: web.Request) -> web.Response:
    """The served model, in OpenAI's list (``object``, ``data``) and Anthropic's page (``has_more``, ...)."""
    state = request.app[STATE_KEY]
    name = state.model_name
    return web.json_response({"object": "list", "data": [_model(state, name)], "has_more": False,
                              "first_id": name, "last_id": name})


async def retrieve_model(request: web.Request) -> web.Response:
    """``/v1/models/{model}``: the served model (or a Triton alias, which requests accept too), else a 404."""
    state, name = request.app[STATE_KEY], request.match_info["model"]
    if not state.knows(name):
        raise UnknownModelError("model", f"unknown model {name!r}; this server serves {state.model_name!r}")
    return web.json_response(_model(state, name))


async def completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=True)


async def _complete(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    req = parse_openai_request(await read_json(request), chat, state.request_names(), state.defaults,
                               state.vocab_size, state.tool_syntax)
    meta = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
            "model": req.model, "object": "chat.completion" if chat else "text_completion"}
    prepared = [await prepare(request, p, req.params, req.strict_max_tokens, req.names) for p in req.prompts]
    tokenizer = state.client.engine.tokenizer
    split = chat and state.reasoning is not None and req.params.structured is None  # thinking has room
    choices = [Choice(k * req.n + i, state.client.stream(one, choice_params(req.params, i)), tokenizer, chat, req,
                      _echo_text(tokenizer, prompt, one) if req.echo else None,
                      reasoning_stream(tokenizer, one) if split else None)
               for k, (prompt, one) in enumerate(zip(req.prompts, prepared)) for i in range(req.n)]
    async with AsyncExitStack() as stack:
        for c in choices:
            await stack.enter_async_context(aclosing(c.events))
        with client_names(req.names):  # all submitted at once; admission errors surface here, before any byte
            firsts = await _all([anext(c.events) for c in choices])
        for c, first, one in zip(choices, firsts, (one for one in prepared for _ in range(req.n))):
            c.start(first, one.token_ids)
        if req.stream:
            return await _stream(request, choices, firsts, meta, chat, req, prepared)
        finals = await _all([c.collect(first) for c, first in zip(choices, firsts)])
    body = {**meta, "choices": [c.whole(chat) for c in choices], "usage": _usage(choices, finals, prepared, req)}
    warnings = _warnings(prepared)
    if warnings:
        body["warnings"] = warnings
    return web.json_response(body)


def _echo_text(tokenizer: Any, prompt: Any, prepared: PreparedPrompt) -> str:
    """The text an echoed prompt returns: a text prompt as sent, a token-id prompt decoded."""
    return prompt if isinstance(prompt, str) else tokenizer.decode(list(prepared.token_ids))


def reasoning_stream(tokenizer: Any, prepared: PreparedPrompt) -> ReasoningStream:
    """The split of an answer into thinking and content; it starts inside ``<think>`` when the prompt opened it."""
    return ReasoningStream(prompt_opens_thinking(tokenizer.decode(list(prepared.token_ids[-8:]))))


def _warnings(prepared: Sequence[PreparedPrompt]) -> list[str]:
    return [w for one in prepared for w in one.warnings()]


class Choice:
    """One of a request's completions: its engine stream, its text so far and the log-probabilities not yet sent
    (``asked``: ``SamplingParams.logprobs``; None: none were asked for). ``echo``: the prompt's text, which goes
    first (with its tokens' log-probabilities, when asked for); ``score_only``: the generated token is left out.
    ``split``: a reasoning model's thinking goes out as ``reasoning_content`` (:mod:`llmc.serve.reasoning`)."""

    def __init__(self, index: int, events: AsyncIterator[StreamEvent], tokenizer: Any, chat: bool,
                 req: OpenAIRequest, echo: str | None = None, split: ReasoningStream | None = None):
        self.index, self.events, self.asked = index, events, req.params.logprobs
        self.echo, self.score_only = echo, req.score_only
        self.parts: list[str] = []
        self.finish_reason: str | None = None
        self.pending: list[TokenLogprob] = []
        self.formatter = LogprobFormatter(tokenizer, chat)
        self.prompt_logprobs: dict[str, Any] | None = None  # an echoed prompt's, until sent
        self.tools = req.tools  # function calling: calls are sent as tool_calls once the answer is complete
        # tool_choice "auto": the text before a call streams, the call waits for the end; else the text is a call
        self.watch = CallStream(req.tools.syntax, req.tools.names) if req.tools and req.tools.syntax else None
        self.parsed: ParsedCalls | None = None  # "auto": the finished answer's calls
        self.split, self.thinking = split, ""  # thinking: reasoning text not sent yet
        self.cached_tokens = 0  # prompt tokens the prefix cache served (known at the end)

    def start(self, first: StreamEvent, prompt_ids: Sequence[int]) -> None:
        """Before any event is taken: the echoed prompt's log-probabilities (the first event carries them)."""
        if self.echo is not None and self.asked is not None:
            self.prompt_logprobs = self.formatter.format_prompt(prompt_ids, first.prompt_logprobs)

    def take(self, event: StreamEvent) -> str:
        """Take an event; returns its text for the response."""
        text = "" if self.score_only else event.text
        self.parts.append(text)
        if not self.score_only:
            self.pending += output_logprobs(event)
        self.finish_reason = event.finish_reason
        if event.metrics is not None:
            self.cached_tokens = event.metrics.cached_tokens
        if self.split is not None:
            thought, text = self.split.feed(text)
            if event.finished:
                thought_rest, text_rest = self.split.finish()
                thought, text = thought + thought_rest, text + text_rest
            self.thinking += thought
        if self.watch is not None:
            out = self.watch.feed(text)
            if event.finished:
                rest, self.parsed = self.watch.finish(event.finish_reason == "stop")
                out += rest
            return out
        return "" if self.tools is not None else text

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
        """The pending tokens' log-probabilities in OpenAI's shape, after an echoed prompt's not sent yet (None
        when not asked for); then none pend."""
        if self.asked is None:
            return None
        out = self.formatter.format(self.pending)
        self.pending = []
        if self.prompt_logprobs is not None:
            head, self.prompt_logprobs = self.prompt_logprobs, None
            out = {key: head[key] + out[key] for key in out}
        return out

    def tool_calls(self) -> list[dict[str, Any]] | None:
        """The finished answer's function calls (function calling with a complete answer), else None."""
        parsed = self._parsed()
        return None if parsed is None else openai_calls(parsed)

    def _parsed(self) -> ParsedCalls | None:
        if self.tools is None or self.finish_reason != "stop":
            return None
        return self.parsed if self.watch is not None else self.tools.read("".join(self.parts))

    def whole(self, chat: bool) -> dict[str, Any]:
        """The choice of a response that is not streamed."""
        text = (self.echo or "") + ("".join(self.parts) if self.split is None else self.split.content)
        parsed = self._parsed()
        choice: dict[str, Any] = {"index": self.index, "finish_reason": "tool_calls" if parsed else self.finish_reason,
                                  "logprobs": self.logprobs()}
        if parsed:
            choice["message"] = {"role": "assistant", "content": parsed.content, "tool_calls": openai_calls(parsed)}
        else:
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        if self.split is not None:
            choice["message"]["reasoning_content"] = self.split.reasoning or None
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


def _usage(choices: Sequence[Choice], finals: Sequence[StreamEvent], prepared: Sequence[PreparedPrompt],
           req: OpenAIRequest) -> dict[str, Any]:
    """Each prompt's tokens once, every choice's generated tokens (none returned with ``max_tokens: 0``), and in
    ``prompt_tokens_details.cached_tokens`` each prompt's tokens served from the prefix cache (its choice that found
    the most: choices start together, so the first computes what the others may find)."""
    prompt = sum(len(one.token_ids) for one in prepared)
    completion = 0 if req.score_only else sum(e.metrics.generated_tokens for e in finals if e.metrics is not None)
    cached = sum(max(c.cached_tokens for c in choices[k * req.n:(k + 1) * req.n]) for k in range(len(prepared)))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def _stream(request: web.Request, choices: Sequence[Choice], firsts: Sequence[StreamEvent],
                  meta: dict[str, Any], chat: bool, req: OpenAIRequest, prepared: Sequence[PreparedPrompt]
                  ) -> web.StreamResponse:
    """SSE chunks (``chat.completion.chunk`` / ``text_completion``) of one choice each, in the order the choices'
    tokens arrive, then ``data: [DONE]``. A chunk carries the log-probabilities of its choice's tokens since that
    choice's previous chunk (a token whose text is held back, e.g. part of a multi-byte character, goes with the
    next chunk). With ``echo`` each choice's first chunk is its prompt."""
    meta = {**meta, "object": "chat.completion.chunk" if chat else "text_completion"}
    response = await start_sse(request)
    warnings = _warnings(prepared)

    def chunk(c: Choice, event: StreamEvent | None, text: str | None = None) -> dict[str, Any]:
        """``event``'s chunk with its ``text`` (None: the chat's opening chunk, the role, or an echoed prompt). A
        function-calling choice sends its answer with the last event: the calls at once, or a cut-short answer's
        text."""
        finish = event.finish_reason if event is not None and event.finished else None
        lps = c.logprobs() if event is not None or c.echo is not None else None
        calls = c.tool_calls() if finish is not None else None
        if calls:
            finish, delta = "tool_calls", {"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]}
        elif c.tools is not None and c.watch is None and finish is not None:
            text = "".join(c.parts)
        if chat:
            if not calls:
                delta = {"role": "assistant", "content": ""} if event is None else ({"content": text} if text else {})
            if c.thinking:
                delta, c.thinking = {"reasoning_content": c.thinking, **delta}, ""
            choice = {"index": c.index, "delta": delta, "finish_reason": finish, "logprobs": lps}
        else:
            choice = {"index": c.index, "text": text or "", "finish_reason": finish, "logprobs": lps}
        out = {**meta, "choices": [choice]}
        if finish is not None and warnings:
            out["warnings"] = warnings
        return out

    queue: asyncio.Queue[tuple[Choice, StreamEvent]] = asyncio.Queue()
    finals: list[StreamEvent] = []

    async def send() -> None:
        while len(finals) < len(choices):
            c, event = await queue.get()
            text = c.take(event)
            if text or c.thinking or event.finished:
                await send_sse(response, chunk(c, event, text))
            if event.finished:
                finals.append(event)

    try:
        for c in choices:
            if chat or c.echo is not None:
                await send_sse(response, chunk(c, None, c.echo))
        await _all([send(), *(c.forward(first, queue) for c, first in zip(choices, firsts))])
        if req.include_usage:
            await send_sse(response, {**meta, "choices": [], "usage": _usage(choices, finals, prepared, req)})
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
