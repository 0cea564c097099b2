"""Fuzzing the request parsers of every endpoint and the KServe tensor decoders (issue 18): any input ends in a
typed RequestError or a valid request, never an unhandled exception (which the server would answer with a 500)."""

from __future__ import annotations

import json
import struct

from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as pb

from llmc.request.params import SamplingParams
from llmc.serve import anthropic_protocol as anthropic
from llmc.serve.grpc_server import request_fields
from llmc.serve.openai_protocol import IGNORED, PARAM_MAP, UNSUPPORTED, parse_openai_request
from llmc.serve.openai_responses import EXTRAS, OWN_FIELDS, parse_responses_request
from llmc.serve.openai_responses import IGNORED as RESPONSES_IGNORED
from llmc.serve.openai_responses import UNSUPPORTED as RESPONSES_UNSUPPORTED
from llmc.serve.protocol import (EXTRA_PARAMS, SPECS, GenerateRequest, flatten_generate_parameters, loads_json_object,
                                 parse_generate_fields)
from llmc.serve.tensors import (NUMPY_DTYPES, decode_json_data, decode_raw, deserialize_bytes, parse_infer_body,
                                tensors_to_fields)
from tests.fuzzing import JSON, fuzz_tests

DEFAULTS = SamplingParams(max_new_tokens=16)
VOCAB = 100
DATATYPES = [*NUMPY_DTYPES, "BYTES", "BF16", "STRING", ""]
NAMES = [*SPECS, "colour", ""]


def json_bytes(value) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


# --------------------------------------------------------------------------------------- raw JSON bodies
RAW_BODIES = st.one_of(st.binary(max_size=200), JSON.map(json_bytes), st.text(max_size=50).map(str.encode),
                       st.integers(1, 5000).map(lambda d: b"[" * d + b"]" * d),
                       st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1,
                               max_size=3).map(lambda s: ('{"x": "' + s.encode("unicode_escape").decode()
                                                          .replace("\\\\x", "\\\\u00") + '"}').encode()))


def check_body(raw: bytes) -> None:
    assert isinstance(loads_json_object(raw), dict)


test_json_body, test_json_body_slow = fuzz_tests(RAW_BODIES, check_body)


# ------------------------------------------------------------------------------ KServe generate fields
GENERATE_FIELDS = st.dictionaries(st.sampled_from([*SPECS, *EXTRA_PARAMS, "id", "request_id", "strict_max_tokens"])
                                  | st.text(max_size=6), JSON, max_size=8)


def check_generate(fields: dict) -> None:
    for extras in (True, False):  # HTTP generate (the extension's "parameters" merged first), gRPC / infer
        req = parse_generate_fields(flatten_generate_parameters(fields) if extras else fields, DEFAULTS, VOCAB,
                                    allow_extras=extras)
        assert isinstance(req, GenerateRequest) and isinstance(req.prompt, str) and req.prompt
        assert req.params.validate(VOCAB) is req.params


test_generate_fields, test_generate_fields_slow = fuzz_tests(
    st.one_of(GENERATE_FIELDS, GENERATE_FIELDS.map(lambda f: {"text_input": "hi", "max_tokens": 3, **f}),
              GENERATE_FIELDS.map(lambda f: {"text_input": "hi", "parameters": {"max_tokens": 3, **f}}),
              JSON.map(lambda v: {"text_input": "hi", "max_tokens": 3, "parameters": v})),
    check_generate)


# ------------------------------------------------------------------------------------- OpenAI bodies
PART = st.one_of(JSON, st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": JSON}))
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer", "wizard"]) | JSON,
                                 "content": st.one_of(st.text(max_size=20), st.lists(PART, max_size=3), JSON)})
OPENAI_KEYS = [*PARAM_MAP, *UNSUPPORTED, *IGNORED, "model", "prompt", "messages", "stream", "stream_options",
               "logprobs", "top_logprobs", "n", "strict_max_tokens", "colour", "chat_template_kwargs",
               "continue_final_message", "add_generation_prompt"]
OPENAI_BODIES = st.dictionaries(st.sampled_from(OPENAI_KEYS), JSON, max_size=8) | st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, max_size=3), "prompt": st.text(max_size=10) | st.lists(st.integers(), max_size=3)},
    optional={"max_tokens": JSON, "stream_options": JSON, "stop": JSON, "model": JSON, "stream": JSON,
              "continue_final_message": JSON, "add_generation_prompt": JSON})


