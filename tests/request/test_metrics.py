"""Request/step metrics, the JSON-lines log, percentiles and TTFT buckets."""

from __future__ import annotations

import json
import math
import threading

import numpy as np
import pytest

from llmc.request.metrics import (
    MetricsLog,
    RequestMetrics,
    StepMetrics,
    percentiles,
    read_metrics_log,
    ttft_bucket,
)


def make_request() -> RequestMetrics:
    m = RequestMetrics(arrival_time=10.0, prompt_tokens=200)
    m.record_scheduled(10.5)
    m.record_scheduled(11.0)  # after a preemption: the first scheduling time stays
    for t in (11.25, 11.5, 12.0, 12.125):
        m.record_token(t)
    m.record_finished(12.5)
    return m


def test_request_latencies():
    m = make_request()
    assert m.queue_time == pytest.approx(0.5)
    assert m.ttft == pytest.approx(1.25)  # from acceptance, not from scheduling
    assert m.itls == pytest.approx([0.25, 0.5, 0.125])
    assert m.e2e_latency == pytest.approx(2.5)
    assert m.generated_tokens == 4 and m.first_token_time == 11.25


def test_unfinished_request_has_no_latencies_yet():
    m = RequestMetrics(arrival_time=1.0)
    assert m.queue_time is None and m.ttft is None and m.e2e_latency is None and m.itls == []


def test_to_dict_is_json_able():
    d = make_request().to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["ttft"] == pytest.approx(1.25) and d["ttft_bucket"] == "129-512"


def test_metrics_log_writes_typed_lines_from_many_threads(tmp_path):
    path = tmp_path / "logs" / "metrics.jsonl"
    step = StepMetrics(step=3, time=1.0, duration_s=0.02, running=4, waiting=1, scheduled_tokens=130,
                       prefill_tokens=126, decode_tokens=4, kv_blocks_used=10, kv_blocks_free=90, preemptions=0)
    with MetricsLog(path) as log:
        def work(i: int) -> None:
            for _ in range(50):
                log.log_step(step)
                log.log_request(make_request(), request_id=f"r{i}", finish_reason="stop")

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    records = read_metrics_log(path)
    assert len(records) == 400
    steps = [r for r in records if r["type"] == "step"]
    requests = [r for r in records if r["type"] == "request"]
    assert len(steps) == len(requests) == 200
    assert steps[0] == {"type": "step", **step.to_dict()}
    assert {r["request_id"] for r in requests} == {"r0", "r1", "r2", "r3"}
    assert requests[0]["finish_reason"] == "stop" and requests[0]["itls"] == pytest.approx([0.25, 0.5, 0.125])


def test_percentiles_match_numpy_linear():
    rng = np.random.default_rng(0)
    values = rng.exponential(size=101).tolist()
    got = percentiles(values, (0, 50, 95, 99, 99.9, 100))
    for q in (0, 50, 95, 99, 99.9, 100):
        assert got[f"p{q:g}"] == pytest.approx(float(np.percentile(values, q)))
    assert percentiles([1.0, 2.0, 3.0, 4.0]) == {"p50": 2.5, "p95": pytest.approx(3.85), "p99": pytest.approx(3.97)}
    assert percentiles([7.0]) == {"p50": 7.0, "p95": 7.0, "p99": 7.0}


def test_percentiles_of_nothing_are_null():
    assert percentiles([]) == {"p50": None, "p95": None, "p99": None}
    assert not any(isinstance(v, float) and math.isnan(v) for v in percentiles([]).values())


def test_ttft_buckets():
    assert [ttft_bucket(n) for n in (0, 128, 129, 512, 513, 4096)] == [
        "<=128", "<=128", "129-512", "129-512", ">512", ">512"
    ]


def test_metrics_log_buffers_lines_between_flushes(tmp_path):
    """Lines reach the file once ``flush_interval_s`` passed since the last flush, at flush() and at close()."""
    now = [0.0]
    path = tmp_path / "metrics.jsonl"
    step = StepMetrics(step=1, time=1.0, duration_s=0.02, running=1, waiting=0, scheduled_tokens=1,
                       prefill_tokens=0, decode_tokens=1, kv_blocks_used=1, kv_blocks_free=9)
    log = MetricsLog(path, flush_interval_s=0.5, clock=lambda: now[0])
    log.log_step(step)
    now[0] = 0.4
    log.log_step(step)
    assert path.read_text() == ""  # within the interval: buffered
    now[0] = 0.6
    log.log_step(step)
    assert len(read_metrics_log(path)) == 3  # the interval passed: everything so far is written
    log.log_step(step)
    log.flush()
    assert len(read_metrics_log(path)) == 4
    log.log_request(make_request(), request_id="r")
    log.close()
    records = read_metrics_log(path)
    assert len(records) == 5 and records[-1]["request_id"] == "r" and records[0] == {"type": "step", **step.to_dict()}


def test_queue_time_counts_from_queueing_when_known():
    m = RequestMetrics(arrival_time=1.0, queued_time=1.25, template_time=0.05, tokenize_time=0.2)
    m.record_scheduled(2.0)
    m.record_token(2.5)
    assert m.queue_time == pytest.approx(0.75) and m.ttft == pytest.approx(1.5)  # TTFT still from acceptance
    record = m.to_dict()
    assert record["template_time"] == 0.05 and record["tokenize_time"] == 0.2 and record["queued_time"] == 1.25
