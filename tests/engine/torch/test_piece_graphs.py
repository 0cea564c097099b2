"""Steps with prompt tokens from CUDA graphs in pieces (llmc/engine/torch/piece_graphs.py).

The CPU tests run the pieces as plain calls over a fused int4 model under Triton's interpreter (the decomposition,
the static buffers and the padding rows); the ``gpu`` tests capture them on CUDA, through the device tool.
"""

from __future__ import annotations

import pytest
import torch

from llmc.engine.torch import triton_support
from llmc.engine.torch.piece_graphs import MAX_PIECE_TOKENS, PieceGraphs, piece_buckets
from tests.engine.torch.helpers import PagedSession, make_build_dir
from tests.engine.torch.test_cuda_graphs import _run_schedule
from tests.engine.torch.test_gpu import random_llama
from tests.engine.torch.test_int4_cuda import tiny_w4a16_ir  # noqa: F401 - a fixture


def test_piece_buckets_cover_the_budget_every_128_tokens_then_every_256():
    assert piece_buckets(1024, 8192) == [128 * i for i in range(1, 9)]
    assert piece_buckets(1000, 8192)[-1] == 1024  # the budget rounded up to its bucket
    assert piece_buckets(1300, 8192)[-3:] == [1024, 1280, 1536]
    assert piece_buckets(100_000, 100_000)[-1] == MAX_PIECE_TOKENS  # larger steps stay eager
    assert piece_buckets(300, 256) == [128, 256]  # never past engine.max_num_tokens
    assert piece_buckets(200, 200) == [128, 200]
    assert piece_buckets(0, 8192) == []  # no budget, no pieces


def _sessions(model, scratch_block: int, buckets: list[int]) -> tuple[PagedSession, PagedSession, PieceGraphs]:
    """Two sessions handing out the same blocks: one eager, one through the pieces (scratch block kept out)."""
    sessions = []
    for _ in range(2):
        session = PagedSession(model, block_size=16, num_blocks=scratch_block + 1)
        session.free.remove(scratch_block)
        sessions.append(session)
    pieces = PieceGraphs(model, sessions[1].kv, buckets, scratch_block * 16, torch.device("cpu"))
    pieces.capture(graphs=False)
    sessions[1].forward = pieces.run
    return sessions[0], sessions[1], pieces


@pytest.mark.skipif(not triton_support.interpreting(),
                    reason="needs Triton's CPU interpreter (the gpu tests cover CUDA)")
def test_pieces_give_the_eager_steps_logits_and_cache_and_padding_writes_only_the_scratch(tiny_w4a16_ir):  # noqa: F811
    """Prompt, mixed and decode steps through the pieces (plain calls, Triton's interpreter) give the eager fused
    model's logits and cache: equal bits where a step fills its bucket, the same up to the kernels' summation
    order where padding rows make it larger. A step smaller than the one before it in the same bucket must not
    write its padding rows into the slots that step's rows had (they would overwrite "a"'s keys)."""
    from llmc.engine.torch.loader import load_model

    model = load_model(tiny_w4a16_ir, "cpu", dtype=torch.bfloat16, triton_on_cpu=True)
    assert model.cuda_fused
    scratch = 16
    eager, piecewise, pieces = _sessions(model, scratch, [8, 16, 32])
    ids = list(range(300, 360))
    steps = [
        {"a": ids[:14]},  # 14 rows of bucket 16
        {"b": ids[20:32]},  # 12 rows of bucket 16: rows 12, 13 held "a"'s slots
        {"a": [ids[14]], "b": ids[32:35]},  # a mixed step: a decode and a chunk over its cache, bucket 8
        {"a": [ids[15]], "b": [ids[35]]},  # two decodes
        {"c": ids[:16]},  # fills bucket 16: no padding
        {"c": ids[16:36], "a": [ids[16]]},  # 21 rows of bucket 32
    ]
    for work in steps:
        want, got = eager.step(work), piecewise.step(work)
        for rid in work:
            if sum(len(t) for t in work.values()) in pieces.buckets:
                assert torch.equal(got[rid], want[rid]), rid
            else:
                assert torch.allclose(got[rid], want[rid], rtol=0.02, atol=0.02 * want[rid].abs().max().item())
                assert torch.equal(got[rid].argmax(-1), want[rid].argmax(-1))
    assert not pieces.can_run(33) and pieces.can_run(32) and not pieces.can_run(0)
    for (k_want, v_want), (k_got, v_got) in zip(eager.kv, piecewise.kv, strict=True):
        for want, got in ((k_want, k_got), (v_want, v_got)):
            assert torch.allclose(got[:scratch].float(), want[:scratch].float(), rtol=0.02, atol=0.02)
            assert want[scratch].abs().sum() == 0 and got[scratch].abs().sum() > 0  # padding went there only


