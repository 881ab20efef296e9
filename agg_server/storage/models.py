"""Model versions: checkpoints (table ``checkpoints`` and the files of `agg_server.storage.checkpoints`),
the strategy state stored with each version, and quality reports (table ``model_quality``), a part of
`agg_server.storage.Storage`.

Invariants of this module:

* A checkpoint row exists only for a file that was completely written and fsynced first.  A file
  without a row is an orphan of a crash: it is ignored and overwritten by the next commit of that version.
* Model versions only increase, and one version is committed once: the check and the insert are one
  transaction holding the rounds lock (on PostgreSQL shared by every instance), and the version is the
  checkpoints' primary key.  The same transaction saves the ledger and closes the round (all or nothing).
* A checkpoint is trusted only if its file's SHA-256 matches the row; a mismatching or missing file is
  marked 'corrupt', logged at ERROR and never served again.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from typing import Any

from agg_server.storage.base import Fence, Tables, check_id, check_time, to_json
from agg_server.storage.database import Database
from agg_server.storage.ledger import store_ledger
from agg_server.storage.records import CheckpointRecord, CheckpointStatus, QualityRecord, RoundStatus
from agg_server.storage.rounds import ROUND_UPDATE_KEYS, check_fence, close_round
from protocol.errors import StorageError

__all__ = ["ModelQueries", "HeadMoved"]


class HeadMoved(StorageError):
    """`Storage.commit_model` with ``base_version``: another round committed first; ``head`` is the
    newest committed version (the caller rebases onto it and tries again)."""

    def __init__(self, message: str, head: int) -> None:
        super().__init__(message)
        self.head = head


_log = logging.getLogger("agg_server.storage")


class ModelQueries(Tables):
    """Committing, loading and expiring model versions, and their quality figures."""

    def commit_model(
        self,
        model_version: int,
        round_id: int | None,
        payload: bytes,
        now: float,
        *,
        ledger: Mapping[str, Any] | None = None,
        round_update: dict[str, Any] | None = None,
        fence: Fence | None = None,
        base_version: int | None = None,
    ) -> None:
        """Durably commit a new global model, and optionally the ledger and its round, all or nothing.

        The file is written and fsynced first; then one transaction records its checksum, saves the
        ledger and marks the round committed.  A crash before that transaction commits leaves the
        previous model current (the new file is an ignored orphan); after it, the new one.

        Parameters
        ----------
        model_version : int
            Newer than every good checkpoint.
        round_id : int or None
            The round that produced the model (None for an initial model).
        payload : bytes
            The encoded `ModelPayload`; stored verbatim.
        now : float
            Time on the coordinator's clock.
        ledger : Mapping or None
            Privacy ledger to save in the same transaction.
        round_update : dict or None
            If given, round ``round_id`` is finished as committed with ``new_model_version =
            model_version`` in the same transaction; allowed keys: "survivors", "epsilon_spent",
            "reason", "sum_sha256", "strategy_state" (a JSON-able mapping the strategy needs again
            with this model, stored in the round's params; see `strategy_state`).
        fence : (cohort, token), optional
            The leader's lease (`LeaseLost` unless current).
        base_version : int, optional
            Compare-and-set: commit only if the newest committed version is still ``base_version``
            (``model_version`` must then be ``base_version + 1``); otherwise `HeadMoved` names the head.

        On PostgreSQL the model bytes are stored in the checkpoint row as well, so that every instance
        can load every version (the file stays a local copy).

        Raises
        ------
        StorageError
            If the version is not newer than the latest good checkpoint, the file cannot be written
            (naming the path), the round is not open, the lease was lost, the head moved (`HeadMoved`),
            or the database fails.
        ValueError
            If an argument is malformed.
        """
        version = check_id("model_version", model_version)
        rid = None if round_id is None else check_id("round_id", round_id)
        if not isinstance(payload, bytes | bytearray | memoryview):
            raise ValueError(f"payload must be bytes, got {type(payload).__name__}")
        data = bytes(payload)
        at = check_time("now", now)
        # Everything that can be refused is checked before touching the disk.
        ledger_text = None if ledger is None else to_json("ledger", ledger)
        update: dict[str, Any] = {}
        if round_update is not None:
            if rid is None:
                raise ValueError("round_update needs a round_id")
            unknown = set(round_update) - ROUND_UPDATE_KEYS
            if unknown:
                raise ValueError(f"round_update: unknown keys {sorted(unknown)}; allowed {sorted(ROUND_UPDATE_KEYS)}")
            update = {"reason": "", "survivors": None, "epsilon_spent": None, **round_update}
            if "strategy_state" in update:
                to_json("strategy_state", update["strategy_state"])  # refused before the file is written
        if base_version is not None and version != check_id("base_version", base_version) + 1:
            raise ValueError(f"model_version {version} must be base_version + 1 = {base_version + 1}")
        self._check_newer(version, base=base_version)
        relative, digest = self._files.write(version, data)
        shared = data if self.dialect == "postgresql" else None
        with self._transaction("commit_model") as conn:
            conn.lock_rounds()
            if fence is not None:
                check_fence(conn, "commit_model", fence)
            # Again, under the lock: another instance may have committed meanwhile.
            self._check_newer(version, conn, base=base_version)
            self._record_checkpoint(conn, version, rid, relative, digest, len(data), at, shared)
            if ledger_text is not None:
                store_ledger(conn, ledger_text)
            if round_update is not None and rid is not None:
                close_round(conn, self.where, rid, RoundStatus.COMMITTED, new_model_version=version, now=at, **update)
            expired, oldest = self._expire_checkpoints(conn)
        self._files.delete(expired)
        if oldest is not None:
            # Files of this data directory whose rows another instance's commit pruned (on PostgreSQL
            # every instance writes its own files, but one commit prunes every instance's rows).
            self._files.remove_older_than(oldest)

    def _check_newer(self, version: int, conn: Database | None = None, *, base: int | None = None) -> None:
        if conn is None:
            with self._guard("commit_model") as db:
                self._check_newer(version, db, base=base)
            return
        newest = conn.execute(
            "SELECT max(model_version) FROM checkpoints WHERE status = ?", (CheckpointStatus.GOOD.value,)
        ).fetchone()[0]
        if base is not None and newest is not None and int(newest) != base:
            raise HeadMoved(f"commit_model: the head is model version {newest}, not the base {base}", int(newest))
        if newest is not None and version <= newest:
            raise StorageError(f"commit_model: model version {version} is not newer than the committed {newest}")

    def _record_checkpoint(
        self,
        conn: Database,
        version: int,
        round_id: int | None,
        relative: str,
        digest: bytes,
        size: int,
        now: float,
        payload: bytes | None = None,
    ) -> None:
        # A 'corrupt' row of the same version (a fallback happened) is replaced by the new model.
        conn.execute(
            "DELETE FROM checkpoints WHERE model_version = ? AND status = ?",
            (version, CheckpointStatus.CORRUPT.value),
        )
        conn.execute(
            "INSERT INTO checkpoints (model_version, round_id, path, sha256, size, created_at, status, payload) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (version, round_id, relative, digest, size, now, CheckpointStatus.GOOD.value, payload),
        )

    def _remove_leftovers(self) -> None:
        # Only crashes leave these: temp files of an unfinished write, and files whose rows were pruned
        # by a commit that died before unlinking them.
        with self._guard("open") as conn:
            oldest = conn.execute("SELECT min(model_version) FROM checkpoints").fetchone()[0]
        self._files.remove_leftovers(None if oldest is None else int(oldest))

    def _expire_checkpoints(self, conn: Database) -> tuple[list[str], int | None]:
        # Inside the commit's transaction, so the row count never exceeds keep_checkpoints good ones
        # whatever the moment of a crash.  Everything older than the keep-th newest good checkpoint
        # goes, corrupt rows included.  Returns the files to delete once the transaction committed:
        # rows go first, so a crash leaves orphan files (removed on the next open), never rows
        # pointing at deleted files (which would look corrupt).  Also returns the oldest version kept.
        row = conn.execute(
            "SELECT model_version FROM checkpoints WHERE status = ? ORDER BY model_version DESC LIMIT 1 OFFSET ?",
            (CheckpointStatus.GOOD.value, self.keep_checkpoints - 1),
        ).fetchone()
        if row is None:
            return [], None
        old = conn.execute("SELECT path FROM checkpoints WHERE model_version < ?", (row[0],)).fetchall()
        conn.execute("DELETE FROM checkpoints WHERE model_version < ?", (row[0],))
        return [str(r[0]) for r in old], int(row[0])

    def strategy_state(self, model_version: int) -> dict[str, Any]:
        """What the strategy stored with ``model_version`` when its round committed (the mapping given
        as ``round_update["strategy_state"]`` to `commit_model`); empty for an initial model, a round
        that stored nothing, or a version no round committed.

        Raises
        ------
        StorageError
            If the database fails or the stored value is not a JSON object.
        """
        version = check_id("model_version", model_version)
        with self._guard("strategy_state") as conn:
            row = conn.execute(
                "SELECT params FROM rounds WHERE new_model_version = ? AND status = ?",
                (version, RoundStatus.COMMITTED.value),
            ).fetchone()
        if row is None or not row[0]:
            return {}
        state = json.loads(row[0]).get("strategy_state", {})
        if not isinstance(state, dict):
            raise StorageError(f"strategy_state: model version {version} has a malformed strategy state")
        return state

    def load_latest_model(self) -> tuple[int, bytes] | None:
        """Return the newest intact checkpoint, falling back past missing or corrupted files.

        Each candidate's file must exist and match its recorded SHA-256.  One that does not is
        marked 'corrupt' and logged at ERROR (file, expected and actual digests), and the next
        older good checkpoint is tried.

        Returns
        -------
        tuple[int, bytes] or None
            (model_version, payload bytes), or None if no checkpoint was ever committed.

        Raises
        ------
        StorageError
            If checkpoints were committed but none is intact: starting a fresh model silently would
            discard the training so far, so the operator must decide; or if the database fails.
        """
        with self._guard("load_latest_model") as conn:
            candidates = conn.execute(
                "SELECT model_version, path, sha256, size, payload IS NOT NULL FROM checkpoints WHERE status = ? "
                "ORDER BY model_version DESC",
                (CheckpointStatus.GOOD.value,),
            ).fetchall()
        for version, relative, expected, size, in_database in candidates:
            path = self._files.path(relative)
            try:
                data = self._stored_payload(int(version)) if in_database else self._files.read(relative)
            except FileNotFoundError:
                found = "no file"
            except OSError as exc:
                found = f"an unreadable file ({exc.strerror or exc})"
            else:
                actual = hashlib.sha256(data).digest()
                if actual == expected:
                    return int(version), data
                found = f"sha256 {actual.hex()} ({len(data)} bytes)"
            _log.error(
                "CORRUPT MODEL CHECKPOINT %s (model version %d): expected sha256 %s (%d bytes), found %s; "
                "marking it corrupt and falling back to the previous checkpoint",
                path,
                version,
                bytes(expected).hex(),
                size,
                found,
            )
            with self._transaction("load_latest_model") as conn:
                conn.execute(
                    "UPDATE checkpoints SET status = ? WHERE model_version = ?",
                    (CheckpointStatus.CORRUPT.value, version),
                )
        with self._guard("load_latest_model") as conn:
            total = int(conn.execute("SELECT count(*) FROM checkpoints").fetchone()[0])
        if total:
            raise StorageError(
                f"load_latest_model: none of the {total} recorded checkpoints in {self._checkpoint_dir} is "
                "intact (see the errors logged above); restore the files from a backup"
            )
        return None

    def _stored_payload(self, version: int) -> bytes:
        with self._guard("load_model") as conn:
            row = conn.execute("SELECT payload FROM checkpoints WHERE model_version = ?", (version,)).fetchone()
        if row is None or row[0] is None:
            raise FileNotFoundError(f"model version {version} has no stored payload")
        return bytes(row[0])

    def load_model(self, version: int) -> bytes:
        """The bytes of committed model ``version`` (from the database row on PostgreSQL, else the
        file), checked against the recorded SHA-256.

        Raises
        ------
        StorageError
            The version was never committed (or expired), or its bytes do not match the digest.
        """
        v = check_id("model_version", version)
        with self._guard("load_model") as conn:
            row = conn.execute(
                "SELECT path, sha256, payload FROM checkpoints WHERE model_version = ? AND status = ?",
                (v, CheckpointStatus.GOOD.value),
            ).fetchone()
        if row is None:
            raise StorageError(f"load_model: model version {v} is not a good checkpoint in {self.where}")
        relative, expected, payload = row
        try:
            data = bytes(payload) if payload is not None else self._files.read(str(relative))
        except OSError as exc:
            raise StorageError(f"load_model: cannot read {self._files.path(str(relative))}: {exc}") from exc
        if hashlib.sha256(data).digest() != bytes(expected):
            raise StorageError(f"load_model: model version {v} does not match its recorded SHA-256")
        return data

    def prune_checkpoint_files(self) -> None:
        """Delete this data directory's model files whose rows are gone (another instance's commit pruned
        them); every commit does this too."""
        with self._guard("prune_checkpoint_files") as conn:
            oldest = conn.execute("SELECT min(model_version) FROM checkpoints").fetchone()[0]
        if oldest is not None:
            self._files.remove_older_than(int(oldest))

    def head_version(self) -> int | None:
        """The newest good committed model version (None before the first commit)."""
        with self._guard("head_version") as conn:
            row = conn.execute(
                "SELECT max(model_version) FROM checkpoints WHERE status = ?", (CheckpointStatus.GOOD.value,)
            ).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    def checkpoints(self) -> list[CheckpointRecord]:
        """Return every checkpoint row, newest version first."""
        with self._guard("checkpoints") as conn:
            rows = conn.execute(
                "SELECT model_version, round_id, path, sha256, size, created_at, status FROM checkpoints "
                "ORDER BY model_version DESC"
            ).fetchall()
        return [
            CheckpointRecord(
                model_version=int(v),
                round_id=None if r is None else int(r),
                path=self.data_dir / p,
                sha256=bytes(h),
                size=int(n),
                created_at=float(c),
                status=CheckpointStatus(s),
            )
            for v, r, p, h, n, c, s in rows
        ]

    # -- model quality --------------------------------------------------------------------------

    def record_quality(self, model_version: int, metric: str, dataset: str, value: float, now: float) -> None:
        """Store (or replace) the quality figure ``metric`` of ``model_version`` measured on ``dataset``.

        Parameters
        ----------
        model_version : int
            A model version (>= 0); the caller checks that it exists.
        metric, dataset : str
            Non-empty labels.
        value : float
            The figure (finite).
        now : float
            Time on the coordinator's clock.

        Raises
        ------
        StorageError
            If the database fails.
        ValueError
            If an argument is malformed.
        """
        version = check_id("model_version", model_version)
        for name, text in (("metric", metric), ("dataset", dataset)):
            if not isinstance(text, str) or not text:
                raise ValueError(f"{name} must be a non-empty string, got {text!r}")
        figure = check_time("value", value)
        at = check_time("now", now)
        with self._transaction("record_quality") as conn:
            conn.execute(
                "INSERT INTO model_quality (model_version, metric, dataset, value, reported_at) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (model_version, metric, dataset) "
                "DO UPDATE SET value = excluded.value, reported_at = excluded.reported_at",
                (version, metric, dataset, figure, at),
            )

    def model_quality(self, limit: int = 100) -> list[QualityRecord]:
        """Return up to ``limit`` quality figures, newest model version first (then metric, dataset)."""
        n = check_id("limit", limit)
        with self._guard("model_quality") as conn:
            rows = conn.execute(
                "SELECT model_version, metric, dataset, value, reported_at FROM model_quality "
                "ORDER BY model_version DESC, metric, dataset LIMIT ?",
                (n,),
            ).fetchall()
        return [
            QualityRecord(model_version=int(v), metric=str(m), dataset=str(d), value=float(x), reported_at=float(t))
            for v, m, d, x, t in rows
        ]
