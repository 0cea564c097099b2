"""What every benchmark driver (offline engine, server client, transformers baseline) hands to the report.

Times are seconds; a record's ``start`` and ``token_times`` share one monotonic clock of its driver, so only
differences matter. TTFT is measured from ``start``: the moment the engine accepted the request (offline) or
the moment the client sent it (server, baseline).
"""

from __future__ import annotations

import os
import resource
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class RequestRecord:
    """One measured request."""

    prompt_tokens: int
    generated_tokens: int
    start: float  # acceptance (offline) or send (client) time
    token_times: tuple[float, ...]  # arrival time of every output chunk (one per token offline)
    end: float
    finish_reason: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def e2e(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class LevelResult:
    """All requests measured at one concurrency level, the wall time of the level and what it used.

    ``memory`` holds the peaks seen during the level (``rss_mb``, ``cuda_max_allocated_mb``, ``kv_blocks_used``,
    ``kv_bytes``...); ``steps`` summarises the engine's step metrics (offline only, else empty);
    ``prefix_cache`` counts the prompt tokens looked up in the prefix cache during the level and those served
    from cached blocks (``queried_tokens``, ``hit_tokens``; empty when the driver cannot see them: a server).
    """

    concurrency: int
    records: tuple[RequestRecord, ...]
    wall_s: float
    memory: dict[str, Any] = field(default_factory=dict)
    steps: dict[str, Any] = field(default_factory=dict)
    prefix_cache: dict[str, int] = field(default_factory=dict)


def current_rss_mb() -> float:
    """This process's resident set size in MiB (Linux /proc; falls back to the peak from getrusage)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class PeakMonitor:
    """Samples ``probe()`` (a dict of numbers) every ``interval_s`` in a thread and keeps each key's maximum.

    Also tracks the process RSS as ``rss_mb``. Use as a context manager around a measured level."""

    def __init__(self, probe: Callable[[], dict[str, float]] | None = None, interval_s: float = 0.02):
        self._probe = probe
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmc-bench-monitor", daemon=True)
        self.peaks: dict[str, float] = {}

    def _sample(self) -> None:
        values = {"rss_mb": current_rss_mb()}
        if self._probe is not None:
            values.update(self._probe())
        for key, value in values.items():
            self.peaks[key] = max(self.peaks.get(key, value), value)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._sample()

    def __enter__(self) -> PeakMonitor:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def closed_loop(items: Sequence[T], concurrency: int, run_one: Callable[[T], RequestRecord],
                clock: Callable[[], float]) -> tuple[list[RequestRecord], float]:
    """Run every item through ``run_one`` with ``concurrency`` worker threads, each starting its next item as
    soon as its previous one finishes (a closed loop). Returns the records in item order and the wall time
    (``clock``) from the first start to the last finish. The first exception of any worker is re-raised."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    results: list[RequestRecord | None] = [None] * len(items)
    errors: list[BaseException] = []
    lock = threading.Lock()
    cursor = iter(range(len(items)))

    def worker() -> None:
        while not errors:
            with lock:
                index = next(cursor, None)
            if index is None:
                return
            try:
                results[index] = run_one(items[index])
            except BaseException as exc:  # re-raised in the caller's thread below
                errors.append(exc)
                return

    threads = [threading.Thread(target=worker, name=f"llmc-bench-{i}", daemon=True) for i in range(concurrency)]
    start = clock()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = clock() - start
    if errors:
        raise errors[0]
    return [r for r in results if r is not None], wall
