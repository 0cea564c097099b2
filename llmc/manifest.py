"""``manifest.json``: the self-description of a build folder (written last, read by every consumer).

A build folder is valid exactly when its manifest parses and its ``format_version`` is one this llmc reads.
Nothing about a build is inferred from file names: dtype, quantization, eos ids, source hashes and tool
versions all live here.
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from llmc.errors import EngineError
from llmc.recipe import Recipe, recipe_from_dict

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
# Model-shape fields copied from the HF config (HF names).
SHAPE_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "vocab_size", "intermediate_size", "max_position_embeddings", "tie_word_embeddings")
_TOOL_PACKAGES = ("llmc", "torch", "transformers", "tokenizers", "safetensors", "gguf")


@dataclass(frozen=True)
class Manifest:
    """The contents of ``manifest.json`` (see docs/ARCHITECTURE.md, "Build folder").

    ``recipe`` is the resolved recipe dict (``recipe_to_dict``); ``source`` is ``{kind, origin, sha256}``;
    ``tools`` maps package -> version; ``timings`` maps build step -> seconds; ``model`` holds the HF shape
    fields in ``SHAPE_KEYS``.
    """

    name: str
    recipe: dict[str, Any]
    recipe_sha256: str
    backend: str
    dtype: str
    quantization: dict[str, Any]
    eos_token_ids: tuple[int, ...]
    special_token_ids: tuple[int, ...]
    source: dict[str, Any]
    model: dict[str, Any]
    tools: dict[str, str]
    timings: dict[str, float]
    created_at: str = ""
    eos_warnings: tuple[str, ...] = ()
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def recipe_obj(self) -> Recipe:
        """The recipe as a frozen ``Recipe`` (``llmc.recipe.recipe_from_dict``, input files not re-checked)."""
        return recipe_from_dict(self.recipe, check_inputs=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict (tuples become lists)."""
        d = asdict(self)
        for key in ("eos_token_ids", "special_token_ids", "eos_warnings"):
            d[key] = list(d[key])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Manifest":
        """Inverse of ``to_dict``; KeyError/TypeError on missing or unknown fields."""
        d = dict(d)
        for key in ("eos_token_ids", "special_token_ids", "eos_warnings"):
            if key in d:
                d[key] = tuple(d[key])
        return cls(**d)


def tool_versions() -> dict[str, str]:
    """Versions of python and the packages a build depends on ("absent" when not installed)."""
    out = {"python": platform.python_version()}
    for name in _TOOL_PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def write_manifest(build_dir: Path, manifest: Manifest) -> Path:
    """Write ``<build_dir>/manifest.json`` and return its path."""
    path = Path(build_dir) / MANIFEST_NAME
    path.write_text(json.dumps(manifest.to_dict(), indent=2) + "\n")  # field order: build steps stay in order
    return path


def read_manifest(build_dir: Path) -> Manifest:
    """Read a build folder's manifest.

    Raises EngineError (with the fix) when the folder or manifest is missing, the JSON is corrupt or lacks
    fields, or ``format_version`` is newer than this llmc reads.
    """
    build_dir = Path(build_dir)
    path = build_dir / MANIFEST_NAME
    rebuild = "Fix: run `llmc build RECIPE` (add --force to rebuild) and pass the build folder, e.g. build/<name>"
    if not build_dir.is_dir():
        raise EngineError(f"build folder {build_dir} does not exist. {rebuild}")
    if not path.exists():
        raise EngineError(f"{build_dir} has no {MANIFEST_NAME}, so it is not a (complete) llmc build. {rebuild}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EngineError(f"{path} is corrupt ({exc}). {rebuild}") from exc
    if not isinstance(data, dict):
        raise EngineError(f"{path} is corrupt (not a JSON object). {rebuild}")
    version = data.get("format_version")
    if not isinstance(version, int):
        raise EngineError(f"{path} has no integer format_version. {rebuild}")
    if version > FORMAT_VERSION:
        raise EngineError(
            f"{path} has format_version {version}, newer than this llmc reads ({FORMAT_VERSION}). "
            f"Fix: upgrade llmc (pip install -U llmc) or rebuild with this version"
        )
    try:
        return Manifest.from_dict(data)
    except TypeError as exc:
        raise EngineError(f"{path} is missing or has unknown fields ({exc}). {rebuild}") from exc
