"""Tokenize/detokenize logic of the Triton Python models (preprocessing, postprocessing, tensorrt_llm_bls).

Kept in the package (no ``triton_python_backend_utils`` import) so it is unit-tested without a Triton
server; the models in ``model_repo/*/1/model.py`` are thin adapters around it. Tensors follow the
TensorRT-LLM backend: ``input_ids`` int32 [B, L] padded with pad_id, ``stop_words_list`` int32 [B, 2, N].
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmc.engine.tensorrt_llm.stop_words import to_stop_words_list
from llmc.errors import RequestError
from llmc.request.detokenize import IncrementalDetokenizer, byte_fallback_token_ids
from llmc.request.inputs import chat_to_token_ids


def _flag(value: str) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes")


def _ids(value: str) -> tuple[int, ...]:
    return tuple(int(v) for v in str(value).replace(" ", "").split(",") if v)


@dataclass(frozen=True)
class TokenizerSettings:
    """The preprocessing/postprocessing model parameters (config.pbtxt ``parameters``, all strings there)."""

    tokenizer_dir: str
    add_special_tokens: bool = True
    apply_chat_template: bool = False
    eos_token_ids: tuple[int, ...] = ()
    pad_id: int = 0
    skip_special_tokens: bool = True

    @classmethod
    def from_parameters(cls, params: Mapping[str, str]) -> TokenizerSettings:
        """Parse Triton's ``{name: string_value}`` parameters (unknown ones are ignored)."""
        return cls(
            tokenizer_dir=params["tokenizer_dir"],
            add_special_tokens=_flag(params.get("add_special_tokens", "true")),
            apply_chat_template=_flag(params.get("apply_chat_template", "false")),
            eos_token_ids=_ids(params.get("eos_token_ids", "")),
            pad_id=int(params.get("pad_id", "0")),
            skip_special_tokens=_flag(params.get("skip_special_tokens", "true")),
        )

    def load_tokenizer(self) -> Any:
        from llmc.tokenizer import load_tokenizer

        return load_tokenizer(Path(self.tokenizer_dir))


class RequestTokenizer:
    """Preprocessing: prompts -> padded input ids; stop/bad words -> id lists; end_id and pad_id.

    ``end_id`` defaults to the first recorded eos id; the other eos ids become single-token stop words (the
    engine has one end_id, so a second eos such as ChatML's ``<|im_end|>`` must be a stop word).
    """

    def __init__(self, tokenizer: Any, settings: TokenizerSettings):
        self.tokenizer = tokenizer
        self.settings = settings

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of one prompt (as a user chat message when ``apply_chat_template``)."""
        if not text:
            raise RequestError("text_input", "is empty; send at least one character")
        if self.settings.apply_chat_template:
            return chat_to_token_ids(self.tokenizer, [{"role": "user", "content": text}])
        return list(self.tokenizer(text, add_special_tokens=self.settings.add_special_tokens)["input_ids"])

    def encode_words(self, words: Sequence[str]) -> list[list[int]]:
        """Each word's ids with add_special_tokens=False (a stop word is matched as that exact id run)."""
        return [list(self.tokenizer(w, add_special_tokens=False)["input_ids"]) for w in words if w]

    def end_id(self, requested: int | None) -> int:
        if requested is not None:
            return int(requested)
        if not self.settings.eos_token_ids:
            raise RequestError("end_id", "the build recorded no eos id; send end_id with the request")
        return self.settings.eos_token_ids[0]

    def preprocess(self, queries: Sequence[str], stop_words: Sequence[Sequence[str]] | None = None,
                   bad_words: Sequence[Sequence[str]] | None = None, end_ids: Sequence[int | None] | None = None,
                   pad_ids: Sequence[int | None] | None = None) -> dict[str, np.ndarray]:
        """One batch -> the preprocessing outputs (names as in the ensemble's preprocessing step)."""
        batch = len(queries)
        stop_words = stop_words or [[] for _ in range(batch)]
        bad_words = bad_words or [[] for _ in range(batch)]
        end_ids = [self.end_id(e) for e in (end_ids or [None] * batch)]
        pads = [self.settings.pad_id if p is None else int(p) for p in (pad_ids or [None] * batch)]
        ids = [self.encode_prompt(q) for q in queries]
        width = max(len(x) for x in ids)
        input_ids = np.array([x + [pads[b]] * (width - len(x)) for b, x in enumerate(ids)], dtype=np.int32)
        stops = [self.encode_words(words) + [[e] for e in self.settings.eos_token_ids if e != end_ids[b]]
                 for b, words in enumerate(stop_words)]
        return {
            "INPUT_ID": input_ids,  # [B, L]
            "REQUEST_INPUT_LEN": np.array([[len(x)] for x in ids], dtype=np.int32),  # [B, 1]
            "STOP_WORDS_IDS": to_stop_words_list(stops),  # [B, 2, N]
            "BAD_WORDS_IDS": to_stop_words_list([self.encode_words(w) for w in bad_words]),  # [B, 2, N]
            "OUT_END_ID": np.array([[e] for e in end_ids], dtype=np.int32),  # [B, 1]
            "OUT_PAD_ID": np.array([[p] for p in pads], dtype=np.int32),  # [B, 1]
        }


class StreamDetokenizers:
    """Postprocessing: per-request incremental detokenizers, so streamed deltas keep spaces and never
    split a multi-byte character.

    State is keyed by request id and dropped when the request's final chunk is decoded (``final=True``,
    an eos id, or ``max_tokens`` reached); at most ``max_requests`` states are kept (oldest dropped), a
    bound for clients that disconnect mid-stream.
    """

    def __init__(self, tokenizer: Any, settings: TokenizerSettings, max_requests: int = 4096):
        self.tokenizer = tokenizer
        self.settings = settings
        self.max_requests = max_requests
        self._byte_ids = byte_fallback_token_ids(tokenizer)
        self._states: OrderedDict[str, IncrementalDetokenizer] = OrderedDict()

    def __len__(self) -> int:
        return len(self._states)

    def _new(self, prompt_ids: Sequence[int]) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, self.settings.skip_special_tokens, self._byte_ids)

    def decode_all(self, token_ids: Sequence[int], prompt_ids: Sequence[int] = ()) -> str:
        """Stateless: the whole text of a finished (non-streamed) output."""
        detok = self._new(prompt_ids)
        return "".join(detok.add(t) for t in token_ids) + detok.flush()

    def decode_delta(self, key: str, new_ids: Sequence[int], prompt_ids: Sequence[int] = (),
                     max_tokens: int | None = None, final: bool = False) -> str:
        """The text that ``new_ids`` (this chunk of request ``key``) add to the stream."""
        detok = self._states.pop(key, None) or self._new(prompt_ids)
        text = "".join(detok.add(t) for t in new_ids)
        done = final or any(t in self.settings.eos_token_ids for t in new_ids) or (
            max_tokens is not None and detok.num_tokens >= max_tokens)
        if done:
            return text + detok.flush()
        self._states[key] = detok
        while len(self._states) > self.max_requests:
            self._states.popitem(last=False)
        return text
