"""Model checkpoint files: ``<data_dir>/checkpoints/model-<version>.msgpack``, written atomically.

Invariants:
* A file is written with `protocol.atomic.write_atomic` (temp file, fsync, rename, fsync of the folder)
  before any database row points at it; a file without a row is the orphan of a crash, ignored and
  overwritten by the next commit of that version.
* Paths handed to the database are relative to the data directory, so the directory can be moved.
* Nothing here knows the database: `agg_server.storage.Storage` decides which files exist.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from pathlib import Path

from protocol.atomic import temp_glob, write_atomic
from protocol.errors import StorageError

__all__ = ["CHECKPOINT_DIR", "CheckpointFiles"]

_log = logging.getLogger("agg_server.storage")

CHECKPOINT_DIR = "checkpoints"


class CheckpointFiles:
    """The checkpoint folder of one data directory.

    Raises
    ------
    StorageError
        The folder cannot be created.
    """

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir)
        self.folder = self.data_dir / CHECKPOINT_DIR
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create data directory {self.folder}: {exc}") from exc

    @staticmethod
    def relative(version: int) -> str:
        """The path recorded in the database for model ``version``."""
        return f"{CHECKPOINT_DIR}/model-{version}.msgpack"

    def write(self, version: int, data: bytes) -> tuple[str, bytes]:
        """Write model ``version`` durably; returns (relative path, SHA-256 of ``data``)."""
        relative = self.relative(version)
        path = self.data_dir / relative
        try:
            write_atomic(path, data)
        except OSError as exc:
            raise StorageError(f"cannot write checkpoint {path}: {exc}") from exc
        return relative, hashlib.sha256(data).digest()

    def read(self, relative: str) -> bytes:
        """The file's bytes (OSError propagates: the caller decides what a missing file means)."""
        return (self.data_dir / relative).read_bytes()

    def path(self, relative: str) -> Path:
        return self.data_dir / relative

    def remove_leftovers(self, oldest_recorded: int | None) -> None:
        """Delete temp files of unfinished writes and files older than every recorded row (pruned by a
        commit that died before unlinking them).  Files newer than every row are left alone."""
        leftovers = [*self.folder.glob(temp_glob("model-*.msgpack")), *self.folder.glob(".model-*.tmp")]
        for temp in leftovers:  # the second pattern: temp files of releases before protocol.atomic
            with contextlib.suppress(OSError):
                temp.unlink()
        if oldest_recorded is not None:
            self.remove_older_than(oldest_recorded)

    def remove_older_than(self, version: int) -> None:
        """Delete the model files of versions below ``version`` (their rows are gone); failures are ignored
        (the next prune tries again)."""
        for path in self.folder.glob("model-*.msgpack"):
            found = path.name[len("model-") : -len(".msgpack")]
            if found.isdigit() and int(found) < version:
                with contextlib.suppress(OSError):
                    path.unlink()

    def delete(self, relatives: list[str]) -> None:
        """Delete files whose rows are gone; a failure is logged, never raised (the commit stands)."""
        for relative in relatives:
            try:
                (self.data_dir / relative).unlink(missing_ok=True)
            except OSError as exc:
                _log.warning("could not delete old checkpoint %s: %s", self.data_dir / relative, exc)
