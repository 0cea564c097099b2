"""Helpers for recipe tests: write a minimal recipe with nested overrides to a temp folder."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
RECIPES_DIR = REPO / "recipes"
BASE = {"name": "test-recipe", "model": {"source": "model-dir"}}


def with_key(data: dict, key_path: str, value: Any) -> dict:
    """A deep copy of ``data`` with ``a.b.c`` set to ``value`` (creating sections on the way)."""
    out = copy.deepcopy(data)
    node = out
    *parents, last = key_path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return out


@pytest.fixture
def write_recipe(tmp_path: Path) -> Callable[..., Path]:
    """``write_recipe({"engine.tp_size": 2}, name="r.yaml")`` -> path of a YAML recipe in ``tmp_path``."""

    def write(overrides: dict[str, Any] | None = None, name: str = "recipe.yaml", base: dict | None = None) -> Path:
        data = copy.deepcopy(BASE if base is None else base)
        for key_path, value in (overrides or {}).items():
            data = with_key(data, key_path, value)
        path = tmp_path / name
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    return write
