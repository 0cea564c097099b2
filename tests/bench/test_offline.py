"""Offline bench on the tiny build (and the transformers baseline on its source): consistent counts."""

from __future__ import annotations


import pytest

from llmc.bench.baseline import HFBaseline, resolve_hf_dir
from llmc.bench.offline import run_offline
from llmc.bench.plan import BenchPlan, plan_levels
from llmc.bench.workload import LengthDist, synthetic_workload
from llmc.request.params import SamplingParams
from llmc.runtime.api import Engine
from llmc.runtime.compute import on_compute_thread

OSL = 6


@pytest.fixture(scope="module")
def plan(tokenizer, corpus):
    workload = synthetic_workload(tokenizer, LengthDist("uniform", 24, 0.5), LengthDist("fixed", OSL), 1 + 6 + 6,
                                  seed=1, corpus=corpus)
    return plan_levels(workload, [1, 4], per_level=6, warmup=1)


def test_offline_levels_count_every_token(bench_build_dir, plan, tmp_path):
    step_log = tmp_path / "steps.jsonl"
    engine = Engine.from_dir(bench_build_dir, device="cpu", metrics_log=step_log)
    try:
        levels, baseline_levels = run_offline(engine, plan, SamplingParams(temperature=0.0), step_log)
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert baseline_levels is None and [lv.concurrency for lv in levels] == [1, 4]
    assert [len(lv.records) for lv in levels] == [6, 6]
    for lv in levels:
        prompts = plan.prompts_of(lv.concurrency)
        assert sum(r.generated_tokens for r in lv.records) == len(prompts) * OSL
        assert sorted(r.prompt_tokens for r in lv.records) == sorted(p.prompt_tokens for p in prompts)
        for r in lv.records:
            assert len(r.token_times) == OSL and r.finish_reason == "length"
            assert 0 < r.ttft <= r.e2e and len(r.itls) == OSL - 1 and min(r.itls) >= 0
        assert lv.wall_s >= max(r.e2e for r in lv.records) * 0.99
        assert lv.memory["kv_blocks_used_peak"] >= 1 and lv.memory["rss_peak_mb"] > 0
        assert lv.steps["count"] >= OSL and lv.steps["decode_tokens"] == len(prompts) * (OSL - 1)
        # reuse is on in this build, but distinct synthetic prompts have no cached prefix to reuse
        assert engine.block_manager.enable_prefix_caching
        assert lv.prefix_cache == {"queried_tokens": sum(p.prompt_tokens for p in prompts), "hit_tokens": 0}
    assert levels[0].memory["max_running"] <= 1 and levels[1].steps["max_running"] > 1
    assert stats["kv_blocks_used"] == 0 and stats["running"] == 0  # every block returned


def test_kv_peak_comes_from_the_step_log_when_the_monitor_misses_every_request(bench_build_dir, plan, tmp_path,
                                                                               monkeypatch):
    """CI once read a KV peak of 0 blocks: the tiny model's requests started and finished between two samples
    of the 20 ms monitor. The step log counts every step, so the peak cannot miss them."""
    from llmc.bench import offline

    monkeypatch.setattr(offline, "_engine_load", lambda engine: {"kv_blocks_used": 0, "running": 0, "waiting": 0})
    step_log = tmp_path / "steps.jsonl"
    engine = Engine.from_dir(bench_build_dir, device="cpu", metrics_log=step_log)
    try:
        levels, _ = run_offline(engine, plan, SamplingParams(temperature=0.0), step_log)
    finally:
        engine.shutdown()
    for lv in levels:
        assert lv.memory["kv_blocks_used_peak"] == lv.steps["max_kv_blocks_used"] >= 1
        assert lv.memory["max_running"] == lv.steps["max_running"] >= 1


def test_hf_baseline_counts_and_batches(bench_build_dir, plan, tiny_hf_dir):
    assert resolve_hf_dir(bench_build_dir) == tiny_hf_dir
    baseline = HFBaseline(tiny_hf_dir, device="cpu")
    small = BenchPlan(plan.warmup, ((1, plan.prompts_of(1)[:2]), (4, plan.prompts_of(4)[:4])))
    levels = baseline.run(small, SamplingParams(temperature=0.0))
    # Measured on the process's compute thread, where llmc's engine runs its steps too.
    assert baseline._in_worker(on_compute_thread)
    plan = small
    for lv in levels:
        assert sum(r.generated_tokens for r in lv.records) == len(plan.prompts_of(lv.concurrency)) * OSL
        assert all(len(r.itls) == OSL - 1 and r.ttft > 0 for r in lv.records)
    # Concurrency 4 runs static batches: the four requests of one batch share their start and token times.
    batch = levels[1].records[:4]
    assert len({r.start for r in batch}) == 1 and len({r.token_times for r in batch}) == 1
    assert baseline.describe()["dtype"] == "float32" and baseline.describe()["prefix_caching"] is False
    assert all(lv.prefix_cache == {"hit_tokens": 0} for lv in levels)


def test_steps_are_summarized_by_kind():
    from llmc.bench.offline import summarize_steps
    from llmc.bench.report import steps_line

    def step(t, duration, decode, prompt):
        return {"type": "step", "time": t, "duration_s": duration, "decode_tokens": decode, "prefill_tokens": prompt,
                "scheduled_tokens": decode + prompt, "running": 4, "waiting": 0, "kv_blocks_used": 9}

    records = [step(0.0, 0.100, 0, 2048), step(0.1, 0.004, 4, 0), step(0.2, 0.006, 4, 0), step(0.3, 0.050, 3, 1021),
               step(0.4, 0.070, 2, 1022), step(0.5, 0.002, 0, 0), step(9.0, 1.0, 4, 0),  # outside [t0, t1]
               {"type": "request", "time": 0.25}]
    kinds = summarize_steps(records, 0.0, 1.0)["by_kind"]
    assert list(kinds) == ["decode", "mixed", "prompt"]  # the empty step is in no kind
    assert kinds["decode"]["count"] == 2 and kinds["decode"]["mean_s"] == pytest.approx(0.005)
    assert kinds["mixed"]["count"] == 2 and kinds["mixed"]["total_s"] == pytest.approx(0.120)
    assert kinds["mixed"]["mean_decode_tokens"] == 2.5 and kinds["mixed"]["mean_prompt_tokens"] == 1021.5
    assert kinds["prompt"] == {"count": 1, "total_s": 0.1, "mean_s": 0.1, "p50_s": 0.1, "p95_s": 0.1, "p99_s": 0.1,
                               "mean_decode_tokens": 0.0, "mean_prompt_tokens": 2048.0}
    assert steps_line(kinds) == ("decode 2 x 5.0 ms (p50 5.0, 4 decodes), mixed 2 x 60.0 ms (p50 60.0, 2 decodes, "
                                 "1022 prompt tokens), prompt 1 x 100.0 ms (p50 100.0, 2048 prompt tokens)")
