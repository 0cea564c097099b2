"""The one reader of safetensors headers: tensor names, dtypes, shapes and offsets without loading any tensor.

Torch-free on purpose: ``llmc validate`` sniffs a model source's weights with it before anything heavy loads.
The IR reader (:mod:`llmc.checkpoint.io`), the TensorRT-LLM backend's IR checks, ``llmc inspect`` and the
model-source checks (:mod:`llmc.source`) all use it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from llmc.errors import CheckpointError

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format caps a header at 100 MB: a larger length means not safetensors


def read_safetensors_header(path: str | Path) -> dict[str, Any]:
    """The JSON header of a safetensors file ({name: {dtype, shape, data_offsets}, "__metadata__": ...}).

    Reads only the header, never tensor data. CheckpointError for a missing or malformed file.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: safetensors header of {length} bytes is implausible; file corrupt")
            header = json.loads(f.read(length))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    return header
