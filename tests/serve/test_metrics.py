"""``/metrics`` series on prometheus_client: names, labels, histogram buckets and gauges read at scrape time."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from llmc.request.metrics import RequestMetrics
from llmc.request.outputs import StreamEvent
from llmc.serve.metrics import ServerMetrics


class FakeEngine:
    def __init__(self) -> None:
        self.used = 0

    def stats(self) -> dict[str, int]:
        return {"waiting": 1, "running": 2, "kv_blocks_used": self.used, "kv_blocks_free": 10 - self.used,
                "kv_blocks_total": 10, "preemptions": self.used // 2, "prefix_cache_queried_tokens": 64 * self.used,
                "prefix_cache_hit_tokens": 32 * self.used, "structured_masks": 5 * self.used,
                "structured_mask_seconds": 0.001 * self.used, "draft_tokens": 8 * self.used,
                "accepted_draft_tokens": 3 * self.used}


def samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} parsed back with prometheus_client's own parser."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_counters_histograms_and_callback_gauges():
    engine, in_flight = FakeEngine(), {"a", "b", "c"}
    metrics = ServerMetrics(engine, in_flight)
    m = RequestMetrics(arrival_time=0.0, prompt_tokens=7, format_compile_time=0.002)
    for t in (0.05, 0.5, 3.0):
        m.record_token(t)
    m.record_finished(3.0)
    metrics.record(StreamEvent("r", "", (), True, "length", None, m))
    metrics.record(StreamEvent("r2", "", (), True, "stop", None, None), reason='we"ird\n')
    metrics.rejected.labels("queue_full").inc()
    engine.used = 4
    got = samples(metrics)
    assert got[("llmc_requests_total", (("finish_reason", "length"),))] == 1
    assert got[("llmc_requests_total", (("finish_reason", 'we"ird\n'),))] == 1  # label escaping round-trips
    assert got[("llmc_requests_rejected_total", (("reason", "queue_full"),))] == 1
    assert got[("llmc_prompt_tokens_total", ())] == 7 and got[("llmc_generation_tokens_total", ())] == 3
    short = ("prompt_tokens", "<=128")
    assert got[("llmc_time_to_first_token_seconds_bucket", (("le", "0.05"), short))] == 1
    assert got[("llmc_time_to_first_token_seconds_count", (short,))] == 1
    assert got[("llmc_time_to_first_token_seconds_count", (("prompt_tokens", ">512"),))] == 0  # exists from start
    assert got[("llmc_inter_token_latency_seconds_bucket", (("le", "0.5"),))] == 1
    assert got[("llmc_inter_token_latency_seconds_bucket", (("le", "+Inf"),))] == 2
    assert got[("llmc_inter_token_latency_seconds_sum", ())] == 3.0 - 0.05
    assert got[("llmc_kv_blocks_used", ())] == 4 and got[("llmc_kv_blocks_free", ())] == 6  # read at scrape
    assert got[("llmc_kv_blocks_total", ())] == 10 and got[("llmc_preemptions_total", ())] == 2
    assert got[("llmc_prefix_cache_queried_tokens_total", ())] == 256
    assert got[("llmc_prefix_cache_hit_tokens_total", ())] == 128
    assert got[("llmc_structured_masks_total", ())] == 20 and got[("llmc_structured_mask_seconds_total", ())] == 0.004
    assert got[("llmc_draft_tokens_total", ())] == 32 and got[("llmc_accepted_draft_tokens_total", ())] == 12
    assert got[("llmc_request_format_compile_seconds_bucket", (("le", "0.0025"),))] == 1
    assert got[("llmc_request_format_compile_seconds_count", ())] == 1  # the request without a format: not observed
    assert got[("llmc_num_requests_running", ())] == 2 and got[("llmc_requests_in_flight", ())] == 3


def test_no_created_series_only_what_the_counters_and_histograms_count():
    """prometheus_client adds a <name>_created gauge (a Unix time) to every counter and histogram;
    "llmc_requests_created" would read as a request count on a dashboard."""
    metrics = ServerMetrics(FakeEngine(), set())
    metrics.requests.labels("stop").inc()
    metrics.itl.observe(0.01)
    text = metrics.render().decode()
    assert "_created" not in text, [line for line in text.splitlines() if "_created" in line][:4]
    got = samples(metrics)
    assert got[("llmc_requests_total", (("finish_reason", "stop"),))] == 1
    assert got[("llmc_inter_token_latency_seconds_count", ())] == 1
    assert metrics.render() == metrics.render()  # a scrape changes nothing for the next one


def test_each_server_has_its_own_registry():
    a, b = ServerMetrics(FakeEngine(), set()), ServerMetrics(FakeEngine(), set())
    a.requests.labels("stop").inc()
    assert ("llmc_requests_total", (("finish_reason", "stop"),)) not in samples(b)


def test_where_the_time_before_the_first_token_went_and_the_lengths():
    metrics = ServerMetrics(FakeEngine(), set())
    m = RequestMetrics(arrival_time=0.0, prompt_tokens=600, template_time=0.002, tokenize_time=0.03,
                       queued_time=0.04)
    m.record_scheduled(0.3)
    m.record_token(0.9)
    m.record_finished(0.9)
    metrics.record(StreamEvent("r", "", (), True, "length", None, m))
    text = RequestMetrics(arrival_time=0.0, prompt_tokens=20, tokenize_time=0.001)  # no template: not observed
    text.record_token(0.01)
    metrics.record(StreamEvent("t", "", (), True, "stop", None, text))
    got = samples(metrics)
    assert got[("llmc_time_to_first_token_seconds_bucket", (("le", "1.0"), ("prompt_tokens", ">512")))] == 1
    assert got[("llmc_time_to_first_token_seconds_bucket", (("le", "0.75"), ("prompt_tokens", ">512")))] == 0
    assert got[("llmc_request_template_seconds_count", ())] == 1
    assert got[("llmc_request_template_seconds_sum", ())] == 0.002
    assert got[("llmc_request_tokenize_seconds_count", ())] == 2
    assert got[("llmc_request_tokenize_seconds_sum", ())] == 0.031
    assert got[("llmc_request_queue_seconds_sum", ())] == 0.3 - 0.04  # from queueing, not from acceptance
    assert got[("llmc_request_queue_seconds_count", ())] == 1  # the second request was never scheduled here
    assert got[("llmc_request_prompt_tokens_bucket", (("le", "512.0"),))] == 1
    assert got[("llmc_request_prompt_tokens_bucket", (("le", "1024.0"),))] == 2
    assert got[("llmc_request_generation_tokens_bucket", (("le", "16.0"),))] == 2
