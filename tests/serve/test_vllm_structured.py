"""vLLM's structured-output fields (``structured_outputs``, the older ``guided_*``) on the OpenAI routes: read as
llmc's formats, answers equal the offline engine's with the same format, errors name vLLM's field."""

from __future__ import annotations

import json
import re

import openai
import pytest

from llmc.errors import RequestError
from llmc.request.params import SamplingParams
from llmc.serve.openai_protocol import parse_openai_request
from llmc.serve.vllm_structured import vllm_output_format

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
EBNF = 'root ::= "north" | "south"'
LARK = 'start: "north" | "south"'
USER = [{"role": "user", "content": "Is water wet? Answer in JSON."}]


@pytest.mark.parametrize("body, structured, field", [
    ({"structured_outputs": {"json": SCHEMA}}, {"type": "json_schema", "schema": SCHEMA}, "structured_outputs.json"),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, {"type": "json_schema", "schema": SCHEMA},
     "structured_outputs.json"),
    ({"structured_outputs": {"regex": "[0-9]+", "whitespace_pattern": None}}, {"type": "regex", "pattern": "[0-9]+"},
     "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["a", "b"], "disable_fallback": False}}, {"type": "choice", "choices": ["a", "b"]},
     "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": EBNF}}, {"type": "ebnf", "grammar": EBNF}, "structured_outputs.grammar"),
    ({"structured_outputs": {"grammar": LARK}}, {"type": "grammar", "grammar": LARK}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json_object": True, "json": None}}, {"type": "json_object"},
     "structured_outputs.json_object"),
    ({"guided_json": json.dumps(SCHEMA), "guided_decoding_backend": "xgrammar"},
     {"type": "json_schema", "schema": SCHEMA}, "guided_json"),
    ({"guided_regex": "[a-z]+"}, {"type": "regex", "pattern": "[a-z]+"}, "guided_regex"),
    ({"guided_choice": ["yes", "no"]}, {"type": "choice", "choices": ["yes", "no"]}, "guided_choice"),
    ({"guided_grammar": EBNF}, {"type": "ebnf", "grammar": EBNF}, "guided_grammar"),
    ({"guided_choice": None, "prompt": "x"}, None, ""),
])
def test_vllm_fields_read_as_llmc_formats(body, structured, field):
    assert vllm_output_format(body) == (structured, field)
    if structured is not None:  # the request carries the same format as llmc's own field gives it
        params = parse_openai_request({"prompt": "Hi", **body}, False, ("m",), SamplingParams()).params
        assert params.structured == parse_openai_request({"prompt": "Hi", "structured": structured}, False, ("m",),
                                                         SamplingParams()).params.structured


@pytest.mark.parametrize("body, field, words", [
    ({"structured_outputs": "regex"}, "structured_outputs", "must be an object"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp", "unknown option"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
     "not supported"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "not supported"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
    ({"structured_outputs": {"json": "[1]"}}, "structured_outputs.json", "JSON schema"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object", "must be true"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_regex": ""}, "guided_regex", "non-empty string"),
    ({"guided_grammar": 3}, "guided_grammar", "non-empty string"),
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex", "both set the output format"),
    ({"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "not supported"),
])
def test_bad_vllm_fields_name_the_field(body, field, words):
    with pytest.raises(RequestError) as err:
        vllm_output_format(body)
    assert err.value.field == field and words in str(err.value)


@pytest.mark.parametrize("other", [{"response_format": {"type": "json_object"}},
                                   {"structured": {"type": "regex", "pattern": "a"}}])
def test_a_second_format_is_refused(other):
    with pytest.raises(RequestError) as err:
        parse_openai_request({"prompt": "Hi", "guided_regex": "a", **other}, False, ("m",), SamplingParams())
    assert err.value.field == "guided_regex" and next(iter(other)) in str(err.value)
    plain_text = {"prompt": "Hi", "guided_regex": "a", "response_format": {"type": "text"}}
    assert parse_openai_request(plain_text, False, ("m",), SamplingParams()).params.structured is not None


def offline_text(offline, prompt, **params) -> str:
    return offline.generate([prompt], SamplingParams(temperature=0.0, **params))[0].text


def test_vllm_clients_get_the_answers_llmc_s_formats_give(client, tiny_server, offline):
    def complete(prompt, extra):
        return client.completions.create(model=tiny_server.model, prompt=prompt, max_tokens=12, temperature=0,
                                         extra_body=extra).choices[0].text

    choice = complete("Go", {"guided_choice": ["north", "south"]})
    assert choice in ("north", "south") and choice == offline_text(
        offline, "Go", max_new_tokens=12, structured={"type": "choice", "choices": ["north", "south"]})
    assert complete("Go", {"structured_outputs": {"grammar": EBNF}}) == offline_text(
        offline, "Go", max_new_tokens=12, structured={"type": "ebnf", "grammar": EBNF})
    timed = complete("The time is", {"structured_outputs": {"regex": "[0-9]{2}:[0-9]{2}"}})
    assert re.fullmatch("[0-9]{2}:[0-9]{2}", timed)
    reply = client.chat.completions.create(model=tiny_server.model, messages=USER, max_tokens=20, temperature=0,
                                           extra_body={"structured_outputs": {"json": json.dumps(SCHEMA)}})
    assert reply.choices[0].message.content == offline_text(
        offline, USER, max_new_tokens=20, structured={"type": "json_schema", "schema": SCHEMA})


def test_a_bad_pattern_is_named_in_the_client_s_field(client, tiny_server):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=tiny_server.model, prompt="Go", max_tokens=4,
                                  extra_body={"structured_outputs": {"regex": "(("}})
    assert err.value.body["param"] == "structured_outputs.regex" and "regex" in err.value.body["message"]
