"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` through Anthropic's own client: answers equal the chat
route's, the stream's events build the same message (the client's accumulator checks their order and indices), stop
reasons, tool use and its results, a prefill continued, thinking blocks, usage with the prefix cache, the key in
``X-Api-Key``, and Anthropic's error types."""

from __future__ import annotations

import json

import anthropic
import pytest

from tests.serve.conftest import start_server
from tests.serve.test_server import events_until_shutdown, metric, sse, wait_idle

WEATHER = {"name": "get_weather", "description": "Weather of a city", "input_schema": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}
ASK = "What is the weather in Paris?"


def _client(server, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.http, api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(tiny_server):
    return _client(tiny_server)


def _chat(client, server, messages, **kwargs):
    return client.chat.completions.create(model=server.model, messages=messages, **kwargs)


def test_an_answer_equals_the_chat_routes_with_usage(claude, client, tiny_server):
    reply = claude.messages.create(model=tiny_server.model, max_tokens=6, system="Answer briefly.",
                                   messages=[{"role": "user", "content": "Say hi"}])
    chat = _chat(client, tiny_server, [{"role": "system", "content": "Answer briefly."},
                                       {"role": "user", "content": "Say hi"}], max_tokens=6)
    [block] = reply.content
    assert block.type == "text" and block.text == chat.choices[0].message.content and reply.id.startswith("msg_")
    assert (reply.stop_reason, reply.stop_sequence, reply.model, reply.role) == ("max_tokens", None,
                                                                                 tiny_server.model, "assistant")
    usage = reply.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == 6 and usage.cache_creation_input_tokens == 0


def test_the_stream_builds_the_same_message(tiny_server, script):
    claude = _client(tiny_server)
    script(tiny_server, "Hello there, friend.")
    whole = claude.messages.create(model=tiny_server.model, max_tokens=40, messages=[{"role": "user", "content": "Hi"}])
    assert whole.stop_reason == "end_turn" and whole.content[0].text == "Hello there, friend."
    with claude.messages.stream(model=tiny_server.model, max_tokens=40,
                                messages=[{"role": "user", "content": "Hi"}]) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == final.content[0].text == whole.content[0].text
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == whole.usage.output_tokens
    events = sse(tiny_server, "/v1/messages", {"max_tokens": 40, "stream": True,
                                               "messages": [{"role": "user", "content": "Hi"}]})
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"} and events[0]["message"]["content"] == []


def test_the_client_lists_and_retrieves_the_served_model(claude, client, tiny_server):
    [card] = list(claude.models.list())
    assert (card.id, card.display_name, card.type) == (tiny_server.model, tiny_server.model, "model")
    assert card.created_at.timestamp() == client.models.retrieve(tiny_server.model).created  # one creation time
    assert claude.models.retrieve(tiny_server.model).id == tiny_server.model


def test_a_stop_sequence_is_named_and_left_out(tiny_server, script):
    script(tiny_server, "Hello there, friend.")
    reply = _client(tiny_server).messages.create(model=tiny_server.model, max_tokens=40, stop_sequences=[","],
                                                 messages=[{"role": "user", "content": "Hi"}])
    assert (reply.stop_reason, reply.stop_sequence, reply.content[0].text) == ("stop_sequence", ",", "Hello there")


def test_tool_use_goes_out_as_blocks_and_results_come_back(claude, client, tiny_server):
    reply = claude.messages.create(model=tiny_server.model, max_tokens=40, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"},
                                   messages=[{"role": "user", "content": ASK}])
    [call] = reply.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.input["city"] in ("Paris", "Oslo")
    assert reply.stop_reason == "tool_use"
    with claude.messages.stream(model=tiny_server.model, max_tokens=60, tools=[WEATHER],
                                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                messages=[{"role": "user", "content": ASK}]) as stream:
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content] == ["tool_use"] and streamed.stop_reason == "tool_use"
    history = [{"role": "user", "content": ASK}, {"role": "assistant", "content": [call.model_dump()]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}]}]
    answer = claude.messages.create(model=tiny_server.model, max_tokens=5, tools=[WEATHER],
                                    tool_choice={"type": "none"}, messages=history)
    chat = _chat(client, tiny_server, [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}], max_tokens=5)
    assert answer.content[0].text == chat.choices[0].message.content
    count = claude.messages.count_tokens(model=tiny_server.model, messages=[{"role": "user", "content": ASK}],
                                         tools=[WEATHER])
    assert count.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens  # the tools counted
    assert count.input_tokens > claude.messages.count_tokens(model=tiny_server.model, messages=[
        {"role": "user", "content": ASK}]).input_tokens


def test_count_tokens_equals_what_a_request_runs_on(claude, tiny_server):
    messages = [{"role": "user", "content": "Count me, please."}]
    count = claude.messages.count_tokens(model=tiny_server.model, system="Be brief.", messages=messages)
    status, tokenized = tiny_server.post("/tokenize", {"messages": [{"role": "system", "content": "Be brief."},
                                                                    *messages]})
    assert status == 200 and count.input_tokens == tokenized["count"]
    reply = claude.messages.create(model=tiny_server.model, max_tokens=1, system="Be brief.", messages=messages)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == count.input_tokens


