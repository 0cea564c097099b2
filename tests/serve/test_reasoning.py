"""A reasoning model's <think> ... </think> as the chat message's reasoning_content: the split of an answer streamed in
pieces split anywhere, the server's choice of syntax, answers through OpenAI's own client (scripted answers: the
runner's sampled tokens are the answer's, see conftest's ``script``), and chat_template_kwargs reaching the template."""

from __future__ import annotations

import pytest

from llmc.errors import RequestError
from llmc.request.inputs import ChatPrompt, chat_to_token_ids
from llmc.request.params import SamplingParams
from llmc.serve.openai_protocol import parse_openai_request
from llmc.serve.reasoning import ReasoningStream, prompt_opens_thinking, served_reasoning
from tests.serve.conftest import start_server
from tests.serve.test_openai_tools import TIME, USER, WEATHER
from tests.serve.test_openai_tools_auto import _client, _streamed

THINK_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}<|im_start|>assistant\n<think>\n"


@pytest.mark.parametrize("thinking, answer, reasoning, content", [
    (False, "<think>\nParis is in France.\n</think>\n\nParis.", "\nParis is in France.\n", "Paris."),
    (False, "  <think>a</think>b", "a", "b"),
    (True, "The prompt opened it.</think>Paris.", "The prompt opened it.", "Paris."),
    (True, "Cut short while thinking </thi", "Cut short while thinking </thi", ""),
    (False, "No thinking at all.", "", "No thinking at all."),
    (False, " <thinking> is not the marker", "", " <thinking> is not the marker"),
    (False, "<think>x</think>", "x", ""),
    (False, " <thi", "", " <thi"),  # cut short inside what might have opened it: text
])
def test_an_answer_split_anywhere_gives_the_same_reasoning_and_content(thinking, answer, reasoning, content):
    splits = [[answer[:k], answer[k:]] for k in range(len(answer) + 1)] + [list(answer)]
    for pieces in splits:
        split = ReasoningStream(thinking)
        fed = [split.feed(p) for p in pieces]
        rest = split.finish()
        assert "".join(r for r, _ in fed) + rest[0] == reasoning == split.reasoning, pieces
        assert "".join(c for _, c in fed) + rest[1] == content == split.content, pieces
        assert all("<think>" not in r and "</think>" not in c for r, c in fed)


def test_thinking_streams_as_it_comes_holding_only_a_possible_marker():
    split = ReasoningStream(False)
    assert [split.feed(p) for p in ["<think>", "Hmm", ", 4 <", "/thi", "nk>", "\n\n", "Four", "."]] == [
        ("", ""), ("Hmm", ""), (", 4 ", ""), ("", ""), ("", ""), ("", ""), ("", "Four"), ("", ".")]


def test_which_servers_split_answers():
    assert served_reasoning("auto", THINK_TEMPLATE) == "think" and served_reasoning("auto", "{{ messages }}") is None
    assert served_reasoning("think", None) == "think" and served_reasoning("none", THINK_TEMPLATE) is None
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n") and not prompt_opens_thinking(
        "<think>\n\n</think>\n\n")


@pytest.fixture(scope="module")
def think_server(serve_tiny_build):
    server = start_server(serve_tiny_build, reasoning_syntax="think")
    yield server
    server.close()


def test_reasoning_content_through_the_client(think_server, script):
    client = _client(think_server)
    script(think_server, "<think>\nThe capital of France.\n</think>\n\nParis.")
    reply = client.chat.completions.create(model=think_server.model, messages=USER, max_tokens=40)
    message = reply.choices[0].message
    assert message.content == "Paris." and message.reasoning_content == "\nThe capital of France.\n"
    assert reply.choices[0].finish_reason == "stop"
    chunks = [c for c in client.chat.completions.create(model=think_server.model, messages=USER, max_tokens=40,
                                                        stream=True) if c.choices]
    thought = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
    assert thought == "\nThe capital of France.\n" and "".join(c.choices[0].delta.content or "" for c in chunks) \
        == "Paris."


def test_thinking_then_a_tool_call(think_server, script):
    script(think_server, '<think>I need the time.</think>\n[{"name": "get_time", "arguments": {"zone": "UTC"}}]')
    reply = _client(think_server).chat.completions.create(model=think_server.model, messages=USER,
                                                          tools=[WEATHER, TIME], max_tokens=60)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == "I need the time."
    assert choice.message.tool_calls[0].function.name == "get_time" and choice.message.content is None
    text, calls, finish = _streamed(_client(think_server), think_server, tools=[WEATHER, TIME], max_tokens=60)
    assert text == "" and finish == "tool_calls" and calls[0].function.name == "get_time"