def test_engine_captures_pieces_for_its_budget_only(tiny_build_dir, monkeypatch):
    """Engine.from_dir asks the runner for the pieces of its mixed-step budget after the warm-up (the recipe's,
    or the one given); without a budget it asks for none. On CPU the runner captures nothing."""
    from llmc.engine.torch.runner import TorchModelRunner
    from llmc.runtime.api import Engine

    asked = []
    capture = TorchModelRunner.capture_pieces
    monkeypatch.setattr(TorchModelRunner, "capture_pieces",
                        lambda self, budget: asked.append(budget) or capture(self, budget))
    engine = Engine.from_dir(tiny_build_dir, device="cpu", mixed_step_tokens=256)
    assert asked == [256] and engine.runner.pieces is None  # CPU: no graphs, so no pieces
    Engine.from_dir(tiny_build_dir, device="cpu", mixed_step_tokens=0)
    assert asked == [256]


def test_pieces_that_do_not_fit_leave_the_budgets_steps_eager_with_a_warning(tiny_build_dir, monkeypatch, caplog):
    """The KV cache takes its share of GPU memory first: pieces that then do not fit are dropped with a warning that
    names the fix, and the budget's steps run eagerly (CPU stands in for CUDA: the capture is what fails here)."""
    from llmc.engine.torch.runner import TorchModelRunner

    runner = TorchModelRunner(tiny_build_dir, device="cpu")
    monkeypatch.setattr(runner, "graphs", object())  # as if the decode graphs had been captured
    monkeypatch.setattr(runner.model, "cuda_fused", True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def out_of_memory(self, graphs=True):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(PieceGraphs, "capture", out_of_memory)
    with caplog.at_level("WARNING", logger="llmc.engine.torch.runner"):
        assert runner.capture_pieces(256) == []
    assert runner.pieces is None
    assert "did not fit in GPU memory (CUDA out of memory. Tried to allocate 2.00 GiB)" in caplog.text
    assert "Fix: lower kv_cache.memory_fraction or serving.mixed_step_tokens" in caplog.text
    monkeypatch.setattr(PieceGraphs, "capture", lambda self, graphs=True: None)  # fits: kept
    buckets = runner.capture_pieces(256)
    assert buckets and runner.pieces is not None and runner.pieces.buckets == buckets


@pytest.mark.gpu
def test_budgeted_steps_replay_pieces_and_give_the_eager_tokens(tmp_path, monkeypatch):
    """On CUDA (float32): steps with prompt chunks beyond the decode graphs replay the captured pieces, with greedy
    tokens equal to eager steps'; blocks never handed out stay zero, the scratch block takes the padding rows;
    ``LLMC_PIECE_GRAPHS=0`` captures none."""
    from llmc.engine.torch.runner import TorchModelRunner

    monkeypatch.setenv("LLMC_GRAPH_CHUNKS", "0")  # every step with prompt tokens is the pieces' (or eager)
    hf_dir = random_llama(tmp_path)
    build = make_build_dir(hf_dir, tmp_path / "build", dtype="float32", tokens_per_block=16)
    piecewise = TorchModelRunner(build, device="cuda", num_blocks=64)
    eager = TorchModelRunner(build, device="cuda", num_blocks=64, cuda_graphs=False)
    assert piecewise.capture_pieces(256) == [128, 256] and eager.capture_pieces(256) == []
    calls = []
    run = piecewise.pieces.run
    piecewise.pieces.run = lambda ids, meta: calls.append(ids.shape[0]) or run(ids, meta)
    prompts = {"a": list(range(100, 237)), "b": list(range(300, 305)), "c": list(range(500, 650))}
    arrivals = {"a": 0, "b": 2, "c": 3}
    out_pieces, sched = _run_schedule(piecewise, prompts, arrivals, max_new=12, chunk=150)
    out_eager, _ = _run_schedule(eager, prompts, arrivals, max_new=12, chunk=150)
    assert out_pieces == out_eager
    assert sum(calls) >= sum(len(p) for p in prompts.values()) and max(calls) > 128
    used = {b for r in sched.reqs.values() for b in r["blocks"]}
    k_cache = piecewise.kv_caches[0][0]
    untouched = [b for b in range(64) if b not in used]
    assert untouched and k_cache[untouched].abs().sum().item() == 0
    assert k_cache[64].abs().sum().item() > 0
    monkeypatch.setenv("LLMC_PIECE_GRAPHS", "0")
    assert TorchModelRunner(build, device="cuda", num_blocks=64).capture_pieces(256) == []
