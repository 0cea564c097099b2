"""Hugging Face Text Generation Inference (TGI)'s own protocol, pure (no HTTP): a ``/generate`` body read as an llmc
request, and the answers and errors in TGI's shapes. Clients written for TGI (huggingface_hub's
``InferenceClient.text_generation``, the ``text-generation`` client, LangChain's ``HuggingFaceEndpoint``) send it.

The body: ``{"inputs": text, "parameters": {...}, "stream": bool, "add_special_tokens": bool}``. TGI's rules, as
its router applies them (huggingface/text-generation-inference@db931fc ``router/src/validation.rs``, ``lib.rs``):

- Greedy unless ``do_sample`` is true or ``temperature`` / ``top_k`` / ``top_p`` ask for sampling; a body without
  ``parameters`` samples (TGI's default parameters set ``do_sample``). Absent fields take the recipe's
  ``runtime.sampling``, as on the other routes (a greedy recipe samples at temperature 1.0 when asked to sample).
- ``max_new_tokens`` absent: as many as ``max_seq_len`` leaves after the prompt; given and over that room: a 422.
- ``stop`` strings stay in the output (TGI keeps the stop sequence); ``truncate`` keeps the prompt's last tokens.
- ``details`` returns every generated token (the stop id included, ``special``) with its log-probability;
  ``top_n_tokens`` the most likely alternatives; ``decoder_input_details`` the prompt's tokens (``prefill``, the
  first one's log-probability null), not with streaming. ``grammar``: ``json`` / ``json_schema`` / ``regex``.
- Log-probabilities are llmc's: the log-softmax of the raw logits (before temperature and penalties).
- What llmc cannot honour is a 422 naming it: ``best_of`` > 1, ``typical_p`` < 1, ``watermark``, ``adapter_id``.

Errors are ``{"error": message, "error_type": kind}`` (huggingface_hub raises its ``ValidationError``,
``OverloadedError``, ... by ``error_type``): 422 validation, 429 overloaded (the queue is full), 424 generation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llmc.errors import RequestError, short_repr
from llmc.request.outputs import StreamEvent, TokenLogprob
from llmc.request.params import MAX_LOGPROBS, SamplingParams
from llmc.serve.openai_logprobs import TokenTexts
from llmc.serve.openai_protocol import check_unsupported, flag, unknown_field
from llmc.serve.protocol import check_param_limits, client_names
from llmc.serve.tgi_grammar import tgi_output_format

TGI_PATHS = ("/", "/generate", "/generate_stream", "/info")
FIELDS = ("inputs", "parameters", "stream", "add_special_tokens")
PARAM_MAP = {"max_new_tokens": "max_new_tokens", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
             "repetition_penalty": "repetition_penalty", "frequency_penalty": "frequency_penalty", "seed": "seed",
             "stop": "stop"}
OPTIONS = ("do_sample", "details", "decoder_input_details", "return_full_text", "top_n_tokens", "truncate", "grammar")
UNSUPPORTED: dict[str, tuple[Any, ...]] = {"best_of": (1,), "typical_p": (1.0, 1), "watermark": (False,),
                                           "adapter_id": ()}
PARAMETERS = (*PARAM_MAP, *OPTIONS, *UNSUPPORTED)
# llmc's names -> the client's, for errors raised below the parser
NAMES = {"prompt": "inputs", "structured": "parameters.grammar", "logprobs": "parameters.top_n_tokens",
         **{target: f"parameters.{key}" for key, target in PARAM_MAP.items()}}
# TGI's status and error_type per llmc status
ERROR_KINDS = {400: (422, "validation"), 401: (401, "authentication"), 404: (404, "not_found"),
               503: (503, "unhealthy"), 504: (504, "generation"), 500: (424, "generation")}


@dataclass(frozen=True)
class TgiRequest:
    """A parsed TGI body. ``stream``: None when the body does not say; ``strict``: ``max_new_tokens`` was given, so
    a prompt that leaves less room is refused (else capped); ``truncate``: the prompt's last tokens to keep;
    ``add_special_tokens``: None for the recipe's."""

    inputs: str
    params: SamplingParams
    stream: bool | None = None
    details: bool = False
    decoder_input_details: bool = False
    return_full_text: bool | None = None
    truncate: int | None = None
    add_special_tokens: bool | None = None
    strict: bool = False

    @property
    def top_n_tokens(self) -> int:
        return self.params.logprobs or 0


