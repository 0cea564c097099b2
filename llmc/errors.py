"""Typed errors for user-facing failures.

Every message says what was wrong and how to fix it. The CLI prints ``error: <message>`` and exits
with status 2 for any :class:`LlmcError`; internal invariants use ``assert`` instead.
"""

from __future__ import annotations


def short_repr(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for quoting a client's value in an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


class LlmcError(Exception):
    """Base class of every error llmc raises for bad input or an unusable environment."""


class RecipeError(LlmcError):
    """A recipe file is invalid. Names the file, the key path and the fix."""

    def __init__(self, file: str | None, key_path: str, problem: str, fix: str):
        self.file = file
        self.key_path = key_path
        self.problem = problem
        self.fix = fix
        where = f"{file}: " if file else ""
        super().__init__(f"{where}{key_path}: {problem}. Fix: {fix}")


class SourceError(LlmcError):
    """A model source (HF folder, GGUF file, package) is missing, unreadable or unsupported."""


class CheckpointError(LlmcError):
    """A checkpoint IR folder is missing files or tensors, or has wrong shapes or dtypes."""


class BuildError(LlmcError):
    """``llmc build`` cannot proceed (output folder not writable, inconsistent inputs, ...)."""


class EngineError(LlmcError):
    """An engine folder cannot be loaded (missing files, version mismatch, ...)."""


class BackendUnavailableError(LlmcError):
    """A backend's runtime dependency (e.g. tensorrt_llm) is missing or has an unsupported version."""


class RequestError(LlmcError):
    """A generation request is invalid. ``field`` names the offending field."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


class UnknownModelError(RequestError):
    """A request names a model the server does not serve (HTTP 404)."""


class ServeError(LlmcError):
    """``llmc serve`` cannot start (a port in use, an address that cannot be bound, ...)."""


class QueueFullError(LlmcError):
    """The bounded waiting queue is full; the client should retry later."""

    def __init__(self, max_queue_size: int, retry_after_s: float = 1.0):
        self.max_queue_size = max_queue_size
        self.retry_after_s = retry_after_s
        super().__init__(
            f"the request queue is full ({max_queue_size} waiting requests); retry in "
            f"{retry_after_s:g} s or raise serving.max_queue_size in the recipe"
        )


class AccuracyGateError(BuildError):
    """The quantized model failed the accuracy gate (KL / perplexity thresholds)."""
