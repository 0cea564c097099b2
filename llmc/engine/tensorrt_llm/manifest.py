"""``engine_manifest.json``: the tool versions and GPU an engine was built with, checked at load.

A serialized TensorRT engine only deserializes under the exact TensorRT version that built it
(reference tensorrt-llm.md lines 15-17); TensorRT's own failure ("Version tag does not match") does
not say what to do. llmc records the versions at build time and refuses a mismatched load with a
message that does.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from llmc.engine.tensorrt_llm.versions import Importer, probe_module
from llmc.errors import EngineError

ENGINE_MANIFEST = "engine_manifest.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class EngineManifest:
    """What ``engine_manifest.json`` holds (next to ``config.json`` and ``rank{r}.engine``)."""

    format_version: int
    backend: str  # always "tensorrt_llm"
    tensorrt_version: str
    tensorrt_llm_version: str
    gpu_name: str | None
    compute_capability: str | None  # "9.0"
    world_size: int
    build_time_s: float
    build_config: dict

    def write(self, engine_dir: Path) -> Path:
        path = Path(engine_dir) / ENGINE_MANIFEST
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path


def read_engine_manifest(engine_dir: Path) -> EngineManifest:
    """Read ``engine_dir/engine_manifest.json``; :class:`EngineError` when missing or malformed."""
    path = Path(engine_dir) / ENGINE_MANIFEST
    if not path.is_file():
        raise EngineError(
            f"{path} is missing: this folder was not built by llmc's tensorrt_llm backend, or the build did "
            "not finish. Fix: rebuild with llmc build --force"
        )
    try:
        return EngineManifest(**json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError) as exc:
        raise EngineError(f"{path} is unreadable ({exc}). Fix: rebuild with llmc build --force") from exc


def installed_versions(importer: Importer = importlib.import_module) -> dict[str, str | None]:
    """``{"tensorrt": ..., "tensorrt_llm": ...}`` on this machine (None when not importable)."""
    return {name: probe_module(name, importer).version for name in ("tensorrt", "tensorrt_llm")}


def check_engine_versions(engine_dir: Path, found: dict[str, str | None] | None = None) -> EngineManifest:
    """Refuse to load an engine built under other TensorRT / TensorRT-LLM versions.

    ``found`` = ``{"tensorrt": version, "tensorrt_llm": version}`` on this machine (default: probed by
    importing them now). Raises :class:`EngineError` naming both sides and the fix; returns the manifest.
    """
    manifest = read_engine_manifest(engine_dir)
    found = installed_versions() if found is None else found
    built = {"tensorrt": manifest.tensorrt_version, "tensorrt_llm": manifest.tensorrt_llm_version}
    if built == {k: found.get(k) for k in built}:
        return manifest
    raise EngineError(
        f"engine built with TensorRT {built['tensorrt']} / TensorRT-LLM {built['tensorrt_llm']}, this machine "
        f"has TensorRT {found.get('tensorrt') or 'none'} / TensorRT-LLM {found.get('tensorrt_llm') or 'none'}; "
        "a TensorRT engine only loads under the TensorRT version that built it. "
        "Fix: rebuild with llmc build --force on this machine"
    )
