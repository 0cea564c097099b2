"""Guided decoding through the generated Triton Python models, run without Triton: the ``llmc`` model (torch
builds) follows ``guided_decoding_guide_type`` / ``guided_decoding_guide`` exactly as the offline engine follows
the same output format, and the ``tensorrt_llm_bls`` model hands both to ``tensorrt_llm`` unchanged, as
tensorrtllm_backend's BLS does (``tensorrt_llm_bls/1/lib/triton_decoder.py``), refusing a type the C++ backend
would silently ignore. ``triton_python_backend_utils`` is a stand-in module (:class:`FakePbUtils`)."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
import threading
import types

import numpy as np
import pytest
from google.protobuf import json_format

from llmc.manifest import read_manifest
from llmc.request.params import SamplingParams
from llmc.serve.pbtxt import read_config
from llmc.serve.repo import generate_model_repo, template_root

PATTERN, PROMPT = "[a-c]{4}", "Letters:"
FINAL = 1


class FakeTensor:
    def __init__(self, name, array):
        self.name, self.array = name, array

    def as_numpy(self):
        return self.array


class FakeResponse:
    def __init__(self, output_tensors, error=None):
        self.tensors = {t.name: t.array for t in output_tensors}
        self.error = error


class FakeRequest:
    """A Triton request: input arrays by name, and a response sender that records (response, flags)."""

    def __init__(self, **arrays):
        self.arrays, self.sent, self.done = arrays, [], threading.Event()

    def get_response_sender(self):
        request = self

        class Sender:
            def send(self, response=None, flags=0):
                request.sent.append((response, flags))
                if flags & FINAL:
                    request.done.set()
        return Sender()

    def texts(self):
        return "".join(r.tensors["text_output"][0, 0].decode() for r, _ in self.sent if r is not None and
                       "text_output" in r.tensors)

    def errors(self):
        return [str(r.error) for r, _ in self.sent if r is not None and r.error is not None]


def fake_pb_utils(backend_outputs=()):
    """A ``triton_python_backend_utils`` module; BLS calls to other models record their request and answer with
    ``backend_outputs`` (one ``{name: array}`` per response)."""
    module = types.ModuleType("triton_python_backend_utils")
    module.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    module.Tensor, module.InferenceResponse = FakeTensor, FakeResponse
    module.TritonError = type("TritonError", (Exception,), {})
    module.get_input_tensor_by_name = lambda request, name: (
        FakeTensor(name, request.arrays[name]) if name in request.arrays else None)
    module.get_output_tensor_by_name = lambda response, name: (
        FakeTensor(name, response[name]) if name in response else None)
    module.calls = []

    class InferenceRequest:
        def __init__(self, model_name, inputs, requested_output_names):
            module.calls.append((model_name, {t.name: t.array for t in inputs}, list(requested_output_names)))

        def exec(self, decoupled=False):
            return iter([FakeReply(outputs) for outputs in backend_outputs])

    module.InferenceRequest = InferenceRequest
    return module


class FakeReply(dict):
    """A response of the called model: its output arrays by name."""

    def has_error(self):
        return False


def _strings(*values):
    return np.array([[v.encode()] for v in values], dtype=np.object_)


def _load(name):
    spec = importlib.util.spec_from_file_location(f"guided_{name}_model", template_root() / name / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _model_args(model_dir, **parameters):
    """``initialize(args)`` as Triton's Python backend passes it: the model config as JSON (``parameters``
    override string values)."""
    config = read_config(model_dir)
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    return {"model_config": json_format.MessageToJson(config, preserving_proto_field_name=True)}


def test_the_llmc_model_follows_a_guide_like_the_offline_engine(serve_tiny_build, offline, tmp_path, monkeypatch):
    repo = generate_model_repo(serve_tiny_build, tmp_path / "repo")
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake_pb_utils())
    model = _load("llmc").TritonPythonModel()
    model.initialize(_model_args(repo / "tiny", device="cpu"))
    try:
        guided = FakeRequest(text_input=_strings(PROMPT), max_tokens=np.array([[8]], dtype=np.int32),
                             temperature=np.array([[0.0]], dtype=np.float32),
                             guided_decoding_guide_type=_strings("regex"), guided_decoding_guide=_strings(PATTERN))
        bad = FakeRequest(text_input=_strings(PROMPT), max_tokens=np.array([[8]], dtype=np.int32),
                          guided_decoding_guide_type=_strings("structural_tag"), guided_decoding_guide=_strings("{}"))
        model.execute([guided, bad])
        assert guided.done.wait(60) and bad.done.wait(60)
    finally:
        model.finalize()
    expected = offline.generate([PROMPT], SamplingParams(max_new_tokens=8, temperature=0.0,
                                                         structured={"type": "regex", "pattern": PATTERN}))[0].text
    assert re.fullmatch(PATTERN, guided.texts()) and guided.texts() == expected and not guided.errors()
    unguided = offline.generate([PROMPT], SamplingParams(max_new_tokens=8, temperature=0.0))[0].text
    assert not re.fullmatch(PATTERN, unguided)  # the guide, not the model, makes the text match
    assert bad.errors() and bad.errors()[0].startswith("guided_decoding_guide_type: must be one of json, json_schema")


@pytest.fixture()
def trt_repo(serve_tiny_build, tmp_path):
    recipe = dataclasses.replace(read_manifest(serve_tiny_build).recipe_obj(), backend="tensorrt_llm")
    return generate_model_repo(serve_tiny_build, tmp_path / "repo", recipe=recipe, eos_token_ids=(2,))


def _bls(repo, monkeypatch, token_ids):
    """The repository's BLS model, initialized from its config; the stand-in tensorrt_llm answers ``token_ids``."""
    outputs = [{"output_ids": np.array([[token_ids]], dtype=np.int32),
                "sequence_length": np.array([[len(token_ids)]], dtype=np.int32)}]
    pb_utils = fake_pb_utils(outputs)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb_utils)
    model = _load("tensorrt_llm_bls").TritonPythonModel()
    model.initialize(_model_args(repo / "tensorrt_llm_bls"))
    return model, pb_utils


