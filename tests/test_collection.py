"""The default test command collects every test file (pytest's default ``norecursedirs`` once hid tests/build/)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _collected_files(*args: str, tmp: Path | None = None) -> set[str]:
    # ``-m "gpu or not gpu"`` overrides the default ``-m 'not gpu'`` of addopts: a file of GPU tests is collected
    # (and deselected) by the default command, and this check is about collection, not selection.
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu or not gpu", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **({"TMPDIR": str(tmp)} if tmp else {})})
    assert proc.returncode == 0, f"collection failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return {line.split("::", 1)[0] for line in proc.stdout.splitlines() if "::" in line}


def test_every_test_file_is_collected_by_the_default_command(tmp_path):
    on_disk = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py")
               if "__pycache__" not in p.parts}
    collected = _collected_files(tmp=tmp_path)
    # Importing the test modules leaves nothing in the temp folder (the fuzz modules' folders once stayed behind
    # after every run: tests/fuzzing.py's scratch_dir removes them at exit). torch's compile cache is one folder
    # per user, reused by every run.
    left = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("torchinductor_"))
    assert not left, f"collecting the tests left {left} in the temp folder"
    missing = sorted(on_disk - collected)
    assert not missing, (f"{len(missing)} test files are not collected by `python -m pytest`: {missing}; "
                         "check norecursedirs in pyproject.toml and that each file defines tests")
    assert "tests/builder/test_pipeline.py" in collected


def test_a_folder_named_build_is_collected(tmp_path):
    # The same collection on a folder named like one pytest's defaults skip: with llmc's explicit norecursedirs
    # a tests/build/ folder is collected too (so the rename is not what keeps the builder tests running).
    hidden = tmp_path / "build"
    hidden.mkdir()
    (hidden / "test_probe.py").write_text("def test_probe():\n    assert True\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", f"--rootdir={ROOT}",
                           "-c", str(ROOT / "pyproject.toml"), str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "build/test_probe.py::test_probe" in proc.stdout, proc.stdout[-2000:]
