"""OpenAI request bodies (llmc/serve/openai_protocol.py): which fields are read, ignored or refused, and roles."""

from __future__ import annotations

import pytest

from llmc.errors import RequestError, UnknownModelError
from llmc.request.params import SamplingParams
from llmc.request.structured import OutputFormat
from llmc.serve.openai_protocol import IGNORED, UNSUPPORTED, parse_openai_request

DEFAULTS = SamplingParams(max_new_tokens=16)
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
SERVED = ("m", "ensemble")


def parse(body: dict, chat: bool = True):
    return parse_openai_request({**(CHAT if chat else {"prompt": "hi"}), **body}, chat, SERVED, DEFAULTS, 100)


@pytest.mark.parametrize("key, near", [("max_token", "max_tokens"), ("temprature", "temperature"),
                                       ("stop_sequences", "stop"), ("max_new_tokens", "max_tokens"),
                                       ("colour", None)])
def test_an_unknown_field_is_refused_with_the_nearest_known_name(key, near):
    with pytest.raises(RequestError) as info:
        parse({key: 5})
    assert info.value.field == key and "unknown field" in info.value.message
    assert (f"did you mean {near!r}?" in info.value.message) == (near is not None), info.value.message
    assert "max_tokens" in info.value.message  # the accepted fields are listed


def test_the_other_endpoints_prompt_field_names_that_endpoint():
    with pytest.raises(RequestError, match=r"prompt: is a field of /v1/completions; this endpoint takes 'messages'"):
        parse({"prompt": "hi"})
    with pytest.raises(RequestError, match=r"messages: is a field of /v1/chat/completions"):
        parse(CHAT, chat=False)


def test_fields_that_do_not_change_the_tokens_are_accepted():
    req = parse({key: "x" for key in IGNORED} | {"max_tokens": 3})
    assert req.params.max_new_tokens == 3


@pytest.mark.parametrize("key, value", [("best_of", 1), ("tools", []), ("tool_choice", "none"), ("logit_bias", {}),
                                        ("response_format", {"type": "text"}), ("logprobs", False),
                                        ("modalities", ["text"]), ("echo", False), ("reasoning_effort", None)])
def test_unsupported_features_are_accepted_when_they_ask_for_nothing(key, value):
    assert parse({key: value}).params == DEFAULTS


@pytest.mark.parametrize("key, value", [("best_of", 2), ("best_of", True), ("function_call", "auto"), ("suffix", "x"),
                                        ("reasoning_effort", "low"), ("audio", {"voice": "x"})])
def test_unsupported_features_are_refused_naming_the_field(key, value):
    with pytest.raises(RequestError) as info:
        parse({key: value})
    assert info.value.field == key and "is not supported by llmc" in info.value.message
    assert set(UNSUPPORTED) >= {key}


def test_echo_is_a_completions_field_that_asks_for_the_prompts_logprobs():
    req = parse({"echo": True, "logprobs": 1, "max_tokens": 0}, chat=False)
    assert req.echo and req.score_only and req.params.max_new_tokens == 1  # one token made, none returned
    assert req.params.prompt_logprobs == req.params.logprobs == 1
    assert parse({"echo": True}, chat=False).params.prompt_logprobs is None  # the text alone: nothing scored
    assert parse({"logprobs": 2}, chat=False).params.prompt_logprobs is None
    with pytest.raises(RequestError, match="echo: is not supported by /v1/chat/completions") as info:
        parse({"echo": True})
    assert info.value.field == "echo"
    with pytest.raises(RequestError, match='max_tokens: must be >= 1; 0 is accepted with "echo": true'):
        parse({"max_tokens": 0}, chat=False)
    with pytest.raises(RequestError, match="max_tokens"):  # chat: the plain bound
        parse({"max_tokens": 0})


@pytest.mark.parametrize("prompt, count", [("hi", 1), ([1, 2, 3], 1), (["a", "b"], 2), ([[1, 2], [3]], 2),
                                           (["a", [4, 5]], 2)])
def test_a_completions_prompt_may_be_a_list_of_prompts(prompt, count):
    req = parse_openai_request({"prompt": prompt}, False, SERVED, DEFAULTS, 100)
    assert len(req.prompts) == count and req.prompt == req.prompts[0]


@pytest.mark.parametrize("body, words", [({"prompt": []}, "must be a string"), ({"prompt": [[]]}, "must be a string"),
                                         ({"prompt": [1, "a"]}, "must be a string"),
                                         ({"prompt": ["a"] * 20, "n": 16}, "20 prompts x n=16 make 320")])
