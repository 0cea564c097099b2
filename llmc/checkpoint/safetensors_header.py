"""The one reader of safetensors headers: tensor names, dtypes, shapes and offsets without loading any tensor.

Torch-free on purpose: ``llmc validate`` sniffs a model source's weights with it before anything heavy loads.
The IR reader (:mod:`llmc.checkpoint.io`), the TensorRT-LLM backend's IR checks, ``llmc inspect`` and the
model-source checks (:mod:`llmc.source`) all use it.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

from llmc.errors import CheckpointError

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format caps a header at 100 MB: a larger length means not safetensors


def read_safetensors_header(path: str | Path) -> dict[str, Any]:
    """The JSON header of a safetensors file ({name: {dtype, shape, data_offsets}, "__metadata__": ...}).

    Reads only the header, never tensor data, and checks that every tensor's bytes lie inside the file (a
    truncated file is a CheckpointError here, not a SafetensorError when loading). CheckpointError for a
    missing or malformed file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: safetensors header of {length} bytes is implausible; file corrupt")
            header = json.loads(f.read(length))
            data_size = os.fstat(f.fileno()).st_size - 8 - length
    except (OSError, struct.error, ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{path} is not a readable safetensors file ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    for name, entry in header.items():
        if name != "__metadata__":
            _check_entry(path, name, entry, data_size)
    return header


def _check_entry(path: Path, name: str, entry: Any, data_size: int) -> None:
    """CheckpointError unless ``entry`` is ``{dtype, shape, data_offsets}`` with offsets inside the data."""
    fix = "the file is corrupt or truncated; rebuild with llmc build --force"
    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
        raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry; {fix}")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise CheckpointError(f"{path}: tensor {name!r} has a malformed shape {shape!r}; {fix}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise CheckpointError(f"{path}: tensor {name!r} has malformed data_offsets {offsets!r}; {fix}")
    if offsets[1] > data_size:
        raise CheckpointError(f"{path}: tensor {name!r} ends at byte {offsets[1]} of the data but the file holds "
                              f"{max(data_size, 0)}; {fix}")


def tensor_headers(checkpoint_dir: str | Path) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """``{name: (dtype, shape, bytes)}`` of every tensor in a checkpoint folder's ``*.safetensors`` files, from
    their headers only."""
    tensors = {}
    for path in sorted(Path(checkpoint_dir).glob("*.safetensors")):
        for name, info in read_safetensors_header(path).items():
            if name != "__metadata__":
                start, end = info["data_offsets"]
                tensors[name] = (info["dtype"], tuple(info["shape"]), int(end) - int(start))
    return tensors
