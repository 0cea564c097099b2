"""Rich consoles for llmc's tables: a terminal's own width, or 180 columns where output goes to a log or CI.

rich gives a console that is not a terminal 80 columns, and then cuts every wide table's cells to "p…".
"""

from __future__ import annotations

from rich.console import Console

LOG_WIDTH = 180


def table_console(stderr: bool = False) -> Console:
    """A console for tables: the terminal's width, else LOG_WIDTH (so no column of a log's table is cut)."""
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=LOG_WIDTH)
