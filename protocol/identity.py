# Invariants: the Ed25519 half of fedrec's cryptography (`protocol.crypto` holds the SecAgg+ half); it only
# wraps the `cryptography` package.  Every signed payload starts with a label naming its purpose (the
# protocol's round payloads also bind the major version, as `protocol.crypto` does), so no signature serves
# two purposes.  A certificate's or a revocation list's fields are returned only after its signature under
# the pinned authority key verifies.  Failures leave as `CryptoError` or one of its subclasses.
"""Long-term identities (Ed25519), enrollment certificates and the authority's revocation lists.

A device signs its round-key advertisement and the consistency check's survivor set with its identity key
(Bonawitz et al. 2017 §4, the malicious-server variant), and proves at registration that it holds the key
its enrollment certificate certifies.  `verify_signature` remembers the verifications that succeeded, per
process.
"""

from __future__ import annotations

import hashlib
import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from protocol.crypto import _VERSION_BINDING, KEY_BYTES, _len_prefixed, _u64
from protocol.errors import (
    CertificateExpired,
    CertificateNotYetValid,
    CertificateRevoked,
    CryptoError,
    RevocationListInvalid,
)

__all__ = [
    "SIGNATURE_BYTES",
    "CERTIFICATE_BYTES",
    "BATCH_BYTES",
    "certificate_batch",
    "registration_payload",
    "SigningKey",
    "verify_signature",
    "issue_certificate",
    "verify_certificate",
    "Certificate",
    "read_certificate",
    "CERTIFICATE_V2_BYTES",
    "CERTIFICATE_V3_BYTES",
    "CERTIFICATE_CLOCK_SKEW",
    "RevocationList",
    "issue_revocation_list",
    "verify_revocation_list",
    "key_advertisement_payload",
    "survivor_set_payload",
    "Cohort",
    "roster_digest",
]

SIGNATURE_BYTES = 64
_CERT_MAGIC = b"FRC1"
#: magic ‖ subject public key ‖ 16-byte serial ‖ CA signature over (label ‖ magic ‖ subject ‖ serial).
CERTIFICATE_BYTES = len(_CERT_MAGIC) + KEY_BYTES + 16 + SIGNATURE_BYTES
#: Certificate format 2 (a validity period): "FRC2" ‖ subject ‖ serial ‖ not_before ‖ not_after (u64
#: big-endian Unix seconds) ‖ CA signature over (label ‖ everything before it).  Format 1 stays readable.
_CERT_MAGIC_V2 = b"FRC2"
CERTIFICATE_V2_BYTES = CERTIFICATE_BYTES + 16
#: Certificate format 3 (protocol 1.8, the device id it was issued for): "FRC3" ‖ subject ‖ serial ‖
#: not_before ‖ not_after ‖ device id (u64 big-endian) ‖ CA signature over (label ‖ everything before it).
_CERT_MAGIC_V3 = b"FRC3"
CERTIFICATE_V3_BYTES = CERTIFICATE_V2_BYTES + 8
#: How far a verifier's clock may be off the authority's (seconds) before a certificate counts as not yet
#: valid or expired.
CERTIFICATE_CLOCK_SKEW = 300
_LABEL_REVOCATION_LIST = b"fedrec/enrollment/revocation-list"
_CRL_MAGIC = b"FRL1"
#: The most device keys one revocation list may name (a 32 MB file).
MAX_REVOKED = 1 << 20
_LABEL_CERTIFICATE = b"fedrec/enrollment/certificate"
_LABEL_KEY_ADVERTISEMENT = b"fedrec/secagg/key-advertisement"
_LABEL_SURVIVOR_SET = b"fedrec/secagg/survivor-set"
_LABEL_ROSTER = b"fedrec/secagg/roster"
_LABEL_REGISTRATION = b"fedrec/enrollment/registration"
#: Protocol 1.4: the first 8 of a certificate's 16 serial bytes name its enrollment batch.
BATCH_BYTES = 8


