"""Text Generation Inference's own routes (``/generate``, ``/generate_stream``, ``/``, ``/info``): TGI's request rules
and answer shapes, the answers equal to the offline engine's, and huggingface_hub's ``InferenceClient`` (TGI's
client) against the server."""

from __future__ import annotations

import json

import pytest

from llmc.errors import RequestError
from llmc.request.outputs import StreamEvent, TokenLogprob
from llmc.request.params import SamplingParams
from llmc.serve.state import json_error
from llmc.serve.tgi_protocol import TokenEntries, finish_reason, parse_tgi_request, tgi_error
from tests.serve.conftest import start_server
from tests.serve.test_server import events_until_shutdown, metric, sse

PROMPT = "Request 3: tell me about rivers"


def parse(body: dict, defaults: SamplingParams = SamplingParams(temperature=0.0)):
    return parse_tgi_request(body, defaults, 512, 256, 1000)


def greedy(offline, prompt, n, **kw):
    return offline.generate([prompt], SamplingParams(max_new_tokens=n, temperature=0.0, **kw))[0]


# ------------------------------------------------------------------------------------------------- parsing
@pytest.mark.parametrize("parameters, greedy_recipe, recipe_at_07", [
    (None, 1.0, 0.7),  # TGI's default parameters sample (a greedy recipe samples at 1.0)
    ({}, 0.0, 0.0),  # do_sample defaults to false: greedy
    ({"do_sample": False, "temperature": 1.0}, 0.0, 0.0),  # 1.0 asks for no sampling warper
    ({"temperature": 0.5}, 0.5, 0.5),
    ({"top_k": 5}, 1.0, 0.7),
    ({"top_p": 0.9}, 1.0, 0.7),
    ({"do_sample": True}, 1.0, 0.7),
])
def test_greedy_unless_the_body_asks_to_sample(parameters, greedy_recipe, recipe_at_07):
    body = {"inputs": "hi"} if parameters is None else {"inputs": "hi", "parameters": parameters}
    assert parse(body).params.temperature == greedy_recipe
    assert parse(body, SamplingParams(temperature=0.7)).params.temperature == recipe_at_07


def test_length_stop_details_and_log_probabilities():
    got = parse({"inputs": "hi", "parameters": {"stop": ["\n"], "top_n_tokens": 3}})
    assert got.params.max_new_tokens == 512 and not got.strict  # absent: the room max_seq_len leaves
    assert got.params.include_stop_str_in_output and got.params.stop == ("\n",)  # TGI keeps the stop sequence
    assert got.params.logprobs == 3 and got.top_n_tokens == 3 and got.params.prompt_logprobs is None
    given = parse({"inputs": "hi", "parameters": {"max_new_tokens": 7, "decoder_input_details": True}})
    assert given.params.max_new_tokens == 7 and given.strict and given.details and given.params.prompt_logprobs == 0
    assert given.params.logprobs == 0  # a token's log-probability is always in TGI's answer
    full = parse({"inputs": "hi", "parameters": {"return_full_text": False, "truncate": 2, "seed": 5},
                  "add_special_tokens": False, "stream": True})
    assert (full.return_full_text, full.truncate, full.params.seed, full.add_special_tokens, full.stream) == (
        False, 2, 5, False, True)


@pytest.mark.parametrize("grammar, expected", [
    ({"type": "json", "value": {"type": "object"}}, {"type": "json_schema", "schema": {"type": "object"}}),
    ({"type": "json", "value": '{"type": "object"}'}, {"type": "json_schema", "schema": {"type": "object"}}),
    ({"type": "json_object", "value": {"type": "object"}}, {"type": "json_schema", "schema": {"type": "object"}}),
    ({"type": "json_schema", "value": {"name": "x", "schema": {"type": "object"}}},
     {"type": "json_schema", "schema": {"type": "object"}}),
    ({"type": "regex", "value": "[0-9]+"}, {"type": "regex", "pattern": "[0-9]+"}),
])
def test_grammars_become_output_formats(grammar, expected):
    got = parse({"inputs": "hi", "parameters": {"grammar": grammar}}).params.structured
    assert got.kind == expected["type"]
    assert (json.loads(got.spec) if got.kind == "json_schema" else got.spec) == expected.get("schema",
                                                                                           expected.get("pattern"))


