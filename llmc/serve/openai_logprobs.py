"""Log-probabilities in OpenAI's response shapes (pure functions over the engine's :class:`TokenLogprob` records).

Chat (``"logprobs": true``, ``"top_logprobs": N``): ``{"content": [{"token", "logprob", "bytes", "top_logprobs":
[{"token", "logprob", "bytes"}]}], "refusal": null}``. Completions (``"logprobs": N``): ``{"tokens",
"token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``, offsets counted from the start of the
returned text; with ``echo`` the prompt's tokens come first, the first one's log-probability and alternatives null
(nothing comes before it). A token's text is that token decoded alone (a piece of a multi-byte character decodes
to U+FFFD, as in other servers; ``bytes`` are that text's UTF-8). The token that ended a request as a stop id has
no entry: it is not part of the output's text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llmc.request.outputs import TokenLogprob


class TokenTexts:
    """Each token's text decoded alone (special tokens as written), once per token id of a request."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = self._text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


class LogprobFormatter:
    """Turns the log-probabilities of a request's events into OpenAI's shape, chunk by chunk (``offset``: the
    completion's characters so far, for ``text_offset``)."""

    def __init__(self, tokenizer: Any, chat: bool):
        self.token_text, self.chat = TokenTexts(tokenizer), chat
        self.offset = 0

    def format(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        """OpenAI's ``logprobs`` object for these tokens (the next ones of the completion)."""
        if self.chat:
            return {"content": [self._chat_entry(lp) for lp in logprobs], "refusal": None}
        tokens = [self.token_text(lp.token_id) for lp in logprobs]
        offsets = []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [{self.token_text(t): v for t, v in lp.top} for lp in logprobs],
                "text_offset": offsets}

    def format_prompt(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        """The completions ``logprobs`` object of an echoed prompt (``logprobs``: one per token after the first),
        before the completion's own."""
        first, start = self.token_text(token_ids[0]), self.offset
        self.offset += len(first)
        rest = self.format(logprobs)
        return {"tokens": [first, *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
                "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": [start, *rest["text_offset"]]}

    def _chat_entry(self, lp: TokenLogprob) -> dict[str, Any]:
        def item(token_id: int, value: float) -> dict[str, Any]:
            text = self.token_text(token_id)
            return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

        return {**item(lp.token_id, lp.logprob), "top_logprobs": [item(t, v) for t, v in lp.top]}
