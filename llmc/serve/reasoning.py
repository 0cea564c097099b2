"""A reasoning model's thinking, split from its answer: ``<think> ... </think>`` (DeepSeek-R1, Qwen3, QwQ and the
models distilled from them) comes back as the chat message's ``reasoning_content``, the rest as its ``content``
(pure functions, no HTTP).

The thinking starts where the answer opens ``<think>``, or at the answer's first token when the chat template opened
it already (the rendered prompt ends with ``<think>``: DeepSeek-R1's newer templates do); it ends at ``</think>``. An
answer cut short while thinking is all ``reasoning_content``. The server splits answers when the chat template
mentions ``<think>`` (``llmc serve --reasoning-syntax``, recipe ``serving.reasoning_syntax``, say otherwise), and
never an answer constrained by an output format or a required tool call, which has no room to think.
"""

from __future__ import annotations

from typing import Literal

from llmc.request.stop import partial_match_length

ReasoningSyntax = Literal["think"]
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def served_reasoning(choice: str, chat_template: str | None) -> ReasoningSyntax | None:
    """The server's reasoning syntax: ``"think"`` or None (answers are not split); ``choice`` ``"auto"`` splits
    when the chat template mentions ``<think>``."""
    if choice == "none":
        return None
    if choice == "think" or THINK_OPEN in (chat_template or ""):
        return "think"
    return None


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """Whether a rendered prompt ending in ``prompt_tail`` leaves its answer inside ``<think>``."""
    return prompt_tail.rstrip().endswith(THINK_OPEN)


class ReasoningStream:
    """Splits an answer's text as it streams: :meth:`feed` returns the (reasoning, content) text that can go out
    now, holding back what may be the start of a marker; :meth:`finish` returns what is still held. ``reasoning``
    and ``content`` accumulate the whole split (markers left out)."""

    def __init__(self, thinking: bool):
        # start: the answer may still open <think>; thinking; lead: after </think>; answer
        self.state = "thinking" if thinking else "start"
        self.held = ""
        self.reasoning = ""
        self.content = ""

    def feed(self, piece: str) -> tuple[str, str]:
        text, self.held = self.held + piece, ""
        reasoning = content = ""
        while text:
            if self.state == "start":
                head = text.lstrip()
                if not head or (THINK_OPEN.startswith(head) and head != THINK_OPEN):
                    self.held = text  # white space or a part of <think> so far
                    break
                if head.startswith(THINK_OPEN):
                    text, self.state = head[len(THINK_OPEN):], "thinking"
                else:
                    self.state = "answer"
            elif self.state == "thinking":
                end = text.find(THINK_CLOSE)
                if end >= 0:
                    reasoning += text[:end]
                    text, self.state = text[end + len(THINK_CLOSE):], "lead"
                    continue
                keep = partial_match_length(text, (THINK_CLOSE,))
                reasoning, self.held = reasoning + text[:len(text) - keep], text[len(text) - keep:]
                break
            elif self.state == "lead":  # the white space between </think> and the answer is neither
                text = text.lstrip()
                if text:
                    self.state = "answer"
            else:
                content, text = content + text, ""
        self.reasoning += reasoning
        self.content += content
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        held, self.held = self.held, ""
        if self.state == "thinking":
            self.reasoning += held
            return held, ""
        self.content += held
        return "", held
