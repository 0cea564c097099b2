"""The schema: bounds, the documented key set, and docs/RECIPE.md covering every key."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from llmc.recipe.parse import yaml_keys
from llmc.recipe.schema import ModelSource, Range, Recipe
from tests.recipe.conftest import REPO


def all_key_paths(cls: type = Recipe, prefix: str = "") -> list[str]:
    """Every YAML key path of the schema, sections included."""
    hints = typing.get_type_hints(cls)
    paths = []
    for name in yaml_keys(cls):
        path = f"{prefix}.{name}" if prefix else name
        paths.append(path)
        if dataclasses.is_dataclass(hints[name]) and hints[name] is not ModelSource:  # a string in YAML
            paths.extend(all_key_paths(hints[name], path))
    return paths


def test_docs_describe_every_key():
    doc = (REPO / "docs" / "RECIPE.md").read_text()
    missing = [p for p in all_key_paths() if p.count(".") > 0 and f"`{p}`" not in doc]
    missing += [p for p in all_key_paths() if "." not in p and f"| `{p}` |" not in doc]
    assert missing == []


def test_top_level_keys_are_the_documented_sections():
    assert yaml_keys(Recipe) == ["name", "model", "quantization", "engine", "kv_cache", "backend", "tensorrt_llm",
                                 "runtime", "serving"]


@pytest.mark.parametrize("bounds, inside, outside, text", [
    (Range(ge=1), [1, 10**9], [0, -1, float("nan")], ">= 1"),
    (Range(gt=0, le=1), [1e-9, 1.0], [0, 1.0001], "> 0 and <= 1"),
    (Range(ge=1, le=65535), [1, 65535], [0, 65536], ">= 1 and <= 65535"),
])
def test_range(bounds, inside, outside, text):
    assert all(bounds.contains(v) for v in inside)
    assert not any(bounds.contains(v) for v in outside)
    assert bounds.describe() == text
