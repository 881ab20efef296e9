"""In-process federation without privacy, one module per model family, and the runs it saves."""

from __future__ import annotations

__all__: list[str] = []
