"""``llmc serve``'s OpenAI routes through OpenAI's own Python client (the ``openai`` package), as users call them:
answers equal the offline engine's, streams parse, usage is counted, and every error reaches the client's
exception with llmc's message, the field at fault and the HTTP status OpenAI uses for it."""

from __future__ import annotations

import openai
import pytest

from llmc.request.params import SamplingParams
from tests.serve.conftest import start_server

MESSAGES = [{"role": "developer", "content": "Answer briefly."}, {"role": "user", "content": "Say hi"}]


def expected(offline, prompt, n: int) -> str:
    return offline.generate([prompt], SamplingParams(max_new_tokens=n, temperature=0.0))[0].text


def test_models_chat_and_completions_equal_the_offline_engine(client, tiny_server, offline):
    assert [m.id for m in client.models.list()] == [tiny_server.model]
    assert client.models.retrieve(tiny_server.model).id == tiny_server.model
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o")
    assert info.value.code == "model_not_found" and "unknown model 'gpt-4o'" in info.value.message
    system = [{"role": "system", "content": "Answer briefly."}, MESSAGES[1]]  # developer is system to the template
    reply = client.chat.completions.create(model=tiny_server.model, messages=MESSAGES, max_tokens=6, temperature=0)
    assert reply.choices[0].message.content == expected(offline, system, 6)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 6
    reply = client.completions.create(model=tiny_server.model, prompt="Tell me about rivers", max_tokens=7,
                                      temperature=0)
    assert reply.choices[0].text == expected(offline, "Tell me about rivers", 7) and reply.usage.completion_tokens == 7


