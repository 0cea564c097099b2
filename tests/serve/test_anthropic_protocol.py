"""Anthropic's Messages API bodies -> llmc's chat request (pure): content blocks, tools, prefill, thinking, structured
outputs, stop reasons, and errors that name the Messages field."""

from __future__ import annotations

import json

import pytest

from llmc.errors import RequestError, UnknownModelError
from llmc.request.inputs import ChatPrompt
from llmc.request.outputs import StreamEvent
from llmc.request.params import SamplingParams
from llmc.serve.anthropic_protocol import anthropic_error, parse_messages_request, stop_reason

SERVED = ("tiny", "ensemble")
WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = {"role": "user", "content": "Weather in Paris?"}


def parse(body: dict, **kw):
    return parse_messages_request({"max_tokens": 8, **body}, SERVED, SamplingParams(temperature=0.0), 1000,
                                  "json", **kw)


def messages_of(parsed) -> list[dict]:
    prompt = parsed.chat.prompt
    return list(prompt.messages if isinstance(prompt, ChatPrompt) else prompt)


def test_sampling_fields_and_system():
    parsed = parse({"model": "tiny", "system": [{"type": "text", "text": "Be brief."}], "messages": [ASK],
                    "max_tokens": 20, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "stop_sequences": ["\n\n"],
                    "seed": 3, "metadata": {"user_id": "u1"}})
    params = parsed.chat.params
    assert (params.max_new_tokens, params.temperature, params.top_p, params.top_k, params.seed) == (20, 0.5, 0.9, 7, 3)
    assert params.stop == ("\n\n",) and parsed.model == "tiny" and not parsed.prefill
    assert messages_of(parsed) == [{"role": "system", "content": "Be brief."}, ASK]


