"""vLLM's utility routes (``/health``, ``/version``, ``/tokenize``, ``/detokenize``): guidellm's backend check, and
token counts equal to what the completion routes run on."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from llmc import __version__
from llmc.errors import RequestError, UnknownModelError
from llmc.request.inputs import ChatPrompt
from llmc.request.params import SamplingParams
from llmc.serve.openai_protocol import parse_openai_request
from llmc.serve.state import STATE_KEY, auth_and_errors
from llmc.serve.vllm_api import TokenizeRequest, health, parse_detokenize, parse_tokenize
from tests.serve.conftest import start_server

KEY = {"Authorization": "Bearer s3cret"}
SERVED = ("tiny", "ensemble")
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def server(serve_tiny_build):
    running = start_server(serve_tiny_build, api_key="s3cret")
    yield running
    running.close()


def tokenize(server, body: dict) -> dict:
    status, reply = server.post("/tokenize", body, KEY)
    assert status == 200, reply
    assert reply["count"] == len(reply["tokens"]) and reply["max_model_len"] == 512
    return reply


def prompt_tokens(server, route: str, body: dict) -> int:
    status, reply = server.post(route, {**body, "max_tokens": 1}, KEY)
    assert status == 200, reply
    return reply["usage"]["prompt_tokens"]


# ------------------------------------------------------------------------------------------------- parsing
def test_messages_are_parsed_by_the_chat_route_s_own_parser():
    defaults = SamplingParams()
    chat = parse_openai_request({"messages": USER, "tools": [WEATHER], "tool_choice": "required"}, True, SERVED,
                                defaults).prompt
    got = parse_tokenize({"messages": USER, "tools": [WEATHER]}, SERVED, defaults)
    assert got == TokenizeRequest(chat) and got.prompt.tools == (WEATHER,)
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": " it?"}]}]
    plain = parse_tokenize({"messages": parts, "add_generation_prompt": False, "return_token_strs": True}, SERVED,
                           defaults)
    assert plain == TokenizeRequest(ChatPrompt(({"role": "user", "content": "What is it?"},),
                                               generation_prompt=False), None, True)
    assert parse_tokenize({"prompt": "Hi", "add_special_tokens": False}, SERVED, defaults) == TokenizeRequest(
        "Hi", False)


@pytest.mark.parametrize("body, field, words", [
    ({}, "prompt", 'either "prompt"'),
    ({"prompt": "Hi", "messages": USER}, "prompt", 'either "prompt"'),
    ({"prompt": ""}, "prompt", "non-empty string"),
    ({"prompt": [1, 2]}, "prompt", "non-empty string"),
    ({"prompt": "Hi", "add_generation_prompt": True}, "add_generation_prompt", "goes with messages"),
    ({"prompt": "Hi", "max_tokens": 3}, "max_tokens", "unknown field"),
    ({"prompt": "Hi", "return_token_strs": "yes"}, "return_token_strs", "true or false"),
    ({"messages": USER, "tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "unknown field"),
    ({"messages": USER, "prompt_logprobs": 1}, "prompt_logprobs", "unknown field"),
    ({"messages": USER, "add_special_tokens": True}, "add_special_tokens", "writes its own special tokens"),
    ({"messages": USER, "continue_final_message": True}, "continue_final_message", "must be the assistant's"),
    ({"messages": USER, "continue_final_message": True, "add_generation_prompt": True}, "continue_final_message",
     "at most one"),
    ({"messages": [{"role": "pirate", "content": "Arr"}]}, "messages[0].role", ""),
    ({"messages": USER, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools", ""),
])
def test_bad_tokenize_bodies_name_the_field(body, field, words):
    with pytest.raises(RequestError) as err:
        parse_tokenize(body, SERVED, SamplingParams())
    assert err.value.field == field and words in str(err.value)


def test_unknown_models_and_bad_ids():
    for body in ({"model": "gpt-4", "prompt": "Hi"}, {"model": "gpt-4", "messages": USER}):
        with pytest.raises(UnknownModelError):
            parse_tokenize(body, SERVED, SamplingParams())
    assert parse_detokenize({"model": "ensemble", "tokens": [3, 4]}, SERVED, 10) == [3, 4]
    for tokens, words in (([3, 10], "outside the vocabulary [0, 10)"), ([True], "list of token ids"),
                          ("3 4", "list of token ids")):
        with pytest.raises(RequestError, match=words.replace("[", r"\[").replace(")", r"\)")):
            parse_detokenize({"tokens": tokens}, SERVED, 10)
    with pytest.raises(RequestError, match="unknown field"):
        parse_detokenize({"tokens": [1], "skip_special_tokens": True}, SERVED, 10)


# ------------------------------------------------------------------------------------------------- routes
def test_health_needs_no_key_and_version_is_llmc_s(server):
    assert server.get("/health") == (200, "")
    assert server.get("/version")[0] == 401
    assert server.get("/version", KEY) == (200, {"version": __version__})


def test_health_is_503_while_draining():
    app = web.Application()
    app[STATE_KEY] = SimpleNamespace(key_matches=lambda *_: True, client=SimpleNamespace(draining=True))
    reply = asyncio.run(auth_and_errors(make_mocked_request("GET", "/health", app=app), health))
    assert reply.status == 503 and reply.headers["Retry-After"] == "5"
    app[STATE_KEY].client.draining = False
    assert asyncio.run(auth_and_errors(make_mocked_request("GET", "/health", app=app), health)).status == 200


def test_text_is_counted_as_completions_runs_it(server):
    text = "Once upon a time, in a land far away"
    reply = tokenize(server, {"prompt": text, "return_token_strs": True})
    assert reply["tokens"] == list(server.engine.tokenize(text))
    assert reply["count"] == prompt_tokens(server, "/v1/completions", {"prompt": text})
    assert reply["token_strs"] == server.engine.tokenizer.convert_ids_to_tokens(reply["tokens"])
    assert tokenize(server, {"prompt": text})["token_strs"] is None
    ids = server.engine.tokenizer(text, add_special_tokens=True)["input_ids"]
    assert tokenize(server, {"model": "ensemble", "prompt": text, "add_special_tokens": True})["tokens"] == ids


def test_messages_are_counted_as_chat_runs_them(server):
    for extra in ({}, {"tools": [WEATHER]}, {"chat_template_kwargs": {"enable_thinking": False}}):
        body = {"messages": USER, **extra}
        chat = {**body, "tool_choice": "required"} if "tools" in extra else body
        reply = tokenize(server, body)
        assert reply["count"] == prompt_tokens(server, "/v1/chat/completions", chat), extra
    with_tools, plain = tokenize(server, {"messages": USER, "tools": [WEATHER]}), tokenize(server, {"messages": USER})
    assert with_tools["count"] > plain["count"]  # the tools are in the prompt
    no_opening = tokenize(server, {"messages": USER, "add_generation_prompt": False})
    assert plain["tokens"][:no_opening["count"]] == no_opening["tokens"] and no_opening["count"] < plain["count"]


def test_a_final_assistant_message_is_continued_open(server):
    prefill = [*USER, {"role": "assistant", "content": "The weather in Paris is"}]
    opened = tokenize(server, {"messages": prefill, "continue_final_message": True, "return_token_strs": True})
    closed = tokenize(server, {"messages": prefill, "add_generation_prompt": False})
    text = server.engine.tokenizer.decode(opened["tokens"])
    assert text.endswith("The weather in Paris is") and opened["count"] < closed["count"]
    assert closed["tokens"][:opened["count"]] == opened["tokens"]  # the same up to the turn's end


def test_a_prompt_over_the_input_limit_is_counted_not_refused(server):
    text = "word " * 400  # more than the tiny build's max_input_len of 256 tokens
    reply = tokenize(server, {"prompt": text})
    assert reply["count"] > 256
    status, error = server.post("/v1/completions", {"prompt": text, "max_tokens": 1}, KEY)
    assert status == 400 and "max_input_len" in error["error"]["message"]


def test_detokenize_round_trips_and_errors_are_openai_s_not_counted(server):
    tokenizer = server.engine.tokenizer
    ids = tokenize(server, {"messages": USER})["tokens"]
    assert server.post("/detokenize", {"tokens": ids}, KEY) == (200, {"prompt": tokenizer.decode(ids)})
    assert server.post("/detokenize", {"tokens": []}, KEY) == (200, {"prompt": ""})
    before = server.get("/metrics", KEY)[1]
    status, reply = server.post("/tokenize", {"prompt": "Hi", "max_tokens": 2}, KEY)
    assert status == 400 and reply["error"]["param"] == "max_tokens" and reply["error"]["type"] == "invalid_request_error"
    status, reply = server.post("/detokenize", {"tokens": [10**9]}, KEY)
    assert status == 400 and "outside the vocabulary" in reply["error"]["message"]
    status, reply = server.post("/tokenize", {"model": "gpt-4", "prompt": "Hi"}, KEY)
    assert status == 404 and reply["error"]["code"] == "model_not_found"
    assert server.get("/metrics", KEY)[1] == before  # no request to the model was refused or run
