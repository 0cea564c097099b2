"""CUDA-graph decode steps (the decode attention kernel itself: test_decode_attention_kernel.py).

The CPU tests run everywhere; the ``gpu`` tests run through the device tool (an NVIDIA GPU with Triton).
"""

from __future__ import annotations

import pytest
import torch

from llmc.engine.torch.cuda_graphs import (DecodeGraphs, decode_rows, graph_batch_sizes, graph_rows, last_rows,
                                           verify_rows)
from llmc.engine.torch.triton_attention import kernel_available
from llmc.engine.types import ScheduledSequence
from llmc.request.params import SamplingParams
from tests.engine.torch.helpers import MiniScheduler, make_build_dir, random_decode_batch
from tests.engine.torch.test_gpu import random_llama

GREEDY = SamplingParams(temperature=0.0)


def test_graph_batch_sizes_cover_every_batch_up_to_the_limit():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(16) == [1, 2, 4, 8, 16]
    assert graph_batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert graph_batch_sizes(64, chunk_rows=256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]  # and prompt chunks
    assert graph_batch_sizes(48, chunk_rows=200) == [1, 2, 4, 8, 16, 32, 48, 96, 192, 200]
    assert graph_batch_sizes(64, chunk_rows=64) == graph_batch_sizes(64)


def test_drafted_rows_are_verified_from_the_replayed_graphs_rows():
    a = ScheduledSequence("a", (11,), 5, (7, 3), True, GREEDY)
    b = ScheduledSequence("b", (12, 40, 41, 42), 9, (9, 4, 5), True, GREEDY, num_draft=3)  # rows 1-4: 1-3 verify
    c = ScheduledSequence("c", (21, 22), 2, (6,), False, GREEDY)
    d = ScheduledSequence("d", (13, 50), 7, (2, 8), True, GREEDY, num_draft=1)  # rows 7-8: 7 verifies
    seqs = (a, b, c, d)
    assert last_rows(seqs) == [0, 4, 6, 8] and verify_rows(seqs) == [1, 2, 3, 7]
    graphs = object.__new__(DecodeGraphs)  # only the replayed graph's outputs matter here
    graphs.device, graphs._replayed = torch.device("cpu"), 16
    graphs._logits = {16: torch.arange(16.0)[:, None].expand(16, 5)}
    graphs._argmax = {16: torch.arange(100, 116)}
    logits, greedy = graphs.rows_at(verify_rows(seqs))
    assert logits[:, 0].tolist() == [1.0, 2.0, 3.0, 7.0] and greedy.tolist() == [101, 102, 103, 107]


def test_decode_rows_pack_each_sequence_then_pad_into_the_scratch_block():
    a = ScheduledSequence("a", (11,), 5, (7, 3), True, GREEDY)  # position 5 with blocks of 4: block 3, offset 1
    b = ScheduledSequence("b", (12,), 0, (9,), True, GREEDY)
    rows = decode_rows((a, b), rows=4, block_size=4, max_blocks=3, scratch_block=20)
    assert rows == [
        [11, 5, 3 * 4 + 1, 6, 7, 3, 20],
        [12, 0, 9 * 4, 1, 9, 20, 20],
        [0, 0, 80, 1, 20, 20, 20],
        [0, 0, 80, 1, 20, 20, 20],
    ]


def test_decode_rows_give_each_prompt_token_a_row_over_its_own_sequence_up_to_its_position():
    a = ScheduledSequence("a", (11,), 5, (7, 3), True, GREEDY)
    b = ScheduledSequence("b", (21, 22, 23), 2, (9, 4), False, GREEDY)  # positions 2-4: block 9 then block 4
    c = ScheduledSequence("c", (31, 32), 0, (6,), True, GREEDY)  # a whole fresh prompt
    rows = decode_rows((a, b, c), rows=8, block_size=4, max_blocks=3, scratch_block=20)
    assert rows == [
        [11, 5, 3 * 4 + 1, 6, 7, 3, 20],
        [21, 2, 9 * 4 + 2, 3, 9, 4, 20],
        [22, 3, 9 * 4 + 3, 4, 9, 4, 20],
        [23, 4, 4 * 4 + 0, 5, 9, 4, 20],
        [31, 0, 6 * 4, 1, 6, 20, 20],
        [32, 1, 6 * 4 + 1, 2, 6, 20, 20],
        [0, 0, 80, 1, 20, 20, 20],
        [0, 0, 80, 1, 20, 20, 20],
    ]
    assert last_rows((a, b, c)) == [0, 3, 5]  # the rows the sampling sequences (a, c) read their logits from


