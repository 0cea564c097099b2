"""llmc.tokenizer: one decoder for byte-level vocabularies that guided decoding (llguidance, xgrammar) reads right,
and a tokenizer config transformers 4 and 5 read alike."""

from __future__ import annotations

import json
import shutil

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from llmc.tokenizer import byte_level_decoder, load_tokenizer, portable_tokenizer_config

CHAIN = ("ByteFallback", "Fuse", "Replace", "ByteLevel")  # a GGUF byte-level vocabulary's decoder, converted


def _tokenizer(vocab: dict[str, int], steps: tuple[str, ...], byte_level: bool = True) -> str:
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if byte_level else \
        pre_tokenizers.Metaspace()
    made = {"ByteFallback": decoders.ByteFallback(), "Fuse": decoders.Fuse(),
            "Replace": decoders.Replace("▁", " "), "ByteLevel": decoders.ByteLevel()}
    tok.decoder = decoders.Sequence([made[s] for s in steps]) if len(steps) > 1 else made[steps[0]]
    return tok.to_str()


def _decoded(tokenizer_json: str, ids: list[int]) -> str:
    return Tokenizer.from_str(tokenizer_json).decode(ids)


def test_a_byte_level_vocabulary_gets_its_byte_level_decoder_alone_and_decodes_as_before():
    text = _tokenizer({"a": 0, "Ġb": 1, "Ċ": 2}, CHAIN)
    plain = byte_level_decoder(text)
    spec, before = json.loads(plain), json.loads(text)
    assert spec["decoder"]["type"] == "ByteLevel"
    assert {k: v for k, v in spec.items() if k != "decoder"} == {k: v for k, v in before.items() if k != "decoder"}
    assert _decoded(plain, [0, 1, 2, 1]) == _decoded(text, [0, 1, 2, 1]) == "a b\n b"
    assert byte_level_decoder(plain) == plain  # nothing left to change


@pytest.mark.parametrize("vocab, steps, byte_level", [
    ({"<0x20>": 0, "a": 1, "Ġb": 2}, CHAIN, True),  # real byte tokens: the chain decodes <0x20> as a space
    ({"a": 0, "▁b": 1}, ("Replace", "ByteFallback", "Fuse"), False),  # SentencePiece-like: no ByteLevel at all
    ({"a": 0, "Ġb": 1}, ("ByteLevel",), True),  # already plain
])
def test_any_other_tokenizer_is_returned_unchanged(vocab, steps, byte_level):
    text = _tokenizer(vocab, steps, byte_level)
    assert byte_level_decoder(text) == text


def test_the_embedded_tokenizer_reads_a_space_as_a_space_in_llguidance(smollm2_tokenizer_dir):
    """The GGUF-converted SmolLM2 tokenizer, read by llguidance as is, takes " tea" for the bytes of "Ġtea"."""
    import llguidance

    text = (smollm2_tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8")
    ids = Tokenizer.from_str(text).encode("green tea", add_special_tokens=False).ids
    as_is = bytes(llguidance.LLTokenizer(text, n_vocab=49152).decode_bytes(ids))
    fixed = bytes(llguidance.LLTokenizer(byte_level_decoder(text), n_vocab=49152).decode_bytes(ids))
    assert as_is == "greenĠtea".encode() and fixed == b"green tea"


def test_the_builds_tokenizer_config_reads_alike_under_transformers_4_and_5():
    """TokenizersBackend (transformers 5 only) becomes PreTrainedTokenizerFast, a model's own class is kept, and a
    BPE never cleans up spaces; the caller's dict is left as it was."""
    bpe = _tokenizer({"a": 0, "Ġb": 1}, ("ByteLevel",))
    config = {"tokenizer_class": "TokenizersBackend", "clean_up_tokenization_spaces": True, "eos_token": "a"}
    assert portable_tokenizer_config(config, bpe) == {"tokenizer_class": "PreTrainedTokenizerFast",
                                                      "clean_up_tokenization_spaces": False, "eos_token": "a"}
    assert config["tokenizer_class"] == "TokenizersBackend" and config["clean_up_tokenization_spaces"] is True
    own = {"tokenizer_class": "Qwen2Tokenizer"}
    assert portable_tokenizer_config(own, bpe) == {"tokenizer_class": "Qwen2Tokenizer",
                                                   "clean_up_tokenization_spaces": False}
    word_piece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).to_str()
    kept = {"tokenizer_class": "BertTokenizer", "clean_up_tokenization_spaces": True}
    assert portable_tokenizer_config(kept, word_piece) == kept  # the clean-up was made for WordPiece


def test_a_bpe_tokenizer_loads_with_the_space_clean_up_off(tmp_path, smollm2_tokenizer_dir):
    """A folder built before the build wrote the flag off (the converted SmolLM2 still says true) decodes as
    transformers 5 does under any version: llmc's decode calls without the flag keep " ," as written."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_tokenizer_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["clean_up_tokenization_spaces"] is True  # what the test starts from
    tok = load_tokenizer(tmp_path)
    assert tok.clean_up_tokenization_spaces is False
    text = "print(x , y) ; it 's a dog ."
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
