"""Loading a build's (or a source folder's) Hugging Face tokenizer: the one way every stage opens one.

A leaf module: the builder, the engines, the runtime, the server and the bench all load tokenizers through
:func:`load_tokenizer`, so none of them imports another stage for it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmc.errors import SourceError

# The tokenizer class transformers 5 writes into tokenizer_config.json (transformers 4 raises on it), and the class
# both versions load a tokenizer.json as (transformers 5 maps it to the same TokenizersBackend).
_NEWER_TOKENIZER_CLASS = "TokenizersBackend"
_PORTABLE_TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def load_tokenizer(hf_dir: Path) -> Any:
    """The fast tokenizer saved in ``hf_dir`` (tokenizer.json), without remote code.

    A folder saved by transformers 5 names its class ``TokenizersBackend``, which transformers 4 (the one
    TensorRT-LLM 1.0 - 1.2 pins) does not know; its ``tokenizer.json`` is the whole tokenizer, so
    transformers 4 loads it as ``PreTrainedTokenizerFast`` (tokens, special tokens and the chat template are
    the same: tests/test_install_beside_trtllm.py compares them across the two versions).
    """
    # Heavy: transformers' tokenizer classes pull in much of transformers (and Triton where it is installed).
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return _no_bpe_clean_up(AutoTokenizer.from_pretrained(str(hf_dir), trust_remote_code=False))
    except ValueError as exc:
        if _NEWER_TOKENIZER_CLASS in str(exc) and (Path(hf_dir) / "tokenizer.json").is_file():
            return _no_bpe_clean_up(PreTrainedTokenizerFast.from_pretrained(str(hf_dir)))
        raise SourceError(f"cannot load the tokenizer in {hf_dir}: {exc}. Fix: the folder needs tokenizer.json "
                          f"and tokenizer_config.json") from exc
    except OSError as exc:
        raise SourceError(f"cannot load the tokenizer in {hf_dir}: {exc}. Fix: the folder needs tokenizer.json "
                          f"and tokenizer_config.json") from exc


def _no_bpe_clean_up(tokenizer: Any) -> Any:
    """``tokenizer`` with ``clean_up_tokenization_spaces`` off where its model is a BPE, as transformers 5 decodes
    (it ignores the flag there): transformers 4 would otherwise drop the space of " ." or " 's" in every ``decode``
    that does not pass the flag (a logprob's token text, an echoed prompt), with a folder built before the build
    wrote the flag off (:func:`portable_tokenizer_config`)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and type(backend.model).__name__ == "BPE":
        tokenizer.clean_up_tokenization_spaces = False
    return tokenizer


def portable_tokenizer_config(config: dict[str, Any], tokenizer_json: str) -> dict[str, Any]:
    """A build's ``tokenizer_config.json`` (``config``) that transformers 4 and 5 read alike, so TensorRT-LLM's
    tools (transformers 4.57.3 with 1.2) load the build's tokenizer and decode the text llmc streams.

    - ``tokenizer_class`` ``TokenizersBackend`` (transformers 5's generic class, a GGUF conversion's) becomes
      ``PreTrainedTokenizerFast``: transformers 4's ``AutoTokenizer`` raises on the former, and TensorRT-LLM loads
      tokenizers through ``AutoTokenizer`` (docs/TENSORRT_LLM.md, U17). A model's own class is kept.
    - ``clean_up_tokenization_spaces`` is false where ``tokenizer_json``'s model is a BPE: transformers 5 ignores
      true there, and transformers 4 and TensorRT-LLM's incremental detokenizer (U17) would strip the space
      before punctuation the model wrote ("x , y" -> "x, y").
    """
    config = dict(config)
    if config.get("tokenizer_class") == _NEWER_TOKENIZER_CLASS:
        config["tokenizer_class"] = _PORTABLE_TOKENIZER_CLASS
    if (json.loads(tokenizer_json).get("model") or {}).get("type") == "BPE":
        config["clean_up_tokenization_spaces"] = False
    return config


def byte_level_decoder(tokenizer_json: str) -> str:
    """``tokenizer_json`` (a Hugging Face ``tokenizer.json``) with the decoder guided decoding must find: a
    byte-level BPE (its pre-tokenizer maps bytes to printable characters, "Ġ" for a space) whose decoder is a chain
    that also holds byte-fallback steps (what converting a GGUF's BPE vocabulary gives, the embedded SmolLM2's among
    them) gets its ByteLevel decoder alone, where every token id decodes to the same text with it. Read as is,
    llguidance takes the chain for SentencePiece's and xgrammar takes its first step, ByteFallback, for the
    vocabulary's kind: both read "Ġtea" as those five bytes, so a space is never allowed where a format needs one.
    Anything else (a vocabulary with ``<0xNN>`` byte tokens, which the chain decodes differently) is returned
    unchanged."""
    spec = json.loads(tokenizer_json)
    pre, decoder = spec.get("pre_tokenizer") or {}, spec.get("decoder") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    chain = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else []
    byte_level = [d for d in chain if d.get("type") == "ByteLevel"]
    if not byte_level or not any(p.get("type") == "ByteLevel" for p in steps):
        return tokenizer_json
    spec["decoder"] = byte_level[0]
    plain = json.dumps(spec, ensure_ascii=False, indent=2)
    return plain if _decodes_alike(tokenizer_json, plain) else tokenizer_json


def _decodes_alike(a_json: str, b_json: str) -> bool:
    """Whether two ``tokenizer.json`` texts decode every token id to the same text (special tokens kept); a
    vocabulary of 49,152 takes ~0.1 s."""
    from tokenizers import Tokenizer

    a, b = Tokenizer.from_str(a_json), Tokenizer.from_str(b_json)
    ids = [[i] for i in range(a.get_vocab_size(with_added_tokens=True))]
    return a.decode_batch(ids, skip_special_tokens=False) == b.decode_batch(ids, skip_special_tokens=False)
