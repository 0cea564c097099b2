"""The root command: every subcommand is registered, has --help, and LlmcError becomes `error:` + exit 2."""

from __future__ import annotations

import subprocess
import sys

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
