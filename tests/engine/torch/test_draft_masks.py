"""A drafted step of a request with an output format (structured outputs with speculation): each drafted row samples
under the mask of its own output position (``ScheduledSequence.draft_masks``), the last row under ``token_mask``.
Masks that allow one token per position, cycling through five, make any model write that cycle: greedy and seeded
sampled requests do, drafted and accepted, on the CPU here and on CUDA (graphs and eager) in
``test_speculate_gpu.py``."""

from __future__ import annotations

import dataclasses

import numpy as np

from llmc.engine.types import SchedulerOutput
from llmc.request.params import SamplingParams
from llmc.runtime.kv_cache import BlockManager
from llmc.runtime.scheduler import Scheduler
from llmc.runtime.scheduler.speculate import PromptLookup
from tests.engine.torch.helpers import make_build_dir
from tests.engine.torch.test_gpu import random_llama
from tests.runtime.scheduler_helpers import make_request

CYCLE = (11, 23, 37, 41, 53)
ANY_FORMAT = {"type": "regex", "pattern": ".+"}  # never compiled here: the masks below stand in for its constraint


def allow(token: int, words: int) -> np.ndarray:
    """A mask (int32 words, llguidance's layout) that allows ``token`` alone."""
    mask = np.zeros(words, dtype=np.uint32)
    mask[token // 32] = np.uint32(1) << np.uint32(token % 32)
    return mask.view(np.int32)


def with_masks(planned: SchedulerOutput, words: int) -> SchedulerOutput:
    """Each sampling row's mask allows the cycle's token at the output position it chooses."""
    seqs = []
    for s in planned.sequences:
        if s.sample:
            at = len(s.output_token_ids)
            rows = [allow(CYCLE[(at + i) % len(CYCLE)], words) for i in range(s.num_draft + 1)]
            s = dataclasses.replace(s, token_mask=rows[-1], draft_masks=np.stack(rows[:-1]) if s.num_draft else None)
        seqs.append(s)
    return dataclasses.replace(planned, sequences=tuple(seqs))


def masked_run(runner, max_new: int = 30) -> tuple[dict[str, list[int]], Scheduler]:
    """A greedy and a seeded sampled request with masks, drafts passed through as the engine's constraints would
    pass allowed ones; their outputs by request id, and the scheduler (its draft counters)."""
    sched = Scheduler(BlockManager(runner.num_blocks, runner.block_size), 8, 64, 512, 16, speculator=PromptLookup(4))
    sched.format_drafts = lambda request_id, proposed, limit: proposed
    params = [SamplingParams(max_new_tokens=max_new, temperature=0.0, structured=ANY_FORMAT),
              SamplingParams(max_new_tokens=max_new, temperature=0.9, seed=5, structured=ANY_FORMAT)]
    for i, n in enumerate([9, 20]):
        request = make_request(f"r{i}", [300 + j % 7 for j in range(n)], max_new=max_new)
        request.params = params[i]
        sched.add(request)
    words = -(-runner.vocab_size // 32)
    outputs: dict[str, list[int]] = {}
    while sched.has_unfinished():
        for rid, tokens in sched.update(runner.execute(with_masks(sched.schedule(), words))).items():
            outputs.setdefault(rid, []).extend(tokens if isinstance(tokens, tuple) else (tokens,))
            if len(sched.get(rid).output_token_ids) == max_new:
                sched.finish_request(rid)
    return outputs, sched


def test_drafted_rows_sample_under_their_own_positions_masks_on_the_cpu(tmp_path):
    from llmc.engine.torch.runner import TorchModelRunner

    runner = TorchModelRunner(make_build_dir(random_llama(tmp_path), tmp_path / "build"), num_blocks=64)
    outputs, sched = masked_run(runner)
    cycle = [CYCLE[p % len(CYCLE)] for p in range(30)]
    assert outputs == {"r0": cycle, "r1": cycle}
    assert sched.drafted_tokens_total >= sched.accepted_tokens_total > 20  # once the cycle repeats, drafts hold
