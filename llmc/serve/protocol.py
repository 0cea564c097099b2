"""The Triton ensemble's request fields, and their translation into one llmc request.

Every entry point that speaks the ensemble's vocabulary (KServe v2 HTTP generate, gRPC ModelInfer /
ModelStreamInfer, the ``llmc`` Python-backend model) parses through :func:`parse_generate_fields`, so the field
names, types and defaults are identical everywhere (triton.md, "Ensemble inputs"). The optional input
``return_log_probs`` and the outputs ``cum_log_probs`` / ``output_log_probs`` are tensorrtllm_backend's
(:mod:`llmc.serve.ensemble_logprobs` fills them), and so are the guided-decoding inputs ``guided_decoding_guide_type``
(``json``, ``json_schema``, ``regex``, ``ebnf_grammar``) and ``guided_decoding_guide`` (the schema, pattern or
grammar), which set ``SamplingParams.structured``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
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
    FieldSpec("return_log_probs", "BOOL", (1,), "bool"),  # sets SamplingParams.logprobs = 0
    FieldSpec("guided_decoding_guide_type", "BYTES", (1,), "string"),  # with the guide: SamplingParams.structured
    FieldSpec("guided_decoding_guide", "BYTES", (1,), "string"),
)
# tensorrtllm_backend's guide types (tensorrt_llm/1/model.py get_guided_decoding_params_from_request, c2e65b88) ->
# llmc's output format kinds and the key its guide goes under (None: the type takes no guide).
GUIDE_TYPES = {"json": ("json_object", None), "json_schema": ("json_schema", "schema"), "regex": ("regex", "pattern"),
               "ebnf_grammar": ("ebnf", "grammar")}
# cum_log_probs [beams] and output_log_probs [beams, tokens]: only in responses to return_log_probs: true.
ENSEMBLE_OUTPUTS: tuple[FieldSpec, ...] = (FieldSpec("text_output", "BYTES", (-1,), "string"),
                                           FieldSpec("cum_log_probs", "FP32", (-1,), "float"),
                                           FieldSpec("output_log_probs", "FP32", (-1, -1), "float"))
# llmc extras accepted by the HTTP generate endpoints (JSON only): SamplingParams fields without an ensemble name.
EXTRA_PARAMS = ("min_p", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "stop_token_ids")
SPECS = {spec.name: spec for spec in ENSEMBLE_INPUTS}
# llmc's internal names (SamplingParams fields, the engine's "prompt") -> the ensemble's names, for errors.
ENSEMBLE_NAMES = {"prompt": "text_input", "max_new_tokens": "max_tokens", "min_tokens": "min_length",
                  "seed": "random_seed", "stop": "stop_words", "logprobs": "return_log_probs",
                  "structured": "guided_decoding_guide"}
# JSON request bodies nest a few levels (messages -> content parts); deeper ones are refused before any walk.
MAX_JSON_DEPTH = 32
# Stop strings are matched on every generated token inside the engine's step, so their number and length
# bound the step time of every request in the batch.
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 32, 1024, 1024
_SURROGATE = re.compile("[\ud800-\udfff]")
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
    strict_max_tokens: bool = False  # 400 instead of a cap when max_tokens exceeds what the prompt leaves room for
    return_log_probs: bool = False  # responses carry cum_log_probs and output_log_probs


def loads_json_object(raw: bytes, what: str = "body") -> dict[str, Any]:
    """Parse a request body that must be a JSON object; RequestError naming ``what`` (or the field) otherwise.

    Refuses what would fail later as a 500: nesting deeper than :data:`MAX_JSON_DEPTH`, and strings (keys
    or values) holding a lone UTF-16 surrogate such as ``"\\ud800"``, which no tokenizer or UTF-8 encoder takes.
    """
    try:
        body = json.loads(raw)
    except RecursionError:
        raise RequestError(what, f"nests deeper than {MAX_JSON_DEPTH} levels; send a flat JSON object") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise RequestError(what, f"is not valid JSON ({exc}); send a JSON object") from None
    if not isinstance(body, dict):
        raise RequestError(what, f"must be a JSON object, got {type(body).__name__}")
    check_json_value(body)
    return body


def check_json_value(value: Any) -> None:
    """RequestError for nesting deeper than :data:`MAX_JSON_DEPTH` or a string with a lone surrogate; the
    error names the path (``messages[0].content``). Iterative, so no input can exhaust the stack."""
    stack: list[tuple[str, Any, int]] = [("", value, 0)]
    while stack:
        path, item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            top = re.split(r"[.\[]", path.lstrip("."), maxsplit=1)[0] or "body"
            raise RequestError(top, f"nests deeper than {MAX_JSON_DEPTH} levels; send a flat JSON object")
        if isinstance(item, str):
            if _SURROGATE.search(item):
                raise RequestError(path.lstrip(".") or "body", "holds a lone UTF-16 surrogate (e.g. \\ud800), "
                                                               "which is not text; send valid Unicode")
        elif isinstance(item, dict):
            for key, child in item.items():
                if _SURROGATE.search(key):
                    raise RequestError(path.lstrip(".") or "body", "has a key with a lone UTF-16 surrogate; "
                                                                   "send valid Unicode")
                stack.append((f"{path}.{key}", child, depth + 1))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", child, depth + 1) for i, child in enumerate(item))


def check_param_limits(params: SamplingParams) -> SamplingParams:
    """RequestError when the stop lists exceed what one request may ask of the shared step loop."""
    if len(params.stop) > MAX_STOP_STRINGS:
        raise RequestError("stop", f"has {len(params.stop)} stop strings; at most {MAX_STOP_STRINGS} are accepted")
    longest = max((len(s) for s in params.stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise RequestError("stop", f"has a stop string of {longest} characters; at most {MAX_STOP_CHARS} are "
                                   f"accepted")
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise RequestError("stop_token_ids", f"has {len(params.stop_token_ids)} ids; at most "
                                             f"{MAX_STOP_TOKEN_IDS} are accepted")
    return params


def with_client_names(exc: RequestError, names: Mapping[str, str]) -> RequestError:
    """``exc`` in the client's vocabulary: its field (``prompt[0]`` -> ``messages[0]``) and the internal
    parameter names in its message (``max_new_tokens`` -> ``max_tokens``) renamed through ``names``."""
    head, bracket, rest = exc.field.partition("[")
    field = names.get(head, head) + bracket + rest
    identifiers = [n for n in names if "_" in n]  # plain words ("prompt", "stop") also occur as prose
    message = exc.message
    if identifiers:
        pattern = r"\b(" + "|".join(map(re.escape, identifiers)) + r")\b"
        message = re.sub(pattern, lambda m: names[m.group(1)], message)
    return RequestError(field, message)


@contextmanager
def client_names(names: Mapping[str, str]) -> Iterator[None]:
    """Re-raise any RequestError of the block through :func:`with_client_names`."""
    try:
        yield
    except RequestError as exc:
        raise with_client_names(exc, names) from None


def model_metadata_dict(name: str) -> dict[str, Any]:
    """KServe v2 model metadata of the served model (the ensemble's tensors; dims with the batch dim)."""
    def tensors(specs: tuple[FieldSpec, ...]) -> list[dict[str, Any]]:
        return [{"name": s.name, "datatype": s.datatype, "shape": [-1, *s.dims]} for s in specs]

    return {"name": name, "versions": ["1"], "platform": "llmc",
            "inputs": tensors(ENSEMBLE_INPUTS), "outputs": tensors(ENSEMBLE_OUTPUTS)}


# The KServe / Triton protocol extensions the server metadata lists. Not "statistics": perf_analyzer then asks for
# no server-side statistics, which llmc does not keep in Triton's shape.
EXTENSIONS = ("generate", "model_configuration")


# KServe wire datatype -> Triton ModelConfig data_type
TRITON_DATA_TYPES = {"BYTES": "TYPE_STRING", "BOOL": "TYPE_BOOL", "INT32": "TYPE_INT32", "INT64": "TYPE_INT64",
                     "UINT64": "TYPE_UINT64", "FP32": "TYPE_FP32", "FP16": "TYPE_FP16"}


def config_tensor(spec: FieldSpec, output: bool = False) -> dict[str, Any]:
    """``spec`` as a ModelConfig ``input`` (with ``optional``) or ``output`` entry (the batch dim implied by
    ``max_batch_size``; Triton outputs have no ``optional``)."""
    tensor = {"name": spec.name, "data_type": TRITON_DATA_TYPES[spec.datatype], "dims": list(spec.dims)}
    return tensor if output else {**tensor, "optional": not spec.required}


def model_config_dict(name: str) -> dict[str, Any]:
    """The served model's Triton ModelConfig (JSON field names as Triton's ``/config`` writes them), which Triton's
    tools read before any request (perf_analyzer and genai-perf stop without it): one prompt per request
    (``max_batch_size`` 1: the engine batches requests itself), the ensemble's inputs with ``optional`` on all but
    ``text_input`` and ``max_tokens``, and ``decoupled`` (a streamed request gets a response per text delta;
    ModelInfer still answers with one)."""
    return {"name": name, "platform": "", "backend": "llmc", "max_batch_size": 1,
            "input": [config_tensor(s) for s in ENSEMBLE_INPUTS],
            "output": [config_tensor(s, output=True) for s in ENSEMBLE_OUTPUTS],
            "model_transaction_policy": {"decoupled": True}}


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
    becomes ``min_tokens``, ``random_seed`` becomes ``seed``, ``return_log_probs: true`` sets ``logprobs = 0``
    (each generated token's own log-probability, no alternatives); ``bad_words`` must be empty (the torch engine
    has no bad-word filter); ``pad_id`` is accepted and unused. With ``allow_extras``, the JSON-only llmc
    extras (:data:`EXTRA_PARAMS`), ``id``/``request_id`` and ``strict_max_tokens`` are accepted. Unknown
    fields, missing required fields and wrong types raise RequestError naming the ensemble's field (never an
    internal name such as ``max_new_tokens``).
    """
    with client_names(ENSEMBLE_NAMES):
        return _parse_generate_fields(dict(fields), defaults, vocab_size, allow_extras)


def _parse_generate_fields(values: dict[str, Any], defaults: SamplingParams, vocab_size: int | None,
                           allow_extras: bool) -> GenerateRequest:
    request_id = _pop_request_id(values) if allow_extras else None
    strict = values.pop("strict_max_tokens", False) if allow_extras else False
    if not isinstance(strict, bool):
        raise RequestError("strict_max_tokens", f"must be true or false, got {strict!r}")
    missing = [s.name for s in ENSEMBLE_INPUTS if s.required and values.get(s.name) is None]
    if missing:
        raise RequestError(missing[0], "is required (send e.g. {\"text_input\": \"Hello\", \"max_tokens\": 64})")
    changes: dict[str, Any] = {}
    stop_ids = list(defaults.stop_token_ids)
    decoded: dict[str, Any] = {}
    for name, raw in values.items():
        if name in EXTRA_PARAMS and allow_extras:
            if raw is not None:
                changes[name] = raw
            continue
        spec = SPECS.get(name)
        if spec is None:
            known = list(SPECS) + (list(EXTRA_PARAMS) + ["id", "strict_max_tokens"] if allow_extras else [])
            raise RequestError(name, f"unknown field; the accepted fields are: {', '.join(known)}")
        if raw is None:
            continue
        decoded[name] = value = _coerce(spec, raw)
        if spec.param is not None:
            changes[spec.param] = value
    if decoded.get("return_log_probs"):
        changes["logprobs"] = 0
    structured = guided_format(decoded.get("guided_decoding_guide_type"), decoded.get("guided_decoding_guide"))
    if structured is not None:
        changes["structured"] = structured
    if decoded.get("bad_words"):
        raise RequestError("bad_words", "is not supported by llmc's engines; remove it or send an empty list")
    if "end_id" in decoded:
        stop_ids.append(decoded["end_id"])
    if stop_ids or "stop_token_ids" in changes:
        requested = changes.get("stop_token_ids", [])
        if not isinstance(requested, (list, tuple)):
            raise RequestError("stop_token_ids", f"must be a list of token ids, got {requested!r}")
        changes["stop_token_ids"] = list(requested) + stop_ids
    params = check_param_limits(defaults.replace(**changes).validate(vocab_size))
    prompt = decoded["text_input"]
    if not prompt:
        raise RequestError("text_input", "is empty; send at least one character")
    return GenerateRequest(prompt, params, bool(decoded.get("stream", False)),
                           bool(decoded.get("exclude_input_in_output", True)), request_id, strict,
                           bool(decoded.get("return_log_probs", False)))


def flatten_generate_parameters(body: Mapping[str, Any]) -> dict[str, Any]:
    """A generate-extension request with its optional ``parameters`` object merged into the top level.

    Triton's generate extension defines ``{"id", "text_input", "parameters": {name: value}}`` and turns each
    parameter that names a model input into that input (triton-inference-server/server ``src/http_server.h``,
    ``ConfigureGenerateMappingSchema``, commit 4294e6ff631f368f123986fef902f004553db7d5), so
    ``{"text_input": "Hi", "parameters": {"max_tokens": 16, "temperature": 0}}`` is the same request as the flat
    form. A ``parameters`` that is not an object, a name given at both levels and a name that is no input or
    extra are RequestErrors naming ``parameters.<name>``.
    """
    fields = dict(body)
    parameters = fields.pop("parameters", None)
    if parameters is None:
        return fields
    if not isinstance(parameters, dict):
        raise RequestError("parameters", f"must be an object of name: value pairs, got {type(parameters).__name__} "
                                         f"(e.g. {{\"max_tokens\": 64, \"temperature\": 0.7}})")
    known = [*SPECS, *EXTRA_PARAMS, "strict_max_tokens"]
    for name, value in parameters.items():
        if name in fields:
            raise RequestError(f"parameters.{name}", "is also given at the top level; send it once")
        if name not in known:
            raise RequestError(f"parameters.{name}", f"unknown parameter; the accepted ones are: {', '.join(known)}")
        fields[name] = value
    return fields


def guided_format(guide_type: str | None, guide: str | None) -> dict[str, Any] | None:
    """``SamplingParams.structured`` from tensorrtllm_backend's guided-decoding inputs (:data:`GUIDE_TYPES`); an
    unknown type is an error here (the C++ backend would silently decode without a guide)."""
    if guide_type is None:
        if guide:
            raise RequestError("guided_decoding_guide", "needs guided_decoding_guide_type (json, json_schema, regex "
                                                        "or ebnf_grammar)")
        return None
    if guide_type not in GUIDE_TYPES:
        raise RequestError("guided_decoding_guide_type", f"must be one of {', '.join(GUIDE_TYPES)}, got "
                                                         f"{guide_type!r}")
    kind, key = GUIDE_TYPES[guide_type]
    if key is None:
        return {"type": kind}
    if not guide:
        raise RequestError("guided_decoding_guide", f"is required with guided_decoding_guide_type {guide_type!r}")
    if kind != "json_schema":
        return {"type": kind, key: guide}
    try:
        return {"type": kind, key: json.loads(guide)}
    except ValueError as exc:
        raise RequestError("guided_decoding_guide", f"must be a JSON schema as JSON text ({exc})") from None


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
