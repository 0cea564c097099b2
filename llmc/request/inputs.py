"""Request input handling: prompts (text, bytes, chat messages, token ids) -> validated token ids.

Runs in the caller's thread (never on the engine's step loop): tokenization and chat templating are CPU
work that must not stall the model. Every problem raises :class:`RequestError` naming the field.

Size is checked before any tokenization: a prompt of ``max_input_len`` tokens spans at most
:func:`max_prompt_chars` characters, so a longer one is refused without tokenizing it (a 5 MB prompt once took
1.3 GB of tokenizer memory only to be refused by its token count).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

from llmc.errors import RequestError


@dataclass(frozen=True)
class ChatPrompt:
    """Chat messages with the function tools the model may call (OpenAI's ``tools``: ``{"type": "function",
    "function": {"name", "description", "parameters"}}``), rendered by the model's chat template with ``tools=``.
    A template that does not use tools gets them as a system message instead (:func:`tools_instruction`), and one
    that does not render an assistant's ``tool_calls`` gets those calls as the message's text.
    ``template_kwargs``: more variables for the template (e.g. Qwen3's ``enable_thinking``).
    ``generation_prompt``: the template's opening of the assistant's turn goes after the messages (as every request
    has it; off only where a client counts a conversation's tokens, vLLM's ``/tokenize``).
    ``continue_final``: the last message (the assistant's) is left open and the answer continues it (a prefill:
    Anthropic's Messages API, vLLM's ``continue_final_message``); no generation prompt then."""

    messages: tuple[dict, ...]
    tools: tuple[dict, ...] = ()
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    generation_prompt: bool = True
    continue_final: bool = False


Prompt = Union[str, bytes, Sequence[int], Sequence[dict], ChatPrompt]


# Normalizers may shorten text before it is split into tokens: allow twice the longest token's text per token.
_NORMALIZER_SLACK = 2


def max_prompt_chars(tokenizer: Any, max_input_len: int) -> int:
    """The most characters that ``max_input_len`` tokens can span: each token's text is at most the
    vocabulary's longest (byte-level BPE: one character per byte), times a slack for normalizers."""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return max_input_len * max(longest, 1) * _NORMALIZER_SLACK


def check_prompt_size(num_chars: int, max_chars: int | None, field: str = "prompt") -> None:
    """RequestError when a prompt is too long to tokenize into ``max_input_len`` tokens (checked before
    tokenizing)."""
    if max_chars is not None and num_chars > max_chars:
        raise RequestError(field, f"has {num_chars} characters, more than {max_chars}, the most that fit the "
                                  f"engine's max_input_len; shorten the prompt")


def prompt_to_token_ids(tokenizer: Any, prompt: Prompt, add_special_tokens: bool, vocab_size: int,
                        max_chars: int | None = None, timings: dict[str, float] | None = None) -> tuple[int, ...]:
    """Tokenize a prompt; ``timings`` (optional) gets the seconds of the chat template (``"template"``) and of
    tokenizing (``"tokenize"``).

    ``str`` is tokenized with ``add_special_tokens`` (the recipe's ``model.add_special_tokens``); ``bytes`` must
    be UTF-8; a list of ``{"role", "content"}`` dicts goes through the tokenizer's chat template with the
    generation prompt appended; a list of ints is taken as token ids (each in ``[0, vocab_size)``).
    ``max_chars`` (see :func:`max_prompt_chars`) refuses longer text, message contents (summed) or id lists
    before any tokenization or templating.
    """
    if isinstance(prompt, ChatPrompt):
        extra_chars = len(json.dumps(prompt.tools)) + len(json.dumps(prompt.template_kwargs))
        check_prompt_size(_num_chars(prompt.messages) + extra_chars, max_chars)
        return tuple(int(t) for t in chat_to_token_ids(tokenizer, prompt.messages, timings, prompt.tools,
                                                       prompt.template_kwargs, prompt.generation_prompt,
                                                       prompt.continue_final))
    if isinstance(prompt, (bytes, bytearray)):
        try:
            prompt = bytes(prompt).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(
                "prompt", f"is not valid UTF-8 ({exc.reason} at byte {exc.start}); send UTF-8 encoded text"
            ) from None
    if isinstance(prompt, Sequence):
        check_prompt_size(_num_chars(prompt), max_chars)
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt", "is empty; send at least one character")
        started = time.perf_counter()
        ids = tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        if timings is not None:
            timings["tokenize"] = time.perf_counter() - started
    elif isinstance(prompt, Sequence) and len(prompt) == 0:
        raise RequestError("prompt", "is empty; send text, chat messages or at least one token id")
    elif isinstance(prompt, Sequence) and all(isinstance(m, dict) for m in prompt):
        ids = chat_to_token_ids(tokenizer, prompt, timings)
    elif isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        check_token_ids(prompt, vocab_size)
        ids = list(prompt)
    else:
        raise RequestError(
            "prompt", f"must be a string, UTF-8 bytes, a list of chat messages or a list of token ids, "
            f"not {type(prompt).__name__}"
        )
    if not ids:
        raise RequestError("prompt", "tokenizes to no tokens; send non-empty text")
    return tuple(int(t) for t in ids)


def check_token_ids(ids: Sequence[int], vocab_size: int, field: str = "prompt") -> None:
    """RequestError naming ``field`` when an id is outside ``[0, vocab_size)``."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(field, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")


def _num_chars(prompt: Sequence[Any]) -> int:
    """Characters of a text, of a chat's string contents (summed), or the length of an id list."""
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(m["content"]) if isinstance(m, dict) and isinstance(m.get("content"), str) else 1 for m in prompt)


