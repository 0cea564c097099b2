"""``POST /v1/messages`` (Anthropic's Messages API, stream or not) and ``POST /v1/messages/count_tokens``, over the chat
machinery of :mod:`llmc.serve.openai_api` (the body is translated by :mod:`llmc.serve.anthropic_protocol`).

A message's ``content`` is a list of blocks: ``thinking`` (a reasoning model's thinking, when the server splits it
off; its ``signature`` is empty, as llmc signs nothing), ``text``, and ``tool_use`` blocks (``id``, ``name``,
``input``: the parsed arguments) when the answer calls tools. ``stop_reason``: ``end_turn``, ``stop_sequence`` (with
``stop_sequence``, the string), ``max_tokens``, ``tool_use``, or ``model_context_window_exceeded`` when the answer
stopped where ``max_seq_len`` capped its ``max_tokens``. ``usage`` counts as Anthropic's does: ``input_tokens`` the
prompt tokens computed, ``cache_read_input_tokens`` those the prefix cache served (``cache_creation_input_tokens`` is
0: llmc's cache needs no writes asked for), ``output_tokens`` the tokens generated.

Streaming sends Anthropic's events, each as ``event: <type>`` + ``data: {...}``: ``message_start`` (the message with
no content), per block ``content_block_start``, its deltas (``thinking_delta``, ``text_delta``; a tool call's
``input_json_delta`` holds its whole arguments, sent once the answer is complete) and ``content_block_stop``, then
``message_delta`` (``stop_reason``, ``stop_sequence`` and the final ``usage``) and ``message_stop``. An error after
the first byte is an ``error`` event, Anthropic's error object. A request aborted by the server (a drain past
``--grace``) is an ``overloaded_error``, which Anthropic's clients retry.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from llmc.errors import LlmcError
from llmc.request.outputs import StreamEvent
from llmc.serve.anthropic_protocol import MessagesRequest, anthropic_error, parse_messages_request, stop_reason
from llmc.serve.engine_client import PreparedPrompt, ServerDrainingError
from llmc.serve.one_chat import chat_steps, serve_one_chat
from llmc.serve.openai_api import Choice
from llmc.serve.state import STATE_KEY, error_status, read_json


class MessageBuilder:
    """A message built from the answer as it streams, and the events that say so."""

    def __init__(self, parsed: MessagesRequest, prepared: PreparedPrompt):
        self.parsed, self.prepared = parsed, prepared
        self.id = "msg_" + uuid.uuid4().hex
        self.blocks: list[dict[str, Any]] = []
        self.open: str | None = None  # the type of the block being streamed: "thinking" or "text"
        self.stop: tuple[str | None, str | None] = (None, None)
        self.usage = {"input_tokens": len(prepared.token_ids), "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": 0, "output_tokens": 0}

    def snapshot(self) -> dict[str, Any]:
        """The message as it stands (Anthropic's fields)."""
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.parsed.model,
                "content": copy.deepcopy(self.blocks), "stop_reason": self.stop[0], "stop_sequence": self.stop[1],
                "usage": dict(self.usage)}

    def start(self) -> list[dict[str, Any]]:
        return [{"type": "message_start", "message": self.snapshot()}]

    def _open(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close()
        self.blocks.append(block)
        self.open = block["type"] if block["type"] != "tool_use" else None
        return events + [{"type": "content_block_start", "index": len(self.blocks) - 1,
                          "content_block": copy.deepcopy(block)}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def thinking(self, delta: str) -> list[dict[str, Any]]:
        events = [] if self.open == "thinking" else self._open({"type": "thinking", "thinking": "", "signature": ""})
        self.blocks[-1]["thinking"] += delta
        return events + [self._delta({"type": "thinking_delta", "thinking": delta})]

    def text(self, delta: str) -> list[dict[str, Any]]:
        events = [] if self.open == "text" else self._open({"type": "text", "text": ""})
        self.blocks[-1]["text"] += delta
        return events + [self._delta({"type": "text_delta", "text": delta})]

    def close(self) -> list[dict[str, Any]]:
        """The open block's closing event (none when no block is open)."""
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def calls(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Tool calls, each a ``tool_use`` block sent whole: start, its arguments, stop."""
        events = []
        for call in calls:
            function = call["function"]
            events += self._open({"type": "tool_use", "id": call["id"], "name": function["name"], "input": {}})
            self.blocks[-1]["input"] = json.loads(function["arguments"])
            events += [self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}),
                       {"type": "content_block_stop", "index": len(self.blocks) - 1}]
        return events

    async def answer(self, choice: Choice, first: StreamEvent) -> AsyncIterator[list[dict[str, Any]]]:
        """The message's events, a list per engine event (the first list opens the message)."""
        yield self.start()
        async for event, thinking, text, calls in chat_steps(choice, first):
            events = self.thinking(thinking) if thinking else []
            if text:
                events += self.text(text)
            yield events + (self.finish(event, choice, calls) if event.finished else [])

    def fail(self, exc: LlmcError) -> list[dict[str, Any]]:
        """An error after the stream began: Anthropic's ``error`` event."""
        return [anthropic_error(error_status(exc)[0], str(exc))]

    def finish(self, final: StreamEvent, choice: Choice, calls: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
        """The last events: the open block closed, the calls, ``message_delta`` and ``message_stop``."""
        if final.finish_reason == "abort":
            raise ServerDrainingError()  # aborted by the drain after --grace
        events = self.text("") if not self.blocks and not calls else []  # an empty answer is still a text block
        events += self.close()
        if calls:
            events += self.calls(calls)
        self.stop = stop_reason(final, bool(calls), self.prepared.capped is not None)
        cached = choice.cached_tokens
        self.usage.update(input_tokens=len(self.prepared.token_ids) - cached, cache_read_input_tokens=cached,
                          output_tokens=final.metrics.generated_tokens if final.metrics is not None else 0)
        delta = {"stop_reason": self.stop[0], "stop_sequence": self.stop[1]}
        return events + [{"type": "message_delta", "delta": delta, "usage": dict(self.usage)},
                         {"type": "message_stop"}]


async def create_message(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    parsed = parse_messages_request(await read_json(request), state.request_names(), state.defaults,
                                    state.vocab_size, state.tool_syntax)
    return await serve_one_chat(request, parsed.chat, lambda prepared: MessageBuilder(parsed, prepared))


async def count_tokens(request: web.Request) -> web.Response:
    """``POST /v1/messages/count_tokens``: ``{"input_tokens": N}``, the prompt's tokens as ``/v1/messages`` renders
    it (system, messages, tools), also past ``max_input_len``; nothing is generated."""
    state = request.app[STATE_KEY]
    parsed = parse_messages_request(await read_json(request), state.request_names(), state.defaults,
                                    state.vocab_size, state.tool_syntax, count_only=True)
    return web.json_response({"input_tokens": len(await state.client.count(parsed.chat.prompt))})


def add_anthropic_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", create_message)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
