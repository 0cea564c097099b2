"""The report: percentiles and buckets from hand-made records, the JSON schema, ratios and scaling."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmc.bench.records import LevelResult, RequestRecord, closed_loop
from llmc.bench.report import (build_report, itl_by_token_index, prefix_cache_summary, prefix_caching_caption,
                               print_report, summarize_level)
from llmc.bench.plan import BenchPlan
from llmc.bench.workload import BenchPrompt

LEVEL_KEYS = {"concurrency", "num_requests", "wall_s", "prompt_tokens", "generated_tokens", "tgs", "tgs_per_request",
              "requests_per_s", "ttft_s", "ttft_by_bucket_s", "itl_s", "itl_by_token_index_s", "e2e_s",
              "finish_reasons", "ttft_vs_prompt_tokens", "memory", "steps", "conditions", "prefix_cache"}


def record(prompt_tokens: int, ttft: float, gaps: list[float], start: float = 10.0) -> RequestRecord:
    times = [start + ttft]
    for gap in gaps:
        times.append(times[-1] + gap)
    return RequestRecord(prompt_tokens, len(times), start, tuple(times), times[-1] + 0.001, "length")


RECORDS = (record(100, 0.10, [0.01, 0.02, 0.03]), record(128, 0.20, [0.02, 0.02, 0.02]),
           record(129, 0.40, [0.03, 0.01, 0.05]), record(600, 0.90, [0.04, 0.04, 0.04]))
PROMPTS = tuple(BenchPrompt("x", (0,) * r.prompt_tokens, 4) for r in RECORDS)


def level(concurrency: int, wall: float, records=RECORDS) -> LevelResult:
    return LevelResult(concurrency, records, wall, {"rss_peak_mb": 100.0, "kv_blocks_used_peak": 3,
                                                    "kv_blocks_total": 10})


def test_summary_percentiles_and_buckets_match_numpy():
    s = summarize_level(level(2, 2.0), PROMPTS, {"temperature": 0.0})
    ttfts = [0.10, 0.20, 0.40, 0.90]
    for q in (50, 95, 99):
        assert s["ttft_s"][f"p{q}"] == pytest.approx(np.percentile(ttfts, q))
    gaps = [g for r in RECORDS for g in r.itls]
    assert s["itl_s"]["count"] == 12
    assert s["itl_s"]["p95"] == pytest.approx(np.percentile(gaps, 95))
    buckets = s["ttft_by_bucket_s"]
    assert buckets["<=128"]["count"] == 2 and buckets["<=128"]["p50"] == pytest.approx(0.15)
    assert buckets["129-512"]["count"] == 1 and buckets["129-512"]["p50"] == pytest.approx(0.40)
    assert buckets[">512"]["count"] == 1 and buckets[">512"]["p50"] == pytest.approx(0.90)
    assert s["generated_tokens"] == 16 and s["tgs"] == pytest.approx(8.0) and s["requests_per_s"] == 2.0
    assert s["e2e_s"]["p50"] == pytest.approx(np.percentile([r.e2e for r in RECORDS], 50))


def test_itl_by_token_index_is_the_mean_per_index():
    means = itl_by_token_index(level(1, 1.0))
    assert means == pytest.approx([0.025, 0.0225, 0.035])
    short = itl_by_token_index(level(1, 1.0, (record(5, 0.1, [0.01]), record(5, 0.1, [0.03, 0.07]))))
    assert short == pytest.approx([0.02, 0.07])


def test_report_schema_conditions_and_ratios():
    plan = BenchPlan(warmup=(PROMPTS[0],), levels=((1, PROMPTS), (4, PROMPTS)))
    llmc = [level(1, 4.0), level(4, 1.0)]
    hf = [level(1, 8.0), level(4, 5.0)]
    sampling = {"temperature": 0.0, "ignore_eos": True}
    report = build_report({"mode": "offline", "engine_dir": "x", "device": "cpu"}, llmc, plan, sampling, hf,
                          {"name": "hf"}, host_start={"load_average": [0.1, 0.2, 0.3]})
    json.loads(json.dumps(report, allow_nan=False))  # JSON-able
    assert {"schema", "host", "sampling", "osl_enforcement", "prompt_lengths", "levels", "scaling", "baseline",
            "ratios", "warmup_requests"} <= set(report)
    assert report["host"]["load_average_start"] == [0.1, 0.2, 0.3]
    for lv in report["levels"] + report["baseline"]["levels"]:
        assert LEVEL_KEYS <= set(lv)
        cond = lv["conditions"]
        assert set(cond) == {"prompt_length_distribution", "sampling", "concurrency", "memory"}
        assert cond["concurrency"] == lv["concurrency"] and cond["sampling"] == sampling
        assert cond["memory"]["rss_peak_mb"] == 100.0
        assert cond["prompt_length_distribution"]["by_bucket"] == {"<=128": 2, "129-512": 1, ">512": 1}
    ratio = {r["concurrency"]: r for r in report["ratios"]}
    tgs_llmc, tgs_hf = report["levels"][0]["tgs"], report["baseline"]["levels"][0]["tgs"]
    assert ratio[1]["tgs"] == {"llmc": tgs_llmc, "baseline": tgs_hf, "ratio": pytest.approx(tgs_llmc / tgs_hf)}
    assert ratio[4]["tgs"]["ratio"] == pytest.approx(5.0)
    assert ratio[1]["ttft_p50"]["ratio"] == pytest.approx(1.0)
    assert [s["ratio"] for s in report["scaling"]] == pytest.approx([1.0, 4.0])


def test_repetitions_report_the_median_tgs_and_pool_latencies(capsys):
    from rich.console import Console

    plan = BenchPlan(warmup=(), levels=((1, PROMPTS), (4, PROMPTS), (1, PROMPTS), (4, PROMPTS), (1, PROMPTS),
                                        (4, PROMPTS)))
    # concurrency 1 at 16/2/8 tok/s (walls 1, 8, 2 s), concurrency 4 at 32/16/64 tok/s
    llmc = [level(1, 1.0), level(4, 0.5), level(1, 8.0), level(4, 1.0), level(1, 2.0), level(4, 0.25)]
    report = build_report({"mode": "offline", "engine_dir": "x", "device": "cpu"}, llmc, plan, {})
    one, four = report["levels"]
    assert report["repeat"] == 3 and [lv["concurrency"] for lv in report["levels"]] == [1, 4]
    assert [r["tgs"] for r in one["repetitions"]] == pytest.approx([16.0, 2.0, 8.0])
    assert one["tgs"] == pytest.approx(8.0) and four["tgs"] == pytest.approx(32.0)  # the medians
    assert report["scaling"][1]["ratio"] == pytest.approx(4.0)
    assert one["num_requests"] == 12 and one["ttft_s"]["count"] == 12 and one["wall_s"] == pytest.approx(11.0)
    assert one["conditions"]["prompt_length_distribution"]["count"] == 12
    console = Console(width=200, record=True)
    print_report(report, console)
    assert "8.0 (16/2/8)" in console.export_text()


def test_print_report_renders(capsys):
    from rich.console import Console

    plan = BenchPlan(warmup=(), levels=((1, PROMPTS),))
    report = build_report({"mode": "offline", "engine_dir": "x", "device": "cpu"}, [level(1, 1.0)], plan,
                          {"temperature": 0.0}, [level(1, 2.0)], {"name": "hf"})
    console = Console(width=200, record=True)
    print_report(report, console)
    text = console.export_text()
    assert "baseline: hf" in text and "2.00x" in text and "<=128" in text


def test_closed_loop_keeps_order_reaches_concurrency_and_reraises():
    import threading
    import time

    active, peak, lock = [0], [0], threading.Lock()

    def run(i: int) -> RequestRecord:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.02)
        with lock:
            active[0] -= 1
        return RequestRecord(i, 1, 0.0, (0.0,), 0.0)

    records, wall = closed_loop(list(range(12)), 4, run, time.perf_counter)
    assert [r.prompt_tokens for r in records] == list(range(12))
    assert peak[0] == 4 and wall >= 0.06

    def fail(i: int) -> RequestRecord:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        closed_loop([1, 2], 2, fail, time.perf_counter)


def test_prefix_cache_hits_per_level_and_the_caption():
    from dataclasses import replace

    from rich.console import Console

    cached = [replace(level(1, 1.0), prefix_cache={"queried_tokens": 957, "hit_tokens": 640}),
              replace(level(1, 1.0), prefix_cache={"queried_tokens": 957, "hit_tokens": 320})]
    assert prefix_cache_summary(cached) == {"hit_tokens": 960, "queried_tokens": 1914, "hit_rate": 960 / 1914}
    assert prefix_cache_summary([level(1, 1.0)]) is None  # a server: not visible
    assert prefix_cache_summary([replace(level(1, 1.0), prefix_cache={"hit_tokens": 0})])["hit_rate"] is None
    plan = BenchPlan(warmup=(), levels=((1, PROMPTS), (1, PROMPTS)))
    on = {"mode": "offline", "engine_dir": "x", "device": "cpu",
          "prefix_caching": {"mode": "on", "llmc": True, "baseline": False, "why": "--prefix-caching on"}}
    report = build_report(on, cached, plan, {}, [level(1, 2.0), level(1, 2.0)], {"name": "hf"})
    assert report["levels"][0]["prefix_cache"]["hit_tokens"] == 960
    assert [r["prefix_cache_hit_tokens"] for r in report["levels"][0]["repetitions"]] == [640, 320]
    caption = prefix_caching_caption(report)
    assert caption.startswith("prefix caching ON (--prefix-caching on): 960 prompt tokens served")
    assert caption.endswith("not like for like")
    assert "not like for like" not in prefix_caching_caption({**report, "baseline": None})
    console = Console(width=220, record=True)
    print_report(report, console)
    text = console.export_text()
    assert "prefix hits" in text and "960 (50%)" in text and "not like for like" in text
    off = {**on, "prefix_caching": {"mode": "off", "llmc": False, "baseline": False, "why": "--prefix-caching off"}}
    assert prefix_caching_caption(build_report(off, cached, plan, {})) == "prefix caching off (--prefix-caching off)"
    server = {"mode": "server", "url": "u", "prefix_caching": {"llmc": None, "why": "the server's build decides"}}
    assert prefix_caching_caption(build_report(server, [level(1, 1.0)], BenchPlan((), ((1, PROMPTS),)), {})) == (
        "prefix caching: the server's build decides")
