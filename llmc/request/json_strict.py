"""A JSON schema's objects closed to properties they do not name, the way XGrammar reads schemas in its strict mode
(the default of ``GrammarCompiler.compile_json_schema``, which vLLM's and TensorRT-LLM's default backend call with
it: mlc-ai/xgrammar@53da3ff ``python/xgrammar/compiler.py``, ``cpp/json_schema_converter.cc``). JSON Schema itself
allows any further property when ``additionalProperties`` is absent, and llguidance follows it: asked for a tool's
``{"city": ...}``, SmolLM2 wrote ``{"city": "Paris", "weather": {"description": ...`` until ``max_tokens`` ran out.

An object schema that lists ``properties`` and says nothing of others (no ``additionalProperties``,
``unevaluatedProperties`` or ``patternProperties``) gets ``"additionalProperties": false``; ``{"type": "object"}``
(no properties named) stays any object, as in XGrammar, and ``"additionalProperties": true`` keeps them open. A
schema with an ``allOf`` of two or more parts is left as it is: closing each part would forbid the others'
properties.
"""

from __future__ import annotations

from typing import Any

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("items", "prefixItems", "anyOf", "oneOf")
_SCHEMAS = ("items", "additionalProperties", "unevaluatedProperties", "additionalItems", "unevaluatedItems",
            "contains", "not", "if", "then", "else", "propertyNames")
_OPEN = ("additionalProperties", "unevaluatedProperties", "patternProperties")


def close_objects(schema: Any) -> Any:
    """``schema`` (parsed JSON; not changed) with its objects closed as the module says; a copy where anything
    changed."""
    if _has_intersection(schema):
        return schema
    return _close(schema)


def _close(schema: Any) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_close(sub) for sub in out[key]]
    for key in _SCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = _close(out[key])
    if isinstance(out.get("properties"), dict) and not any(key in out for key in _OPEN):
        out["additionalProperties"] = False
    return out


def _has_intersection(schema: Any) -> bool:
    """True when some ``allOf`` anywhere in ``schema`` has two or more parts."""
    stack = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            parts = item.get("allOf")
            if isinstance(parts, list) and len(parts) > 1:
                return True
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False
