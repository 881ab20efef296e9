"""What every table family of `agg_server.storage.Storage` shares: the connection plumbing (`Tables`) and the
argument checks run before any statement.

Invariants of this module:

* A query method reaches the database only through `Tables._guard` (one statement or a read) or
  `Tables._transaction` (several statements, all or nothing); both raise `StorageError` naming the
  operation once the storage is closed.
* Arguments are checked here before any SQL runs; misuse (a negative id, a bad digest length, a value
  that is not JSON) raises plain `ValueError`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from agg_server.storage.checkpoints import CheckpointFiles
from agg_server.storage.database import Database
from protocol.errors import StorageError

__all__ = [
    "Tables",
    "Fence",
    "LedgerUpdate",
    "check_id",
    "check_time",
    "optional_number",
    "to_json",
    "check_digest",
    "check_devices",
]

Fence = tuple[int, int]
"""(cohort, fencing token) of the instance writing a round."""

LedgerUpdate = Callable[[dict[str, Any] | None], dict[str, Any]]
"""Reads the stored privacy ledger (None if none) and returns the new one, or raises to refuse."""

_DIGEST_BYTES = 32


class Tables:
    """The state every table family's queries use; `agg_server.storage.Storage` sets it up and closes it."""

    data_dir: Path
    db_path: Path
    keep_checkpoints: int
    where: str
    _db: Database | None
    _files: CheckpointFiles
    _checkpoint_dir: Path

    @property
    def dialect(self) -> str:
        """The database back-end: "sqlite" or "postgresql"."""
        return self._database("dialect").dialect

    def _database(self, op: str) -> Database:
        if self._db is None:
            raise StorageError(f"{op}: storage {self.where} is closed")
        return self._db

    def _guard(self, op: str) -> Any:
        return self._database(op).guard(op)

    def _transaction(self, op: str) -> Any:
        return self._database(op).transaction(op)


def check_id(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def check_time(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def optional_number(name: str, value: object) -> float | None:
    return None if value is None else check_time(name, value)


def _json_default(obj: object) -> Any:
    # numpy scalars and arrays (e.g. an np.int64 graph parameter) store as their Python values.
    tolist = getattr(obj, "tolist", None)
    if callable(tolist):
        return tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON-serialisable")


def to_json(name: str, value: Mapping[str, Any]) -> str:
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a mapping, got {type(value).__name__}")
    try:
        # allow_nan=False: NaN is not JSON, and the status page serves these values as JSON.
        return json.dumps(dict(value), allow_nan=False, sort_keys=True, default=_json_default)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} cannot be stored as JSON: {exc}") from None


def check_digest(value: object) -> bytes:
    if not isinstance(value, bytes | bytearray | memoryview) or len(value) != _DIGEST_BYTES:
        raise ValueError(f"token_sha256 must be {_DIGEST_BYTES} bytes, got {value!r:.40}")
    return bytes(value)


def check_devices(name: str, devices: Sequence[int]) -> list[int]:
    ids = [check_id(f"{name} device id", d) for d in devices]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{name} lists a device more than once")
    return ids
