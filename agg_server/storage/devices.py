"""Devices and the one-time enrollment tokens they register with (tables ``devices`` and
``enrollment_tokens``), a part of `agg_server.storage.Storage`.

Invariants of this module:

* Bearer tokens and enrollment tokens are stored as SHA-256 digests only.
* A device is created in the transaction that claims its credential: a certified identity key registers
  once, an enrollment token is used once (of two registrations racing on one token, one wins).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agg_server.storage.base import Tables, check_devices, check_digest, check_time
from protocol.errors import EnrollmentRefused, StorageError

__all__ = ["DeviceQueries"]


class DeviceQueries(Tables):
    """Registering devices and looking them up."""

    def add_device(
        self,
        token_sha256: bytes,
        platform: str,
        now: float,
        *,
        source: str = "",
        identity_key: bytes | None = None,
        enrollment_token_sha256: bytes | None = None,
        device_id: int | None = None,
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
        device_id : int, optional
            The id to register it under (>= 1: a certificate that names its device id); default the next.

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
        digest = check_digest(token_sha256)
        at = check_time("now", now)
        if identity_key is not None and (type(identity_key) is not bytes or len(identity_key) != 32):
            raise ValueError("identity_key must be 32 bytes")
        enrollment = None if enrollment_token_sha256 is None else check_digest(enrollment_token_sha256)
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
            if device_id is None:
                row = conn.execute(
                    "INSERT INTO devices (token_sha256, platform, registered_at, source, identity_key) "
                    "VALUES (?, ?, ?, ?, ?) RETURNING device_id",
                    (digest, str(platform), at, str(source), identity_key),
                ).fetchone()
            else:
                row = self._insert_with_id(conn, device_id, (digest, str(platform), at, str(source), identity_key))
            if row is None:  # pragma: no cover - RETURNING always gives the new row
                raise StorageError("add_device: no row id returned")
            if enrollment is not None:
                conn.execute(
                    "UPDATE enrollment_tokens SET used_by = ? WHERE token_sha256 = ?", (int(row[0]), enrollment)
                )
        return int(row[0])

    def _insert_with_id(self, conn: Any, device_id: int, values: tuple[Any, ...]) -> Any:
        """Insert a device under ``device_id`` (refused if taken); keep PostgreSQL's id sequence above it."""
        if isinstance(device_id, bool) or not isinstance(device_id, int) or device_id < 1:
            raise EnrollmentRefused(f"a certificate's device id must be >= 1, got {device_id!r}")
        if conn.execute("SELECT 1 FROM devices WHERE device_id = ?", (device_id,)).fetchone():
            raise EnrollmentRefused(f"device id {device_id} named by the certificate is already registered")
        row = conn.execute(
            "INSERT INTO devices (device_id, token_sha256, platform, registered_at, source, identity_key) "
            "VALUES (?, ?, ?, ?, ?, ?) RETURNING device_id",
            (device_id, *values),
        ).fetchone()
        if self.dialect == "postgresql":
            conn.execute(
                "SELECT setval(pg_get_serial_sequence('devices', 'device_id'), "
                "GREATEST((SELECT max(device_id) FROM devices), 1))"
            )
        return row

    def add_enrollment_tokens(self, token_sha256s: Sequence[bytes], source: str, now: float) -> None:
        """Store the digests of new one-time enrollment tokens of one credential source."""
        digests = [check_digest(d) for d in token_sha256s]
        at = check_time("now", now)
        if not isinstance(source, str) or not source:
            raise ValueError("an enrollment token source is a non-empty string")
        with self._transaction("add_enrollment_tokens") as conn:
            conn.executemany(
                "INSERT INTO enrollment_tokens (token_sha256, source, created_at) VALUES (?, ?, ?)",
                [(d, source, at) for d in digests],
            )

    def enrollment_token_source(self, token_sha256: bytes) -> tuple[str, bool] | None:
        """The source of an enrollment token and whether it was used; None for an unknown token."""
        digest = check_digest(token_sha256)
        with self._guard("enrollment_token_source") as conn:
            row = conn.execute(
                "SELECT source, used_at FROM enrollment_tokens WHERE token_sha256 = ?", (digest,)
            ).fetchone()
        return None if row is None else (str(row[0]), row[1] is not None)

    def device_sources(self, device_ids: Sequence[int]) -> dict[int, str]:
        """The credential source of each of ``device_ids`` that is registered."""
        ids = check_devices("device", device_ids)
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

    def device_for_token(self, token_sha256: bytes) -> int | None:
        """Return the device id registered with this token digest, or None."""
        digest = check_digest(token_sha256)
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
