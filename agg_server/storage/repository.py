"""`Storage`: the aggregation server's durable state — devices, rounds, participation, the privacy
ledger, quality reports and model checkpoints — over a `Database` (SQLite or PostgreSQL,
`agg_server.storage.database`) and a `CheckpointFiles` folder (`agg_server.storage.checkpoints`).

One facade class over one module per table family, each a base class of `Storage` holding that family's
queries: `agg_server.storage.devices` (devices, enrollment tokens), `agg_server.storage.revocation`
(revocation lists), `agg_server.storage.rounds` (rounds, cohort leases, participation),
`agg_server.storage.ledger` (the privacy ledger) and `agg_server.storage.models` (checkpoints, strategy
state, quality).  A transaction that spans families (a commit writes the checkpoint, the ledger and the
round at once) stays one transaction: the family it touches second offers a function that runs on the
caller's open connection (`close_round`, `store_ledger`, `release_unrevealed`, `check_fence`).

Invariants of this module and the family modules:

* Every multi-row change runs in one transaction, so a crash leaves either the old rows or the new ones.
* A checkpoint row exists only for a file that was completely written and fsynced first.  A file
  without a row is an orphan of a crash: it is ignored and overwritten by the next commit of that version.
* Model versions only increase, and one version is committed once: the check and the insert are one
  transaction holding the rounds lock (on PostgreSQL shared by every instance), and the version is the
  checkpoints' primary key.
* A checkpoint is trusted only if its file's SHA-256 matches the row; a mismatching or missing file is
  marked 'corrupt', logged at ERROR and never served again.
* Every driver error leaving this class is a `StorageError` naming the operation and database;
  argument misuse (wrong status name, bad digest length) raises plain `ValueError`.
* Several instances (docs/operations.md): a write of a round given ``fence=(cohort, token)`` first reads
  the cohort's lease row with a share lock and refuses (`LeaseLost`) unless the token is still the
  current one, in the same transaction; a lease acquisition locks that row for update and bumps the
  token, so a write of a deposed leader either commits before the take-over or is refused after it.
* The privacy ledger is read, changed and written only under the rounds lock: a round's ε is reserved
  (appended to the ledger) in the transaction that opens it, and a round that ends without committing
  gives its reservation back only if it was never revealed (``rounds.revealed``, set before the UNMASK
  phase is announced); a revealed round stays charged whatever happens next.
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType

from agg_server.storage.checkpoints import CheckpointFiles
from agg_server.storage.database import DATABASE_NAME, DatabaseHealth, Timeouts, open_database
from agg_server.storage.devices import DeviceQueries
from agg_server.storage.ledger import LedgerQueries
from agg_server.storage.models import HeadMoved, ModelQueries
from agg_server.storage.revocation import RevocationQueries
from agg_server.storage.rounds import LeaseLost, RoundQueries
from protocol.errors import StorageError

__all__ = ["Storage", "LeaseLost", "HeadMoved"]


class Storage(DeviceQueries, RevocationQueries, RoundQueries, LedgerQueries, ModelQueries):
    """Devices, rounds, participation, the privacy ledger and model checkpoints of one server.

    Parameters
    ----------
    data_dir : Path
        Folder for ``fedrec.sqlite3`` and ``checkpoints/`` (created if missing).
    keep_checkpoints : int
        Good checkpoint files to keep (>= 1); older ones are deleted after each commit.
    url : str or None
        ``storage.url``: None for SQLite in ``data_dir``, else a PostgreSQL URL.
    timeouts : `Timeouts` or None
        Connect, statement and lock timeouts (``storage.*_timeout``).

    Raises
    ------
    StorageError
        If the folder cannot be created, or the database cannot be opened, is corrupt, is not a
        fedrec database, has a newer schema, or cannot switch to WAL mode.
    ValueError
        If ``keep_checkpoints < 1``.

    Notes
    -----
    Use from one thread at a time (the server runs every call on its storage thread).  `close` (or leaving
    a ``with`` block) checkpoints the WAL and closes.
    """

    def __init__(
        self, data_dir: Path, *, keep_checkpoints: int = 5, url: str | None = None, timeouts: Timeouts | None = None
    ) -> None:
        if isinstance(keep_checkpoints, bool) or not isinstance(keep_checkpoints, int) or keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be an int >= 1, got {keep_checkpoints!r}")
        self.data_dir = Path(data_dir)
        self.db_path = self.data_dir / DATABASE_NAME
        self.keep_checkpoints = keep_checkpoints
        self._files = CheckpointFiles(self.data_dir)
        self._checkpoint_dir = self._files.folder
        self._db = open_database(self.data_dir, url, timeouts or Timeouts())
        self.where = self._db.where
        #: Readable from any thread without blocking (the readiness probe): see `DatabaseHealth`.
        self.health: DatabaseHealth = self._db.health
        try:
            self._remove_leftovers()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Checkpoint the WAL into the database file and close; calling it again does nothing.

        Raises
        ------
        StorageError
            If the connection cannot be closed.  A failed WAL checkpoint is only logged: the WAL
            is replayed on the next open, so no data is lost.
        """
        db, self._db = self._db, None
        if db is not None:
            db.close()

    def __enter__(self) -> Storage:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._db is None else "open"
        return f"Storage({str(self.data_dir)!r}, {self.where!r}, {state})"

    def claim_instance(self, instance_id: str) -> None:
        """Hold ``instance_id`` for as long as this storage is open, so that a second live process with
        the same ``storage.instance_id`` is refused at start instead of stealing this one's leases.

        Raises
        ------
        StorageError
            Another running process holds it (or the database fails).
        """
        if not self._database("claim_instance").claim(instance_id):
            raise StorageError(
                f"storage.instance_id {instance_id!r} is in use by another running instance on {self.where}; "
                "give every instance its own storage.instance_id (the id of an instance whose host died is free "
                "again within about 15 s)"
            )

    def integrity_check(self) -> str:
        """Check the database: SQLite's ``PRAGMA integrity_check``; on PostgreSQL, a full read of every
        table and the invariants the schema cannot state (no model version committed twice).

        Returns
        -------
        str
            "ok" for a healthy database, otherwise the findings, one per line.

        Raises
        ------
        StorageError
            If the check cannot run.
        """
        found = self._database("integrity_check").integrity_check()
        if found != "ok":
            return found
        problems = self._ledger_problems()
        return "\n".join(problems) if problems else "ok"
