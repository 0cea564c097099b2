"""The ``/metrics`` series of ``llmc serve``, on ``prometheus_client`` (its text exposition, HELP escaping and
callback gauges).

Each :class:`ServerMetrics` owns its own ``CollectorRegistry`` (no process-global state, so several servers or
tests can live in one process). Updates are thread-safe (the engine's step thread and the event loop both record).

Per finished request: TTFT by prompt-length bucket (label ``prompt_tokens``: ``<=128``, ``129-512``, ``>512``;
``sum by (le)`` gives all of them), where the time before the first token went (chat template, tokenizing, the
engine's queue), the prompt and output lengths; per token the inter-token gaps. Read from the engine at scrape
time: requests waiting and running, KV blocks, and its totals of preemptions and of prefix-cache lookups and hits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from llmc.request.metrics import TTFT_BUCKETS, ttft_bucket
from llmc.request.outputs import StreamEvent

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Latency buckets in seconds, from sub-millisecond decode steps to multi-second prefills on CPU.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   10.0, 30.0)
# Tokens a request's prompt or output had: powers of two up to 128 K.
TOKEN_BUCKETS = tuple(float(2 ** i) for i in range(4, 18))
# Engine.stats() key -> (metric name, help)
ENGINE_GAUGES = {
    "waiting": ("llmc_num_requests_waiting", "Requests waiting in the engine's queue."),
    "running": ("llmc_num_requests_running", "Requests in the running batch."),
    "kv_blocks_used": ("llmc_kv_blocks_used", "KV-cache blocks in use."),
    "kv_blocks_free": ("llmc_kv_blocks_free", "Free KV-cache blocks."),
    "kv_blocks_total": ("llmc_kv_blocks_total", "KV-cache blocks the engine has."),
}
# Engine.stats() key -> (counter name without _total, help): totals since the engine started, read at scrape.
ENGINE_COUNTERS = {
    "preemptions": ("llmc_preemptions", "Times a running request was preempted (its KV blocks freed, its tokens "
                                        "recomputed later)."),
    "prefix_cache_queried_tokens": ("llmc_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix "
                                                                        "cache."),
    "prefix_cache_hit_tokens": ("llmc_prefix_cache_hit_tokens", "Prompt tokens served from cached KV blocks (not "
                                                                "computed again)."),
    "structured_masks": ("llmc_structured_masks", "Allowed-token masks computed for requests with an output format "
                                                  "(one per row a step samples under one, drafted rows included)."),
    "structured_mask_seconds": ("llmc_structured_mask_seconds", "Host seconds computing those masks on the step "
                                                                "loop."),
    "draft_tokens": ("llmc_draft_tokens", "Draft tokens verified (prompt-lookup speculation, "
                                          "serving.speculative_tokens)."),
    "accepted_draft_tokens": ("llmc_accepted_draft_tokens", "Draft tokens the model's own choice confirmed (each "
                                                            "one a token generated without a step of its own)."),
}


class ServerMetrics:
    """Request outcomes, latencies, token counts, and engine load read at scrape time.

    ``engine`` needs ``stats() -> dict`` (keys of :data:`ENGINE_GAUGES`); ``in_flight`` is the server's set of
    requests it is handling."""

    def __init__(self, engine: Any, in_flight: Sized):
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.requests = Counter("llmc_requests", "Finished requests by finish reason.", ("finish_reason",),
                                registry=reg)
        self.rejected = Counter("llmc_requests_rejected", "Requests refused before running.", ("reason",),
                                registry=reg)
        self.ttft = Histogram("llmc_time_to_first_token_seconds", "Time from request acceptance to its first token, "
                              "by prompt length (tokens).", ("prompt_tokens",), buckets=LATENCY_BUCKETS, registry=reg)
        for bucket in TTFT_BUCKETS:  # every bucket's series exists from the start (0 until a request lands there)
            self.ttft.labels(bucket)
        self.template = Histogram("llmc_request_template_seconds", "Rendering the chat template of a request.",
                                  buckets=LATENCY_BUCKETS, registry=reg)
        self.compile_format = Histogram("llmc_request_format_compile_seconds", "Compiling a request's output format "
                                        "(structured outputs).", buckets=LATENCY_BUCKETS, registry=reg)
        self.tokenize = Histogram("llmc_request_tokenize_seconds", "Tokenizing a request's prompt.",
                                  buckets=LATENCY_BUCKETS, registry=reg)
        self.queue = Histogram("llmc_request_queue_seconds", "Time a request waited in the engine's queue before "
                               "its first step.", buckets=LATENCY_BUCKETS, registry=reg)
        self.prompt_lengths = Histogram("llmc_request_prompt_tokens", "Prompt tokens of a finished request.",
                                        buckets=TOKEN_BUCKETS, registry=reg)
        self.output_lengths = Histogram("llmc_request_generation_tokens", "Tokens a finished request generated.",
                                        buckets=TOKEN_BUCKETS, registry=reg)
        self.itl = Histogram("llmc_inter_token_latency_seconds", "Gap between consecutive tokens.",
                             buckets=LATENCY_BUCKETS, registry=reg)
        self.e2e = Histogram("llmc_e2e_request_latency_seconds", "Request acceptance to finish.",
                             buckets=LATENCY_BUCKETS, registry=reg)
        self.prompt_tokens = Counter("llmc_prompt_tokens", "Prompt tokens of finished requests.", registry=reg)
        self.generated_tokens = Counter("llmc_generation_tokens", "Tokens generated.", registry=reg)
        for key, (name, help_text) in ENGINE_GAUGES.items():
            Gauge(name, help_text, registry=reg).set_function(_reader(engine, key))
        reg.register(_EngineCounters(engine))
        Gauge("llmc_requests_in_flight", "Requests the server is handling.",
              registry=reg).set_function(lambda: len(in_flight))

    def render(self) -> bytes:
        """The Prometheus text exposition of every series (the ``/metrics`` body), without the ``<name>_created``
        series prometheus_client adds to each counter and histogram: gauges of a Unix time, and
        ``llmc_requests_created`` reads as a count of requests. Dropped here, not by prometheus_client's
        process-wide switch."""
        return generate_latest(_WithoutCreated(self.registry))

    def record(self, event: StreamEvent, reason: str | None = None) -> None:
        """Count a finished request (``reason`` overrides the event's finish reason, e.g. "timeout")."""
        self.requests.labels(reason or event.finish_reason or "unknown").inc()
        m = event.metrics
        if m is None:
            return
        self.prompt_tokens.inc(m.prompt_tokens)
        self.generated_tokens.inc(m.generated_tokens)
        self.prompt_lengths.observe(m.prompt_tokens)
        self.output_lengths.observe(m.generated_tokens)
        if m.template_time:
            self.template.observe(m.template_time)
        self.tokenize.observe(m.tokenize_time)
        if m.format_compile_time:
            self.compile_format.observe(m.format_compile_time)
        if m.queue_time is not None:
            self.queue.observe(m.queue_time)
        if m.ttft is not None:
            self.ttft.labels(ttft_bucket(m.prompt_tokens)).observe(m.ttft)
        for gap in m.itls:
            self.itl.observe(gap)
        if m.e2e_latency is not None:
            self.e2e.observe(m.e2e_latency)


class _WithoutCreated:
    """A view of a registry whose families carry no ``_created`` samples (what ``generate_latest`` reads)."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            if family.type in ("counter", "histogram"):
                family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


def _reader(engine: Any, key: str) -> Callable[[], float]:
    return lambda: engine.stats()[key]


class _EngineCounters:
    """The engine's running totals (:data:`ENGINE_COUNTERS`) as Prometheus counters, read at scrape time."""

    def __init__(self, engine: Any):
        self.engine = engine

    def collect(self):
        stats = self.engine.stats()
        for key, (name, help_text) in ENGINE_COUNTERS.items():
            yield CounterMetricFamily(name, help_text, value=stats[key])
