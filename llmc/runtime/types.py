"""The one typed contract between the scheduler and a model runner.

The scheduler is device-free: it decides *which tokens of which sequences* are computed this step and
where their KV entries live (block ids). The model runner turns that into tensors, runs the forward
pass over the paged KV cache, samples on the device and returns the sampled token ids.

There are no prefill/decode modes: every sequence has ``num_computed`` tokens in the KV cache and
``token_ids`` new tokens to compute this step (a chunk of its prompt, or the last sampled token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmc.runtime.params import SamplingParams


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's work for one engine step."""

    request_id: str
    token_ids: tuple[int, ...]  # new tokens to run this step, positions num_computed .. num_computed+len-1
    num_computed: int  # tokens already in the KV cache (their positions are 0 .. num_computed-1)
    block_ids: tuple[int, ...]  # the sequence's whole block table, covering num_computed + len(token_ids)
    sample: bool  # True when the logits at the last new token are sampled (False: a non-final prefill chunk)
    params: SamplingParams
    # Tokens the penalties see: the prompt and the tokens generated so far (in order).
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: tuple[int, ...] = ()


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
    """Sampled token per sequence that had ``sample=True``, keyed by request id."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # Optional per-sampled-sequence log-probability of the chosen token.
    logprobs: dict[str, float] = field(default_factory=dict)
