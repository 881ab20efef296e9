"""In-process private federation: real coordinator rounds, the private-round simulator, private runs per family."""

from __future__ import annotations

__all__: list[str] = []
