"""Tables a person reads in a terminal of any width, down to 80 columns.

A table is printed as a table when every column still gets its readable minimum: long values fold onto more
lines (never cut), short ids never wrap, and a key column keeps the width it asks for. When even that cannot fit,
the table becomes a list: one block per row, `header: value` lines, which any width can show. Rich on its own
would squeeze a table that does not fit until some columns are zero characters wide, headers and values gone.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

# Per column: one space of padding each side; per table: one rule between columns and one at each edge.
CELL_PADDING = 2


@dataclass(frozen=True)
class Column:
    """One column. `short`: values of a few characters (an id like "P3a", a count, a date, yes/no) that never
    wrap: the column is as wide as its widest value (its header may still break at a space).
    `key`: what names the row (a registration id, a rung): folded only when folding every other column is not
    enough. `min_width`: the narrowest a folded value stays readable at; 0 means its header's longest word."""

    header: str
    short: bool = False
    key: bool = False
    min_width: int = 0

    def __post_init__(self) -> None:
        if self.min_width < 0:
            raise ValueError(f"column {self.header!r}: min_width = {self.min_width} must be >= 0")
        if self.short and self.key:
            raise ValueError(f"column {self.header!r}: short columns never fold, so key = True adds nothing")


def _width(markup: str) -> int:
    """The widest line of a cell, as printed (markup removed)."""
    return max((Text.from_markup(line).cell_len for line in markup.split("\n")), default=0)


def _capped(floors: list[int], natural: list[int], room: int) -> list[int] | None:
    """Widths within `room`: the widest columns cut first (the largest cap under which all fit), none below its
    floor; what the cap leaves over goes back to the columns it cut, left to right. None if the floors alone
    do not fit."""
    if sum(floors) > room:
        return None
    low, high = 0, max(natural)
    while low < high:
        cap = (low + high + 1) // 2
        if sum(max(f, min(n, cap)) for f, n in zip(floors, natural)) <= room:
            low = cap
        else:
            high = cap - 1
    widths = [max(f, min(n, low)) for f, n in zip(floors, natural)]
    spare = room - sum(widths)
    for i, n in enumerate(natural):
        grant = min(spare, n - widths[i])
        widths[i] += grant
        spare -= grant
    return widths


def column_widths(columns: list[Column], rows: list[list[str]], width: int) -> list[int] | None:
    """The content width of each column that fits the table in `width` characters, or None when it cannot fit
    without taking a column below its readable minimum."""
    values = [max([0] + [_width(row[i]) for row in rows]) for i in range(len(columns))]
    words = [max(len(word) for word in c.header.split()) for c in columns]
    natural = [max(len(c.header), v) for c, v in zip(columns, values)]
    floors = [
        max(v, w) if c.short else min(n, max(c.min_width, w)) for c, v, w, n in zip(columns, values, words, natural)
    ]
    room = width - CELL_PADDING * len(columns) - (len(columns) + 1)
    if sum(natural) <= room:
        return natural
    keys_whole = [n if c.key else f for c, f, n in zip(columns, floors, natural)]
    return _capped(keys_whole, natural, room) or _capped(floors, natural, room)


def print_table(console: Console, title: str, columns: list[Column], rows: list[list[str]]) -> None:
    """`rows` hold rich markup (escape text from documents and measurements before it gets here)."""
    assert all(len(row) == len(columns) for row in rows), (title, [c.header for c in columns])
    widths = column_widths(columns, rows, console.width)
    if widths is None:
        print_blocks(console, title, columns, rows)
        return
    table = Table(title=escape(title))
    for column, width in zip(columns, widths):
        # No no_wrap even for short columns: their width already holds every value, and no_wrap would crop a
        # header that has to break at its space instead.
        table.add_column(escape(column.header), width=width, overflow="fold")
    for row in rows:
        table.add_row(*row)
    console.print(table)


def print_blocks(console: Console, title: str, columns: list[Column], rows: list[list[str]]) -> None:
    """The list form: the title, then per row its first column's `header: value`, the others indented below it
    (empty values left out), a blank line between rows. A row whose first cell is empty continues the row above
    it in the table (an item's second oracle): its block repeats that row's first value."""
    console.print(f"[bold]{escape(title)}[/]")
    named = ""
    for index, row in enumerate(rows):
        if index:
            console.print()
        named = row[0] if row[0].strip() else named
        console.print(Text.from_markup(f"{escape(columns[0].header)}: {named}", overflow="fold"))
        for column, value in zip(columns[1:], row[1:]):
            if value.strip():
                console.print(Text.from_markup(f"  {escape(column.header)}: {value}", overflow="fold"))
