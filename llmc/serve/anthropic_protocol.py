"""Anthropic's Messages API request (``POST /v1/messages``, ``/v1/messages/count_tokens``) -> the chat request llmc
runs (pure functions, no HTTP).

A Messages body is translated into a ``/v1/chat/completions`` body and parsed by
:func:`~llmc.serve.openai_protocol.parse_openai_request`, so both share sampling, structured outputs, function calling,
the chat template and every limit (vLLM serves the same route the same way: vllm-project/vllm@82df3f4,
``vllm/entrypoints/anthropic/protocol.py``). The request's fields, as Anthropic's Python SDK (2.17,
``anthropic/types/message_create_params.py``) names them:

- ``system`` (a string or text blocks) is a system message first; ``messages`` alternate ``user`` and ``assistant``,
  each a string or a list of content blocks: ``text``; an assistant's ``tool_use`` (``id``, ``name``, ``input``) is
  a tool call of that message; a user's ``tool_result`` (``tool_use_id``, ``content`` text or text blocks,
  ``is_error``: its text is prefixed with "Error: ") is a ``tool`` message, before the user's text; ``thinking`` and
  ``redacted_thinking`` blocks are left out, as chat templates drop earlier thinking. Images, documents and server
  tools' blocks are refused (llmc serves text models). A final ``assistant`` message is a prefill: the answer
  continues its text (the chat template leaves that turn open) and holds only what follows it.
- ``max_tokens`` is required, as Anthropic's is; ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``; llmc's
  sampling extras (``seed``, ``min_p``, ``repetition_penalty``, ...) pass through as on chat.
- ``tools``: custom tools (``name``, ``description``, ``input_schema``); ``tool_choice``: ``auto``, ``any``
  (a call is required), ``tool`` (``name``: that one), ``none``; ``disable_parallel_tool_use``: one call at most.
- ``output_config.format`` (``{"type": "json_schema", "schema"}``): structured outputs.
- ``thinking`` (``enabled``, ``adaptive``, ``disabled``) sets the chat template's ``enable_thinking`` (Qwen3's and
  others' switch; templates without it ignore it) unless ``chat_template_kwargs`` does; ``budget_tokens`` is not
  enforced (the thinking counts against ``max_tokens``, as Anthropic's does). A reasoning model's thinking comes back
  as ``thinking`` blocks when the server splits it (``llmc serve --reasoning-syntax``).

Errors are Anthropic's ``{"type": "error", "error": {"type", "message"}}`` (``invalid_request_error`` for a 400,
``not_found_error``, ``authentication_error``, ``overloaded_error`` for a full queue or a draining server,
``timeout_error``, ``api_error``), and every message names the Messages field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from llmc.errors import RequestError, short_repr
from llmc.request.outputs import StreamEvent
from llmc.request.params import SamplingParams
from llmc.serve.openai_protocol import (PARAM_MAP, OpenAIRequest, check_unsupported, parse_openai_request,
                                        string_field, text_content, unknown_field)
from llmc.serve.protocol import with_client_names
from llmc.serve.tool_syntax import ToolSyntax

ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
OWN_FIELDS = ("model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature", "top_p",
              "top_k", "tools", "tool_choice", "thinking", "output_config")
# llmc's sampling fields a Messages body may carry too (Anthropic's own take no other names)
EXTRAS = tuple(k for k in PARAM_MAP if k not in ("max_tokens", "max_completion_tokens", "temperature", "top_p",
                                                 "top_k", "stop")) + ("chat_template_kwargs", "logit_bias")
# Sent by Anthropic's clients, no effect on the tokens: accepted and ignored.
IGNORED = ("metadata", "service_tier", "cache_control", "inference_geo", "anthropic_version")
# Features llmc cannot honour -> the values besides null that ask for none of it.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {"container": (), "mcp_servers": ([],), "context_management": (),
                                           "speed": ("standard",)}
# Other APIs' names for Messages fields, for the hint of an unknown field.
OTHER_NAMES = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens", "response_format":
               "output_config.format", "output_format": "output_config.format", "n": None}
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
SERVER_TOOLS = "llmc runs no server tools; define a custom tool {\"name\", \"input_schema\"}"
TEXT_ONLY = "llmc serves text models; send text blocks"
# Chat's field names in errors raised by the chat parser -> this API's
CLIENT_NAMES = {"response_format": "output_config.format", "stop": "stop_sequences"}
# Anthropic's error type per HTTP status (llmc's statuses; other 4xx are invalid requests, other 5xx api errors)
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 408: "timeout_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error",
               529: "overloaded_error"}


@dataclass(frozen=True)
class MessagesRequest:
    """A parsed Messages request: the chat request llmc runs, and what the answer repeats back."""

    chat: OpenAIRequest
    model: str
    prefill: bool  # the last message is the assistant's, which the answer continues


def parse_messages_request(body: Mapping[str, Any], served: tuple[str, ...], defaults: SamplingParams,
                           vocab_size: int | None = None, tool_syntax: ToolSyntax | None = None,
                           count_only: bool = False) -> MessagesRequest:
    """Check and translate a Messages body; RequestError names the Messages field for every problem.
    ``count_only``: a ``count_tokens`` body (no ``max_tokens``, nothing generated)."""
    _check_fields(body, count_only)
    messages = chat_messages(body.get("messages"))
    system = body.get("system")
    if system is not None:
        messages.insert(0, {"role": "system", "content": text_content(system, "system")})
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages, "stream": body.get("stream"),
                            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
                            "top_k": body.get("top_k"), "stop": body.get("stop_sequences"),
                            **{k: body[k] for k in EXTRAS if k in body}}
    chat["max_tokens"] = 1 if count_only else _max_tokens(body)
    template_kwargs = _thinking(body.get("thinking"), body.get("chat_template_kwargs"))
    if template_kwargs:
        chat["chat_template_kwargs"] = template_kwargs
    fmt = _output_format(body.get("output_config"))
    if fmt is not None:
        chat["response_format"] = fmt
    if body.get("tools"):
        chat["tools"] = _chat_tools(body["tools"])
    _tool_choice(body.get("tool_choice"), chat, count_only)
    prefill = messages[-1]["role"] == "assistant"
    if prefill:
        if messages[-1].get("tool_calls"):
            raise RequestError(f"messages[{len(body['messages']) - 1}]", "a final assistant message is a prefill "
                               "the answer continues: text only, no tool_use blocks")
        chat["continue_final_message"] = True
    try:
        req = parse_openai_request({k: v for k, v in chat.items() if v is not None}, True, served, defaults,
                                   vocab_size, tool_syntax)
    except RequestError as exc:  # in this API's names; chat's tools[i].function.x is tools[i].input_schema here
        renamed = with_client_names(exc, CLIENT_NAMES)
        where = renamed.field.replace(".function.parameters", ".input_schema").replace(".function.", ".")
        raise type(exc)(where, renamed.message) from None
    names = {internal: CLIENT_NAMES.get(name, name) for internal, name in req.names.items()}
    return MessagesRequest(replace(req, names=names), req.model, prefill)


def _check_fields(body: Mapping[str, Any], count_only: bool) -> None:
    known = (*OWN_FIELDS, *EXTRAS, *IGNORED, *UNSUPPORTED)
    for key in body:
        if key not in known:
            if key in OTHER_NAMES:
                fix = f"use {OTHER_NAMES[key]!r}" if OTHER_NAMES[key] else "one answer a request; send n requests"
                raise RequestError(key, f"is not a Messages API field; {fix}")
            raise unknown_field(key, known)
    if count_only and body.get("stream"):
        raise RequestError("stream", "count_tokens answers at once; leave stream out")
    check_unsupported(body, UNSUPPORTED)


def _max_tokens(body: Mapping[str, Any]) -> int:
    value = body.get("max_tokens")
    if value is None:
        raise RequestError("max_tokens", "is required: the most tokens to generate (e.g. 1024), as Anthropic's "
                                         "API requires")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError("max_tokens", f"must be an integer >= 1, got {short_repr(value)}")
    return value


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """``messages`` -> chat messages (see the module docstring); RequestError naming ``messages[i]...``."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", 'must be a non-empty list of {"role": "user" | "assistant", "content"} '
                                       "objects")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            fix = '; put the system prompt in the top-level "system" field' if role == "system" else ""
            raise RequestError(f"{where}.role", f'must be "user" or "assistant", got {short_repr(role)}{fix}')
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise RequestError(f"{where}.content", f"must be a string or a list of content blocks, got "
                                                   f"{type(content).__name__}")
        out += _user(blocks, where) if role == "user" else [_assistant(blocks, where)]
    return out


