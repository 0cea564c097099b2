"""Structured outputs and ``logit_bias`` through ``llmc serve``'s OpenAI routes and OpenAI's own client:
``response_format`` (``json_schema``, ``json_object``) and llmc's ``structured`` field (regex, choice, grammars),
answers equal the offline engine's with the same format, streams equal whole answers, errors name the client's
field."""

from __future__ import annotations

import json
import re

import openai
import pytest

from llmc.request.params import SamplingParams

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}
USER = [{"role": "user", "content": "Is water wet? Answer in JSON."}]


def offline_text(offline, prompt, **params) -> str:
    return offline.generate([prompt], SamplingParams(temperature=0.0, **params))[0].text


def test_chat_json_schema_answers_parse_and_equal_the_offline_engine(client, tiny_server, offline):
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    reply = client.chat.completions.create(model=tiny_server.model, messages=USER, max_tokens=20, temperature=0,
                                           response_format=response_format)
    content = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop" and json.loads(content)["answer"] in ("yes", "no")
    assert content == offline_text(offline, USER, max_new_tokens=20,
                                   structured={"type": "json_schema", "schema": SCHEMA})
    stream = client.chat.completions.create(model=tiny_server.model, messages=USER, max_tokens=20, temperature=0,
                                            response_format=response_format, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == content


def test_completions_take_llmcs_structured_field_and_several_choices(client, tiny_server, offline):
    structured = {"type": "regex", "pattern": "[0-9]{2}:[0-9]{2}"}
    reply = client.completions.create(model=tiny_server.model, prompt="The time is", max_tokens=12, temperature=0.8,
                                      seed=3, n=3, extra_body={"structured": structured})
    assert [c.finish_reason for c in reply.choices] == ["stop"] * 3
    assert all(re.fullmatch(structured["pattern"], c.text) for c in reply.choices)
    choice = {"type": "choice", "choices": ["north", "south"]}
    reply = client.completions.create(model=tiny_server.model, prompt="Go", max_tokens=8, temperature=0,
                                      extra_body={"structured": choice})
    assert reply.choices[0].text == offline_text(offline, "Go", max_new_tokens=8, structured=choice)
    assert reply.choices[0].text in ("north", "south")
    reply = client.chat.completions.create(model=tiny_server.model, messages=USER, max_tokens=30, temperature=0,
                                           response_format={"type": "json_object"})
    assert reply.choices[0].message.content.startswith("{")  # the tiny random model may not close it in 30 tokens


def test_logit_bias_reaches_the_sampler(client, tiny_server, offline):
    reply = client.completions.create(model=tiny_server.model, prompt="Snow", max_tokens=4, temperature=0,
                                      logit_bias={"7": 100}, logprobs=0)
    assert reply.choices[0].logprobs.tokens and reply.choices[0].text == offline_text(
        offline, "Snow", max_new_tokens=4, logit_bias={"7": 100})
    assert offline.generate(["Snow"], SamplingParams(temperature=0.0, max_new_tokens=4, logit_bias={"7": 100})
                            )[0].token_ids == (7, 7, 7, 7)


@pytest.mark.parametrize("kwargs, param, words", [
    ({"response_format": {"type": "xml"}}, "response_format", '"structured" field also takes regex'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema",
     'the JSON schema under "schema"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}},
     "response_format", "is not a valid json_schema format"),
    ({"extra_body": {"structured": {"type": "regex", "pattern": "(("}}}, "structured", "not a valid regex format"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"structured": {"type": "json_object"}}},
     "structured", "both set an output format"),
    ({"logit_bias": {"7": 500}}, "logit_bias", "biases are numbers in [-100, 100]"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias", "ids must be distinct integers"),
])
def test_bad_formats_and_biases_are_400s_naming_the_clients_field(client, tiny_server, kwargs, param, words):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=tiny_server.model, messages=USER, max_tokens=4, stream=stream,
                                           **kwargs)
        assert info.value.param == param and words in info.value.message, info.value.body
    assert not tiny_server.engine.scheduler.has_unfinished()
