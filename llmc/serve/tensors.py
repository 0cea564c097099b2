"""KServe v2 tensor encoding shared by the HTTP ``/infer`` endpoint and the gRPC server.

Raw tensor bytes are little-endian and row-major; a BYTES tensor is a sequence of elements, each a 4-byte
little-endian length followed by that many bytes (Triton's wire format).
"""

from __future__ import annotations

import struct
from typing import Any, Mapping, Sequence

import numpy as np

from llmc.errors import RequestError
from llmc.serve.protocol import check_wire_datatype, loads_json_object

NUMPY_DTYPES = {
    "BOOL": np.bool_, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
    "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
    "FP16": np.float16, "FP32": np.float32, "FP64": np.float64,
}


def serialize_bytes(elements: Sequence[bytes]) -> bytes:
    """Triton's BYTES wire format: ``<u32 length><bytes>`` per element."""
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def deserialize_bytes(raw: bytes, field: str = "raw_input_contents") -> list[bytes]:
    """Inverse of :func:`serialize_bytes`; RequestError naming ``field`` on a truncated buffer."""
    out, pos = [], 0
    while pos < len(raw):
        if pos + 4 > len(raw):
            raise RequestError(field, "a BYTES tensor is truncated (a length prefix is cut off)")
        (n,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if pos + n > len(raw):
            raise RequestError(field, "a BYTES tensor is truncated (an element is cut off)")
        out.append(raw[pos:pos + n])
        pos += n
    return out


def decode_raw(name: str, datatype: str, raw: bytes) -> list[Any]:
    """The flat element list of one raw input tensor (BYTES elements stay ``bytes``)."""
    check_wire_datatype(name, datatype)
    if datatype == "BYTES":
        return deserialize_bytes(raw, name)
    if datatype == "BF16":  # no numpy dtype: the upper half of a float32
        if len(raw) % 2:
            raise RequestError(name, f"raw data of {len(raw)} bytes is not a whole number of BF16 elements")
        halves = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        return halves.view(np.float32).tolist()
    dtype = np.dtype(NUMPY_DTYPES[datatype])
    if len(raw) % dtype.itemsize:
        raise RequestError(name, f"raw data of {len(raw)} bytes is not a whole number of {datatype} elements")
    return np.frombuffer(raw, dtype=dtype.newbyteorder("<")).tolist()


def parse_infer_body(raw: bytes, header_length: str | None = None) -> tuple[str, dict[str, list[Any]]]:
    """``(id, {input name: flat element list})`` of a KServe v2 ``/infer`` body.

    ``header_length`` is the ``Inference-Header-Content-Length`` header of the binary-data extension: the
    JSON header is ``raw[:header_length]`` and each input with ``parameters.binary_data_size`` takes that many
    of the bytes after it, in order. Every malformed part is a RequestError naming it (``inputs[1].datatype``);
    a size that runs past the body, or bytes left over, are errors, never a silent cut."""
    split = len(raw) if header_length is None else _header_length(header_length, len(raw))
    body = loads_json_object(raw[:split])
    inputs = body.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise RequestError("inputs", "must be a non-empty list of {\"name\", \"datatype\", \"shape\", \"data\"} "
                                     "objects")
    request_id = body.get("id", "")
    if not isinstance(request_id, str):
        raise RequestError("id", f"must be a string, got {type(request_id).__name__}")
    tensors: dict[str, list[Any]] = {}
    offset = split
    for i, tensor in enumerate(inputs):
        name, datatype, size = _tensor_header(tensor, f"inputs[{i}]")
        if name in tensors:
            raise RequestError(f"inputs[{i}].name", f"{name!r} appears twice; send each input once")
        if size is None:
            if "data" not in tensor:
                raise RequestError(f"inputs[{i}].data", "is required (or parameters.binary_data_size)")
            tensors[name] = decode_json_data(name, datatype, tensor["data"])
            continue
        if offset + size > len(raw):
            raise RequestError(f"inputs[{i}].parameters.binary_data_size",
                               f"is {size} bytes, but only {len(raw) - offset} bytes of binary data are left")
        tensors[name] = decode_raw(name, datatype, raw[offset:offset + size])
        offset += size
    if offset != len(raw):
        raise RequestError("body", f"has {len(raw) - offset} bytes after the last binary input; check "
                                   f"binary_data_size and Inference-Header-Content-Length")
    return request_id, tensors


def _header_length(value: str, body_size: int) -> int:
    try:
        split = int(value)
    except ValueError:
        raise RequestError("Inference-Header-Content-Length", f"must be an integer, got {value!r}") from None
    if not 0 <= split <= body_size:
        raise RequestError("Inference-Header-Content-Length", f"is {split}, outside the body's {body_size} bytes")
    return split


def _tensor_header(tensor: Any, where: str) -> tuple[str, str, int | None]:
    """(name, datatype, binary_data_size or None) of one input object."""
    if not isinstance(tensor, dict):
        raise RequestError(where, f"must be an object with name, datatype, shape and data, got "
                                  f"{type(tensor).__name__}")
    name, datatype = tensor.get("name"), tensor.get("datatype")
    if not isinstance(name, str):
        raise RequestError(f"{where}.name", "is required and must be a string (e.g. \"text_input\")")
    if not isinstance(datatype, str):
        raise RequestError(f"{where}.datatype", "is required and must be a string (e.g. \"BYTES\", \"INT32\")")
    parameters = tensor.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise RequestError(f"{where}.parameters", "must be an object")
    size = parameters.get("binary_data_size")
    if size is not None and (type(size) is not int or size < 0):
        raise RequestError(f"{where}.parameters.binary_data_size", f"must be a non-negative integer, got {size!r}")
    return name, datatype, size


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
