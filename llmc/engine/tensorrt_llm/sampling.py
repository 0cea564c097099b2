"""SamplingParams -> the keyword arguments of ``ModelRunnerCpp.generate`` (reference lines 87-91).

Mapping (llmc field -> TensorRT-LLM kwarg):
- ``max_new_tokens`` -> ``max_new_tokens``, ALWAYS passed (pitfall, line 90: its default is 1), clipped
  so prompt + new tokens fit ``engine.max_seq_len``;
- the first recorded eos id -> ``end_id`` and the pad id -> ``pad_id``, ALWAYS passed (line 90: both
  default to None); TensorRT-LLM has one end id, so the other eos ids go to ``stop_words_list``
  (triton.md line 39);
- ``stop_token_ids`` and ``stop`` strings (encoded with add_special_tokens=False, triton.md line 34)
  -> ``stop_words_list`` ([batch, 2, N] int32, :mod:`stop_words`);
- ``temperature == 0`` (greedy) -> ``top_k=1, temperature=1.0`` (top-1 sampling is argmax; a
  temperature of 0 would divide by zero); otherwise ``temperature``, ``top_k`` (0 = off),
  ``top_p`` as given;
- ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty`` -> same names;
- ``seed`` -> ``random_seed`` (only when set);
- ``min_p``, ``min_tokens``, ``ignore_eos`` have no kwarg in the reference and are refused with a
  RequestError when set (rather than silently ignored).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from llmc.engine.tensorrt_llm.stop_words import to_stop_words_list
from llmc.errors import RequestError
from llmc.runtime.params import SamplingParams

UNSUPPORTED_DEFAULTS = {"min_p": 0.0, "min_tokens": 0, "ignore_eos": False}


def refuse_unsupported(params: SamplingParams) -> None:
    """RequestError for a SamplingParams field the tensorrt_llm backend cannot honour."""
    for name, default in UNSUPPORTED_DEFAULTS.items():
        if getattr(params, name) != default:
            raise RequestError(
                name,
                f"{getattr(params, name)!r} is not supported by the tensorrt_llm backend "
                f"(ModelRunnerCpp has no such sampling option in TensorRT-LLM 1.0 - 1.2); leave it at "
                f"{default!r} or use backend: torch",
            )


def sampling_kwargs(params: SamplingParams) -> dict[str, Any]:
    """The sampling part of the ``generate`` kwargs (see the module docstring for the mapping)."""
    refuse_unsupported(params)
    greedy = params.temperature == 0
    kwargs: dict[str, Any] = {
        "temperature": 1.0 if greedy else float(params.temperature),
        "top_k": 1 if greedy else int(params.top_k),
        "top_p": float(params.top_p),
        "repetition_penalty": float(params.repetition_penalty),
        "presence_penalty": float(params.presence_penalty),
        "frequency_penalty": float(params.frequency_penalty),
    }
    if params.seed is not None:
        kwargs["random_seed"] = int(params.seed)
    return kwargs


def stop_word_ids(tokenizer: Any, params: SamplingParams, eos_token_ids: Sequence[int]) -> list[list[int]]:
    """One request's stop words as token-id lists: extra eos ids, stop ids, then encoded stop strings.

    Stop strings are encoded with ``add_special_tokens=False`` (triton.md line 34). TensorRT-LLM
    matches these token sequences; llmc's StopStringMatcher on the decoded text stays the authority
    for strings (a string can tokenize differently inside the output).
    """
    words = [[int(t)] for t in eos_token_ids[1:]]
    words += [[int(t)] for t in params.stop_token_ids if [int(t)] not in words]
    for text in params.stop:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if ids:
            words.append([int(t) for t in ids])
    return words


def generate_kwargs(tokenizer: Any, params: SamplingParams, eos_token_ids: Sequence[int], pad_id: int,
                    batch_size: int, max_new_tokens: int) -> dict[str, Any]:
    """All keyword arguments of one ``ModelRunnerCpp.generate`` call (batch shares ``params``).

    ``max_new_tokens`` is already clipped by the caller. ``stop_words_list`` is an int32
    [batch, 2, N] array, or None when the request has no stop words.
    """
    words = stop_word_ids(tokenizer, params, eos_token_ids)
    stop_words_list: np.ndarray | None = to_stop_words_list([words] * batch_size) if words else None
    return {
        "max_new_tokens": int(max_new_tokens),
        "end_id": int(eos_token_ids[0]),
        "pad_id": int(pad_id),
        "stop_words_list": stop_words_list,
        "streaming": True,
        **sampling_kwargs(params),
        "return_dict": True,
        "output_sequence_lengths": True,
    }
