"""OpenAI function calling on ``/v1/chat/completions``, by structured outputs: ``tools`` and ``tool_choice``.

``tool_choice`` (pure functions, no HTTP):

- a named function (``{"type": "function", "function": {"name": ...}}``): the answer is that function's arguments,
  constrained to its ``parameters`` schema;
- ``"required"``: the answer is a JSON list of calls ``[{"name": ..., "arguments": {...}}]``, each constrained to
  one of the tools and its schema (one call when ``parallel_tool_calls`` is false);
- ``"none"``: the tools are left out and the model answers in text;
- ``"auto"`` (OpenAI's default when tools are given) is a 400: choosing between text and a call needs the model's
  own tool-call syntax, which llmc does not parse; name the function or send ``"required"``.

The tools reach the model through its chat template (:class:`~llmc.request.inputs.ChatPrompt`). A complete answer
comes back as ``message.tool_calls`` (``id``, ``type: "function"``, ``function.name``, ``function.arguments`` as JSON
text) with ``finish_reason: "tool_calls"`` and no content; an answer cut short (``length``) comes back as text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmc.errors import RequestError, short_repr

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
MAX_TOOLS = 128  # OpenAI's limit


@dataclass(frozen=True)
class ToolCalls:
    """A request's tool mode: ``tools`` (as sent), ``name`` (the named function; None: ``"required"``) and the
    output format that makes the model's answer a call."""

    tools: tuple[dict, ...]
    name: str | None
    parallel: bool = True

    @property
    def output_format(self) -> dict[str, Any]:
        """``SamplingParams.structured`` for this mode."""
        schemas = {t["function"]["name"]: t["function"].get("parameters") or _EMPTY_PARAMETERS for t in self.tools}
        if self.name is not None:
            return {"type": "json_schema", "schema": schemas[self.name]}
        call = [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                 "required": ["name", "arguments"], "additionalProperties": False} for name, schema in schemas.items()]
        calls: dict[str, Any] = {"type": "array", "items": {"anyOf": call}, "minItems": 1}
        if not self.parallel:
            calls["maxItems"] = 1
        return {"type": "json_schema", "schema": calls}

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """OpenAI ``tool_calls`` from a complete answer's text; None when it does not parse (cut short)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        made = [(self.name, value)] if self.name is not None else [(c["name"], c["arguments"]) for c in value]
        return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                 "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
                for name, arguments in made]


def parse_tools(body: Mapping[str, Any], chat: bool) -> ToolCalls | None:
    """The request's tool mode (None: no tools, or ``tool_choice: "none"``); RequestError naming the field."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise RequestError("tool_choice", "needs tools; send the functions the model may call in tools")
        return None
    if not chat:
        raise RequestError("tools", "is a field of /v1/chat/completions")
    checked = _check_tools(tools)
    names = [t["function"]["name"] for t in checked]
    if choice is None or choice == "auto":
        raise RequestError("tool_choice", '"auto" (the default with tools) needs the model\'s own tool-call syntax, '
                                          'which llmc does not parse; send "required" or name the function: '
                                          '{"type": "function", "function": {"name": ...}}')
    if choice == "none":
        return None
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise RequestError("parallel_tool_calls", f"must be true or false, got {parallel!r}")
    if choice == "required":
        return ToolCalls(checked, None, parallel)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or name not in names:
        raise RequestError("tool_choice", f'must be "none", "required" or {{"type": "function", "function": '
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