def test_graph_rows_take_steps_of_few_new_tokens_and_chunks_only_when_allowed():
    dec = [ScheduledSequence(f"d{i}", (5,), 40, (1, 2, 3), True, GREEDY) for i in range(3)]
    chunk = ScheduledSequence("p", tuple(range(4)), 8, (4, 5), False, GREEDY)  # positions 8-11 in blocks of 16
    assert graph_rows(tuple(dec), 16, 4, 8, chunk_rows=0) == 3
    assert graph_rows(tuple(dec), 16, 4, 2, chunk_rows=16) == 0  # 3 decodes > the largest decode graph's 2
    assert graph_rows((*dec, chunk), 16, 4, 8, chunk_rows=8) == 7
    assert graph_rows((*dec, chunk), 16, 4, 8, chunk_rows=0) == 0  # prompt chunks run eagerly
    assert graph_rows((*dec, chunk), 16, 4, 4, chunk_rows=6) == 0  # 7 rows > the 6 the chunk graphs take
    assert graph_rows((), 16, 4, 8, chunk_rows=8) == 0
    wide = ScheduledSequence("w", (5,), 64, tuple(range(5)), True, GREEDY)  # position 64: a 5th block of 16
    assert graph_rows((wide,), 16, 4, 8, chunk_rows=8) == 0
    no_sample = ScheduledSequence("n", (5,), 3, (1,), False, GREEDY)  # one token that samples nothing: a chunk
    assert graph_rows((no_sample,), 16, 4, 8, chunk_rows=0) == 0 and graph_rows((no_sample,), 16, 4, 8, 8) == 1
    # Each row reads its sequence's cache up to its position: at most what 2 decodes of 4 blocks of 16 read (128).
    fresh = ScheduledSequence("f", tuple(range(15)), 0, (1,), True, GREEDY)  # contexts 1 .. 15: 120 in all
    late = ScheduledSequence("l", tuple(range(3)), 60, (1, 2, 3, 4), True, GREEDY)  # contexts 61-63: 186
    assert graph_rows((fresh,), 16, 4, 2, chunk_rows=16) == 15
    assert graph_rows((late,), 16, 4, 2, chunk_rows=16) == 0  # eager: one read of the context for all 3 queries
    assert graph_rows((late,), 16, 4, 3, chunk_rows=16) == 3


def test_cpu_never_uses_the_kernel_or_graphs(tiny_hf_dir, tmp_path):
    from llmc.engine.torch.runner import TorchModelRunner

    assert not kernel_available("cpu", 32, 64)
    runner = TorchModelRunner(make_build_dir(tiny_hf_dir, tmp_path / "b", tokens_per_block=32), device="cpu")
    assert runner.graphs is None
    assert runner.kv_caches[0][0].shape[0] == runner.num_blocks  # no scratch block


def _run_schedule(runner, prompts: dict[str, list[int]], arrivals: dict[str, int], max_new: int, chunk: int):
    sched = MiniScheduler(runner.block_size, runner.num_blocks, chunk=chunk)
    step = 0
    while step < 200 and (len(sched.reqs) < len(prompts)
                          or any(len(r["out"]) < r["max_new"] for r in sched.reqs.values())):
        for rid, at in arrivals.items():
            if at == step:
                sched.add(rid, prompts[rid], max_new=max_new)
        out = sched.schedule(step)
        if out.sequences:
            sched.update(runner.execute(out).sampled_token_ids)
        step += 1
    return {rid: r["out"] for rid, r in sched.reqs.items()}, sched


