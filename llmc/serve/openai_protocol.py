"""OpenAI request bodies -> one typed llmc request (pure functions, no HTTP): ``/v1/completions`` and
``/v1/chat/completions``.

Request fields map onto :class:`~llmc.request.params.SamplingParams` (``max_tokens`` -> ``max_new_tokens``,
``seed``, ``stop``, penalties, ``top_p``; llmc extras ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``, ``include_stop_str_in_output``, ``strict_max_tokens``).
``n`` (1-16) completions of the prompt run as that many engine requests (a seeded request's choice i with
``seed + i``); a completions ``prompt`` may be a list of prompts (choice ``k * n + i`` is prompt k's choice i).
Log-probabilities: chat's ``logprobs: true`` with ``top_logprobs`` (0-20), completions' ``logprobs`` (0-20).
Completions' ``echo: true`` puts the prompt before the completion, and with ``logprobs`` its tokens'
log-probabilities (the first token's is null), which is how evaluation harnesses (lm-eval's ``local-completions``)
score a continuation; ``max_tokens: 0`` with ``echo`` returns the prompt alone. Fields that do not change the output
(``user``, ``metadata``, ``store``, ...) are accepted and ignored; features llmc cannot honour (``best_of`` > 1,
chat's ``echo``, the legacy ``functions``) are a 400 unless they ask for nothing (``best_of: 1``, null). Function
calling: chat's ``tools`` with ``tool_choice`` ``"auto"`` (read in the model's own tool-call syntax), ``"required"``
or a named function (:mod:`llmc.serve.openai_tools`), and ``tool`` messages and an assistant's ``tool_calls`` in the
history. Structured outputs: ``response_format`` (``json_object``, ``json_schema``; also TGI's ``{"type", "value"}``
shape, :mod:`llmc.serve.tgi_grammar`) on both endpoints, and llmc's
``structured`` (the same plus ``regex``, ``choice`` and ``grammar`` formats,
:class:`~llmc.request.structured.OutputFormat`), or vLLM's fields for them (:mod:`llmc.serve.vllm_structured`);
``logit_bias`` adds its biases to the logits; chat's
``chat_template_kwargs`` (vLLM's field) passes variables to the chat template (Qwen3's ``enable_thinking``), and
vLLM's ``continue_final_message`` continues a final assistant message (:mod:`llmc.serve.chat_template_args`). Any
other field is a 400 too, as OpenAI's API answers it: a
misspelt ``max_token`` would otherwise be dropped silently and the request run with the default length. Every
RequestError names the client's field (``max_tokens``, ``messages[0].content``), never an internal one. A
``developer`` message (OpenAI's newer name for the system instructions) reaches the chat template as ``system``.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmc.errors import RequestError, UnknownModelError, short_repr
from llmc.request.inputs import ChatPrompt
from llmc.request.params import SamplingParams
from llmc.serve.chat_template_args import FIELDS as TEMPLATE_FIELDS, answer_start, chat_only, template_kwargs
from llmc.serve.openai_tools import ToolCalls, parse_tools
from llmc.serve.protocol import check_param_limits, client_names
from llmc.serve.tgi_grammar import tgi_output_format
from llmc.serve.tool_syntax import ToolSyntax
from llmc.serve.vllm_structured import FIELDS as VLLM_FIELDS, vllm_output_format

PARAM_MAP = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "temperature": "temperature",
             "top_p": "top_p", "seed": "seed", "stop": "stop", "presence_penalty": "presence_penalty",
             "frequency_penalty": "frequency_penalty", "top_k": "top_k", "min_p": "min_p",
             "repetition_penalty": "repetition_penalty", "min_tokens": "min_tokens", "ignore_eos": "ignore_eos",
             "stop_token_ids": "stop_token_ids", "skip_special_tokens": "skip_special_tokens",
             "include_stop_str_in_output": "include_stop_str_in_output"}
# Features llmc cannot honour -> the values besides null that ask for none of it (accepted, as clients send them).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "best_of": (1,), "suffix": ("",),
    "functions": ([],), "function_call": ("none",),
    "modalities": (["text"],), "audio": (), "prediction": (),
    "reasoning_effort": (), "web_search_options": ()}
# Sent by OpenAI clients, no effect on the tokens: accepted and ignored.
IGNORED = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")
COMMON_FIELDS = ("model", "stream", "stream_options", "strict_max_tokens", "n", "logprobs", "top_logprobs", "echo",
                 "response_format", "structured", "logit_bias", "tools", "tool_choice", "parallel_tool_calls",
                 *TEMPLATE_FIELDS, *PARAM_MAP, *UNSUPPORTED, *IGNORED, *VLLM_FIELDS)
MAX_CHOICES = 16  # n: completions of one request (each is an engine request of its own)
MAX_COMPLETIONS = 256  # prompts x n in one completions request
# Other APIs' names for OpenAI fields, for the hint of an unknown field.
OTHER_NAMES = {"stop_sequences": "stop", "max_new_tokens": "max_tokens", "max_length": "max_tokens",
               "random_seed": "seed"}
CHAT_ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {"developer": "system"}


@dataclass(frozen=True)
class OpenAIRequest:
    """A parsed OpenAI request. ``prompts``: texts or token-id lists (completions) or one list of ``{"role",
    "content"}`` string messages (chat). ``names``: llmc's internal names -> this request's field names, for later
    errors. ``echo``: the prompt goes before each completion; ``score_only`` (``max_tokens: 0`` with echo): the one
    token the engine generates is not returned."""

    model: str
    prompts: tuple[Any, ...]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    strict_max_tokens: bool = False
    names: Mapping[str, str] = field(default_factory=dict)
    n: int = 1  # completions of each prompt (choices)
    echo: bool = False
    score_only: bool = False
    tools: ToolCalls | None = None  # chat's function calling (tools + tool_choice "auto", "required" or a function)

    @property
    def prompt(self) -> Any:
        """The first (for chat: the only) prompt."""
        return self.prompts[0]


def parse_openai_request(body: Mapping[str, Any], chat: bool, served: tuple[str, ...], defaults: SamplingParams,
                         vocab_size: int | None = None, tool_syntax: ToolSyntax | None = None) -> OpenAIRequest:
    """Check and translate an OpenAI body. ``served``: accepted model names (the first is the default);
    ``tool_syntax``: the served model's tool-call syntax (None: ``tool_choice: "auto"`` is refused).

    Raises RequestError naming the client's field for every problem."""
    check_fields(body, chat)
    tokens_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    names = {"max_new_tokens": tokens_field, "prompt": "messages" if chat else "prompt"}
    model = check_model(body, served)
    prompts = (parse_messages(body.get("messages")),) if chat else parse_prompts(body.get("prompt"))
    n, echo = _choices(body), _echo(body, chat)
    if len(prompts) * n > MAX_COMPLETIONS:
        raise RequestError("n", f"{len(prompts)} prompts x n={n} make {len(prompts) * n} completions; at most "
                                f"{MAX_COMPLETIONS} in one request: send the prompts in several requests")
    score_only = not chat and _is_zero(body.get(tokens_field))
    if score_only:
        if not echo:
            raise RequestError(tokens_field, 'must be >= 1; 0 is accepted with "echo": true (the prompt alone, '
                                             'scored with logprobs)')
        body = {**body, tokens_field: 1}  # the engine makes one token, which the response leaves out
    with client_names(names):
        params = sampling_params(body, defaults, vocab_size)
    logprobs = _logprobs(body, chat)
    structured, names["structured"] = _output_format(body)
    tools = parse_tools(body, chat, tool_syntax)
    if tools is not None:
        if structured is not None:
            raise RequestError("tools", f"and {names['structured']} both set the answer's format; a tool call's "
                                        f"format is its function's parameters")
        structured, names["structured"] = tools.output_format, "tools"
    chat_only(body, chat)
    kwargs, (opening, continued) = template_kwargs(body), answer_start(body, prompts[0]) if chat else (True, False)
    if tools is not None or kwargs or not opening:
        functions = tools.tools if tools is not None else ()
        prompts = (ChatPrompt(tuple(prompts[0]), functions, kwargs, opening, continued),)
    with client_names(names):
        params = params.replace(logprobs=logprobs, prompt_logprobs=logprobs if echo else None, structured=structured,
                                logit_bias=_logit_bias(body)).validate(vocab_size)
    return OpenAIRequest(model, prompts, params, flag(body, "stream"), _include_usage(body),
                         flag(body, "strict_max_tokens"), names, n, echo, score_only, tools)


