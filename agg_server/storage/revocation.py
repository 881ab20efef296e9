"""The enrollment authority's revocation lists (table ``revocation_lists``) and the devices whose certified
identity key they revoke, a part of `agg_server.storage.Storage`.

Invariants of this module:

* The stored lists only move forward: a list is stored only if its number is higher than every stored
  one, checked and inserted in one transaction under the rounds lock (serialised with other instances).
"""

from __future__ import annotations

from collections.abc import Sequence

from agg_server.storage.base import Tables, check_id, check_time

__all__ = ["RevocationQueries"]


class RevocationQueries(Tables):
    """Storing revocation lists and finding the devices they revoke."""

    def store_revocation_list(self, number: int, data: bytes, now: float) -> tuple[int, bytes] | None:
        """Store an (already verified) revocation list numbered ``number`` unless the database holds one
        with that number or higher; returns None when stored, else the newest stored ``(number, data)``,
        which the caller compares (one transaction, serialised with the other instances)."""
        n = check_id("number", number)
        at = check_time("now", now)
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
        n = check_id("number", number)
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

    def identity_keys(self, device_ids: Sequence[int]) -> dict[int, bytes]:
        """The certified identity key of each of ``device_ids`` that registered with one (a signed round's
        roster)."""
        ids = sorted({check_id("device_id", d) for d in device_ids})
        out: dict[int, bytes] = {}
        with self._guard("identity_keys") as conn:
            for start in range(0, len(ids), 500):
                chunk = ids[start : start + 500]
                marks = ",".join("?" * len(chunk))
                query = "SELECT device_id, identity_key FROM devices WHERE identity_key IS NOT NULL AND device_id IN "
                rows = conn.execute(f"{query}({marks})", chunk)
                out.update((int(d), bytes(k)) for d, k in rows)
        return out
