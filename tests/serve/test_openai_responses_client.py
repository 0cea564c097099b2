"""``POST /v1/responses`` through OpenAI's own client: answers equal the chat route's and the offline engine's, the
stream's typed events build the same response (OpenAI's stream helper checks their order and identities), function
calls go out as ``function_call`` items and come back as input, thinking is a ``reasoning`` item, and llmc's
statelessness is said, not hidden."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel

from tests.serve.conftest import start_server

WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}
ASK = "What is the weather in Paris?"


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http + "/v1", api_key="unused", max_retries=0, timeout=60)


def _chat(client, server, messages, **kwargs):
    return client.chat.completions.create(model=server.model, messages=messages, temperature=0, **kwargs)


def test_an_answer_equals_the_chat_routes_with_usage_and_status(client, tiny_server):
    reply = client.responses.create(model=tiny_server.model, input="Say hi", instructions="Answer briefly.",
                                    max_output_tokens=6, temperature=0)
    chat = _chat(client, tiny_server, [{"role": "system", "content": "Answer briefly."},
                                       {"role": "user", "content": "Say hi"}], max_tokens=6)
    assert reply.output_text == chat.choices[0].message.content and reply.id.startswith("resp_")
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (chat.usage.prompt_tokens, 6)
    assert reply.usage.total_tokens == chat.usage.prompt_tokens + 6 and reply.store is False
    assert (reply.model, reply.instructions, reply.max_output_tokens, reply.temperature) == (
        tiny_server.model, "Answer briefly.", 6, 0.0)
    [message] = reply.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"


def test_the_stream_builds_the_same_response(tiny_server, script):
    client = _client(tiny_server)
    script(tiny_server, "Hello there, friend.")
    whole = client.responses.create(model=tiny_server.model, input="Say hi", max_output_tokens=40)
    assert whole.status == "completed" and whole.output_text == "Hello there, friend."
    with client.responses.stream(model=tiny_server.model, input="Say hi", max_output_tokens=40) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens and final.status == "completed"
    assert events[0].response.status == "in_progress" and events[0].response.output == []


def test_a_cut_short_stream_ends_incomplete(client, tiny_server):
    events = list(client.responses.create(model=tiny_server.model, input="Say hi", max_output_tokens=3,
                                          temperature=0, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.usage.output_tokens == 3
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_logprobs_equal_the_chat_routes(client, tiny_server):
    reply = client.responses.create(model=tiny_server.model, input="Say hi", max_output_tokens=3, temperature=0,
                                    top_logprobs=2, include=["message.output_text.logprobs"])
    chat = _chat(client, tiny_server, [{"role": "user", "content": "Say hi"}], max_tokens=3, logprobs=True,
                 top_logprobs=2)
    got = [lp.model_dump() for lp in reply.output[0].content[0].logprobs]
    assert got == [lp.model_dump() for lp in chat.choices[0].logprobs.content] and len(got) == 3


def test_text_format_and_pydantic_parsing(tiny_server, script):
    class Reading(BaseModel):
        city: str
        degrees: int

    script(tiny_server, '{"city":"Paris","degrees":21}')  # the random model's strings never end
    reply = _client(tiny_server).responses.parse(model=tiny_server.model, input="A reading", text_format=Reading,
                                                 max_output_tokens=60)
    assert reply.status == "completed" and reply.output_parsed == Reading(city="Paris", degrees=21)
    assert reply.text.format.type == "json_schema" and reply.text.format.name == "Reading"


def test_function_calls_go_out_as_items_and_come_back_as_input(client, tiny_server):
    reply = client.responses.create(model=tiny_server.model, input=ASK, tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40,
                                    temperature=0)
    [call] = reply.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["city"] in ("Paris", "Oslo") and reply.status == "completed"
    with client.responses.stream(model=tiny_server.model, input=ASK, tools=[WEATHER], tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=60, temperature=0) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds and streamed.output[0].type == "function_call"
    history = [{"role": "user", "content": ASK}, *[item.model_dump(exclude_none=True) for item in reply.output],
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    answer = client.responses.create(model=tiny_server.model, input=history, tools=[WEATHER], tool_choice="none",
                                     max_output_tokens=5, temperature=0)
    chat = _chat(client, tiny_server, [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}], max_tokens=5)
    assert answer.output_text == chat.choices[0].message.content
    assert answer.usage.input_tokens == chat.usage.prompt_tokens


@pytest.fixture(scope="module")
def think_server(serve_tiny_build):
    server = start_server(serve_tiny_build, reasoning_syntax="think", tool_call_syntax="json")
    yield server
    server.close()


def test_thinking_is_a_reasoning_item_before_the_message_or_the_calls(think_server, script):
    client = _client(think_server)
    script(think_server, "<think>\nThe capital.\n</think>\n\nParis.")
    reply = client.responses.create(model=think_server.model, input="Capital of France?", max_output_tokens=40)
    reasoning, message = reply.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "\nThe capital.\n"
    assert message.type == "message" and reply.output_text == "Paris."
    assert reply.usage.output_tokens_details.reasoning_tokens > 0
    with client.responses.stream(model=think_server.model, input="Capital of France?", max_output_tokens=40) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert "response.reasoning_text.delta" in kinds and final.output_text == "Paris."
    assert [i.type for i in final.output] == ["reasoning", "message"]
    script(think_server, '<think>Look it up.</think>\n[{"name": "get_weather", "arguments": {"city": "Oslo"}}]')
    reply = client.responses.create(model=think_server.model, input=ASK, tools=[WEATHER], max_output_tokens=60)
    assert [i.type for i in reply.output] == ["reasoning", "function_call"]
    assert json.loads(reply.output[1].arguments) == {"city": "Oslo"}


def test_llmc_says_it_keeps_no_responses(client, tiny_server):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=tiny_server.model, input="Hi", previous_response_id="resp_1")
    assert info.value.param == "previous_response_id" and "send the whole conversation" in info.value.message
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve("resp_1")
    assert "llmc keeps no responses" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=tiny_server.model, input="Hi", tools=[{"type": "web_search"}])
    assert info.value.param == "tools[0]" and "hosted tools" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=tiny_server.model, input="Hi " * 5000)
    assert info.value.param == "input" and "tokens" in info.value.message


def test_an_error_after_the_first_byte_is_an_error_event_then_response_failed(serve_tiny_build):
    server = start_server(serve_tiny_build, request_timeout_s=0.3)
    try:
        stream = _client(server).responses.create(model=server.model, input="Hi", max_output_tokens=400, stream=True,
                                                  extra_body={"min_tokens": 400})
        events = list(stream)
    finally:
        server.close()
    assert events[0].type == "response.created" and "response.output_text.delta" in [e.type for e in events]
    error, failed = events[-2:]
    assert error.type == "error" and error.code == "timeout" and "0.3" in error.message
    assert failed.type == "response.failed" and failed.response.status == "failed"
    assert failed.response.error.code == "timeout"


def test_events_are_framed_with_their_type(tiny_server):
    import urllib.request

    body = json.dumps({"input": "Hi", "max_output_tokens": 2, "stream": True}).encode()
    request = urllib.request.Request(tiny_server.http + "/v1/responses", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert reply.headers["Content-Type"].startswith("text/event-stream")
        frames = reply.read().decode().strip().split("\n\n")
    for frame in frames:
        head, data = frame.split("\n")
        assert head == "event: " + json.loads(data.removeprefix("data: "))["type"]
    assert "[DONE]" not in frames[-1] and json.loads(frames[-1].split("data: ")[1])["type"] == "response.incomplete"


def test_a_client_leaving_a_stream_aborts_it_and_frees_its_blocks(tiny_server):
    from tests.serve.test_server import metric, sse, wait_idle

    aborted = metric(tiny_server, 'llmc_requests_total{finish_reason="abort"}')
    events = sse(tiny_server, "/v1/responses", {"input": "Tell me about rivers", "max_output_tokens": 400,
                                                "min_tokens": 400, "stream": True}, stop_after=6)
    assert [e["type"] for e in events][-1] == "response.output_text.delta"
    stats = wait_idle(tiny_server.engine)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert metric(tiny_server, 'llmc_requests_total{finish_reason="abort"}') == aborted + 1
