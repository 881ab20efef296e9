"""Harnesses for tests and benchmarks, kept out of the installed packages: an in-process SecAgg+ round,
the coordinator behind the HTTP routes in memory, and the operator's quality report client."""

from __future__ import annotations

__all__: list[str] = []
