"""Rounds, their cohort leases and who took part in which phase (tables ``rounds``, ``cohort_leases``,
``participation`` and ``phase_timings``), a part of `agg_server.storage.Storage`.

Invariants of this module:

* Several instances (docs/operations.md): a write of a round given ``fence=(cohort, token)`` first reads
  the cohort's lease row with a share lock and refuses (`LeaseLost`) unless the token is still the
  current one, in the same transaction (`check_fence`); a lease acquisition locks that row for update
  and bumps the token, so a write of a deposed leader either commits before the take-over or is refused
  after it.
* A round's ε is reserved in the transaction that opens it (under the rounds lock); a round that ends
  without committing gives the reservation back only if it was never revealed (`close_round`, `abandon`,
  through `agg_server.storage.ledger.release_unrevealed`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from agg_server.storage.base import (
    Fence,
    LedgerUpdate,
    Tables,
    check_devices,
    check_id,
    check_time,
    optional_number,
    to_json,
)
from agg_server.storage.database import Database
from agg_server.storage.ledger import read_ledger, release_unrevealed, store_ledger
from agg_server.storage.records import (
    COHORT_PHASE,
    LeaseRecord,
    ParticipationStatus,
    PhaseRecord,
    RoundRecord,
    RoundStatus,
)
from protocol.errors import StorageError

__all__ = ["RoundQueries", "LeaseLost", "ROUND_UPDATE_KEYS", "close_round", "check_fence", "abandon"]


class LeaseLost(StorageError):
    """A write of a round was refused: the cohort's lease has a newer fencing token (another instance
    leads the cohort now) or no longer exists."""


_log = logging.getLogger("agg_server.storage")

_ROUND_COLUMNS = (
    "round_id, started_at, finished_at, status, reason, base_model_version, new_model_version, "
    "cohort_size, survivors, epsilon_spent, params, cohort, revealed"
)
#: The keys `Storage.commit_model` accepts in ``round_update`` (passed on to `close_round`).
ROUND_UPDATE_KEYS = frozenset({"survivors", "epsilon_spent", "reason", "sum_sha256", "strategy_state"})


class RoundQueries(Tables):
    """Opening and closing rounds, cohort leases, and each phase's participation."""

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
        rid = check_id("round_id", round_id)
        base = check_id("base_model_version", base_model_version)
        members = check_devices("cohort", cohort)
        text = to_json("params", params)
        at = check_time("now", now)
        with self._transaction("start_round") as conn:
            conn.lock_rounds()
            lead, token = (0, 0) if fence is None else check_fence(conn, "start_round", fence)
            if conn.execute("SELECT 1 FROM rounds WHERE round_id = ?", (rid,)).fetchone():
                raise StorageError(f"start_round: round {rid} already exists")
            if reserve is not None:
                store_ledger(conn, to_json("ledger", reserve(read_ledger(conn, self.where))))
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
                check_fence(conn, "finish_round", fence)
            close_round(
                conn,
                self.where,
                round_id,
                status,
                reason=reason,
                new_model_version=new_model_version,
                survivors=survivors,
                epsilon_spent=epsilon_spent,
                now=now,
            )

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
        at = check_time("now", now)
        with self._transaction("abandon_open_rounds") as conn:
            conn.lock_rounds()
            return abandon(conn, None, "server restarted", at, self.where)

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
        c = check_id("cohort", cohort)
        at = check_time("now", now)
        ttl = check_time("seconds", seconds)
        if not isinstance(holder, str) or not holder:
            raise ValueError(f"holder must be a non-empty string, got {holder!r}")
        with self._transaction("acquire_lease") as conn:
            conn.lock_rounds()
            conn.execute(
                "INSERT INTO cohort_leases (cohort, holder, url, token, expires_at) VALUES (?, '', '', 1, 0) "
                "ON CONFLICT (cohort) DO NOTHING",
                (c,),
            )
            # Expiry by the database's clock (one clock for every instance, whatever their hosts' skew).
            row = conn.execute(
                f"SELECT holder, token, expires_at > {conn.now_sql()} FROM cohort_leases WHERE cohort = ?"
                f"{conn.row_lock('update')}",
                (c,),
            ).fetchone()
            current, token, live = str(row[0]), int(row[1]), bool(row[2])
            if current and current != holder and live:
                return None
            token = token + 1 if current else token
            conn.execute(
                f"UPDATE cohort_leases SET holder = ?, url = ?, token = ?, expires_at = {conn.now_sql()} + ? "
                "WHERE cohort = ?",
                (holder, str(url), token, ttl, c),
            )
            abandoned = abandon(conn, c, f"cohort {c} taken over by {holder}", at, self.where)
        for rid in abandoned:
            _log.warning("round %d of cohort %d abandoned: its leader is gone (now led by %s)", rid, c, holder)
        return token, abandoned

    def renew_lease(self, cohort: int, token: int, now: float, seconds: float) -> bool:
        """Extend a held lease; False when the token is no longer current (the lease was lost)."""
        c, t = check_id("cohort", cohort), check_id("token", token)
        check_time("now", now)
        ttl = check_time("seconds", seconds)
        with self._transaction("renew_lease") as conn:
            cur = conn.execute(
                f"UPDATE cohort_leases SET expires_at = {conn.now_sql()} + ? WHERE cohort = ? AND token = ?",
                (ttl, c, t),
            )
            return cur.rowcount == 1

    def release_lease(self, cohort: int, token: int) -> None:
        """Give a held lease up at once (graceful shutdown), so another instance can take the cohort."""
        c, t = check_id("cohort", cohort), check_id("token", token)
        with self._transaction("release_lease") as conn:
            conn.execute("UPDATE cohort_leases SET expires_at = 0 WHERE cohort = ? AND token = ?", (c, t))

    def leases(self) -> list[LeaseRecord]:
        """Every cohort lease, by cohort (``expires_in``: seconds left by the database's clock)."""
        with self._guard("leases") as conn:
            rows = conn.execute(
                f"SELECT cohort, holder, url, token, expires_at, expires_at - {conn.now_sql()} FROM cohort_leases "
                "ORDER BY cohort"
            ).fetchall()
        return [
            LeaseRecord(
                cohort=int(c), holder=str(h), url=str(u), token=int(t), expires_at=float(e), expires_in=float(left)
            )
            for c, h, u, t, e, left in rows
        ]

    def mark_revealed(self, round_id: int, *, fence: Fence | None = None) -> None:
        """Record, before the UNMASK phase is announced, that the round's sum may be revealed from now
        on: its ε reservation then stays charged whatever happens to the round."""
        rid = check_id("round_id", round_id)
        with self._transaction("mark_revealed") as conn:
            # The rounds lock first, then the lease row: the order of `acquire_lease` (the opposite order
            # deadlocked a take-over racing a reveal).
            conn.lock_rounds()
            if fence is not None:
                check_fence(conn, "mark_revealed", fence)
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
        n = check_id("limit", limit)
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
        rid = check_id("round_id", round_id)
        name = str(phase)
        if not name:
            raise ValueError("phase must be a non-empty string")
        ok = check_devices("arrived", arrived)
        gone = check_devices("dropped", dropped)
        both = set(ok) & set(gone)
        if both:
            raise ValueError(f"devices {sorted(both)} are listed as both arrived and dropped")
        secs = check_time("seconds", seconds)
        at = check_time("now", now)
        with self._transaction("record_phase") as conn:
            if fence is not None:
                check_fence(conn, "record_phase", fence)
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
        rid = check_id("round_id", round_id)
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
        rid = check_id("round_id", round_id)
        ok: list[int] = []
        dropped: list[int] = []
        with self._guard("phase_devices") as conn:
            for device, status in conn.execute(
                "SELECT device_id, status FROM participation WHERE round_id = ? AND phase = ? ORDER BY device_id",
                (rid, str(phase)),
            ):
                (ok if status == ParticipationStatus.OK.value else dropped).append(int(device))
        return ok, dropped


