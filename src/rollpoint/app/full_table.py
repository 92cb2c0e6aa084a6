"""Tables the CLI prints whole: no id, URL or path is ever cut.

Owns :func:`print_full`: rich fits a table to the console's width (80 columns when output
is not a terminal) by cutting cells with an ellipsis or wrapping them mid-word, so a column
of snapshot ids whose difference is at the end read all alike, and a URL broke mid-port.
Here a table is measured at its natural width and printed at that width when it is wider
than the console (a terminal then wraps whole lines, which copy and paste keep intact).
"""

from __future__ import annotations

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

_UNBOUNDED = 100_000


def print_full(console: Console, table: Table) -> None:
    """Print ``table`` with every cell in full, on as many columns as it needs."""
    for column in table.columns:
        column.no_wrap = True
        column.overflow = "ignore"
    needed = Measurement.get(console, console.options.update_width(_UNBOUNDED), table).maximum
    width = console.width
    if needed <= width:
        console.print(table)
        return
    console.width = needed
    try:
        console.print(table)
    finally:
        console.width = width
