# Invariants: with `protocol.samplers.NoiseStream` (the DP noise's keystream), the only module in fedrec that
# touches cryptographic primitives, and it only wraps the `cryptography` package.  Every derived key comes
# from HKDF-SHA256 with an `info` that names its purpose, the protocol version, the session id and the
# parties, so no key serves two purposes, two sessions or two pairs.  AES-GCM nonces are 12 random bytes
# prepended to the ciphertext, so a key may encrypt many messages without nonce reuse.  The mask PRG uses a
# zero CTR nonce, which is safe only because each PRG key is derived for exactly one (session, pair or
# device, purpose) and expands exactly one vector.  Failures of the primitives (bad tags, bad key bytes,
# low-order points) leave as `CryptoError`.
"""Cryptographic helpers for SecAgg+ (Bonawitz et al. 2017 §4; Bell et al. 2020 §3).

X25519 for key agreement, HKDF-SHA256 for key derivation, AES-256-GCM for the Shamir-share channel and
an AES-256-CTR keystream, read as little-endian uint32, as the mask PRG.
"""

from __future__ import annotations

import hashlib
import os
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, CipherContext, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from numpy.typing import NDArray

from protocol.errors import (
    CertificateExpired,
    CertificateNotYetValid,
    CertificateRevoked,
    CryptoError,
    RevocationListInvalid,
)
from protocol.spec import PROTOCOL_VERSION

__all__ = [
    "KEY_BYTES",
    "NONCE_BYTES",
    "TAG_BYTES",
    "LABEL_SHARE_ENCRYPTION",
    "LABEL_PAIR_MASK",
    "LABEL_SELF_MASK",
    "KeyPair",
    "generate_key_pair",
    "key_pair_from_private_bytes",
    "x25519",
    "hkdf_sha256",
    "derive_key",
    "session_id",
    "share_associated_data",
    "share_encryption_key",
    "pair_mask_key",
    "self_mask_key",
    "aead_encrypt",
    "aead_decrypt",
    "random_seed",
    "prg_uint32",
    "MaskPrg",
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
    "CERTIFICATE_CLOCK_SKEW",
    "RevocationList",
    "issue_revocation_list",
    "verify_revocation_list",
    "key_advertisement_payload",
    "survivor_set_payload",
]

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
LABEL_SHARE_ENCRYPTION = b"fedrec/secagg/share-enc"
LABEL_PAIR_MASK = b"fedrec/secagg/pair-mask"
LABEL_SELF_MASK = b"fedrec/secagg/self-mask"
_LABEL_SESSION = b"fedrec/secagg/session"
_ZERO_CTR_NONCE = bytes(16)


#: What key derivation and the session id bind of the protocol version: the major version and a zero
#: minor field.  Binding the minor too would stop devices of different 1.x versions from sharing a round.
_VERSION_BINDING = struct.pack(">HH", PROTOCOL_VERSION[0], 0)


def _u64(value: int) -> bytes:
    if not 0 <= value < 2**64:
        raise CryptoError(f"party id {value} does not fit in 64 bits")
    return struct.pack(">Q", value)


