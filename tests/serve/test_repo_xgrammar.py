"""The xgrammar tokenizer info of a ``tensorrt_llm`` model repository: the JSON file named by the model's
``xgrammar_tokenizer_info_path``, from which Triton's tensorrtllm C++ backend builds guided decoding.

The backend (NVIDIA/TensorRT-LLM ``triton_backend/inflight_batcher_llm/src/model_instance_state.cc``
``getGuidedDecodingConfigFromParams``) reads ``encoded_vocab`` (list of strings), ``tokenizer_str`` (string) and
``stop_token_ids`` (list of ints) and hands them to xgrammar, whose TokenizerInfo takes list index = token id and
reads tokenizer_str only to detect how tokens decode (docs/TENSORRT_LLM.md, "Guided decoding")."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

import llmc.serve.repo as repo_module
from llmc.errors import BuildError
from llmc.manifest import read_manifest
from llmc.serve.repo import XGRAMMAR_INFO, generate_model_repo
from llmc.tokenizer import load_tokenizer


def _trt_recipe(build_dir):
    return dataclasses.replace(read_manifest(build_dir).recipe_obj(), backend="tensorrt_llm")


def _info(repo):
    return json.loads((repo / "tensorrt_llm" / XGRAMMAR_INFO).read_text())


def _xgrammar_vocab_type(tokenizer_json: dict) -> str:
    """xgrammar's rule (mlc-ai/xgrammar ``cpp/tokenizer_info.cc`` ``DetectVocabType``): the first ByteLevel or
    ByteFallback decoder, in a Sequence or alone, else RAW."""
    decoder = tokenizer_json.get("decoder") or {}
    steps = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    return next((s["type"] for s in steps if s.get("type") in ("ByteLevel", "ByteFallback")), "RAW")


@pytest.fixture(scope="module")
def tokenizer(serve_tiny_build):
    return load_tokenizer(serve_tiny_build / "tokenizer")


@pytest.fixture(scope="module")
def info(serve_tiny_build, tmp_path_factory):
    """The info of a tensorrt_llm repository whose eos ids come from the build (generation_config.json)."""
    repo = generate_model_repo(serve_tiny_build, tmp_path_factory.mktemp("xgr") / "repo",
                               recipe=_trt_recipe(serve_tiny_build))
    return _info(repo)


def test_encoded_vocab_lists_every_token_in_id_order(info, tokenizer):
    vocab = info["encoded_vocab"]
    assert set(info) == {"encoded_vocab", "tokenizer_str", "stop_token_ids"}
    assert len(vocab) == len(tokenizer) == max(tokenizer.get_vocab().values()) + 1
    assert all(isinstance(token, str) and token for token in vocab)  # no id without its token
    ids = [0, 1, 2, 3, 100, 278, 4096, 12345, len(tokenizer) - 1]
    assert [vocab[i] for i in ids] == tokenizer.convert_ids_to_tokens(ids)
    assert vocab.index("Ġb") == tokenizer.convert_tokens_to_ids("Ġb")


def test_stop_token_ids_are_the_builds_eos_ids(info, serve_tiny_build, tmp_path):
    assert info["stop_token_ids"] == list(read_manifest(serve_tiny_build).eos_token_ids)
    repo = generate_model_repo(serve_tiny_build, tmp_path / "repo", recipe=_trt_recipe(serve_tiny_build),
                               eos_token_ids=(2, 0))
    assert _info(repo)["stop_token_ids"] == [2, 0]


def test_tokenizer_str_is_the_builds_tokenizer_with_a_decoder_xgrammar_reads_right(info, tokenizer,
                                                                                     serve_tiny_build,
                                                                                     smollm2_tokenizer_dir, tmp_path):
    from tokenizers import Tokenizer

    ours = json.loads(info["tokenizer_str"])
    built = json.loads((serve_tiny_build / "tokenizer" / "tokenizer.json").read_text())
    assert ours == built and _xgrammar_vocab_type(ours) == "ByteLevel"  # llmc build wrote the decoder already
    every = [[i] for i in range(len(info["encoded_vocab"]))]
    assert Tokenizer.from_str(info["tokenizer_str"]).decode_batch(every, skip_special_tokens=False) == \
        tokenizer.backend_tokenizer.decode_batch(every, skip_special_tokens=False)
    # A build made before that carries the GGUF-converted SmolLM2 decoder, ByteFallback before ByteLevel (no <0xNN>
    # token exists): read as is, xgrammar would decode "Ġb" as "Ġb" instead of " b". Its repository's info gets the
    # ByteLevel decoder alone.
    old = tmp_path / "build"
    shutil.copytree(serve_tiny_build, old)
    shutil.copy(smollm2_tokenizer_dir / "tokenizer.json", old / "tokenizer" / "tokenizer.json")
    chained = json.loads((old / "tokenizer" / "tokenizer.json").read_text())
    repo = generate_model_repo(old, tmp_path / "repo", recipe=_trt_recipe(old))
    fixed = json.loads(_info(repo)["tokenizer_str"])
    assert _xgrammar_vocab_type(chained) == "ByteFallback" and _xgrammar_vocab_type(fixed) == "ByteLevel"
    assert {k: v for k, v in fixed.items() if k != "decoder"} == {k: v for k, v in chained.items() if k != "decoder"}


def test_xgrammar_reads_the_info_and_follows_a_guide(info, tokenizer):
    """xgrammar 0.1.25 (TensorRT-LLM 1.2's pin; in llmc's dev extra): TokenizerInfo built as the C++ backend's
    GuidedDecoder builds it (TokenizerInfo::FromHuggingFace = metadata detected from tokenizer_str + the vocab)."""
    import xgrammar as xgr

    meta = xgr.TokenizerInfo._detect_metadata_from_hf(info["tokenizer_str"])
    meta = json.loads(meta) if isinstance(meta, str) else meta
    token_info = xgr.TokenizerInfo(info["encoded_vocab"], xgr.VocabType(meta["vocab_type"]),
                                   vocab_size=len(info["encoded_vocab"]), stop_token_ids=info["stop_token_ids"],
                                   add_prefix_space=meta["add_prefix_space"])
    compiler = xgr.GrammarCompiler(token_info)
    for pattern, text in (("[a-c]{4}", "abca"), ("a b", "a b")):
        matcher = xgr.GrammarMatcher(compiler.compile_grammar(xgr.Grammar.from_regex(pattern)))
        assert all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False)), text
        assert matcher.accept_token(info["stop_token_ids"][0]) and matcher.is_terminated(), text
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(xgr.Grammar.from_regex("[a-c]{4}")))
    assert not matcher.accept_token(tokenizer.convert_tokens_to_ids("d"))


def test_a_folder_without_tokenizer_json_is_one_clear_error_before_anything_is_written(serve_tiny_build, tmp_path):
    build = tmp_path / "build"
    shutil.copytree(serve_tiny_build, build)
    (build / "tokenizer" / "tokenizer.json").unlink()
    out = tmp_path / "repo"
    out.mkdir()
    (out / "previous").write_text("kept")
    with pytest.raises(BuildError, match=r"(?s)xgrammar's tokenizer info .* Fix: the folder needs tokenizer\.json"):
        generate_model_repo(build, out, recipe=_trt_recipe(build), eos_token_ids=(2,))
    assert [p.name for p in out.iterdir()] == ["previous"]


def test_a_slow_tokenizer_is_one_clear_error(serve_tiny_build, tmp_path, monkeypatch):
    class SlowTokenizer:  # stands in for a Python (slow) tokenizer: a vocabulary, no backend_tokenizer
        def get_vocab(self):
            return {"a": 0}

    monkeypatch.setattr(repo_module, "load_tokenizer", lambda path: SlowTokenizer())
    with pytest.raises(BuildError) as raised:
        generate_model_repo(serve_tiny_build, tmp_path / "repo", recipe=_trt_recipe(serve_tiny_build),
                            eos_token_ids=(2,))
    message = str(raised.value)
    assert "slow (SlowTokenizer) tokenizer without tokenizer.json" in message and "tokenizer_str" in message
    assert "Fix: save a fast tokenizer" in message and not (tmp_path / "repo").exists()


def test_a_failed_check_leaves_no_half_written_repository(serve_tiny_build, tmp_path, monkeypatch):
    monkeypatch.setattr(repo_module, "check_trtllm_model", lambda config: ["a problem"])
    with pytest.raises(BuildError, match="a problem"):
        generate_model_repo(serve_tiny_build, tmp_path / "repo", recipe=_trt_recipe(serve_tiny_build),
                            eos_token_ids=(2,))
    assert not (tmp_path / "repo").exists()
