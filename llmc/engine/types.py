"""The one typed contract between the runtime and an engine backend's model runner.

The scheduler is device-free: it decides *which tokens of which sequences* are computed this step and
where their KV entries live (block ids). The model runner turns that into tensors, runs the forward
pass over the paged KV cache, samples on the device and returns the sampled token ids.

There are no prefill/decode modes: every sequence has ``num_computed`` tokens in the KV cache and
``token_ids`` new tokens to compute this step (a chunk of its prompt, or the last sampled token). A step
with exactly one new token is a *decode* (:func:`is_decode`, the one definition every layer uses).

Runners come in two kinds (:class:`ModelRunner`): a :class:`StepRunner` executes the steps llmc's scheduler
plans (the torch backend); a :class:`BatchRunner` takes whole requests because its backend schedules and
samples by itself (TensorRT-LLM's executor).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from llmc.request.outputs import Completion, StreamEvent, TokenLogprob
from llmc.request.params import SamplingParams


def is_decode(num_new_tokens: int) -> bool:
    """True for a sequence that computes exactly one new token this step (its last sampled one, or the last
    token of a prompt whose earlier chunks ran already): the decode-first order of the scheduler, the batched
    attention path, the CUDA-graph steps and the step metrics all key on this."""
    return num_new_tokens == 1


# A sampled token whose value is not on the host yet: the scheduler plans the next step while the previous one
# still runs (runners with ``async_steps``); the runner takes the value from that step's ids on the device.
PLACEHOLDER = -1


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's work for one engine step. With an asynchronous runner a decode's token may be
    :data:`PLACEHOLDER` (then its last output token is too): the token the previous step sampled for it."""

    request_id: str
    token_ids: tuple[int, ...]  # new tokens to run this step, positions num_computed .. num_computed+len-1
    num_computed: int  # tokens already in the KV cache (their positions are 0 .. num_computed-1)
    block_ids: tuple[int, ...]  # the sequence's whole block table, covering num_computed + len(token_ids)
    sample: bool  # True when the logits at the last new token are sampled (False: a non-final prefill chunk)
    params: SamplingParams
    # Tokens the penalties see: the prompt and the tokens generated so far (in order).
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: tuple[int, ...] = ()
    # The token ids the request's output format allows next (SamplingParams.structured), for a sequence that samples:
    # int32 [ceil(vocab / 32)] on the host, bit i % 32 of word i // 32 set for an allowed id i; None: any id.
    token_mask: Any = field(default=None, compare=False)
    # Draft tokens (speculation, llmc.runtime.scheduler.speculate): the last ``num_draft`` of ``token_ids`` are
    # guesses that follow the decode token before them; the runner returns the token it chooses after each new token
    # (ModelRunnerOutput.verify_token_ids, then sampled_token_ids after the last), greedy or sampled as that output
    # position would be without drafts (its seed index, penalties and min_tokens count the drafts before it).
    num_draft: int = 0
    # The drafted rows' masks (an output format's request with drafts): int32 [num_draft, words], row i for the row
    # that chooses output position len(output_token_ids) + i; token_mask is then the last row's (after every draft).
    draft_masks: Any = field(default=None, compare=False)

    @property
    def draft_token_ids(self) -> tuple[int, ...]:
        """The draft tokens (the last ``num_draft`` of ``token_ids``; none without speculation)."""
        return self.token_ids[len(self.token_ids) - self.num_draft:] if self.num_draft else ()

    @property
    def is_decode(self) -> bool:
        """One new token this step (:func:`is_decode`)."""
        return is_decode(len(self.token_ids))


@dataclass(frozen=True)
class SchedulerOutput:
    """Everything the model runner needs for one step; ``sequences`` is in batch order."""

    step: int
    sequences: tuple[ScheduledSequence, ...]
    preempted_request_ids: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)


@dataclass(frozen=True)
class ModelRunnerOutput:
    """Sampled token per sequence that had ``sample=True``, keyed by request id (and log-probabilities)."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # The sampled token's log-probabilities, for the sequences whose SamplingParams ask for them.
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    # Prompt log-probabilities of this step's prompt chunks (SamplingParams.prompt_logprobs): request id ->
    # (the first prompt position they score, one entry per position from there), for any sequence, sampled or not.
    prompt_logprobs: dict[str, tuple[int, tuple[TokenLogprob, ...]]] = field(default_factory=dict)
    # Sequences with draft tokens (ScheduledSequence.num_draft): the token chosen after each of their new tokens but
    # the last (num_draft of them; ``sampled_token_ids`` has the one after the last).
    verify_token_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # Their log-probabilities, one per drafted row, for the sequences whose SamplingParams ask for them.
    verify_logprobs: dict[str, tuple[TokenLogprob, ...]] = field(default_factory=dict)


@runtime_checkable
class ModelRunner(Protocol):
    """What every backend's loaded model tells the layers above it."""

    vocab_size: int  # token ids (prompts, stop ids, logit biases) must lie in 0 .. vocab_size - 1


@runtime_checkable
class StepRunner(ModelRunner, Protocol):
    """A runner that executes the steps llmc's scheduler plans over its paged KV cache (the torch backend)."""

    block_size: int  # tokens per KV block
    num_blocks: int  # KV blocks the block manager may hand out: block ids 0 .. num_blocks - 1

    def execute(self, scheduled: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; return the sampled token of every sequence with ``sample=True``."""
        ...

    # Runners with ``async_steps = True`` also have ``launch(scheduled, previous=None) -> pending`` (the step is
    # queued; ``pending.result()`` waits for its ModelRunnerOutput), where a :data:`PLACEHOLDER` token of
    # ``scheduled`` is the token that ``previous`` (the pending step launched just before) sampled for that
    # request. The engine calls ``previous.result()`` after launching the next step and before launching another.
    # Runners with ``late_masks = True`` take ``launch(scheduled, previous, masks)``: ``masks()``, called once the
    # step's forward pass is queued and before it samples, returns the step with its output-format masks set (the
    # engine collects ``previous`` in it, so the masks see its tokens while the device runs the forward pass).
    # Runners with ``verifies_drafts = True`` take sequences with draft tokens (ScheduledSequence.num_draft).


@runtime_checkable
class BatchRunner(ModelRunner, Protocol):
    """A runner whose backend batches, schedules and samples by itself (TensorRT-LLM's executor): it takes
    prompts as token ids and yields llmc's events, run through llmc's own output pipeline."""

    tokenizer: Any  # the build's Hugging Face tokenizer
    eos_token_ids: tuple[int, ...]

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | None = None) -> list[Completion]:
        """One :class:`Completion` per prompt, in order."""
        ...

    def stream(self, prompt: Sequence[int], params: SamplingParams | None = None,
               request_id: str = "trt-0") -> Iterator[StreamEvent]:
        """One request's events as tokens arrive; the last has ``finished=True``."""
        ...
