"""Imports between llmc's packages only go down the layers (docs/ARCHITECTURE.md, "Layers").

The test reads every module of ``llmc/`` with ``ast`` (nothing is imported), collects each import of an
llmc module -- at module level, inside functions, and ``"llmc.x.y"`` strings handed to ``importlib`` -- and
fails on an import that goes up a layer or sideways between two packages of one layer.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "llmc"

# Top to bottom. A module may import its own package and any package of a lower layer; never one above, never
# another package of its own layer.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("llmc", "llmc.cli"),  # the package face (``from llmc import Engine``) and the command line
    ("llmc.builder", "llmc.doctor"),
    ("llmc.serve", "llmc.bench"),
    ("llmc.runtime",),  # the Engine facade, scheduler, KV-block bookkeeping, the step loop
    ("llmc.engine",),  # backends: torch, tensorrt_llm; the scheduler -> runner contract
    ("llmc.source",),
    ("llmc.checkpoint",),
    ("llmc.manifest",),
    ("llmc.recipe",),
    ("llmc.request",),
    ("llmc.tokenizer",),
    ("llmc.errors", "llmc.console"),
)
# The only name other modules may take from the package face: everything else there is the public API.
FACE_NAMES_BELOW = {"__version__"}
MODULE_STRING = re.compile(r"^(llmc(?:\.\w+)+)(?::\w+)?$")  # "llmc.serve.commands:serve_cmd"


@dataclass(frozen=True)
class Import:
    """One import of an llmc module: where it is and what it names."""

    module: str  # the importing module, e.g. "llmc.runtime.api"
    line: int
    target: str  # the imported module, e.g. "llmc.engine.base"; "llmc" for the package face
    names: tuple[str, ...]  # names taken from the package face (``from llmc import __version__``)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    """True when ``name`` is a module or package of this checkout."""
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_in(source: str, text: str) -> list[Import]:
    """Every llmc import in ``text``, the code of module ``source``, wherever it stands in the file."""
    found: list[Import] = []
    for node in ast.walk(ast.parse(text, source)):
        if isinstance(node, ast.Import):
            found += [Import(source, node.lineno, a.name, ()) for a in node.names if a.name.split(".")[0] == "llmc"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] == "llmc":
            submodules = [a.name for a in node.names if is_module(f"{node.module}.{a.name}")]
            found += [Import(source, node.lineno, f"{node.module}.{name}", ()) for name in submodules]
            rest = tuple(a.name for a in node.names if a.name not in submodules)
            if rest:
                found.append(Import(source, node.lineno, node.module, rest))
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{source} line {node.lineno}: relative import; llmc uses absolute imports only")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = MODULE_STRING.match(node.value)
            if match and is_module(match.group(1)):
                found.append(Import(source, node.lineno, match.group(1), ()))
    return found


def layer_of(module: str) -> tuple[int, str]:
    """(layer index, owning package) of a module: the longest package prefix listed in LAYERS."""
    best: tuple[int, str] | None = None
    for index, packages in enumerate(LAYERS):
        for package in packages:
            inside = module == package or module.startswith(package + ".")
            if inside and (best is None or len(package) > len(best[1])):
                best = (index, package)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add its package to LAYERS in tests/test_layers.py")
    return best


def violation(imp: Import) -> str | None:
    """Why ``imp`` breaks the layering, or None."""
    if imp.target == "llmc":  # the package face
        if imp.module == "llmc" or set(imp.names) <= FACE_NAMES_BELOW:
            return None
        return f"takes {', '.join(imp.names)} from the package face; import it from its own module"
    source_layer, source_package = layer_of(imp.module)
    target_layer, target_package = layer_of(imp.target)
    if source_package == target_package:
        return None
    if target_layer < source_layer:
        return f"imports {imp.target}, a layer above {source_package}"
    if target_layer == source_layer:
        return f"imports {imp.target}, a sibling of {source_package} in the same layer"
    return None


def all_imports() -> list[Import]:
    return [imp for path in sorted(PACKAGE.rglob("*.py")) for imp in imports_in(module_name(path), path.read_text())]


def test_every_module_has_a_layer() -> None:
    for path in PACKAGE.rglob("*.py"):
        layer_of(module_name(path))


def test_imports_only_go_down() -> None:
    problems = [f"{imp.module} line {imp.line}: {why}" for imp in all_imports() if (why := violation(imp))]
    assert not problems, "upward or sideways imports:\n" + "\n".join(problems)


def test_the_package_face_imports_no_llmc_module_eagerly() -> None:
    """``import llmc`` (which every module and ``llmc --help`` run) stays cheap: the public API names are
    resolved on first use."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    eager = [node.lineno for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
             and imports_in("llmc", ast.unparse(node))]
    assert not eager


@pytest.mark.parametrize("source, expected", [
    ("from llmc.engine.base import load_runner\n", "llmc.engine.base"),
    ("def f():\n    from llmc.runtime.api import Engine\n", "llmc.runtime.api"),
    ("import llmc.serve.run\n", "llmc.serve.run"),
    ("from llmc import manifest as mf\n", "llmc.manifest"),
    ("TARGET = 'llmc.builder.pipeline:build'\n", "llmc.builder.pipeline"),
])
def test_imports_are_found_wherever_they_stand(source: str, expected: str) -> None:
    """The walk sees in-function imports and importlib strings, which is where upward imports used to hide."""
    assert [imp.target for imp in imports_in("llmc.engine.probe", source)] == [expected]


@pytest.mark.parametrize("importer, target, names, broken", [
    ("llmc.engine.torch.runner", "llmc.runtime.api", (), True),  # up
    ("llmc.serve.run", "llmc.bench.commands", (), True),  # sideways
    ("llmc.runtime.api", "llmc.engine.base", (), False),  # down
    ("llmc.serve.server", "llmc", ("__version__",), False),
    ("llmc.serve.server", "llmc", ("Engine",), True),
    ("llmc.builder.pipeline", "llmc.builder.export", (), False),  # inside one package
])
def test_the_rule(importer: str, target: str, names: tuple[str, ...], broken: bool) -> None:
    assert (violation(Import(importer, 1, target, names)) is not None) == broken
