"""The engine's background step loop: one thread that runs ``step()`` while there is work.

Callers in other threads (or asyncio tasks) add requests and call :meth:`EngineLoop.wake`; the loop sleeps
on a condition variable when idle, so an idle engine costs no CPU.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class EngineLoop:
    """Runs ``step`` repeatedly in a daemon thread while ``has_work()`` is true."""

    def __init__(self, step: Callable[[], object], has_work: Callable[[], bool], name: str = "llmc-engine"):
        self._step = step
        self._has_work = has_work
        self._name = name
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the thread (no-op when already running)."""
        if self.running:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Tell the loop there may be new work (called after adding or aborting a request)."""
        with self._cond:
            self._cond.notify_all()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Ask the loop to exit after its current step and wait for it."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._thread = None

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._has_work():
                    self._cond.wait()
                if self._stopping:
                    return
            try:
                self._step()
            except Exception:  # step() already failed the affected requests; keep serving the others
                log.exception("engine step failed")
