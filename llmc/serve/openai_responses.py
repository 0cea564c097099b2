"""OpenAI's Responses API request (``POST /v1/responses``) -> the chat request llmc runs (pure functions, no HTTP).

A Responses body is translated into a ``/v1/chat/completions`` body and parsed by
:func:`~llmc.serve.openai_protocol.parse_openai_request`, so both endpoints share sampling, structured outputs,
function calling, the chat template and every limit:

- ``input``: a string (one user message) or a list of items: messages (``role`` user, system, developer or
  assistant; ``content`` a string or ``input_text`` / ``output_text`` parts), ``function_call`` items (joined to the
  assistant message before them, as that message's ``tool_calls``) and ``function_call_output`` items (``tool``
  messages); ``reasoning`` items are left out, as chat templates drop earlier thinking. ``instructions`` is a
  system message before them.
- ``max_output_tokens`` -> ``max_tokens``; ``text.format`` (``text``, ``json_object``, ``json_schema`` with
  ``name`` and ``schema``) -> ``response_format``; ``tools`` (function tools, ``{"type": "function", "name",
  "parameters"}``) and ``tool_choice`` (``{"type": "function", "name"}`` names one) -> chat's; ``top_logprobs``
  or ``include: ["message.output_text.logprobs"]`` -> ``logprobs`` (``include``'s other names ask for hosted-tool
  results, images or encrypted reasoning, which llmc never makes: accepted, nothing added).
- llmc's sampling extras (``seed``, ``stop``, ``top_k``, ...) pass through as on chat.

llmc keeps no responses: ``previous_response_id``, ``conversation`` and ``background`` are refused with the fix
(send the whole conversation in ``input``), and a response says ``"store": false``. Hosted tools (web search, file
search, ...), non-text input and ``reasoning`` settings are refused too; every error names the Responses field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from llmc.errors import RequestError, short_repr
from llmc.request.params import SamplingParams
from llmc.serve.openai_protocol import (PARAM_MAP, OpenAIRequest, check_unsupported, parse_openai_request,
                                        string_field, text_content)
from llmc.serve.protocol import with_client_names
from llmc.serve.tool_syntax import ToolSyntax

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# include's other values ask for data of hosted tools, images or encrypted reasoning, which llmc never makes:
# accepted (Codex and the Agents SDK send "reasoning.encrypted_content" with every stateless request), none added
INCLUDE_NOTHING = ("reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
                   "web_search_call.action.sources", "message.input_image.image_url",
                   "computer_call_output.output.image_url", "code_interpreter_call.outputs")
# llmc's sampling fields a Responses body may carry too (OpenAI's own take no other names here)
EXTRAS = tuple(k for k in PARAM_MAP if k not in ("max_tokens", "max_completion_tokens", "temperature", "top_p")) + (
    "strict_max_tokens", "chat_template_kwargs", "structured", "logit_bias")
OWN_FIELDS = ("model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "text",
              "tools", "tool_choice", "parallel_tool_calls", "top_logprobs", "include")
IGNORED = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "prompt_cache_retention",
           "prompt_cache_options", "safety_identifier", "stream_options")
# Features llmc cannot honour -> the values besides null that ask for none of it.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "previous_response_id": (), "conversation": (), "background": (False,), "prompt": (), "reasoning": ({},),
    "truncation": ("disabled",), "max_tool_calls": (), "context_management": ([],), "moderation": ()}
STATELESS = "llmc keeps no responses; send the whole conversation in input (earlier output items included)"
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
# Chat's field names in errors raised by the chat parser -> this API's
CLIENT_NAMES = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format",
                "logprobs": "top_logprobs"}


@dataclass(frozen=True)
class ResponsesRequest:
    """A parsed Responses request: the chat request llmc runs, and what the response object repeats back."""

    chat: OpenAIRequest
    instructions: str | None
    max_output_tokens: int | None
    text: dict[str, Any]
    tools: list[Any]
    tool_choice: Any
    parallel_tool_calls: bool
    top_logprobs: int | None
    metadata: Any = None
    user: Any = None


def parse_responses_request(body: Mapping[str, Any], served: tuple[str, ...], defaults: SamplingParams,
                            vocab_size: int | None = None, tool_syntax: ToolSyntax | None = None) -> ResponsesRequest:
    """Check and translate a Responses body; RequestError names the Responses field for every problem."""
    _check_fields(body)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError("instructions", f"must be a string (the system message), got {short_repr(instructions)}")
    messages = input_messages(body.get("input"))
    if instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    chat = {"model": body.get("model"), "messages": messages, "stream": body.get("stream"),
            "max_tokens": body.get("max_output_tokens"), "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), **{k: body[k] for k in EXTRAS if k in body}}
    text = _text_config(body.get("text"))
    if text["format"] != {"type": "text"}:
        chat["response_format"] = _response_format(text["format"])
    tools = body.get("tools") or []
    if tools:
        chat["tools"] = _chat_tools(tools)
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    top = _top_logprobs(body)
    if top is not None:
        chat.update(logprobs=True, top_logprobs=top)
    try:
        req = parse_openai_request({k: v for k, v in chat.items() if v is not None}, True, served, defaults,
                                   vocab_size, tool_syntax)
    except RequestError as exc:  # in this API's names; chat's tools[i].function.name is tools[i].name here
        renamed = with_client_names(exc, CLIENT_NAMES)
        where = renamed.field.replace(".function.", ".", 1) if renamed.field.startswith("tools[") else renamed.field
        raise type(exc)(where, renamed.message) from None
    names = {internal: CLIENT_NAMES.get(name, name) for internal, name in req.names.items()}
    return ResponsesRequest(replace(req, names=names), instructions, body.get("max_output_tokens"), text, tools,
                            body.get("tool_choice") or ("auto" if tools else "none"),
                            body.get("parallel_tool_calls", True) is not False, top, body.get("metadata"),
                            body.get("user"))


def _check_fields(body: Mapping[str, Any]) -> None:
    known = (*OWN_FIELDS, *EXTRAS, *IGNORED, *UNSUPPORTED)
    for key in body:
        if key not in known:
            hint = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens":
                    "max_output_tokens", "response_format": "text.format", "logprobs": "top_logprobs", "n": None}
            if key in hint:
                fix = f"use {hint[key]!r}" if hint[key] else "the Responses API returns one answer; send n requests"
                raise RequestError(key, f"is a chat-completions field; {fix}")
            raise RequestError(key, f"unknown field; the accepted fields are: {', '.join(sorted(known))}")
    check_unsupported(body, UNSUPPORTED, {key: STATELESS for key in ("previous_response_id", "conversation",
                                                                    "background", "prompt")})


def input_messages(items: Any) -> list[dict[str, Any]]:
    """``input`` -> chat messages (see the module docstring); RequestError naming ``input[i]...``."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise RequestError("input", "must be a string or a non-empty list of input items (messages, function_call "
                                    "and function_call_output items)")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and isinstance(item, dict) and "role" in item:
            role = item["role"]
            if role not in MESSAGE_ROLES:
                raise RequestError(f"{where}.role", f"must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}")
            text = text_content(item.get("content"), f"{where}.content", TEXT_PARTS)
            messages.append({"role": role, "content": text})
        elif kind == "function_call":
            call = {"id": string_field(item, "call_id", where), "type": "function",
                    "function": {"name": string_field(item, "name", where),
                                 "arguments": string_field(item, "arguments", where)}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": string_field(item, "call_id", where),
                             "content": text_content(item.get("output"), f"{where}.output", TEXT_PARTS)})
        elif kind != "reasoning":
            got = short_repr(kind) if isinstance(item, dict) else type(item).__name__
            fix = f"; {STATELESS}" if kind == "item_reference" else ""
            raise RequestError(where, f"must be a message ({{\"role\", \"content\"}}), function_call, "
                                      f"function_call_output or reasoning item, got {got}{fix}")
    return messages


