"""One chat answer in another API's shape: what the Responses API (:mod:`llmc.serve.openai_responses_api`) and
Anthropic's Messages API (:mod:`llmc.serve.anthropic_api`) share. The request is a parsed chat request of one choice,
run through the chat route's :class:`~llmc.serve.openai_api.Choice`; an API's builder turns the answer's pieces into
its objects and typed events (``{"type": ..., ...}``, each sent as ``event: <type>``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any, Protocol

from aiohttp import web

from llmc.errors import LlmcError
from llmc.request.outputs import StreamEvent
from llmc.serve.engine_client import PreparedPrompt
from llmc.serve.openai_api import Choice, reasoning_stream
from llmc.serve.openai_protocol import OpenAIRequest
from llmc.serve.protocol import client_names
from llmc.serve.state import STATE_KEY, prepare, send_sse, start_sse


class AnswerBuilder(Protocol):
    """An API's answer: its typed events as the answer streams, the whole object, and the events of an error."""

    def answer(self, choice: Choice, first: StreamEvent) -> AsyncIterator[list[dict[str, Any]]]: ...

    def snapshot(self) -> dict[str, Any]: ...

    def fail(self, exc: LlmcError) -> list[dict[str, Any]]: ...


async def chat_steps(choice: Choice, first: StreamEvent
                     ) -> AsyncIterator[tuple[StreamEvent, str, str, list[dict[str, Any]] | None]]:
    """Per engine event from ``first`` on: ``(event, thinking, text, calls)``, the thinking and text to send (a
    reasoning model's thinking split off when the server does so) and, with the finished event, the answer's function
    calls (chat's ``tool_calls``; None when there are none). A constrained call cut short is sent as its text."""
    event = first
    while True:
        text = choice.take(event)
        thinking, choice.thinking = choice.thinking, ""
        calls = choice.tool_calls() if event.finished else None
        if event.finished and choice.tools is not None and choice.watch is None and not calls:
            text = "".join(choice.parts)  # as chat returns it
        yield event, thinking, text, calls
        if event.finished:
            return
        event = await anext(choice.events)


async def serve_one_chat(request: web.Request, req: OpenAIRequest,
                         builder_for: Callable[[PreparedPrompt], AnswerBuilder]) -> web.StreamResponse:
    """Run ``req`` and answer with the builder's whole object, or with its events when ``req.stream``; admission
    errors come before any byte (the route's error mapping answers them), a later one is the builder's error
    events."""
    state = request.app[STATE_KEY]
    prepared = await prepare(request, req.prompt, req.params, req.strict_max_tokens, req.names)
    tokenizer = state.client.engine.tokenizer
    split = state.reasoning is not None and req.params.structured is None
    choice = Choice(0, state.client.stream(prepared, req.params), tokenizer, True, req, None,
                    reasoning_stream(tokenizer, prepared) if split else None)
    out = builder_for(prepared)
    async with aclosing(choice.events):
        with client_names(req.names):
            first = await anext(choice.events)
        choice.start(first, prepared.token_ids)
        async with aclosing(out.answer(choice, first)) as answer:
            if not req.stream:
                async for _ in answer:
                    pass
                return web.json_response(out.snapshot())
            response = await start_sse(request)
            try:
                async for events in answer:
                    for e in events:
                        await send_sse(response, e, event=e["type"])
            except LlmcError as exc:
                for e in out.fail(exc):
                    await send_sse(response, e, event=e["type"])
    await response.write_eof()
    return response
