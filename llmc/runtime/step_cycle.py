"""One engine step over the scheduler, the runner and the requests' output pipelines (:class:`StepCycle`).

A step: ``scheduler.schedule()`` -> ``runner.execute()`` -> ``scheduler.update()`` -> each new token goes through
its request's output pipeline (stop ids, incremental detokenization, stop strings, lengths) and becomes a
:class:`StreamEvent` delivered to that request's sink.

With a runner whose steps run asynchronously (CUDA: ``runner.async_steps``) the engine plans and launches step
n + 1 while step n still runs: :meth:`Scheduler.advance` applies step n with a placeholder for each token it
samples, the runner takes those tokens from step n's ids on the device, and once step n is done its tokens fill
the placeholders and go through the output pipelines while step n + 1 runs. The GPU then never waits for the host
between steps, and host work per step (scheduling, detokenizing, stop strings, waking the consumers) overlaps it.
A request ended by a stop token or string computes one extra row in the next step, which is discarded; one that
reaches its length limit is not scheduled again. Decode steps are planned past, and so are the short steps a
mixed-step budget (``serving.mixed_step_tokens``) makes of decodes and prompt chunks: without that, each such step
(tens of milliseconds, launched eagerly) left the GPU idle while the host collected its tokens and planned the
next. After any other step with prompt tokens (up to ``engine.max_num_tokens`` of them: hundreds of milliseconds)
the engine waits for it first, so requests that arrived while it ran join the very next step (planned ahead, they
would wait a whole prefill step longer; waiting costs the GPU well under a millisecond next to such a step).
Penalties read earlier tokens' values: while a running request uses them, the engine waits for step n before
planning step n + 1. Output formats (structured outputs) need them only to sample: with a runner that takes late
masks (``late_masks``, the torch runner), step n + 1 is planned and its forward pass queued with placeholders as
above, then, before its sampler, the engine collects step n (each constraint sees its token) and computes the
masks on the host while the device runs that forward pass; other runners wait for step n first. Draft tokens
(``Scheduler.speculator``) follow a request's last token: while a request that may draft runs, the engine waits for
step n before planning step n + 1, and a drafted step's tokens (1 to drafts + 1 of them) are always collected first.

The scheduler and the outputs are shared with :class:`~llmc.runtime.api.Engine` under its lock, which is not held
while the model runs (callers add and abort requests during a step).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from llmc.engine.types import ModelRunnerOutput, SchedulerOutput, StepRunner
from llmc.request.metrics import MetricsLog, StepMetrics
from llmc.request.outputs import RequestOutput, StreamEvent
from llmc.request.structured import Constraint
from llmc.runtime.compute import run_compute
from llmc.runtime.scheduler import Scheduler

log = logging.getLogger(__name__)


@dataclass
class _Inflight:
    """A launched step whose tokens have not reached the host: its plan, the runner's pending step and the
    scheduler's ticket for :meth:`Scheduler.fill`."""

    scheduled: SchedulerOutput
    pending: object
    ticket: list


def _short(scheduled: SchedulerOutput, mixed_budget: int | None) -> bool:
    """Whether the engine plans past the step: every sequence decodes one token, or the step has decodes and the
    mixed-step budget ``mixed_budget`` bounded it (see :class:`~llmc.runtime.scheduler.Scheduler`)."""
    if scheduled.num_tokens == len(scheduled.sequences):  # one token each: all decodes
        return True
    if any(s.num_draft for s in scheduled.sequences):  # how many tokens it yields is known only at its end
        return False
    if not mixed_budget:
        return False
    decodes = sum(1 for s in scheduled.sequences if s.is_decode)
    return decodes > 0 and scheduled.num_tokens <= max(mixed_budget, decodes)


def _masked(scheduled: SchedulerOutput) -> bool:
    """Whether a sequence of the step samples under an output format (it needs a mask)."""
    return any(s.sample and s.params.structured is not None for s in scheduled.sequences)