def _len_prefixed(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


@dataclass(frozen=True, slots=True)
class KeyPair:
    """A fresh X25519 key pair; used for one round only.

    Attributes
    ----------
    private_key : X25519PrivateKey
        The secret scalar (never leaves the device except as Shamir shares of `private_bytes`).
    public_key : bytes
        32 raw bytes.
    """

    private_key: X25519PrivateKey
    public_key: bytes

    def private_bytes(self) -> bytes:
        """Return the raw 32-byte private scalar (what gets Shamir-shared for the s key)."""
        return self.private_key.private_bytes_raw()


def generate_key_pair() -> KeyPair:
    """Generate a fresh X25519 key pair from the OS CSPRNG.

    Returns
    -------
    KeyPair
    """
    private = X25519PrivateKey.generate()
    return KeyPair(private, private.public_key().public_bytes_raw())


def key_pair_from_private_bytes(raw: bytes) -> KeyPair:
    """Rebuild a key pair from its 32-byte private scalar (e.g. after Shamir reconstruction).

    Parameters
    ----------
    raw : bytes
        32 bytes.

    Returns
    -------
    KeyPair

    Raises
    ------
    CryptoError
        ``raw`` is not 32 bytes.
    """
    if not isinstance(raw, bytes) or len(raw) != KEY_BYTES:
        raise CryptoError("an X25519 private key is 32 raw bytes")
    private = X25519PrivateKey.from_private_bytes(raw)
    return KeyPair(private, private.public_key().public_bytes_raw())


def x25519(private_key: X25519PrivateKey | bytes, peer_public_key: bytes) -> bytes:
    """X25519 key agreement (RFC 7748 §5).

    Parameters
    ----------
    private_key : X25519PrivateKey or bytes
        Our private key, or its 32 raw bytes.
    peer_public_key : bytes
        The peer's 32 raw bytes.

    Returns
    -------
    bytes
        The 32-byte shared secret; never used directly as a key (always through HKDF).

    Raises
    ------
    CryptoError
        Malformed key bytes, or a low-order peer point (all-zero shared secret).
    """
    try:
        if isinstance(private_key, bytes):
            private_key = key_pair_from_private_bytes(private_key).private_key
        if not isinstance(peer_public_key, bytes) or len(peer_public_key) != KEY_BYTES:
            raise CryptoError("an X25519 public key is 32 raw bytes")
        return private_key.exchange(X25519PublicKey.from_public_bytes(peer_public_key))
    except ValueError as exc:
        raise CryptoError(f"X25519 key agreement failed: {exc}") from None


def hkdf_sha256(ikm: bytes, *, info: bytes, length: int = KEY_BYTES, salt: bytes | None = None) -> bytes:
    """HKDF-SHA256 (RFC 5869): extract with ``salt`` then expand with ``info``.

    Parameters
    ----------
    ikm : bytes
        Input keying material.
    info : bytes
        Context binding; required (an empty ``info`` is only meaningful in known-answer tests).
    length : int
        Output bytes, at most 255 * 32.
    salt : bytes or None
        Optional salt (None = zeros, per the RFC).

    Returns
    -------
    bytes
    """
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info).derive(ikm)


def derive_key(secret: bytes, *, label: bytes, session: bytes, parties: Sequence[int]) -> bytes:
    """Derive a 32-byte key bound to a purpose, the protocol version, the session and the parties.

    ``info = len‖label ‖ major‖0 ‖ len‖session_id ‖ count ‖ party ids (8 bytes each)``; every part is
    length-prefixed or fixed-width so two different contexts never produce the same ``info``.  Only the
    major version is bound (the minor field is always 0): peers of any 1.x minor version must derive the
    same keys, since a minor version only appends message fields.

    Parameters
    ----------
    secret : bytes
        Input keying material (an X25519 shared secret or a random seed).
    label : bytes
        Purpose, one of the ``LABEL_*`` constants.
    session : bytes
        The 32-byte session id.
    parties : sequence of int
        Device ids in a purpose-defined order.

    Returns
    -------
    bytes
        32 bytes.
    """
    info = b"".join(
        (
            _len_prefixed(label),
            _VERSION_BINDING,
            _len_prefixed(session),
            struct.pack(">I", len(parties)),
            *(_u64(p) for p in parties),
        )
    )
    return hkdf_sha256(secret, info=info)


