"""``POST /v1/responses``: OpenAI's Responses API, stream or not, over the chat machinery of
:mod:`llmc.serve.openai_api` (the body is translated by :mod:`llmc.serve.openai_responses`).

A response's ``output`` is a list of items: a ``reasoning`` item (a reasoning model's thinking, when the server
splits it off), a ``message`` with one ``output_text`` part (with ``logprobs`` when asked for) and ``function_call``
items (``call_id``, ``name``, ``arguments`` as JSON text). ``status`` is ``completed``, or ``incomplete`` with
``incomplete_details.reason: "max_output_tokens"`` when the answer was cut at ``max_output_tokens``; ``usage`` counts
``input_tokens`` (``cached_tokens``: served by the prefix cache) and ``output_tokens`` (``reasoning_tokens``: the
thinking's text tokenized again: the split is made on text, so this can differ by a token from what was sampled).

Streaming sends OpenAI's typed events, each as ``event: <type>`` + ``data: {...}`` with a ``sequence_number``:
``response.created``, ``response.in_progress``, then per item ``response.output_item.added``, its deltas
(``response.reasoning_text.delta``; ``response.content_part.added``, ``response.output_text.delta``,
``response.output_text.done``, ``response.content_part.done``; ``response.function_call_arguments.delta`` and
``.done``: a call is sent whole once the answer is complete) and ``response.output_item.done``, and last
``response.completed`` (or ``response.incomplete``) with the whole response, the same object the request gets
without ``stream``. An error after the first byte is an ``error`` event, then ``response.failed``. llmc keeps no
responses: ``GET``/``DELETE /v1/responses/{id}`` answer 404 and say so.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from llmc.errors import LlmcError
from llmc.request.outputs import StreamEvent
from llmc.serve.engine_client import PreparedPrompt
from llmc.serve.one_chat import chat_steps, serve_one_chat
from llmc.serve.openai_api import Choice
from llmc.serve.openai_responses import STATELESS, ResponsesRequest, parse_responses_request
from llmc.serve.state import STATE_KEY, error_status, read_json


class ResponseBuilder:
    """A response object built from the answer as it streams, and the typed events that say so."""

    def __init__(self, parsed: ResponsesRequest, tokenizer: Any, prepared: PreparedPrompt):
        self.parsed, self.tokenizer, self.prepared = parsed, tokenizer, prepared
        self.id, self.created_at = "resp_" + uuid.uuid4().hex, int(time.time())
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the reasoning or message item being streamed
        self.seq = 0
        self.status, self.incomplete, self.usage = "in_progress", None, None
        self.warnings: list[str] = []
        self.error: dict[str, Any] | None = None

    def snapshot(self) -> dict[str, Any]:
        """The response object as it stands (OpenAI's fields; the request's settings repeated back)."""
        p, params = self.parsed, self.parsed.chat.params
        body = {"id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
                "error": self.error, "incomplete_details": self.incomplete, "instructions": p.instructions,
                "max_output_tokens": p.max_output_tokens, "model": p.chat.model, "output": copy.deepcopy(self.items),
                "parallel_tool_calls": p.parallel_tool_calls, "previous_response_id": None, "reasoning": None,
                "store": False, "temperature": params.temperature, "text": p.text, "tool_choice": p.tool_choice,
                "tools": p.tools, "top_logprobs": p.top_logprobs, "top_p": params.top_p, "truncation": "disabled",
                "usage": self.usage, "metadata": p.metadata or {}, "user": p.user}
        if self.warnings:
            body["warnings"] = self.warnings
        return body

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """An event; ``fields`` are sent as they are when the event goes out, so an item or part that changes
        later is passed as a copy (an added one); a done one no longer changes."""
        out = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return out

    def start(self) -> list[dict[str, Any]]:
        return [self.event("response.created", response=self.snapshot()),
                self.event("response.in_progress", response=self.snapshot())]

    def _add(self, item: dict[str, Any]) -> dict[str, Any]:
        self.items.append(item)
        return self.event("response.output_item.added", output_index=len(self.items) - 1, item=copy.deepcopy(item))

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def reasoning(self, delta: str) -> list[dict[str, Any]]:
        events = [] if self.open is not None and self.open["type"] == "reasoning" else self.close()
        if self.open is None:
            self.open = {"id": "rs_" + uuid.uuid4().hex, "type": "reasoning", "summary": [],
                         "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
            events.append(self._add(self.open))
        self.open["content"][0]["text"] += delta
        return events + [self.event("response.reasoning_text.delta", **self._where(), content_index=0, delta=delta)]

    def text(self, delta: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events = [] if self.open is not None and self.open["type"] == "message" else self.close()
        if self.open is None:
            self.open = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "status": "in_progress",
                         "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(self._add(self.open))
            self.open["content"].append(part)
            events.append(self.event("response.content_part.added", **self._where(), content_index=0,
                                     part=dict(part, logprobs=[])))
        part = self.open["content"][0]
        part["text"] += delta
        part["logprobs"] += logprobs
        return events + [self.event("response.output_text.delta", **self._where(), content_index=0, delta=delta,
                                    logprobs=logprobs)]

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        """The open item's closing events (none when no item is open)."""
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        part, where = item["content"][0], self._where()
        if item["type"] == "reasoning":
            events = [self.event("response.reasoning_text.done", **where, content_index=0, text=part["text"])]
        else:
            events = [self.event("response.output_text.done", **where, content_index=0, text=part["text"],
                                 logprobs=part["logprobs"]),
                      self.event("response.content_part.done", **where, content_index=0, part=part)]
        return events + [self.event("response.output_item.done", output_index=where["output_index"], item=item)]

    def calls(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Function calls, each sent whole: added, its arguments, done."""
        events = self.close()
        for call in calls:
            function = call["function"]
            item = {"id": "fc_" + uuid.uuid4().hex, "type": "function_call", "status": "in_progress",
                    "call_id": call["id"], "name": function["name"], "arguments": ""}
            events.append(self._add(item))
            item["arguments"] = function["arguments"]
            events += [self.event("response.function_call_arguments.delta", **self._where(),
                                  delta=function["arguments"]),
                       self.event("response.function_call_arguments.done", **self._where(), name=function["name"],
                                  arguments=function["arguments"])]
            item["status"] = "completed"
            events.append(self.event("response.output_item.done", output_index=len(self.items) - 1, item=item))
        return events

    async def answer(self, choice: Choice, first: StreamEvent) -> AsyncIterator[list[dict[str, Any]]]:
        """The response's events, a list per engine event (the first list opens the response)."""
        yield self.start()
        async for event, thinking, text, calls in chat_steps(choice, first):
            events = self.reasoning(thinking) if thinking else []
            logprobs = choice.logprobs()
            if text:
                events += self.text(text, logprobs["content"] if logprobs else [])
            yield events + (self.finish(event, choice, calls) if event.finished else [])

    def finish(self, final: StreamEvent, choice: Choice, calls: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
        """The last events: open items closed, the calls, and ``response.completed`` / ``response.incomplete``."""
        prepared = self.prepared
        cut = final.finish_reason == "length"
        if self.open is None and not calls and not any(i["type"] == "message" for i in self.items):
            events = self.text("", [])  # an empty answer is still a message
        else:
            events = []
        events += self.close("incomplete" if cut else "completed")
        if calls:
            events += self.calls(calls)
        self.status = "incomplete" if cut else "completed"
        self.incomplete = {"reason": "max_output_tokens"} if cut else None
        output = final.metrics.generated_tokens if final.metrics is not None else 0
        thinking = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "reasoning")
        reasoning = len(self.tokenizer.encode(thinking, add_special_tokens=False)) if thinking else 0
        self.usage = {"input_tokens": len(prepared.token_ids), "input_tokens_details":
                      {"cached_tokens": choice.cached_tokens}, "output_tokens": output,
                      "output_tokens_details": {"reasoning_tokens": reasoning},
                      "total_tokens": len(prepared.token_ids) + output}
        self.warnings = list(prepared.warnings())
        return events + [self.event("response.incomplete" if cut else "response.completed", response=self.snapshot())]

    def fail(self, exc: LlmcError) -> list[dict[str, Any]]:
        """An error after the stream began: OpenAI's ``error`` event, then ``response.failed``."""
        status, code = error_status(exc)
        code = code or ("invalid_request_error" if status < 500 else "server_error")
        self.status, self.error = "failed", {"code": code, "message": str(exc)}
        return [self.event("error", code=code, message=str(exc), param=getattr(exc, "field", None)),
                self.event("response.failed", response=self.snapshot())]


async def create_response(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    parsed = parse_responses_request(await read_json(request), state.request_names(), state.defaults,
                                     state.vocab_size, state.tool_syntax)
    tokenizer = state.client.engine.tokenizer
    return await serve_one_chat(request, parsed.chat, lambda prepared: ResponseBuilder(parsed, tokenizer, prepared))


async def stored_response(request: web.Request) -> web.Response:
    """``GET``/``DELETE /v1/responses/{id}`` (and ``.../cancel``): llmc keeps no responses."""
    raise web.HTTPNotFound(text=f"no response {request.match_info['id']!r}: {STATELESS}")


def add_responses_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{id}", stored_response)
    app.router.add_delete("/v1/responses/{id}", stored_response)
    app.router.add_get("/v1/responses/{id}/input_items", stored_response)
    app.router.add_post("/v1/responses/{id}/cancel", stored_response)
