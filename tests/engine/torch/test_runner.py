"""TorchModelRunner: continuous-batching steps over the paged cache give transformers' greedy outputs."""

from __future__ import annotations

import pytest
import torch

from llmc.engine.base import load_runner
from llmc.engine.torch.runner import TorchModelRunner
from llmc.engine.types import ScheduledSequence, SchedulerOutput
from llmc.errors import EngineError
from tests.engine.torch.helpers import GREEDY, MiniScheduler, make_build_dir


@pytest.fixture(scope="module")
def build_dir(tiny_hf_dir, tmp_path_factory):
    return make_build_dir(tiny_hf_dir, tmp_path_factory.mktemp("build") / "tiny", tokens_per_block=8)


def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                            pad_token_id=2, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_greedy_outputs_equal_transformers_with_staggered_arrivals(build_dir, tiny_hf_model):
    runner = TorchModelRunner(build_dir, device="cpu")
    runner.warmup()
    prompts = {"a": list(range(100, 123)), "b": list(range(500, 505)), "c": list(range(900, 917))}
    arrivals = {0: ["a"], 2: ["b"], 5: ["c"]}
    sched = MiniScheduler(runner.block_size, runner.num_blocks, chunk=9)  # 23 tokens -> 3 prefill chunks
    for step in range(40):
        for rid in arrivals.get(step, []):
            sched.add(rid, prompts[rid], max_new=10)
        out = runner.execute(sched.schedule(step))
        sched.update(out.sampled_token_ids)
    for rid, prompt in prompts.items():
        assert sched.reqs[rid]["out"] == hf_greedy(tiny_hf_model, prompt, 10), rid


def test_warmup_builds_prompt_attention_plans_up_to_the_longest_prompt_chunk(build_dir, monkeypatch):
    from llmc.engine.torch import attention
    from llmc.manifest import read_manifest

    seen = []
    monkeypatch.setattr(attention, "warm_prompt_buckets", lambda *args: seen.append(args) or [])
    runner = TorchModelRunner(build_dir, device="cpu")
    runner.warmup()
    engine = read_manifest(build_dir).recipe_obj().engine
    cfg = runner.model.config
    assert seen == [(cfg.num_heads, cfg.num_kv_heads, cfg.head_size, getattr(torch, cfg.dtype), torch.device("cpu"),
                     min(engine.max_input_len, engine.max_num_tokens))]


def test_cuda_warmup_runs_a_prompt_chunk_over_a_cached_context(build_dir, monkeypatch):
    """On CUDA the warm-up's long prompt ends with a chunk over the cached rest, so the paged prefill kernel is
    compiled before serving (most likely what stalled a bf16 run at concurrency 8 for 1.1 s, 2026-12-03). The
    steps are recorded, not run: the device is CUDA in name only."""
    from types import SimpleNamespace

    from llmc.engine.torch import attention
    from llmc.engine.torch.runner import WARMUP_CONTINUATION, WARMUP_LONG_PROMPT, WARMUP_REQUEST_ID, WARMUP_TOP_P

    runner = TorchModelRunner(build_dir, device="cpu")
    monkeypatch.setattr(attention, "warm_prompt_buckets", lambda *args: [])
    steps = []

    def record(out):
        steps.append(out.sequences)
        return SimpleNamespace(sampled_token_ids={WARMUP_REQUEST_ID: 7})

    monkeypatch.setattr(runner, "execute", record)
    monkeypatch.setattr(runner, "device", torch.device("cuda"))
    runner.warmup()
    seqs = [step[0] for step in steps]
    long = min(WARMUP_LONG_PROMPT, runner.max_prompt_chunk, runner.num_blocks * runner.block_size - 1)
    cut = long - WARMUP_CONTINUATION
    assert [(s.num_computed, len(s.token_ids), s.sample) for s in seqs[1:]] == [
        (0, cut, False), (cut, WARMUP_CONTINUATION, True), (long, 1, True), (long, 1, True), (long, 1, True)]
    assert seqs[-3].token_mask is None  # then the decode again under a mask that allows every id
    assert (seqs[-2].token_mask == -1).all() and 32 * len(seqs[-2].token_mask) - runner.vocab_size in range(32)
    assert seqs[-1].params == WARMUP_TOP_P and seqs[-1].token_mask is None  # and sampled with top-p alone
    assert WARMUP_TOP_P.top_p < 1 and WARMUP_TOP_P.top_k == 0 and not WARMUP_TOP_P.greedy
    assert seqs[0].num_computed == 0 and seqs[0].sample  # the short prompt, whole
    assert all(s.prompt_token_ids == seqs[-1].prompt_token_ids for s in seqs[1:])
    monkeypatch.setattr(runner, "device", torch.device("cpu"))  # CPU: no long prompt, no continuation
    steps.clear()
    runner.warmup()
    assert [(s[0].num_computed, s[0].sample) for s in steps] == [(0, True), (len(steps[0][0].token_ids), True)]