def session_id(round_id: int, public_keys: Mapping[int, tuple[bytes, bytes]]) -> bytes:
    """Session id = SHA-256 over the round id and every advertised key pair, sorted by device id.

    Binding it into every HKDF ``info`` and every AEAD associated data means nothing from one round can be
    replayed into another, even with reused device ids (Bonawitz et al. 2017 §4; FCP's session id).

    Parameters
    ----------
    round_id : int
        The round.
    public_keys : mapping of int to (bytes, bytes)
        Device id → (c public key, s public key) for all of U1.

    Returns
    -------
    bytes
        32 bytes.
    """
    h = hashlib.sha256()
    h.update(_len_prefixed(_LABEL_SESSION))
    h.update(_VERSION_BINDING)
    h.update(_u64(round_id))
    h.update(struct.pack(">I", len(public_keys)))
    for device_id in sorted(public_keys):
        c_pk, s_pk = public_keys[device_id]
        h.update(_u64(device_id))
        h.update(_len_prefixed(c_pk))
        h.update(_len_prefixed(s_pk))
    return h.digest()


def share_associated_data(session: bytes, src: int, dst: int) -> bytes:
    """AEAD associated data for a share ciphertext: session id ‖ src ‖ dst."""
    return session + _u64(src) + _u64(dst)


def share_encryption_key(shared_secret: bytes, session: bytes, src: int, dst: int) -> bytes:
    """Directional AES-256-GCM key for shares sent from ``src`` to ``dst``."""
    return derive_key(shared_secret, label=LABEL_SHARE_ENCRYPTION, session=session, parties=(src, dst))


def pair_mask_key(shared_secret: bytes, session: bytes, u: int, v: int) -> bytes:
    """PRG key of the pairwise mask between ``u`` and ``v`` (order-independent)."""
    lo, hi = (u, v) if u < v else (v, u)
    return derive_key(shared_secret, label=LABEL_PAIR_MASK, session=session, parties=(lo, hi))


def self_mask_key(seed: bytes, session: bytes, device_id: int) -> bytes:
    """PRG key of ``device_id``'s self mask, from its 32-byte seed b_u."""
    return derive_key(seed, label=LABEL_SELF_MASK, session=session, parties=(device_id,))


def _aesgcm(key: bytes) -> AESGCM:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise CryptoError("an AES-256 key is 32 bytes")
    return AESGCM(key)


def aead_encrypt(key: bytes, plaintext: bytes, associated_data: bytes, *, nonce: bytes | None = None) -> bytes:
    """AES-256-GCM encryption; returns ``nonce ‖ ciphertext ‖ tag``.

    Parameters
    ----------
    key : bytes
        32 bytes.
    plaintext, associated_data : bytes
        Data to encrypt, and data to authenticate only.
    nonce : bytes or None
        Leave None: a fresh random 12-byte nonce is drawn.  Passing one exists for known-answer tests only;
        a reused nonce under one key breaks GCM.

    Returns
    -------
    bytes
    """
    if nonce is None:
        nonce = os.urandom(NONCE_BYTES)
    elif len(nonce) != NONCE_BYTES:
        raise CryptoError("an AES-GCM nonce is 12 bytes")
    return nonce + _aesgcm(key).encrypt(nonce, plaintext, associated_data)


def aead_decrypt(key: bytes, blob: bytes, associated_data: bytes) -> bytes:
    """Inverse of `aead_encrypt`.

    Raises
    ------
    CryptoError
        Wrong key, wrong associated data, truncated or tampered ciphertext.
    """
    if len(blob) < NONCE_BYTES + TAG_BYTES:
        raise CryptoError("ciphertext too short")
    try:
        return _aesgcm(key).decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], associated_data)
    except InvalidTag:
        raise CryptoError("share ciphertext failed authentication") from None


def random_seed() -> bytes:
    """32 bytes from the OS CSPRNG (self-mask seed b_u)."""
    return os.urandom(KEY_BYTES)


def _ctr_encryptor(key: bytes) -> CipherContext:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise CryptoError("a PRG key is 32 bytes")
    return Cipher(algorithms.AES(key), modes.CTR(_ZERO_CTR_NONCE)).encryptor()


