"""vLLM's structured-output fields on the OpenAI routes, read as llmc's ``structured`` formats (pure, no HTTP), so
requests written for vLLM run unchanged.

- ``structured_outputs`` (vLLM 0.12 and later): an object with one of ``json`` (a JSON schema, as an object or as
  JSON text), ``regex``, ``choice``, ``grammar``, ``json_object: true``.
- The fields it replaced, which older clients still send: ``guided_json``, ``guided_regex``, ``guided_choice``,
  ``guided_grammar``; ``guided_decoding_backend`` is accepted and picks nothing (llmc has one backend, llguidance).

A grammar with ``::=`` rules is EBNF (GBNF, XGrammar's syntax, which vLLM's default backend reads); any other is
Lark. Options llmc cannot honour (``whitespace_pattern``, ``structural_tag``, ...) are a 400 naming them, and so is
a second format (these fields with ``response_format`` or llmc's ``structured``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from llmc.errors import RequestError, short_repr

FORMATS = ("json", "regex", "choice", "grammar", "json_object")
LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# structured_outputs' options that change the format in ways llmc cannot (null or false ask for nothing)
UNSUPPORTED = ("whitespace_pattern", "structural_tag", "disable_any_whitespace", "disable_fallback",
               "disable_additional_properties")
FIELDS = ("structured_outputs", *LEGACY, "guided_decoding_backend", "guided_whitespace_pattern")


def vllm_output_format(body: Mapping[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """llmc's ``structured`` format (:class:`~llmc.request.structured.OutputFormat`'s dict) from the body's vLLM
    fields, and the client's name of the field it came from (for later errors); ``(None, "")`` without one."""
    if body.get("guided_whitespace_pattern") is not None:
        raise RequestError("guided_whitespace_pattern", "is not supported by llmc (its JSON has no free "
                                                        "whitespace); remove it")
    given = [key for key in ("structured_outputs", *LEGACY) if body.get(key) is not None]
    if not given:
        return None, ""
    if len(given) > 1:
        raise RequestError(given[1], f"and {given[0]} both set the output format; send one of them")
    if given[0] in LEGACY:
        return read_format(LEGACY[given[0]], body[given[0]], given[0]), given[0]
    spec = body["structured_outputs"]
    if not isinstance(spec, Mapping):
        raise RequestError("structured_outputs", f'must be an object such as {{"regex": "..."}}, got '
                                                 f'{short_repr(spec)}')
    for key in spec:
        if key in UNSUPPORTED and spec[key] not in (None, False):
            raise RequestError(f"structured_outputs.{key}", "is not supported by llmc; remove it")
        if key not in UNSUPPORTED and key not in FORMATS:
            raise RequestError(f"structured_outputs.{key}", f"unknown option; the formats are {', '.join(FORMATS)}")
    kinds = [key for key in FORMATS if spec.get(key) not in (None, False)]
    if len(kinds) != 1:
        raise RequestError("structured_outputs", f"must set exactly one of {', '.join(FORMATS)}, got "
                                                 f"{short_repr(dict(spec))}")
    where = f"structured_outputs.{kinds[0]}"
    return read_format(kinds[0], spec[kinds[0]], where), where


def read_format(kind: str, value: Any, where: str) -> dict[str, Any]:
    """llmc's format from one of :data:`FORMATS` and its value (``where``: the client's name of the value)."""
    if kind == "json_object":
        if value is not True:
            raise RequestError(where, f"must be true, got {short_repr(value)}")
        return {"type": "json_object"}
    if kind == "json":
        schema = value
        if isinstance(value, str):
            try:
                schema = json.loads(value)
            except json.JSONDecodeError as exc:
                raise RequestError(where, f"is not valid JSON ({exc.msg} at character {exc.pos})") from None
        if not isinstance(schema, (Mapping, bool)):
            raise RequestError(where, f"must be a JSON schema (an object), got {short_repr(value)}")
        return {"type": "json_schema", "schema": schema}
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise RequestError(where, f"must be a non-empty list of non-empty strings, got {short_repr(value)}")
        return {"type": "choice", "choices": value}
    if not isinstance(value, str) or not value:
        raise RequestError(where, f"must be a non-empty string, got {short_repr(value)}")
    if kind == "regex":
        return {"type": "regex", "pattern": value}
    return {"type": "ebnf" if "::=" in value else "grammar", "grammar": value}
