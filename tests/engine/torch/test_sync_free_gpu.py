"""On CUDA, queuing a step waits for nothing on the device (gpu-marked: run through the device tool). The engine
overlaps its host work with the GPU by queuing step n + 1 while step n runs; one blocking copy or read in the
sampler or the runner's launch makes the host wait for the GPU instead. These tests run them under
``torch.cuda.set_sync_debug_mode("error")``, which raises on every synchronizing call PyTorch makes."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from llmc.engine.torch import sampler as sampler_mod
from llmc.engine.torch.sampler import Sampler, _gather_params
from llmc.engine.types import ScheduledSequence
from llmc.request.params import SamplingParams
from tests.engine.torch.helpers import MiniScheduler, make_build_dir
from tests.engine.torch.test_gpu import random_llama
from tests.engine.torch.test_sampler import seq
from tests.engine.torch.test_sampler_shaping_gpu import allowed_ids, mask_of

pytestmark = pytest.mark.gpu

KINDS = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=0.8),
    "top_k": SamplingParams(temperature=0.8, top_k=5),
    "top_p": SamplingParams(temperature=0.8, top_p=0.9),
    "top_k_top_p": SamplingParams(temperature=0.8, top_k=20, top_p=0.5),
    "min_p_seeded": SamplingParams(temperature=0.7, min_p=0.1, seed=3),
    "penalties": SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2),
    "bias_min_tokens": SamplingParams(temperature=0.9, logit_bias={"7": 3.0}, min_tokens=4, stop_token_ids=(2,)),
    "format": SamplingParams(temperature=0.0, structured={"type": "json_object"}),
    "format_sampled": SamplingParams(temperature=0.8, top_p=0.95, structured={"type": "json_object"}),
    "logprobs": SamplingParams(temperature=0.6, top_p=0.8, logprobs=3),
}


@contextlib.contextmanager
def no_host_sync():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_the_guard_raises_on_the_syncs_it_must_catch():
    """Not vacuous: the guard catches a blocking upload (what a scalar made on the device is) and a read back."""
    x = torch.ones(4, device="cuda")
    for sync in (lambda: torch.tensor(float("-inf"), device="cuda"), lambda: bool((x > 0).all()),
                 lambda: torch.arange(3).to("cuda")):
        with pytest.raises(RuntimeError), no_host_sync():
            sync()
    with no_host_sync():
        torch.arange(3).to("cuda", non_blocking=True)  # a pageable upload that does not wait


def seqs_of(kinds: list[str], vocab: int) -> list[ScheduledSequence]:
    out = []
    for i, kind in enumerate(kinds):
        params = KINDS[kind]
        rid = f"{kind}:{i}"
        mask = mask_of(allowed_ids(rid, 0, vocab), vocab) if params.structured is not None else None
        out.append(ScheduledSequence(request_id=rid, token_ids=(0,), num_computed=4, block_ids=(0,),
                                     sample=True, params=params, prompt_token_ids=(3, 4, 5, 7),
                                     output_token_ids=(9, 2), token_mask=mask))
    return out


@pytest.mark.parametrize("kinds", [["top_p"] * 4, list(KINDS), ["top_k_top_p", "greedy", "top_k"],
                                   ["format", "greedy", "format"], ["format_sampled", "temperature"]])
def test_the_sampler_on_cuda_waits_for_nothing(kinds):
    vocab = 50_000  # past the CPU's top-p window
    logits = torch.randn(len(kinds), vocab, generator=torch.Generator().manual_seed(0)).mul_(4).cuda()
    seqs = seqs_of(kinds, vocab)
    sampler = Sampler("cuda", eos_token_ids=(2,), seed=0)
    first = sampler(logits, seqs)  # compiles and caches outside the guard
    with no_host_sync():
        ids = sampler(logits, seqs)
    assert ids.shape == first.shape == (len(kinds),)
    for s, token in zip(seqs, ids.tolist()):
        assert 0 <= token < vocab
        if s.token_mask is not None:
            assert token in allowed_ids(s.request_id, 0, vocab)


@pytest.mark.parametrize("scale", [6.0, 0.05])  # peaked rows (the CPU's window holds the nucleus) and flat ones
def test_cuda_top_p_cuts_where_the_cpu_cuts(scale, monkeypatch):
    """CUDA finds each row's cut without sorting (llmc.engine.torch.top_p_cut) and reads nothing back: the same
    tokens kept as on the CPU (its window of 1,024 values for peaked rows, a full sort for flat ones)."""
    from llmc.engine.torch import top_p_cut

    calls, real = [], top_p_cut.top_p_filter
    monkeypatch.setattr(top_p_cut, "top_p_filter", lambda *a: calls.append(1) or real(*a))
    logits = torch.randn(5, 49152, generator=torch.Generator().manual_seed(1)) * scale
    scaled = logits - logits.amax(dim=-1, keepdim=True)
    seqs = [seq(SamplingParams(temperature=1.0, top_p=p), rid=str(p)) for p in (0.5, 0.8, 0.9, 0.95, 0.99)]
    cpu = sampler_mod._filter(scaled, _gather_params(seqs, torch.device("cpu")))
    on_device = scaled.cuda()
    sampler_mod._filter(on_device, _gather_params(seqs, torch.device("cuda")))  # compiles outside the guard
    with no_host_sync():
        cuda = sampler_mod._filter(on_device, _gather_params(seqs, torch.device("cuda")))
    assert calls == [1, 1] and torch.equal(torch.isfinite(cuda).cpu(), torch.isfinite(cpu))
    assert torch.equal(cuda.cpu()[torch.isfinite(cpu)], cpu[torch.isfinite(cpu)])


@pytest.mark.parametrize("graphs", [True, False])
def test_runner_launch_on_cuda_waits_for_nothing(tmp_path, graphs):
    """Prompt chunks, decode steps (captured graphs or eager) and every sampling kind at once, late masks too: the
    runner's launch queues each step without waiting; the ids are read after it, as the engine does."""
    from llmc.engine.torch.runner import TorchModelRunner

    build = make_build_dir(random_llama(tmp_path), tmp_path / "build", dtype="float32", tokens_per_block=16)
    runner = TorchModelRunner(build, device="cuda", num_blocks=128, cuda_graphs=graphs)
    kinds = list(KINDS) + ["prompt_logprobs"]
    vocab = runner.vocab_size
    for round_ in range(2):  # the first round compiles and captures outside the guard
        sched = MiniScheduler(runner.block_size, runner.num_blocks, chunk=16)
        for i, kind in enumerate(kinds):
            sched.add(kind, list(range(100 + 7 * i, 120 + 9 * i)), max_new=5)
        for step in range(12):
            plan = sched.schedule(step)
            seqs = tuple(dataclasses.replace(
                s, params=KINDS.get(s.request_id, SamplingParams(temperature=0.0, prompt_logprobs=2)),
                token_mask=mask_of(allowed_ids(s.request_id, step, vocab), vocab)
                if s.request_id.startswith("format") and s.sample else None) for s in plan.sequences)
            full = dataclasses.replace(plan, sequences=seqs)
            late = dataclasses.replace(full, sequences=tuple(dataclasses.replace(s, token_mask=None) for s in seqs))
            with no_host_sync() if round_ else contextlib.nullcontext():
                pending = runner.launch(late, None, masks=lambda full=full: full)
            out = pending.result()
            for s in seqs:
                if s.token_mask is not None:
                    assert out.sampled_token_ids[s.request_id] in allowed_ids(s.request_id, step, vocab)
            sched.update(out.sampled_token_ids)
        assert all(len(r["out"]) == 5 for r in sched.reqs.values())


@pytest.mark.parametrize("graphs", [True, False])
def test_drafted_steps_on_cuda_wait_for_nothing(tmp_path, graphs):
    """Steps with draft tokens to verify (prompt lookup; greedy and seeded sampled rows with log-probabilities)."""
    from llmc.engine.torch.runner import TorchModelRunner
    from tests.engine.torch.test_speculate_gpu import _generate

    build = make_build_dir(random_llama(tmp_path), tmp_path / "build", dtype="float32", tokens_per_block=16)
    runner = TorchModelRunner(build, device="cuda", num_blocks=64, cuda_graphs=graphs)
    first, _ = _generate(runner, speculate=True)  # compiles and captures outside the guard
    launch, guarded = runner.launch, []

    def launch_guarded(*args, **kwargs):
        with no_host_sync():
            guarded.append(1)
            return launch(*args, **kwargs)

    runner.launch = launch_guarded
    again, sched = _generate(runner, speculate=True)
    assert again == first and len(guarded) > 10 and sched.drafted_tokens_total > 0
