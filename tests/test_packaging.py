"""pyproject.toml ships every llmc package and the Triton templates (a wheel install has no checkout)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_listed_and_templates_are_mapped():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(project["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "llmc").rglob("__init__.py")}
    assert on_disk <= listed, f"add to [tool.setuptools] packages: {sorted(on_disk - listed)}"
    assert project["tool"]["setuptools"]["package-dir"]["llmc.serve.model_repo"] == "model_repo"
    data = project["tool"]["setuptools"]["package-data"]["llmc.serve.model_repo"]
    templates = {p.relative_to(ROOT / "model_repo") for p in (ROOT / "model_repo").rglob("*") if p.is_file()}
    shipped = {t for t in templates if any(t.match(pattern) for pattern in data)}
    assert shipped == {t for t in templates if t.suffix in (".pbtxt", ".py")} and shipped
    # The CPU kernels' C++ sources and headers are compiled on the user's machine: the wheel must carry them.
    sources = {p.name for p in (ROOT / "llmc" / "engine" / "torch" / "csrc").iterdir() if p.suffix in (".cpp", ".h")}
    patterns = project["tool"]["setuptools"]["package-data"]["llmc.engine.torch"]
    assert {"vec_math.h", "bindings.cpp"} <= sources
    assert all(any(Path("csrc", name).match(pattern) for pattern in patterns) for name in sources)
    # So are the CUDA kernels' sources (nvcc on the GPU machine) and the int4 kernels' tuned config table.
    cuda = [Path("csrc_cuda", p.name) for p in (ROOT / "llmc" / "engine" / "torch" / "csrc_cuda").glob("*.cu")]
    assert cuda and all(any(path.match(pattern) for pattern in patterns) for path in cuda)
    assert any(Path("int4_cuda_configs.json").match(pattern) for pattern in patterns)


def test_console_script_points_at_the_cli():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["llmc"] == "llmc.cli:main"
