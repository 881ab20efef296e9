"""The line a benchmark prints first when its figures come from its own settings rather than from what the CLI
ships, so a figure copied from its output is never taken for what ``fedrec simulate --dataset D --json`` gives.

Scripts import it as a sibling module (``python benchmarks/NAME.py`` puts this folder on ``sys.path``).
"""

from __future__ import annotations

import sys
from typing import TextIO

#: Where the shipped defaults' own figures are (their command, dataset by dataset).
SHIPPED = "`fedrec simulate --dataset D --json` (docs/results/2026-11-27-auto-default.md)"


def own_settings(what: str, out: TextIO | None = None) -> str:
    """Print (and return) "settings: ``what``; not the shipped defaults of ``SHIPPED``"."""
    if not what.strip():
        raise ValueError("say which settings the script uses")
    line = f"settings: {what.strip()}; these are this script's own settings, not the shipped defaults of {SHIPPED}"
    print(line, file=out or sys.stdout, flush=True)
    return line