@dataclass(frozen=True, slots=True)
class SigningKey:
    """An Ed25519 key pair: a device's long-term identity, or the enrollment authority's key.

    Attributes
    ----------
    private_key : Ed25519PrivateKey
    public_key : bytes
        32 raw bytes.
    """

    private_key: Ed25519PrivateKey
    public_key: bytes

    @classmethod
    def generate(cls) -> SigningKey:
        """A fresh key from the OS CSPRNG."""
        private = Ed25519PrivateKey.generate()
        return cls(private, private.public_key().public_bytes_raw())

    @classmethod
    def from_private_bytes(cls, raw: bytes) -> SigningKey:
        """Rebuild from the 32-byte seed (a device's stored identity).

        Raises
        ------
        CryptoError
            Not 32 bytes.
        """
        if type(raw) is not bytes or len(raw) != KEY_BYTES:
            raise CryptoError("an Ed25519 private key is 32 bytes")
        private = Ed25519PrivateKey.from_private_bytes(raw)
        return cls(private, private.public_key().public_bytes_raw())

    def private_bytes(self) -> bytes:
        """The 32-byte seed (for the device's store only)."""
        return self.private_key.private_bytes_raw()

    def sign(self, data: bytes) -> bytes:
        """A 64-byte Ed25519 signature of ``data``."""
        return self.private_key.sign(data)


# Verifications that succeeded, keyed by SHA-256(key || signature || data) (key and signature have fixed
# lengths, so the framing is unambiguous).  Verification is a pure function of those bytes, so a hit is
# exactly the answer a fresh check would give; failures are never remembered.  A real device verifies each
# signature once and gains nothing; a process hosting many simulated devices (the demo, a fleet shard)
# stops verifying the same survivor signatures and certificates once per device: in the demo's signed
# round of 943 devices that was 61% of its CPU.  Bounded: cleared when full.
_VERIFIED: set[bytes] = set()
_VERIFIED_MAX = 1 << 17


def verify_signature(public_key: bytes, signature: bytes, data: bytes) -> None:
    """Check an Ed25519 signature.

    Raises
    ------
    CryptoError
        Malformed key or signature, or a signature that does not verify.
    """
    if type(public_key) is not bytes or len(public_key) != KEY_BYTES:
        raise CryptoError("an Ed25519 public key is 32 bytes")
    if type(signature) is not bytes or len(signature) != SIGNATURE_BYTES:
        raise CryptoError("an Ed25519 signature is 64 bytes")
    key = hashlib.sha256(public_key + signature + bytes(data)).digest()
    if key in _VERIFIED:
        return
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, data)
    except (InvalidSignature, ValueError):
        raise CryptoError("signature does not verify") from None
    if len(_VERIFIED) >= _VERIFIED_MAX:
        _VERIFIED.clear()
    _VERIFIED.add(key)


def issue_certificate(
    authority: SigningKey,
    subject_public_key: bytes,
    *,
    batch: bytes = bytes(BATCH_BYTES),
    serial: bytes | None = None,
    not_before: int | None = None,
    not_after: int | None = None,
    device_id: int | None = None,
) -> bytes:
    """The enrollment authority certifies a device's long-term public key.

    Parameters
    ----------
    authority : SigningKey
        The enrollment authority's key (kept apart from the aggregation server).
    subject_public_key : bytes
        The device's 32-byte Ed25519 public key.
    batch : bytes
        Protocol 1.4: the 8-byte enrollment batch (credential source) the certificate is issued under;
        the first half of the 16-byte serial, signed with the rest.  The server rate-limits registrations
        and caps each round's share per batch.
    serial : bytes, optional
        The other 8 serial bytes; random by default (fixed only by the test-vector generator).
    not_before, not_after : int, optional
        The validity period in Unix seconds, both or neither: with them a format-2 certificate
        (`CERTIFICATE_V2_BYTES`), without them a format-1 certificate that never expires (kept for the
        test vectors of protocol 1.4; `protocol.enrollment.EnrollmentAuthority.issue` always sets them).
    device_id : int, optional
        Protocol 1.8: the device id the certificate is issued for (format 3, `CERTIFICATE_V3_BYTES`; needs
        the validity period).  The server registers the device under it, and every verifier refuses
        the certificate for any other id.

    Returns
    -------
    bytes
        `CERTIFICATE_BYTES` or `CERTIFICATE_V2_BYTES` bytes.
    """
    if type(subject_public_key) is not bytes or len(subject_public_key) != KEY_BYTES:
        raise CryptoError("an Ed25519 public key is 32 bytes")
    if type(batch) is not bytes or len(batch) != BATCH_BYTES:
        raise CryptoError(f"a certificate batch is {BATCH_BYTES} bytes")
    tail = os.urandom(BATCH_BYTES) if serial is None else serial
    if type(tail) is not bytes or len(tail) != BATCH_BYTES:
        raise CryptoError(f"a certificate serial tail is {BATCH_BYTES} bytes")
    if not_before is None and not_after is None:
        body = _CERT_MAGIC + subject_public_key + batch + tail
    else:
        for name, value in (("not_before", not_before), ("not_after", not_after)):
            if type(value) is not int or not 0 <= value < 1 << 63:
                raise CryptoError(f"a certificate's {name} is a non-negative integer of Unix seconds, got {value!r}")
        assert not_before is not None and not_after is not None
        if not_after <= not_before:
            raise CryptoError(f"a certificate's not_after ({not_after}) must be after its not_before ({not_before})")
        body = _CERT_MAGIC_V2 + subject_public_key + batch + tail + _u64(not_before) + _u64(not_after)
        if device_id is not None:
            if type(device_id) is not int or not 0 <= device_id < 1 << 63:
                raise CryptoError(f"a certificate's device id is a non-negative integer, got {device_id!r}")
            body = _CERT_MAGIC_V3 + body[len(_CERT_MAGIC_V2) :] + _u64(device_id)
    if device_id is not None and not body.startswith(_CERT_MAGIC_V3):
        raise CryptoError("a certificate that names a device id needs a validity period")
    return body + authority.sign(_LABEL_CERTIFICATE + body)