def _block(block: Any, where: str, kinds: tuple[str, ...]) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind in kinds:
        return kind
    if kind in ("image", "document", "search_result", "container_upload"):
        raise RequestError(where, f"is a {kind} block; {TEXT_ONLY}")
    got = short_repr(kind) if isinstance(block, dict) else type(block).__name__
    raise RequestError(where, f"must be one of the block types {', '.join(kinds)}, got {got}")


def _user(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """A user turn: its tool results as ``tool`` messages, then its text (if any) as a user message."""
    results, texts = [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if _block(block, at, ("text", "tool_result")) == "text":
            texts.append(string_field(block, "text", at))
            continue
        text = text_content(block.get("content", ""), f"{at}.content")
        if block.get("is_error"):
            text = "Error: " + text
        results.append({"role": "tool", "tool_call_id": string_field(block, "tool_use_id", at), "content": text})
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def _assistant(blocks: list[Any], where: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _block(block, at, ("text", "tool_use", "thinking", "redacted_thinking"))
        if kind == "text":
            message["content"] += string_field(block, "text", at)
        elif kind == "tool_use":
            if not isinstance(block.get("input"), dict):
                raise RequestError(f"{at}.input", f"must be an object (the call's arguments), got "
                                                  f"{short_repr(block.get('input'))}")
            message.setdefault("tool_calls", []).append({
                "id": string_field(block, "id", at), "type": "function",
                "function": {"name": string_field(block, "name", at),
                             "arguments": json.dumps(block["input"], ensure_ascii=False)}})
    return message


def _thinking(thinking: Any, template_kwargs: Any) -> Any:
    """``chat_template_kwargs`` with ``enable_thinking`` set from ``thinking`` (unless the body's kwargs set it)."""
    if thinking is None:
        return template_kwargs
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "adaptive", "disabled"):
        raise RequestError("thinking", f'must be {{"type": "enabled", "budget_tokens": N}}, {{"type": "adaptive"}} '
                                       f'or {{"type": "disabled"}}, got {short_repr(thinking)}')
    if template_kwargs is None:
        return {"enable_thinking": kind != "disabled"}
    if isinstance(template_kwargs, dict):
        return {"enable_thinking": kind != "disabled", **template_kwargs}
    return template_kwargs  # not an object: the chat parser says so


def _output_format(config: Any) -> dict[str, Any] | None:
    if config is None:
        return None
    if not isinstance(config, dict) or set(config) - {"format", "effort"}:
        raise RequestError("output_config", f'must be {{"format": {{"type": "json_schema", "schema": {{...}}}}}}, '
                                            f"got {short_repr(config)}")
    if config.get("effort") is not None:
        raise RequestError("output_config.effort", "is not supported by llmc (a served model has one effort); "
                                                   "remove it")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise RequestError("output_config.format", f'must be {{"type": "json_schema", "schema": {{...}}}}, got '
                                                   f"{short_repr(fmt)}")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _chat_tools(tools: Any) -> list[dict[str, Any]]:
    """Custom tools -> chat's ``{"type": "function", "function": {"name", "description", "parameters"}}``."""
    if not isinstance(tools, list):
        raise RequestError("tools", f"must be a list of tools, got {short_repr(tools)}")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom" or "input_schema" not in tool:
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise RequestError(f"tools[{i}]", f"is a {short_repr(kind)} tool; {SERVER_TOOLS}")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any, chat: dict[str, Any], count_only: bool) -> None:
    """``tool_choice`` -> chat's ``tool_choice`` and ``parallel_tool_calls`` (set in ``chat``)."""
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind == "tool" and isinstance(choice.get("name"), str):
            chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        elif kind in TOOL_CHOICES:
            chat["tool_choice"] = TOOL_CHOICES[kind]
        else:
            raise RequestError("tool_choice", f'must be {{"type": "auto"}}, {{"type": "any"}}, {{"type": "none"}} '
                                              f'or {{"type": "tool", "name": ...}}, got {short_repr(choice)}')
        if choice.get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
    if count_only and chat.get("tools") and chat.get("tool_choice", "auto") == "auto":
        chat["tool_choice"] = "required"  # counted alike (the tools are in the prompt), with no tool syntax needed


def stop_reason(final: StreamEvent, called: bool, capped: bool) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence``: ``tool_use`` (the answer is calls), ``stop_sequence`` (with
    the string), ``max_tokens``, ``model_context_window_exceeded`` (stopped where ``max_seq_len`` capped the request's
    ``max_tokens``), else ``end_turn``."""
    if called:
        return "tool_use", None
    if final.finish_reason == "length":
        return ("model_context_window_exceeded" if capped else "max_tokens"), None
    if isinstance(final.stop_reason, str):
        return "stop_sequence", final.stop_reason
    return "end_turn", None


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body for an llmc error of HTTP ``status``."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
