"""Engine end to end on CPU: continuous batching equals transformers greedy (staggered arrivals, chunked
prefill, forced preemption), abort, streaming, threads, asyncio, step-loop failures, metrics. Tiny random
Llama builds, plus the embedded SmolLM2 (slow). Per-request options and input checks: test_api_requests.py."""

from __future__ import annotations

import asyncio
import json
import random
import threading

import pytest

from llmc.errors import EngineError, RequestError
from llmc.request.params import SamplingParams
from tests.runtime.engine_helpers import GREEDY, assert_all_blocks_free, hf_greedy, make_engine

def random_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths]


def run_staggered(engine, prompts, params, arrive_every: int = 2) -> dict[int, list[int]]:
    """Add prompt i at step i * arrive_every and step until every request finished; token ids by index."""
    ids, tokens, finished, step = {}, {}, set(), 0
    while len(finished) < len(prompts):
        i = step // arrive_every
        if step % arrive_every == 0 and i < len(prompts):
            ids[engine.add_request(prompts[i], params)] = i
        for event in engine.step():
            tokens.setdefault(ids[event.request_id], []).extend(event.token_ids)
            if event.finished:
                finished.add(event.request_id)
        step += 1
    return tokens


# ------------------------------------------------------------------------------------ greedy equivalence
@pytest.mark.parametrize("overlap", [False, True])
def test_staggered_mixed_batch_equals_single_request_transformers_greedy(tiny_build_dir, tiny_hf_dir, overlap):
    engine = make_engine(tiny_build_dir, overlap=overlap)
    prompts = random_prompts(0, [5, 70, 1, 33, 100, 17])  # 70 and 100 are prefilled in chunks of <= 32
    got = run_staggered(engine, prompts, GREEDY)
    for i, prompt in enumerate(prompts):
        assert got[i] == hf_greedy(tiny_hf_dir, prompt, GREEDY.max_new_tokens), f"prompt {i}"
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("overlap", [False, True])
def test_tiny_cache_forces_preemption_and_outputs_stay_exact(tiny_build_dir, tiny_hf_dir, overlap):
    engine = make_engine(tiny_build_dir, num_blocks=12, overlap=overlap)  # 96 slots for 4 requests of ~50 tokens
    prompts = random_prompts(1, [30, 38, 25, 40])
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    got = run_staggered(engine, prompts, params, arrive_every=1)
    assert engine.stats()["preemptions"] > 0
    for i, prompt in enumerate(prompts):
        assert got[i] == hf_greedy(tiny_hf_dir, prompt, params.max_new_tokens), f"prompt {i}"
    assert_all_blocks_free(engine)


def test_shared_prefix_reuses_blocks_and_outputs_stay_exact(tiny_build_dir, tiny_hf_dir):
    engine = make_engine(tiny_build_dir)
    (prefix,) = random_prompts(2, [40])
    prompts = [prefix + tail for tail in random_prompts(3, [3, 9, 1])]
    first = engine.generate(prompts[0], GREEDY)[0]
    assert engine.block_manager.num_cached_blocks > 0
    rest = engine.generate(prompts[1:], GREEDY)
    for prompt, completion in zip(prompts, [first, *rest]):
        assert list(completion.token_ids) == hf_greedy(tiny_hf_dir, prompt, GREEDY.max_new_tokens)
    assert_all_blocks_free(engine)


@pytest.mark.slow
def test_smollm2_continuous_batching_equals_transformers_greedy(smollm2_build_dir, smollm2_hf_dir):
    engine = make_engine(smollm2_build_dir)
    tok = engine.tokenizer
    texts = ["The capital of France is a city called", "def fibonacci(n):\n    if n < 2:\n        return",
             "Write a haiku about the sea and the gulls"]  # 8, 15 and 11 tokens
    prompts = [tok(t)["input_ids"] for t in texts]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    expected = [hf_greedy(smollm2_hf_dir, p, params.max_new_tokens) for p in prompts]
    assert run_staggered(engine, prompts, params) == dict(enumerate(expected))
    # 3 blocks of 16 tokens: all three prompts are admitted, then the 15-token one needs a second block.
    small = make_engine(smollm2_build_dir, num_blocks=3)
    assert run_staggered(small, prompts, params, arrive_every=1) == dict(enumerate(expected))
    assert small.stats()["preemptions"] > 0
    assert_all_blocks_free(engine)
    assert_all_blocks_free(small)


