"""Binary codes on the device: the packed forms of `protocol.codes` plus `bitarray` conversion.

Bit order matches `protocol.codes`: code k of an item is bit k, +1 is 1, little-endian.
"""

from __future__ import annotations

import numpy as np
from bitarray import bitarray
from numpy.typing import NDArray

from protocol.codes import (
    all_signs,
    from_bytes,
    pack_signs,
    pack_user,
    random_signs,
    to_bytes,
    unpack_signs,
    words_for,
)

__all__ = [
    "all_signs",
    "words_for",
    "pack_signs",
    "unpack_signs",
    "pack_user",
    "to_bitarray",
    "from_bitarray",
    "to_bytes",
    "from_bytes",
    "random_signs",
]


def to_bitarray(signs: NDArray[np.int8]) -> bitarray:
    """Concatenate the codes of an (m, f) sign matrix into one bitarray of m·f bits (+1 → 1)."""
    signs = np.asarray(signs)
    if signs.ndim != 2 or not all_signs(signs):
        raise ValueError("expected a 2-D matrix of -1/+1")
    out = bitarray(endian="little")
    out.pack((signs > 0).astype(np.uint8).tobytes())
    return out


def from_bitarray(bits: bitarray, f: int) -> NDArray[np.int8]:
    """Inverse of :func:`to_bitarray`."""
    if len(bits) % f:
        raise ValueError(f"bitarray of {len(bits)} bits is not a whole number of {f}-bit codes")
    flat = np.frombuffer(bits.unpack(), dtype=np.uint8)
    return (flat.reshape(-1, f).astype(np.int8) * 2 - 1).astype(np.int8)


#: Rows of a sign matrix packed at a time: `pack_signs`' bit matrix is a byte a sign.
_ROWS = 1 << 14


def pack_rows(signs: NDArray[np.int8]) -> NDArray[np.uint64]:
    """`protocol.codes.pack_signs` of an (m, f) ±1 matrix, _ROWS rows at a time (the same words)."""
    if signs.shape[0] <= _ROWS:
        return pack_signs(signs)
    return np.concatenate([pack_signs(signs[s : s + _ROWS]) for s in range(0, signs.shape[0], _ROWS)], axis=1)