def check_model(body: Mapping[str, Any], served: tuple[str, ...]) -> str:
    """The body's ``model`` (default: the first of ``served``); UnknownModelError for a name not in ``served``."""
    model = body.get("model") or served[0]
    if not isinstance(model, str) or model not in served:
        raise UnknownModelError("model", f"unknown model {model!r}; this server serves {served[0]!r}")
    return model


def _output_format(body: Mapping[str, Any]) -> tuple[Any, str]:
    """``SamplingParams.structured`` from OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``
    with ``json_schema.schema``) or llmc's ``structured`` (any :class:`~llmc.request.structured.OutputFormat`: also
    ``regex``, ``choice``, ``grammar``), and the client's name of that field (for errors)."""
    fmt, extension = body.get("response_format"), body.get("structured")
    vllm, vllm_field = vllm_output_format(body)
    if vllm is not None:
        if extension is not None or fmt not in (None, {"type": "text"}):
            other = "structured" if extension is not None else "response_format"
            raise RequestError(vllm_field.split(".")[0], f"and {other} both set an output format; send one of them")
        return vllm, vllm_field
    if fmt is not None and fmt != {"type": "text"}:
        if extension is not None:
            raise RequestError("structured", "and response_format both set an output format; send one of them")
        if isinstance(fmt, dict) and "value" in fmt:  # TGI's shape, which huggingface_hub's chat client sends
            return tgi_output_format(fmt, "response_format"), "response_format"
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise RequestError("response_format", f'must be {{"type": "text"}}, {{"type": "json_object"}} or '
                                                  f'{{"type": "json_schema", "json_schema": {{"name": ..., "schema": '
                                                  f'{{...}}}}}}, got {short_repr(fmt)}; llmc\'s "structured" field '
                                                  f'also takes regex, choice and grammar formats')
        if fmt["type"] == "json_object":
            return {"type": "json_object"}, "response_format"
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
            raise RequestError("response_format.json_schema", f'must be an object with the JSON schema under '
                                                              f'"schema", got {short_repr(spec)}')
        return {"type": "json_schema", "schema": spec["schema"]}, "response_format"
    return extension, "structured"