def check_openai(body: dict) -> None:
    for chat in (True, False):  # without the other endpoint's prompt field (a RequestError before the rest)
        own = {k: v for k, v in body.items() if k != ("prompt" if chat else "messages")}
        req = parse_openai_request(own, chat, ("m", "ensemble"), DEFAULTS, VOCAB)
        assert req.params.validate(VOCAB) is req.params
        if chat:
            messages = req.prompt if isinstance(req.prompt, list) else req.prompt.messages
            assert all(m["role"] in ("system", "user", "assistant") and isinstance(m["content"], str)
                       for m in messages)
            assert not getattr(req.prompt, "continue_final", False) or messages[-1]["role"] == "assistant"


test_openai_body, test_openai_body_slow = fuzz_tests(OPENAI_BODIES, check_openai)


# --------------------------------------------------------------------------------- /v1/responses bodies
ITEM = st.one_of(MESSAGE, st.fixed_dictionaries(
    {"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "item_reference"])
     | JSON}, optional={"role": st.sampled_from(["user", "assistant", "developer"]) | JSON, "content": JSON,
                        "call_id": st.text(max_size=5) | JSON, "name": JSON, "arguments": JSON, "output": JSON}))
TOOL = st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"]) | JSON},
                             optional={"name": st.sampled_from(["f", "g", "a b"]) | JSON, "parameters": JSON})
RESPONSES_KEYS = [*OWN_FIELDS, *EXTRAS, *RESPONSES_IGNORED, *RESPONSES_UNSUPPORTED, "messages", "colour"]
RESPONSES_BODIES = st.dictionaries(st.sampled_from(RESPONSES_KEYS), JSON, max_size=8) | st.fixed_dictionaries(
    {"input": st.text(max_size=10) | st.lists(ITEM, max_size=4)},
    optional={"instructions": st.text(max_size=5) | JSON, "tools": st.lists(TOOL, max_size=2) | JSON,
              "tool_choice": JSON, "text": JSON, "include": JSON, "top_logprobs": JSON, "max_output_tokens": JSON})


def check_responses(body: dict) -> None:
    req = parse_responses_request(body, ("m", "ensemble"), DEFAULTS, VOCAB, "json")
    assert req.chat.params.validate(VOCAB) is req.chat.params
    messages = req.chat.prompt if isinstance(req.chat.prompt, list) else req.chat.prompt.messages
    assert all(m["role"] in ("system", "user", "assistant", "tool") and isinstance(m["content"], str)
               for m in messages)


test_responses_body, test_responses_body_slow = fuzz_tests(RESPONSES_BODIES, check_responses)


# ---------------------------------------------------------------------------------- /v1/messages bodies
BLOCK = st.one_of(st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image"]) | JSON},
    optional={"text": JSON, "id": st.text(max_size=3) | JSON, "name": st.sampled_from(["f", "g"]) | JSON,
              "input": JSON, "tool_use_id": st.text(max_size=3) | JSON, "content": JSON, "is_error": JSON}), JSON)
ANTHROPIC_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]) | JSON,
                                           "content": st.text(max_size=10) | st.lists(BLOCK, max_size=3) | JSON})
ANTHROPIC_TOOL = st.fixed_dictionaries({}, optional={"type": st.sampled_from(["custom", "bash_20250124"]) | JSON,
                                                     "name": st.sampled_from(["f", "g", "a b"]) | JSON,
                                                     "input_schema": JSON})
ANTHROPIC_KEYS = [*anthropic.OWN_FIELDS, *anthropic.EXTRAS, *anthropic.IGNORED, *anthropic.UNSUPPORTED, "stop"]
ANTHROPIC_BODIES = st.dictionaries(st.sampled_from(ANTHROPIC_KEYS), JSON, max_size=8) | st.fixed_dictionaries(
    {"messages": st.lists(ANTHROPIC_MESSAGE, max_size=4), "max_tokens": st.integers(0, 20) | JSON},
    optional={"system": st.text(max_size=5) | JSON, "tools": st.lists(ANTHROPIC_TOOL, max_size=2) | JSON,
              "tool_choice": JSON, "thinking": JSON, "output_config": JSON, "stop_sequences": JSON})


