"""The bounded waiting queue: priority + FCFS, a maximum wait after which a request jumps ahead."""

from __future__ import annotations

import time
from collections.abc import Callable

from llmc.errors import QueueFullError
from llmc.runtime.scheduler.request import Request


class WaitingQueue:
    """Requests waiting for admission, served in this order:

    1. preempted requests (they already held the GPU; by priority, then arrival),
    2. requests that have waited longer than ``max_wait_s`` (oldest first, whatever their priority),
    3. everything else by priority (lower number first), then arrival (FCFS).

    ``add`` rejects new requests with :class:`QueueFullError` when ``max_size`` requests are waiting;
    preempted requests always fit back (``push_front``), so preemption never loses a request.
    """

    def __init__(self, max_size: int, max_wait_s: float | None = None, clock: Callable[[], float] = time.monotonic):
        if max_size <= 0:
            raise ValueError(f"max_size must be positive, got {max_size}")
        self.max_size = max_size
        self.max_wait_s = max_wait_s
        self._clock = clock
        self._items: list[Request] = []

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(list(self._items))

    def add(self, request: Request) -> None:
        """Append a new request; raises QueueFullError when the queue is full."""
        if len(self._items) >= self.max_size:
            raise QueueFullError(self.max_size)
        self._items.append(request)

    def push_front(self, request: Request) -> None:
        """Put a preempted request back; it is served before any new request."""
        assert request.num_preemptions > 0, "push_front is for preempted requests"
        self._items.append(request)

    def _key(self, request: Request, now: float) -> tuple:
        if request.num_preemptions > 0:
            return (0, request.priority, request.seq_no)
        if self.max_wait_s is not None and now - request.arrival_time > self.max_wait_s:
            return (1, 0, request.seq_no)
        return (2, request.priority, request.seq_no)

    def peek(self) -> Request | None:
        """The request to admit next (None when empty)."""
        if not self._items:
            return None
        now = self._clock()
        return min(self._items, key=lambda r: self._key(r, now))

    def ordered(self) -> list[Request]:
        """All waiting requests in service order."""
        now = self._clock()
        return sorted(self._items, key=lambda r: self._key(r, now))

    def remove(self, request: Request) -> None:
        self._items.remove(request)
