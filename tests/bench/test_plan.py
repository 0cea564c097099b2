"""Benchmark plans: disjoint prompt slices per level and repetition; benchmark sampling parameters."""

from __future__ import annotations

import pytest

from llmc.bench.plan import bench_params, plan_levels
from llmc.bench.workload import BenchPrompt, Workload
from llmc.request.params import SamplingParams


def _prompts(n: int) -> Workload:
    return Workload(tuple(BenchPrompt(f"p{i}", (i + 1,) * (i + 1), 4) for i in range(n)), {})


def test_plan_gives_levels_disjoint_slices():
    plan = plan_levels(_prompts(1 + 4 + 8), [1, 8], per_level=4, warmup=1)
    assert plan.concurrency == (1, 8)
    assert [p.text for p in plan.warmup] == ["p0"]
    assert [p.text for p in plan.prompts_of(1)] == ["p1", "p2", "p3", "p4"]
    assert len(plan.prompts_of(8)) == 8  # at least the concurrency, so the level is reached
    seen = [p.text for _, ps in plan.levels for p in ps] + [p.text for p in plan.warmup]
    assert len(seen) == len(set(seen))


def test_repetitions_interleave_the_levels_with_fresh_prompts():
    plan = plan_levels(_prompts(1 + 3 * (2 + 4)), [1, 4], per_level=2, warmup=1, repeat=3)
    assert [c for c, _ in plan.levels] == [1, 4, 1, 4, 1, 4]  # each repetition measures every level
    assert plan.concurrency == (1, 4) and plan.repeat == 3
    assert len(plan.prompts_of(1)) == 6 and len(plan.prompts_of(4)) == 12
    seen = [p.text for _, ps in plan.levels for p in ps] + [p.text for p in plan.warmup]
    assert len(seen) == len(set(seen))  # no repetition reuses a prompt (nor its cached prefix)
    with pytest.raises(ValueError, match="repeat"):
        plan_levels(_prompts(4), [1], per_level=1, warmup=0, repeat=0)


def test_plan_cycles_a_short_workload():
    plan = plan_levels(_prompts(2), [3], per_level=3, warmup=0)
    assert [p.text for p in plan.prompts_of(3)] == ["p0", "p1", "p0"]


def test_bench_params_enforce_the_output_length():
    p = bench_params(SamplingParams(temperature=0.0, min_tokens=2), 17)
    assert p.max_new_tokens == 17 and p.ignore_eos and p.temperature == 0.0 and p.min_tokens == 0
