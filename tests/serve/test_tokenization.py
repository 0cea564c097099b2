"""Pre/postprocessing logic of the Triton Python models, run without Triton (and the model.py files import
without ``triton_python_backend_utils``)."""

from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import pytest

from llmc.engine.tensorrt_llm.stop_words import from_stop_words_list
from llmc.serve.repo import template_root
from llmc.serve.tokenization import RequestTokenizer, StreamDetokenizers, TokenizerSettings
from llmc.tokenizer import load_tokenizer

TEXTS = ["Hello there, how are you doing today?", "天气很好，我们去公园散步吧。", "emoji 🎉🚀 and café naïve ✓"]


@pytest.fixture(scope="module")
def tokenizer(serve_tiny_build):
    return load_tokenizer(serve_tiny_build / "tokenizer")


def _settings(build, **kw):
    return TokenizerSettings(tokenizer_dir=str(build / "tokenizer"), **{"eos_token_ids": (2, 0), "pad_id": 2, **kw})


def _load_model_py(name):
    path = template_root() / name / "1" / "model.py"
    spec = importlib.util.spec_from_file_location(f"triton_{name}_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_settings_from_triton_parameters(serve_tiny_build):
    s = TokenizerSettings.from_parameters({"tokenizer_dir": "/t", "add_special_tokens": "false",
                                           "eos_token_ids": "2, 0", "pad_id": "5", "apply_chat_template": "true"})
    assert (s.add_special_tokens, s.eos_token_ids, s.pad_id, s.apply_chat_template) == (False, (2, 0), 5, True)


def test_preprocess_tokenizes_and_pads(serve_tiny_build, tokenizer):
    pre = RequestTokenizer(tokenizer, _settings(serve_tiny_build))
    out = pre.preprocess(["Hi", "a longer prompt here"])
    expected = [tokenizer("Hi")["input_ids"], tokenizer("a longer prompt here")["input_ids"]]
    assert out["INPUT_ID"].dtype == np.int32 and out["INPUT_ID"].shape == (2, max(map(len, expected)))
    assert out["REQUEST_INPUT_LEN"].tolist() == [[len(e)] for e in expected]
    for row, ids in zip(out["INPUT_ID"].tolist(), expected):
        assert row[: len(ids)] == ids and set(row[len(ids):]) <= {2}
    assert out["OUT_END_ID"].tolist() == [[2], [2]] and out["OUT_PAD_ID"].tolist() == [[2], [2]]


def test_chat_template_applied_when_configured(serve_tiny_build, tokenizer):
    pre = RequestTokenizer(tokenizer, _settings(serve_tiny_build, apply_chat_template=True))
    ids = pre.preprocess(["What is 2+2?"])["INPUT_ID"][0].tolist()
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], tokenize=False,
                                         add_generation_prompt=True)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids).rstrip().endswith("<|im_start|>assistant")


def test_stop_words_list_and_extra_eos(serve_tiny_build, tokenizer):
    pre = RequestTokenizer(tokenizer, _settings(serve_tiny_build))
    out = pre.preprocess(["x", "y"], stop_words=[["\n\nUser:", " end"], []], end_ids=[None, 0])
    words = from_stop_words_list(out["STOP_WORDS_IDS"])
    encode = lambda w: tokenizer(w, add_special_tokens=False)["input_ids"]
    # request 0: its own words, then the second recorded eos (0) as a stop word; end_id is the first eos
    assert words[0] == [encode("\n\nUser:"), encode(" end"), [0]]
    # request 1 asked for end_id 0, so eos 2 becomes the stop word
    assert words[1] == [[2]]
    assert out["OUT_END_ID"].tolist() == [[2], [0]]
    assert out["STOP_WORDS_IDS"].dtype == np.int32 and out["STOP_WORDS_IDS"].shape[:2] == (2, 2)


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_detokenization_is_exact(serve_tiny_build, tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = StreamDetokenizers(tokenizer, _settings(serve_tiny_build))
    chunks = [detok.decode_delta("r1", [t], max_tokens=len(ids)) for t in ids]
    assert "".join(chunks) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in c for c in chunks)
    assert len(detok) == 0  # max_tokens reached: state dropped


def test_interleaved_requests_keep_separate_state(serve_tiny_build, tokenizer):
    a, b = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS[:2])
    detok = StreamDetokenizers(tokenizer, _settings(serve_tiny_build))
    out = {"a": "", "b": ""}
    for i in range(max(len(a), len(b))):
        for key, ids in (("a", a), ("b", b)):
            if i < len(ids):
                out[key] += detok.decode_delta(key, [ids[i]])
    assert len(detok) == 2
    out["a"] += detok.decode_delta("a", [2])  # eos ends request a
    assert len(detok) == 1 and out["a"] == TEXTS[0]
    assert out["b"] + detok.decode_delta("b", [], final=True) == TEXTS[1] and len(detok) == 0


def test_state_is_bounded(serve_tiny_build, tokenizer):
    detok = StreamDetokenizers(tokenizer, _settings(serve_tiny_build), max_requests=3)
    for i in range(10):
        detok.decode_delta(f"r{i}", [100])
    assert len(detok) == 3


def test_model_files_import_without_triton(serve_tiny_build, tokenizer):
    assert "triton_python_backend_utils" not in sys.modules
    for name in ("preprocessing", "postprocessing", "tensorrt_llm_bls", "llmc"):
        assert hasattr(_load_model_py(name), "TritonPythonModel"), name
    assert "triton_python_backend_utils" not in sys.modules


def test_postprocessing_model_logic_streams_exactly(serve_tiny_build, tokenizer):
    post = _load_model_py("postprocessing")
    model = post.TritonPythonModel()
    params = {"tokenizer_dir": {"string_value": str(serve_tiny_build / "tokenizer")},
              "eos_token_ids": {"string_value": "2"}}
    model.initialize({"model_config": json.dumps({"parameters": params})})
    ids = tokenizer(TEXTS[2], add_special_tokens=False)["input_ids"]
    streamed = ""
    for t in ids:  # one [1, 1, 1] chunk per response, as tensorrt_llm streams with exclude_input_in_output
        texts = post.postprocess(model.detok, "req-7", np.array([[[t]]], dtype=np.int32),
                                 np.array([[1]], dtype=np.int32), stream=True)
        streamed += texts[0][0]
    streamed += model.detok.decode_delta("req-7/0/0", [], final=True)
    assert streamed == TEXTS[2]
    whole = post.postprocess(model.detok, "", np.array([[ids + [2, 2]]], dtype=np.int32),
                             np.array([[len(ids)]], dtype=np.int32))
    assert whole == [[TEXTS[2]]]


def test_bls_maps_preprocessing_onto_tensorrt_llm_inputs(serve_tiny_build, tokenizer):
    bls = _load_model_py("tensorrt_llm_bls")
    pre = RequestTokenizer(tokenizer, _settings(serve_tiny_build)).preprocess(["hello"])
    inputs = bls.trtllm_inputs(pre, {"max_tokens": np.array([[5]], dtype=np.int32), "top_k": None})
    assert inputs["request_output_len"].tolist() == [[5]] and "runtime_top_k" not in inputs
    assert inputs["input_ids"] is pre["INPUT_ID"] and inputs["exclude_input_in_output"].tolist() == [[True]]
