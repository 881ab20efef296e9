"""The privacy ledger (table ``privacy_ledger``, one row), a part of `agg_server.storage.Storage`.

Invariants of this module:

* The ledger is read, changed and written only under the rounds lock: the functions taking a connection
  (`read_ledger`, `store_ledger`, `release_unrevealed`) run inside a caller's transaction that holds it,
  so a reservation, a release and a commit of several instances never interleave.
* A reservation is the ledger entry carrying the round id; a round that never revealed its sum gives it
  back when it ends without committing, a revealed one stays charged whatever happens next.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from agg_server.storage.base import Tables, to_json
from agg_server.storage.database import Database
from agg_server.storage.records import RoundStatus
from protocol.errors import StorageError

__all__ = ["LedgerQueries", "read_ledger", "store_ledger", "release_unrevealed"]


class LedgerQueries(Tables):
    """Saving and loading the privacy ledger, and checking it against the rounds."""

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

    def save_ledger(self, ledger: Mapping[str, Any]) -> None:
        """Store the privacy ledger (`PrivacyLedger.to_dict` output), replacing the previous one.

        Raises
        ------
        StorageError
            If the database fails.
        ValueError
            If the ledger is not JSON-serialisable.
        """
        text = to_json("ledger", ledger)
        with self._transaction("save_ledger") as conn:
            conn.lock_rounds()
            store_ledger(conn, text)

    def load_ledger(self) -> dict[str, Any] | None:
        """Return the stored privacy ledger, or None if none was saved.

        Raises
        ------
        StorageError
            If the database fails or the stored ledger is not a JSON object.
        """
        with self._guard("load_ledger") as conn:
            return read_ledger(conn, self.where, op="load_ledger: ")


def read_ledger(conn: Database, where: str, *, op: str = "") -> dict[str, Any] | None:
    """The stored privacy ledger (None: none saved), read on the caller's connection; ``op`` prefixes errors."""
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


def release_unrevealed(conn: Database, round_ids: Sequence[int], where: str) -> None:
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
    ledger = read_ledger(conn, where) if unrevealed else None
    if ledger is None or not isinstance(ledger.get("rounds"), list):
        return
    kept = [c for c in ledger["rounds"] if not (isinstance(c, dict) and c.get("round_id") in unrevealed)]
    if len(kept) != len(ledger["rounds"]):
        store_ledger(conn, to_json("ledger", {**ledger, "rounds": kept}))


def store_ledger(conn: Database, text: str) -> None:
    """Replace the stored privacy ledger by the JSON ``text`` (caller holds the rounds lock)."""
    conn.execute(
        "INSERT INTO privacy_ledger (id, ledger) VALUES (1, ?) ON CONFLICT (id) DO UPDATE SET ledger = excluded.ledger",
        (text,),
    )