@pytest.mark.gpu
def test_graph_decode_equals_eager_decode_and_leaves_other_blocks_alone(tmp_path):
    from llmc.engine.torch.runner import TorchModelRunner

    hf_dir = random_llama(tmp_path)
    build = make_build_dir(hf_dir, tmp_path / "build", dtype="float32", tokens_per_block=16)
    graphed = TorchModelRunner(build, device="cuda", num_blocks=64)
    eager = TorchModelRunner(build, device="cuda", num_blocks=64, cuda_graphs=False)
    assert graphed.graphs is not None and eager.graphs is None
    assert graphed.kv_caches[0][0].shape[0] == 65  # the scratch block after the 64 managed ones
    calls = []
    run = graphed.graphs.run
    graphed.graphs.run = lambda seqs, fill=None: calls.append(len(seqs)) or run(seqs, fill)
    # Mixed lengths, staggered arrivals: decode batches of 1, 2 and 3 rows (padded to 1, 2 and 4).
    prompts = {"a": list(range(100, 137)), "b": list(range(300, 305)), "c": list(range(500, 550))}
    arrivals = {"a": 0, "b": 2, "c": 5}
    out_graph, sched = _run_schedule(graphed, prompts, arrivals, max_new=12, chunk=16)
    out_eager, _ = _run_schedule(eager, prompts, arrivals, max_new=12, chunk=16)
    assert out_graph == out_eager
    assert calls and set(calls) >= {1, 2, 3}
    used = {b for r in sched.reqs.values() for b in r["blocks"]}
    k_cache = graphed.kv_caches[0][0]
    untouched = [b for b in range(64) if b not in used]
    assert untouched and k_cache[untouched].abs().sum().item() == 0  # padding rows wrote only the scratch block
    assert k_cache[64].abs().sum().item() > 0


@pytest.mark.gpu
def test_short_prompt_chunks_replay_the_graphs_and_give_the_eager_tokens(tmp_path, monkeypatch):
    """Steps whose prompt chunks and decodes fit the graphs' rows replay them (each prompt token a one-token query
    over its own sequence's cache): greedy tokens equal to eager steps (float32), the sampled rows picked from
    each chunk's last token, chunks that end no prompt sampling nothing; ``LLMC_GRAPH_CHUNKS=0`` keeps chunks
    eager; the warm-up's prefills run eagerly and leave the graphs in place."""
    from llmc.engine.torch.runner import TorchModelRunner

    hf_dir = random_llama(tmp_path)
    build = make_build_dir(hf_dir, tmp_path / "build", dtype="float32", tokens_per_block=16)
    graphed = TorchModelRunner(build, device="cuda", num_blocks=64)
    eager = TorchModelRunner(build, device="cuda", num_blocks=64, cuda_graphs=False)
    monkeypatch.setenv("LLMC_GRAPH_CHUNKS", "0")
    decodes_only = TorchModelRunner(build, device="cuda", num_blocks=64)
    assert graphed.graphs.chunk_rows == 256 and decodes_only.graphs.chunk_rows == 0
    assert graphed.graphs.sizes[-2:] == [128, 256] and decodes_only.graphs.sizes[-1] == 16
    graphed.warmup()
    assert graphed.graphs is not None
    chunk_rows = {"graphed": [], "decodes_only": []}
    for key, runner in (("graphed", graphed), ("decodes_only", decodes_only)):
        run = runner.graphs.run
        runner.graphs.run = (lambda seqs, fill=None, run=run, key=key:
                             chunk_rows[key].append(sum(len(s.token_ids) for s in seqs if not s.is_decode))
                             or run(seqs, fill))
    prompts = {"a": list(range(100, 111)), "b": list(range(300, 305)), "c": list(range(500, 530))}
    arrivals = {"a": 0, "b": 1, "c": 3}
    out_graph, _ = _run_schedule(graphed, prompts, arrivals, max_new=10, chunk=3)
    out_eager, _ = _run_schedule(eager, prompts, arrivals, max_new=10, chunk=3)
    out_decodes, _ = _run_schedule(decodes_only, prompts, arrivals, max_new=10, chunk=3)
    assert out_graph == out_eager == out_decodes
    assert sum(chunk_rows["graphed"]) == sum(len(p) for p in prompts.values())  # every prompt token in a graph
    assert chunk_rows["decodes_only"] and not any(chunk_rows["decodes_only"])


