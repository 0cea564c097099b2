"""Tool calls in a model's own syntax (tool_choice "auto"): the syntax a chat template teaches, answers read as calls
or as text, and the stream that sends the text before a call while holding the call, split at every position."""

from __future__ import annotations

import pytest

from llmc.serve.tool_syntax import CallStream, ParsedCalls, detect_syntax, parse_calls, served_syntax

NAMES = ("get_weather", "get_time")
PARIS = ("get_weather", {"city": "Paris", "days": 2})
UTC = ("get_time", {"zone": "UTC"})

# The parts of real templates that decide (whole templates are long; these are their tool-call instructions).
HERMES_TEMPLATE = ("{% if tools %}You may call functions. For each call return a json object within "
                   "<tool_call></tool_call> XML tags.{% for tool in tools %}{{ tool | tojson }}{% endfor %}{% endif %}")
LLAMA3_TEMPLATE = ("{%- if tools is not none %}Respond in the format {\"name\": function name, \"parameters\": "
                   "dictionary of argument name and its value}.{%- endif %}{{- '<|python_tag|>' + tool_call.name }}")
MISTRAL_TEMPLATE = "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]"
NO_TOOLS_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
UNKNOWN_TEMPLATE = "{% for t in tools %}FUNCTION {{ t.function.name }}{% endfor %}{{ messages[0].content }}"


@pytest.mark.parametrize("template, syntax", [
    (HERMES_TEMPLATE, "hermes"), (LLAMA3_TEMPLATE, "json"), (MISTRAL_TEMPLATE, "json"),
    (NO_TOOLS_TEMPLATE, "json"), (UNKNOWN_TEMPLATE, None),
])
def test_the_syntax_a_template_teaches(template, syntax):
    assert detect_syntax(template) == syntax
    assert served_syntax("auto", template) == syntax
    assert served_syntax("hermes", template) == "hermes" and served_syntax("json", template) == "json"
    assert served_syntax("none", template) is None


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>', None, [PARIS]),
    ('Let me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>\n'
     '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>',
     "Let me look.", [PARIS, UTC]),
    ('<tool_call>{"name": "get_time", "parameters": {"zone": "UTC"}}', None, [UTC]),  # last closing tag left out
    ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call> and more text', None, None),
    ('<tool_call>{"name": "a"}</tool_call>x<tool_call>{"name": "get_time"}</tool_call>', None, None),
    ('<tool_call>{"name": "get_news", "arguments": {}}</tool_call>', None, None),  # not one of the tools
    ('<tool_call>{"name": "get_time", "arguments": {"zone": </tool_call>', None, None),  # broken JSON
    ('<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>', None, None),  # arguments not an object
    ("The weather in Paris is sunny.", None, None),
])
def test_hermes_answers(text, content, calls):
    parsed = parse_calls(text, "hermes", NAMES)
    assert parsed == (None if calls is None else ParsedCalls(content, tuple(calls)))


@pytest.mark.parametrize("text, calls", [
    ('[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]', [PARIS]),  # llmc's system message
    ('  {"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', [PARIS]),  # Llama 3.x
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
     '{"name": "get_time", "parameters": {"zone": "UTC"}}', [PARIS, UTC]),
    ('[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}, '
     '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]', [UTC, PARIS]),  # Mistral
    ('{"name": "get_time", "arguments": {"zone": "UTC"}} Done.', None),  # text after the calls
    ("[1, 2, 3]", None), ('{"city": "Paris"}', None), ("[]", None),
    ("Sure: [{\"name\": \"get_time\", \"arguments\": {}}]", None),  # calls make up a whole answer
    ("Paris.", None),
])
def test_json_answers(text, calls):
    parsed = parse_calls(text, "json", NAMES)
    assert parsed == (None if calls is None else ParsedCalls(None, tuple(calls)))


def _stream(syntax: str, pieces: list[str], complete: bool = True) -> tuple[list[str], str, ParsedCalls | None]:
    stream = CallStream(syntax, NAMES)
    sent = [stream.feed(piece) for piece in pieces]
    rest, parsed = stream.finish(complete)
    return sent, rest, parsed


HERMES_ANSWER = 'Checking.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
TEXT_ANSWER = "The <tool is broken; [1] says {so}. <tool_call"  # ends in a marker's start: still text


@pytest.mark.parametrize("syntax, answer", [
    ("hermes", HERMES_ANSWER), ("hermes", TEXT_ANSWER),
    ("json", '\n <|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}'), ("json", TEXT_ANSWER),
    ("json", "<|eot|> is not a marker"), ("json", "  [1] Paris"),
])
def test_a_stream_split_anywhere_sends_the_text_and_holds_the_call(syntax, answer):
    """Every split of the answer into two and into single characters: the text sent is the text before the call
    (all of the answer when it is text), never a piece of the call, and the calls equal the whole answer's."""
    whole = parse_calls(answer, syntax, NAMES)
    text_before = answer if whole is None else answer[:answer.find("<tool_call>")] if syntax == "hermes" else ""
    splits = [[answer[:k], answer[k:]] for k in range(len(answer) + 1)] + [list(answer)]
    for pieces in splits:
        sent, rest, parsed = _stream(syntax, pieces)
        assert "".join(sent) + rest == text_before and parsed == whole, pieces
        if whole is not None:
            assert "".join(sent) == text_before and "{" not in "".join(sent)


def test_a_stream_sends_text_as_it_comes_and_holds_only_a_possible_marker():
    sent, rest, parsed = _stream("hermes", ["Sure", ", let me <too", "l_c", "all>{\"name\": \"get_time\", ",
                                            '"arguments": {"zone": "UTC"}}</tool_call>'])
    assert sent == ["Sure", ", let me ", "", "", ""] and rest == "" and parsed == ParsedCalls("Sure, let me", (UTC,))
    sent, rest, parsed = _stream("json", [" ", "Paris", " is", " sunny"])
    assert sent == ["", " Paris", " is", " sunny"] and rest == "" and parsed is None
    sent, rest, parsed = _stream("json", ["[", '{"name": "get_time",', ' "arguments": {"zone": "UTC"}}]'])
    assert sent == ["", "", ""] and rest == "" and parsed == ParsedCalls(None, (UTC,))


def test_an_answer_cut_short_is_text_even_when_its_calls_parse():
    sent, rest, parsed = _stream("json", ['{"name": "get_time", "arguments": {"zone": "UTC"}}'], complete=False)
    assert parsed is None and "".join(sent) + rest == '{"name": "get_time", "arguments": {"zone": "UTC"}}'
