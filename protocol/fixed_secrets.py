# Invariants: known-answer test vectors only.  `FixedDeviceSecrets` replaces every value a device session
# would otherwise draw from the OS CSPRNG; it lives apart from the session so that a production import path
# never needs it, and a grep for its name finds every place that makes a session deterministic.
"""Fixed device secrets for the known-answer vectors of docs/test-vectors (never for production)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from protocol import crypto, shamir
from protocol.errors import LocalProtocolError
from protocol.shamir import PRIME, Share

__all__ = ["FixedDeviceSecrets"]


@dataclass(frozen=True, slots=True, kw_only=True)
class FixedDeviceSecrets:
    """Every secret a device session would draw from the OS CSPRNG, fixed: for known-answer vectors ONLY.

    A session given these is fully deterministic, which is what `docs/test-vectors` needs to publish
    byte-exact rounds; a production device must never pass them (reused keys, seeds or nonces across
    rounds destroy the privacy of every round that shares them).

    Attributes
    ----------
    c_private_key, s_private_key : bytes
        Raw 32-byte X25519 private scalars of the share-encryption and mask key pairs.
    self_mask_seed : bytes
        The 32-byte self-mask seed b_u.
    b_coefficients, s_coefficients : tuple of int
        The t - 1 non-constant Shamir coefficients a_1..a_{t-1} (field elements below 2**521 - 1) of the
        polynomials that share b_u and the s private key; the constant term is the secret itself.
    share_nonces : mapping of int to bytes
        Recipient id → 12-byte AES-GCM nonce of the share ciphertext addressed to it.
    """

    c_private_key: bytes
    s_private_key: bytes
    self_mask_seed: bytes
    b_coefficients: tuple[int, ...]
    s_coefficients: tuple[int, ...]
    share_nonces: Mapping[int, bytes]

    def __post_init__(self) -> None:
        for name in ("c_private_key", "s_private_key", "self_mask_seed"):
            value = getattr(self, name)
            if type(value) is not bytes or len(value) != crypto.KEY_BYTES:
                raise ValueError(f"{name} must be {crypto.KEY_BYTES} bytes")
        for name in ("b_coefficients", "s_coefficients"):
            values = getattr(self, name)
            if type(values) is not tuple or not all(type(c) is int and 0 <= c < PRIME for c in values):
                raise ValueError(f"{name} must be a tuple of field elements")
        if any(type(n) is not bytes or len(n) != crypto.NONCE_BYTES for n in self.share_nonces.values()):
            raise ValueError(f"share nonces must be {crypto.NONCE_BYTES} bytes")

    def shares(self, secret: bytes, coefficients: tuple[int, ...], t: int, count: int) -> list[Share]:
        """Evaluate secret + a_1 x + ... + a_{t-1} x^{t-1} at x = 1..count (what `shamir.split` returns).

        Raises
        ------
        LocalProtocolError
            The number of coefficients does not match the threshold.
        """
        if len(coefficients) != t - 1:
            raise LocalProtocolError(f"fixed secrets carry {len(coefficients)} coefficients, t={t} needs {t - 1}")
        return shamir.evaluate((int.from_bytes(secret, "big"), *coefficients), count)