@dataclass(frozen=True, slots=True)
class Certificate:
    """A checked enrollment certificate.

    Attributes
    ----------
    subject : bytes
        The certified 32-byte Ed25519 device key.
    serial : bytes
        16 bytes: the batch (8) and a random tail (8).
    not_before, not_after : int or None
        The validity period in Unix seconds; None for a format-1 certificate (no period: it never expires,
        only revocation ends it).
    device_id : int or None
        Format 3: the device id it was issued for; None for formats 1 and 2 (any id).
    """

    subject: bytes
    serial: bytes
    not_before: int | None
    not_after: int | None
    device_id: int | None = None

    def check_device(self, device_id: int) -> None:
        """Refuse the certificate for a device id it does not name (format 3).

        Raises
        ------
        CryptoError
            It names another device id.
        """
        if self.device_id is not None and self.device_id != device_id:
            raise CryptoError(
                f"enrollment certificate issued for device {self.device_id} is presented for device {device_id}"
            )

    @property
    def batch(self) -> bytes:
        return self.serial[:BATCH_BYTES]


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def read_certificate(
    certificate: bytes,
    authority_public_key: bytes,
    *,
    now: float | None = None,
    revoked: frozenset[bytes] | RevocationList = frozenset(),
    check_period: bool = True,
) -> Certificate:
    """Check a certificate against the pinned authority key, the verifier's clock and a revocation list.

    Parameters
    ----------
    now : float, optional
        The verifier's clock in Unix seconds (default: ``time.time()``); a format-2 certificate must be
        within its validity period give or take `CERTIFICATE_CLOCK_SKEW`.
    revoked : RevocationList or frozenset of bytes
        Device keys whose certificates are refused.
    check_period : bool
        False only to read a certificate's fields whatever its period (the authority revoking it).

    Raises
    ------
    CryptoError
        Malformed, or not signed by the authority.
    CertificateNotYetValid, CertificateExpired
        Outside its validity period (checked after the signature: a forged period is reported as forged).
    CertificateRevoked
        Its device key is on ``revoked``.
    """
    if type(certificate) is not bytes:
        raise CryptoError("malformed enrollment certificate")
    if len(certificate) == CERTIFICATE_BYTES and certificate.startswith(_CERT_MAGIC):
        v2 = False
    elif len(certificate) == CERTIFICATE_V2_BYTES and certificate.startswith(_CERT_MAGIC_V2):
        v2 = True
    elif len(certificate) == CERTIFICATE_V3_BYTES and certificate.startswith(_CERT_MAGIC_V3):
        v2 = True
    else:
        raise CryptoError("malformed enrollment certificate")
    body, signature = certificate[:-SIGNATURE_BYTES], certificate[-SIGNATURE_BYTES:]
    try:
        verify_signature(authority_public_key, signature, _LABEL_CERTIFICATE + body)
    except CryptoError:
        raise CryptoError("enrollment certificate is not signed by the pinned authority") from None
    start = len(_CERT_MAGIC)
    subject = body[start : start + KEY_BYTES]
    serial = body[start + KEY_BYTES : start + KEY_BYTES + 16]
    not_before = not_after = None
    device_id = None
    if v2:
        not_before, not_after = struct.unpack(">QQ", body[start + KEY_BYTES + 16 : start + KEY_BYTES + 32])
        if len(body) > start + KEY_BYTES + 32:
            (device_id,) = struct.unpack(">Q", body[start + KEY_BYTES + 32 :])
    if not_before is not None and not_after is not None and check_period:
        clock = time.time() if now is None else now
        if clock + CERTIFICATE_CLOCK_SKEW < not_before:
            raise CertificateNotYetValid(
                f"enrollment certificate not yet valid: its not_before is {_utc(not_before)}, "
                f"the verifier's clock says {_utc(clock)}"
            )
        if clock - CERTIFICATE_CLOCK_SKEW > not_after:
            raise CertificateExpired(
                f"enrollment certificate expired: its not_after is {_utc(not_after)}, "
                f"the verifier's clock says {_utc(clock)}"
            )
    keys = revoked.device_keys if isinstance(revoked, RevocationList) else revoked
    if subject in keys:
        number = f" #{revoked.number}" if isinstance(revoked, RevocationList) else ""
        raise CertificateRevoked(
            f"enrollment certificate revoked: the authority's revocation list{number} names device key {subject.hex()}"
        )
    return Certificate(subject=subject, serial=serial, not_before=not_before, not_after=not_after, device_id=device_id)


