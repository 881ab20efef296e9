"""`Storage`: the aggregation server's durable state — devices, rounds, participation, the privacy
ledger, quality reports and model checkpoints — over a `Database` (SQLite or PostgreSQL,
`agg_server.storage.database`) and a `CheckpointFiles` folder (`agg_server.storage.checkpoints`).

Longer than 500 lines because it is one class with one method per query, each with its validation and
docstring; splitting it by table would scatter transactions that span tables (a commit writes the
checkpoint, the ledger and the round at once).

Invariants of this module:

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

import hashlib
import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from agg_server.storage.checkpoints import CheckpointFiles
from agg_server.storage.database import DATABASE_NAME, Database, open_database
from agg_server.storage.records import (
    COHORT_PHASE,
    CheckpointRecord,
    CheckpointStatus,
    LeaseRecord,
    ParticipationStatus,
    PhaseRecord,
    QualityRecord,
    RoundRecord,
    RoundStatus,
)
from protocol.errors import EnrollmentRefused, StorageError

__all__ = ["Storage", "LeaseLost", "HeadMoved"]


class LeaseLost(StorageError):
    """A write of a round was refused: the cohort's lease has a newer fencing token (another instance
    leads the cohort now) or no longer exists."""


class HeadMoved(StorageError):
    """`Storage.commit_model` with ``base_version``: another round committed first; ``head`` is the
    newest committed version (the caller rebases onto it and tries again)."""

    def __init__(self, message: str, head: int) -> None:
        super().__init__(message)
        self.head = head


Fence = tuple[int, int]
"""(cohort, fencing token) of the instance writing a round."""

LedgerUpdate = Callable[[dict[str, Any] | None], dict[str, Any]]
"""Reads the stored privacy ledger (None if none) and returns the new one, or raises to refuse."""

_log = logging.getLogger("agg_server.storage")

_DIGEST_BYTES = 32

_ROUND_COLUMNS = (
    "round_id, started_at, finished_at, status, reason, base_model_version, new_model_version, "
    "cohort_size, survivors, epsilon_spent, params, cohort, revealed"
)
_ROUND_UPDATE_KEYS = frozenset({"survivors", "epsilon_spent", "reason", "sum_sha256", "strategy_state"})


def _check_id(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def _check_time(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _optional_number(name: str, value: object) -> float | None:
    return None if value is None else _check_time(name, value)


def _json_default(obj: object) -> Any:
    # numpy scalars and arrays (e.g. an np.int64 graph parameter) store as their Python values.
    tolist = getattr(obj, "tolist", None)
    if callable(tolist):
        return tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON-serialisable")


def _to_json(name: str, value: Mapping[str, Any]) -> str:
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a mapping, got {type(value).__name__}")
    try:
        # allow_nan=False: NaN is not JSON, and the status page serves these values as JSON.
        return json.dumps(dict(value), allow_nan=False, sort_keys=True, default=_json_default)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} cannot be stored as JSON: {exc}") from None


class Storage:
    """Devices, rounds, participation, the privacy ledger and model checkpoints of one server.

    Parameters
    ----------
    data_dir : Path
        Folder for ``fedrec.sqlite3`` and ``checkpoints/`` (created if missing).
    keep_checkpoints : int
        Good checkpoint files to keep (>= 1); older ones are deleted after each commit.

    Raises
    ------
    StorageError
        If the folder cannot be created, or the database cannot be opened, is corrupt, is not a
        fedrec database, has a newer schema, or cannot switch to WAL mode.
    ValueError
        If ``keep_checkpoints < 1``.

    Notes
    -----
    Use from one thread.  `close` (or leaving a ``with`` block) checkpoints the WAL and closes.
    """

    def __init__(self, data_dir: Path, *, keep_checkpoints: int = 5, url: str | None = None) -> None:
        if isinstance(keep_checkpoints, bool) or not isinstance(keep_checkpoints, int) or keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be an int >= 1, got {keep_checkpoints!r}")
        self.data_dir = Path(data_dir)
        self.db_path = self.data_dir / DATABASE_NAME
        self.keep_checkpoints = keep_checkpoints
        self._files = CheckpointFiles(self.data_dir)
        self._checkpoint_dir = self._files.folder
        self._db: Database | None = open_database(self.data_dir, url)
        self.where = self._db.where
        try:
            self._remove_leftovers()
        except BaseException:
            self.close()
            raise

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

    def _ledger_problems(self) -> list[str]:
        # Every ε charge names a round that exists and is open (reserved), committed or revealed: a
        # round that never revealed its sum and did not commit must have given its reservation back.
        ledger = self.load_ledger()
        if ledger is None:
            return []
        with self._guard("integrity_check") as conn:
            rounds = {
                int(r): (str(s), bool(v)) for r, s, v in conn.execute("SELECT round_id, status, revealed FROM rounds")
            }
        problems: list[str] = []
        charged = [c.get("round_id") for c in ledger.get("rounds", []) if isinstance(c, dict)]
        twice = sorted({r for r in charged if r is not None and charged.count(r) > 1})
        if twice:
            problems.append(f"rounds charged twice in the privacy ledger: {twice}")
        for rid in charged:
            if rid is None:
                continue
            status, revealed = rounds.get(int(rid), ("missing", False))
            if status not in (RoundStatus.OPEN.value, RoundStatus.COMMITTED.value) and not revealed:
                problems.append(f"round {rid} is charged in the privacy ledger but is {status} and was never revealed")
        return problems

    # -- devices --------------------------------------------------------------------------------

    def add_device(
        self,
        token_sha256: bytes,
        platform: str,
        now: float,
        *,
        source: str = "",
        identity_key: bytes | None = None,
        enrollment_token_sha256: bytes | None = None,
    ) -> int:
        """Register a device by the SHA-256 of its bearer token.

        Parameters
        ----------
        token_sha256 : bytes
            32-byte digest of the token (the token itself is never stored).
        platform : str
            Free-form platform label reported by the device.
        now : float
            Registration time on the coordinator's clock.
        source : str
            The credential source it enrolled through (``cert:<batch hex>``, ``token:<label>``, ``open``).
        identity_key : bytes, optional
            Its certified Ed25519 public key (32 bytes); a key registers once.
        enrollment_token_sha256 : bytes, optional
            The digest of the one-time enrollment token it used: marked used in the same transaction.

        Returns
        -------
        int
            The new device id (>= 1).

        Raises
        ------
        StorageError
            If the digest is already registered or the database fails.
        ValueError
            If the digest is not 32 bytes.
        """
        digest = _check_digest(token_sha256)
        at = _check_time("now", now)
        if identity_key is not None and (type(identity_key) is not bytes or len(identity_key) != 32):
            raise ValueError("identity_key must be 32 bytes")
        enrollment = None if enrollment_token_sha256 is None else _check_digest(enrollment_token_sha256)
        with self._transaction("add_device") as conn:
            if conn.execute("SELECT 1 FROM devices WHERE token_sha256 = ?", (digest,)).fetchone():
                raise StorageError("add_device: this token digest is already registered")
            if (
                identity_key is not None
                and conn.execute("SELECT 1 FROM devices WHERE identity_key = ?", (identity_key,)).fetchone()
            ):
                raise EnrollmentRefused("this certified identity key is already registered (certificates enroll once)")
            if enrollment is not None:
                # Claimed inside the transaction: of two registrations racing on one token, one wins.
                claimed = conn.execute(
                    "UPDATE enrollment_tokens SET used_at = ? WHERE token_sha256 = ? AND used_at IS NULL",
                    (at, enrollment),
                ).rowcount
                if claimed != 1:
                    raise EnrollmentRefused(
                        "the enrollment token is unknown or was used before (tokens are single use)"
                    )
            row = conn.execute(
                "INSERT INTO devices (token_sha256, platform, registered_at, source, identity_key) "
                "VALUES (?, ?, ?, ?, ?) RETURNING device_id",
                (digest, str(platform), at, str(source), identity_key),
            ).fetchone()
            if row is None:  # pragma: no cover - RETURNING always gives the new row
                raise StorageError("add_device: no row id returned")
            if enrollment is not None:
                conn.execute(
                    "UPDATE enrollment_tokens SET used_by = ? WHERE token_sha256 = ?", (int(row[0]), enrollment)
                )
        return int(row[0])

    def add_enrollment_tokens(self, token_sha256s: Sequence[bytes], source: str, now: float) -> None:
        """Store the digests of new one-time enrollment tokens of one credential source."""
        digests = [_check_digest(d) for d in token_sha256s]
        at = _check_time("now", now)
        if not isinstance(source, str) or not source:
            raise ValueError("an enrollment token source is a non-empty string")
        with self._transaction("add_enrollment_tokens") as conn:
            conn.executemany(
                "INSERT INTO enrollment_tokens (token_sha256, source, created_at) VALUES (?, ?, ?)",
                [(d, source, at) for d in digests],
            )

    def enrollment_token_source(self, token_sha256: bytes) -> tuple[str, bool] | None:
        """The source of an enrollment token and whether it was used; None for an unknown token."""
        digest = _check_digest(token_sha256)
        with self._guard("enrollment_token_source") as conn:
            row = conn.execute(
                "SELECT source, used_at FROM enrollment_tokens WHERE token_sha256 = ?", (digest,)
            ).fetchone()
        return None if row is None else (str(row[0]), row[1] is not None)

    def device_sources(self, device_ids: Sequence[int]) -> dict[int, str]:
        """The credential source of each of ``device_ids`` that is registered."""
        ids = _check_devices("device", device_ids)
        out: dict[int, str] = {}
        with self._guard("device_sources") as conn:
            for start in range(0, len(ids), 500):
                chunk = ids[start : start + 500]
                marks = ",".join("?" * len(chunk))
                for device_id, source in conn.execute(
                    f"SELECT device_id, source FROM devices WHERE device_id IN ({marks})", chunk
                ):
                    out[int(device_id)] = str(source)
        return out

    def store_revocation_list(self, number: int, data: bytes, now: float) -> tuple[int, bytes] | None:
        """Store an (already verified) revocation list numbered ``number`` unless the database holds one
        with that number or higher; returns None when stored, else the newest stored ``(number, data)``,
        which the caller compares (one transaction, serialised with the other instances)."""
        n = _check_id("number", number)
        at = _check_time("now", now)
        if type(data) is not bytes or not data:
            raise ValueError("a revocation list is non-empty bytes")
        with self._transaction("store_revocation_list") as conn:
            conn.lock_rounds()
            row = conn.execute("SELECT number, data FROM revocation_lists ORDER BY number DESC LIMIT 1").fetchone()
            if row is not None and int(row[0]) >= n:
                return int(row[0]), bytes(row[1])
            conn.execute("INSERT INTO revocation_lists (number, data, stored_at) VALUES (?, ?, ?)", (n, data, at))
        return None

    def newest_revocation_number(self) -> int | None:
        """The number of the newest stored revocation list (None: none stored)."""
        with self._guard("newest_revocation_number") as conn:
            row = conn.execute("SELECT max(number) FROM revocation_lists").fetchone()
        return None if row is None or row[0] is None else int(row[0])

    def revocation_list(self, number: int) -> bytes | None:
        """The stored revocation list numbered ``number`` (None: not stored)."""
        n = _check_id("number", number)
        with self._guard("revocation_list") as conn:
            row = conn.execute("SELECT data FROM revocation_lists WHERE number = ?", (n,)).fetchone()
        return None if row is None else bytes(row[0])

    def certified_device_count(self) -> int:
        """How many registered devices have a certified identity key."""
        with self._guard("certified_device_count") as conn:
            return int(conn.execute("SELECT count(*) FROM devices WHERE identity_key IS NOT NULL").fetchone()[0])

    def revoked_devices(self, identity_keys: frozenset[bytes]) -> list[int]:
        """`devices_with_identity` by the cheaper of two plans: look each key up (a list shorter than the
        fleet) or scan the certified devices once and test each key against the set (a list longer than
        the fleet: 10^6 revoked keys, 1,000 devices)."""
        if len(identity_keys) <= self.certified_device_count():
            return self.devices_with_identity(sorted(identity_keys))
        with self._guard("revoked_devices") as conn:
            rows = conn.execute("SELECT device_id, identity_key FROM devices WHERE identity_key IS NOT NULL").fetchall()
        return sorted(int(d) for d, k in rows if bytes(k) in identity_keys)

    def devices_with_identity(self, identity_keys: Sequence[bytes]) -> list[int]:
        """The registered devices whose certified identity key is one of ``identity_keys`` (ascending)."""
        keys = sorted({bytes(k) for k in identity_keys})
        if any(len(k) != 32 for k in keys):
            raise ValueError("identity keys are 32 bytes")
        out: list[int] = []
        with self._guard("devices_with_identity") as conn:
            for start in range(0, len(keys), 500):
                chunk = keys[start : start + 500]
                marks = ",".join("?" * len(chunk))
                out.extend(
                    int(r[0])
                    for r in conn.execute(f"SELECT device_id FROM devices WHERE identity_key IN ({marks})", chunk)
                )
        return sorted(out)

    def device_for_token(self, token_sha256: bytes) -> int | None:
        """Return the device id registered with this token digest, or None."""
        digest = _check_digest(token_sha256)
        with self._guard("device_for_token") as conn:
            row = conn.execute("SELECT device_id FROM devices WHERE token_sha256 = ?", (digest,)).fetchone()
        return None if row is None else int(row[0])

    def device_count(self) -> int:
        """Return the number of registered devices."""
        with self._guard("device_count") as conn:
            return int(conn.execute("SELECT count(*) FROM devices").fetchone()[0])

    def device_ids(self) -> list[int]:
        """Return every registered device id, ascending."""
        with self._guard("device_ids") as conn:
            return [int(r[0]) for r in conn.execute("SELECT device_id FROM devices ORDER BY device_id")]

    # -- rounds ---------------------------------------------------------------------------------

    def next_round_id(self) -> int:
        """Return one more than the largest round id ever stored (1 for a new database)."""
        with self._guard("next_round_id") as conn:
            return int(conn.execute("SELECT coalesce(max(round_id), 0) + 1 FROM rounds").fetchone()[0])

    def start_round(
        self,
        round_id: int,
        base_model_version: int,
        cohort: Sequence[int],
        params: Mapping[str, Any],
        now: float,
        *,
        fence: Fence | None = None,
        reserve: LedgerUpdate | None = None,
    ) -> None:
        """Record a new open round and its invited cohort.

        Parameters
        ----------
        round_id : int
            New, unused round id (see `next_round_id`).
        base_model_version : int
            Model version the cohort trains.
        cohort : Sequence[int]
            Registered device ids invited (stored as participation phase `COHORT_PHASE`).
        params : Mapping[str, Any]
            JSON-serialisable round parameters (graph, deadlines, training plan…).
        now : float
            Start time on the coordinator's clock.
        fence : (cohort, token), optional
            The leader's lease: refused with `LeaseLost` unless the token is current.
        reserve : callable, optional
            Reserves the round's ε: called with the stored privacy ledger inside the transaction (under
            the rounds lock, so no other instance changes the ledger meanwhile); its result is stored.
            Whatever it raises (e.g. `PrivacyBudgetExceeded`) refuses the round, nothing is written.

        Raises
        ------
        StorageError
            If the round id exists, a device is unknown, the lease was lost, or the database fails.
        ValueError
            If an argument is malformed (negative id, duplicate device, params not JSON).
        """
        rid = _check_id("round_id", round_id)
        base = _check_id("base_model_version", base_model_version)
        members = _check_devices("cohort", cohort)
        text = _to_json("params", params)
        at = _check_time("now", now)
        with self._transaction("start_round") as conn:
            conn.lock_rounds()
            lead, token = (0, 0) if fence is None else _check_fence(conn, "start_round", fence)
            if conn.execute("SELECT 1 FROM rounds WHERE round_id = ?", (rid,)).fetchone():
                raise StorageError(f"start_round: round {rid} already exists")
            if reserve is not None:
                _store_ledger(conn, _to_json("ledger", reserve(_read_ledger(conn, self.where))))
            conn.execute(
                "INSERT INTO rounds (round_id, started_at, status, base_model_version, cohort_size, params, "
                "cohort, lease_token) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (rid, at, RoundStatus.OPEN.value, base, len(members), text, lead, token),
            )
            conn.executemany(
                "INSERT INTO participation (round_id, device_id, phase, status, at) VALUES (?, ?, ?, ?, ?)",
                [(rid, d, COHORT_PHASE, ParticipationStatus.OK.value, at) for d in members],
            )

    def finish_round(
        self,
        round_id: int,
        status: str,
        *,
        reason: str = "",
        new_model_version: int | None = None,
        survivors: int | None = None,
        epsilon_spent: float | None = None,
        now: float,
        fence: Fence | None = None,
    ) -> None:
        """Close an open round.  A round that does not commit and was never revealed gives its ε
        reservation back (its entry leaves the privacy ledger); a revealed one stays charged.

        Parameters
        ----------
        round_id : int
            An open round.
        status : str
            "committed", "aborted" or "abandoned" (a `RoundStatus` other than OPEN).
        reason : str
            Why the round did not commit.
        new_model_version, survivors, epsilon_spent : optional
            Outcome of the round, when known.
        now : float
            Finish time on the coordinator's clock.
        fence : (cohort, token), optional
            The leader's lease (`LeaseLost` unless current).

        Raises
        ------
        StorageError
            If the round does not exist or is not open, the lease was lost, or the database fails.
        ValueError
            If ``status`` is not a final status or a value is malformed.
        """
        with self._transaction("finish_round") as conn:
            conn.lock_rounds()  # the ledger may change (a released reservation)
            if fence is not None:
                _check_fence(conn, "finish_round", fence)
            self._finish_round(
                conn,
                round_id,
                status,
                reason=reason,
                new_model_version=new_model_version,
                survivors=survivors,
                epsilon_spent=epsilon_spent,
                now=now,
            )

    def _finish_round(
        self,
        conn: Database,
        round_id: int,
        status: str,
        *,
        reason: str,
        new_model_version: int | None,
        survivors: int | None,
        epsilon_spent: float | None,
        now: float,
        sum_sha256: bytes | None = None,
        strategy_state: Mapping[str, Any] | None = None,
    ) -> None:
        # Runs inside the caller's transaction (finish_round's own, or commit_model's), which holds the
        # rounds lock.
        rid = _check_id("round_id", round_id)
        final = _round_status(status)
        if final is RoundStatus.OPEN:
            raise ValueError("finish_round: status must be 'committed', 'aborted' or 'abandoned'")
        version = None if new_model_version is None else _check_id("new_model_version", new_model_version)
        count = None if survivors is None else _check_id("survivors", survivors)
        epsilon = _optional_number("epsilon_spent", epsilon_spent)
        at = _check_time("now", now)
        digest = None if sum_sha256 is None else bytes(sum_sha256)
        cur = conn.execute(
            "UPDATE rounds SET status = ?, reason = ?, finished_at = ?, new_model_version = ?, "
            "survivors = ?, epsilon_spent = ?, sum_sha256 = ? WHERE round_id = ? AND status = ?",
            (final.value, str(reason), at, version, count, epsilon, digest, rid, RoundStatus.OPEN.value),
        )
        if cur.rowcount != 1:
            row = conn.execute("SELECT status FROM rounds WHERE round_id = ?", (rid,)).fetchone()
            if row is None:
                raise StorageError(f"finish_round: round {rid} does not exist")
            raise StorageError(f"finish_round: round {rid} is already {row[0]}")
        if strategy_state is not None:
            row = conn.execute("SELECT params FROM rounds WHERE round_id = ?", (rid,)).fetchone()
            params = json.loads(row[0]) if row is not None and row[0] else {}
            params["strategy_state"] = dict(strategy_state)
            conn.execute("UPDATE rounds SET params = ? WHERE round_id = ?", (_to_json("params", params), rid))
        if final is not RoundStatus.COMMITTED:
            _release_unrevealed(conn, [rid], self.where)

    def abandon_open_rounds(self, now: float) -> list[int]:
        """Mark every open round 'abandoned' with reason "server restarted" (call on start-up of a
        single instance; several instances abandon one cohort's rounds in `acquire_lease`).

        A round's secrets lived only in the stopped process, so it can never finish; its devices
        will be told to check in again.  Unrevealed rounds give their ε reservation back.

        Parameters
        ----------
        now : float
            Time on the coordinator's clock.

        Returns
        -------
        list[int]
            The abandoned round ids, ascending.
        """
        at = _check_time("now", now)
        with self._transaction("abandon_open_rounds") as conn:
            conn.lock_rounds()
            return _abandon(conn, None, "server restarted", at, self.where)

    # -- cohort leases (several instances on one database) ----------------------------------------

    def acquire_lease(
        self, cohort: int, holder: str, url: str, now: float, seconds: float
    ) -> tuple[int, list[int]] | None:
        """Lead ``cohort`` for ``seconds`` if it has no live leader (or ``holder`` leads it already, e.g.
        before a restart): the token grows by one, and the cohort's rounds still open (their leader is
        gone or restarted) are abandoned in the same transaction, unrevealed ones giving their ε back.

        Returns
        -------
        (int, list[int]) or None
            The new fencing token and the round ids abandoned, or None when another holder's lease has
            not expired.
        """
        c = _check_id("cohort", cohort)
        at = _check_time("now", now)
        ttl = _check_time("seconds", seconds)
        if not isinstance(holder, str) or not holder:
            raise ValueError(f"holder must be a non-empty string, got {holder!r}")
        with self._transaction("acquire_lease") as conn:
            conn.lock_rounds()
            conn.execute(
                "INSERT INTO cohort_leases (cohort, holder, url, token, expires_at) VALUES (?, '', '', 1, 0) "
                "ON CONFLICT (cohort) DO NOTHING",
                (c,),
            )
            row = conn.execute(
                f"SELECT holder, token, expires_at FROM cohort_leases WHERE cohort = ?{conn.row_lock('update')}",
                (c,),
            ).fetchone()
            current, token, expires = str(row[0]), int(row[1]), float(row[2])
            if current and current != holder and expires > at:
                return None
            token = token + 1 if current else token
            conn.execute(
                "UPDATE cohort_leases SET holder = ?, url = ?, token = ?, expires_at = ? WHERE cohort = ?",
                (holder, str(url), token, at + ttl, c),
            )
            abandoned = _abandon(conn, c, f"cohort {c} taken over by {holder}", at, self.where)
        for rid in abandoned:
            _log.warning("round %d of cohort %d abandoned: its leader is gone (now led by %s)", rid, c, holder)
        return token, abandoned

    def renew_lease(self, cohort: int, token: int, now: float, seconds: float) -> bool:
        """Extend a held lease; False when the token is no longer current (the lease was lost)."""
        c, t = _check_id("cohort", cohort), _check_id("token", token)
        until = _check_time("now", now) + _check_time("seconds", seconds)
        with self._transaction("renew_lease") as conn:
            cur = conn.execute("UPDATE cohort_leases SET expires_at = ? WHERE cohort = ? AND token = ?", (until, c, t))
            return cur.rowcount == 1

    def release_lease(self, cohort: int, token: int) -> None:
        """Give a held lease up at once (graceful shutdown), so another instance can take the cohort."""
        c, t = _check_id("cohort", cohort), _check_id("token", token)
        with self._transaction("release_lease") as conn:
            conn.execute("UPDATE cohort_leases SET expires_at = 0 WHERE cohort = ? AND token = ?", (c, t))

    def leases(self) -> list[LeaseRecord]:
        """Every cohort lease, by cohort."""
        with self._guard("leases") as conn:
            rows = conn.execute(
                "SELECT cohort, holder, url, token, expires_at FROM cohort_leases ORDER BY cohort"
            ).fetchall()
        return [
            LeaseRecord(cohort=int(c), holder=str(h), url=str(u), token=int(t), expires_at=float(e))
            for c, h, u, t, e in rows
        ]

    def mark_revealed(self, round_id: int, *, fence: Fence | None = None) -> None:
        """Record, before the UNMASK phase is announced, that the round's sum may be revealed from now
        on: its ε reservation then stays charged whatever happens to the round."""
        rid = _check_id("round_id", round_id)
        with self._transaction("mark_revealed") as conn:
            if fence is not None:
                _check_fence(conn, "mark_revealed", fence)
            cur = conn.execute(
                "UPDATE rounds SET revealed = 1 WHERE round_id = ? AND status = ?", (rid, RoundStatus.OPEN.value)
            )
            if cur.rowcount != 1:
                raise StorageError(f"mark_revealed: round {rid} is not open")

    def round_sums(self) -> dict[int, tuple[int, bytes | None]]:
        """Committed rounds: round id -> (model version, SHA-256 of the unmasked sum or None)."""
        with self._guard("round_sums") as conn:
            rows = conn.execute(
                "SELECT round_id, new_model_version, sum_sha256 FROM rounds WHERE status = ? ORDER BY round_id",
                (RoundStatus.COMMITTED.value,),
            ).fetchall()
        return {int(r): (int(v), None if h is None else bytes(h)) for r, v, h in rows}

    def recent_rounds(self, limit: int = 20) -> list[RoundRecord]:
        """Return up to ``limit`` rounds, newest first.

        Raises
        ------
        StorageError
            If the database fails or a stored row is malformed.
        """
        n = _check_id("limit", limit)
        with self._guard("recent_rounds") as conn:
            rows = conn.execute(f"SELECT {_ROUND_COLUMNS} FROM rounds ORDER BY round_id DESC LIMIT ?", (n,)).fetchall()
        return [_round_record(row) for row in rows]

    def round_counts(self) -> dict[str, int]:
        """Return the number of rounds per status, with every status present (zeros included)."""
        counts = {s.value: 0 for s in RoundStatus}
        with self._guard("round_counts") as conn:
            for status, count in conn.execute("SELECT status, count(*) FROM rounds GROUP BY status"):
                counts[str(status)] = int(count)
        return counts

    # -- participation --------------------------------------------------------------------------

    def record_phase(
        self,
        round_id: int,
        phase: str,
        arrived: Sequence[int],
        dropped: Sequence[int],
        seconds: float,
        now: float,
        *,
        fence: Fence | None = None,
    ) -> None:
        """Record who answered and who dropped in one closed phase, and how long it took.

        Parameters
        ----------
        round_id : int
            The round (must exist).
        phase : str
            Phase name, e.g. a `protocol.session.Phase` value; recorded once per round.
        arrived, dropped : Sequence[int]
            Disjoint registered device ids.
        seconds : float
            How long the phase was open.
        now : float
            Time on the coordinator's clock.

        Raises
        ------
        StorageError
            If the phase was already recorded, the round or a device is unknown, or the database fails.
        ValueError
            If a device appears twice or in both lists, or a value is malformed.
        """
        rid = _check_id("round_id", round_id)
        name = str(phase)
        if not name:
            raise ValueError("phase must be a non-empty string")
        ok = _check_devices("arrived", arrived)
        gone = _check_devices("dropped", dropped)
        both = set(ok) & set(gone)
        if both:
            raise ValueError(f"devices {sorted(both)} are listed as both arrived and dropped")
        secs = _check_time("seconds", seconds)
        at = _check_time("now", now)
        with self._transaction("record_phase") as conn:
            if fence is not None:
                _check_fence(conn, "record_phase", fence)
            conn.execute(
                "INSERT INTO phase_timings (round_id, phase, seconds, arrived, dropped) VALUES (?, ?, ?, ?, ?)",
                (rid, name, secs, len(ok), len(gone)),
            )
            rows = [(rid, d, name, ParticipationStatus.OK.value, at) for d in ok]
            rows += [(rid, d, name, ParticipationStatus.DROPPED.value, at) for d in gone]
            conn.executemany(
                "INSERT INTO participation (round_id, device_id, phase, status, at) VALUES (?, ?, ?, ?, ?)",
                rows,
            )

    def phase_stats(self, round_id: int) -> list[PhaseRecord]:
        """Return the recorded phases of a round, in the order they were recorded."""
        rid = _check_id("round_id", round_id)
        with self._guard("phase_stats") as conn:
            rows = conn.execute(
                "SELECT phase, seconds, arrived, dropped FROM phase_timings WHERE round_id = ? "
                f"ORDER BY {conn.order_of_insertion()}",
                (rid,),
            ).fetchall()
        return [
            PhaseRecord(round_id=rid, phase=str(p), seconds=float(s), arrived=int(a), dropped=int(d))
            for p, s, a, d in rows
        ]

    def phase_devices(self, round_id: int, phase: str) -> tuple[list[int], list[int]]:
        """Return the device ids that were ok and that dropped in one phase (`COHORT_PHASE`: invited).

        Returns
        -------
        tuple[list[int], list[int]]
            (ok, dropped), each ascending.
        """
        rid = _check_id("round_id", round_id)
        ok: list[int] = []
        dropped: list[int] = []
        with self._guard("phase_devices") as conn:
            for device, status in conn.execute(
                "SELECT device_id, status FROM participation WHERE round_id = ? AND phase = ? ORDER BY device_id",
                (rid, str(phase)),
            ):
                (ok if status == ParticipationStatus.OK.value else dropped).append(int(device))
        return ok, dropped

    # -- privacy ledger -------------------------------------------------------------------------

    def save_ledger(self, ledger: Mapping[str, Any]) -> None:
        """Store the privacy ledger (`PrivacyLedger.to_dict` output), replacing the previous one.

        Raises
        ------
        StorageError
            If the database fails.
        ValueError
            If the ledger is not JSON-serialisable.
        """
        text = _to_json("ledger", ledger)
        with self._transaction("save_ledger") as conn:
            conn.lock_rounds()
            _store_ledger(conn, text)

    def load_ledger(self) -> dict[str, Any] | None:
        """Return the stored privacy ledger, or None if none was saved.

        Raises
        ------
        StorageError
            If the database fails or the stored ledger is not a JSON object.
        """
        with self._guard("load_ledger") as conn:
            return _read_ledger(conn, self.where, op="load_ledger: ")

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
        version = _check_id("model_version", model_version)
        for name, text in (("metric", metric), ("dataset", dataset)):
            if not isinstance(text, str) or not text:
                raise ValueError(f"{name} must be a non-empty string, got {text!r}")
        figure = _check_time("value", value)
        at = _check_time("now", now)
        with self._transaction("record_quality") as conn:
            conn.execute(
                "INSERT INTO model_quality (model_version, metric, dataset, value, reported_at) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (model_version, metric, dataset) "
                "DO UPDATE SET value = excluded.value, reported_at = excluded.reported_at",
                (version, metric, dataset, figure, at),
            )

    def model_quality(self, limit: int = 100) -> list[QualityRecord]:
        """Return up to ``limit`` quality figures, newest model version first (then metric, dataset)."""
        n = _check_id("limit", limit)
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

    # -- model checkpoints ----------------------------------------------------------------------

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
        version = _check_id("model_version", model_version)
        rid = None if round_id is None else _check_id("round_id", round_id)
        if not isinstance(payload, bytes | bytearray | memoryview):
            raise ValueError(f"payload must be bytes, got {type(payload).__name__}")
        data = bytes(payload)
        at = _check_time("now", now)
        # Everything that can be refused is checked before touching the disk.
        ledger_text = None if ledger is None else _to_json("ledger", ledger)
        update: dict[str, Any] = {}
        if round_update is not None:
            if rid is None:
                raise ValueError("round_update needs a round_id")
            unknown = set(round_update) - _ROUND_UPDATE_KEYS
            if unknown:
                raise ValueError(f"round_update: unknown keys {sorted(unknown)}; allowed {sorted(_ROUND_UPDATE_KEYS)}")
            update = {"reason": "", "survivors": None, "epsilon_spent": None, **round_update}
            if "strategy_state" in update:
                _to_json("strategy_state", update["strategy_state"])  # refused before the file is written
        if base_version is not None and version != _check_id("base_version", base_version) + 1:
            raise ValueError(f"model_version {version} must be base_version + 1 = {base_version + 1}")
        self._check_newer(version, base=base_version)
        relative, digest = self._files.write(version, data)
        shared = data if self.dialect == "postgresql" else None
        with self._transaction("commit_model") as conn:
            conn.lock_rounds()
            if fence is not None:
                _check_fence(conn, "commit_model", fence)
            # Again, under the lock: another instance may have committed meanwhile.
            self._check_newer(version, conn, base=base_version)
            self._record_checkpoint(conn, version, rid, relative, digest, len(data), at, shared)
            if ledger_text is not None:
                _store_ledger(conn, ledger_text)
            if round_update is not None and rid is not None:
                self._finish_round(conn, rid, RoundStatus.COMMITTED, new_model_version=version, now=at, **update)
            expired = self._expire_checkpoints(conn)
        self._files.delete(expired)

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

    def _expire_checkpoints(self, conn: Database) -> list[str]:
        # Inside the commit's transaction, so the row count never exceeds keep_checkpoints good ones
        # whatever the moment of a crash.  Everything older than the keep-th newest good checkpoint
        # goes, corrupt rows included.  Returns the files to delete once the transaction committed:
        # rows go first, so a crash leaves orphan files (removed on the next open), never rows
        # pointing at deleted files (which would look corrupt).
        row = conn.execute(
            "SELECT model_version FROM checkpoints WHERE status = ? ORDER BY model_version DESC LIMIT 1 OFFSET ?",
            (CheckpointStatus.GOOD.value, self.keep_checkpoints - 1),
        ).fetchone()
        if row is None:
            return []
        old = conn.execute("SELECT path FROM checkpoints WHERE model_version < ?", (row[0],)).fetchall()
        conn.execute("DELETE FROM checkpoints WHERE model_version < ?", (row[0],))
        return [str(r[0]) for r in old]

    def strategy_state(self, model_version: int) -> dict[str, Any]:
        """What the strategy stored with ``model_version`` when its round committed (the mapping given
        as ``round_update["strategy_state"]`` to `commit_model`); empty for an initial model, a round
        that stored nothing, or a version no round committed.

        Raises
        ------
        StorageError
            If the database fails or the stored value is not a JSON object.
        """
        version = _check_id("model_version", model_version)
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
        v = _check_id("model_version", version)
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


def _check_fence(conn: Database, op: str, fence: Fence) -> Fence:
    cohort, token = _check_id("fence cohort", fence[0]), _check_id("fence token", fence[1])
    row = conn.execute(
        f"SELECT token FROM cohort_leases WHERE cohort = ?{conn.row_lock('share')}", (cohort,)
    ).fetchone()
    if row is None or int(row[0]) != token:
        now = "no lease" if row is None else f"token {row[0]}"
        raise LeaseLost(f"{op}: the lease of cohort {cohort} is lost (held token {token}, the database has {now})")
    return cohort, token


def _read_ledger(conn: Database, where: str, *, op: str = "") -> dict[str, Any] | None:
    row = conn.execute("SELECT ledger FROM privacy_ledger WHERE id = 1").fetchone()
    if row is None:
        return None
    try:
        value = json.loads(row[0])
    except ValueError as exc:
        raise StorageError(f"{op}the stored privacy ledger in {where} is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise StorageError(f"{op}the stored privacy ledger in {where} is not an object")
    return value


def _release_unrevealed(conn: Database, round_ids: Sequence[int], where: str) -> None:
    """Give back the ε reservations of those of ``round_ids`` that were never revealed (caller holds the
    rounds lock).  A reservation is the ledger entry carrying the round id."""
    if not round_ids:
        return
    marks = ", ".join("?" for _ in round_ids)
    unrevealed = {
        int(r[0])
        for r in conn.execute(
            f"SELECT round_id FROM rounds WHERE revealed = 0 AND round_id IN ({marks})", tuple(round_ids)
        )
    }
    ledger = _read_ledger(conn, where) if unrevealed else None
    if ledger is None or not isinstance(ledger.get("rounds"), list):
        return
    kept = [c for c in ledger["rounds"] if not (isinstance(c, dict) and c.get("round_id") in unrevealed)]
    if len(kept) != len(ledger["rounds"]):
        _store_ledger(conn, _to_json("ledger", {**ledger, "rounds": kept}))


def _abandon(conn: Database, cohort: int | None, reason: str, at: float, where: str) -> list[int]:
    # Open rounds (of one cohort, or all) become 'abandoned'; unrevealed ones give their ε back.
    where_cohort = "" if cohort is None else " AND cohort = ?"
    args: tuple[Any, ...] = (RoundStatus.OPEN.value,) if cohort is None else (RoundStatus.OPEN.value, cohort)
    ids = [
        int(r[0])
        for r in conn.execute(f"SELECT round_id FROM rounds WHERE status = ?{where_cohort} ORDER BY round_id", args)
    ]
    if ids:
        conn.execute(
            f"UPDATE rounds SET status = ?, reason = ?, finished_at = ? WHERE status = ?{where_cohort}",
            (RoundStatus.ABANDONED.value, reason, at, *args),
        )
        _release_unrevealed(conn, ids, where)
    return ids


def _store_ledger(conn: Database, text: str) -> None:
    conn.execute(
        "INSERT INTO privacy_ledger (id, ledger) VALUES (1, ?) ON CONFLICT (id) DO UPDATE SET ledger = excluded.ledger",
        (text,),
    )


def _check_digest(value: object) -> bytes:
    if not isinstance(value, bytes | bytearray | memoryview) or len(value) != _DIGEST_BYTES:
        raise ValueError(f"token_sha256 must be {_DIGEST_BYTES} bytes, got {value!r:.40}")
    return bytes(value)


def _check_devices(name: str, devices: Sequence[int]) -> list[int]:
    ids = [_check_id(f"{name} device id", d) for d in devices]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{name} lists a device more than once")
    return ids


def _round_status(value: str) -> RoundStatus:
    try:
        return RoundStatus(value)
    except ValueError:
        allowed = ", ".join(repr(s.value) for s in RoundStatus)
        raise ValueError(f"round status must be one of {allowed}, got {value!r}") from None


def _round_record(row: tuple[Any, ...]) -> RoundRecord:
    rid, started, finished, status, reason, base, new, size, survivors, epsilon, params, cohort, revealed = row
    try:
        decoded = json.loads(params)
        state = RoundStatus(status)
    except ValueError as exc:
        raise StorageError(f"round {rid} is malformed in the database: {exc}") from exc
    return RoundRecord(
        round_id=int(rid),
        started_at=float(started),
        finished_at=None if finished is None else float(finished),
        status=state,
        reason=str(reason),
        base_model_version=int(base),
        new_model_version=None if new is None else int(new),
        cohort_size=int(size),
        survivors=None if survivors is None else int(survivors),
        epsilon_spent=None if epsilon is None else float(epsilon),
        params=decoded if isinstance(decoded, dict) else {"value": decoded},
        cohort=int(cohort),
        revealed=bool(revealed),
    )