# ------------------------------------------------------------------------------------------ streaming
def test_stream_deltas_concatenate_to_generate_text_and_decode(tiny_build_dir):
    engine = make_engine(tiny_build_dir)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    events = list(engine.stream("Once upon a time", params))
    assert events[-1].finished and events[-1].finish_reason == "length"
    assert all(not e.finished for e in events[:-1])
    text = "".join(e.text for e in events)
    ids = [t for e in events for t in e.token_ids]
    (completion,) = engine.generate(["Once upon a time"], params)
    assert completion.text == text and list(completion.token_ids) == ids and len(ids) == 24
    assert text == engine.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_mid_stream_frees_blocks(tiny_build_dir, overlap):
    engine = make_engine(tiny_build_dir, overlap=overlap)
    params = SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True)
    rid = engine.add_request("Tell me a long story", params)
    other = engine.add_request("Another request", params)
    for _ in range(4):
        engine.step()
    assert engine.stats()["kv_blocks_used"] > 0
    assert engine.abort(rid)
    assert not engine.abort(rid)
    assert engine.scheduler.get(rid) is None
    engine.abort(other)
    assert_all_blocks_free(engine)


def test_closing_a_stream_early_aborts_its_request(tiny_build_dir):
    engine = make_engine(tiny_build_dir)
    stream = engine.stream("Hello", SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        next(stream)
    stream.close()
    assert_all_blocks_free(engine)


def test_abort_event_ends_a_background_stream(tiny_build_dir):
    engine = make_engine(tiny_build_dir)
    engine.start()
    try:
        params = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
        events = []
        for event in engine.stream("Count forever", params, request_id="long"):
            events.append(event)
            if len(events) == 3:
                engine.abort("long")
        assert events[-1].finished and events[-1].finish_reason == "abort"
        assert len(events) < 100
    finally:
        engine.shutdown()
    assert_all_blocks_free(engine)


# ------------------------------------------------------------------------------ concurrency, failures
def test_background_loop_serves_concurrent_threads(tiny_build_dir):
    engine = make_engine(tiny_build_dir)
    prompts = [f"Thread number {i} says" for i in range(6)]
    expected = [c.token_ids for c in make_engine(tiny_build_dir).generate(prompts, GREEDY)]
    results: dict[int, tuple] = {}

    def worker(i: int) -> None:
        results[i] = tuple(t for e in engine.stream(prompts[i], GREEDY) for t in e.token_ids)

    engine.start()
    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        engine.shutdown()
    assert [results[i] for i in range(6)] == expected
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("background", [True, False])
def test_astream_serves_concurrent_tasks(tiny_build_dir, background):
    engine = make_engine(tiny_build_dir)
    prompts = ["async one", "async two is longer", "three"]
    expected = [c.token_ids for c in make_engine(tiny_build_dir).generate(prompts, GREEDY)]

    async def collect(prompt: str) -> tuple:
        return tuple([t async for e in engine.astream(prompt, GREEDY) for t in e.token_ids])

    async def main() -> list:
        return list(await asyncio.gather(*(collect(p) for p in prompts)))

    if background:
        engine.start()
    try:
        assert asyncio.run(main()) == expected
    finally:
        engine.shutdown()
    assert_all_blocks_free(engine)


class FailingRunner:
    """Wraps a runner and raises on chosen calls of ``execute``."""

    def __init__(self, runner, fail_on: set[int]):
        self._runner, self._fail_on, self.calls = runner, fail_on, 0
        self.block_size, self.num_blocks, self.vocab_size = runner.block_size, runner.num_blocks, runner.vocab_size

    def execute(self, scheduled):
        self.calls += 1
        if self.calls in self._fail_on:
            raise RuntimeError("simulated device failure")
        return self._runner.execute(scheduled)


def test_overlapped_steps_process_tokens_while_the_next_step_runs(tiny_build_dir):
    """With an asynchronous runner a decode step n + 1 is planned and launched before step n's tokens are waited
    for (its decode tokens are placeholders the runner fills from step n), and step n's tokens become events while
    step n + 1 runs. A request at its length limit is not planned again. Outputs equal the serial engine's, stop
    strings included (a request they end computes one discarded row)."""
    serial, engine = make_engine(tiny_build_dir), make_engine(tiny_build_dir, overlap=True)
    assert engine.overlapped_steps and not serial.overlapped_steps
    runner = engine.runner
    params = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    engine.add_request("Once upon a time", params, request_id="r", sink=lambda e: runner.log.append(("event", e)))
    while engine.scheduler.has_unfinished():
        engine.step()
    launches = [step for kind, step in runner.log if kind == "launch"]
    events = [(i, item) for i, (kind, item) in enumerate(runner.log) if kind == "event"]
    assert len(events) == 5 and events[-1][1].finished and len(launches) == 5  # no step after the last token
    for k, (position, event) in enumerate(events[:-1]):
        # token k was sampled by step launches[k]; its event follows the launch of the next step, which came
        # before the engine waited for step launches[k] at all, except after the prefill (the plan then waits
        # for it, so that requests that arrived while it ran join the next step)
        launched_next = runner.log.index(("launch", launches[k + 1]))
        waited = runner.log.index(("result", launches[k]))
        assert (waited < launched_next if k == 0 else launched_next < waited < position), k
    last_launch = runner.log.index(("launch", launches[-1]))
    assert events[-1][0] > last_launch and ("launch", launches[-1] + 1) not in runner.log
    assert_all_blocks_free(engine)
    # Same completions as the serial engine, also when a stop string (known only from the text) ends them.
    stops = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True, stop=[" Hmm", " upl", "SESE"])
    for p in (params, stops, SamplingParams(max_new_tokens=16, temperature=0.8, seed=3)):
        prompts = ["Once upon a time", "The capital of", "1, 2, 3,"]  # the tiny model's greedy texts hit the stops
        got, want = engine.generate(prompts, p), serial.generate(prompts, p)
        assert [(c.text, c.token_ids, c.finish_reason) for c in got] == \
            [(c.text, c.token_ids, c.finish_reason) for c in want]
        if p is stops:
            assert [c.finish_reason for c in got] == ["stop"] * 3
        assert_all_blocks_free(engine)
        # idle: every launched step was waited for (also the last one, whose rows all belonged to finished requests)
        kinds = [entry[0] for entry in runner.log]
        assert kinds.count("launch") == kinds.count("result")


