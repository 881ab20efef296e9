"""Measuring models: ranking metrics and baselines, evaluation set-ups, the centralised ALS reference, JSON records."""

from __future__ import annotations

__all__: list[str] = []
