"""OpenAI's Responses API body -> llmc's chat request (:mod:`llmc.serve.openai_responses`): input items become the
chat messages the template sees, Responses fields map onto sampling, output formats, tools and log-probabilities,
and every error names the Responses field (never chat's name for it)."""

from __future__ import annotations

import pytest

from llmc.errors import RequestError, UnknownModelError
from llmc.request.inputs import ChatPrompt
from llmc.request.params import SamplingParams
from llmc.request.structured import OutputFormat
from llmc.serve.openai_responses import input_messages, parse_responses_request

SERVED = ("tiny", "ensemble")
DEFAULTS = SamplingParams(max_new_tokens=16, temperature=0.0)
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def parse(body, syntax=None):
    return parse_responses_request(body, SERVED, DEFAULTS, 1000, syntax)


def test_input_items_become_the_chat_messages_a_template_sees():
    assert input_messages("Hi") == [{"role": "user", "content": "Hi"}]
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                             {"type": "input_text", "text": "in Paris?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
             {"type": "function_call", "call_id": "call_3", "name": "get_weather", "arguments": "{}"}]
    call = lambda k, city: {"id": f"call_{k}", "type": "function",  # noqa: E731
                            "function": {"name": "get_weather", "arguments": city}}
    assert input_messages(items) == [
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.",  # the calls after an assistant's text are that message's
         "tool_calls": [call(1, '{"city": "Paris"}'), call(2, '{"city": "Oslo"}')]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        {"role": "assistant", "content": None, "tool_calls": [call(3, "{}")]}]


def test_fields_map_onto_the_chat_request():
    req = parse({"model": "tiny", "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 5,
                 "temperature": 0.7, "top_p": 0.5, "seed": 3, "stop": ["\n"], "stream": True, "store": True,
                 "metadata": {"k": "v"}, "user": "u", "truncation": "disabled", "reasoning": {}})
    chat = req.chat
    assert chat.prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    p = chat.params
    assert (p.max_new_tokens, p.temperature, p.top_p, p.seed, p.stop) == (5, 0.7, 0.5, 3, ("\n",))
    assert chat.stream and p.logprobs is None and p.structured is None and chat.tools is None
    assert (req.instructions, req.max_output_tokens, req.metadata, req.user) == ("Be brief.", 5, {"k": "v"}, "u")
    assert req.text == {"format": {"type": "text"}} and req.tool_choice == "none" and req.tools == []
    assert chat.names["max_new_tokens"] == "max_output_tokens" and chat.names["prompt"] == "input"
    default = parse({"input": "Hi"})
    assert default.chat.model == "tiny" and default.chat.params.max_new_tokens == 16


def test_text_format_tools_and_logprobs():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    req = parse({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "n", "schema": schema,
                                                    "strict": True}}})
    assert req.chat.params.structured == OutputFormat.from_dict({"type": "json_schema", "schema": schema})
    assert req.chat.names["structured"] == "text.format" and req.text["format"]["name"] == "n"
    assert parse({"input": "Hi", "text": {"format": {"type": "json_object"}}}).chat.params.structured == OutputFormat(
        "json_object")
    named = parse({"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}})
    assert named.chat.tools.name == "get_weather" and named.chat.params.structured == OutputFormat.from_dict(
        {"type": "json_schema", "schema": WEATHER["parameters"]})
    assert isinstance(named.chat.prompt, ChatPrompt) and named.chat.prompt.tools[0]["function"] == {
        k: WEATHER[k] for k in ("name", "description", "parameters")}
    auto = parse({"input": "Hi", "tools": [WEATHER], "parallel_tool_calls": False}, syntax="hermes")
    assert auto.chat.tools.syntax == "hermes" and not auto.chat.tools.parallel and auto.tool_choice == "auto"
    assert not auto.parallel_tool_calls
    assert parse({"input": "Hi", "tools": [WEATHER], "tool_choice": "none"}).chat.tools is None
    assert parse({"input": "Hi", "top_logprobs": 3}).chat.params.logprobs == 3
    assert parse({"input": "Hi", "include": ["message.output_text.logprobs"]}).chat.params.logprobs == 0
    assert parse({"input": "Hi", "include": []}).chat.params.logprobs is None
    stateless = parse({"input": "Hi", "include": ["reasoning.encrypted_content"], "store": False})  # Codex sends it
    assert stateless.chat.params.logprobs is None


@pytest.mark.parametrize("body, field, words", [
    ({"input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id", "llmc keeps no responses"),
    ({"input": "Hi", "conversation": "conv_1"}, "conversation", "send the whole conversation in input"),
    ({"input": "Hi", "background": True}, "background", "llmc keeps no responses"),
    ({"input": "Hi", "reasoning": {"effort": "low"}}, "reasoning", "not supported"),
    ({"input": "Hi", "truncation": "auto"}, "truncation", "not supported"),
    ({"input": "Hi", "max_tokens": 5}, "max_tokens", "use 'max_output_tokens'"),
    ({"input": "Hi", "n": 2}, "n", "returns one answer"),
    ({"input": "Hi", "max_output_tokns": 5}, "max_output_tokns", "unknown field"),
    ({}, "input", "must be a string or a non-empty list"),
    ({"input": []}, "input", "non-empty list"),
    ({"input": [{"role": "bot", "content": "x"}]}, "input[0].role", "must be one of user"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]",
     "llmc serves text only"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "llmc keeps no responses"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id", "must be a string"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "input[0].output", "string"),
    ({"input": "Hi", "instructions": ["x"]}, "instructions", "must be a string"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens", "must be >= 1"),
    ({"input": "Hi", "temperature": -1}, "temperature", "must be >= 0"),
    ({"input": "Hi", "text": {"format": {"type": "xml"}}}, "text.format", "json_schema"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema", "JSON schema"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0]", "llmc runs no hosted tools"),
    ({"input": "Hi", "tools": [{**WEATHER, "name": "a b"}]}, "tools[0].name", "distinct name"),
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
     "one of ['get_weather']"),
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "allowed_tools"}}, "tool_choice", '"required"'),
    ({"input": "Hi", "tools": [WEATHER]}, "tool_choice", "--tool-call-syntax"),
    ({"input": "Hi", "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ({"input": "Hi", "include": ["message.logprobs"]}, "include", "message.output_text.logprobs"),
    ({"input": "Hi", "context_management": [{"type": "compaction"}]}, "context_management", "not supported"),
])
def test_errors_name_the_responses_field(body, field, words):
    with pytest.raises(RequestError) as info:
        parse(body)
    assert info.value.field == field and words in info.value.message, info.value


def test_an_unknown_model_is_a_404_error():
    with pytest.raises(UnknownModelError, match="unknown model 'gpt-4o'"):
        parse({"model": "gpt-4o", "input": "Hi"})
