"""What every ``fedrec`` command prints with: one table style and one progress bar.

Invariants:
- Tables are plain aligned text (first column left-aligned, the others right-aligned, a dashed rule
  under the header), whatever the command or the model family, so results read and diff the same way.
- Progress goes to stderr (stdout stays the report, safe to pipe or diff) through tqdm, which shows
  the elapsed time and an ETA; it is silent when stderr is not a terminal unless asked for.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, TextIO

__all__ = ["table", "progress", "parse_table"]


def table(header: Sequence[str], rows: Sequence[Sequence[str]], out: TextIO) -> None:
    """Write ``rows`` under ``header`` as one aligned text table."""
    cells = [list(header), *(list(r) for r in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for j, row in enumerate(cells):
        line = "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        out.write(line.rstrip() + "\n")
        if j == 0:
            out.write("  ".join("-" * w for w in widths) + "\n")


def parse_table(text: str, label: str) -> list[str]:
    """The cells of the first row of a `table` in ``text`` whose first cell starts with ``label`` (for
    tests and scripts reading a report back)."""
    import re

    for line in text.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) > 1 and cells[0].startswith(label):
            return cells
    raise KeyError(f"no table row labelled {label!r}")


def progress(total: int | None, desc: str, unit: str, *, enabled: bool | None = None) -> Any:
    """A tqdm bar on stderr with elapsed time and ETA.

    ``enabled=None`` shows it only when stderr is a terminal; False never; True always.
    """
    from tqdm import tqdm

    disable = (not sys.stderr.isatty()) if enabled is None else not enabled
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        file=sys.stderr,
        leave=False,
        disable=disable,
        dynamic_ncols=True,
        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} {unit} [{elapsed}<{remaining}{postfix}]",
    )
