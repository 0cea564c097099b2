"""Output-format masks and logit biases on CUDA (gpu-marked: run through the device tool): the captured decode steps
and the eager prompt steps pick the same greedy tokens as the CPU runner, also with the masks given late (after the
forward pass is queued), and every row (sampled ones too) stays inside its allowed set."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from llmc.request.params import SamplingParams
from tests.engine.torch.helpers import MiniScheduler, make_build_dir
from tests.engine.torch.test_gpu import random_llama

pytestmark = pytest.mark.gpu


def allowed_ids(rid: str, step: int, vocab: int) -> list[int]:
    """A different allowed set for every request and step (a few ids spread over the vocabulary)."""
    seed = sum(map(ord, rid)) * 1000 + step
    return sorted(np.random.default_rng(seed).choice(vocab, size=5, replace=False).tolist())


def mask_of(ids: list[int], vocab: int) -> np.ndarray:
    bits = np.zeros((vocab + 31) // 32 * 32, dtype=np.uint8)
    bits[ids] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def run_masked(runner, params: dict, late: bool) -> dict:
    """Requests a, b, c (prompts of 37, 5 and 20 tokens, 6 new tokens each) through ``runner`` with ``params``;
    a and b sample under masks that allow a few ids, different at every step, c without one. ``late``: the masks
    are given as the engine's overlapped steps give them (launch's ``masks``, after the forward pass is queued).
    Checks every masked token is allowed; returns each request's tokens."""
    vocab = runner.vocab_size
    sched = MiniScheduler(runner.block_size, runner.num_blocks, chunk=16)
    for rid, prompt in (("a", range(100, 137)), ("b", range(300, 305)), ("c", range(500, 520))):
        sched.add(rid, list(prompt), max_new=6)
    for step in range(10):
        plan = sched.schedule(step)
        seqs = tuple(dataclasses.replace(s, params=params[s.request_id], token_mask=mask_of(
            allowed_ids(s.request_id, step, vocab), vocab) if s.request_id != "c" and s.sample else None)
            for s in plan.sequences)
        masked = dataclasses.replace(plan, sequences=seqs)
        if late:  # the step as the engine launches it: its params, masks to come
            calls, unmasked = [], dataclasses.replace(masked, sequences=tuple(
                dataclasses.replace(s, token_mask=None) for s in seqs))
            out = runner.launch(unmasked, None, masks=lambda: calls.append(1) or masked).result()
            assert calls == [1]
        else:
            out = runner.execute(masked)
        for s in seqs:
            token = out.sampled_token_ids.get(s.request_id)
            if token is not None and s.token_mask is not None:
                assert token in allowed_ids(s.request_id, step, vocab)
        sched.update(out.sampled_token_ids)
    return {rid: r["out"] for rid, r in sched.reqs.items()}


def test_masks_and_biases_on_cuda_equal_the_cpu_runners(tmp_path):
    from llmc.engine.torch.runner import TorchModelRunner

    hf_dir = random_llama(tmp_path)
    build = make_build_dir(hf_dir, tmp_path / "build", dtype="float32", tokens_per_block=16)
    params = {"a": SamplingParams(temperature=0.0, structured={"type": "json_object"}, logit_bias={"3": 4.0}),
              "b": SamplingParams(temperature=0.8, seed=5, structured={"type": "json_object"}),
              "c": SamplingParams(temperature=0.0, logit_bias={"11": 100})}
    cuda = TorchModelRunner(build, device="cuda", num_blocks=64)
    # The CUDA runner twice: masks given with the step, and late; then the CPU runner.
    first, late = run_masked(cuda, params, False), run_masked(cuda, params, True)
    cpu = run_masked(TorchModelRunner(build, device="cpu", num_blocks=64), params, False)
    assert all(len(v) == 6 for v in first.values())
    assert first["a"] == cpu["a"] and first["c"] == cpu["c"] == [11] * 6  # greedy rows; b's draws differ by device
    assert late == first  # the same draws too: one seed, one device


def test_greedy_rows_under_masks_alone_take_the_one_kernel_path_and_match_the_cpu_runner(tmp_path, monkeypatch):
    """Greedy rows whose only shaping is a mask (and a free greedy row beside them) are chosen on CUDA by
    ``masked_argmax`` (one kernel, late masks included): the same tokens as the CPU runner's general path."""
    from llmc.engine.torch import masked_argmax
    from llmc.engine.torch.runner import TorchModelRunner

    calls = []
    real = masked_argmax.masked_argmax
    monkeypatch.setattr(masked_argmax, "masked_argmax", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    hf_dir = random_llama(tmp_path)
    build = make_build_dir(hf_dir, tmp_path / "build", dtype="float32", tokens_per_block=16)
    fmt = SamplingParams(temperature=0.0, structured={"type": "json_object"})
    params = {"a": fmt, "b": fmt, "c": SamplingParams(temperature=0.0)}
    results = []
    for late in (False, True):
        results.append(run_masked(TorchModelRunner(build, device="cuda", num_blocks=64), params, late))
        assert calls and max(calls) == 3, calls  # the decode steps' three rows went through the kernel
        calls.clear()
    results.append(run_masked(TorchModelRunner(build, device="cpu", num_blocks=64), params, False))
    assert not calls  # the CPU runner's sampler takes its general path
    assert all(len(v) == 6 for v in results[0].values())
    assert results[0] == results[1] == results[2]