@pytest.mark.parametrize("body, field", [
    ({"inputs": ""}, "inputs"),
    ({"inputs": ["a"]}, "inputs"),
    ({"inputs": "hi", "prompt": "x"}, "prompt"),
    ({"inputs": "hi", "parameters": "x"}, "parameters"),
    ({"inputs": "hi", "parameters": {"max_tokens": 5}}, "parameters.max_tokens"),
    ({"inputs": "hi", "parameters": {"best_of": 2}}, "parameters.best_of"),
    ({"inputs": "hi", "parameters": {"typical_p": 0.9}}, "parameters.typical_p"),
    ({"inputs": "hi", "parameters": {"watermark": True}}, "parameters.watermark"),
    ({"inputs": "hi", "parameters": {"adapter_id": "lora-1"}}, "parameters.adapter_id"),
    ({"inputs": "hi", "parameters": {"top_n_tokens": 21}}, "parameters.top_n_tokens"),
    ({"inputs": "hi", "parameters": {"truncate": 0}}, "parameters.truncate"),
    ({"inputs": "hi", "parameters": {"truncate": 257}}, "parameters.truncate"),
    ({"inputs": "hi", "parameters": {"temperature": -1}}, "parameters.temperature"),
    ({"inputs": "hi", "parameters": {"top_p": 1.5}}, "parameters.top_p"),
    ({"inputs": "hi", "parameters": {"max_new_tokens": 0}}, "parameters.max_new_tokens"),
    ({"inputs": "hi", "parameters": {"do_sample": "yes"}}, "parameters.do_sample"),
    ({"inputs": "hi", "stream": "yes"}, "stream"),
    ({"inputs": "hi", "parameters": {"grammar": {"type": "lark", "value": "x"}}}, "parameters.grammar"),
    ({"inputs": "hi", "parameters": {"grammar": {"type": "json", "value": "{"}}}, "parameters.grammar.value"),
    ({"inputs": "hi", "parameters": {"grammar": {"type": "json_schema", "value": {"type": "object"}}}},
     "parameters.grammar.value"),
])
def test_bad_bodies_name_the_field(body, field):
    with pytest.raises(RequestError) as err:
        parse(body)
    assert err.value.field == field, err.value
    assert "strict_max_tokens" not in err.value.message and "logprobs" not in err.value.message


def test_what_asks_for_nothing_unsupported_is_accepted():
    got = parse({"inputs": "hi", "parameters": {"best_of": 1, "typical_p": 1.0, "watermark": False, "adapter_id": None,
                                                "details": None, "seed": None}})
    assert got.params.seed is None and not got.details


def test_errors_have_tgi_s_statuses_and_error_types():
    assert tgi_error(400, "x") == (422, {"error": "x", "error_type": "validation"})
    assert tgi_error(503, "full", "queue_full") == (429, {"error": "full", "error_type": "overloaded"})
    assert tgi_error(500, "boom") == (424, {"error": "boom", "error_type": "generation"})
    reply = json_error("/generate", 401, "missing key", code="invalid_api_key")
    assert reply.status == 401 and json.loads(reply.body) == {"error": "missing key", "error_type": "authentication"}


def test_finish_reasons_and_token_entries():
    assert finish_reason(StreamEvent("r", "", (5,), True, "length")) == "length"
    assert finish_reason(StreamEvent("r", "", (5,), True, "stop", "\n")) == "stop_sequence"
    assert finish_reason(StreamEvent("r", "", (2,), True, "stop", 2)) == "eos_token"

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return f"<{ids[0]}>"

    entries = TokenEntries(Tok(), frozenset({2}))
    event = StreamEvent("r", "ab", (7, 2), True, "stop", 2,
                        logprobs=(TokenLogprob(7, -0.5, ((7, -0.5), (8, -1.0))), TokenLogprob(2, float("-inf"))))
    (first, top), (last, _) = entries.generated(event)  # two tokens in one step (speculative decoding)
    assert first == {"id": 7, "text": "", "logprob": -0.5, "special": False}
    assert last == {"id": 2, "text": "ab", "logprob": None, "special": True}  # the step's text, on its last token
    assert [t["text"] for t in top] == ["<7>", "<8>"]
    assert entries.prefill((4, 7), (TokenLogprob(7, -2.0),)) == [{"id": 4, "text": "<4>", "logprob": None},
                                                                 {"id": 7, "text": "<7>", "logprob": -2.0}]


