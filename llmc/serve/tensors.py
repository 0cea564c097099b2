"""KServe v2 tensor encoding shared by the HTTP ``/infer`` endpoint and the gRPC server.

Raw tensor bytes are little-endian and row-major; a BYTES tensor is a sequence of elements, each a 4-byte
little-endian length followed by that many bytes (Triton's wire format).
"""

from __future__ import annotations

import struct
from typing import Any, Mapping, Sequence

import numpy as np

from llmc.errors import RequestError
from llmc.serve.protocol import check_wire_datatype

NUMPY_DTYPES = {
    "BOOL": np.bool_, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
    "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
    "FP16": np.float16, "FP32": np.float32, "FP64": np.float64,
}


def serialize_bytes(elements: Sequence[bytes]) -> bytes:
    """Triton's BYTES wire format: ``<u32 length><bytes>`` per element."""
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def deserialize_bytes(raw: bytes) -> list[bytes]:
    """Inverse of :func:`serialize_bytes`; RequestError on a truncated buffer."""
    out, pos = [], 0
    while pos < len(raw):
        if pos + 4 > len(raw):
            raise RequestError("raw_input_contents", "a BYTES tensor is truncated (a length prefix is cut off)")
        (n,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if pos + n > len(raw):
            raise RequestError("raw_input_contents", "a BYTES tensor is truncated (an element is cut off)")
        out.append(raw[pos:pos + n])
        pos += n
    return out


def decode_raw(name: str, datatype: str, raw: bytes) -> list[Any]:
    """The flat element list of one raw input tensor (BYTES elements stay ``bytes``)."""
    check_wire_datatype(name, datatype)
    if datatype == "BYTES":
        return deserialize_bytes(raw)
    dtype = np.dtype(NUMPY_DTYPES[datatype])
    if len(raw) % dtype.itemsize:
        raise RequestError(name, f"raw data of {len(raw)} bytes is not a whole number of {datatype} elements")
    return np.frombuffer(raw, dtype=dtype.newbyteorder("<")).tolist()


def decode_json_data(name: str, datatype: str, data: Any) -> list[Any]:
    """The flat element list of one JSON tensor (``data`` may be nested lists)."""
    check_wire_datatype(name, datatype)
    flat: list[Any] = []

    def walk(x: Any) -> None:
        if isinstance(x, list):
            for item in x:
                walk(item)
        else:
            flat.append(x)

    walk(data)
    return flat


def tensors_to_fields(tensors: Mapping[str, list[Any]]) -> dict[str, Any]:
    """Ensemble fields from flat tensor element lists: batch size must be 1 (one prompt per request)."""
    fields: dict[str, Any] = {}
    for name, values in tensors.items():
        if name != "stop_words" and name != "bad_words" and len(values) != 1:
            raise RequestError(name, f"must hold exactly one element (batch size 1), got {len(values)}")
        fields[name] = values if name in ("stop_words", "bad_words") else values[0]
    return fields
