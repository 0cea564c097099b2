"""Draft tokens on CUDA (gpu-marked, run through the device tool): a drafted step replays the CUDA graphs like a
short prompt chunk and verifies its drafts with the logits and greedy tokens the graph computed for every row; the
eager path computes them from the drafted rows' hidden states. Both give plain decoding's tokens (float32), greedy
and seeded sampling (with token log-probabilities) alike, and drafted rows of a request with an output format sample
under their own positions' masks."""

from __future__ import annotations

import pytest
import torch

from llmc.request.params import SamplingParams
from llmc.runtime.kv_cache import BlockManager
from llmc.runtime.scheduler import Scheduler
from llmc.runtime.scheduler.speculate import PromptLookup
from tests.engine.torch.helpers import make_build_dir
from tests.engine.torch.test_draft_masks import CYCLE, masked_run
from tests.engine.torch.test_gpu import random_llama
from tests.runtime.scheduler_helpers import make_request

pytestmark = pytest.mark.gpu


def _generate(runner, speculate: bool) -> tuple[dict[str, list[int]], Scheduler]:
    sched = Scheduler(BlockManager(runner.num_blocks, runner.block_size), 8, 64, 512, 16,
                      speculator=PromptLookup(5) if speculate else None)
    seeded = SamplingParams(max_new_tokens=48, temperature=0.05, seed=11, logprobs=2)  # random weights: flat logits
    for i, n in enumerate([9, 30, 17]):
        request = make_request(f"r{i}", [300 + (7 * j + i) % 40 for j in range(n)], max_new=48)
        if i == 2:
            request.params = seeded
        sched.add(request)
    outputs: dict[str, list[int]] = {}
    while sched.has_unfinished():
        for rid, tokens in sched.update(runner.execute(sched.schedule())).items():
            outputs.setdefault(rid, []).extend(tokens if isinstance(tokens, tuple) else (tokens,))
            if len(sched.get(rid).output_token_ids) == 48:
                sched.finish_request(rid)
    return outputs, sched


@pytest.mark.parametrize("graphs", [True, False])
def test_drafted_steps_on_cuda_give_plain_decodings_tokens(tmp_path, graphs):
    from llmc.engine.torch.runner import TorchModelRunner

    build = make_build_dir(random_llama(tmp_path), tmp_path / "build", dtype="float32", tokens_per_block=16)
    runner = TorchModelRunner(build, device="cuda", num_blocks=64, cuda_graphs=graphs)
    assert (runner.graphs is not None) == graphs
    verified = []
    if graphs:
        rows_at = runner.graphs.rows_at
        runner.graphs.rows_at = lambda rows: verified.append(len(rows)) or rows_at(rows)
    plain, _ = _generate(runner, speculate=False)
    drafted, sched = _generate(runner, speculate=True)
    assert drafted == plain
    assert sched.drafted_tokens_total > sched.accepted_tokens_total > 0  # random weights: the outputs loop
    assert not graphs or (verified and sum(verified) == sched.drafted_tokens_total)
    del runner
    torch.cuda.empty_cache()


@pytest.mark.parametrize("graphs", [True, False])
def test_drafted_rows_sample_under_their_own_positions_masks_on_cuda(tmp_path, graphs):
    from llmc.engine.torch.runner import TorchModelRunner

    build = make_build_dir(random_llama(tmp_path), tmp_path / "build", dtype="bfloat16", tokens_per_block=16)
    runner = TorchModelRunner(build, device="cuda", num_blocks=64, cuda_graphs=graphs)
    outputs, sched = masked_run(runner)
    cycle = [CYCLE[p % len(CYCLE)] for p in range(30)]
    assert outputs == {"r0": cycle, "r1": cycle}
    assert sched.drafted_tokens_total >= sched.accepted_tokens_total > 20
    del runner
    torch.cuda.empty_cache()