def test_blocks_become_chat_messages_with_tool_calls_and_results():
    body = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Paris?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Look it up.", "signature": "x"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no data", "is_error": True},
            {"type": "text", "text": "And tomorrow?"}]}],
        "tools": [WEATHER]}
    got = messages_of(parse(body))
    assert got[0] == {"role": "user", "content": "Weather in Paris?"}
    assert got[1]["content"] == "Checking." and got[1]["tool_calls"] == [{"id": "toolu_1", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]
    assert got[2:] == [{"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
                       {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no data"},
                       {"role": "user", "content": "And tomorrow?"}]


@pytest.mark.parametrize("choice, syntax, name", [
    (None, "json", None),  # auto: the model's own syntax, read from its answer
    ({"type": "auto"}, "json", None),
    ({"type": "any"}, None, None),  # required: the answer is constrained to calls
    ({"type": "tool", "name": "get_weather"}, None, "get_weather"),
])
def test_tool_choices(choice, syntax, name):
    parsed = parse({"messages": [ASK], "tools": [WEATHER], **({"tool_choice": choice} if choice else {})})
    tools = parsed.chat.tools
    assert parsed.chat.prompt.tools[0]["function"]["parameters"] == WEATHER["input_schema"]
    assert (tools.syntax, tools.name, tools.parallel) == (syntax, name, True)


def test_tool_choice_none_and_one_call_at_most():
    assert parse({"messages": [ASK], "tools": [WEATHER], "tool_choice": {"type": "none"}}).chat.tools is None
    parsed = parse({"messages": [ASK], "tools": [WEATHER],
                    "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    assert parsed.chat.tools.parallel is False


def test_a_final_assistant_message_is_a_prefill():
    parsed = parse({"messages": [ASK, {"role": "assistant", "content": "The weather is"}]})
    assert parsed.prefill and parsed.chat.prompt.continue_final
    assert parsed.chat.prompt.messages[-1] == {"role": "assistant", "content": "The weather is"}


def test_thinking_sets_the_template_switch_and_output_config_a_schema():
    assert parse({"messages": [ASK], "thinking": {"type": "disabled"}}).chat.prompt.template_kwargs == {
        "enable_thinking": False}
    kwargs = parse({"messages": [ASK], "thinking": {"type": "enabled", "budget_tokens": 2048},
                    "chat_template_kwargs": {"enable_thinking": False, "x": 1}}).chat.prompt.template_kwargs
    assert kwargs == {"enable_thinking": False, "x": 1}  # the body's own kwargs win
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    parsed = parse({"messages": [ASK], "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert parsed.chat.params.structured is not None and parsed.chat.names["structured"] == "output_config.format"


def test_count_only_needs_no_max_tokens_and_counts_the_tools():
    parsed = parse_messages_request({"messages": [ASK], "tools": [WEATHER]}, SERVED, SamplingParams(), 1000, None,
                                    count_only=True)
    assert parsed.chat.prompt.tools and parsed.chat.params.max_new_tokens == 1


@pytest.mark.parametrize("body, field, words", [
    ({"max_tokens": None, "messages": [ASK]}, "max_tokens", "is required"),
    ({"max_tokens": 0, "messages": [ASK]}, "max_tokens", ">= 1"),
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role", 'top-level "system"'),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "string or a list"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]",
     "text models"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages[0].content[0]", "text, tool_result"),
    ({"messages": [ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                            "input": "x"}]}]},
     "messages[1].content[0].input", "must be an object"),
    ({"messages": [ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "get_weather",
                                                            "input": {}}]}], "tools": [WEATHER]},
     "messages[1]", "prefill"),
    ({"messages": [ASK], "stop": ["x"]}, "stop", "stop_sequences"),
    ({"messages": [ASK], "response_format": {}}, "response_format", "output_config.format"),
    ({"messages": [ASK], "temprature": 0.5}, "temprature", "did you mean 'temperature'"),
    ({"messages": [ASK], "temperature": -1}, "temperature", ""),
    ({"messages": [ASK], "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]",
     "no server tools"),
    ({"messages": [ASK], "tools": [{**WEATHER, "input_schema": 3}]}, "tools[0].input_schema", ""),
    ({"messages": [ASK], "tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice", '"type": "any"'),
    ({"messages": [ASK], "thinking": {"type": "on"}}, "thinking", '"type": "adaptive"'),
    ({"messages": [ASK], "output_config": {"effort": "high"}}, "output_config.effort", "not supported"),
    ({"messages": [ASK], "output_config": {"format": {"type": "json_object"}}}, "output_config.format",
     "json_schema"),
    ({"messages": [ASK], "mcp_servers": [{"url": "x"}]}, "mcp_servers", "not supported"),
    ({"messages": [ASK], "system": [{"type": "image"}]}, "system[0]", "serves text only"),
])
def test_bad_bodies_name_the_messages_field(body, field, words):
    with pytest.raises(RequestError) as err:
        parse(body)
    assert err.value.field == field and words in err.value.message, (err.value.field, err.value.message)


def test_unknown_model_and_what_asks_for_nothing():
    with pytest.raises(UnknownModelError):
        parse({"model": "claude-sonnet-4-5", "messages": [ASK]})
    parse({"messages": [ASK], "mcp_servers": [], "speed": "standard", "service_tier": "auto",
           "cache_control": {"type": "ephemeral"}})
    with pytest.raises(RequestError, match="count_tokens answers at once"):
        parse({"messages": [ASK], "stream": True}, count_only=True)


def test_stop_reasons():
    def final(reason, stop=None):
        return StreamEvent("r", "x", (1,), True, reason, stop)

    assert stop_reason(final("stop", 2), False, False) == ("end_turn", None)
    assert stop_reason(final("stop", "\n\n"), False, False) == ("stop_sequence", "\n\n")
    assert stop_reason(final("length"), False, False) == ("max_tokens", None)
    assert stop_reason(final("length"), False, True) == ("model_context_window_exceeded", None)
    assert stop_reason(final("stop", 2), True, False) == ("tool_use", None)


def test_error_bodies_have_anthropic_s_types():
    assert anthropic_error(400, "bad") == {"type": "error", "error": {"type": "invalid_request_error",
                                                                      "message": "bad"}}
    kinds = {s: anthropic_error(s, "m")["error"]["type"] for s in (401, 404, 405, 413, 500, 503, 504)}
    assert kinds == {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
                     413: "request_too_large", 500: "api_error", 503: "overloaded_error", 504: "timeout_error"}
