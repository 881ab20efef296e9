"""Rating data for the simulator: loaders and the `Ratings` container, per-user splits, planted matrices."""

from __future__ import annotations

__all__: list[str] = []
