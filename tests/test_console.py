"""llmc.console: tables printed to a log or CI keep every column whole."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from llmc import console as llmc_console


def test_a_log_gets_the_wide_console():
    # pytest captures stdout and stderr: neither is a terminal here, as in CI or `llmc build ... > log`
    for stderr in (False, True):
        c = llmc_console.table_console(stderr=stderr)
        assert not c.is_terminal and c.width == llmc_console.LOG_WIDTH == 180 and c.stderr is stderr


def test_a_terminal_keeps_its_own_width(monkeypatch):
    class Terminal(Console):
        def __init__(self, **kwargs):
            super().__init__(force_terminal=True, width=97, **kwargs)

    monkeypatch.setattr(llmc_console, "Console", Terminal)
    assert llmc_console.table_console().width == 97


def test_nine_wide_columns_are_not_cut_in_a_log():
    table = Table()
    for i in range(9):
        table.add_column(f"column {i}", no_wrap=True)
    table.add_row(*["3412786650881.23"] * 9)
    cut, log = io.StringIO(), io.StringIO()
    Console(file=cut, width=80).print(table)  # rich's default for a non-terminal: cells become "34…"
    Console(file=log, width=llmc_console.LOG_WIDTH).print(table)
    assert "…" in cut.getvalue() and "…" not in log.getvalue() and "3412786650881.23" in log.getvalue()
