"""Per-request scheduling state (owned and mutated by the scheduler only)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from llmc.request.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    The single scheduling model: ``all_token_ids`` (prompt + generated) is the sequence, the first
    ``num_computed`` of them have KV entries, and each step computes the next chunk until
    ``num_computed == num_tokens``; the step that computes the last token samples the next one.
    Preemption by recompute resets ``num_computed`` to 0 and keeps the generated tokens.

    ``priority``: lower number = served first (0 is the default; negative values jump ahead).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    priority: int = 0
    arrival_time: float = 0.0  # scheduler clock at ``Scheduler.add``
    seq_no: int = 0  # admission order, the FCFS tie-break
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    cached_tokens: int = 0  # tokens found in the prefix cache at the first admission

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_remaining(self) -> int:
        """Tokens not yet in the KV cache (the rest of the prompt, or the last sampled token)."""
        return self.num_tokens - self.num_computed

    @property
    def all_token_ids(self) -> tuple[int, ...]:
        return self.prompt_token_ids + tuple(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> tuple[int, ...]:
        """``all_token_ids[start:end]`` without building the whole sequence (a decode step takes one token of a
        2,048-token prompt + outputs; the concatenation cost ~8 us per request per step)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return tuple(self.output_token_ids[start - p : end - p])
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + tuple(self.output_token_ids[: end - p])

    @property
    def token_view(self) -> TokenView:
        """``all_token_ids`` as a sequence whose slices are read with :meth:`token_slice` (no concatenation)."""
        return TokenView(self)

    @property
    def rank(self) -> tuple[int, int]:
        """Sort key of importance: smaller is served first and preempted last."""
        return (self.priority, self.seq_no)


class TokenView:
    """A request's prompt and generated tokens, read by slices (``view[a:b]``, a tuple) without building the whole
    sequence: what the draft-token lookup reads each step (a few tokens of a 2,048-token request)."""

    __slots__ = ("_request",)

    def __init__(self, request: Request):
        self._request = request

    def __len__(self) -> int:
        return self._request.num_tokens

    def __getitem__(self, key: slice) -> tuple[int, ...]:
        start, stop, _ = key.indices(len(self))
        return self._request.token_slice(start, max(start, stop))