@pytest.mark.gpu
def test_graph_decode_takes_placeholder_tokens_from_the_previous_step_on_the_device(tmp_path):
    """The engine launches decode step n + 1 before step n's tokens reach the host: the replayed graph's input
    tokens come from step n's ids on the device, and the tokens equal those of steps launched with known values."""
    from llmc.engine.torch.runner import TorchModelRunner
    from llmc.engine.types import PLACEHOLDER, ScheduledSequence, SchedulerOutput

    hf_dir = random_llama(tmp_path)
    build = make_build_dir(hf_dir, tmp_path / "build", dtype="float32", tokens_per_block=16)
    runner = TorchModelRunner(build, device="cuda", num_blocks=64)
    prompts = {"a": tuple(range(100, 137)), "b": tuple(range(300, 305))}
    blocks = {"a": (1, 2, 3, 4), "b": (5, 6)}
    calls = []
    run = runner.graphs.run
    runner.graphs.run = lambda seqs, fill=None: calls.append(fill is not None) or run(seqs, fill)

    def decode(ahead: bool) -> dict[str, list[int]]:
        first = runner.launch(SchedulerOutput(0, tuple(
            ScheduledSequence(r, p, 0, blocks[r], True, GREEDY, prompt_token_ids=p) for r, p in prompts.items())))
        out = {r: [t] for r, t in first.result().sampled_token_ids.items()}
        pending, waiting = first, None
        for step in range(1, 9):
            seqs = tuple(ScheduledSequence(r, (PLACEHOLDER if ahead and step > 1 else out[r][-1],),
                                           len(p) + step - 1, blocks[r], True, GREEDY, prompt_token_ids=p)
                         for r, p in prompts.items())
            pending = runner.launch(SchedulerOutput(step, seqs), previous=waiting if ahead else None)
            if ahead:  # the step before is waited for only now, after this one was queued
                if waiting is not None:
                    for r, t in waiting.result().sampled_token_ids.items():
                        out[r].append(t)
                waiting = pending
            else:
                for r, t in pending.result().sampled_token_ids.items():
                    out[r].append(t)
        if ahead:
            for r, t in waiting.result().sampled_token_ids.items():
                out[r].append(t)
        return out

    known = decode(ahead=False)
    assert not any(calls) and len(calls) == 9  # the 42-token prompt step replays a chunk graph too
    assert decode(ahead=True) == known and sum(calls) == 7  # every decode step after the first took placeholders


@pytest.mark.gpu
def test_step_triton_kernels_chained_in_a_cuda_graph_give_the_same_bits_with_programmatic_launch(monkeypatch):
    """The step's Triton kernels launched while their predecessor runs (``LLMC_TRITON_PDL``, the default on sm_90+)
    wait for it before touching memory: add + RMSNorm -> RoPE + KV write -> decode attention -> its merge ->
    RMSNorm, each reading the last one's output (the attention reads the keys the RoPE kernel just wrote), replayed
    from a CUDA graph with fresh inputs, gives the bits and the cache of plain launches and of eager calls."""
    from llmc.engine.torch import cuda_ext, fused_triton, triton_support
    from llmc.engine.torch.rope import rope_cos_sin
    from llmc.engine.torch.triton_attention import paged_decode_attention

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90")
    dtype = torch.bfloat16
    q0, k_cache0, v_cache0, meta = random_decode_batch("cuda", dtype)
    d, nh, hd = q0.shape
    nkv = k_cache0.shape[2]
    width = nh * hd
    gen = torch.Generator(device="cuda").manual_seed(3)
    w_qkv = (torch.randn(width, (nh + 2 * nkv) * hd, generator=gen, device="cuda") * width ** -0.5).to(dtype)
    w1, w2 = (torch.rand(width, generator=gen, device="cuda") + 0.5).to(dtype), torch.ones(width, device="cuda",
                                                                                         dtype=dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2, device="cuda").float() / hd))
    cos, sin = rope_cos_sin(inv_freq, meta.decode_context_lens.long() - 1, dtype)
    slots = meta.slot_mapping

    def chain(h, a, k_cache, v_cache):
        normed = fused_triton.add_rms_norm_(h, a, w1, 1e-5)
        q = fused_triton.rope_write_kv(normed @ w_qkv, cos, sin, k_cache, v_cache, slots, nh, nkv, hd)
        att = paged_decode_attention(q, k_cache, v_cache, meta.decode_tables, meta.decode_context_lens, hd ** -0.5)
        return fused_triton.rms_norm(att.reshape(d, width), w2, 1e-5)

    inputs = [(torch.randn(d, width, generator=gen, device="cuda").to(dtype),
               torch.randn(d, width, generator=gen, device="cuda").to(dtype)) for _ in range(3)]
    results = {}
    try:
        for pdl in ("0", "1"):
            monkeypatch.setenv(triton_support.PDL_ENV, pdl)
            for cached in (cuda_ext.pdl, triton_support.early_launch, triton_support.pdl_launch):
                cached.cache_clear()
            assert triton_support.pdl_launch(torch.device("cuda")) == (pdl == "1")
            h, a = inputs[0][0].clone(), inputs[0][1].clone()
            k_cache, v_cache = k_cache0.clone(), v_cache0.clone()
            chain(h.clone(), a, k_cache, v_cache)  # compile and warm up outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = chain(h, a, k_cache, v_cache)
            got = []
            for x, y in inputs:
                h.copy_(x)
                a.copy_(y)
                graph.replay()
                got.append((out.clone(), h.clone(), k_cache.clone(), v_cache.clone()))
            results[pdl] = got
    finally:
        for cached in (cuda_ext.pdl, triton_support.early_launch, triton_support.pdl_launch):
            cached.cache_clear()
    for (x, y), plain, pdl in zip(inputs, results["0"], results["1"]):
        k_cache, v_cache = k_cache0.clone(), v_cache0.clone()
        h = x.clone()
        eager = (chain(h, y, k_cache, v_cache), h, k_cache, v_cache)
        assert torch.isfinite(plain[0]).all() and not torch.equal(plain[2], k_cache0)  # keys were written
        for p, q, e in zip(plain, pdl, eager):
            assert torch.equal(p, q) and torch.equal(p, e)