def test_the_bls_forwards_the_guide_to_tensorrt_llm_unchanged(trt_repo, serve_tiny_build, monkeypatch):
    from llmc.tokenizer import load_tokenizer

    ids = load_tokenizer(serve_tiny_build / "tokenizer").encode("abca", add_special_tokens=False)
    model, pb_utils = _bls(trt_repo, monkeypatch, ids)  # tensorrt_llm answers with the tokens of "abca"
    request = FakeRequest(text_input=_strings(PROMPT), max_tokens=np.array([[4]], dtype=np.int32),
                          guided_decoding_guide_type=_strings("regex"), guided_decoding_guide=_strings(PATTERN))
    model._serve(request)
    ((name, inputs, _),) = pb_utils.calls
    assert name == "tensorrt_llm"
    for key, value in (("guided_decoding_guide_type", b"regex"), ("guided_decoding_guide", PATTERN.encode())):
        assert inputs[key].dtype == np.object_ and inputs[key].tolist() == [[value]], key
    trt_inputs = {t.name for t in read_config(trt_repo / "tensorrt_llm").input}
    assert set(inputs) <= trt_inputs
    assert request.texts() == "abca" and request.sent[-1][1] == FINAL and not request.errors()


@pytest.mark.parametrize("guide_type, guide, words", [
    ("structural_tag", "{}", "guided_decoding_guide_type: must be one of json, json_schema, regex, ebnf_grammar"),
    ("regex", None, "guided_decoding_guide: is required with guided_decoding_guide_type 'regex'"),
    ("json_schema", "{not json", "guided_decoding_guide: must be a JSON schema as JSON text"),
    (None, "[0-9]", "guided_decoding_guide: needs guided_decoding_guide_type"),
])
def test_the_bls_refuses_a_guide_the_backend_would_drop(trt_repo, monkeypatch, guide_type, guide, words):
    model, pb_utils = _bls(trt_repo, monkeypatch, [])
    arrays = {"text_input": _strings(PROMPT), "max_tokens": np.array([[4]], dtype=np.int32)}
    if guide_type is not None:
        arrays["guided_decoding_guide_type"] = _strings(guide_type)
    if guide is not None:
        arrays["guided_decoding_guide"] = _strings(guide)
    request = FakeRequest(**arrays)
    model._serve(request)
    assert not pb_utils.calls and request.errors()[0].startswith(words) and request.sent[-1][1] == FINAL


def test_the_bls_without_a_guide_sends_no_guided_inputs(trt_repo, monkeypatch):
    model, pb_utils = _bls(trt_repo, monkeypatch, [])
    request = FakeRequest(text_input=_strings(PROMPT), max_tokens=np.array([[4]], dtype=np.int32))
    model._serve(request)
    ((_, inputs, _),) = pb_utils.calls
    assert not {"guided_decoding_guide_type", "guided_decoding_guide"} & set(inputs) and not request.errors()
