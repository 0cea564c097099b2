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
        return {"waiting": 1, "running": 2, "kv_blocks_used": self.used, "kv_blocks_free": 10 - self.used}


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
    m = RequestMetrics(arrival_time=0.0, prompt_tokens=7)
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
    assert got[("llmc_time_to_first_token_seconds_bucket", (("le", "0.05"),))] == 1
    assert got[("llmc_time_to_first_token_seconds_count", ())] == 1
    assert got[("llmc_inter_token_latency_seconds_bucket", (("le", "0.5"),))] == 1
    assert got[("llmc_inter_token_latency_seconds_bucket", (("le", "+Inf"),))] == 2
    assert got[("llmc_inter_token_latency_seconds_sum", ())] == 3.0 - 0.05
    assert got[("llmc_kv_blocks_used", ())] == 4 and got[("llmc_kv_blocks_free", ())] == 6  # read at scrape
    assert got[("llmc_num_requests_running", ())] == 2 and got[("llmc_requests_in_flight", ())] == 3


def test_each_server_has_its_own_registry():
    a, b = ServerMetrics(FakeEngine(), set()), ServerMetrics(FakeEngine(), set())
    a.requests.labels("stop").inc()
    assert ("llmc_requests_total", (("finish_reason", "stop"),)) not in samples(b)
