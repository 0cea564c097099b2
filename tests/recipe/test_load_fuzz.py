"""Fuzzing the recipe loader (issue 18): any file ends in a RecipeError or a valid recipe, never a traceback."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml
from hypothesis import strategies as st

from llmc.recipe.load import load_recipe, parse_recipe_text
from tests.fuzzing import JSON, fuzz_tests, mutations, scratch_dir

VALID = Path(__file__).resolve().parents[2] / "recipes" / "smollm2-135m-awq.yaml"
VALID_DICT = yaml.safe_load(VALID.read_text())


def _paths(d: dict, prefix: tuple = ()) -> list[tuple]:
    out = []
    for key, value in d.items():
        out.append(prefix + (key,))
        if isinstance(value, dict):
            out += _paths(value, prefix + (key,))
    return out


PATHS = _paths(VALID_DICT)


@st.composite
def mutated_recipes(draw) -> str:
    """The AWQ recipe with a few keys replaced by random values, removed, or joined by unknown ones."""
    d = copy.deepcopy(VALID_DICT)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(PATHS))
        parent = d
        for key in path[:-1]:
            parent = parent.get(key) if isinstance(parent, dict) else None
        if not isinstance(parent, dict):
            continue
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if action == "replace":
            parent[path[-1]] = draw(JSON)
        elif action == "delete":
            parent.pop(path[-1], None)
        else:
            parent[draw(st.text(max_size=8))] = draw(JSON)
    return yaml.safe_dump(d, allow_unicode=True)


NESTED = st.sampled_from([10, 400, 1500]).map(lambda d: "[" * d + "]" * d)  # past the YAML parser's recursion
TEXTS = st.one_of(mutated_recipes(), st.text(max_size=200), NESTED)


def check_text(text: str) -> None:
    parse_recipe_text(text, VALID, check_inputs=False)


test_recipe_text, test_recipe_text_slow = fuzz_tests(TEXTS, check_text)

_DIR = scratch_dir("llmc-recipe-fuzz-")


def check_file(data: bytes) -> None:
    path = _DIR / "recipe.yaml"
    path.write_bytes(data)
    load_recipe(path, check_inputs=False)


test_recipe_file, test_recipe_file_slow = fuzz_tests(mutations(VALID.read_bytes()), check_file)
