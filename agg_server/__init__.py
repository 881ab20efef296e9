"""fedrec aggregation server: round coordination, strategies and storage."""

from __future__ import annotations

from protocol.errors import *  # noqa: F403
from protocol.errors import __all__ as _errors_all

__all__ = [*_errors_all]