def certificate_batch(certificate: bytes) -> bytes:
    """Protocol 1.4: the enrollment batch (8 bytes) of a certificate (check the certificate first)."""
    start = len(_CERT_MAGIC) + KEY_BYTES
    return certificate[start : start + BATCH_BYTES]


def registration_payload(certificate: bytes) -> bytes:
    """Protocol 1.4: what a device signs with its identity key to register with ``certificate`` (proof
    that it holds the certified key: a certificate alone is public, neighbours receive it every round)."""
    return _LABEL_REGISTRATION + _VERSION_BINDING + _len_prefixed(certificate)


def verify_certificate(
    certificate: bytes,
    authority_public_key: bytes,
    *,
    now: float | None = None,
    revoked: frozenset[bytes] | RevocationList = frozenset(),
    device_id: int | None = None,
) -> bytes:
    """Check a certificate (`read_certificate`: signature, validity period, revocation, and with
    ``device_id`` that a format-3 certificate names that id); return the certified device public key.

    Raises
    ------
    CryptoError
        Malformed, or not signed by the authority.
    CertificateNotYetValid, CertificateExpired, CertificateRevoked
        As `read_certificate`.
    """
    checked = read_certificate(certificate, authority_public_key, now=now, revoked=revoked)
    if device_id is not None:
        checked.check_device(device_id)
    return checked.subject


@dataclass(frozen=True, slots=True)
class RevocationList:
    """A checked revocation list of the enrollment authority.

    Attributes
    ----------
    number : int
        Increases with every list the authority issues; a verifier never goes back to a lower number.
    issued_at : int
        Unix seconds.
    device_keys : frozenset of bytes
        The revoked 32-byte device keys (every certificate of such a key is refused).
    """

    number: int
    issued_at: int
    device_keys: frozenset[bytes]


def issue_revocation_list(authority: SigningKey, number: int, issued_at: int, device_keys: Sequence[bytes]) -> bytes:
    """The authority's signed revocation list: "FRL1" ‖ number ‖ issued_at (u64) ‖ count (u32) ‖ the
    sorted distinct 32-byte device keys ‖ signature over (label ‖ everything before it).

    Raises
    ------
    CryptoError
        A key that is not 32 bytes, more than `MAX_REVOKED` keys, or a negative number or time.
    """
    keys = sorted(set(device_keys))
    if any(type(k) is not bytes or len(k) != KEY_BYTES for k in keys):
        raise CryptoError("a revoked device key is 32 bytes")
    if len(keys) > MAX_REVOKED:
        raise CryptoError(f"a revocation list names at most {MAX_REVOKED} device keys")
    for name, value in (("number", number), ("issued_at", issued_at)):
        if type(value) is not int or not 0 <= value < 1 << 63:
            raise CryptoError(f"a revocation list's {name} is a non-negative integer, got {value!r}")
    body = _CRL_MAGIC + _u64(number) + _u64(issued_at) + struct.pack(">I", len(keys)) + b"".join(keys)
    return body + authority.sign(_LABEL_REVOCATION_LIST + body)


