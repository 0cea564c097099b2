"""llmc: an ahead-of-time compile toolchain for LLM inference.

The Python API (the convention of ``from vllm import LLM, SamplingParams``)::

    from llmc import Engine, SamplingParams

    engine = Engine.from_dir("build/smollm2-135m-awq")
    print(engine.generate(["The capital of France is"], SamplingParams(max_new_tokens=16))[0].text)

The names are resolved on first use, so ``import llmc`` (and ``llmc --help``) loads neither torch nor a model.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
_API = {
    "Engine": "llmc.runtime.api",
    "SamplingParams": "llmc.request.params",
    "Completion": "llmc.request.outputs",
    "StreamEvent": "llmc.request.outputs",
    "TokenLogprob": "llmc.request.outputs",
}
__all__ = ["__version__", *_API]


def __getattr__(name: str) -> object:
    """``llmc.Engine`` and friends, imported from their modules when first asked for (PEP 562)."""
    if name not in _API:
        raise AttributeError(f"module 'llmc' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
