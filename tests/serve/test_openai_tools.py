"""Function calling on ``/v1/chat/completions`` (``tools`` + ``tool_choice``) by structured outputs: the modes and
their errors, the calls parsed from an answer, how tools reach a chat template with and without tool support, and
the whole route through OpenAI's own client (answers equal the offline engine's, streams equal whole answers)."""

from __future__ import annotations

import json

import pytest

from llmc.errors import RequestError
from llmc.request.inputs import ChatPrompt, chat_to_token_ids, tools_instruction
from llmc.request.params import SamplingParams
from llmc.serve.openai_tools import ToolCalls, openai_calls, parse_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
USER = [{"role": "user", "content": "What is the weather in Paris for 2 days?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_tool_choice_modes_and_their_formats():
    named = parse_tools({"tools": [WEATHER, TIME], "tool_choice": NAMED}, chat=True)
    assert named.name == "get_weather" and named.output_format == {"type": "json_schema",
                                                                   "schema": WEATHER["function"]["parameters"]}
    required = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"}, chat=True)
    schema = required.output_format["schema"]
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]] == ["get_weather", "get_time"]
    single = parse_tools({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}, chat=True)
    assert single.output_format["schema"]["maxItems"] == 1
    assert parse_tools({"tools": [WEATHER], "tool_choice": "none"}, chat=True) is None
    for body in ({"tools": [WEATHER, TIME]}, {"tools": [WEATHER, TIME], "tool_choice": "auto"}):
        auto = parse_tools(body, chat=True, syntax="json")
        assert auto.syntax == "json" and auto.name is None and auto.names == ("get_weather", "get_time")
    assert parse_tools({}, chat=True) is None and parse_tools({"tools": []}, chat=True) is None


@pytest.mark.parametrize("body, field, words", [
    ({"tools": [WEATHER]}, "tool_choice", '"auto" (the default with tools) needs the model\'s own tool-call syntax'),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", 'send "required" or name the function'),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "one of ['get_weather']"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools[0]", '{"type": "function"'),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools[1].function.name", "distinct name"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "required"},
     "tools[0].function.name", "letters, digits"),
    ({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": "yes"}, "parallel_tool_calls",
     "true or false"),
])
def test_bad_tool_requests_name_the_field(body, field, words):
    with pytest.raises(RequestError) as info:
        parse_tools(body, chat=True)
    assert info.value.field == field and words in info.value.message


def test_calls_are_parsed_from_a_complete_answer():
    named = ToolCalls((WEATHER,), "get_weather")
    (call,) = openai_calls(named.read('{"city":"Oslo","days":3}'))
    assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) == 29
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 3}'}
    both = openai_calls(ToolCalls((WEATHER, TIME), None).read('[{"name":"get_time","arguments":{"zone":"UTC"}},'
                                                              '{"name":"get_weather","arguments":{"city":"Paris",'
                                                              '"days":1}}]'))
    assert [c["function"]["name"] for c in both] == ["get_time", "get_weather"] and both[0]["id"] != both[1]["id"]
    assert named.read('{"city":"Os') is None  # cut short: no call
    auto = ToolCalls((WEATHER, TIME), None, True, "hermes")  # "auto": the model's own syntax, not constrained
    assert auto.output_format is None and auto.read("Sunny.") is None
    parsed = auto.read('Wait.<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>')
    assert parsed.content == "Wait." and parsed.calls == (("get_time", {"zone": "UTC"}),)


def test_tools_reach_a_template_without_tool_support_as_a_system_message(tokenizer):
    history = [*USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    text = tokenizer.decode(chat_to_token_ids(tokenizer, history, tools=(WEATHER,)))
    assert text.startswith("<|im_start|>system\n" + tools_instruction((WEATHER,)))
    assert '[{"name": "get_weather", "arguments": {"city": "Paris"}}]' in text and "<|im_start|>tool\nsunny" in text
    with_system = tokenizer.decode(chat_to_token_ids(tokenizer, [{"role": "system", "content": "Be brief."}, *USER],
                                                     tools=(WEATHER,)))
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\nYou can call these functions")


def test_a_template_with_tool_support_gets_the_tools_and_calls_as_they_are(tokenizer):
    import copy

    aware = copy.copy(tokenizer)
    aware.chat_template = ("{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}{% for m in messages %}"
                           "{{ m.role }}: {{ m.content }}{% if m.tool_calls %}CALLS {{ m.tool_calls[0].function.name }}"
                           "{% endif %}\n{% endfor %}")
    history = [*USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}]
    text = aware.decode(chat_to_token_ids(aware, history, tools=(WEATHER, TIME)))
    assert text.startswith("TOOL get_weather\nTOOL get_time\nuser: What is") and "assistant: CALLS get_time" in text
    assert "You can call these functions" not in text


@pytest.fixture(scope="module")
def tokenizer(smollm2_hf_dir):
    from llmc.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_hf_dir)


def test_a_named_function_call_through_the_client_equals_the_offline_engine(client, tiny_server, offline):
    reply = client.chat.completions.create(model=tiny_server.model, messages=USER, tools=[WEATHER, TIME],
                                           tool_choice=NAMED, max_tokens=40, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and arguments["city"] in ("Paris", "Oslo")
    assert set(arguments) == {"city", "days"} and type(arguments["days"]) is int
    want = offline.generate([ChatPrompt(tuple(USER), (WEATHER, TIME))], SamplingParams(
        max_new_tokens=40, temperature=0.0, structured={"type": "json_schema",
                                                        "schema": WEATHER["function"]["parameters"]}))[0]
    assert json.loads(want.text) == arguments
    stream = client.chat.completions.create(model=tiny_server.model, messages=USER, tools=[WEATHER, TIME],
                                            tool_choice=NAMED, max_tokens=40, temperature=0, stream=True)
    chunks = [c for c in stream if c.choices]
    streamed = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert len(streamed) == 1 and streamed[0].function.name == "get_weather" and streamed[0].index == 0
    assert json.loads(streamed[0].function.arguments) == arguments and chunks[-1].choices[0].finish_reason == \
        "tool_calls"
    assert all(not c.choices[0].delta.content for c in chunks)


def test_required_calls_name_a_tool_each_and_a_cut_short_answer_is_text(client, tiny_server):
    reply = client.chat.completions.create(model=tiny_server.model, messages=USER, tools=[WEATHER, TIME],
                                           tool_choice="required", parallel_tool_calls=False, max_tokens=60,
                                           temperature=0.7, seed=4, n=3)
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        assert call.function.name in ("get_weather", "get_time") and isinstance(json.loads(call.function.arguments),
                                                                               dict)
    short = client.chat.completions.create(model=tiny_server.model, messages=USER, tools=[WEATHER],
                                           tool_choice=NAMED, max_tokens=2, temperature=0)
    assert short.choices[0].finish_reason == "length" and short.choices[0].message.tool_calls is None
    assert short.choices[0].message.content.startswith("{")


def test_a_conversation_with_earlier_calls_and_results_is_answered(client, tiny_server):
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"}]
    reply = client.chat.completions.create(model=tiny_server.model, messages=history, tools=[WEATHER],
                                           tool_choice="none", max_tokens=4, temperature=0)
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.tool_calls is None