def test_a_request_that_arrives_while_a_prefill_runs_joins_the_next_step(tiny_build_dir):
    """Only decode steps are planned past: after a prefill the engine waits for it before planning, so a request
    that arrived while it ran is in the very next step (not one prefill step later)."""
    engine = make_engine(tiny_build_dir, overlap=True)
    runner, launch, steps = engine.runner, engine.runner.launch, []
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)

    def launch_and_watch(scheduled, previous=None):
        pending = launch(scheduled, previous)
        steps.append([s.request_id for s in scheduled.sequences])
        if len(steps) == 1:  # "b" arrives while the first step (the prefill of "a") runs
            result = pending.result
            pending.result = lambda: engine.add_request("The capital of", params, request_id="b") and result()
        return pending

    runner.launch = launch_and_watch
    engine.add_request("Once upon a time", params, request_id="a")
    while engine.scheduler.has_unfinished():
        engine.step()
    assert steps[0] == ["a"] and steps[1] == ["a", "b"]
    assert_all_blocks_free(engine)


def test_steps_a_mixed_budget_keeps_short_are_planned_past(tiny_build_dir):
    """With serving.mixed_step_tokens, a step of decodes plus a prompt chunk within the budget is planned past like a
    decode step (the next one is launched before its tokens are waited for); outputs equal the serial engine's
    under the same budget."""
    serial = make_engine(tiny_build_dir, mixed_step_tokens=6)
    engine = make_engine(tiny_build_dir, overlap=True, mixed_step_tokens=6)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    runs = []
    for eng in (serial, engine):
        shapes, done = [], {}

        def record(events):
            for event in events:
                done.setdefault(event.request_id, []).extend(event.token_ids)

        if eng is engine:
            def watch(scheduled, previous=None, launch=engine.runner.launch):
                shapes.append((scheduled.step, scheduled.num_tokens, len(scheduled.sequences)))
                return launch(scheduled, previous)
            engine.runner.launch = watch
        eng.add_request("Once upon a time", params, request_id="a")
        record(eng.step())  # a's prefill alone: b arrives after it, while a decodes
        eng.add_request("The capital of France is a city where people walk along the river", params,
                        request_id="b")
        while eng.scheduler.has_unfinished():
            record(eng.step())
        runs.append(done)
    mixed = [step for step, tokens, seqs in shapes if seqs == 2 and 2 < tokens <= 6]
    assert len(mixed) >= 2, shapes  # b's prompt went through in chunks beside a's decodes
    log = engine.runner.log
    for step in mixed:  # the next step was launched before this one's tokens were waited for
        assert log.index(("launch", step + 1)) < log.index(("result", step)), step
    assert runs[0] == runs[1] and len(runs[0]["a"]) == len(runs[0]["b"]) == 12
    assert_all_blocks_free(engine)