def test_the_warm_up_decode_under_an_all_allowing_mask_chooses_the_unmasked_token(build_dir):
    """``warm_masks`` (run by the CUDA warm-up, so the sampler's masked greedy kernel is compiled before serving)
    repeats a decode under a mask of every id: the same token as without it."""
    runner = TorchModelRunner(build_dir, device="cpu")
    prompt = tuple(range(40, 47))
    first = runner.execute(SchedulerOutput(step=0, sequences=(
        ScheduledSequence("w", prompt, 0, (0,), True, GREEDY, prompt_token_ids=prompt),)))
    token = first.sampled_token_ids["w"]
    decode = ScheduledSequence("w", (token,), len(prompt), (0,), True, GREEDY, prompt_token_ids=prompt,
                               output_token_ids=(token,))
    plain = runner.execute(SchedulerOutput(step=1, sequences=(decode,))).sampled_token_ids
    assert runner.warm_masks(decode).sampled_token_ids == plain


def test_kv_budget_and_sizes_follow_the_recipe(build_dir, tiny_model):
    runner = TorchModelRunner(build_dir, device="cpu")
    cfg = tiny_model.config
    assert runner.block_size == 8
    assert runner.kv_bytes_per_token == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_size * 4  # float32 on CPU
    assert runner.num_blocks == 4 * 2**20 // (runner.kv_bytes_per_token * 8)  # cpu_budget_mb: 4
    assert runner.vocab_size == 49152 and runner.device == torch.device("cpu")
    assert tuple(runner.kv_caches[0][0].shape) == (runner.num_blocks, 8, cfg.num_kv_heads, cfg.head_size)
    assert TorchModelRunner(build_dir, num_blocks=7).num_blocks == 7


def test_auto_kv_dtype_is_the_checkpoints_also_on_cpu(tiny_hf_dir, tmp_path, monkeypatch):
    """kv_cache.dtype auto = model.dtype (docs/RECIPE.md): a float16 checkpoint computes in float32 on CPU but
    caches K/V in float16, as engine.json's kv_bytes_per_token says; greedy tokens equal a float32 cache's."""
    from llmc.engine.torch import runner as runner_module
    from llmc.engine.torch.compile import read_engine_config

    build = make_build_dir(tiny_hf_dir, tmp_path / "tiny16", dtype="float16", tokens_per_block=8)

    def greedy(runner):
        sched = MiniScheduler(runner.block_size, runner.num_blocks, chunk=6)
        sched.add("a", list(range(100, 117)), max_new=8)
        for step in range(12):
            sched.update(runner.execute(sched.schedule(step)).sampled_token_ids)
        return sched.reqs["a"]["out"]

    runner = TorchModelRunner(build, device="cpu")
    assert runner.kv_caches[0][0].dtype == torch.float16
    assert runner.model.transformer.ln_f.weight.dtype == torch.float32
    assert runner.kv_bytes_per_token == read_engine_config(build / "engine")["kv_bytes_per_token"]
    monkeypatch.setattr(runner_module, "runtime_kv_dtype", lambda *args: (torch.float32, None))
    wide = TorchModelRunner(build, device="cpu")
    assert wide.kv_caches[0][0].dtype == torch.float32
    assert greedy(runner) == greedy(wide)


def test_only_sampling_sequences_return_tokens(build_dir):
    runner = TorchModelRunner(build_dir, num_blocks=8)
    chunk = ScheduledSequence("a", (5, 6, 7), 0, (3,), False, GREEDY)
    last = ScheduledSequence("b", (8, 9), 0, (4,), True, GREEDY)
    out = runner.execute(SchedulerOutput(step=0, sequences=(chunk, last)))
    assert set(out.sampled_token_ids) == {"b"} and 0 <= out.sampled_token_ids["b"] < 49152
    assert runner.execute(SchedulerOutput(step=1, sequences=())).sampled_token_ids == {}


def test_block_outside_the_cache_is_an_engine_error(build_dir):
    runner = TorchModelRunner(build_dir, num_blocks=4)
    bad = ScheduledSequence("a", (5, 6), 0, (4,), True, GREEDY)
    with pytest.raises(EngineError, match="4 blocks"):
        runner.execute(SchedulerOutput(step=0, sequences=(bad,)))


def test_load_runner_dispatches_on_the_manifest_backend(build_dir):
    runner = load_runner(build_dir, device="auto", num_blocks=4)
    assert isinstance(runner, TorchModelRunner) and runner.num_blocks == 4


