# Invariants: arithmetic is over GF(p) with p = 2**521 - 1 (a Mersenne prime), so every 32-byte secret is a
# field element and any t - 1 shares are independent of it (Shamir 1979).  Share indices are 1..k (never 0,
# which is the secret).  Reconstruction uses exactly t shares, refuses fewer, refuses duplicate indices, and
# refuses a result that is not a 32-byte value: a share from another secret or a random one makes the
# interpolated value a uniform field element, which fits in 256 bits with probability 2**-265.  (This is a
# sanity check, not authentication: a deliberate small additive change can pass; the session verifies a
# reconstructed s key against its advertised public key, and shares travel under AEAD.)
# Lagrange coefficients at 0 depend only on the index set; they are memoised per set (`functools.lru_cache`).
"""t-of-k Shamir secret sharing of raw 32-byte secrets (self-mask seeds, X25519 private keys)."""

from __future__ import annotations

import functools
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from protocol.errors import CryptoError, NotEnoughParticipants

__all__ = [
    "PRIME",
    "SECRET_BYTES",
    "SHARE_BYTES",
    "evaluate",
    "MAX_SHARES",
    "Share",
    "split",
    "reconstruct",
    "lagrange_at_zero",
]

PRIME = 2**521 - 1
SECRET_BYTES = 32
_INDEX_BYTES = 2
_VALUE_BYTES = (PRIME.bit_length() + 7) // 8  # 66
SHARE_BYTES = _INDEX_BYTES + _VALUE_BYTES
MAX_SHARES = 2**16 - 1


@dataclass(frozen=True, slots=True)
class Share:
    """One Shamir share: the polynomial evaluated at ``index``.

    Attributes
    ----------
    index : int
        x-coordinate, 1..65535.
    value : int
        y-coordinate, an element of GF(2**521 - 1).
    """

    index: int
    value: int

    def __post_init__(self) -> None:
        if type(self.index) is not int or not 1 <= self.index <= MAX_SHARES:
            raise CryptoError(f"share index must be in 1..{MAX_SHARES}, got {self.index!r}")
        if type(self.value) is not int or not 0 <= self.value < PRIME:
            raise CryptoError("share value is not a field element")

    def to_bytes(self) -> bytes:
        """Fixed-length encoding: 2-byte big-endian index ‖ 66-byte big-endian value (68 bytes)."""
        return self.index.to_bytes(_INDEX_BYTES, "big") + self.value.to_bytes(_VALUE_BYTES, "big")

    @classmethod
    def from_bytes(cls, data: bytes) -> Share:
        """Inverse of `to_bytes`.

        Raises
        ------
        CryptoError
            Wrong length, index 0, or a value outside the field.
        """
        if not isinstance(data, bytes) or len(data) != SHARE_BYTES:
            raise CryptoError(f"a share is {SHARE_BYTES} bytes")
        return cls(int.from_bytes(data[:_INDEX_BYTES], "big"), int.from_bytes(data[_INDEX_BYTES:], "big"))


def split(secret: bytes, t: int, k: int) -> list[Share]:
    """Split a 32-byte secret into ``k`` shares, any ``t`` of which reconstruct it.

    Parameters
    ----------
    secret : bytes
        Exactly 32 bytes.
    t : int
        Threshold, 1 <= t <= k.
    k : int
        Number of shares, at most 65535; share i has index i (1-based).

    Returns
    -------
    list of Share
        Shares with indices 1..k.

    Raises
    ------
    ValueError
        Bad secret length or parameters.
    """
    if not isinstance(secret, bytes) or len(secret) != SECRET_BYTES:
        raise ValueError(f"a Shamir secret is {SECRET_BYTES} bytes")
    if not 1 <= t <= k <= MAX_SHARES:
        raise ValueError(f"need 1 <= t <= k <= {MAX_SHARES}, got t={t}, k={k}")
    # Coefficients from the OS CSPRNG: the random polynomial is what hides the secret.
    coefficients = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME) for _ in range(t - 1)]
    return evaluate(coefficients, k)


def evaluate(coefficients: Sequence[int], k: int) -> list[Share]:
    """Shares 1..k of the polynomial c_0 + c_1 x + ... + c_{t-1} x^{t-1} over the field (c_0 is the secret).

    `split` draws the coefficients; the fixed secrets of the test vectors pass their own."""
    top_down = list(coefficients)[::-1]
    shares = []
    for x in range(1, k + 1):
        y = 0
        for c in top_down:  # Horner: t multiplications per share
            y = (y * x + c) % PRIME
        shares.append(Share(x, y))
    return shares


@functools.lru_cache(maxsize=4096)
def lagrange_at_zero(indices: tuple[int, ...]) -> tuple[int, ...]:
    """Lagrange basis coefficients λ_i(0) for a sorted tuple of distinct share indices.

    λ_i = Π_{j≠i} x_j / (x_j − x_i) mod p.  Cached per index set because a server reconstructing many
    secrets sees the same sets again (e.g. every neighbourhood with the same responders).

    Parameters
    ----------
    indices : tuple of int
        Strictly increasing share indices.

    Returns
    -------
    tuple of int
        Coefficients aligned with ``indices``.
    """
    product = 1
    for x in indices:
        product = product * x % PRIME
    out = []
    for i, xi in enumerate(indices):
        denominator = xi
        for j, xj in enumerate(indices):
            if j != i:
                denominator = denominator * (xj - xi) % PRIME
        out.append(product * pow(denominator, -1, PRIME) % PRIME)
    return tuple(out)


def reconstruct(shares: Sequence[Share], t: int) -> bytes:
    """Recover the 32-byte secret from at least ``t`` shares.

    Uses the ``t`` shares with the smallest indices (a canonical choice, so index sets repeat and the
    Lagrange cache hits).

    Parameters
    ----------
    shares : sequence of Share
        Distinct-index shares of one secret.
    t : int
        The threshold the secret was split with.

    Returns
    -------
    bytes
        The secret.

    Raises
    ------
    NotEnoughParticipants
        Fewer than ``t`` shares.
    CryptoError
        Duplicate indices, or shares that do not interpolate to a 32-byte secret (e.g. mixed secrets).
    """
    if t < 1:
        raise ValueError(f"threshold must be >= 1, got {t}")
    indices = [s.index for s in shares]
    if len(set(indices)) != len(indices):
        raise CryptoError("duplicate share indices")
    if len(shares) < t:
        raise NotEnoughParticipants(f"need {t} shares to reconstruct, have {len(shares)}")
    chosen = sorted(shares, key=lambda s: s.index)[:t]
    coefficients = lagrange_at_zero(tuple(s.index for s in chosen))
    value = 0
    for share, lam in zip(chosen, coefficients, strict=True):
        value = (value + share.value * lam) % PRIME
    if value >= 1 << (8 * SECRET_BYTES):
        raise CryptoError("shares are inconsistent: the interpolated secret is not 32 bytes")
    return value.to_bytes(SECRET_BYTES, "big")
