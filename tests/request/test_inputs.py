"""Prompt -> token ids: oversized prompts are refused by size before any tokenization or templating."""

from __future__ import annotations

import time

import pytest

from llmc.errors import RequestError
from llmc.request.inputs import ChatPrompt, max_prompt_chars, prompt_to_token_ids


class CountingTokenizer:
    """A tokenizer whose vocabulary's longest token has 5 characters; records every call."""

    chat_template = "{{ messages }}"

    def __init__(self) -> None:
        self.calls = 0

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "hello": 1, "b": 2}

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        self.calls += 1
        return {"input_ids": [0] * len(text)}

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True) -> str:
        self.calls += 1
        return "".join(m["content"] for m in messages)


def test_bound_is_max_input_len_times_the_longest_token_with_slack():
    assert max_prompt_chars(CountingTokenizer(), 10) == 10 * 5 * 2


@pytest.mark.parametrize("prompt", ["x" * 101, b"x" * 101, [{"role": "user", "content": "x" * 60}] * 2, [0] * 101])
def test_oversized_prompts_are_refused_without_tokenizing(prompt):
    tokenizer = CountingTokenizer()
    with pytest.raises(RequestError, match="has 1[02][0-9] characters, more than 100") as info:
        prompt_to_token_ids(tokenizer, prompt, True, 10, max_chars=100)
    assert info.value.field == "prompt" and tokenizer.calls == 0


def test_prompts_within_the_bound_are_tokenized():
    tokenizer = CountingTokenizer()
    assert prompt_to_token_ids(tokenizer, "x" * 100, True, 10, max_chars=100) == (0,) * 100
    assert prompt_to_token_ids(tokenizer, [{"role": "user", "content": "x" * 100}], True, 10, max_chars=100)
    assert tokenizer.calls == 3


class SlowTokenizer(CountingTokenizer):
    """Rendering the template takes 30 ms, tokenizing 60 ms."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        time.sleep(0.06)
        return super().__call__(text, add_special_tokens)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True) -> str:
        time.sleep(0.03)
        return super().apply_chat_template(messages, tokenize, add_generation_prompt)


def test_timings_split_the_chat_template_from_tokenizing():
    timings: dict[str, float] = {}
    prompt_to_token_ids(SlowTokenizer(), [{"role": "user", "content": "hi"}], True, 10, timings=timings)
    assert 0.03 <= timings["template"] < 0.06 <= timings["tokenize"] < 0.2, timings
    timings = {}
    prompt_to_token_ids(SlowTokenizer(), "hi", True, 10, timings=timings)
    assert set(timings) == {"tokenize"} and 0.06 <= timings["tokenize"] < 0.2
    timings = {}
    prompt_to_token_ids(SlowTokenizer(), [1, 2], True, 10, timings=timings)
    assert timings == {}  # token ids: nothing to render or tokenize


class TemplateArguments(CountingTokenizer):
    """Records the arguments the chat template was rendered with."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **extra) -> str:
        self.seen = {"add_generation_prompt": add_generation_prompt, **extra}
        return "".join(m["content"] for m in messages)


def test_a_prefill_leaves_the_last_assistant_message_open():
    tokenizer = TemplateArguments()
    prefill = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"})
    prompt_to_token_ids(tokenizer, ChatPrompt(prefill, continue_final=True), True, 10)
    assert tokenizer.seen == {"add_generation_prompt": False, "continue_final_message": True}
    prompt_to_token_ids(tokenizer, ChatPrompt(prefill), True, 10)
    assert tokenizer.seen == {"add_generation_prompt": True}
    with pytest.raises(RequestError, match="only a final assistant message can be continued"):
        prompt_to_token_ids(tokenizer, ChatPrompt(prefill[:1], continue_final=True), True, 10)