# ------------------------------------------------------------------------------------------------- server
def test_generate_equals_the_offline_engine_with_details(tiny_server, offline):
    expected = greedy(offline, PROMPT, 8, logprobs=2)
    status, reply = tiny_server.post("/generate", {"inputs": PROMPT, "parameters": {
        "max_new_tokens": 8, "details": True, "top_n_tokens": 2}})
    assert status == 200 and reply["generated_text"] == expected.text, reply
    details = reply["details"]
    assert details["finish_reason"] == "length" and details["generated_tokens"] == 8 and details["seed"] is None
    assert [t["id"] for t in details["tokens"]] == list(expected.token_ids) and details["prefill"] == []
    assert "".join(t["text"] for t in details["tokens"]) == expected.text
    assert [t["logprob"] for t in details["tokens"]] == pytest.approx([lp.logprob for lp in expected.logprobs])
    assert [[t["id"] for t in top] for top in details["top_tokens"]] == [[t for t, _ in lp.top]
                                                                         for lp in expected.logprobs]


def test_compat_route_answers_a_list_with_the_prompt_first(tiny_server, offline):
    expected = greedy(offline, PROMPT, 5).text
    status, reply = tiny_server.post("/", {"inputs": PROMPT, "parameters": {"max_new_tokens": 5}})
    assert status == 200 and reply == [{"generated_text": PROMPT + expected}], reply
    status, reply = tiny_server.post("/", {"inputs": PROMPT, "parameters": {"max_new_tokens": 5,
                                                                            "return_full_text": False}})
    assert reply == [{"generated_text": expected}]
    status, reply = tiny_server.post("/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 5,
                                                                                    "return_full_text": True}})
    assert reply == {"generated_text": PROMPT + expected}


@pytest.mark.parametrize("path, body", [
    ("/generate_stream", {}),
    ("/", {"stream": True}),
])
def test_stream_has_one_event_per_token_and_the_whole_text_last(tiny_server, offline, path, body):
    expected = greedy(offline, PROMPT, 6, logprobs=1)
    events = sse(tiny_server, path, {"inputs": PROMPT, **body, "parameters": {
        "max_new_tokens": 6, "details": True, "top_n_tokens": 1, "return_full_text": False}})
    assert [e["index"] for e in events] == [1, 2, 3, 4, 5, 6]
    assert [e["token"]["id"] for e in events] == list(expected.token_ids)
    assert "".join(e["token"]["text"] for e in events) == events[-1]["generated_text"] == expected.text
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    assert events[-1]["details"] == {"finish_reason": "length", "generated_tokens": 6, "seed": None,
                                     "input_length": len(offline.tokenize(PROMPT))}
    assert [[t["id"] for t in e["top_tokens"]] for e in events] == [[lp.top[0][0]] for lp in expected.logprobs]


def test_prefill_details_are_the_prompt_s_log_probabilities(tiny_server, offline):
    expected = greedy(offline, PROMPT, 2, prompt_logprobs=0)
    status, reply = tiny_server.post("/generate", {"inputs": PROMPT, "parameters": {
        "max_new_tokens": 2, "decoder_input_details": True}})
    assert status == 200, reply
    prefill = reply["details"]["prefill"]
    assert [t["id"] for t in prefill] == list(offline.tokenize(PROMPT)) and prefill[0]["logprob"] is None
    assert [t["logprob"] for t in prefill[1:]] == pytest.approx([lp.logprob for lp in expected.prompt_logprobs])


def test_stop_sequence_stays_in_the_text(tiny_server, offline):
    text = greedy(offline, PROMPT, 12).text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    status, reply = tiny_server.post("/generate", {"inputs": PROMPT, "parameters": {
        "max_new_tokens": 12, "stop": [stop], "details": True}})
    assert status == 200 and reply["details"]["finish_reason"] == "stop_sequence", reply
    assert reply["generated_text"] == text[:text.index(stop) + len(stop)]


def test_truncate_keeps_the_prompt_s_last_tokens(tiny_server, offline):
    ids = offline.tokenize(PROMPT)
    expected = greedy(offline, list(ids[-3:]), 4).text
    events = sse(tiny_server, "/generate_stream", {"inputs": PROMPT, "parameters": {
        "max_new_tokens": 4, "truncate": 3, "details": True}})
    assert events[-1]["generated_text"] == expected and events[-1]["details"]["input_length"] == 3


