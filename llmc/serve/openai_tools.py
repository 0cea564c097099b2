"""OpenAI function calling on ``/v1/chat/completions``: ``tools`` and ``tool_choice``.

``tool_choice`` (pure functions, no HTTP):

- ``"auto"`` (OpenAI's default when tools are given): the model answers in text or calls functions, as it
  chooses; the answer is read in the model's own tool-call syntax (:mod:`llmc.serve.tool_syntax`: the server's
  ``--tool-call-syntax``, by default guessed from the chat template). A server that cannot tell the syntax answers
  ``"auto"`` with a 400 that says how to name it;
- a named function (``{"type": "function", "function": {"name": ...}}``): the answer is that function's arguments,
  constrained to its ``parameters`` schema (structured outputs);
- ``"required"``: the answer is a JSON list of calls ``[{"name": ..., "arguments": {...}}]``, each constrained to
  one of the tools and its schema (one call when ``parallel_tool_calls`` is false);
- ``"none"``: the tools are left out and the model answers in text.

The tools reach the model through its chat template (:class:`~llmc.request.inputs.ChatPrompt`). Calls come back as
``message.tool_calls`` (``id``, ``type: "function"``, ``function.name``, ``function.arguments`` as JSON text) with
``finish_reason: "tool_calls"`` (and, with ``"auto"``, the text the model wrote before them as ``content``); an
answer cut short (``length``), or with ``"auto"`` one that is not calls, comes back as text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmc.errors import RequestError, short_repr
from llmc.serve.tool_syntax import ParsedCalls, ToolSyntax, parse_calls

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
MAX_TOOLS = 128  # OpenAI's limit


@dataclass(frozen=True)
class ToolCalls:
    """A request's tool mode: ``tools`` (as sent), ``name`` (the named function; None: ``"required"`` or
    ``"auto"``), ``parallel`` (``parallel_tool_calls``) and ``syntax`` (``"auto"``: the model's tool-call syntax,
    read from its unconstrained answer; None: the answer is constrained to calls)."""

    tools: tuple[dict, ...]
    name: str | None
    parallel: bool = True
    syntax: ToolSyntax | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t["function"]["name"] for t in self.tools)

    @property
    def output_format(self) -> dict[str, Any] | None:
        """``SamplingParams.structured`` for this mode (None with ``"auto"``: the model may answer in text)."""
        if self.syntax is not None:
            return None
        schemas = {t["function"]["name"]: t["function"].get("parameters") or _EMPTY_PARAMETERS for t in self.tools}
        if self.name is not None:
            return {"type": "json_schema", "schema": schemas[self.name]}
        call = [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                 "required": ["name", "arguments"], "additionalProperties": False} for name, schema in schemas.items()]
        calls: dict[str, Any] = {"type": "array", "items": {"anyOf": call}, "minItems": 1}
        if not self.parallel:
            calls["maxItems"] = 1
        return {"type": "json_schema", "schema": calls}

    def read(self, text: str) -> ParsedCalls | None:
        """A complete answer's calls; None when it is text (``"auto"``) or does not parse."""
        if self.syntax is not None:
            return parse_calls(text, self.syntax, self.names)
        try:
            value = json.loads(text)
        except ValueError:
            return None
        made = [(self.name, value)] if self.name is not None else [(c["name"], c["arguments"]) for c in value]
        return ParsedCalls(None, tuple(made))


def openai_calls(parsed: ParsedCalls) -> list[dict[str, Any]]:
    """OpenAI ``tool_calls`` (each with a fresh id, its arguments as JSON text)."""
    return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
             "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
            for name, arguments in parsed.calls]


def parse_tools(body: Mapping[str, Any], chat: bool, syntax: ToolSyntax | None = None) -> ToolCalls | None:
    """The request's tool mode (None: no tools, or ``tool_choice: "none"``); RequestError naming the field.
    ``syntax``: the served model's tool-call syntax (None: unknown, and ``"auto"`` is refused)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise RequestError("tool_choice", "needs tools; send the functions the model may call in tools")
        return None
    if not chat:
        raise RequestError("tools", "is a field of /v1/chat/completions")
    checked = _check_tools(tools)
    names = [t["function"]["name"] for t in checked]
    if choice == "none":
        return None
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise RequestError("parallel_tool_calls", f"must be true or false, got {parallel!r}")
    if choice is None or choice == "auto":
        if syntax is None:
            raise RequestError("tool_choice", '"auto" (the default with tools) needs the model\'s own tool-call '
                                              'syntax, which this server could not tell from the chat template; '
                                              'start llmc serve with --tool-call-syntax hermes or json, or send '
                                              '"required" or name the function: {"type": "function", "function": '
                                              '{"name": ...}}')
        return ToolCalls(checked, None, parallel, syntax)
    if choice == "required":
        return ToolCalls(checked, None, parallel)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or name not in names:
        raise RequestError("tool_choice", f'must be "auto", "none", "required" or {{"type": "function", "function": '
                                          f'{{"name": one of {names}}}}}, got {short_repr(choice)}')
    return ToolCalls(checked, name, parallel)


def _check_tools(tools: Any) -> tuple[dict, ...]:
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise RequestError("tools", f"must be a list of at most {MAX_TOOLS} function tools")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise RequestError(f"tools[{i}]", 'must be {"type": "function", "function": {"name": ..., '
                                              '"parameters": {...}}}')
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name) or name in seen:
            raise RequestError(f"tools[{i}].function.name", f"must be a distinct name of 1-64 letters, digits, _ "
                                                            f"or -, got {name!r}")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise RequestError(f"tools[{i}].function.parameters", "must be a JSON schema (an object)")
        seen.add(name)
    return tuple(tools)