def close_round(
    conn: Database,
    where: str,
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
    """Close an open round on the caller's connection (`RoundQueries.finish_round`'s own transaction, or
    `Storage.commit_model`'s), which holds the rounds lock."""
    rid = check_id("round_id", round_id)
    final = _round_status(status)
    if final is RoundStatus.OPEN:
        raise ValueError("finish_round: status must be 'committed', 'aborted' or 'abandoned'")
    version = None if new_model_version is None else check_id("new_model_version", new_model_version)
    count = None if survivors is None else check_id("survivors", survivors)
    epsilon = optional_number("epsilon_spent", epsilon_spent)
    at = check_time("now", now)
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
        conn.execute("UPDATE rounds SET params = ? WHERE round_id = ?", (to_json("params", params), rid))
    if final is not RoundStatus.COMMITTED:
        release_unrevealed(conn, [rid], where)


def check_fence(conn: Database, op: str, fence: Fence) -> Fence:
    """Refuse ``op`` with `LeaseLost` unless ``fence`` holds the current token of its cohort's lease (the row
    is share-locked until the caller's transaction ends)."""
    cohort, token = check_id("fence cohort", fence[0]), check_id("fence token", fence[1])
    row = conn.execute(
        f"SELECT token FROM cohort_leases WHERE cohort = ?{conn.row_lock('share')}", (cohort,)
    ).fetchone()
    if row is None or int(row[0]) != token:
        now = "no lease" if row is None else f"token {row[0]}"
        raise LeaseLost(f"{op}: the lease of cohort {cohort} is lost (held token {token}, the database has {now})")
    return cohort, token


def abandon(conn: Database, cohort: int | None, reason: str, at: float, where: str) -> list[int]:
    """Open rounds (of one cohort, or all) become 'abandoned'; unrevealed ones give their ε back."""
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
        release_unrevealed(conn, ids, where)
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
