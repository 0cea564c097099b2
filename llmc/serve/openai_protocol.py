"""OpenAI request bodies -> one typed llmc request (pure functions, no HTTP): ``/v1/completions`` and
``/v1/chat/completions``.

Request fields map onto :class:`~llmc.request.params.SamplingParams` (``max_tokens`` -> ``max_new_tokens``,
``seed``, ``stop``, penalties, ``top_p``; llmc extras ``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``, ``include_stop_str_in_output``,
``strict_max_tokens``). Fields OpenAI clients commonly send and llmc does not use (``user``, ``logit_bias:
null``, ...) are ignored; features llmc cannot honour (``n`` > 1, log probs, tools) are a 400. Every
RequestError names the client's field (``max_tokens``, ``messages[0].content``), never an internal one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llmc.errors import RequestError
from llmc.request.params import SamplingParams
from llmc.serve.protocol import check_param_limits, client_names

PARAM_MAP = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "temperature": "temperature",
             "top_p": "top_p", "seed": "seed", "stop": "stop", "presence_penalty": "presence_penalty",
             "frequency_penalty": "frequency_penalty", "top_k": "top_k", "min_p": "min_p",
             "repetition_penalty": "repetition_penalty", "min_tokens": "min_tokens", "ignore_eos": "ignore_eos",
             "stop_token_ids": "stop_token_ids", "skip_special_tokens": "skip_special_tokens",
             "include_stop_str_in_output": "include_stop_str_in_output"}
UNSUPPORTED = {"n": 1, "best_of": 1, "logprobs": None, "top_logprobs": None, "echo": False, "suffix": None,
               "tools": None, "functions": None}
CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class OpenAIRequest:
    """A parsed OpenAI request. ``prompt``: text or token ids (completions) or ``{"role", "content"}`` string
    messages (chat). ``names``: llmc's internal names -> this request's field names, for later errors."""

    model: str
    prompt: Any
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    strict_max_tokens: bool = False
    names: Mapping[str, str] = field(default_factory=dict)


def parse_openai_request(body: Mapping[str, Any], chat: bool, served: tuple[str, ...], defaults: SamplingParams,
                         vocab_size: int | None = None) -> OpenAIRequest:
    """Check and translate an OpenAI body. ``served``: accepted model names (the first is the default).

    Raises RequestError naming the client's field for every problem."""
    tokens_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    names = {"max_new_tokens": tokens_field, "prompt": "messages" if chat else "prompt"}
    model = body.get("model") or served[0]
    if not isinstance(model, str) or model not in served:
        raise RequestError("model", f"unknown model {model!r}; this server serves {served[0]!r}")
    prompt = parse_messages(body.get("messages")) if chat else parse_prompt(body.get("prompt"))
    with client_names(names):
        params = sampling_params(body, defaults, vocab_size)
    return OpenAIRequest(model, prompt, params, _flag(body, "stream"), _include_usage(body),
                         _flag(body, "strict_max_tokens"), names)


def sampling_params(body: Mapping[str, Any], defaults: SamplingParams, vocab_size: int | None) -> SamplingParams:
    """SamplingParams from an OpenAI body (``defaults`` for absent fields); RequestError names the field."""
    for key, neutral in UNSUPPORTED.items():
        value = body.get(key)
        if value is not None and value != neutral and not (key == "logprobs" and value is False):
            raise RequestError(key, f"is not supported by llmc (got {value!r}); remove it")
    changes = {target: body[key] for key, target in PARAM_MAP.items() if body.get(key) is not None}
    return check_param_limits(defaults.replace(**changes).validate(vocab_size))


def parse_prompt(prompt: Any) -> str | list[int]:
    """A completions ``prompt``: a string, a list of token ids, or a one-element list of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)):
        return prompt
    raise RequestError("prompt", "must be a string or a list of token ids (one prompt per request)")


def parse_messages(messages: Any) -> list[dict[str, str]]:
    """Chat ``messages`` -> ``[{"role", "content"}]`` with string contents (text parts joined).

    A role outside :data:`CHAT_ROLES`, a content that is neither a string nor a list of ``{"type": "text",
    "text": str}`` parts, or a non-text part is a RequestError naming ``messages[i]...``."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "must be a non-empty list of {\"role\", \"content\"} objects")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(where, "must be an object with role and content")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise RequestError(f"{where}.role", f"must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        out.append({"role": role, "content": _content(m.get("content"), f"{where}.content")})
    return out


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(where, f"must be a string or a list of text parts, got {type(content).__name__}")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(f"{where}[{j}]", f"must be a {{\"type\": \"text\", \"text\": ...}} part, got "
                                                f"{kind!r}; llmc serves text only")
        if not isinstance(part.get("text"), str):
            raise RequestError(f"{where}[{j}].text", f"must be a string, got {type(part.get('text')).__name__}")
        parts.append(part["text"])
    return "".join(parts)


def _flag(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(key, f"must be true or false, got {value!r}")
    return value


def _include_usage(body: Mapping[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise RequestError("stream_options", f"must be an object such as {{\"include_usage\": true}}, got "
                                             f"{options!r}")
    value = options.get("include_usage", False)
    if not isinstance(value, bool):
        raise RequestError("stream_options.include_usage", f"must be true or false, got {value!r}")
    return value
