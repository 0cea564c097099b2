"""The ensemble's guided-decoding inputs (tensorrtllm_backend's ``guided_decoding_guide_type`` and
``guided_decoding_guide``) on ``llmc serve``'s KServe endpoints: the generate extension's JSON, tritonclient HTTP
``/infer`` and gRPC ModelInfer; each answer equals the offline engine's with the same output format."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from llmc.errors import RequestError
from llmc.request.params import SamplingParams
from llmc.request.structured import OutputFormat
from llmc.serve.protocol import parse_generate_fields
from tests.serve.test_ensemble_logprobs import inputs, text_of

DEFAULTS = SamplingParams(max_new_tokens=16, temperature=0.0)
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


def guided(guide_type, guide=None):
    fields = {"text_input": "hi", "max_tokens": 8, "guided_decoding_guide_type": guide_type}
    if guide is not None:
        fields["guided_decoding_guide"] = guide
    return parse_generate_fields(fields, DEFAULTS).params.structured


def test_guide_types_map_onto_output_formats():
    assert guided("json") == OutputFormat("json_object")
    assert guided("json_schema", json.dumps(SCHEMA)) == OutputFormat.from_dict({"type": "json_schema",
                                                                                "schema": SCHEMA})
    assert guided("regex", "[0-9]+") == OutputFormat("regex", "[0-9]+")
    assert guided("ebnf_grammar", 'root ::= "a"') == OutputFormat("ebnf", 'root ::= "a"')
    assert parse_generate_fields({"text_input": "hi", "max_tokens": 8}, DEFAULTS).params.structured is None


@pytest.mark.parametrize("guide_type, guide, field, words", [
    ("structural_tag", "{}", "guided_decoding_guide_type", "must be one of json, json_schema, regex, ebnf_grammar"),
    ("regex", None, "guided_decoding_guide", "is required with guided_decoding_guide_type 'regex'"),
    ("json_schema", "{not json", "guided_decoding_guide", "must be a JSON schema as JSON text"),
    (None, "[0-9]", "guided_decoding_guide", "needs guided_decoding_guide_type"),
])
def test_bad_guides_name_the_ensemble_field(guide_type, guide, field, words):
    fields = {"text_input": "hi", "max_tokens": 8, "guided_decoding_guide_type": guide_type,
              "guided_decoding_guide": guide}
    with pytest.raises(RequestError) as info:
        parse_generate_fields({k: v for k, v in fields.items() if v is not None}, DEFAULTS)
    assert info.value.field == field and words in info.value.message


def offline_text(offline, prompt, fmt, n=12) -> str:
    return offline.generate([prompt], SamplingParams(max_new_tokens=n, temperature=0.0, structured=fmt))[0].text


def test_generate_json_follows_the_guide_and_names_the_guide_in_errors(tiny_server, offline):
    body = {"text_input": "Is it on?", "max_tokens": 12, "temperature": 0.0,
            "guided_decoding_guide_type": "json_schema", "guided_decoding_guide": json.dumps(SCHEMA)}
    status, reply = tiny_server.post("/v2/models/ensemble/generate", body)
    assert status == 200 and json.loads(reply["text_output"]) in ({"ok": True}, {"ok": False})
    assert reply["text_output"] == offline_text(offline, "Is it on?", {"type": "json_schema", "schema": SCHEMA})
    status, reply = tiny_server.post("/v2/models/ensemble/generate", {**body, "guided_decoding_guide_type": "regex",
                                                                      "guided_decoding_guide": "(("})
    assert status == 400 and reply["error"].startswith("guided_decoding_guide: is not a valid regex format")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_tritonclient_infer_follows_the_guide(tiny_server, offline, protocol):
    if protocol == "http":
        import tritonclient.http as module
        client = module.InferenceServerClient(tiny_server.http.removeprefix("http://"))
    else:
        import tritonclient.grpc as module
        client = module.InferenceServerClient(tiny_server.grpc)
    guide = {"guided_decoding_guide_type": np.array([[b"regex"]], dtype=np.object_),
             "guided_decoding_guide": np.array([[b"[a-c]{4}"]], dtype=np.object_)}
    result = client.infer("ensemble", inputs(module, "Letters:", 12, **guide))
    text = text_of(result.as_numpy("text_output"))
    assert re.fullmatch("[a-c]{4}", text) and text == offline_text(offline, "Letters:", {"type": "regex",
                                                                                        "pattern": "[a-c]{4}"})
    client.close()
