"""Prometheus text exposition (format 0.0.4) without a client library: counters, gauges, histograms.

A :class:`Registry` owns its metrics (no module-level state); ``render()`` produces the ``/metrics`` body.
Metric updates are thread-safe (the engine's step thread and the event loop both record).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence

LabelValues = tuple[str, ...]
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Latency buckets in seconds, from sub-millisecond decode steps to multi-second prefills on CPU.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   10.0, 30.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, label_names: Sequence[str] = ()):
        self.name = name
        self.help = help_text
        self.label_names = tuple(label_names)
        self._lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    """A monotonically increasing count per label set."""

    kind = "counter"

    def __init__(self, name: str, help_text: str, label_names: Sequence[str] = ()):
        super().__init__(name, help_text, label_names)
        self._values: dict[LabelValues, float] = {}

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        with self._lock:
            self._values[labels] = self._values.get(labels, 0.0) + amount

    def value(self, *labels: str) -> float:
        with self._lock:
            return self._values.get(labels, 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return self.header() + [f"{self.name}{_labels(self.label_names, k)} {_num(v)}" for k, v in items]


class Gauge(_Metric):
    """A value read at scrape time from ``read()`` (a callable returning the current number)."""

    kind = "gauge"

    def __init__(self, name: str, help_text: str, read: Callable[[], float]):
        super().__init__(name, help_text)
        self._read = read

    def render(self) -> list[str]:
        return self.header() + [f"{self.name} {_num(self._read())}"]


class Histogram(_Metric):
    """Cumulative-bucket histogram of observations (``_bucket``, ``_sum``, ``_count`` series)."""

    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Sequence[float] = LATENCY_BUCKETS):
        super().__init__(name, help_text)
        self.buckets = tuple(sorted(buckets)) + (math.inf,)
        self._counts = [0] * len(self.buckets)
        self._sum = 0.0
        self._count = 0

    def observe(self, value: float) -> None:
        with self._lock:
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    self._counts[i] += 1
                    break
            self._sum += value
            self._count += 1

    @property
    def count(self) -> int:
        with self._lock:
            return self._count

    def render(self) -> list[str]:
        with self._lock:
            counts, total, n = list(self._counts), self._sum, self._count
        lines, running = self.header(), 0
        for bound, c in zip(self.buckets, counts):
            running += c
            lines.append(f'{self.name}_bucket{{le="{_num(bound)}"}} {running}')
        lines += [f"{self.name}_sum {_num(total)}", f"{self.name}_count {n}"]
        return lines


class Registry:
    """An ordered set of metrics rendered together."""

    def __init__(self) -> None:
        self._metrics: list[_Metric] = []

    def add(self, metric: _Metric) -> _Metric:
        if any(m.name == metric.name for m in self._metrics):
            raise ValueError(f"metric {metric.name} is registered twice")
        self._metrics.append(metric)
        return metric

    def render(self) -> str:
        lines: list[str] = []
        for metric in self._metrics:
            lines += metric.render()
        return "\n".join(lines) + "\n"
