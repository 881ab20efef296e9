"""fedsim: datasets, evaluation, in-process federation and the `fedrec` CLI."""

from __future__ import annotations

__all__: list[str] = []
