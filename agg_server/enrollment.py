"""Who may register a device (protocol 1.4, issue 15 items 1 and 4): enrollment credentials, their
sources, the per-source registration rate, and the per-source share of a round's cohort.

Invariants:
- A registration carries at most one credential: a certificate of the configured enrollment authority
  with a proof that the device holds the certified key, or an operator-issued one-time token.  Without
  one it is accepted only when ``enrollment.open_registration`` resolves to true (loopback development).
- Every credential has a source: ``cert:<batch hex>`` (the batch is signed inside the certificate),
  ``token:<label>`` (the label the operator issued the tokens under), or ``open``.  The rate limit and the
  cohort cap count per source.
- A certified identity key registers once, a token is consumed once (both in the same database
  transaction as the new device); tokens are stored as SHA-256 only.
- Nothing here touches the network; the caller passes ``now`` for rate limits, and certificates' validity
  periods are checked against the wall clock (``time.time()``, the clock the authority stamped them with).
- The revocation list in force only moves forward: it is replaced by a list of the authority with a
  higher (or equal, unchanged) number, never by one that fails to verify or goes back.  It comes from
  the file ``enrollment.revocation_list`` or from the shared database (lists an operator uploaded, kept
  forever, the number only growing), whichever is newer.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import secrets
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from agg_server.config import ServerConfig
from agg_server.storage import Storage
from protocol import crypto
from protocol.enrollment import load_revocation_list
from protocol.errors import CryptoError, EnrollmentRefused, RateLimited, RevocationListInvalid, StorageError

__all__ = ["Enrollment", "Credential", "capped_cohort", "TOKEN_LABEL", "MAX_TOKENS_PER_REQUEST"]

#: What an operator may call a batch of enrollment tokens.
TOKEN_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_TOKENS_PER_REQUEST = 10_000
OPEN_SOURCE = "open"
#: Seconds between two looks at the shared database for a newer uploaded revocation list.
DATABASE_POLL = 1.0
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Credential:
    """A checked registration credential: its source, the certified key (certificates) and the token
    digest to consume (tokens)."""

    source: str
    identity_key: bytes | None = None
    token_sha256: bytes | None = None
    rate_key: str = ""


class _Bucket:
    __slots__ = ("level", "at")

    def __init__(self, level: float, at: float) -> None:
        self.level = level
        self.at = at


class Enrollment:
    """The registration gate of one server.

    Parameters
    ----------
    config : the server configuration (``[enrollment]`` and ``server.host``).
    storage : the opened storage (devices, enrollment tokens).
    """

    def __init__(self, config: ServerConfig, storage: Storage) -> None:
        self.config = config.enrollment
        self.storage = storage
        self.authority = self.config.authority_public_key
        self.open = self.config.registration_is_open(config.listen.host)
        self._buckets: dict[str, _Bucket] = {}
        self._sources: dict[int, str] = {}
        self._crl_path = self.config.revocation_list
        self._crl: crypto.RevocationList | None = None
        self._crl_bytes = b""
        self._crl_etag = ""
        self._crl_stamp: tuple[int, int, int] | None = None
        self._revoked_ids: frozenset[int] = frozenset()
        self._db_checked = -math.inf
        if self._crl_path is not None:
            # At start-up a list that is missing, tampered with or foreign stops the server (fail closed).
            stamp = self._stamp()
            self._load_crl(*load_revocation_list(self._crl_path, self.authority))
            self._crl_stamp = stamp
        if self.authority:
            self._refresh_from_database(force=True)  # a storage error at start-up stops the server

    # -- revocation -----------------------------------------------------------------------------------
    def _stamp(self) -> tuple[int, int, int] | None:
        assert self._crl_path is not None
        try:
            st = os.stat(self._crl_path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _load_crl(self, crl: crypto.RevocationList, data: bytes, origin: str = "file") -> None:
        self._crl = crl
        self._crl_bytes = data
        self._crl_etag = f'"crl-{crl.number}-{hashlib.sha256(data).hexdigest()[:32]}"'
        self._revoked_ids = frozenset(self.storage.revoked_devices(crl.device_keys))
        log.info(
            "revocation list #%d (%s) in force: %d device keys revoked, %d registered devices excluded",
            crl.number,
            origin,
            len(crl.device_keys),
            len(self._revoked_ids),
        )

    def refresh_revocations(self, *, force_database: bool = False) -> None:
        """Adopt a newer revocation list: the file ``enrollment.revocation_list`` when it changed, and the
        newest list an operator uploaded to the shared database (checked at most every `DATABASE_POLL`
        seconds, or now with ``force_database``).  A replacement that does not verify or has a lower
        number than the list in force is refused (logged, with the check it failed) and the list stays."""
        self._refresh_file()
        self._refresh_from_database(force=force_database)

    def _refresh_file(self) -> None:
        if self._crl_path is None:
            return
        stamp = self._stamp()
        if stamp == self._crl_stamp:
            return
        self._crl_stamp = stamp
        try:
            if stamp is None:
                raise RevocationListInvalid(f"the revocation list {self._crl_path} is gone")
            crl, data = load_revocation_list(self._crl_path, self.authority)
            if self._crl is not None and crl.number < self._crl.number:
                raise RevocationListInvalid(
                    f"{self._crl_path}: revocation list #{crl.number} is older than #{self._crl.number} in force "
                    "(a rollback)"
                )
        except RevocationListInvalid as exc:
            log.error("revocation list refused, the list in force stays: %s", exc)
            return
        self._load_crl(crl, data)

    def _refresh_from_database(self, *, force: bool = False) -> None:
        if not self.authority:
            return
        clock = time.monotonic()
        if not force and clock - self._db_checked < DATABASE_POLL:
            return
        self._db_checked = clock
        try:
            number = self.storage.newest_revocation_number()
            if number is None or (self._crl is not None and number <= self._crl.number):
                return
            data = self.storage.revocation_list(number)
        except StorageError as exc:
            if force:
                raise
            log.error("cannot read the uploaded revocation lists, the list in force stays: %s", exc)
            return
        if data is None:  # pragma: no cover - the numbers come from the same table
            return
        try:
            crl = crypto.verify_revocation_list(data, self.authority)
        except RevocationListInvalid as exc:
            log.error("uploaded revocation list #%d refused, the list in force stays: %s", number, exc)
            return
        self._load_crl(crl, data, "database")

    def upload_revocation_list(self, data: bytes, now: float) -> tuple[crypto.RevocationList, bool]:
        """Store a revocation list an operator uploaded (``POST /v1/admin/revocation-list``) in the shared
        database, so that every instance enforces it, and enforce it here at once.

        Returns
        -------
        (RevocationList, bool)
            The list, and whether it was stored (False: the same list was stored already).

        Raises
        ------
        EnrollmentRefused
            The server has no enrollment authority.
        RevocationListInvalid
            Malformed or not signed by the authority; a lower number than the list in force or the newest
            stored (a rollback); or a different list under a number already stored.  Nothing is stored.
        """
        if not self.authority:
            raise EnrollmentRefused("this server has no enrollment authority; it takes no revocation list")
        crl = crypto.verify_revocation_list(bytes(data), self.authority)
        self.refresh_revocations(force_database=True)
        if self._crl is not None and crl.number < self._crl.number:
            raise RevocationListInvalid(
                f"revocation list #{crl.number} is older than #{self._crl.number} in force (a rollback); nothing stored"
            )
        newest = self.storage.store_revocation_list(crl.number, bytes(data), now)
        stored = newest is None
        if newest is not None:
            number, kept = newest
            if number > crl.number:
                raise RevocationListInvalid(
                    f"revocation list #{crl.number} is older than #{number} stored (a rollback); nothing stored"
                )
            if kept != data:
                raise RevocationListInvalid(f"a different revocation list #{number} is stored already; nothing stored")
        if self._crl is None or crl.number > self._crl.number or self._crl_bytes != data:
            self._load_crl(crl, bytes(data), "upload")
        return crl, stored

    def signed_revocation_list(self) -> tuple[bytes, str]:
        """The signed bytes of the list in force and their ETag (re-read if the file changed); ``(b"", "")``
        without one.  Devices fetch it (protocol 1.5) to enforce it themselves."""
        self.refresh_revocations()
        return self._crl_bytes, self._crl_etag

    @property
    def revocation_list(self) -> crypto.RevocationList | None:
        """The revocation list in force (None: neither ``enrollment.revocation_list`` nor an uploaded one)."""
        return self._crl

    def revoked_devices(self) -> frozenset[int]:
        """Registered devices whose certified key the list in force revokes (re-read if the file changed)."""
        self.refresh_revocations()
        return self._revoked_ids

    # -- credentials --------------------------------------------------------------------------------
    def check(self, *, certificate: bytes, proof: bytes, token: str, peer: str) -> Credential:
        """The credential of one registration, checked (nothing is consumed yet).

        Raises
        ------
        EnrollmentRefused
            No credential where one is required, a certificate that is forged, foreign, outside its validity
            period (the message says "expired" or "not yet valid"), revoked, or without a valid proof; a
            certificate on a server without an authority, a token on a server that enrolls by certificate,
            or an unknown or used token.
        """
        if certificate:
            if not self.authority:
                raise EnrollmentRefused("this server has no enrollment authority; it does not take certificates")
            self.refresh_revocations()
            revoked: crypto.RevocationList | frozenset[bytes] = self._crl if self._crl is not None else frozenset()
            try:
                identity = crypto.verify_certificate(certificate, self.authority, revoked=revoked)
                crypto.verify_signature(identity, proof, crypto.registration_payload(certificate))
            except CryptoError as exc:
                raise EnrollmentRefused(f"certificate refused: {exc}") from None
            source = "cert:" + crypto.certificate_batch(certificate).hex()
            return Credential(source=source, identity_key=identity, rate_key=source)
        if token:
            if self.authority:
                raise EnrollmentRefused(
                    "this server enrolls devices by certificate (signed rounds); enrollment tokens are not accepted"
                )
            digest = hashlib.sha256(token.encode("utf-8")).digest()
            known = self.storage.enrollment_token_source(digest)
            if known is None:
                raise EnrollmentRefused("unknown enrollment token")
            source, used = known
            if used:
                raise EnrollmentRefused("the enrollment token was used before (tokens are single use)")
            return Credential(source=source, token_sha256=digest, rate_key=source)
        if not self.open:
            what = "a certificate of the enrollment authority" if self.authority else "an enrollment token"
            raise EnrollmentRefused(f"registration requires an enrollment credential: {what}")
        return Credential(source=OPEN_SOURCE, rate_key=f"open:{peer}")

    def admit(self, credential: Credential, now: float) -> None:
        """Take one registration from the credential source's bucket.

        Raises
        ------
        RateLimited
            The source registered ``registration_burst`` devices and more than
            ``registrations_per_second`` since; ``retry_after`` says when one more is accepted.
        """
        rate, burst = self.config.registrations_per_second, float(self.config.registration_burst)
        bucket = self._buckets.get(credential.rate_key)
        if bucket is None:
            bucket = self._buckets[credential.rate_key] = _Bucket(burst, now)
        bucket.level = min(burst, bucket.level + max(0.0, now - bucket.at) * rate)
        bucket.at = now
        if bucket.level < 1.0:
            wait = (1.0 - bucket.level) / rate
            raise RateLimited(
                f"registrations from credential source {credential.source!r} are limited to "
                f"{rate:g}/s after a burst of {burst:g}; retry in {wait:.2f} s",
                retry_after=wait,
            )
        bucket.level -= 1.0
        if len(self._buckets) > 100_000:  # forget full buckets of quiet sources (memory bound)
            for key in [k for k, b in self._buckets.items() if b.level >= burst]:
                del self._buckets[key]

    def remember(self, device_id: int, source: str) -> None:
        self._sources[device_id] = source

    # -- operator tokens ------------------------------------------------------------------------------
    def issue_tokens(self, count: int, label: str, now: float) -> list[str]:
        """Create ``count`` one-time enrollment tokens under source ``token:<label>``; only their SHA-256
        is stored, the tokens are returned once.

        Raises
        ------
        EnrollmentRefused
            The server enrolls by certificate.
        ValueError
            A count outside [1, 10000] or a label that is not 1-64 of ``[A-Za-z0-9._-]``.
        """
        if self.authority:
            raise EnrollmentRefused("this server enrolls devices by certificate; it issues no enrollment tokens")
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_TOKENS_PER_REQUEST:
            raise ValueError(f"count must be an integer in [1, {MAX_TOKENS_PER_REQUEST}], got {count!r}")
        if not isinstance(label, str) or TOKEN_LABEL.fullmatch(label) is None:
            raise ValueError(f"source must be 1-64 characters of [A-Za-z0-9._-], got {label!r}")
        tokens = [secrets.token_urlsafe(32) for _ in range(count)]
        self.storage.add_enrollment_tokens(
            [hashlib.sha256(t.encode("utf-8")).digest() for t in tokens], f"token:{label}", now
        )
        return tokens

    # -- cohorts --------------------------------------------------------------------------------------
    def sources(self, device_ids: Sequence[int]) -> dict[int, str]:
        """The credential source of each device (cached; read from storage once per device)."""
        missing = [d for d in device_ids if d not in self._sources]
        if missing:
            self._sources.update(self.storage.device_sources(missing))
        return {d: self._sources.get(d, "") for d in device_ids}


def capped_cohort(
    fresh: Sequence[int], n: int, sources: Mapping[int, str], share: float, rng: np.random.Generator
) -> tuple[int, ...]:
    """Draw up to ``n`` devices of ``fresh`` at random so that no credential source fills more than
    ``share`` of the cohort drawn: each source contributes at most ⌊share·size⌋ devices.  When the pool
    cannot fill ``n`` that way the cohort shrinks (and the cap with it) until it holds; () if nothing can.
    """
    order = rng.permutation(np.asarray(fresh, dtype=np.int64))
    while n > 0:
        cap = math.floor(share * n + 1e-9)
        if cap < 1:
            return ()
        counts: Counter[str] = Counter()
        chosen: list[int] = []
        for d in order.tolist():
            s = sources.get(d, "")
            if counts[s] < cap:
                counts[s] += 1
                chosen.append(d)
                if len(chosen) == n:
                    return tuple(sorted(chosen))
        n = len(chosen)
    return ()
