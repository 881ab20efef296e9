# Invariants: a write through `write_atomic` never damages the previous file.  The bytes go to a
# temporary file in the same directory (so the rename cannot cross file systems), which is flushed and
# fsynced, then renamed over the target with `os.replace`, and the directory is fsynced so the rename
# itself is durable.  A crash at any point leaves the old file or the new one, never a mix; the only
# leftover of a crash is a temporary file named ``.<name>.tmp-<hex>``, which `TEMP_GLOB` matches.
"""One atomic, durable file write shared by the device store and the server's checkpoint store."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["write_atomic", "fsync_dir", "temp_glob"]

_CHUNK = 1 << 20


def temp_glob(name: str) -> str:
    """Glob pattern of the temporary files a crashed `write_atomic` of ``name`` may leave."""
    return f".{name}.tmp-*"


def fsync_dir(directory: Path) -> None:
    """fsync a directory so that a rename inside it is durable (no-op where directories cannot be
    opened, e.g. Windows, whose NTFS journals renames)."""
    if os.name == "nt":  # pragma: no cover
        return
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(
    path: Path | str,
    data: bytes,
    *,
    write_chunk: Callable[[BinaryIO, bytes], object] | None = None,
    mode: int = 0o666,
) -> None:
    """Replace ``path`` with ``data`` atomically and durably.

    Parameters
    ----------
    path : the target file; its directory must exist.
    data : the new content.
    write_chunk : writes one chunk (at most 1 MiB) to the open temporary file; default ``fh.write``.
        A test seam: a fault injected here fails the write part-way, and the old file stays.
    mode : the permission bits the file is created with (less the umask); key material passes 0o600, so
        it is never readable by others, not even for the moment before a chmod.

    Raises
    ------
    OSError
        The file could not be written; the previous file, if any, is untouched and the temporary
        file is removed.  Callers translate it into their own error (``StorageError``).
    """
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    temp = directory / f".{target.name}.tmp-{secrets.token_hex(6)}"
    write = write_chunk if write_chunk is not None else _write
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), mode)
        with open(fd, "wb") as fh:
            for start in range(0, len(data), _CHUNK):
                write(fh, data[start : start + _CHUNK])
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
    fsync_dir(directory)


def _write(fh: BinaryIO, chunk: bytes) -> None:
    fh.write(chunk)
