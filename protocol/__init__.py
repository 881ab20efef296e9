"""fedrec protocol: sans-IO messages, codec, secure aggregation and differential privacy."""

from __future__ import annotations

from protocol.errors import *  # noqa: F403
from protocol.errors import __all__ as _errors_all

PROTOCOL_VERSION = (1, 0)

__all__ = [*_errors_all, "PROTOCOL_VERSION"]