def _text_config(text: Any) -> dict[str, Any]:
    """``text`` with its ``format`` filled in (``{"type": "text"}`` when absent)."""
    if text is None:
        return {"format": {"type": "text"}}
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise RequestError("text", f'must be {{"format": {{...}}}}, got {short_repr(text)}')
    fmt = text.get("format") or {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise RequestError("text.format", f'must be {{"type": "text"}}, {{"type": "json_object"}} or {{"type": '
                                          f'"json_schema", "name": ..., "schema": {{...}}}}, got {short_repr(fmt)}')
    return {**text, "format": fmt}


def _response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    if not isinstance(fmt.get("schema"), (dict, bool)):
        raise RequestError("text.format.schema", f"must be a JSON schema (an object), got "
                                                 f"{short_repr(fmt.get('schema'))}")
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "response"), "schema": fmt["schema"]}}


def _chat_tools(tools: Any) -> list[dict[str, Any]]:
    """Responses' flat function tools -> chat's ``{"type": "function", "function": {...}}``."""
    if not isinstance(tools, list):
        raise RequestError("tools", f"must be a list of function tools, got {short_repr(tools)}")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise RequestError(f"tools[{i}]", f'must be {{"type": "function", "name": ..., "parameters": {{...}}}}, '
                                              f'got {short_repr(kind)}; llmc runs no hosted tools')
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                                      if tool.get(k) is not None}})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    if choice in ("auto", "none", "required"):
        return choice
    raise RequestError("tool_choice", f'must be "auto", "none", "required" or {{"type": "function", "name": ...}}, '
                                      f'got {short_repr(choice)}')


def _top_logprobs(body: Mapping[str, Any]) -> int | None:
    """The alternatives per token when log-probabilities are asked for (``include`` names them, or
    ``top_logprobs`` is set); None when they are not."""
    include = body.get("include") or []
    if not isinstance(include, list) or any(name not in (LOGPROBS_INCLUDE, *INCLUDE_NOTHING) for name in include):
        raise RequestError("include", f'must be a list of OpenAI\'s includable names ("{LOGPROBS_INCLUDE}", '
                                      f'"reasoning.encrypted_content", ...), got {short_repr(include)}')
    top = body.get("top_logprobs")
    if top is None:
        return 0 if LOGPROBS_INCLUDE in include else None
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
        raise RequestError("top_logprobs", f"must be an integer in [0, 20], got {short_repr(top)}")
    return top