def _logit_bias(body: Mapping[str, Any]) -> Any:
    """OpenAI's ``logit_bias`` (token ids as JSON keys -> bias in [-100, 100]); validated by SamplingParams."""
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise RequestError("logit_bias", f'must map token ids to biases, e.g. {{"50256": -100}}, got '
                                         f'{short_repr(bias)}')
    return bias


def _is_zero(value: Any) -> bool:
    return type(value) is int and value == 0


def _echo(body: Mapping[str, Any], chat: bool) -> bool:
    echo = flag(body, "echo")
    if echo and chat:
        raise RequestError("echo", "is not supported by /v1/chat/completions; /v1/completions echoes a prompt")
    return echo


def check_fields(body: Mapping[str, Any], chat: bool) -> None:
    """RequestError for a field neither endpoint knows (with the nearest known name), or the other endpoint's
    prompt field."""
    own, other = ("messages", "prompt") if chat else ("prompt", "messages")
    for key in body:
        if key == own or key in COMMON_FIELDS:
            continue
        if key == other:
            route = "/v1/completions" if chat else "/v1/chat/completions"
            raise RequestError(key, f"is a field of {route}; this endpoint takes {own!r}")
        raise unknown_field(key, (own, *COMMON_FIELDS), other_names=OTHER_NAMES)


def unknown_field(key: str, accepted: Sequence[str], prefix: str = "",
                  other_names: Mapping[str, str] | None = None) -> RequestError:
    """The error for a field not in ``accepted``: its nearest accepted name (``other_names``: other APIs' names
    for accepted fields) and the accepted ones. ``prefix``: where the field sits (``parameters.``)."""
    names = other_names or {}
    near = [names[key]] if key in names else difflib.get_close_matches(key, accepted, n=1)
    hint = f"did you mean {near[0]!r}? " if near else ""
    listed = ", ".join(sorted(accepted))
    return RequestError(f"{prefix}{key}", f"unknown field; {hint}the accepted fields are: {listed}")


def sampling_params(body: Mapping[str, Any], defaults: SamplingParams, vocab_size: int | None) -> SamplingParams:
    """SamplingParams from an OpenAI body (``defaults`` for absent fields); RequestError names the field."""
    check_unsupported(body, UNSUPPORTED)
    changes = {target: body[key] for key, target in PARAM_MAP.items() if body.get(key) is not None}
    return check_param_limits(defaults.replace(**changes).validate(vocab_size))


def _choices(body: Mapping[str, Any]) -> int:
    n = body.get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise RequestError("n", f"must be an integer in [1, {MAX_CHOICES}] (the completions to return), got {n!r}")
    return n


