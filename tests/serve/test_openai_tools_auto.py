"""tool_choice "auto" through OpenAI's own client: the model's text comes back as it is (equal to the offline
engine's), and an answer the model writes as calls -- in llmc's JSON syntax (the tiny build's template has no tools)
or in Hermes' <tool_call> blocks -- comes back as tool_calls, streamed or not. A model cannot be made to write a
given call, so those tests script the runner's sampled tokens (the tokens of the answer, then the end token):
they test the server's reading of an answer, not the model."""

from __future__ import annotations

import json

import openai
import pytest

from llmc.request.inputs import ChatPrompt
from llmc.request.params import SamplingParams
from tests.serve.conftest import start_server
from tests.serve.test_openai_tools import TIME, USER, WEATHER


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def json_server(serve_tiny_build):
    server = start_server(serve_tiny_build)  # the tiny build's template has no tools: llmc's JSON calls
    yield server
    server.close()


@pytest.fixture(scope="module")
def hermes_server(serve_tiny_build):
    server = start_server(serve_tiny_build, tool_call_syntax="hermes")
    yield server
    server.close()


def _streamed(client, server, **kwargs) -> tuple[str, list, str]:
    chunks = [c for c in client.chat.completions.create(model=server.model, messages=USER, stream=True, **kwargs)
              if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    return text, calls, chunks[-1].choices[0].finish_reason


def test_auto_returns_the_models_text_as_the_offline_engine_writes_it(json_server, offline):
    client = _client(json_server)
    want = offline.generate([ChatPrompt(tuple(USER), (WEATHER, TIME))], SamplingParams(max_new_tokens=12,
                                                                                      temperature=0.0))[0]
    for tool_choice in ("auto", None):  # OpenAI's default with tools is "auto"
        extra = {} if tool_choice is None else {"tool_choice": tool_choice}
        reply = client.chat.completions.create(model=json_server.model, messages=USER, tools=[WEATHER, TIME],
                                               max_tokens=12, temperature=0, **extra)
        choice = reply.choices[0]
        assert choice.message.content == want.text and choice.message.tool_calls is None
        assert choice.finish_reason == want.finish_reason
    text, calls, finish = _streamed(client, json_server, tools=[WEATHER, TIME], max_tokens=12, temperature=0)
    assert text == want.text and calls == [] and finish == want.finish_reason


def test_auto_reads_json_calls(json_server, script):
    client = _client(json_server)
    script(json_server, '[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
                        '{"name": "get_time", "arguments": {"zone": "UTC"}}]')
    reply = client.chat.completions.create(model=json_server.model, messages=USER, tools=[WEATHER, TIME],
                                           max_tokens=80)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "UTC"})]
    assert len({c.id for c in choice.message.tool_calls}) == 2
    text, calls, finish = _streamed(client, json_server, tools=[WEATHER, TIME], max_tokens=80)
    assert text == "" and finish == "tool_calls" and [c.index for c in calls] == [0, 1]
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris", "days": 2}, {"zone": "UTC"}]


def test_auto_streams_the_text_before_a_hermes_call_and_then_the_call(hermes_server, script):
    client = _client(hermes_server)
    script(hermes_server, 'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
                          '</tool_call>')
    reply = client.chat.completions.create(model=hermes_server.model, messages=USER, tools=[WEATHER, TIME],
                                           tool_choice="auto", max_tokens=80)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {"zone": "UTC"}
    text, calls, finish = _streamed(client, hermes_server, tools=[WEATHER, TIME], max_tokens=80)
    assert text == "Let me check.\n" and finish == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "get_time"


def test_an_answer_that_is_not_a_call_of_a_tool_comes_back_as_text(hermes_server, script):
    client = _client(hermes_server)
    answer = '<tool_call>\n{"name": "get_news", "arguments": {}}\n</tool_call>'
    script(hermes_server, answer)
    reply = client.chat.completions.create(model=hermes_server.model, messages=USER, tools=[WEATHER, TIME],
                                           max_tokens=80)
    assert reply.choices[0].finish_reason == "stop" and reply.choices[0].message.content == answer
    assert reply.choices[0].message.tool_calls is None
    assert _streamed(client, hermes_server, tools=[WEATHER, TIME], max_tokens=80) == (answer, [], "stop")
    short = client.chat.completions.create(model=hermes_server.model, messages=USER, tools=[WEATHER, TIME],
                                           max_tokens=5)  # cut short inside the call: its text
    assert short.choices[0].finish_reason == "length" and short.choices[0].message.content.startswith("<tool_call>")


def test_a_server_that_cannot_tell_the_syntax_refuses_auto_and_says_how_to_name_it(serve_tiny_build):
    server = start_server(serve_tiny_build, tool_call_syntax="none")
    try:
        with pytest.raises(openai.BadRequestError) as info:
            _client(server).chat.completions.create(model=server.model, messages=USER, tools=[WEATHER], max_tokens=4)
        assert info.value.param == "tool_choice" and "--tool-call-syntax hermes or json" in info.value.message
    finally:
        server.close()