@pytest.mark.gpu
def test_logprobs_from_graph_steps_equal_eager_and_cpu_steps(tmp_path):
    """Log-probabilities leave the CUDA runner through page-locked copies behind the step's kernels (graph and eager
    steps alike) and must equal the CPU runner's."""
    from llmc.engine.torch.runner import TorchModelRunner

    hf_dir = random_llama(tmp_path)
    build = make_build_dir(hf_dir, tmp_path / "build", dtype="float32", tokens_per_block=16)
    params = SamplingParams(temperature=0.0, logprobs=3)
    results = []
    for runner in (TorchModelRunner(build, device="cuda", num_blocks=64),
                   TorchModelRunner(build, device="cuda", num_blocks=64, cuda_graphs=False),
                   TorchModelRunner(build, device="cpu", num_blocks=64)):
        sched = MiniScheduler(runner.block_size, runner.num_blocks, chunk=16, params=params)
        sched.add("a", list(range(100, 137)), max_new=6)
        sched.add("b", list(range(300, 305)), max_new=6)
        logprobs = []
        for step in range(10):
            out = runner.execute(sched.schedule(step))
            sched.update(out.sampled_token_ids)
            logprobs += [out.logprobs[rid] for rid in sorted(out.logprobs)]
        assert sorted(out.sampled_token_ids) == sorted(out.logprobs) or not out.sampled_token_ids
        results.append(logprobs)
    graphed, eager, cpu = results
    assert len(graphed) == 12 and [lp.token_id for lp in graphed] == [lp.token_id for lp in cpu]
    for ours in (graphed, eager):
        for lp, ref in zip(ours, cpu):
            assert lp.logprob == pytest.approx(ref.logprob, abs=1e-3)
            assert [t for t, _ in lp.top] == [t for t, _ in ref.top] and lp.top[0][0] == lp.token_id


@pytest.mark.gpu
def test_prompt_logprobs_on_cuda_equal_the_cpu_runners(tmp_path):
    """Prompt chunks whose request asks for its prompt's log-probabilities run eagerly (the graphs compute the
    sampled rows' logits only), their rows' log-probabilities leave through page-locked copies (also from steps
    that sample nothing), and they must equal the CPU runner's."""
    from llmc.engine.torch.runner import TorchModelRunner

    hf_dir = random_llama(tmp_path)
    build = make_build_dir(hf_dir, tmp_path / "build", dtype="float32", tokens_per_block=16)
    params = SamplingParams(temperature=0.0, prompt_logprobs=2)
    results = []
    for runner in (TorchModelRunner(build, device="cuda", num_blocks=64),
                   TorchModelRunner(build, device="cpu", num_blocks=64)):
        sched = MiniScheduler(runner.block_size, runner.num_blocks, chunk=16, params=params)
        sched.add("a", list(range(100, 137)), max_new=3)  # three chunks: two sample nothing
        sched.add("b", list(range(300, 305)), max_new=3)
        scored: dict[str, list] = {"a": [], "b": []}
        for step in range(6):
            out = runner.execute(sched.schedule(step))
            sched.update(out.sampled_token_ids)
            for rid, (start, entries) in out.prompt_logprobs.items():
                assert start == len(scored[rid]) + 1
                scored[rid] += entries
        results.append(scored)
    cuda, cpu = results
    assert [len(cuda[r]) for r in "ab"] == [36, 4]
    for rid in "ab":
        assert [lp.token_id for lp in cuda[rid]] == [lp.token_id for lp in cpu[rid]]
        for lp, ref in zip(cuda[rid], cpu[rid]):
            assert lp.logprob == pytest.approx(ref.logprob, abs=1e-3)
            assert [t for t, _ in lp.top] == [t for t, _ in ref.top]