def test_a_prompt_that_opens_thinking(think_server, script):
    tokenizer = think_server.engine.tokenizer
    original, tokenizer.chat_template = tokenizer.chat_template, THINK_TEMPLATE
    try:
        script(think_server, "Short.</think>Paris.")
        reply = _client(think_server).chat.completions.create(model=think_server.model, messages=USER, max_tokens=40)
        assert reply.choices[0].message.reasoning_content == "Short." and reply.choices[0].message.content == \
            "Paris."
    finally:
        tokenizer.chat_template = original


def test_a_constrained_answer_is_not_split(think_server):
    reply = _client(think_server).chat.completions.create(  # an output format leaves no room to think
        model=think_server.model, messages=USER, max_tokens=8, temperature=0, response_format={"type": "json_object"})
    assert reply.choices[0].message.content.startswith("{")
    assert getattr(reply.choices[0].message, "reasoning_content", None) is None


def test_a_server_without_a_thinking_template_sends_answers_as_they_come(tiny_server, script):
    script(tiny_server, "<think>x</think>y")
    reply = _client(tiny_server).chat.completions.create(model=tiny_server.model, messages=USER, max_tokens=20)
    assert reply.choices[0].message.content == "<think>x</think>y"
    assert getattr(reply.choices[0].message, "reasoning_content", None) is None


def test_chat_template_kwargs_reach_the_template(smollm2_hf_dir):
    from llmc.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(smollm2_hf_dir)
    tokenizer.chat_template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                               "{% if enable_thinking is defined and not enable_thinking %} NOTHINK{% endif %}")
    plain = tokenizer.decode(chat_to_token_ids(tokenizer, USER))
    off = tokenizer.decode(chat_to_token_ids(tokenizer, USER, template_kwargs={"enable_thinking": False}))
    assert off == plain + " NOTHINK"
    req = parse_openai_request({"messages": USER, "chat_template_kwargs": {"enable_thinking": False}}, True,
                               ("m",), SamplingParams())
    assert req.prompts == (ChatPrompt(tuple(USER), (), {"enable_thinking": False}),)


@pytest.mark.parametrize("body, chat, field", [
    ({"prompt": "hi", "chat_template_kwargs": {"a": 1}}, False, "chat_template_kwargs"),
    ({"messages": USER, "chat_template_kwargs": [1]}, True, "chat_template_kwargs"),
    ({"messages": USER, "chat_template_kwargs": {"add_generation_prompt": False}}, True,
     "chat_template_kwargs.add_generation_prompt"),
    ({"messages": USER, "chat_template_kwargs": {"tools": []}}, True, "chat_template_kwargs.tools"),
    ({"prompt": "hi", "continue_final_message": True}, False, "continue_final_message"),
    ({"prompt": "hi", "add_generation_prompt": False}, False, "add_generation_prompt"),
    ({"messages": USER, "continue_final_message": True}, True, "continue_final_message"),  # the last is the user's
    ({"messages": [*USER, {"role": "assistant", "content": "It"}], "continue_final_message": True,
      "add_generation_prompt": True}, True, "continue_final_message"),
    ({"messages": USER, "add_generation_prompt": "no"}, True, "add_generation_prompt"),
])
def test_bad_chat_template_kwargs_name_the_field(body, chat, field):
    with pytest.raises(RequestError) as info:
        parse_openai_request(body, chat, ("m",), SamplingParams())
    assert info.value.field == field


def test_a_final_assistant_message_is_continued(tiny_server, offline):
    """vLLM's ``continue_final_message``: the answer continues the assistant's text (a prefill), the same tokens as
    the offline engine's from the open turn, and holds only the continuation."""
    prefill = [*USER, {"role": "assistant", "content": "The weather in Paris is"}]
    req = parse_openai_request({"messages": prefill, "continue_final_message": True}, True, ("m",), SamplingParams())
    assert req.prompts == (ChatPrompt(tuple(prefill), generation_prompt=False, continue_final=True),)
    reply = _client(tiny_server).chat.completions.create(model=tiny_server.model, messages=prefill, max_tokens=6,
                                                         extra_body={"continue_final_message": True})
    want = offline.generate([ChatPrompt(tuple(prefill), generation_prompt=False, continue_final=True)],
                            SamplingParams(max_new_tokens=6, temperature=0.0))[0]
    assert reply.choices[0].message.content == want.text
    ids = offline.tokenize(ChatPrompt(tuple(prefill), generation_prompt=False, continue_final=True))
    assert reply.usage.prompt_tokens == len(ids) and offline.tokenizer.decode(ids).endswith("The weather in Paris is")