def test_overlapped_steps_wait_for_token_values_while_a_request_uses_penalties(tiny_build_dir):
    """Penalties read the values of earlier tokens, so while such a request runs the engine waits for step n before
    planning step n + 1 (no placeholders); outputs equal the serial engine's."""
    serial, engine = make_engine(tiny_build_dir), make_engine(tiny_build_dir, overlap=True)
    runner = engine.runner
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)
    got, want = engine.generate(["Once upon a time", "1, 2, 3,"], params), serial.generate(
        ["Once upon a time", "1, 2, 3,"], params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    order = [entry for entry in runner.log if entry[0] in ("launch", "result")]
    for (kind, step), (next_kind, next_step) in zip(order, order[1:]):
        if kind == "launch":  # every launched step is waited for before the next launch
            assert (next_kind, next_step) == ("result", step)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("overlap", [False, True])
def test_step_failure_fails_affected_requests_frees_blocks_and_keeps_serving(tiny_build_dir, overlap):
    """The third runner call raises: ``execute`` of the serial engine, ``launch`` of the overlapped one."""
    from llmc.runtime.api import Engine
    from tests.runtime.engine_helpers import LazyStepRunner

    base = make_engine(tiny_build_dir)
    runner = LazyStepRunner(base.runner, fail_on_launch={3}) if overlap else FailingRunner(base.runner, {3})
    engine = Engine(runner, base.tokenizer, base.recipe, base.eos_token_ids)
    engine.start()
    try:
        with pytest.raises(EngineError, match="simulated device failure"):
            list(engine.stream("this one fails", GREEDY))
        assert_all_blocks_free(engine)
        (ok,) = engine.generate(["this one works"], GREEDY)
        assert ok.finish_reason == "length" and len(ok.token_ids) == GREEDY.max_new_tokens
    finally:
        engine.shutdown()


# -------------------------------------------------------------------------------------------- metrics
def test_request_and_step_metrics(tiny_build_dir, tmp_path):
    from llmc.runtime.api import Engine

    base = make_engine(tiny_build_dir)
    log = tmp_path / "metrics.jsonl"
    engine = Engine(base.runner, base.tokenizer, base.recipe, base.eos_token_ids, metrics_log=log)
    (completion,) = engine.generate(["metrics please"], GREEDY)
    # Records are buffered between steps; an engine that goes idle has flushed them (read before shutdown).
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    engine.shutdown()
    m = completion.metrics
    assert m.prompt_tokens == len(engine.tokenizer("metrics please")["input_ids"])
    assert m.generated_tokens == len(completion.token_ids) == len(m.token_times)
    assert m.ttft is not None and m.ttft > 0 and m.queue_time >= 0
    assert len(m.itls) == m.generated_tokens - 1 and all(g >= 0 for g in m.itls)
    assert m.e2e_latency >= m.ttft
    steps = [r for r in lines if r["type"] == "step"]
    assert len(steps) >= GREEDY.max_new_tokens
    assert sum(r["decode_tokens"] for r in steps) == GREEDY.max_new_tokens - 1
    assert sum(r["prefill_tokens"] for r in steps) == m.prompt_tokens
    assert all(r["kv_blocks_used"] + r["kv_blocks_free"] == engine.block_manager.num_blocks for r in steps)
    (request,) = [r for r in lines if r["type"] == "request"]
    assert request["request_id"] == completion.request_id and request["ttft"] == pytest.approx(m.ttft)


@pytest.mark.parametrize("prefix_caching", [None, True, False])
def test_prefix_caching_override_and_hit_counters(tiny_build_dir, prefix_caching):
    from llmc.runtime.api import Engine

    base = make_engine(tiny_build_dir)
    engine = Engine(base.runner, base.tokenizer, base.recipe, base.eos_token_ids, prefix_caching=prefix_caching)
    enabled = base.recipe.serving.enable_kv_cache_reuse if prefix_caching is None else prefix_caching
    assert engine.block_manager.enable_prefix_caching is enabled
    (prompt,) = random_prompts(4, [40])  # five full blocks of 8 tokens
    engine.generate([prompt], GREEDY)
    engine.generate([prompt], GREEDY)
    stats = engine.stats()
    assert stats["prefix_cache_queried_tokens"] == 2 * len(prompt)
    assert stats["prefix_cache_hit_tokens"] == (32 if enabled else 0)  # never the block of the last token


def test_prefix_caching_override_is_refused_for_a_tensorrt_llm_build(tiny_build_dir, tmp_path):
    from llmc.runtime.api import Engine

    manifest = json.loads((tiny_build_dir / "manifest.json").read_text())
    manifest["backend"] = manifest["recipe"]["backend"] = "tensorrt_llm"
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RequestError, match="serving.enable_kv_cache_reuse"):
        Engine.from_dir(tmp_path, prefix_caching=False)
