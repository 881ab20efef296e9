"""Who may register a device (protocol 1.4, docs/threat-model.md §3.10): enrollment credentials, their
sources, the per-source registration rate, and the per-source share of a round's cohort; registering a
device and authenticating its bearer token.

Invariants:
- A registration carries at most one credential: a certificate of the configured enrollment authority
  with a proof that the device holds the certified key, or an operator-issued one-time token.  Without
  one it is accepted only when ``enrollment.open_registration`` resolves to true (loopback development).
- Every credential has a source: ``cert:<batch hex>`` (the batch is signed inside the certificate),
  ``token:<label>`` (the label the operator issued the tokens under), or ``open``.  The rate limit and the
  cohort cap count per source.
- A certified identity key registers once, a token is consumed once (both in the same database
  transaction as the new device); enrollment and bearer tokens are stored as SHA-256 only (`token_digest`).
- A device whose certified key the revocation list in force revokes is refused on every route.
- Nothing here touches the network; the caller passes ``now`` for rate limits, and certificates' validity
  periods are checked against the wall clock (``time.time()``, the clock the authority stamped them with).
- The revocation list in force only moves forward: it is replaced by a list of the authority with a
  higher (or equal, unchanged) number, never by one that fails to verify or goes back.  It comes from
  the file ``enrollment.revocation_list`` or from the shared database (lists an operator uploaded, kept
  forever, the number only growing), whichever is newer.  In the server a new list is read and verified
  off the event loop (`Enrollment.refresh`, in a worker thread, one refresh at a time) and swapped in on
  the loop; requests meanwhile enforce the list in force and never look at the file themselves.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import re
import secrets
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from agg_server.config import ServerConfig
from agg_server.storage import Storage
from protocol.enrollment import load_revocation_list
from protocol.errors import (
    AuthError,
    CryptoError,
    EnrollmentRefused,
    RateLimited,
    RevocationListInvalid,
    StorageError,
)
from protocol.identity import (
    RevocationList,
    certificate_batch,
    read_certificate,
    registration_payload,
    verify_revocation_list,
    verify_signature,
)
from protocol.messages import RegisterResponse

_T = TypeVar("_T")

__all__ = ["Enrollment", "Credential", "capped_cohort", "token_digest", "TOKEN_LABEL", "MAX_TOKENS_PER_REQUEST"]

#: What an operator may call a batch of enrollment tokens.
TOKEN_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_TOKENS_PER_REQUEST = 10_000
OPEN_SOURCE = "open"
#: Seconds between two looks at the shared database for a newer uploaded revocation list.
DATABASE_POLL = 1.0
#: Seconds between two runs of the server's background refresher (`Enrollment.refresh`): the list file is
#: looked at (``os.stat``) this often, never by a request.
REFRESH_PERIOD = 1.0
log = logging.getLogger(__name__)


def token_digest(token: str) -> bytes:
    """SHA-256 of a bearer or enrollment token: the only form in which the server stores it."""
    return hashlib.sha256(token.encode("utf-8")).digest()


@dataclass(frozen=True, slots=True)
class Credential:
    """A checked registration credential: its source, the certified key (certificates) and the token
    digest to consume (tokens)."""

    source: str
    identity_key: bytes | None = None
    token_sha256: bytes | None = None
    rate_key: str = ""
    device_id: int | None = None  # a format-3 certificate's device id: the device registers under it


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
        self._crl: RevocationList | None = None
        self._crl_bytes = b""
        self._crl_etag = ""
        self._crl_stamp: tuple[int, int, int] | None = None
        self._revoked_ids: frozenset[int] = frozenset()
        self._db_checked = -math.inf
        #: Set by the server, whose background task calls `refresh`: the request path does not refresh.
        self.in_background = False
        #: Set by the server: the thread its storage calls run on (the state thread); None: the caller's.
        self.storage_executor: Executor | None = None
        self._refreshing = asyncio.Lock()  # serializes `refresh` and `upload_revocation_list_async`
        if self._crl_path is not None:
            # At start-up a list that is missing, tampered with or foreign stops the server (fail closed).
            stamp = self._stamp()
            crl, data, etag = self._read_file()
            self._load_crl(crl, data, "file", etag)
            self._crl_stamp = stamp
        if self.authority:
            self._refresh_database(force=True)  # a storage error at start-up stops the server

    # -- revocation -----------------------------------------------------------------------------------
    # Two ways to keep the list current.  In the server (`agg_server.app`) a background task owned by the
    # app calls `refresh` every `REFRESH_PERIOD` seconds (``in_background`` is set): the file's stat, its
    # read and the signature check over the whole list run in a worker thread, and the request path
    # (`check`, `revoked_devices`, `signed_revocation_list`) does no refresh and no filesystem I/O: it
    # keeps enforcing the list in force, also while a refresh is in flight, until the refresh swaps the
    # new list in on the server's state thread in one step (no await between the forward-only check and the swap).
    # Without a refresher (in-process simulations, tests of this class) the request path refreshes
    # itself synchronously, as `refresh_revocations` says.
    def _stamp(self) -> tuple[int, int, int] | None:
        assert self._crl_path is not None
        try:
            st = os.stat(self._crl_path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    @staticmethod
    def _etag(crl: RevocationList, data: bytes) -> str:
        return f'"crl-{crl.number}-{hashlib.sha256(data).hexdigest()[:32]}"'

    def _read_file(self) -> tuple[RevocationList, bytes, str]:
        """Read and verify the list file (thread-safe: no storage, no state)."""
        assert self._crl_path is not None
        crl, data = load_revocation_list(self._crl_path, self.authority, interruptible=True)
        return crl, data, self._etag(crl, data)

    def _verify_bytes(self, data: bytes) -> tuple[RevocationList, str]:
        """Verify an uploaded or stored list (thread-safe: no storage, no state)."""
        crl = verify_revocation_list(data, self.authority, interruptible=True)
        return crl, self._etag(crl, data)

    def _load_crl(
        self, crl: RevocationList, data: bytes, origin: str = "file", etag: str = ""
    ) -> list[RevocationList | None]:
        """Put ``crl`` in force; returns a one-element list holding the list it replaced, for the caller to
        empty where freeing 10^6 keys does not hold up the loop."""
        revoked = frozenset(self.storage.revoked_devices(crl.device_keys))  # storage: on the caller's thread
        retired = [self._crl]
        # the swap: no await and no exception between these assignments
        self._crl, self._crl_bytes, self._crl_etag = crl, data, etag or self._etag(crl, data)
        self._revoked_ids = revoked
        log.info(
            "revocation list #%d (%s) in force: %d device keys revoked, %d registered devices excluded",
            crl.number,
            origin,
            len(crl.device_keys),
            len(self._revoked_ids),
        )
        return retired

    def _adopt(
        self, crl: RevocationList, data: bytes, etag: str, origin: str, where: str
    ) -> list[RevocationList | None]:
        """Put ``crl`` in force unless it goes back (the forward-only rule; logged, the list stays)."""
        if self._crl is not None and crl.number < self._crl.number:
            log.error(
                "revocation list refused, the list in force stays: %s: revocation list #%d is older than #%d in "
                "force (a rollback)",
                where,
                crl.number,
                self._crl.number,
            )
            return []
        return self._load_crl(crl, data, origin, etag)

    def refresh_revocations(self, *, force_database: bool = False) -> None:
        """Adopt a newer revocation list, synchronously: the file ``enrollment.revocation_list`` when it
        changed, and the newest list an operator uploaded to the shared database (checked at most every
        `DATABASE_POLL` seconds, or now with ``force_database``).  A replacement that does not verify or has
        a lower number than the list in force is refused (logged, with the check it failed) and the list
        stays.  The server does this off its event loop instead (`refresh`)."""
        if self._crl_path is not None:
            found = self._file_candidate()
            if found is not None:
                self._adopt(*found, "file", str(self._crl_path))
        self._refresh_database(force_database)

    def _refresh_database(self, force: bool) -> None:
        blob = self._database_candidate(force)
        checked = None if blob is None else self._checked_upload(blob)
        if blob is not None and checked is not None:
            self._adopt(checked[0], blob, checked[1], "database", "the database")

    def _file_candidate(self) -> tuple[RevocationList, bytes, str] | None:
        """The list file, read and verified, when it changed since it was last looked at (None: unchanged,
        or refused: logged).  Thread-safe: besides the file it touches only its stamp, which one refresh at
        a time writes (the server's worker thread; the request path without one)."""
        assert self._crl_path is not None
        stamp = self._stamp()
        if stamp == self._crl_stamp:
            return None
        self._crl_stamp = stamp
        try:
            if stamp is None:
                raise RevocationListInvalid(f"the revocation list {self._crl_path} is gone")
            return self._read_file()
        except RevocationListInvalid as exc:
            log.error("revocation list refused, the list in force stays: %s", exc)
            return None

    def _checked_upload(self, data: bytes) -> tuple[RevocationList, str] | None:
        """An uploaded list's bytes verified (None: refused, logged).  Thread-safe."""
        try:
            return self._verify_bytes(data)
        except RevocationListInvalid as exc:
            log.error("uploaded revocation list refused, the list in force stays: %s", exc)
            return None

    async def refresh(self, executor: Executor | None = None, *, force_database: bool = False) -> None:
        """`refresh_revocations` with the file's stat, its read and every signature check in ``executor``
        (None: the loop's default), so that the event loop keeps answering while a list of 10^6 keys is
        checked.  Refreshes are serialized (one at a time per instance), and the forward-only rule is
        checked again on the loop at the swap."""
        async with self._refreshing:
            await self._refresh_locked(executor, force_database)

    async def _on_storage(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` on `storage_executor` (the server's state thread), or here without one."""
        if self.storage_executor is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.storage_executor, fn, *args)

    async def _refresh_locked(self, executor: Executor | None, force_database: bool) -> None:
        loop = asyncio.get_running_loop()
        if self._crl_path is not None:
            found = await loop.run_in_executor(executor, self._file_candidate)
            if found is not None:
                retired = await self._on_storage(self._adopt, *found, "file", str(self._crl_path))
                await loop.run_in_executor(executor, retired.clear)  # the old list is freed there
        blob = await self._on_storage(self._database_candidate, force_database)  # two short queries
        if blob is not None:
            checked = await loop.run_in_executor(executor, self._checked_upload, blob)
            if checked is not None:
                retired = await self._on_storage(self._adopt, checked[0], blob, checked[1], "database", "the database")
                await loop.run_in_executor(executor, retired.clear)

    def _database_candidate(self, force: bool) -> bytes | None:
        """The newest uploaded list when it is newer than the list in force (None: none, or not time to
        look: at most every `DATABASE_POLL` seconds unless ``force``).

        Raises
        ------
        StorageError
            With ``force`` only (start-up, an upload, the server's refresher); otherwise logged."""
        if not self.authority:
            return None
        clock = time.monotonic()
        if not force and clock - self._db_checked < DATABASE_POLL:
            return None
        self._db_checked = clock
        try:
            number = self.storage.newest_revocation_number()
            if number is None or (self._crl is not None and number <= self._crl.number):
                return None
            return self.storage.revocation_list(number)
        except StorageError as exc:
            if force:
                raise
            log.error("cannot read the uploaded revocation lists, the list in force stays: %s", exc)
            return None

    def upload_revocation_list(self, data: bytes, now: float) -> tuple[RevocationList, bool]:
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
        crl, etag = self._verify_bytes(bytes(data))
        self.refresh_revocations(force_database=True)
        return self._store_upload(crl, bytes(data), etag, now)

    async def upload_revocation_list_async(
        self, data: bytes, now: float, executor: Executor | None = None
    ) -> tuple[RevocationList, bool]:
        """`upload_revocation_list` with the signature checks in ``executor``, serialized with `refresh`;
        the list is in force here when it returns."""
        if not self.authority:
            raise EnrollmentRefused("this server has no enrollment authority; it takes no revocation list")
        data = bytes(data)
        crl, etag = await asyncio.get_running_loop().run_in_executor(executor, self._verify_bytes, data)
        async with self._refreshing:
            await self._refresh_locked(executor, True)
            return await self._on_storage(self._store_upload, crl, data, etag, now)

    def _store_upload(self, crl: RevocationList, data: bytes, etag: str, now: float) -> tuple[RevocationList, bool]:
        if self._crl is not None and crl.number < self._crl.number:
            raise RevocationListInvalid(
                f"revocation list #{crl.number} is older than #{self._crl.number} in force (a rollback); nothing stored"
            )
        newest = self.storage.store_revocation_list(crl.number, data, now)
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
            self._load_crl(crl, data, "upload", etag)
        return crl, stored

    def _refresh_on_request(self) -> None:
        if not self.in_background:
            self.refresh_revocations()

    def signed_revocation_list(self) -> tuple[bytes, str]:
        """The signed bytes of the list in force and their ETag; ``(b"", "")`` without one.  Devices fetch
        it (protocol 1.5) to enforce it themselves."""
        self._refresh_on_request()
        return self._crl_bytes, self._crl_etag

    @property
    def revocation_list(self) -> RevocationList | None:
        """The revocation list in force (None: neither ``enrollment.revocation_list`` nor an uploaded one)."""
        return self._crl

    def revoked_devices(self) -> frozenset[int]:
        """Registered devices whose certified key the list in force revokes."""
        self._refresh_on_request()
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
            self._refresh_on_request()
            revoked: RevocationList | frozenset[bytes] = self._crl if self._crl is not None else frozenset()
            try:
                checked = read_certificate(certificate, self.authority, revoked=revoked)
                verify_signature(checked.subject, proof, registration_payload(certificate))
            except CryptoError as exc:
                raise EnrollmentRefused(f"certificate refused: {exc}") from None
            source = "cert:" + certificate_batch(certificate).hex()
            return Credential(source=source, identity_key=checked.subject, rate_key=source, device_id=checked.device_id)
        if token:
            if self.authority:
                raise EnrollmentRefused(
                    "this server enrolls devices by certificate (signed rounds); enrollment tokens are not accepted"
                )
            digest = token_digest(token)
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

    # -- devices --------------------------------------------------------------------------------------
    def register(
        self,
        platform: str,
        now: float,
        *,
        certificate: bytes = b"",
        proof: bytes = b"",
        enrollment_token: str = "",
        peer: str = "",
    ) -> RegisterResponse:
        """Create a device identity; the token is returned once and stored only as its SHA-256.

        The registration's enrollment credential is checked first, then the credential source's rate
        (``peer`` keys the rate of open registrations); the certificate's identity key or the one-time
        token is consumed with the new device in one transaction.

        Raises
        ------
        EnrollmentRefused
            Missing, forged, foreign or reused credential (`check`).
        RateLimited
            The credential source registers faster than ``enrollment.registrations_per_second``.
        """
        credential = self.check(certificate=certificate, proof=proof, token=enrollment_token, peer=peer)
        self.admit(credential, now)
        token = secrets.token_urlsafe(32)
        device_id = self.storage.add_device(
            token_digest(token),
            platform,
            now,
            source=credential.source,
            identity_key=credential.identity_key,
            enrollment_token_sha256=credential.token_sha256,
            device_id=credential.device_id,
        )
        self.remember(device_id, credential.source)
        return RegisterResponse(device_id=device_id, token=token)

    def authenticate(self, token: str | None) -> int:
        """The device a bearer token belongs to.

        Raises
        ------
        AuthError
            Missing or unknown token.
        EnrollmentRefused
            (403) The token's device is revoked: its certified key is on the revocation list in force.
        """
        if not token:
            raise AuthError("missing bearer token")
        device = self.storage.device_for_token(token_digest(token))
        if device is None:
            raise AuthError("unknown bearer token")
        self.refuse_revoked(device, "its bearer token is refused on every route")
        return device

    def refuse_revoked(self, device_id: int, consequence: str) -> None:
        """Raise `EnrollmentRefused` (saying ``consequence``) if the list in force revokes ``device_id``."""
        if device_id in self.revoked_devices():
            crl = self.revocation_list
            number = f" #{crl.number}" if crl is not None else ""
            raise EnrollmentRefused(
                f"revocation check: device {device_id}'s certified key is on the enrollment authority's "
                f"revocation list{number}; {consequence}"
            )

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
        self.storage.add_enrollment_tokens([token_digest(t) for t in tokens], f"token:{label}", now)
        return tokens

    # -- cohorts --------------------------------------------------------------------------------------
    def roster(self, cohort: Sequence[int]) -> dict[int, bytes] | None:
        """A signed round's roster (protocol 1.8): each device's certified identity key; None on a server
        without an authority.  A device registered without one (before the server had an authority) is
        named with a key nobody holds, distinct per device: it is excluded at `keys`."""
        if not self.authority:
            return None
        known = self.storage.identity_keys(cohort)
        nobody = b"fedrec/roster/no-identity"
        return {d: known.get(d) or hashlib.sha256(nobody + d.to_bytes(8, "big")).digest() for d in cohort}

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