def check_anthropic(body: dict) -> None:
    for count_only in (False, True):
        req = anthropic.parse_messages_request(body, ("m", "ensemble"), DEFAULTS, VOCAB, "json", count_only).chat
        assert req.params.validate(VOCAB) is req.params
        messages = req.prompt if isinstance(req.prompt, list) else req.prompt.messages
        assert all(m["role"] in ("system", "user", "assistant", "tool") and isinstance(m["content"], str)
                   for m in messages)


test_anthropic_body, test_anthropic_body_slow = fuzz_tests(ANTHROPIC_BODIES, check_anthropic)


# ------------------------------------------------------------------------------------- /infer bodies
TENSOR = st.fixed_dictionaries({}, optional={
    "name": st.sampled_from(NAMES) | JSON, "datatype": st.sampled_from(DATATYPES) | JSON,
    "shape": JSON, "data": JSON, "parameters": st.fixed_dictionaries(
        {}, optional={"binary_data_size": st.integers(-2, 40) | JSON}) | JSON})


@st.composite
def infer_bodies(draw) -> tuple[bytes, str | None]:
    head = json_bytes(draw(st.fixed_dictionaries({"inputs": st.lists(TENSOR, max_size=4) | JSON},
                                                 optional={"id": JSON})))
    tail = draw(st.binary(max_size=40))
    header = draw(st.sampled_from([None, str(len(head)), str(len(head) + 3), "-1", "x"]))
    return (head + tail if header is not None else head), header


def check_infer(case: tuple[bytes, str | None]) -> None:
    request_id, tensors = parse_infer_body(*case)
    parse_generate_fields(tensors_to_fields(tensors), DEFAULTS, VOCAB, allow_extras=False)


test_infer_body, test_infer_body_slow = fuzz_tests(infer_bodies(), check_infer)


# --------------------------------------------------------------------------------- gRPC ModelInfer
@st.composite
def grpc_requests(draw) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="ensemble")
    for _ in range(draw(st.integers(0, 4))):
        tensor = request.inputs.add(name=draw(st.sampled_from(NAMES)), datatype=draw(st.sampled_from(DATATYPES)),
                                    shape=[1, 1])
        if draw(st.booleans()):
            tensor.contents.int_contents.extend(draw(st.lists(st.integers(-2**31, 2**31 - 1), max_size=2)))
            tensor.contents.bytes_contents.extend(draw(st.lists(st.binary(max_size=8), max_size=2)))
            tensor.contents.fp32_contents.extend(draw(st.lists(st.floats(width=32), max_size=2)))
            tensor.contents.bool_contents.extend(draw(st.lists(st.booleans(), max_size=2)))
    if draw(st.booleans()):
        request.raw_input_contents.extend(draw(st.lists(st.binary(max_size=16), max_size=4)))
    return request


def check_grpc(request: pb.ModelInferRequest) -> None:
    parse_generate_fields(request_fields(request), DEFAULTS, VOCAB, allow_extras=False)


test_grpc_request, test_grpc_request_slow = fuzz_tests(grpc_requests(), check_grpc)


# ---------------------------------------------------------------------------------- tensor decoders
def bytes_tensor(elements: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


DECODER_CASES = st.one_of(
    st.tuples(st.just("raw"), st.sampled_from(NAMES), st.sampled_from(DATATYPES),
              st.binary(max_size=32) | st.lists(st.binary(max_size=6), max_size=3).map(bytes_tensor)),
    st.tuples(st.just("json"), st.sampled_from(NAMES), st.sampled_from(DATATYPES), JSON),
    st.tuples(st.just("bytes"), st.just(""), st.just(""), st.binary(max_size=40)),
    st.tuples(st.just("fields"), st.just(""), st.just(""),
              st.dictionaries(st.sampled_from(NAMES), st.lists(JSON, max_size=3), max_size=4)))


def check_decoder(case) -> None:
    kind, name, datatype, value = case
    if kind == "raw":
        assert isinstance(decode_raw(name, datatype, value), list)
    elif kind == "json":
        assert isinstance(decode_json_data(name, datatype, value), list)
    elif kind == "bytes":
        assert all(isinstance(e, bytes) for e in deserialize_bytes(value))
    else:
        assert isinstance(tensors_to_fields(value), dict)


test_tensor_decoders, test_tensor_decoders_slow = fuzz_tests(DECODER_CASES, check_decoder)