class StepCycle:
    """Runs engine steps: ``outputs`` (request id -> its output pipeline) and ``scheduler`` are the engine's, guarded
    by ``lock``; finished, aborted and failed requests leave both through :meth:`retire`."""

    def __init__(self, scheduler: Scheduler, runner: StepRunner, outputs: dict[str, RequestOutput],
                 lock: threading.RLock, clock: Callable[[], float], metrics_log: MetricsLog | None):
        self.scheduler, self.runner, self.clock = scheduler, runner, clock
        self._outputs = outputs
        self._lock = lock
        self._step_lock = threading.Lock()  # one step at a time
        self._metrics_log = metrics_log
        self._overlap = bool(getattr(runner, "async_steps", False)) and hasattr(runner, "launch")
        self._late_masks = self._overlap and bool(getattr(runner, "late_masks", False))
        self._inflight: _Inflight | None = None  # overlapped steps: the launched step whose tokens are not known
        self._step_masks = (0, 0.0)  # the planned step's output-format masks: rows, host seconds
        self.masks_total, self.mask_seconds_total = 0, 0.0  # since the engine started (Engine.stats)
        if scheduler.speculator is not None:  # output formats vet their requests' drafts and add forced tokens
            scheduler.format_drafts = self._format_drafts

    def step(self) -> list[StreamEvent]:
        """Run one engine step; returns the events it produced (also delivered to each request's sink).

        An exception in the step fails the requests it scheduled (an "error" event each, blocks freed);
        the other requests keep going."""
        with self._step_lock:
            if self._overlap:
                events = self._step_overlapped()
            else:
                events = self._step_serial()
            if self._metrics_log is not None and not self.scheduler.has_unfinished():
                self._metrics_log.flush()  # idle now: the log is complete up to here
        return events

    def _step_serial(self) -> list[StreamEvent]:
        start = self.clock()
        scheduled: SchedulerOutput | None = None
        try:
            with self._lock:
                scheduled = self.scheduler.schedule()
            scheduled = self._constrain(scheduled)
            result = ModelRunnerOutput()
            if scheduled.sequences:
                result = run_compute(self.runner.execute, scheduled)
            with self._lock:
                events = self.process(self.scheduler.update(result), result)
                self._record_step(scheduled, start)
        except Exception as exc:
            log.exception("engine step failed")
            events = self.fail(scheduled, exc)
        return events

    def _step_overlapped(self) -> list[StreamEvent]:
        """Schedule and launch step n + 1 while step n still runs (its tokens are placeholders the runner takes
        from the device), then wait for step n and turn its tokens into events while step n + 1 runs."""
        start = self.clock()
        scheduled: SchedulerOutput | None = None
        events: list[StreamEvent] = []
        inflight, self._inflight = self._inflight, None
        try:
            if inflight is not None and (self._needs_token_values()
                                         or not _short(inflight.scheduled, self.scheduler.max_mixed_tokens)):
                # penalties read the previous tokens' values; after a long prefill step the plan waits for it so
                # that requests which arrived meanwhile are admitted in the very next step
                events += self._collect(inflight)
                inflight = None
            with self._lock:
                scheduled = self.scheduler.schedule()
            late: tuple = ()  # launch's late masks, where this step takes them
            if inflight is not None and self._late_masks and _masked(scheduled):
                planned = scheduled

                def masks() -> SchedulerOutput:  # on the compute thread, the step's forward pass queued
                    nonlocal inflight
                    events.extend(self._collect(inflight))  # the constraints see the previous step's tokens
                    inflight = None  # collected (if that raised, the handler below fails its requests)
                    return self._constrain(planned)
                late = (masks,)
            else:
                scheduled = self._constrain(scheduled)
            pending = None
            if scheduled.sequences:
                pending = run_compute(self.runner.launch, scheduled, inflight.pending if inflight else None, *late)
            if inflight is not None:
                events += self._collect(inflight)  # while the GPU runs this step
                inflight = None
            with self._lock:
                ticket = self.scheduler.advance()
                self._record_step(scheduled, start)
                idle = not self.scheduler.has_unfinished()
            if pending is not None:
                if idle:  # every request of the step ended meanwhile: nothing else would collect it
                    events += self._collect(_Inflight(scheduled, pending, ticket))
                else:
                    self._inflight = _Inflight(scheduled, pending, ticket)
        except Exception as exc:
            log.exception("engine step failed")
            if inflight is not None:  # the launch failed: the previous step's tokens still reach their requests
                try:
                    events += self._collect(inflight)
                except Exception:
                    events += self.fail(inflight.scheduled, exc)
            events += self.fail(scheduled, exc)
        return events

    def _collect(self, inflight: _Inflight) -> list[StreamEvent]:
        """Wait for a launched step and turn its tokens into events (finished requests leave)."""
        result = inflight.pending.result()
        with self._lock:
            return self.process(self.scheduler.fill(inflight.ticket, result), result)

    def _needs_token_values(self) -> bool:
        """Whether a running request samples with penalties, or with an output format where the runner cannot take
        late masks (they read the values of earlier tokens before the step is launched), or may draft tokens (they
        follow its last token's value; with drafting on, every request may be: an output format's constraint vets
        its drafts at planning)."""
        drafting = self.scheduler.speculator is not None
        with self._lock:
            running = self.scheduler.running
            return bool(running) and (drafting or any(
                r.params.uses_penalties or (r.params.structured is not None and not self._late_masks)
                for r in running))

    def _constrain(self, scheduled: SchedulerOutput) -> SchedulerOutput:
        """``scheduled`` with the allowed-token mask of every sequence that samples under an output format
        (``SamplingParams.structured``), computed from its constraint, which has seen every earlier token (the
        engine waits for a step's tokens before planning the next while such a request runs). The masks are computed
        outside the lock (only this thread advances a constraint), so adding and aborting requests never waits
        for them."""
        self._step_masks = (0, 0.0)
        if not _masked(scheduled):
            return scheduled
        seqs = list(scheduled.sequences)
        rows, constraints = [], []
        with self._lock:
            for i, s in enumerate(seqs):
                output = self._outputs.get(s.request_id)
                if s.sample and output is not None and output.constraint is not None:
                    rows.append(i)
                    constraints.append(output.constraint)
        if not rows:
            return scheduled
        drafts = [seqs[i].draft_token_ids for i in rows]
        start = self.clock()
        # together on llguidance's threads where the engine has a pool; a drafted row's mask after each draft too
        masks = Constraint.masks(constraints, drafts if any(drafts) else None)
        self._step_masks = (len(masks), self.clock() - start)
        self.masks_total += len(masks)
        self.mask_seconds_total += self._step_masks[1]
        at = 0
        for i, d in zip(rows, drafts):
            seqs[i] = dataclasses.replace(seqs[i], token_mask=masks[at + len(d)],
                                          draft_masks=masks[at:at + len(d)] if d else None)
            at += 1 + len(d)
        return dataclasses.replace(scheduled, sequences=tuple(seqs))

    def _format_drafts(self, request_id: str, proposed: tuple[int, ...], limit: int) -> tuple[int, ...]:
        """The scheduler's ``format_drafts``: a request's drafts as its output format allows them (planning runs on
        this thread, after every earlier token reached the constraint)."""
        output = self._outputs.get(request_id)
        if output is None or output.constraint is None:
            return ()
        return output.constraint.drafts(proposed, limit)

    @property
    def overlapped_steps(self) -> bool:
        """True when a step's tokens are processed while the next step runs (a runner with ``async_steps``)."""
        return self._overlap

    def flush_metrics(self) -> None:
        """Wait for the step in progress, then write every metrics record so far to the metrics log's file
        (readers of the log call this first: records are buffered between steps)."""
        with self._step_lock:
            if self._metrics_log is not None:
                self._metrics_log.flush()

    def process(self, new_tokens: dict[str, int | tuple[int, ...]], result: ModelRunnerOutput | None = None
                ) -> list[StreamEvent]:
        """Turn sampled tokens (and the step's log-probabilities, where asked for: ``result``) into events;
        finished requests leave the scheduler (blocks freed). A tuple is a request's several new tokens (accepted
        draft tokens, then the model's own): an event each, up to the one that ends the request. Under the lock."""
        logprobs = result.logprobs if result is not None else {}
        if result is not None and result.prompt_logprobs:
            for request_id, (start, entries) in result.prompt_logprobs.items():
                output = self._outputs.get(request_id)
                if output is not None:
                    output.add_prompt_logprobs(start, entries)
        now = self.clock()
        events = []
        for request_id, tokens in new_tokens.items():
            output = self._outputs.get(request_id)
            if output is None:
                continue
            request = self.scheduler.get(request_id)
            output.metrics.record_scheduled(request.first_scheduled_time)
            output.metrics.num_preemptions = request.num_preemptions
            output.metrics.cached_tokens = request.cached_tokens
            drafted = result.verify_logprobs.get(request_id, ()) if result is not None else ()
            for i, token in enumerate(tokens if isinstance(tokens, tuple) else (tokens,)):
                # a drafted row's own log-probabilities, then (all drafts accepted) the step's last row's
                logprob = drafted[i] if i < len(drafted) else logprobs.get(request_id) if logprobs else None
                event = output.on_token(token, now, logprob)
                events.append(event)
                self.emit(output, event)
                if event.finished:
                    self.retire(request_id)
                    break
        return events

    def emit(self, output: RequestOutput, event: StreamEvent) -> None:
        """Deliver an event to its request's sink. Called under the lock, so every request's events arrive in
        order; sinks must not block (queue puts, ``call_soon_threadsafe``)."""
        if output.sink is None:
            return
        try:
            output.sink(event)
        except Exception:  # a consumer's broken sink must not fail the other requests of the batch
            log.exception("the event sink of request %s raised", event.request_id)

    def retire(self, request_id: str) -> RequestOutput:
        """Remove a finished, aborted or failed request: free its blocks, log its metrics. Under the lock."""
        self.scheduler.finish_request(request_id)
        output = self._outputs.pop(request_id)
        if self._metrics_log is not None:
            self._metrics_log.log_request(output.metrics, request_id)
        return output

    def fail(self, scheduled: SchedulerOutput | None, exc: Exception) -> list[StreamEvent]:
        """Fail the requests of a step that raised (all live requests if the failure was not in the runner)."""
        message = f"{type(exc).__name__}: {exc}"
        with self._lock:
            ids = [s.request_id for s in scheduled.sequences] if scheduled is not None else list(self._outputs)
            events = []
            now = self.clock()
            for request_id in ids:
                output = self._outputs.get(request_id)
                if output is None:
                    continue
                events.append(output.terminal(now, "error", message))
                self.emit(output, events[-1])
                self.retire(request_id)
        return events

    def _record_step(self, scheduled: SchedulerOutput, start: float) -> None:
        if self._metrics_log is None:
            return
        decode = sum(1 + s.num_draft for s in scheduled.sequences if s.is_decode or s.num_draft)  # drafts: decoding
        self._metrics_log.log_step(StepMetrics(
            step=scheduled.step,
            time=start,
            duration_s=self.clock() - start,
            running=self.scheduler.num_running,
            waiting=self.scheduler.num_waiting,
            scheduled_tokens=scheduled.num_tokens,
            prefill_tokens=scheduled.num_tokens - decode,
            decode_tokens=decode,
            kv_blocks_used=self.scheduler.block_manager.num_used_blocks,
            kv_blocks_free=self.scheduler.block_manager.num_free_blocks,
            preemptions=len(scheduled.preempted_request_ids),
            masked_rows=self._step_masks[0],
            mask_time_s=self._step_masks[1],
        ))

    def close_metrics(self) -> None:
        """Close the metrics log; later steps are not logged."""
        with self._lock:
            if self._metrics_log is not None:
                self._metrics_log.close()
                self._metrics_log = None
