"""Tool calls written in a model's own syntax, for chat's ``tool_choice: "auto"`` (pure functions, no HTTP).

With ``"auto"`` the model decides between answering in text and calling functions, so its output is not
constrained: the answer is read afterwards in the syntax its chat template taught it. Two syntaxes cover the
common templates:

- ``hermes``: calls in ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, optionally after some
  text (Qwen2.5, Hermes and the many templates that copied them); the closing tag of the last block may be missing.
- ``json``: the whole answer is one or more JSON calls (``{"name": ..., "arguments" or "parameters": {...}}``, or a
  list of them), separated by ``;`` or white space, optionally after ``<|python_tag|>`` or ``[TOOL_CALLS]``
  (Llama 3.1 - 3.3's JSON tool calls, Mistral's ``[TOOL_CALLS][...]``) -- and what llmc's own system message asks a
  template without tools for (a JSON list of calls, :func:`llmc.request.inputs.tools_instruction`).

:func:`detect_syntax` picks one from the chat template; ``llmc serve --tool-call-syntax`` (recipe
``serving.tool_call_syntax``) names it when the guess is wrong. An answer is calls only when every call parses,
names one of the request's tools and has an object of arguments (a JSON text of one is accepted); anything else is
text, sent as it came. :class:`CallStream` streams the text before a call and holds back the call itself (and any
text that may be the start of one) until the answer ends.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

from llmc.request.inputs import template_takes_tools
from llmc.request.stop import partial_match_length

ToolSyntax = Literal["hermes", "json"]
SYNTAXES: tuple[str, ...] = ("hermes", "json")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
JSON_MARKERS = ("<|python_tag|>", "[TOOL_CALLS]")  # may be left out of the text when skip_special_tokens drops them
_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE) + r"|\Z)", re.DOTALL)


def detect_syntax(template: str) -> ToolSyntax | None:
    """The syntax a chat template teaches its model; None when it takes tools in a way llmc does not know. A
    template without tools gets them in llmc's system message, which asks for JSON calls."""
    if not template_takes_tools(template):
        return "json"
    if HERMES_OPEN in template:
        return "hermes"
    if any(marker in template for marker in JSON_MARKERS) or "[AVAILABLE_TOOLS]" in template:
        return "json"
    return None


def served_syntax(choice: str, chat_template: str | None) -> ToolSyntax | None:
    """The server's syntax: ``choice`` (``serving.tool_call_syntax`` / ``--tool-call-syntax``) when it names one,
    None for ``"none"`` (``tool_choice: "auto"`` refused), else (``"auto"``) :func:`detect_syntax`."""
    if choice == "none":
        return None
    if choice in SYNTAXES:
        return choice  # type: ignore[return-value]
    return detect_syntax(chat_template or "")


@dataclass(frozen=True)
class ParsedCalls:
    """An answer read as calls: ``content`` (the text before them, stripped; None when there is none) and
    ``calls`` as (name, arguments)."""

    content: str | None
    calls: tuple[tuple[str, dict[str, Any]], ...]


def parse_calls(text: str, syntax: ToolSyntax, names: Collection[str]) -> ParsedCalls | None:
    """``text`` (a whole answer) as calls of the tools ``names`` in ``syntax``; None when it is text."""
    if syntax == "hermes":
        start = text.find(HERMES_OPEN)
        if start < 0:
            return None
        blocks, end = [], start
        for match in _HERMES_BLOCK.finditer(text, start):
            if text[end:match.start()].strip():
                return None  # text between two calls: not a run of calls
            blocks.append(match.group(1))
            end = match.end()
        if text[end:].strip():
            return None
        values = [_json(block) for block in blocks]
        calls = _calls(values, names, lists=False)
        return None if calls is None else ParsedCalls(text[:start].strip() or None, calls)
    body = _strip_marker(text.strip())
    if not body.startswith(("{", "[")):
        return None
    calls = _calls(_json_values(body), names, lists=True)
    return None if calls is None else ParsedCalls(None, calls)


class CallStream:
    """Streams an answer's text while holding back what is or may become a call: :meth:`feed` returns the text
    that can go out now; :meth:`finish` reads the whole answer and returns the text still held (all of it when
    the answer is not calls) and the calls (None: it is text)."""

    def __init__(self, syntax: ToolSyntax, names: Collection[str]):
        self.syntax, self.names = syntax, names
        self.text = ""
        self.sent = 0  # characters of text released
        self.holding = False  # a call has started: everything from there waits for the end

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.holding:
            return ""
        if self.syntax == "hermes":
            start = self.text.find(HERMES_OPEN, self.sent)
            if start >= 0:
                self.holding = True
                return self._release(start)
            return self._release(len(self.text) - partial_match_length(self.text, (HERMES_OPEN,)))
        if self.sent == 0:  # calls make up a whole answer: its start decides
            head = self.text.lstrip()
            if not head or any(marker.startswith(head) for marker in JSON_MARKERS):
                return ""  # white space or the start of a marker so far
            rest = _strip_marker(head)
            if not rest:
                return ""  # a marker and white space so far
            if rest.startswith(("{", "[")):
                self.holding = True
                return ""
        return self._release(len(self.text))

    def finish(self, complete: bool) -> tuple[str, ParsedCalls | None]:
        """``complete``: the answer ended by itself (not cut short), the only way it can be calls."""
        parsed = parse_calls(self.text, self.syntax, self.names) if complete else None
        if parsed is not None:
            return "", parsed
        return self._release(len(self.text)), None

    def _release(self, upto: int) -> str:
        out, self.sent = self.text[self.sent:upto], max(self.sent, upto)
        return out


def _strip_marker(text: str) -> str:
    for marker in JSON_MARKERS:
        if text.startswith(marker):
            return text[len(marker):].lstrip()
    return text


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _json_values(text: str) -> list[Any]:
    """The JSON values of ``text``, one after another, separated by ``;`` or white space ([None] when a part does
    not parse)."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return [None]
        values.append(value)
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
    return values


def _calls(values: list[Any], names: Collection[str], lists: bool) -> tuple[tuple[str, dict[str, Any]], ...] | None:
    """Every value as a call (a list's items too with ``lists``); None unless each is a call of a known tool."""
    flat = [item for v in values for item in (v if lists and isinstance(v, list) else [v])]
    calls = [_call(item, names) for item in flat]
    if not calls or any(c is None for c in calls):
        return None
    return tuple(c for c in calls if c is not None)


def _call(value: Any, names: Collection[str]) -> tuple[str, dict[str, Any]] | None:
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text, as OpenAI sends them
        arguments = _json(arguments)
    return (value["name"], arguments) if isinstance(arguments, dict) else None