def parse_tgi_request(body: Mapping[str, Any], defaults: SamplingParams, max_seq_len: int,
                      max_input_len: int, vocab_size: int | None = None) -> TgiRequest:
    """Check and translate a TGI body; RequestError naming the client's field (``parameters.top_p``)."""
    _check_names(body, FIELDS, "")
    inputs = body.get("inputs")
    if not isinstance(inputs, str) or not inputs:
        raise RequestError("inputs", f"must be a non-empty string (the prompt), got {short_repr(inputs)}")
    p = body.get("parameters")
    if p is not None and not isinstance(p, Mapping):
        raise RequestError("parameters", f"must be an object of generation parameters, got {short_repr(p)}")
    p = {"do_sample": True} if p is None else p  # TGI's default parameters sample
    _check_names(p, PARAMETERS, "parameters.")
    check_unsupported({f"parameters.{k}": v for k, v in p.items()},
                      {f"parameters.{k}": v for k, v in UNSUPPORTED.items()})
    changes = {target: p[key] for key, target in PARAM_MAP.items() if p.get(key) is not None}
    sampling = _flag(p, "do_sample") or any(p.get(k) not in (None, n) for k, n in (("temperature", 1.0),
                                                                                     ("top_k", 0), ("top_p", 1.0)))
    if not sampling:
        changes["temperature"] = 0.0
    elif "temperature" not in changes and defaults.temperature == 0:
        changes["temperature"] = 1.0
    changes.setdefault("max_new_tokens", max_seq_len)
    details, prefill = _flag(p, "details"), _flag(p, "decoder_input_details")
    structured = tgi_output_format(p.get("grammar"), "parameters.grammar")
    with client_names(NAMES):
        params = check_param_limits(defaults.replace(
            **changes, include_stop_str_in_output=True, logprobs=_count(p, "top_n_tokens", MAX_LOGPROBS) or 0,
            prompt_logprobs=0 if prefill else None, structured=structured).validate(vocab_size))
    special = flag(body, "add_special_tokens", None)
    return TgiRequest(inputs, params, flag(body, "stream", None), details or prefill, prefill,
                      _flag(p, "return_full_text", None), _count(p, "truncate", max_input_len, 1), special,
                      p.get("max_new_tokens") is not None)


def _flag(p: Mapping[str, Any], key: str, default: bool | None = False) -> bool | None:
    with client_names({key: f"parameters.{key}"}):
        return flag(p, key, default)


def _check_names(body: Mapping[str, Any], accepted: Sequence[str], prefix: str) -> None:
    for key in body:
        if key not in accepted:
            raise unknown_field(str(key), accepted, prefix)


def _count(p: Mapping[str, Any], key: str, most: int, least: int = 0) -> int | None:
    value = p.get(key)
    if value is None:
        return None
    if type(value) is not int or not least <= value <= most:
        raise RequestError(f"parameters.{key}", f"must be an integer in [{least}, {most}], got {short_repr(value)}")
    return value


def tgi_error(status: int, message: str, code: str | None = None) -> tuple[int, dict[str, str]]:
    """TGI's status and error body for an llmc error of HTTP ``status`` and OpenAI ``code`` (a full queue is
    ``overloaded``, a 429)."""
    if code == "queue_full":
        return 429, {"error": message, "error_type": "overloaded"}
    status, kind = ERROR_KINDS.get(status, (status, "validation" if status < 500 else "generation"))
    return status, {"error": message, "error_type": kind}


def finish_reason(event: StreamEvent) -> str:
    """TGI's finish reason: ``length``, ``stop_sequence`` (a stop string) or ``eos_token`` (a stop id, or a
    structured output that is complete)."""
    if event.finish_reason == "length":
        return "length"
    return "stop_sequence" if isinstance(event.stop_reason, str) else "eos_token"


class TokenEntries:
    """TGI's token objects (``{"id", "text", "logprob", "special"}``) of a request's events. A generated token's
    ``text`` is the output text its event added (on an event's last token), so the stream's texts concatenate to
    ``generated_text``; a prompt token's or an alternative's is that token decoded alone."""

    def __init__(self, tokenizer: Any, special_ids: frozenset[int]):
        self.decoded, self.special_ids = TokenTexts(tokenizer), special_ids

    def entry(self, token_id: int, logprob: float, text: str | None = None) -> dict[str, Any]:
        return {"id": token_id, "text": self.decoded(token_id) if text is None else text, "logprob": logprob,
                "special": token_id in self.special_ids}

    def generated(self, event: StreamEvent) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
        """The event's tokens, each with its alternatives."""
        out, last = [], len(event.token_ids) - 1
        lps = event.logprobs if len(event.logprobs) == len(event.token_ids) else ()
        for i, token_id in enumerate(event.token_ids):
            lp = lps[i] if lps else TokenLogprob(token_id, float("nan"))
            top = [self.entry(t, v) for t, v in lp.top]
            out.append((self.entry(token_id, _number(lp.logprob), event.text if i == last else ""), top))
        return out

    def prefill(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
        """``decoder_input_details``: the prompt's tokens; the first has no log-probability (nothing before it)."""
        values = [None, *(_number(lp.logprob) for lp in logprobs)]
        return [{"id": t, "text": self.decoded(t), "logprob": v} for t, v in zip(token_ids, values)]


def _number(value: float) -> float | None:
    """JSON has no NaN or infinity: such a log-probability goes out as null (as TGI's serializer writes NaN)."""
    return value if value == value and abs(value) != float("inf") else None
