"""What a chat request passes to the model's chat template besides its messages and tools (pure): vLLM's
``chat_template_kwargs`` (more template variables, e.g. Qwen3's ``enable_thinking``) and where the answer starts,
``add_generation_prompt`` (default true: the template opens the assistant's turn) or ``continue_final_message``
(the last message, the assistant's, is left open and the answer continues it: a prefill; the answer holds only the
continuation). Both are vLLM's chat fields, read as vLLM reads them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from llmc.errors import RequestError, short_repr

FIELDS = ("chat_template_kwargs", "add_generation_prompt", "continue_final_message")
# apply_chat_template's own arguments, which chat_template_kwargs may not set
TEMPLATE_OWN_ARGUMENTS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                    "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                                    "truncation", "max_length", "return_tensors", "return_dict",
                                    "return_assistant_tokens_mask", "tokenizer_kwargs"})


def chat_only(body: Mapping[str, Any], chat: bool) -> None:
    """RequestError for these fields on ``/v1/completions``."""
    for key in FIELDS:
        if not chat and body.get(key) is not None:
            raise RequestError(key, "is a field of /v1/chat/completions")


def template_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    """Chat's ``chat_template_kwargs``: more variables for the chat template."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise RequestError("chat_template_kwargs", f'must be an object of template variables, e.g. '
                                                   f'{{"enable_thinking": false}}, got {short_repr(kwargs)}')
    taken = sorted(set(kwargs) & TEMPLATE_OWN_ARGUMENTS)
    if taken:
        raise RequestError(f"chat_template_kwargs.{taken[0]}", "is set by llmc itself (messages, tools, the "
                                                               "generation prompt); leave it out")
    return kwargs


def answer_start(body: Mapping[str, Any], messages: Sequence[Mapping[str, Any]]) -> tuple[bool, bool]:
    """``(generation_prompt, continue_final)`` for the chat template (see the module docstring)."""
    flags = []
    for key, default in (("add_generation_prompt", True), ("continue_final_message", False)):
        value = body.get(key)
        if value is not None and not isinstance(value, bool):
            raise RequestError(key, f"must be true or false, got {short_repr(value)}")
        flags.append(default if value is None else value)
    opening, continued = flags
    if continued and body.get("add_generation_prompt") is True:
        raise RequestError("continue_final_message", "and add_generation_prompt both set where the answer starts; "
                                                     "send at most one of them as true")
    if continued and messages[-1].get("role") != "assistant":
        raise RequestError("continue_final_message", "continues the last message, which must be the assistant's; "
                                                     f"the last is a {messages[-1].get('role')!r} message")
    return opening and not continued, continued