def test_load_runner_refuses_a_tensorrt_llm_build_with_the_way_to_open_it(build_dir, tmp_path):
    import json
    import shutil

    trt_build = tmp_path / "trt"
    shutil.copytree(build_dir, trt_build)
    manifest = json.loads((trt_build / "manifest.json").read_text())
    (trt_build / "manifest.json").write_text(json.dumps({**manifest, "backend": "tensorrt_llm"}))
    with pytest.raises(EngineError, match="Engine.from_dir"):
        load_runner(trt_build)


def test_a_placeholder_token_is_the_previous_steps_token_on_the_device(build_dir):
    """A step launched before the previous one's tokens reached the host: its placeholder tokens are taken from
    that step's ids on the device (here a mixed step: a decode with a placeholder next to a prefill chunk)."""
    from llmc.engine.types import PLACEHOLDER

    def steps(runner, placeholders: bool):
        first = runner.launch(SchedulerOutput(step=0, sequences=(
            ScheduledSequence("a", (5, 6, 7), 0, (1,), True, GREEDY, prompt_token_ids=(5, 6, 7)),
            ScheduledSequence("b", (8, 9), 0, (2,), True, GREEDY, prompt_token_ids=(8, 9)))))
        known = first.result().sampled_token_ids
        token = {rid: (PLACEHOLDER if placeholders else t) for rid, t in known.items()}
        second = runner.launch(SchedulerOutput(step=1, sequences=(
            ScheduledSequence("c", (3, 4, 5, 6), 0, (3,), True, GREEDY, prompt_token_ids=(3, 4, 5, 6)),
            ScheduledSequence("b", (token["b"],), 2, (2,), True, GREEDY, prompt_token_ids=(8, 9),
                              output_token_ids=(token["b"],)),
            ScheduledSequence("a", (token["a"],), 3, (1,), True, GREEDY, prompt_token_ids=(5, 6, 7),
                              output_token_ids=(token["a"],)))), previous=first)
        return known, second.result().sampled_token_ids

    runner = TorchModelRunner(build_dir, num_blocks=8)
    known, with_values = steps(runner, placeholders=False)
    assert steps(runner, placeholders=True) == (known, with_values)
    orphan = ScheduledSequence("a", (PLACEHOLDER,), 3, (1,), True, GREEDY, output_token_ids=(PLACEHOLDER,))
    with pytest.raises(EngineError, match="placeholder"):
        runner.execute(SchedulerOutput(step=2, sequences=(orphan,)))


def test_late_masks_are_taken_after_the_forward_pass_and_sampled_like_masks_given_with_the_step(build_dir):
    """launch(masks=...): the callback runs once, after the forward pass (the model's call) and before the sampler;
    the sampled tokens are those of the same step with its masks given up front (each in its allowed set); masks
    for other rows than the step's are an engine error; a step that samples nothing still calls it."""
    import dataclasses

    import numpy as np

    from llmc.request.params import SamplingParams

    runner = TorchModelRunner(build_dir, num_blocks=8)
    params = SamplingParams(temperature=0.0, structured={"type": "regex", "pattern": "a"})

    def mask(allowed):
        bits = np.zeros((runner.vocab_size + 31) // 32 * 32, dtype=np.uint8)
        bits[allowed] = 1
        return np.packbits(bits, bitorder="little").view(np.int32)

    plan = SchedulerOutput(step=0, sequences=(
        ScheduledSequence("a", (5, 6, 7), 0, (1,), True, params), ScheduledSequence("b", (8, 9), 0, (2,), True, GREEDY),
        ScheduledSequence("c", (3, 4), 0, (3,), False, GREEDY)))
    allowed = {"a": [17, 300, 4000]}
    masked = dataclasses.replace(plan, sequences=tuple(
        dataclasses.replace(s, token_mask=mask(allowed[s.request_id])) if s.request_id in allowed else s
        for s in plan.sequences))
    up_front = runner.execute(masked).sampled_token_ids
    order: list[str] = []
    forward = runner.model.forward

    def spy(*args, **kwargs):
        order.append("forward")
        return forward(*args, **kwargs)

    runner.model.forward = spy
    try:
        late = runner.launch(plan, None, masks=lambda: order.append("masks") or masked).result().sampled_token_ids
    finally:
        del runner.model.forward
    assert order == ["forward", "masks"] and late == up_front and late["a"] in allowed["a"]
    other = dataclasses.replace(masked, sequences=masked.sequences[1:])
    with pytest.raises(EngineError, match="late output-format masks came back for other rows"):
        runner.launch(plan, None, masks=lambda: other)
    prompt_only = SchedulerOutput(step=1, sequences=(ScheduledSequence("d", (1, 2), 0, (4,), False, GREEDY),))
    calls: list[int] = []
    assert runner.launch(prompt_only, None, masks=lambda: calls.append(1) or prompt_only).result(
        ).sampled_token_ids == {}
    assert calls == [1]