def verify_revocation_list(data: bytes, authority_public_key: bytes, *, interruptible: bool = False) -> RevocationList:
    """Check a revocation list against the authority key.

    ``interruptible``: build the key set from a generator, so that the interpreter can hand the GIL to other
    threads between keys (a server checking 10^6 keys in a worker thread keeps its event loop answering:
    one C call over the whole list held the GIL 130-320 ms), at about 0.13 s more CPU per 10^6 keys
    (benchmarks/bench_revocation_loop.py).

    Raises
    ------
    RevocationListInvalid
        Malformed (magic, length, count, unsorted or repeated keys) or not signed by the authority.
    """
    head = len(_CRL_MAGIC) + 8 + 8 + 4
    if type(data) is not bytes or len(data) < head + SIGNATURE_BYTES or not data.startswith(_CRL_MAGIC):
        raise RevocationListInvalid("malformed revocation list (not a fedrec revocation list)")
    number, issued_at, count = struct.unpack(">QQI", data[len(_CRL_MAGIC) : head])
    if count > MAX_REVOKED or len(data) != head + KEY_BYTES * count + SIGNATURE_BYTES:
        raise RevocationListInvalid(f"malformed revocation list: {len(data)} bytes do not hold {count} device keys")
    body, signature = data[:-SIGNATURE_BYTES], data[-SIGNATURE_BYTES:]
    try:
        verify_signature(authority_public_key, signature, _LABEL_REVOCATION_LIST + body)
    except CryptoError:
        raise RevocationListInvalid("revocation list is not signed by the enrollment authority") from None
    keys = [body[head + KEY_BYTES * i : head + KEY_BYTES * (i + 1)] for i in range(count)]
    if any(a >= b for a, b in zip(keys, keys[1:], strict=False)):
        raise RevocationListInvalid("malformed revocation list: device keys not sorted and distinct")
    device_keys = frozenset(k for k in keys) if interruptible else frozenset(keys)
    return RevocationList(number=number, issued_at=issued_at, device_keys=device_keys)


#: Protocol 1.8: what a signed round's cohort is bound by, (n, `roster_digest`) (None in older rounds).
Cohort = tuple[int, bytes] | None


def roster_digest(device_ids: Sequence[int], identity_keys: Sequence[bytes]) -> bytes:
    """Protocol 1.8: SHA-256 of a round's roster, the invited devices in increasing id order each with its
    certified identity key; a device signs it (with n) in its key advertisement and its survivor set."""
    if len(device_ids) != len(identity_keys):
        raise CryptoError("a roster names one identity key per device")
    h = hashlib.sha256(_LABEL_ROSTER + _VERSION_BINDING + struct.pack(">I", len(device_ids)))
    for v, key in zip(device_ids, identity_keys, strict=True):
        h.update(_u64(v) + _len_prefixed(key))
    return h.digest()


def _cohort_binding(cohort: Cohort) -> bytes:
    # Empty before protocol 1.8 (the payload keeps its older, shorter form); n and the roster digest after.
    if cohort is None:
        return b""
    n, digest = cohort
    return _u64(n) + _len_prefixed(digest)


def key_advertisement_payload(
    round_id: int, device_id: int, c_public_key: bytes, s_public_key: bytes, cohort: Cohort = None
) -> bytes:
    """What a device signs when it advertises its round keys (binds round, device id and both keys, and
    since protocol 1.8 the cohort size n and the digest of the roster it was shown)."""
    return (
        _LABEL_KEY_ADVERTISEMENT
        + _VERSION_BINDING
        + _u64(round_id)
        + _u64(device_id)
        + c_public_key
        + s_public_key
        + _cohort_binding(cohort)
    )


def survivor_set_payload(round_id: int, session: bytes, survivors: Sequence[int], cohort: Cohort = None) -> bytes:
    """What a survivor signs in the consistency check: the round, the session and the sorted set U3 (and
    since protocol 1.8 the cohort size n and the roster digest)."""
    ids = sorted(survivors)
    return (
        _LABEL_SURVIVOR_SET
        + _VERSION_BINDING
        + _u64(round_id)
        + _len_prefixed(session)
        + struct.pack(">I", len(ids))
        + b"".join(_u64(v) for v in ids)
        + _cohort_binding(cohort)
    )
