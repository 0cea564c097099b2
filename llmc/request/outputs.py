"""What the engine hands back (``StreamEvent``, ``Completion``) and the per-request output pipeline that
turns sampled token ids into them: stop ids -> incremental detokenization -> stop strings -> length limits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from llmc.request.detokenize import IncrementalDetokenizer
from llmc.request.metrics import RequestMetrics
from llmc.request.params import SamplingParams
from llmc.request.stop import StopStringMatcher, check_stop_token
from llmc.request.structured import Constraint

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (``SamplingParams.logprobs``) and the ``top``
    most likely tokens' ``(token id, log-probability)``, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class StreamEvent:
    """One increment of a request's output.

    ``text`` is the new text (possibly empty while a multi-byte character is incomplete) and ``token_ids``
    the new token ids. The last event has ``finished=True`` and a ``finish_reason``: "stop" (``stop_reason``
    is the matched stop string or stop token id), "length" (max_new_tokens or max_seq_len), "abort", or
    "error" (``error`` says what failed; the request's KV blocks are freed). Concatenating every event's
    ``text`` gives the final text. ``logprobs``: one per token of ``token_ids`` when the request asked for them.
    ``prompt_logprobs`` (the first event only, when the request asked for them): one per prompt token after the
    first, in order (entry i is the prompt's token i + 1 given the tokens before it).
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    metrics: RequestMetrics | None = None
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Completion:
    """A finished request: the whole generated text and token ids (see :class:`StreamEvent`)."""

    request_id: str
    prompt: Any
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    stop_reason: str | int | None
    metrics: RequestMetrics | None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token of token_ids when the request asked for them
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # one per prompt token after the first (see StreamEvent)

    @classmethod
    def from_events(cls, prompt: Any, events: Sequence[StreamEvent]) -> Completion:
        last = events[-1]
        return cls(
            request_id=last.request_id,
            prompt=prompt,
            text="".join(e.text for e in events),
            token_ids=tuple(t for e in events for t in e.token_ids),
            finish_reason=last.finish_reason,
            stop_reason=last.stop_reason,
            metrics=last.metrics,
            logprobs=tuple(lp for e in events for lp in e.logprobs),
            prompt_logprobs=next((e.prompt_logprobs for e in events if e.prompt_logprobs), ()),
        )


def output_logprobs(event: StreamEvent) -> tuple[TokenLogprob, ...]:
    """The event's log-probabilities of output tokens: less the stop id's that ended the request (that token is
    not part of the output's text)."""
    if event.finished and event.finish_reason == "stop" and isinstance(event.stop_reason, int):
        return tuple(lp for lp in event.logprobs if lp.token_id != event.stop_reason)
    return event.logprobs


class RequestOutput:
    """The output side of one request (owned by the engine, used under its lock).

    ``sink`` receives every event of this request (called from the thread that ran the step);
    ``byte_token_ids`` is the tokenizer's byte-fallback id set, computed once per engine.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: tuple[int, ...],
        params: SamplingParams,
        tokenizer: Any,
        eos_token_ids: Sequence[int],
        max_seq_len: int,
        metrics: RequestMetrics,
        sink: Callable[[StreamEvent], None] | None = None,
        byte_token_ids: frozenset[int] | None = None,
        constraint: Constraint | None = None,
    ):
        self.request_id = request_id
        self.params = params
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_total = min(len(prompt_token_ids) + params.max_new_tokens, max_seq_len)
        self.num_prompt = len(prompt_token_ids)
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens,
                                                  byte_token_ids)
        self.matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self.metrics = metrics
        self.sink = sink
        self.num_generated = 0
        self.constraint = constraint  # the compiled output format (params.structured); it sees every token
        self.prompt_logprobs: list[TokenLogprob] = []  # prompt positions 1, 2, ... computed so far
        if params.prompt_logprobs is not None:  # the first token's event takes them (other requests pay nothing)
            self.on_token = self._first_token  # type: ignore[method-assign]

    def add_prompt_logprobs(self, start: int, entries: Sequence[TokenLogprob]) -> None:
        """Log-probabilities of prompt positions ``start``, ``start + 1``, ... (a chunk's; a chunk computed again
        after a preemption repeats positions already here: they are kept once). They go out with the first
        event."""
        have = 1 + len(self.prompt_logprobs)  # the next position wanted
        if start > have:
            raise AssertionError(f"prompt log-probabilities of {self.request_id} from position {start}, "
                                 f"expected {have} (a chunk's were lost)")
        self.prompt_logprobs += entries[have - start:]

    def on_token(self, token_id: int, now: float, logprob: TokenLogprob | None = None) -> StreamEvent:
        """Process one sampled token (and its log-probabilities, when the request asked for them): returns its
        event (finished when a stop or a length limit hit, or the output format is complete; an "error" event when
        the format does not allow the token, which the sampler's mask rules out)."""
        self.num_generated += 1
        self.metrics.record_token(now)
        lps = (logprob,) if logprob is not None else ()
        if self.constraint is not None and not self.constraint.accept(token_id):
            self.metrics.record_finished(now)
            return StreamEvent(self.request_id, "", (token_id,), True, "error", None, self.metrics,
                               f"token {token_id} is not allowed by the request's output format (structured): "
                               f"{self.constraint.error or 'rejected'}", lps)
        if check_stop_token(token_id, self.num_generated, self.params, self.eos_token_ids):
            text, matched = self._flush()
            return self._finish(now, text, (token_id,), "stop", matched if matched is not None else token_id, lps)
        text, matched = self._feed(self.detokenizer.add(token_id))
        if matched is not None:
            return self._finish(now, text, (token_id,), "stop", matched, lps)
        complete = self.constraint is not None and self.constraint.complete  # its format admits no further token
        if complete or self.num_prompt + self.num_generated >= self.max_total:
            tail, matched = self._flush()
            reason = "length" if matched is None and not complete else "stop"
            return self._finish(now, text + tail, (token_id,), reason, matched, lps)
        if lps:
            return StreamEvent(self.request_id, text, (token_id,), logprobs=lps)
        return StreamEvent(self.request_id, text, (token_id,))  # the common case, without a keyword (0.13 us less)

    def _first_token(self, token_id: int, now: float, logprob: TokenLogprob | None = None) -> StreamEvent:
        """:meth:`on_token` for the first token of a request that asked for prompt log-probabilities: its event
        carries them; later tokens take the plain method again."""
        del self.on_token
        event = self.on_token(token_id, now, logprob)
        return dataclasses.replace(event, prompt_logprobs=tuple(self.prompt_logprobs))

    def _feed(self, text: str) -> tuple[str, str | None]:
        """Run new text through the stop-string matcher (stops count once more than min_tokens were made,
        exactly like stop token ids)."""
        return self.matcher.feed(text, can_stop=self.num_generated > self.params.min_tokens)

    def _flush(self) -> tuple[str, str | None]:
        """Release text held back by the detokenizer and the matcher at the end of the request."""
        text, matched = self._feed(self.detokenizer.flush())
        if matched is None:
            text += self.matcher.flush()
        return text, matched

    def _finish(self, now: float, text: str, token_ids: tuple[int, ...], reason: FinishReason,
                stop_reason: str | int | None, logprobs: tuple[TokenLogprob, ...] = ()) -> StreamEvent:
        self.metrics.record_finished(now)
        return StreamEvent(self.request_id, text, token_ids, True, reason, stop_reason, self.metrics,
                           logprobs=logprobs)

    def terminal(self, now: float, reason: FinishReason, error: str | None = None) -> StreamEvent:
        """The closing event of an aborted or failed request (no new tokens, held-back text dropped)."""
        self.metrics.record_finished(now)
        return StreamEvent(self.request_id, "", (), True, reason, None, self.metrics, error)
