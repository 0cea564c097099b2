"""Continuous batching over a paged KV cache: one device-free policy, one step at a time.

Each :meth:`Scheduler.schedule` call builds one :class:`SchedulerOutput` under a token budget
(``max_num_tokens``) and a sequence cap (``max_num_seqs``):

1. running sequences first, most important first: decodes (1 token each) before unfinished prefills, so a
   long prompt never stalls decodes; a prefill continues in a chunk of whatever budget is left. A step that has
   decodes takes at most ``max_mixed_tokens`` tokens in all (when set): a long prefill then joins many decode
   steps in chunks instead of making one decode step as slow as a whole prompt (inter-token latency stays even
   while prompts arrive); a step without decodes takes the full budget (time to first token);
2. then waiting requests are admitted (queue order, see :class:`WaitingQueue`) while the budget, the
   sequence cap and the free blocks allow; prompt tokens found in the prefix cache (computed full blocks of
   earlier prompts and outputs, :mod:`llmc.runtime.kv_cache`) count as computed and
   the rest is prefilled in chunks of the remaining budget (a request that asks for its prompt's
   log-probabilities reuses no cached prefix: every prompt position is computed).

When a running sequence needs a new block and none is free, the least important running sequence that is
not yet scheduled this step (lowest priority, then latest arrival; possibly the sequence itself) is
preempted by recompute: its blocks are freed and it goes back to the front of the waiting queue with
``num_computed = 0``, its generated tokens kept as part of the input to recompute.

:meth:`update` applies the runner's sampled tokens. With a runner that queues steps on a GPU the engine
plans step n + 1 before step n's tokens reach the host: :meth:`advance` applies step n with a placeholder per
sampled token, and :meth:`fill` puts the tokens in place once they arrive. A request whose length limit is
reached is never scheduled again; one that a stop token ends runs one more (discarded) row. The engine decides
when a request is done (stop tokens, stop strings, lengths) and calls :meth:`finish_request`; finish, abort and
error all return every block.

With a ``speculator`` (:mod:`llmc.runtime.scheduler.speculate`), a request's decode token may be followed by
draft tokens in the same step (within the token budget and the request's length limit, KV slots reserved for all of
them); :meth:`fill` keeps the drafts the runner's chosen tokens confirm, appends the model's own next token and
counts the confirmed drafts as computed (a rejected draft's KV entry is overwritten by the next step). A request
with an output format drafts through ``format_drafts`` (the engine's: the lookup's drafts its format allows, or
the tokens the format forces where those are longer).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from llmc.engine.types import PLACEHOLDER, ModelRunnerOutput, ScheduledSequence, SchedulerOutput, is_decode
from llmc.errors import RequestError
from llmc.runtime.kv_cache import BlockManager
from llmc.runtime.scheduler.queue import WaitingQueue
from llmc.runtime.scheduler.request import Request, RequestStatus
from llmc.runtime.scheduler.speculate import PromptLookup, speculable


class Scheduler:
    """Decides which tokens of which requests run each step. Not thread-safe: the engine serializes calls."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_tokens: int,
        max_model_len: int,
        max_queue_size: int,
        max_wait_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_mixed_tokens: int | None = None,
        speculator: PromptLookup | None = None,
        draft_limits: tuple[int, int] | None = None,
    ):
        if max_num_seqs <= 0 or max_num_tokens <= 0 or max_model_len <= 0:
            raise ValueError("max_num_seqs, max_num_tokens and max_model_len must be positive")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens
        self.max_mixed_tokens = max_mixed_tokens or None  # 0 / None: steps with decodes take max_num_tokens too
        self.max_model_len = max_model_len
        self.clock = clock
        self.waiting = WaitingQueue(max_queue_size, max_wait_s, clock)
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._next_seq_no = 0
        self._step = 0
        self.speculator = speculator  # draft tokens after decodes (None: off)
        # (rows, row contexts) a step with drafts may have in all (the runner's CUDA graphs'), None: no bound
        self.draft_limits = draft_limits
        # (request id, prompt lookup's drafts, limit) -> the drafts a request's output format allows (the engine's
        # constraints, which have seen every token so far); None: requests with an output format are not drafted
        self.format_drafts: Callable[[str, tuple[int, ...], int], tuple[int, ...]] | None = None
        # (request, tokens, sample, drafts) of the last schedule()
        self._last_scheduled: list[tuple[Request, int, bool, tuple[int, ...]]] = []
        self.drafted_tokens_total = 0  # draft tokens verified so far
        self.accepted_tokens_total = 0  # of which the model's own choice equalled the draft
        self.num_preemptions_total = 0
        self.last_step_preemptions = 0

    # ----------------------------------------------------------------------------------------- queries
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def get(self, request_id: str) -> Request | None:
        """The live (waiting or running) request with this id, or None."""
        return self._requests.get(request_id)

    # ------------------------------------------------------------------------------------ admission
    def add(self, request: Request) -> None:
        """Queue a new request. Raises QueueFullError when the waiting queue is full and RequestError when
        the request can never fit the KV cache or the model length."""
        if request.request_id in self._requests:
            raise RequestError("request_id", f"{request.request_id!r} is already in flight; use a unique id")
        if not request.prompt_token_ids:
            raise RequestError("prompt", "the prompt has no tokens")
        if len(request.prompt_token_ids) >= self.max_model_len:
            raise RequestError(
                "prompt",
                f"{len(request.prompt_token_ids)} tokens leave no room to generate within max_seq_len="
                f"{self.max_model_len}; shorten the prompt",
            )
        self._check_capacity(request)
        request.arrival_time = self.clock()
        request.seq_no = self._next_seq_no
        request.status = RequestStatus.WAITING
        self.waiting.add(request)
        self._next_seq_no += 1
        self._requests[request.request_id] = request

    def _check_capacity(self, request: Request) -> None:
        bm = self.block_manager
        worst = min(len(request.prompt_token_ids) + request.params.max_new_tokens, self.max_model_len)
        if bm.blocks_for(worst) > bm.num_blocks:
            raise RequestError(
                "max_new_tokens",
                f"prompt + max_new_tokens = {worst} tokens need {bm.blocks_for(worst)} KV blocks but the cache "
                f"has {bm.num_blocks} blocks of {bm.block_size} tokens; lower max_new_tokens or give the "
                "KV cache more memory",
            )

    def finish_request(self, request_id: str) -> bool:
        """End a request (finished, aborted or failed): leave the queues and return every block.

        Returns False when the request is unknown or already finished (idempotent)."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.block_manager.free(request_id)
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        if self.speculator is not None:
            self.speculator.forget(request_id)
        return True

    abort = finish_request

    # ------------------------------------------------------------------------------------- scheduling
    def schedule(self) -> SchedulerOutput:
        """Plan one step (see the module docstring)."""
        self._step += 1
        budget = self.max_num_tokens
        planned: list[tuple[Request, int, bool, tuple[int, ...]]] = []
        preempted: list[str] = []
        order = sorted(self.running, key=lambda r: r.rank)
        decodes = [r for r in order if is_decode(r.num_remaining)]
        prefills = [r for r in order if not is_decode(r.num_remaining)]
        if decodes and self.max_mixed_tokens:
            budget = min(budget, max(self.max_mixed_tokens, len(decodes)))
        planned_ids: set[int] = set()  # id() of the planned requests (preemption never picks them)
        room = self._draft_room(decodes)
        for request in decodes + prefills:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            if request.num_tokens >= self._max_total(request):
                continue  # its last token is sampled (a placeholder until the step ends): it ends on it
            n = min(request.num_remaining, budget)
            drafts = self._drafts(request, budget, room) if is_decode(n) else ()
            n += len(drafts)
            if self._reserve(request, n, planned_ids, preempted):
                planned.append((request, n, request.num_computed + n - len(drafts) == request.num_tokens, drafts))
                planned_ids.add(id(request))
                budget -= n
        if not preempted:
            budget = self._admit(budget, planned)
        self._last_scheduled = planned
        self.last_step_preemptions = len(preempted)
        self.num_preemptions_total += len(preempted)
        return SchedulerOutput(
            step=self._step,
            sequences=tuple(self._to_scheduled(*entry) for entry in planned),
            preempted_request_ids=tuple(preempted),
        )

    def _draft_room(self, decodes: list[Request]) -> list[int] | None:
        """What the step's drafts may add to its decodes' rows and row contexts (``draft_limits``), or None."""
        if self.speculator is None or self.draft_limits is None:
            return None
        rows, context = self.draft_limits
        return [rows - len(decodes), context - sum(r.num_computed + 1 for r in decodes)]

    def _drafts(self, request: Request, budget: int, room: list[int] | None) -> tuple[int, ...]:
        """Draft tokens to verify after a decode's token (:mod:`~llmc.runtime.scheduler.speculate`): within the
        step's token budget, short enough that every accepted token stays within the request's length limit, and
        within ``room`` (rows, row contexts left under ``draft_limits``; taken from it): a drafted row reads its
        context like a decode, and on CUDA drafts never push a step of decodes off the captured graphs into eager
        launches (prompt chunks that join the step count as they do without drafts)."""
        if self.speculator is None or not speculable(request.params, self.format_drafts is not None):
            return ()
        limit = min(budget, self._max_total(request) - request.num_tokens) - 1
        if room is not None:
            first = request.num_computed + 2  # the first draft's row reads this many tokens
            while limit > 0 and (limit > room[0] or limit * first + limit * (limit - 1) // 2 > room[1]):
                limit -= 1
        drafts = self.speculator.propose(request.request_id, request.token_view, limit)
        if request.params.structured is not None and self.format_drafts is not None and limit > 0:
            drafts = self.format_drafts(request.request_id, drafts, min(limit, self.speculator.num_draft))
        if room is not None and drafts:
            room[0] -= len(drafts)
            room[1] -= len(drafts) * first + len(drafts) * (len(drafts) - 1) // 2
        return drafts

    def _reserve(self, request: Request, n: int, planned_ids: set[int], preempted: list[str]) -> bool:
        """Reserve KV slots for ``n`` more tokens of a running request, preempting as needed.

        Returns False when the request itself was preempted."""
        bm = self.block_manager
        need = request.num_computed + n - bm.num_slots(request.request_id)
        if need <= 0:
            return True
        while not bm.can_append(request.request_id, need):
            candidates = [r for r in self.running if id(r) not in planned_ids]
            victim = max(candidates, key=lambda r: r.rank)  # ``request`` itself is a candidate
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        bm.append(request.request_id, need)
        return True

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request.request_id)
        self.running.remove(request)
        request.num_computed = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.push_front(request)

    def _admit(self, budget: int, planned: list[tuple[Request, int, bool, tuple[int, ...]]]) -> int:
        """Admit waiting requests in queue order while budget, sequence cap and blocks allow."""
        bm = self.block_manager
        while budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            if request is None:
                break
            if request.output_token_ids and request.output_token_ids[-1] == PLACEHOLDER:
                break  # preempted while its last token was on the way: recompute once it is known
            tokens = request.all_token_ids
            reuse = request.params.prompt_logprobs is None  # prompt log-probabilities: every position computed
            if not bm.can_allocate(tokens, reuse):
                break  # head-of-line: keep queue order rather than letting small requests overtake
            self.waiting.remove(request)
            bm.allocate(request.request_id, tokens, reuse)
            request.num_computed = bm.num_cached_tokens(request.request_id)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = self.clock()
                request.cached_tokens = request.num_computed
            self.running.append(request)
            n = min(request.num_remaining, budget)
            planned.append((request, n, request.num_computed + n == request.num_tokens, ()))
            budget -= n
        return budget

    def _to_scheduled(self, request: Request, n: int, sample: bool, drafts: tuple[int, ...]) -> ScheduledSequence:
        start = request.num_computed
        return ScheduledSequence(
            request_id=request.request_id,
            token_ids=request.token_slice(start, start + n - len(drafts)) + drafts,
            num_draft=len(drafts),
            num_computed=start,
            block_ids=self.block_manager.block_table(request.request_id),
            sample=sample,
            params=request.params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=tuple(request.output_token_ids),
        )

    def _max_total(self, request: Request) -> int:
        """Tokens (prompt + generated) at which the request ends by length."""
        return min(len(request.prompt_token_ids) + request.params.max_new_tokens, self.max_model_len)

    # ----------------------------------------------------------------------------------------- update
    def advance(self) -> list[tuple[Request, int, tuple[int, ...]]]:
        """Apply the last :meth:`schedule` as if its step had run, before its tokens are known (the runner
        launches the next step while this one runs): ``num_computed`` advances and each sampling request gets a
        :data:`PLACEHOLDER` token at the end of its outputs. Returns the ticket :meth:`fill` takes with the step's
        result. Requests finished or aborted meanwhile are skipped. Draft tokens count as computed only once
        :meth:`fill` knows which were accepted."""
        ticket: list[tuple[Request, int, tuple[int, ...]]] = []
        for request, n, sample, drafts in self._last_scheduled:
            if request.status is not RequestStatus.RUNNING or self._requests.get(request.request_id) is not request:
                continue
            request.num_computed += n - len(drafts)
            self.block_manager.commit(request.request_id, request.num_computed, request.token_slice)
            if sample:
                request.output_token_ids.append(PLACEHOLDER)
                ticket.append((request, len(request.output_token_ids) - 1, drafts))
        self._last_scheduled = []
        return ticket

    def fill(self, ticket: list[tuple[Request, int, tuple[int, ...]]], output: ModelRunnerOutput
             ) -> dict[str, int | tuple[int, ...]]:
        """Put a step's sampled tokens in place of the placeholders :meth:`advance` left; returns {request_id:
        token} of the requests still live (running, or preempted since: their token is real and recomputed with
        the rest). Requests finished or aborted meanwhile are skipped. A request that verified draft tokens gets
        a tuple instead: the drafts the model's own choices confirmed, then its next token (1 to drafts + 1 tokens,
        all appended; the confirmed drafts' KV entries count as computed)."""
        new_tokens: dict[str, int | tuple[int, ...]] = {}
        for request, index, drafts in ticket:
            if self._requests.get(request.request_id) is not request:
                continue
            token = output.sampled_token_ids.get(request.request_id)
            assert token is not None, f"runner returned no token for {request.request_id!r}"
            request.output_token_ids[index] = int(token)
            new_tokens[request.request_id] = int(token)
            if drafts:
                tokens = _accepted(drafts, output.verify_token_ids.get(request.request_id), int(token))
                request.output_token_ids[index:] = tokens
                if request.status is RequestStatus.RUNNING:  # (preempted since: every token is recomputed)
                    request.num_computed += len(tokens) - 1
                    self.block_manager.commit(request.request_id, request.num_computed, request.token_slice)
                self.drafted_tokens_total += len(drafts)
                self.accepted_tokens_total += len(tokens) - 1
                if self.speculator is not None:
                    self.speculator.verified(request.request_id, len(tokens) - 1)
                new_tokens[request.request_id] = tokens
        return new_tokens

    def update(self, output: ModelRunnerOutput) -> dict[str, int | tuple[int, ...]]:
        """Apply the last step's results: advance ``num_computed``, append sampled tokens (:meth:`advance`, then
        :meth:`fill` at once).

        Returns {request_id: new token} for the live requests that sampled. Requests finished or aborted
        while the step ran are skipped."""
        return self.fill(self.advance(), output)


def _accepted(drafts: tuple[int, ...], verify: tuple[int, ...] | None, last: int) -> tuple[int, ...]:
    """A drafted step's new tokens: the token the model chose after each new token (``verify``: after the decode
    token and each draft but the last; ``last``: after the last draft), kept while it equals the draft it checks;
    the first that differs is kept and ends them."""
    if verify is None or len(verify) != len(drafts):
        raise RuntimeError(f"the runner verified {0 if verify is None else len(verify)} of {len(drafts)} drafts")
    for i, (draft, chosen) in enumerate(zip(drafts, verify)):
        if chosen != draft:
            return tuple(verify[:i + 1])
    return (*verify, last)