def test_a_bad_prompt_list_is_refused(body, words):
    with pytest.raises(RequestError, match=words):
        parse_openai_request(body, False, SERVED, DEFAULTS, 100)


def test_a_developer_message_reaches_the_template_as_system():
    req = parse({"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]})
    assert req.prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    with pytest.raises(RequestError, match=r"messages\[1\].role: must be one of system, user, assistant, tool, "
                                           r"developer, got 'function'"):
        parse({"messages": [{"role": "user", "content": "hi"}, {"role": "function", "content": "42"}]})


def test_an_unknown_model_is_its_own_error():
    with pytest.raises(UnknownModelError, match="unknown model 'gpt-4o'; this server serves 'm'"):
        parse({"model": "gpt-4o"})
    assert parse({"model": "ensemble"}).model == "ensemble"


@pytest.mark.parametrize("body, chat, expected", [
    ({"logprobs": True}, True, 0), ({"logprobs": True, "top_logprobs": 5}, True, 5), ({"logprobs": False}, True, None),
    ({}, True, None), ({"logprobs": 3}, False, 3), ({"logprobs": 0}, False, 0), ({"logprobs": None}, False, None),
])
def test_log_probabilities_map_onto_sampling_params(body, chat, expected):
    assert parse(body, chat).params.logprobs == expected


@pytest.mark.parametrize("body, chat, field, words", [
    ({"top_logprobs": 2}, True, "top_logprobs", 'needs "logprobs": true'),
    ({"logprobs": 3}, True, "logprobs", "must be true or false"),
    ({"logprobs": True, "top_logprobs": 21}, True, "top_logprobs", r"in \[0, 20\]"),
    ({"logprobs": True}, False, "logprobs", "the number of most likely tokens"),
    ({"logprobs": 2, "top_logprobs": 2}, False, "top_logprobs", "is a field of /v1/chat/completions"),
])
def test_bad_log_probability_fields_name_the_field(body, chat, field, words):
    with pytest.raises(RequestError, match=words) as info:
        parse(body, chat)
    assert info.value.field == field


@pytest.mark.parametrize("value, expected", [(None, 1), (1, 1), (4, 4), (16, 16)])
def test_n_is_the_number_of_choices(value, expected):
    assert parse({"n": value}).n == expected


@pytest.mark.parametrize("value", [0, 17, True, 2.0, "3"])
def test_n_out_of_range_names_the_field(value):
    with pytest.raises(RequestError, match=r"n: must be an integer in \[1, 16\]"):
        parse({"n": value})


def test_response_format_and_logit_bias_map_onto_the_sampling_params():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    req = parse({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
                 "logit_bias": {"50": -100, "7": 5}})
    assert req.params.structured == OutputFormat.from_dict({"type": "json_schema", "schema": schema})
    assert req.params.logit_bias == ((7, 5.0), (50, -100.0)) and req.names["structured"] == "response_format"
    assert parse({"response_format": {"type": "json_object"}}).params.structured == OutputFormat("json_object")
    regex = parse({"structured": {"type": "regex", "pattern": "a|b"}})
    assert regex.params.structured == OutputFormat("regex", "a|b") and regex.names["structured"] == "structured"
    assert parse({"response_format": {"type": "text"}}).params.structured is None


@pytest.mark.parametrize("fmt, expected", [
    ({"type": "json_object", "value": {"type": "object", "properties": {"a": {}}}},  # huggingface_hub's rewrite
     {"type": "json_schema", "schema": {"type": "object", "properties": {"a": {}}}}),
    ({"type": "json", "value": '{"type": "string"}'}, {"type": "json_schema", "schema": {"type": "string"}}),
    ({"type": "json_schema", "value": {"name": "n", "schema": {"type": "integer"}}},
     {"type": "json_schema", "schema": {"type": "integer"}}),
    ({"type": "regex", "value": "[0-9]+"}, {"type": "regex", "pattern": "[0-9]+"}),
])
def test_tgi_s_response_format_is_read_with_its_schema(fmt, expected):
    """TGI's ``{"type", "value"}`` shape, which huggingface_hub's chat client sends for an OpenAI ``json_schema``
    format: read as that schema, not as "any JSON object" (the schema was dropped before)."""
    req = parse({"response_format": fmt})
    assert req.params.structured == OutputFormat.from_dict(expected) and req.names["structured"] == "response_format"
    with pytest.raises(RequestError, match=r"^response_format.value: must be a JSON schema"):
        parse({"response_format": {"type": "json_object", "value": 5}})
