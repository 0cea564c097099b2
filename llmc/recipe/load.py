"""Load recipes from YAML or plain dicts, and turn them back into canonical JSON-able dicts and hashes.

``load_recipe(path)`` is the edge where recipe text becomes a frozen, validated :class:`Recipe`; everything
inward takes the Recipe. ``recipe_to_dict`` gives the resolved form (absolute paths as strings, every default
filled in) that build manifests store and ``recipe_from_dict`` reads back unchanged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

from llmc.errors import RecipeError
from llmc.recipe.parse import ROOT, Context, parse_section
from llmc.recipe.schema import ModelSource, Recipe
from llmc.request.structured import OutputFormat
from llmc.recipe.validate import validate_recipe


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (PyYAML silently keeps the last one)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {seen[key] + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_recipe(path: str | Path, *, check_inputs: bool = True) -> Recipe:
    """Read, parse and validate the recipe YAML at ``path``.

    Relative paths inside it resolve against its folder. Raises RecipeError (file, key path, fix) for a
    missing file, YAML syntax errors (with line and column) and every schema or consistency problem.
    ``check_inputs``: see :func:`recipe_from_dict`.
    """
    path = Path(path)
    if not path.is_file():
        raise RecipeError(str(path), ROOT, "recipe file not found", "check the path (e.g. recipes/smollm2-135m.yaml)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise RecipeError(str(path), ROOT, f"the file is not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
                                           f"{err.start})", "save the recipe as UTF-8 (it is a YAML text file)") from None
    except OSError as err:
        raise RecipeError(str(path), ROOT, f"cannot read the file ({err.strerror or err})",
                          "check the path and its permissions") from None
    return parse_recipe_text(text, path, check_inputs=check_inputs)


def parse_recipe_text(text: str, path: str | Path, *, check_inputs: bool = True) -> Recipe:
    """Parse and validate recipe YAML ``text`` (read from ``path``, which relative paths resolve against).

    RecipeError for every problem, including YAML nested too deeply for the parser's recursion."""
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise RecipeError(str(path), ROOT, f"YAML syntax error{where}: {err.problem or err}",
                          f"fix the YAML{where} (indentation, `key: value` colons, quotes)") from err
    except yaml.YAMLError as err:
        raise RecipeError(str(path), ROOT, f"YAML error: {err}", "fix the YAML syntax") from err
    except RecursionError:
        raise RecipeError(str(path), ROOT, "the YAML nests too deeply to parse",
                          "write the recipe as the flat mapping docs/RECIPE.md describes") from None
    if data is None:
        raise RecipeError(str(path), ROOT, "the file is empty", "write a recipe (see docs/RECIPE.md)")
    return recipe_from_dict(data, file=Path(path), check_inputs=check_inputs)


def recipe_from_dict(d: Any, file: str | Path | None = None, *, check_inputs: bool = True) -> Recipe:
    """Parse and validate a recipe given as plain data (the YAML document, or ``recipe_to_dict`` output).

    Relative paths resolve against ``file``'s folder, or the current directory when ``file`` is None.
    ``check_inputs=False`` skips the existence checks of calibration/chat-template files and optional
    packages (used when re-reading a recipe recorded in a build manifest).
    """
    file_path = Path(file) if file is not None else None
    base_dir = file_path.parent.absolute() if file_path is not None else Path.cwd()
    ctx = Context(file=str(file_path) if file_path is not None else None, base_dir=base_dir)
    recipe = parse_section(Recipe, d, ctx, "")
    recipe = dataclasses.replace(recipe, path=file_path)
    validate_recipe(recipe, ctx, check_inputs=check_inputs)
    return recipe


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """The resolved recipe as JSON-able data: every key present, paths absolute strings, tuples as lists.

    ``recipe_from_dict(recipe_to_dict(r)) == r``. ``recipe.path`` is not included.
    """
    return _to_plain(recipe)


def _to_plain(value: Any) -> Any:
    if isinstance(value, ModelSource):
        return str(value)
    if isinstance(value, OutputFormat):  # runtime.sampling.structured: the mapping the recipe takes
        return value.to_dict()
    if dataclasses.is_dataclass(value):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                if not f.metadata.get("internal")}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    return value


def canonical_json(recipe: Recipe) -> str:
    """The recipe's canonical JSON text: sorted keys, no spaces (what :func:`recipe_hash` hashes)."""
    return json.dumps(recipe_to_dict(recipe), sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def recipe_hash(recipe: Recipe) -> str:
    """sha256 hex digest of the canonical JSON of the resolved recipe (stable across runs and key order)."""
    return hashlib.sha256(canonical_json(recipe).encode("utf-8")).hexdigest()