def test_a_prefill_is_continued(claude, offline, tiny_server):
    messages = [{"role": "user", "content": ASK}, {"role": "assistant", "content": "The weather in Paris is"}]
    reply = claude.messages.create(model=tiny_server.model, max_tokens=6, messages=messages)
    status, tokenized = tiny_server.post("/tokenize", {"messages": messages, "continue_final_message": True})
    assert status == 200 and offline.tokenizer.decode(tokenized["tokens"]).endswith("The weather in Paris is")
    from llmc.request.params import SamplingParams

    expected = offline.generate([tokenized["tokens"]], SamplingParams(max_new_tokens=6, temperature=0.0))[0]
    assert reply.content[0].text == expected.text  # the continuation alone, after the open turn


def test_the_prefix_cache_is_counted_as_cache_reads(claude, tiny_server):
    messages = [{"role": "user", "content": "Tell me about rivers and the sea. " * 6}]
    first = claude.messages.create(model=tiny_server.model, max_tokens=2, messages=messages).usage
    again = claude.messages.create(model=tiny_server.model, max_tokens=2, messages=messages).usage
    total = first.input_tokens + first.cache_read_input_tokens
    assert again.cache_read_input_tokens > 0 and again.input_tokens + again.cache_read_input_tokens == total


@pytest.fixture(scope="module")
def think_server(serve_tiny_build):
    server = start_server(serve_tiny_build, reasoning_syntax="think", tool_call_syntax="json", api_key="s3cret")
    yield server
    server.close()


def test_thinking_is_a_block_before_the_text_or_the_calls(think_server, script):
    claude = _client(think_server, "s3cret")
    script(think_server, "<think>\nThe capital.\n</think>\n\nParis.")
    reply = claude.messages.create(model=think_server.model, max_tokens=40, thinking={"type": "disabled"},
                                   messages=[{"role": "user", "content": "Capital of France?"}])
    assert [b.type for b in reply.content] == ["thinking", "text"] and reply.content[1].text == "Paris."
    assert reply.content[0].thinking == "\nThe capital.\n"
    with claude.messages.stream(model=think_server.model, max_tokens=40,
                                messages=[{"role": "user", "content": "Capital of France?"}]) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text == "Paris."
    script(think_server, '<think>Look it up.</think>\n[{"name": "get_weather", "arguments": {"city": "Oslo"}}]')
    reply = claude.messages.create(model=think_server.model, max_tokens=60, tools=[WEATHER],
                                   messages=[{"role": "user", "content": ASK}])
    assert [b.type for b in reply.content] == ["thinking", "tool_use"] and reply.content[1].input == {"city": "Oslo"}
    assert reply.stop_reason == "tool_use"


def test_the_key_goes_in_x_api_key_and_errors_have_anthropic_s_types(think_server, claude, tiny_server):
    with pytest.raises(anthropic.AuthenticationError) as info:
        _client(think_server, "wrong").messages.create(model=think_server.model, max_tokens=2,
                                                       messages=[{"role": "user", "content": "Hi"}])
    assert info.value.body["error"]["type"] == "authentication_error" and "X-Api-Key" in info.value.message
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.create(model="claude-sonnet-4-5", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert info.value.body["error"]["type"] == "not_found_error" and tiny_server.model in info.value.message
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model=tiny_server.model, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    assert info.value.body["error"]["type"] == "invalid_request_error" and "text models" in info.value.message
    rejected = metric(tiny_server, 'llmc_requests_rejected_total{reason="invalid"}')
    status, reply = tiny_server.post("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}]})
    assert status == 400 and reply == {"type": "error", "error": {"type": "invalid_request_error", "message":
                                       "max_tokens: is required: the most tokens to generate (e.g. 1024), as "
                                       "Anthropic's API requires"}}
    assert metric(tiny_server, 'llmc_requests_rejected_total{reason="invalid"}') == rejected + 1


def test_an_error_after_the_first_byte_is_an_error_event(serve_tiny_build):
    server = start_server(serve_tiny_build, request_timeout_s=0.3)
    try:
        with pytest.raises(anthropic.APIStatusError) as info:
            with _client(server).messages.stream(model=server.model, max_tokens=400, extra_body={"min_tokens": 400},
                                                 messages=[{"role": "user", "content": "Hi"}]) as stream:
                for _ in stream:
                    pass
    finally:
        server.close()
    assert info.value.body["error"]["type"] == "timeout_error" and "0.3" in info.value.message


def test_a_request_aborted_by_the_server_is_an_overloaded_error(serve_tiny_build):
    server = start_server(serve_tiny_build)
    try:  # message_start, content_block_start, the first delta
        events = events_until_shutdown(server, "/v1/messages", {
            "max_tokens": 480, "min_tokens": 480, "stream": True, "messages": [{"role": "user", "content": ASK}]}, 3)
    finally:
        server.close()
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "error", events[-3:]
    assert events[-1]["error"]["type"] == "overloaded_error"


def test_a_client_leaving_a_stream_aborts_it_and_frees_its_blocks(tiny_server):
    aborted = metric(tiny_server, 'llmc_requests_total{finish_reason="abort"}')
    events = sse(tiny_server, "/v1/messages", {"max_tokens": 400, "min_tokens": 400, "stream": True,
                                               "messages": [{"role": "user", "content": "Tell me about rivers"}]},
                 stop_after=6)
    assert events[-1]["type"] == "content_block_delta"
    stats = wait_idle(tiny_server.engine)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert metric(tiny_server, 'llmc_requests_total{finish_reason="abort"}') == aborted + 1