@pytest.mark.parametrize("path, body, field", [
    ("/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 600}}, "parameters.max_new_tokens"),
    ("/generate", {"inputs": PROMPT, "stream": True}, "stream"),
    ("/generate_stream", {"inputs": PROMPT, "parameters": {"decoder_input_details": True}},
     "parameters.decoder_input_details"),
    ("/", {"inputs": PROMPT, "parameters": {"watermark": True}}, "parameters.watermark"),
    ("/", {"inputs": "word " * 400}, "inputs"),
])
def test_bad_requests_are_a_422_validation_error(tiny_server, path, body, field):
    before = metric(tiny_server, 'llmc_requests_rejected_total{reason="invalid"}')
    status, reply = tiny_server.post(path, body)
    assert status == 422 and reply["error_type"] == "validation" and reply["error"].startswith(field + ":"), reply
    assert metric(tiny_server, 'llmc_requests_rejected_total{reason="invalid"}') == before + 1


def test_info_describes_the_model_and_limits(tiny_server):
    status, reply = tiny_server.get("/info")
    assert status == 200 and reply["model_id"] == tiny_server.model and reply["model_pipeline_tag"] == "text-generation"
    assert (reply["max_input_tokens"], reply["max_total_tokens"], reply["max_best_of"]) == (256, 512, 1)


def test_huggingface_hub_inference_client(tiny_server, offline):
    """TGI's client: text, details, streaming and a validation error, as huggingface_hub parses them."""
    from huggingface_hub import InferenceClient
    from huggingface_hub.errors import ValidationError

    client = InferenceClient(tiny_server.http)
    expected = greedy(offline, PROMPT, 5).text
    assert client.text_generation(PROMPT, max_new_tokens=5, return_full_text=False) == expected
    assert client.text_generation(PROMPT, max_new_tokens=5) == PROMPT + expected
    out = client.text_generation(PROMPT, max_new_tokens=5, details=True, decoder_input_details=True)
    assert out.details.generated_tokens == 5 and len(out.details.prefill) == len(offline.tokenize(PROMPT))
    assert "".join(client.text_generation(PROMPT, max_new_tokens=5, stream=True)) == expected
    with pytest.raises(ValidationError, match="parameters.watermark"):
        client.text_generation(PROMPT, max_new_tokens=5, watermark=True)


def test_tgi_s_model_placeholders_reach_the_served_model(tiny_server, offline):
    """TGI ignores a request's model; its clients send "tgi" (LiteLLM's huggingface provider) or "dummy"
    (huggingface_hub given a URL). Any other name is still a 404, and the placeholders are no model of /v1/models."""
    expected = greedy(offline, PROMPT, 4).text
    for name in ("tgi", "dummy"):
        status, reply = tiny_server.post("/v1/completions", {"model": name, "prompt": PROMPT, "max_tokens": 4})
        assert status == 200 and reply["choices"][0]["text"] == expected, reply
        assert tiny_server.get(f"/v1/models/{name}")[0] == 404
    assert tiny_server.post("/v1/completions", {"model": "other", "prompt": PROMPT, "max_tokens": 4})[0] == 404


def test_huggingface_hub_chat_with_a_schema(tiny_server):
    """huggingface_hub's chat client against a URL: model "dummy", and an OpenAI json_schema format sent in TGI's
    shape; the answer follows the schema."""
    from huggingface_hub import InferenceClient

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"]}
    out = InferenceClient(tiny_server.http).chat_completion(
        [{"role": "user", "content": "A digit?"}], max_tokens=16,
        response_format={"type": "json_schema", "json_schema": {"name": "d", "schema": schema}})
    answer = json.loads(out.choices[0].message.content)
    assert set(answer) == {"n"} and 0 <= answer["n"] <= 9, answer


def test_an_aborted_request_ends_with_tgi_s_incomplete_generation(serve_tiny_build, offline):
    """The server stopping under a stream (its engine aborts every request): the stream's last event is TGI's
    ``incomplete_generation`` error, not a token."""
    assert greedy(offline, PROMPT, 480).finish_reason == "length"  # the request would not end on its own first
    server = start_server(serve_tiny_build)
    try:
        events = events_until_shutdown(server, "/generate_stream", {"inputs": PROMPT,
                                                                    "parameters": {"max_new_tokens": 480}})
    finally:
        server.close()
    assert "token" in events[0] and 1 < len(events) < 481
    assert events[-1]["error_type"] == "incomplete_generation" and "aborted" in events[-1]["error"], events[-1]