def prg_uint32(key: bytes, length: int) -> NDArray[np.uint32]:
    """Expand a PRG key into ``length`` uniform uint32 ring elements (AES-256-CTR keystream, little-endian).

    Uniform mod 2**32 without rejection sampling because the ring is a power of two.

    Parameters
    ----------
    key : bytes
        32-byte key from `pair_mask_key` or `self_mask_key` (each key expands one vector only).
    length : int
        Number of elements.

    Returns
    -------
    ndarray of uint32, shape (length,)
    """
    stream = _ctr_encryptor(key).update(bytes(4 * length))
    return np.frombuffer(stream, dtype="<u4").astype(np.uint32)


class MaskPrg:
    """Reusable PRG expander for one vector length: no allocation per expansion.

    The server expands thousands of masks per round; writing each keystream into one scratch buffer keeps
    memory flat and saves the allocation (about a third of the cost at L = 10**5).

    Parameters
    ----------
    length : int
        Number of uint32 elements per mask.
    """

    __slots__ = ("length", "_zeros", "_scratch", "_view")

    def __init__(self, length: int) -> None:
        if length < 1:
            raise ValueError("mask length must be >= 1")
        self.length = length
        self._zeros = bytes(4 * length)
        # CTR's update_into wants block_size - 1 spare bytes in the output buffer.
        self._scratch = bytearray(4 * length + 15)
        self._view: NDArray[np.uint32] = np.frombuffer(self._scratch, dtype="<u4", count=length)

    def expand(self, key: bytes) -> NDArray[np.uint32]:
        """Return the mask for ``key`` as a view that the next call overwrites.

        Parameters
        ----------
        key : bytes
            32-byte PRG key.

        Returns
        -------
        ndarray of uint32, shape (length,)
            Valid until the next `expand`; copy it to keep it.
        """
        _ctr_encryptor(key).update_into(self._zeros, self._scratch)
        return self._view


# -- long-term identities (Ed25519) and enrollment certificates ------------------------------------------

SIGNATURE_BYTES = 64
_CERT_MAGIC = b"FRC1"
#: magic ‖ subject public key ‖ 16-byte serial ‖ CA signature over (label ‖ magic ‖ subject ‖ serial).
CERTIFICATE_BYTES = len(_CERT_MAGIC) + KEY_BYTES + 16 + SIGNATURE_BYTES
#: Certificate format 2 (a validity period): "FRC2" ‖ subject ‖ serial ‖ not_before ‖ not_after (u64
#: big-endian Unix seconds) ‖ CA signature over (label ‖ everything before it).  Format 1 stays readable.
_CERT_MAGIC_V2 = b"FRC2"
CERTIFICATE_V2_BYTES = CERTIFICATE_BYTES + 16
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
    """

    subject: bytes
    serial: bytes
    not_before: int | None
    not_after: int | None

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
    if v2:
        not_before, not_after = struct.unpack(">QQ", body[start + KEY_BYTES + 16 :])
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
    return Certificate(subject=subject, serial=serial, not_before=not_before, not_after=not_after)


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
) -> bytes:
    """Check a certificate (`read_certificate`: signature, validity period, revocation); return the
    certified device public key.

    Raises
    ------
    CryptoError
        Malformed, or not signed by the authority.
    CertificateNotYetValid, CertificateExpired, CertificateRevoked
        As `read_certificate`.
    """
    return read_certificate(certificate, authority_public_key, now=now, revoked=revoked).subject


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


def key_advertisement_payload(round_id: int, device_id: int, c_public_key: bytes, s_public_key: bytes) -> bytes:
    """What a device signs when it advertises its round keys (binds round, device id and both keys)."""
    return _LABEL_KEY_ADVERTISEMENT + _VERSION_BINDING + _u64(round_id) + _u64(device_id) + c_public_key + s_public_key


def survivor_set_payload(round_id: int, session: bytes, survivors: Sequence[int]) -> bytes:
    """What a survivor signs in the consistency check: the round, the session and the sorted set U3."""
    ids = sorted(survivors)
    return (
        _LABEL_SURVIVOR_SET
        + _VERSION_BINDING
        + _u64(round_id)
        + _len_prefixed(session)
        + struct.pack(">I", len(ids))
        + b"".join(_u64(v) for v in ids)
    )
