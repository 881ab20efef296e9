# Invariants: the SecAgg+ half of fedrec's cryptography (`protocol.identity` holds the Ed25519 half,
# `protocol.samplers.NoiseStream` the DP-noise keystream); it only wraps the `cryptography` package.
# Every derived key comes from HKDF-SHA256 with an `info` that names its purpose, the protocol version, the
# session id and the parties, so no key serves two purposes, two sessions or two pairs.  AES-GCM nonces are
# 12 random bytes prepended to the ciphertext, so a key may encrypt many messages without nonce reuse.  The
# mask PRG uses a zero CTR nonce, which is safe only because each PRG key is derived for exactly one
# (session, pair or device, purpose) and expands exactly one vector.  Failures of the primitives (bad tags,
# bad key bytes, low-order points) leave as `CryptoError`.
"""Cryptographic helpers for SecAgg+ (Bonawitz et al. 2017 §4; Bell et al. 2020 §3).

X25519 for key agreement, HKDF-SHA256 for key derivation, AES-256-GCM for the Shamir-share channel and
an AES-256-CTR keystream, read as little-endian uint32, as the mask PRG.  Long-term identities, signatures
and enrollment certificates are `protocol.identity`; the DP noise keystream is `protocol.samplers`.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, CipherContext, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from numpy.typing import NDArray

from protocol.errors import CryptoError
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
