"""On-device store: one msgpack file per model, with a versioned header and a checksum, written
atomically.

File layout (a single msgpack map):
    {"magic": "fedrec-store", "format": [major, minor], "kind": str,
     "sha256": bytes(32), "payload": bytes}
where ``payload`` is itself a msgpack map (the model's state) and ``sha256`` is its digest.

Invariants:
- A save never damages the previous file: the new content goes to a temporary file in the same
  directory, is flushed and fsync'ed, then atomically renamed over the old name, and the directory
  is fsync'ed.  A crash at any point leaves either the old file or the new one, never a mix.
- A load verifies everything (msgpack structure, magic, major version, kind, checksum) before any
  field is used.  A file that fails is moved aside to ``<name>.corrupt-<n>`` (never deleted or
  overwritten; a warning is logged) and `StorageError` is raised naming the file and the reason.  That is
  for the device's own store, which must start over without the damaged file; a reader of a file the user
  named (``load_store(..., move_aside=False)``, the ``fedrec`` CLI) reports it and leaves it where it is.

The factor models (`device_sdk.mf.MFModel`, `device_sdk.ials.IALSModel`) store the same core state
(`factor_state`, read back by `read_factor_state`): the configuration, the shape, the model version, V and U
as float64 little-endian and which users are trained; each adds its own keys after it.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol, TypeVar

import msgpack
import numpy as np
from numpy.typing import NDArray

from protocol.atomic import write_atomic
from protocol.codes import float_matrix_from_bytes
from protocol.errors import StorageError

__all__ = ["STORE_FORMAT", "save_store", "load_store", "MAX_STORE_BYTES", "factor_state", "read_factor_state"]

_log = logging.getLogger(__name__)

STORE_MAGIC = "fedrec-store"
STORE_FORMAT = (1, 0)
MAX_STORE_BYTES = 2**31  # refuse to read anything larger (a 10^7-item, 128-bit model is 160 MB)


def _write_chunk(fh: Any, chunk: bytes) -> None:
    # The seam through which tests fail a save part-way (`protocol.atomic.write_atomic` calls it).
    fh.write(chunk)


def save_store(path: str | os.PathLike[str], kind: str, state: dict[str, Any], *, private: bool = False) -> None:
    """Atomically write ``state`` (msgpack-serialisable builtins and bytes) as a store file; ``private``
    (key material, credentials) creates it with mode 0600.

    Raises
    ------
    StorageError
        If the state cannot be serialised or the file cannot be written; the previous file, if
        any, is left untouched.
    """
    path = Path(path)
    try:
        payload = msgpack.packb(state, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise StorageError(f"cannot serialise {kind} state for {path}: {exc}") from exc
    blob = msgpack.packb(
        {
            "magic": STORE_MAGIC,
            "format": list(STORE_FORMAT),
            "kind": kind,
            "sha256": hashlib.sha256(payload).digest(),
            "payload": payload,
        },
        use_bin_type=True,
    )
    try:
        write_atomic(
            path, blob, write_chunk=lambda fh, chunk: _write_chunk(fh, chunk), mode=0o600 if private else 0o666
        )
    except OSError as exc:
        raise StorageError(f"could not write {path}: {exc}") from exc


def _move_aside(path: Path) -> Path:
    for n in range(1, 10_000):
        target = path.with_name(f"{path.name}.corrupt-{n}")
        if not target.exists():
            os.replace(path, target)
            return target
    raise StorageError(f"too many corrupt copies of {path}; clean them up")  # pragma: no cover


def _corrupt(path: Path, reason: str, move_aside: bool) -> StorageError:
    if not move_aside:
        return StorageError(f"{path} is corrupt or not a fedrec store file ({reason}); left it unchanged")
    try:
        moved = _move_aside(path)
    except OSError as exc:  # pragma: no cover - read-only media
        return StorageError(f"{path} is corrupt ({reason}) and could not be moved aside: {exc}")
    _log.warning("store file %s is corrupt (%s); moved it aside to %s", path, reason, moved.name)
    return StorageError(f"{path} is corrupt ({reason}); moved it aside to {moved.name}")


def load_store(path: str | os.PathLike[str], kind: str, *, move_aside: bool = True) -> dict[str, Any]:
    """Read and verify a store file written by :func:`save_store`.

    ``move_aside`` is for the device's own store (the default): a corrupted file is renamed so the device
    can start over.  A reader of a file the user named passes False, and the file stays where it is.

    Raises
    ------
    StorageError
        If the file is missing, truncated, corrupted, of another kind or of an incompatible
        format.  With ``move_aside``, a corrupted file is moved aside first (``<name>.corrupt-<n>``).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_STORE_BYTES:
            raise StorageError(f"{path} is {size} bytes, larger than the {MAX_STORE_BYTES} limit")
        data = path.read_bytes()
    except FileNotFoundError as exc:
        raise StorageError(f"no store file at {path}") from exc
    except OSError as exc:
        raise StorageError(f"cannot read {path}: {exc}") from exc
    try:
        outer = msgpack.unpackb(data, raw=False, max_bin_len=MAX_STORE_BYTES, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise _corrupt(path, f"not a valid msgpack document: {type(exc).__name__}", move_aside) from exc
    del data  # the payload is a copy: the file's bytes need not stay beside it and the state read from it
    if not isinstance(outer, dict) or outer.get("magic") != STORE_MAGIC:
        raise _corrupt(path, "missing fedrec-store header", move_aside)
    fmt = outer.get("format")
    if not (isinstance(fmt, list) and len(fmt) == 2 and all(isinstance(x, int) for x in fmt)):
        raise _corrupt(path, "malformed format version", move_aside)
    if fmt[0] != STORE_FORMAT[0]:
        # Not corrupt: written by an incompatible version. Leave it where it is.
        raise StorageError(f"{path} has store format {fmt[0]}.{fmt[1]}; this fedrec reads {STORE_FORMAT[0]}.x")
    payload, digest = outer.get("payload"), outer.get("sha256")
    if not isinstance(payload, bytes) or not isinstance(digest, bytes):
        raise _corrupt(path, "missing payload or checksum", move_aside)
    if hashlib.sha256(payload).digest() != digest:
        raise _corrupt(path, "checksum mismatch", move_aside)
    if outer.get("kind") != kind:
        raise StorageError(f"{path} holds a {outer.get('kind')!r} model, expected {kind!r}")
    try:
        state = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:
        raise _corrupt(path, f"payload is not valid msgpack: {type(exc).__name__}", move_aside) from exc
    if not isinstance(state, dict):
        raise _corrupt(path, "payload is not a map", move_aside)
    return state


class FactorModel(Protocol):
    """What `factor_state` stores of a factor model and `read_factor_state` restores."""

    n_items: int
    n_users: int
    config: Any
    model_version: int
    item_factors: NDArray[np.float64]
    user_factors: NDArray[np.float64]
    user_trained: NDArray[np.bool_]


M = TypeVar("M", bound=FactorModel)


def factor_state(model: FactorModel) -> dict[str, Any]:
    """The stored core of a factor model: its configuration (a dataclass), shape, version, V and U (float64
    little-endian) and its trained users (packed bits)."""
    return {
        "config": asdict(model.config),
        "n_items": model.n_items,
        "n_users": model.n_users,
        "model_version": model.model_version,
        "item_factors": np.ascontiguousarray(model.item_factors, dtype="<f8").tobytes(),
        "user_factors": np.ascontiguousarray(model.user_factors, dtype="<f8").tobytes(),
        "user_trained": np.packbits(model.user_trained).tobytes(),
    }


def read_factor_state(
    state: dict[str, Any],
    model_type: Callable[..., M],
    config_type: Callable[..., Any],
    rng: np.random.Generator | None,
    *,
    check: Callable[[NDArray[np.float64], NDArray[np.float64], Any], None] | None = None,
) -> M:
    """The factor model `factor_state` stored in ``state``: ``model_type(n_items, config, n_users=, rng=)`` (``rng``
    or a fresh generator) with the stored V, U, trained users and version; ``check(V, U, config)`` vets the
    factors before they are adopted.

    Raises
    ------
    KeyError, TypeError, ValueError
        On a missing key or a value that does not fit (the caller names the file in a `StorageError`).
    """
    config = config_type(**dict(state["config"]))
    n_items, n_users = int(state["n_items"]), int(state["n_users"])
    model = model_type(n_items, config, n_users=n_users, rng=rng or np.random.default_rng())
    V = float_matrix_from_bytes(state["item_factors"], (n_items, config.factors))
    U = float_matrix_from_bytes(state["user_factors"], (n_users, config.factors))
    if check is not None:
        check(V, U, config)
    packed = np.frombuffer(state["user_trained"], np.uint8)
    if packed.size != (n_users + 7) // 8:
        raise ValueError(f"user_trained holds {packed.size} bytes for {n_users} users")
    model.item_factors, model.user_factors = V, U
    model.user_trained = np.unpackbits(packed)[:n_users].astype(bool)
    model.model_version = int(state["model_version"])
    return model
