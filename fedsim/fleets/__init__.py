"""Fleets of simulated devices over HTTP against a real server: local and Ray back-ends, faults, the demo."""

from __future__ import annotations

__all__: list[str] = []