def _logprobs(body: Mapping[str, Any], chat: bool) -> int | None:
    """``SamplingParams.logprobs`` from chat's ``logprobs`` (true / false) and ``top_logprobs`` (0-20), or from
    completions' ``logprobs`` (the number of most likely tokens, 0-20); None: not asked for."""
    value, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:
        if value is not None and not isinstance(value, bool):
            raise RequestError("logprobs", f"must be true or false, got {value!r}; the number of alternatives is "
                                           f"top_logprobs")
        if top is not None and not value:
            raise RequestError("top_logprobs", 'needs "logprobs": true')
        count = (0 if top is None else top) if value else None
    else:
        if top is not None:
            raise RequestError("top_logprobs", "is a field of /v1/chat/completions; here logprobs is the number "
                                               "of most likely tokens")
        if isinstance(value, bool):
            raise RequestError("logprobs", f"must be the number of most likely tokens to return (0-20), got "
                                           f"{value!r}")
        count = value
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= 20):
        raise RequestError("top_logprobs" if chat else "logprobs", f"must be an integer in [0, 20], got {count!r}")
    return count


def check_unsupported(body: Mapping[str, Any], unsupported: Mapping[str, tuple[Any, ...]],
                      fixes: Mapping[str, str] | None = None) -> None:
    """RequestError for a field of ``unsupported`` (field -> the values besides null that ask for none of the
    feature) that asks for the feature; ``fixes``: what to do instead, per field (default: remove it)."""
    for key, neutral in unsupported.items():
        value = body.get(key)
        if value is not None and not any(_same(value, v) for v in neutral):
            fix = (fixes or {}).get(key, "remove it")
            raise RequestError(key, f"is not supported by llmc (got {short_repr(value)}); {fix}")


def _same(value: Any, neutral: Any) -> bool:
    """``value == neutral`` without counting True as 1 or 1.0 as a count."""
    return type(value) is type(neutral) and value == neutral


def parse_prompts(prompt: Any) -> tuple[str | list[int], ...]:
    """A completions ``prompt``: a string, a list of token ids, or a non-empty list of either (several prompts)."""
    if _one_prompt(prompt):
        return (prompt,)
    if isinstance(prompt, list) and prompt and all(_one_prompt(p) for p in prompt):
        return tuple(prompt)
    raise RequestError("prompt", "must be a string, a list of token ids, or a list of prompts (strings or token-id "
                                 "lists)")


def _one_prompt(prompt: Any) -> bool:
    return isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt)
                                       and all(type(t) is int for t in prompt))


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
        role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in CHAT_ROLES:
            raise RequestError(f"{where}.role", f"must be one of {', '.join((*CHAT_ROLES, *ROLE_ALIASES))}, got "
                                                f"{m.get('role')!r}")
        calls = m.get("tool_calls") if role == "assistant" else None
        content = m.get("content")
        text = "" if content is None and calls else text_content(content, f"{where}.content")
        message = {"role": role, "content": text}
        if calls:
            message["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
        if role == "tool" and isinstance(m.get("tool_call_id"), str):
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    return out


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's earlier ``tool_calls`` (``{"id", "type": "function", "function": {"name",
    "arguments"}}``), kept for the chat template."""
    if not isinstance(calls, list):
        raise RequestError(where, "must be a list of function calls")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not isinstance(
                function.get("arguments", ""), str):
            raise RequestError(f"{where}[{j}]", 'must be {"id": ..., "type": "function", "function": {"name": ..., '
                                                '"arguments": "<JSON text>"}}')
    return calls


def text_content(content: Any, where: str, kinds: tuple[str, ...] = ("text",)) -> str:
    """A message's content: a string, or a list of text parts (``{"type": <one of kinds>, "text": str}``) joined;
    RequestError naming the part at fault (llmc serves text only)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(where, f"must be a string or a list of {kinds[0]} parts, got {type(content).__name__}")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in kinds:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(f"{where}[{j}]", f"must be a {{\"type\": \"{kinds[0]}\", \"text\": ...}} part, got "
                                                f"{kind!r}; llmc serves text only")
        if not isinstance(part.get("text"), str):
            raise RequestError(f"{where}[{j}].text", f"must be a string, got {type(part.get('text')).__name__}")
        parts.append(part["text"])
    return "".join(parts)


def string_field(item: Mapping[str, Any], key: str, where: str) -> str:
    """``item[key]``, a string; RequestError naming ``where.key`` for anything else."""
    value = item.get(key)
    if not isinstance(value, str):
        raise RequestError(f"{where}.{key}", f"must be a string, got {short_repr(value)}")
    return value


def flag(body: Mapping[str, Any], key: str, default: bool | None = False) -> bool | None:
    """The body's boolean ``key`` (``default`` when absent or null); RequestError naming it for anything else."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(key, f"must be true or false, got {short_repr(value)}")
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
