"""Shared pieces of the scheduler tests: a fake clock, a deterministic fake model over a simulated paged KV cache
(it checks every context it reads), request and scheduler factories, random arrivals, and the placeholder
resolution an asynchronous runner does on the device."""

from __future__ import annotations

import dataclasses
import random

from llmc.engine.types import PLACEHOLDER, ModelRunnerOutput, SchedulerOutput
from llmc.request.params import SamplingParams
from llmc.runtime.kv_cache import BlockManager
from llmc.runtime.scheduler import Request, Scheduler


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def next_token(tokens: list[int]) -> int:
    """A deterministic 'model': the next token depends on the whole context."""
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 31 + len(tokens)) % 50 + 100


class SlotRunner:
    """Fake model runner with a simulated paged KV cache.

    It writes each new token to its slot and, before sampling, reads the context back through the block
    table: a wrong block table, a skipped prefill chunk or a bad prefix-cache hit shows up as a mismatch.
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.slots: dict[int, int] = {}

    def _slot(self, block_ids: tuple[int, ...], pos: int) -> int:
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        sampled = {}
        for s in out.sequences:
            for i, t in enumerate(s.token_ids):
                self.slots[self._slot(s.block_ids, s.num_computed + i)] = t
        for s in out.sequences:
            total = s.num_computed + len(s.token_ids)
            ctx = [self.slots[self._slot(s.block_ids, p)] for p in range(total)]
            assert ctx == list(s.prompt_token_ids + s.output_token_ids)[:total], s.request_id
            if s.sample:
                assert total == len(s.prompt_token_ids) + len(s.output_token_ids)
                sampled[s.request_id] = next_token(ctx)
        return ModelRunnerOutput(sampled_token_ids=sampled)


def make_request(rid: str, prompt, max_new: int = 4, priority: int = 0) -> Request:
    prompt = tuple(range(1, prompt + 1)) if isinstance(prompt, int) else tuple(prompt)
    return Request(rid, prompt, SamplingParams(max_new_tokens=max_new, temperature=0.0), priority=priority)


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_tokens=32, max_model_len=256,
                   max_queue_size=16, max_wait_s=None, clock=None, prefix=True, max_mixed_tokens=None) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    return Scheduler(bm, max_num_seqs, max_num_tokens, max_model_len, max_queue_size, max_wait_s,
                     clock or FakeClock(), max_mixed_tokens=max_mixed_tokens)


def random_arrivals(seed: int, n: int, shared_prefix: int = 0) -> dict[int, list[Request]]:
    rng = random.Random(seed)
    prefix = tuple(rng.randrange(1, 90) for _ in range(shared_prefix))
    arrivals: dict[int, list[Request]] = {}
    for i in range(n):
        prompt = prefix + tuple(rng.randrange(1, 90) for _ in range(rng.randint(1, 40)))
        req = make_request(f"r{i}", prompt, max_new=rng.randint(1, 12), priority=rng.choice([0, 0, 1]))
        arrivals.setdefault(rng.randint(0, 20), []).append(req)
    return arrivals


def resolve_placeholders(out: SchedulerOutput, previous: ModelRunnerOutput | None) -> SchedulerOutput:
    """``out`` with each placeholder token replaced by what the previous step sampled for that request (what the
    CUDA runner does on the device)."""
    seqs = []
    for s in out.sequences:
        if s.token_ids[-1:] == (PLACEHOLDER,):
            token = previous.sampled_token_ids[s.request_id]
            s = dataclasses.replace(s, token_ids=s.token_ids[:-1] + (token,),
                                    output_token_ids=s.output_token_ids[:-1] + (token,))
        seqs.append(s)
    return dataclasses.replace(out, sequences=tuple(seqs))
