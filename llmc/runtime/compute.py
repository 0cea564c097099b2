"""One thread for all of a process's model compute: ``run_compute(fn, *args)``.

Why: torch's CPU kernels run on an OpenMP thread team owned by the *calling* thread (GNU libgomp in the
PyTorch wheels). Each thread that has ever run a parallel region keeps its own team alive. Once the process
has more such threads than the machine has cores (the main thread loaded the model, a loop thread steps it,
a third runs a baseline), libgomp stops spinning between parallel regions and every region pays a futex
wake-up. Measured on the 2-core CI machine: a 576 x 1536 fp32 GEMV took 80 us from the first thread and
190-240 us from a second one, and a SmolLM2 decode step went from ~35 ms to ~65 ms. Running all model work
(loading, warm-up, every step, the benchmark's transformers baseline) on one long-lived thread keeps one team.

Calls made on the compute thread itself run inline, so nested ``run_compute`` calls cannot deadlock.
Exceptions propagate to the caller. On CUDA this costs a thread hand-off per step (tens of microseconds) and
keeps CUDA graphs captured and replayed on the same thread.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")

_NAME = "llmc-compute"
_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_thread_ident: int | None = None


def _mark_thread() -> None:
    global _thread_ident
    _thread_ident = threading.get_ident()


def _get_executor() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=_NAME, initializer=_mark_thread)
        return _executor


def on_compute_thread() -> bool:
    """True when called from the compute thread."""
    return _thread_ident is not None and threading.get_ident() == _thread_ident


def run_compute(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run ``fn(*args, **kwargs)`` on the process's compute thread and return its result (or raise its
    exception). Blocks the caller; inline when already on the compute thread."""
    if on_compute_thread():
        return fn(*args, **kwargs)
    return _get_executor().submit(fn, *args, **kwargs).result()


def compute_thread_ident() -> int | None:
    """The compute thread's ``threading.get_ident()``, or None before its first use."""
    return _thread_ident
