"""Workloads: seeded length distributions within bounds, exact-length synthetic prompts, prompt files, plans."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings, strategies as st

from llmc.bench.workload import (BenchPrompt, LengthDist, Workload, bench_params, file_workload, plan_levels,
                                 prompt_length_summary, synthetic_workload)
from llmc.errors import RequestError
from llmc.runtime.params import SamplingParams


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["fixed", "uniform", "normal"]), mean=st.integers(1, 4000),
       spread=st.floats(0, 0.95), seed=st.integers(0, 2**32))
def test_length_dist_is_seeded_and_within_bounds(kind, mean, spread, seed):
    dist = LengthDist(kind, mean, spread)
    lo, hi = dist.bounds()
    a = dist.sample(random.Random(seed), 50)
    assert a == dist.sample(random.Random(seed), 50)
    assert all(lo <= n <= hi for n in a) and lo >= 1
    if kind == "fixed":
        assert set(a) == {mean}


def test_uniform_and_normal_spread_over_the_range():
    rng = random.Random(0)
    uniform = LengthDist("uniform", 100, 0.5).sample(rng, 2000)
    normal = LengthDist("normal", 100, 0.5).sample(rng, 2000)
    assert min(uniform) == 50 and max(uniform) == 150
    assert abs(sum(uniform) / len(uniform) - 100) < 3
    assert abs(sum(normal) / len(normal) - 100) < 3
    # N(100, 25^2): about 68 % within one sigma, clearly more concentrated than the uniform.
    within = sum(75 <= n <= 125 for n in normal) / len(normal)
    assert 0.6 < within < 0.76


@pytest.mark.parametrize("bad", [dict(kind="poisson", mean=10), dict(kind="fixed", mean=0),
                                 dict(kind="uniform", mean=10, spread=1.0)])
def test_length_dist_rejects_bad_values(bad):
    with pytest.raises(RequestError):
        LengthDist(**bad)


def test_synthetic_prompts_have_exact_lengths_and_reencode(tokenizer, corpus):
    w = synthetic_workload(tokenizer, LengthDist("uniform", 64, 0.5), LengthDist("fixed", 7), 12, seed=3,
                           corpus=corpus)
    expected = LengthDist("uniform", 64, 0.5).sample(random.Random(3), 12)
    assert [p.prompt_tokens for p in w.prompts] == expected
    for p in w.prompts:
        assert tuple(tokenizer(p.text, add_special_tokens=False)["input_ids"]) == p.token_ids
        assert p.max_new_tokens == 7
    again = synthetic_workload(tokenizer, LengthDist("uniform", 64, 0.5), LengthDist("fixed", 7), 12, seed=3,
                               corpus=corpus)
    assert again == w
    other = synthetic_workload(tokenizer, LengthDist("uniform", 64, 0.5), LengthDist("fixed", 7), 12, seed=4,
                               corpus=corpus)
    assert [p.text for p in other.prompts] != [p.text for p in w.prompts]
    assert w.description["isl"] == {"dist": "uniform", "mean": 64, "spread": 0.5, "min": 32, "max": 96}


def test_prompt_files(tmp_path, tokenizer):
    txt = tmp_path / "p.txt"
    txt.write_text("hello world\n\nsecond prompt here\n")
    w = file_workload(txt, tokenizer, default_max_tokens=5)
    assert [p.text for p in w.prompts] == ["hello world", "second prompt here"]
    assert [p.max_new_tokens for p in w.prompts] == [5, 5]
    assert w.prompts[0].token_ids == tuple(tokenizer("hello world", add_special_tokens=False)["input_ids"])

    jsonl = tmp_path / "p.jsonl"
    messages = [{"role": "user", "content": "Hi there"}]
    jsonl.write_text(json.dumps({"prompt": "abc", "max_tokens": 3}) + "\n" + json.dumps({"messages": messages}) + "\n")
    w = file_workload(jsonl, tokenizer, default_max_tokens=9)
    assert [p.max_new_tokens for p in w.prompts] == [3, 9]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert w.prompts[1].text == rendered and "<|im_start|>user" in rendered
    assert w.prompts[1].token_ids == tuple(tokenizer(rendered, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("line", ['{"max_tokens": 3}', '{"prompt": "a", "messages": []}', "not json",
                                  '{"prompt": "a", "max_tokens": 0}', '{"prompt": ""}'])
def test_bad_jsonl_lines_are_request_errors(tmp_path, tokenizer, line):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(RequestError) as info:
        file_workload(path, tokenizer, 4)
    assert "bad.jsonl:1" in str(info.value) or "JSON" in str(info.value)


def test_missing_prompt_file(tmp_path, tokenizer):
    with pytest.raises(RequestError, match="does not exist"):
        file_workload(tmp_path / "nope.txt", tokenizer, 4)


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


def test_prompt_length_summary_buckets():
    prompts = [BenchPrompt("", (0,) * n, 2) for n in (1, 128, 129, 512, 513)]
    summary = prompt_length_summary(prompts)
    assert summary["by_bucket"] == {"<=128": 2, "129-512": 2, ">512": 1}
    assert summary["prompt_tokens"]["min"] == 1 and summary["prompt_tokens"]["max"] == 513


def test_bench_params_enforce_the_output_length():
    p = bench_params(SamplingParams(temperature=0.0, min_tokens=2), 17)
    assert p.max_new_tokens == 17 and p.ignore_eos and p.temperature == 0.0 and p.min_tokens == 0
