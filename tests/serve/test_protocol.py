"""Ensemble field parsing (shared by HTTP, gRPC and the Triton llmc model) and KServe tensor decoding."""

from __future__ import annotations

import pytest

from llmc.errors import RequestError
from llmc.request.params import SamplingParams
from llmc.serve.protocol import flatten_generate_parameters, parse_generate_fields
from llmc.serve.tensors import decode_raw, deserialize_bytes, serialize_bytes, tensors_to_fields

DEFAULTS = SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=(2,))


def test_fields_map_onto_sampling_params():
    req = parse_generate_fields({"text_input": "hi", "max_tokens": [5], "stop_words": ["\n", ""], "end_id": 7,
                                 "temperature": 0.7, "top_k": 3, "min_length": 2, "random_seed": 9, "stream": True,
                                 "id": "abc", "min_p": 0.1}, DEFAULTS, vocab_size=100)
    p = req.params
    assert (req.prompt, req.stream, req.request_id) == ("hi", True, "abc")
    assert (p.max_new_tokens, p.stop, p.temperature, p.top_k, p.min_tokens, p.seed, p.min_p) == \
        (5, ("\n",), 0.7, 3, 2, 9, 0.1)
    assert set(p.stop_token_ids) == {2, 7}


def test_the_generate_extensions_parameters_object_reads_as_the_flat_request():
    """Triton's generate extension nests settings in "parameters"; each one that names an input is that input."""
    nested = flatten_generate_parameters({"id": "7", "text_input": "hi", "parameters": {
        "max_tokens": 5, "temperature": 0.5, "stream": False, "stop_words": "\n", "min_p": 0.2}})
    assert nested == {"id": "7", "text_input": "hi", "max_tokens": 5, "temperature": 0.5, "stream": False,
                      "stop_words": "\n", "min_p": 0.2}
    req = parse_generate_fields(nested, DEFAULTS, vocab_size=100)
    p = req.params
    assert (req.request_id, p.max_new_tokens, p.temperature, p.stop, p.min_p) == ("7", 5, 0.5, ("\n",), 0.2)
    assert flatten_generate_parameters({"text_input": "hi", "max_tokens": 1}) == {"text_input": "hi", "max_tokens": 1}
    assert flatten_generate_parameters({"text_input": "hi", "max_tokens": 1, "parameters": {}}) == \
        {"text_input": "hi", "max_tokens": 1}


@pytest.mark.parametrize("body, field, words", [
    ({"text_input": "x", "parameters": [1]}, "parameters", "must be an object"),
    ({"text_input": "x", "parameters": "max_tokens=3"}, "parameters", "must be an object"),
    ({"text_input": "x", "max_tokens": 3, "parameters": {"max_tokens": 4}}, "parameters.max_tokens", "top level"),
    ({"text_input": "x", "parameters": {"max_tokens": 3, "temprature": 0}}, "parameters.temprature", "temperature"),
    ({"text_input": "x", "parameters": {"max_tokens": 3, "id": "a"}}, "parameters.id", "unknown parameter"),
])
def test_a_bad_parameters_object_names_the_parameter(body, field, words):
    with pytest.raises(RequestError) as info:
        flatten_generate_parameters(body)
    assert str(info.value).startswith(field + ":") and words in str(info.value), str(info.value)


@pytest.mark.parametrize("fields, field", [
    ({"max_tokens": 3}, "text_input"), ({"text_input": "x"}, "max_tokens"),
    ({"text_input": "x", "max_tokens": 0}, "max_tokens"), ({"text_input": "x", "max_tokens": True}, "max_tokens"),
    ({"text_input": 5, "max_tokens": 1}, "text_input"), ({"text_input": "x", "max_tokens": 1, "stream": 1}, "stream"),
    ({"text_input": "x", "max_tokens": 1, "random_seed": -1}, "random_seed"),
    ({"text_input": "x", "max_tokens": 1, "top_p": 2.0}, "top_p"),
    ({"text_input": "x", "max_tokens": 1, "min_p": 0.1}, "min_p"),
    ({"text_input": "x", "max_tokens": 1, "stop_token_ids": False}, "stop_token_ids"),  # found by the fuzzer
    ({"text_input": "x", "max_tokens": 1, "return_log_probs": "true"}, "return_log_probs"),
    ({"text_input": "x", "max_tokens": 1, "return_log_probs": 1}, "return_log_probs"),
    ({"text_input": "x", "max_tokens": 1, "return_log_probs": [True, True]}, "return_log_probs"),
])
def test_bad_fields_name_the_field(fields, field):
    with pytest.raises(RequestError) as info:
        parse_generate_fields(fields, DEFAULTS, allow_extras="min_p" not in fields)
    assert field in str(info.value)


def test_tensor_wire_format_round_trips():
    elements = [b"hello", "天气".encode(), b""]
    assert deserialize_bytes(serialize_bytes(elements)) == elements
    with pytest.raises(RequestError, match="truncated"):
        deserialize_bytes(serialize_bytes([b"abc"])[:-1])
    assert decode_raw("max_tokens", "INT32", (12).to_bytes(4, "little")) == [12]
    with pytest.raises(RequestError, match="datatype"):
        decode_raw("max_tokens", "FP32", b"\0\0\0\0")
    with pytest.raises(RequestError, match="batch size 1"):
        tensors_to_fields({"text_input": [b"a", b"b"]})


def test_bf16_raw_tensors_decode():
    raw = bytes([0x80, 0x3F, 0x00, 0xC0])  # 1.0 and -2.0 as bfloat16, little-endian
    assert decode_raw("temperature", "BF16", raw) == [1.0, -2.0]
    with pytest.raises(RequestError, match="whole number of BF16"):
        decode_raw("temperature", "BF16", b"\0")


def test_null_extras_keep_their_defaults():
    """Found by the fuzzer: ``"stop_token_ids": null`` reached ``list(None)``."""
    req = parse_generate_fields({"text_input": "x", "max_tokens": 1, "stop_token_ids": None, "min_p": None}, DEFAULTS)
    assert req.params.stop_token_ids == (2,) and req.params.min_p == 0.0


def test_return_log_probs_asks_for_each_tokens_log_prob_only_when_true():
    base = {"text_input": "hi", "max_tokens": 3}
    on = parse_generate_fields({**base, "return_log_probs": [True]}, DEFAULTS, allow_extras=False)
    assert on.return_log_probs and on.params.logprobs == 0  # the token's own log-probability, no alternatives
    for fields in (base, {**base, "return_log_probs": False}, {**base, "return_log_probs": None}):
        off = parse_generate_fields(fields, DEFAULTS, allow_extras=False)
        assert not off.return_log_probs and off.params == parse_generate_fields(base, DEFAULTS).params
        assert off.params.logprobs is None


def test_return_log_probs_on_a_tensorrt_llm_build_is_refused_under_its_ensemble_name():
    """llmc's tensorrt_llm backend returns no log-probabilities: its refusal names the ensemble's field."""
    from llmc.engine.tensorrt_llm.sampling import refuse_unsupported
    from llmc.serve.protocol import ENSEMBLE_NAMES, client_names

    req = parse_generate_fields({"text_input": "hi", "max_tokens": 3, "return_log_probs": True}, DEFAULTS)
    with pytest.raises(RequestError) as info, client_names(ENSEMBLE_NAMES):
        refuse_unsupported(req.params)
    assert info.value.field == "return_log_probs"
    assert "is not supported by the tensorrt_llm backend" in str(info.value) and "backend: torch" in str(info.value)
