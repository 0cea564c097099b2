"""The Triton ensemble's request fields, and their translation into one llmc request.

Every entry point that speaks the ensemble's vocabulary (KServe v2 HTTP generate, gRPC ModelInfer /
ModelStreamInfer, the ``llmc`` Python-backend model) parses through :func:`parse_generate_fields`, so the field
names, types and defaults are identical everywhere (triton.md, "Ensemble inputs").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Mapping

from llmc.errors import RequestError
from llmc.request.params import SamplingParams

Kind = Literal["string", "strings", "int", "uint", "float", "bool"]


@dataclass(frozen=True)
class FieldSpec:
    """One ensemble input: Triton datatype, dims (without the batch dim), llmc kind, SamplingParams target."""

    name: str
    datatype: str  # Triton wire datatype ("BYTES", "INT32", ...)
    dims: tuple[int, ...]
    kind: Kind
    param: str | None = None  # the SamplingParams field it sets, if any
    required: bool = False


ENSEMBLE_INPUTS: tuple[FieldSpec, ...] = (
    FieldSpec("text_input", "BYTES", (1,), "string", required=True),
    FieldSpec("max_tokens", "INT32", (1,), "int", "max_new_tokens", required=True),
    FieldSpec("stop_words", "BYTES", (-1,), "strings", "stop"),
    FieldSpec("bad_words", "BYTES", (-1,), "strings"),
    FieldSpec("end_id", "INT32", (1,), "int"),
    FieldSpec("pad_id", "INT32", (1,), "int"),
    FieldSpec("temperature", "FP32", (1,), "float", "temperature"),
    FieldSpec("top_k", "INT32", (1,), "int", "top_k"),
    FieldSpec("top_p", "FP32", (1,), "float", "top_p"),
    FieldSpec("repetition_penalty", "FP32", (1,), "float", "repetition_penalty"),
    FieldSpec("presence_penalty", "FP32", (1,), "float", "presence_penalty"),
    FieldSpec("frequency_penalty", "FP32", (1,), "float", "frequency_penalty"),
    FieldSpec("min_length", "INT32", (1,), "int", "min_tokens"),
    FieldSpec("random_seed", "UINT64", (1,), "uint", "seed"),
    FieldSpec("stream", "BOOL", (1,), "bool"),
    FieldSpec("exclude_input_in_output", "BOOL", (1,), "bool"),
)
ENSEMBLE_OUTPUTS: tuple[FieldSpec, ...] = (FieldSpec("text_output", "BYTES", (-1,), "string"),)
# llmc extras accepted by the HTTP generate endpoints (JSON only): SamplingParams fields without an ensemble name.
EXTRA_PARAMS = ("min_p", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "stop_token_ids")
SPECS = {spec.name: spec for spec in ENSEMBLE_INPUTS}
_WIRE_KINDS = {  # which wire datatypes a kind accepts (integers of any width, any float width)
    "string": {"BYTES"}, "strings": {"BYTES"}, "bool": {"BOOL"},
    "int": {"INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64"},
    "uint": {"INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64"},
    "float": {"FP16", "BF16", "FP32", "FP64"},
}


@dataclass(frozen=True)
class GenerateRequest:
    """A parsed generate request: the prompt text, its sampling parameters and the output options."""

    prompt: str
    params: SamplingParams
    stream: bool = False
    exclude_input_in_output: bool = True
    request_id: str | None = None


def check_wire_datatype(name: str, datatype: str) -> None:
    """RequestError unless ``datatype`` can carry ensemble input ``name`` (unknown names are refused too)."""
    spec = SPECS.get(name)
    if spec is None:
        raise RequestError(name, f"unknown input; the inputs are: {', '.join(SPECS)}")
    if datatype not in _WIRE_KINDS[spec.kind]:
        raise RequestError(name, f"has datatype {datatype}, expected {spec.datatype}")


def parse_generate_fields(fields: Mapping[str, Any], defaults: SamplingParams, vocab_size: int | None = None,
                          allow_extras: bool = True) -> GenerateRequest:
    """Translate ensemble fields (already decoded to Python values) into a :class:`GenerateRequest`.

    Scalars may arrive as one-element lists (tensor form). ``end_id`` joins the stop token ids, ``min_length``
    becomes ``min_tokens``, ``random_seed`` becomes ``seed``; ``bad_words`` must be empty (the torch engine
    has no bad-word filter); ``pad_id`` is accepted and unused. With ``allow_extras``, the JSON-only llmc
    extras (:data:`EXTRA_PARAMS`) and ``id``/``request_id`` are accepted. Unknown fields, missing required
    fields and wrong types raise RequestError naming the field.
    """
    values = dict(fields)
    request_id = _pop_request_id(values) if allow_extras else None
    missing = [s.name for s in ENSEMBLE_INPUTS if s.required and values.get(s.name) is None]
    if missing:
        raise RequestError(missing[0], "is required (send e.g. {\"text_input\": \"Hello\", \"max_tokens\": 64})")
    changes: dict[str, Any] = {}
    stop_ids = list(defaults.stop_token_ids)
    decoded: dict[str, Any] = {}
    for name, raw in values.items():
        if name in EXTRA_PARAMS and allow_extras:
            changes[name] = raw
            continue
        spec = SPECS.get(name)
        if spec is None:
            known = list(SPECS) + (list(EXTRA_PARAMS) + ["id"] if allow_extras else [])
            raise RequestError(name, f"unknown field; the accepted fields are: {', '.join(known)}")
        if raw is None:
            continue
        decoded[name] = value = _coerce(spec, raw)
        if spec.param is not None:
            changes[spec.param] = value
    if decoded.get("bad_words"):
        raise RequestError("bad_words", "is not supported by llmc's engines; remove it or send an empty list")
    if "end_id" in decoded:
        stop_ids.append(decoded["end_id"])
    if stop_ids or "stop_token_ids" in changes:
        changes["stop_token_ids"] = list(changes.get("stop_token_ids", [])) + stop_ids
    params = defaults.replace(**changes).validate(vocab_size)
    prompt = decoded["text_input"]
    if not prompt:
        raise RequestError("text_input", "is empty; send at least one character")
    return GenerateRequest(prompt, params, bool(decoded.get("stream", False)),
                           bool(decoded.get("exclude_input_in_output", True)), request_id)


def _pop_request_id(values: dict[str, Any]) -> str | None:
    rid = values.pop("id", None)
    rid = values.pop("request_id", rid)
    if rid is not None and not isinstance(rid, str):
        raise RequestError("id", f"must be a string, got {type(rid).__name__}")
    return rid or None


def _coerce(spec: FieldSpec, raw: Any) -> Any:
    """One field's value, checked against its kind (a one-element list stands for a scalar)."""
    if spec.kind == "strings":
        items = [raw] if isinstance(raw, (str, bytes)) else raw
        if not isinstance(items, (list, tuple)):
            raise RequestError(spec.name, f"must be a string or a list of strings, got {type(raw).__name__}")
        return [_as_text(spec.name, item) for item in items if item not in ("", b"")]
    if isinstance(raw, (list, tuple)):
        if len(raw) != 1:
            raise RequestError(spec.name, f"must be a single value, got {len(raw)} values")
        raw = raw[0]
    if hasattr(raw, "item"):  # numpy scalar from a tensor
        raw = raw.item()
    if spec.kind == "string":
        return _as_text(spec.name, raw)
    if spec.kind == "bool":
        if not isinstance(raw, bool):
            raise RequestError(spec.name, f"must be true or false, got {raw!r}")
        return raw
    if spec.kind in ("int", "uint"):
        if not isinstance(raw, int) or isinstance(raw, bool):
            raise RequestError(spec.name, f"must be an integer, got {raw!r}")
        if spec.kind == "uint" and raw < 0:
            raise RequestError(spec.name, f"must be >= 0, got {raw}")
        if spec.name == "max_tokens" and raw <= 0:
            raise RequestError(spec.name, f"must be >= 1, got {raw}; ask for at least one token")
        return raw
    if not isinstance(raw, (int, float)) or isinstance(raw, bool) or not math.isfinite(raw):
        raise RequestError(spec.name, f"must be a finite number, got {raw!r}")
    return float(raw)


def _as_text(name: str, value: Any) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(name, "is not valid UTF-8; send UTF-8 encoded text") from None
    if not isinstance(value, str):
        raise RequestError(name, f"must be a string, got {type(value).__name__}")
    return value