def chat_to_token_ids(tokenizer: Any, messages: Sequence[dict], timings: dict[str, float] | None = None,
                      tools: Sequence[dict] = (), template_kwargs: Mapping[str, Any] | None = None,
                      generation_prompt: bool = True, continue_final: bool = False) -> list[int]:
    """Render chat messages with the model's own chat template (generation prompt appended unless
    ``generation_prompt`` is False; with ``continue_final`` the last message is left open for the answer to continue
    instead) and tokenize.

    The template already contains every special token it needs, so none are added on top. ``timings``: as in
    :func:`prompt_to_token_ids`. ``tools``, ``template_kwargs``: see :class:`ChatPrompt`."""
    template = getattr(tokenizer, "chat_template", None) or ""
    messages = _with_tools(list(messages), tools, template)
    for i, message in enumerate(messages):
        if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            raise RequestError(
                f"prompt[{i}]", 'a chat message needs a string "role" and a string "content"'
            )
    if not template:
        raise RequestError("prompt", "this model has no chat template; send a plain text prompt instead")
    started = time.perf_counter()
    extra = dict(template_kwargs or {})
    if tools and template_takes_tools(template):
        extra["tools"] = list(tools)
    if continue_final:
        if not messages or messages[-1].get("role") != "assistant":
            raise RequestError("prompt", "only a final assistant message can be continued")
        extra["continue_final_message"] = True
    text = tokenizer.apply_chat_template(list(messages), tokenize=False,
                                         add_generation_prompt=generation_prompt and not continue_final, **extra)
    rendered = time.perf_counter()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if timings is not None:
        timings["template"], timings["tokenize"] = rendered - started, time.perf_counter() - rendered
    return ids


def template_takes_tools(template: str) -> bool:
    """Whether a chat template renders ``tools=`` itself (else llmc lists them in a system message)."""
    return "tools" in template


def tools_instruction(tools: Sequence[dict]) -> str:
    """The system text that tells a model whose chat template has no tools which functions it may call."""
    listed = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    return ("You can call these functions (JSON schemas of their parameters):\n" + listed + "\nTo call functions, "
            'answer with a JSON list of calls: [{"name": ..., "arguments": {...}}].')


def _with_tools(messages: list[dict], tools: Sequence[dict], template: str) -> list[dict]:
    """``messages`` as a template without tool support needs them: the tools in the system message, an assistant's
    ``tool_calls`` as its text (a template that uses them gets the messages unchanged)."""
    if "tool_calls" not in template:
        messages = [_calls_as_text(m) if m.get("tool_calls") else m for m in messages]
    if not tools or template_takes_tools(template):
        return messages
    note = tools_instruction(tools)
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{note}"}, *messages[1:]]
    return [{"role": "system", "content": note}, *messages]


def _calls_as_text(message: dict) -> dict:
    calls = [{"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))}
             for c in message["tool_calls"]]
    text = ((message.get("content") or "") + "\n" + json.dumps(calls, ensure_ascii=False)).strip()
    return {key: value for key, value in message.items() if key != "tool_calls"} | {"content": text}


def _arguments(arguments: Any) -> Any:
    """A call's arguments as a JSON value (OpenAI sends them as JSON text)."""
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return arguments


def check_prompt_length(num_tokens: int, max_input_len: int) -> None:
    """Reject (never truncate) prompts longer than the engine's ``max_input_len``."""
    if num_tokens > max_input_len:
        raise RequestError(
            "prompt",
            f"has {num_tokens} tokens, more than the engine's max_input_len={max_input_len}; shorten the prompt "
            "or rebuild with a larger engine.max_input_len",
        )
