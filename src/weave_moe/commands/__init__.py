"""Sub-commands of `weave-moe` (see weave_moe.cli), and the one way they print a table."""

from __future__ import annotations


def print_table(table, console=None) -> None:
    """Print a rich `Table` without cutting cells when the output is not a terminal.

    Rich lays a table out for the console width, 80 columns when stdout is a pipe or a file, and shortens cells that do
    not fit (`qwen3-30b-a3…`). A pipe has no width to respect, so there the console is widened to the table's natural
    width; in a terminal the table keeps the terminal's width (columns that must stay whole say `no_wrap=True` and a
    `min_width`).

    Args:
        table: a `rich.table.Table`.
        console: the `rich.console.Console` to print on (default: a new one on stdout).
    """
    from rich.console import Console

    console = console or Console()
    if not console.is_terminal:
        natural = Console(width=100_000).measure(table).maximum
        if natural > console.width:
            console = Console(width=natural, file=console.file)
    console.print(table)
