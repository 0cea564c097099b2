"""Loading a build's (or a source folder's) Hugging Face tokenizer: the one way every stage opens one.

A leaf module: the builder, the engines, the runtime, the server and the bench all load tokenizers through
:func:`load_tokenizer`, so none of them imports another stage for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmc.errors import SourceError

# The tokenizer class transformers 5 writes into tokenizer_config.json (transformers 4 raises on it).
_NEWER_TOKENIZER_CLASS = "TokenizersBackend"


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
        return AutoTokenizer.from_pretrained(str(hf_dir), trust_remote_code=False)
    except ValueError as exc:
        if _NEWER_TOKENIZER_CLASS in str(exc) and (Path(hf_dir) / "tokenizer.json").is_file():
            return PreTrainedTokenizerFast.from_pretrained(str(hf_dir))
        raise SourceError(f"cannot load the tokenizer in {hf_dir}: {exc}. Fix: the folder needs tokenizer.json "
                          f"and tokenizer_config.json") from exc
    except OSError as exc:
        raise SourceError(f"cannot load the tokenizer in {hf_dir}: {exc}. Fix: the folder needs tokenizer.json "
                          f"and tokenizer_config.json") from exc
