"""Text Generation Inference's output-format object, ``{"type": "json" | "json_object" | "json_schema" | "regex",
"value": ...}``, read as llmc's ``structured`` format (pure). TGI takes it as ``parameters.grammar`` on ``/generate``
and as ``response_format`` on its chat route, where huggingface_hub's ``InferenceClient.chat_completion`` sends an
OpenAI ``json_schema`` format rewritten as ``{"type": "json_object", "value": schema}``
(huggingface/text-generation-inference@db931fc ``router/src/lib.rs``, ``GrammarType``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmc.errors import RequestError, short_repr
from llmc.serve.vllm_structured import read_format

GRAMMARS = ("json", "json_object", "json_schema", "regex")


def tgi_output_format(grammar: Any, where: str) -> dict[str, Any] | None:
    """llmc's format from TGI's object (None: none); RequestError naming ``where`` (or ``where.value``)."""
    if grammar is None:
        return None
    if not isinstance(grammar, Mapping) or grammar.get("type") not in GRAMMARS or set(grammar) != {"type", "value"}:
        raise RequestError(where, f'must be {{"type": "json" | "json_object" | "json_schema" | "regex", "value": '
                                  f'...}}, got {short_repr(grammar)}')
    kind, value = grammar["type"], grammar["value"]
    if kind == "json_schema":  # TGI's JsonSchemaConfig
        if not isinstance(value, Mapping) or "schema" not in value or not set(value) <= {"name", "schema"}:
            raise RequestError(f"{where}.value", f'must be {{"name": ..., "schema": {{...}}}}, got {short_repr(value)}')
        value = value["schema"]
    return read_format("regex" if kind == "regex" else "json", value, f"{where}.value")
