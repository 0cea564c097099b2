"""Guarded, lazy import of TensorRT-LLM and the version rules of llmc's engine backend.

Facts (docs/TENSORRT_LLM.md lists the reference line of each):
- the TensorRT *engine* workflow (``trtllm-build``, ``tensorrt_llm.builder.build``, ``BuildConfig``,
  ``ModelRunnerCpp``) exists in TensorRT-LLM 1.0 - 1.2 only; llmc pins ``tensorrt-llm>=1.0,<1.3``
  (reference tensorrt-llm.md lines 10-14);
- a serialized engine loads only under the exact TensorRT version that built it (lines 15-17).

Nothing here imports ``tensorrt_llm`` at module import time: the import happens inside
:func:`require_tensorrt_llm`, through an injectable ``importer`` so tests can pass a test double
without ever registering a module under that name.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from llmc.errors import BackendUnavailableError

MIN_VERSION = (1, 0)  # reference line 13: ">=1.0"
MAX_VERSION_EXCLUSIVE = (1, 3)  # reference line 13: "<1.3"; 1.3+ has no engine path (lines 10-12)
PIP_SPEC = "tensorrt-llm>=1.0,<1.3"
CONTAINER_HINT = "nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3"  # triton.md line 4
PIP_HINT = f"pip install --extra-index-url https://pypi.nvidia.com '{PIP_SPEC}'"

Importer = Callable[[str], Any]


def _what_is_needed() -> str:
    return (
        f"the tensorrt_llm backend needs TensorRT-LLM 1.0 - 1.2 ({PIP_SPEC}): use NVIDIA's TensorRT-LLM "
        f"container (e.g. {CONTAINER_HINT}) or `{PIP_HINT}` on a machine with an NVIDIA GPU. "
        "TensorRT-LLM 1.3 and later removed the TensorRT engine workflow (trtllm-build, BuildConfig, "
        "ModelRunnerCpp), so they cannot build or run llmc's engines. "
        "`backend: torch` in the recipe works everywhere (CPU or GPU) without TensorRT-LLM"
    )


def parse_version(found: str) -> tuple[int, int]:
    """``"1.2.0rc3"`` -> ``(1, 2)``. Raises :class:`BackendUnavailableError` when unparseable."""
    match = re.match(r"^\s*v?(\d+)\.(\d+)", found)
    if match is None:
        raise BackendUnavailableError(
            f"cannot read the TensorRT-LLM version {found!r}; {_what_is_needed()}"
        )
    return int(match.group(1)), int(match.group(2))


def check_version(found: str) -> None:
    """Raise :class:`BackendUnavailableError` unless ``found`` is in [1.0, 1.3).

    Pre-releases of 1.3 (``1.3.0rc1``) are refused like 1.3.0: pip's ``<1.3`` excludes them too.
    """
    major_minor = parse_version(found)
    if MIN_VERSION <= major_minor < MAX_VERSION_EXCLUSIVE:
        return
    raise BackendUnavailableError(
        f"found TensorRT-LLM {found.strip()}, which llmc's tensorrt_llm backend does not support; "
        + _what_is_needed()
    )


def require_tensorrt_llm(importer: Importer = importlib.import_module) -> ModuleType:
    """Import ``tensorrt_llm`` now and check its version; return the module.

    ``importer`` is ``importlib.import_module`` in production; tests pass a test double object.
    Raises :class:`BackendUnavailableError` (with what is needed) when the import fails or the
    version is outside [1.0, 1.3).
    """
    try:
        module = importer("tensorrt_llm")
    except ImportError as exc:
        raise BackendUnavailableError(
            f"cannot import tensorrt_llm ({exc}); {_what_is_needed()}"
        ) from exc
    check_version(str(getattr(module, "__version__", "unknown")))
    return module


TWO_MACHINE_HINT = (
    "To quantize on this machine and compile the engines on a GPU box: build the same recipe with "
    "`backend: torch` here (its checkpoint/ folder is the IR TensorRT-LLM compiles), copy that build folder to "
    "the GPU box and run `llmc build RECIPE --from-ir BUILD_DIR` there (README, \"Two machines\")"
)


def require_tensorrt_llm_for_build(importer: Importer = importlib.import_module) -> ModuleType:
    """:func:`require_tensorrt_llm` for ``llmc build``, called before any build work (source conversion,
    quantization): its error says that nothing was built and how to split the build across two machines."""
    try:
        return require_tensorrt_llm(importer)
    except BackendUnavailableError as exc:
        raise BackendUnavailableError(
            f"backend: tensorrt_llm: {exc}. llmc build stopped before any work, nothing was written. "
            f"{TWO_MACHINE_HINT}"
        ) from exc


@dataclass(frozen=True)
class ModuleProbe:
    """What importing a module found: its ``__version__``, or the error that stopped the import."""

    name: str
    version: str | None
    error: str | None  # "ModuleNotFoundError: No module named 'tensorrt'" when not importable


def probe_module(module_name: str, importer: Importer = importlib.import_module) -> ModuleProbe:
    """Import ``module_name`` now (lazily: only when a caller asks) and report its version.

    Any import failure is reported in ``error`` (not raised): a broken install (missing shared
    libraries raise OSError) means "not usable here", which is what ``llmc doctor`` shows.
    """
    try:
        module = importer(module_name)
    except Exception as exc:  # noqa: BLE001 - reported to the user, not swallowed
        return ModuleProbe(module_name, None, f"{type(exc).__name__}: {exc}")
    version = getattr(module, "__version__", None)
    return ModuleProbe(module_name, str(version) if version is not None else "unknown", None)
