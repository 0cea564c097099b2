"""SamplingParams -> the keyword arguments of ``ModelRunnerCpp.generate`` (TensorRT-LLM 1.0 - 1.2).

Mapping (llmc field -> TensorRT-LLM kwarg), checked against ``tensorrt_llm/runtime/model_runner_cpp.py``
(docs/TENSORRT_LLM.md names the commit):
- ``max_new_tokens`` -> ``max_new_tokens``, ALWAYS passed (its default is 1), clipped so prompt + new tokens
  fit ``engine.max_seq_len``;
- the first recorded eos id -> ``end_id`` and the pad id -> ``pad_id``, ALWAYS passed (both default to
  None); TensorRT-LLM has one end id, so the other eos ids go to ``stop_words_list``;
- ``stop_token_ids`` and ``stop`` strings (encoded with add_special_tokens=False) -> ``stop_words_list``:
  ONE LIST PER REQUEST of token-id lists (``List[List[List[int]]]``), which ``generate`` zips per request
  into ``Request(stop_words=...)``. The ``[batch, 2, N]`` tensor of :mod:`stop_words` is the Triton
  backend's form only: given to ``generate`` its offset row would become a stop word (eos ids
  [128001, 128009] -> row 1 ``[1]`` -> every request stops on token id 1);
- ``temperature == 0`` (greedy) -> ``top_k=1, temperature=1.0`` (top-1 sampling is argmax; a
  temperature of 0 would divide by zero); otherwise ``temperature``, ``top_k`` (0 = off),
  ``top_p`` as given;
- ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty`` -> same names;
- ``seed`` -> ``random_seed`` (generate renames it to SamplingConfig's ``seed``), ``min_p`` -> ``min_p``,
  ``min_tokens`` -> ``min_tokens``: each only when set (all three are in generate's accepted list);
- ``ignore_eos`` has no generate kwarg and is refused with a RequestError when set (rather than ignored);
  so are ``logprobs`` and ``prompt_logprobs``, which this backend does not return yet, ``structured`` (output
  formats: ``ModelRunnerCpp`` has no guided-decoding argument in 1.0 - 1.2) and ``logit_bias``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llmc.errors import RequestError
from llmc.request.params import SamplingParams

# SamplingParams field -> (the value the tensorrt_llm backend honours, why no other)
UNSUPPORTED_DEFAULTS = {
    "ignore_eos": (False, "ModelRunnerCpp has no such sampling option in TensorRT-LLM 1.0 - 1.2"),
    "logprobs": (None, "llmc's tensorrt_llm backend does not return log-probabilities yet"),
    "prompt_logprobs": (None, "llmc's tensorrt_llm backend does not return log-probabilities yet"),
    "structured": (None, "TensorRT-LLM's ModelRunnerCpp takes no guided decoding; the build's Triton model "
                         "repository takes guided_decoding_guide inputs"),
    "logit_bias": ((), "llmc's tensorrt_llm backend does not pass a logit bias to TensorRT-LLM yet"),
}


def refuse_unsupported(params: SamplingParams) -> None:
    """RequestError for a SamplingParams field the tensorrt_llm backend cannot honour."""
    for name, (default, why) in UNSUPPORTED_DEFAULTS.items():
        if getattr(params, name) != default:
            raise RequestError(
                name,
                f"{getattr(params, name)!r} is not supported by the tensorrt_llm backend ({why}); leave it at "
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
    if params.min_p > 0:
        kwargs["min_p"] = float(params.min_p)
    if params.min_tokens > 0:
        kwargs["min_tokens"] = int(params.min_tokens)
    return kwargs


def stop_word_ids(tokenizer: Any, params: SamplingParams, eos_token_ids: Sequence[int]) -> list[list[int]]:
    """One request's stop words as token-id lists: extra eos ids, stop ids, then encoded stop strings.

    Stop strings are encoded with ``add_special_tokens=False``. TensorRT-LLM
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

    ``max_new_tokens`` is already clipped by the caller. ``stop_words_list`` is one list of token-id lists
    per request (``[[ids of word 1], [ids of word 2], ...]`` each), or None when there are no stop words.
    """
    words = stop_word_ids(tokenizer, params, eos_token_ids)
    stop_words_list = [[list(w) for w in words] for _ in range(batch_size)] if words else None
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