def test_streams_parse_and_count_usage(client, tiny_server, offline):
    stream = client.chat.completions.create(model=tiny_server.model, messages=MESSAGES[1:], max_completion_tokens=5,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected(offline, MESSAGES[1:], 5)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    pieces = [c.choices[0].text for c in client.completions.create(model=tiny_server.model, prompt="Snow",
                                                                    max_tokens=4, temperature=0, stream=True)]
    assert "".join(pieces) == expected(offline, "Snow", 4)


@pytest.mark.parametrize("kwargs, error, param, words", [
    ({"n": 17}, openai.BadRequestError, "n", "n: must be an integer in [1, 16]"),
    ({"extra_body": {"best_of": 2}}, openai.BadRequestError, "best_of", "best_of: is not supported by llmc (got 2)"),
    ({"tool_choice": "required"}, openai.BadRequestError, "tool_choice", "needs tools"),
    ({"extra_body": {"max_token": 5}}, openai.BadRequestError, "max_token", "did you mean 'max_tokens'?"),
    ({"max_tokens": 0}, openai.BadRequestError, "max_tokens", "max_tokens:"),
    ({"model": "gpt-4o"}, openai.NotFoundError, "model", "unknown model 'gpt-4o'"),
    ({"top_logprobs": 2}, openai.BadRequestError, "top_logprobs", 'needs "logprobs": true'),
    ({"logprobs": True, "top_logprobs": 21}, openai.BadRequestError, "top_logprobs", "[0, 20]"),
])
def test_errors_reach_the_clients_exception_with_the_message_and_field(client, tiny_server, kwargs, error, param,
                                                                        words):
    call = {"model": tiny_server.model, "messages": MESSAGES[1:], **kwargs}
    for stream in (False, True):
        with pytest.raises(error) as info:
            client.chat.completions.create(**call, stream=stream)
        assert words in info.value.message and info.value.param == param, info.value.body
        assert info.value.type == "invalid_request_error"
    if error is openai.NotFoundError:
        assert info.value.code == "model_not_found"
    assert client.chat.completions.create(model=tiny_server.model, messages=MESSAGES[1:], max_tokens=1).choices


def test_logprobs_in_openais_shapes_equal_the_engines(client, tiny_server, offline):
    params = SamplingParams(max_new_tokens=5, temperature=0.0, logprobs=2)
    ref = offline.generate(["Tell me about rivers"], params)[0].logprobs
    reply = client.completions.create(model=tiny_server.model, prompt="Tell me about rivers", max_tokens=5,
                                      temperature=0, logprobs=2)
    got = reply.choices[0].logprobs
    assert got.token_logprobs == pytest.approx([lp.logprob for lp in ref], abs=1e-5)
    assert "".join(got.tokens) == reply.choices[0].text and got.text_offset[0] == 0
    assert [len(top) for top in got.top_logprobs] == [2] * 5
    messages = MESSAGES[1:]
    ref = offline.generate([messages], params)[0].logprobs
    reply = client.chat.completions.create(model=tiny_server.model, messages=messages, max_tokens=5, temperature=0,
                                           logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert [e.logprob for e in content] == pytest.approx([lp.logprob for lp in ref], abs=1e-5)
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token for e in content)  # greedy
    assert "".join(e.token for e in content) == reply.choices[0].message.content
    stream = client.chat.completions.create(model=tiny_server.model, messages=messages, max_tokens=5, temperature=0,
                                            logprobs=True, stream=True)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([lp.logprob for lp in ref], abs=1e-5)
    assert all(e.top_logprobs == [] for e in streamed)  # logprobs without top_logprobs: the tokens' own only
    plain = client.chat.completions.create(model=tiny_server.model, messages=messages, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_n_choices_are_seeded_requests_of_their_own(client, tiny_server, offline):
    call = {"model": tiny_server.model, "messages": MESSAGES[1:], "max_tokens": 6, "temperature": 1.0, "seed": 5}
    single = client.chat.completions.create(**call)
    one = single.choices[0].message.content
    reply = client.chat.completions.create(**call, n=3, logprobs=True)
    texts = [c.message.content for c in reply.choices]
    assert [c.index for c in reply.choices] == [0, 1, 2] and texts[0] == one  # choice 0: the n = 1 answer
    for i, text in enumerate(texts):  # choice i samples with seed + i
        seeded = offline.generate([MESSAGES[1:]], SamplingParams(max_new_tokens=6, temperature=1.0, seed=5 + i))
        assert text == seeded[0].text
    assert len(set(texts)) > 1 and all(len(c.logprobs.content) == 6 for c in reply.choices)
    assert reply.usage.completion_tokens == 18 and reply.usage.prompt_tokens == single.usage.prompt_tokens  # once
    stream = client.chat.completions.create(**call, n=3, stream=True, stream_options={"include_usage": True})
    streamed = {i: "" for i in range(3)}
    finished = set()
    for c in stream:
        for choice in c.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
        if c.usage:
            assert c.usage.completion_tokens == 18
    assert [streamed[i] for i in range(3)] == texts and finished == {0, 1, 2}
    greedy = client.completions.create(model=tiny_server.model, prompt="Snow", max_tokens=4, temperature=0, n=2)
    assert greedy.choices[0].text == greedy.choices[1].text == expected(offline, "Snow", 4)
    stats = tiny_server.engine.stats()
    assert stats["running"] == 0 and stats["kv_blocks_used"] == 0


def test_usage_counts_the_prompt_tokens_served_from_the_prefix_cache(client, tiny_server):
    """OpenAI's ``prompt_tokens_details.cached_tokens``: a chat's next turn repeats the first turn and its answer,
    whose computed full blocks (8 tokens each) the prefix cache serves; the first turn finds at most the blocks of
    the template's system prompt, which other chats share."""
    history = [{"role": "user", "content": "Name the largest rivers of Europe and the seas they reach."}]
    first = client.chat.completions.create(model=tiny_server.model, messages=history, max_tokens=20, temperature=0)
    shared = first.usage.prompt_tokens_details.cached_tokens
    assert shared % 8 == 0 and shared <= 24  # SmolLM2's default system prompt: 24 tokens before the user's
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And of Asia?"}]
    answered = first.usage.prompt_tokens + first.usage.completion_tokens - 1  # the last token was never computed
    for stream in (False, True):
        kwargs = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
        reply = client.chat.completions.create(model=tiny_server.model, messages=history, max_tokens=2,
                                               temperature=0, **kwargs)
        usage = [c for c in reply if c.usage][-1].usage if stream else reply.usage
        cached = usage.prompt_tokens_details.cached_tokens
        assert cached % 8 == 0 and shared < answered // 8 * 8 <= cached < usage.prompt_tokens, (cached, answered)


def test_a_wrong_api_key_is_an_authentication_error(serve_tiny_build):
    server = start_server(serve_tiny_build, api_key="s3cret")
    try:
        wrong = openai.OpenAI(base_url=server.http + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            wrong.models.list()
        assert "missing or wrong API key" in info.value.message and info.value.code == "invalid_api_key"
        right = openai.OpenAI(base_url=server.http + "/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in right.models.list()] == [server.model]
    finally:
        server.close()
