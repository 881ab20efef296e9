"""Binary codes, shared by devices and server (the wire form of LightFR models): ±1 sign
matrices and their bit-packed, word-major uint64 storage.

Invariants:
- A code of length f is stored in ``w = ceil(f / 64)`` little-endian uint64 words; bit ``k`` of the
  code lives in word ``k // 64`` at bit position ``k % 64`` (least significant first).  +1 is bit 1,
  -1 is bit 0.  Padding bits above f are always 0, so XOR + popcount never counts them.
- Item codes are stored **word-major**: shape ``(w, m)``.  A Hamming scan then streams one
  contiguous row of m words per code word (see docs/design.md §2.1).
- The wire/bytes form is the little-endian bytes of the (w, m) array, row after row.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "all_signs",
    "words_for",
    "pack_signs",
    "unpack_signs",
    "pack_user",
    "to_bytes",
    "from_bytes",
    "random_signs",
    "float_matrix_to_bytes",
    "float_matrix_from_bytes",
]


def words_for(f: int) -> int:
    """Number of uint64 words that hold a code of ``f`` bits."""
    if f <= 0:
        raise ValueError(f"code length must be positive, got {f}")
    return (f + 63) // 64


#: Entries of a sign matrix checked at a time by `all_signs` (its temporaries: two bytes an entry).
_CHECK_CHUNK = 1 << 22


def all_signs(signs: NDArray[Any]) -> bool:
    """Whether every entry of ``signs`` is -1 or +1 (any shape; True when empty).

    For integer, boolean and real dtypes the test is |x| == 1, over `_CHECK_CHUNK` entries at a time: the
    same answer as ``np.isin(signs, (-1, 1)).all()`` at about a hundredth of its cost (it sorts) and a
    bounded memory; other dtypes go through `np.isin`."""
    a = np.asarray(signs)
    if a.dtype.kind not in "biuf":
        return bool(np.isin(a, (-1, 1)).all())
    if a.ndim == 0:
        return bool(abs(a) == 1)
    row = math.prod(a.shape[1:])
    rows = max(1, _CHECK_CHUNK // max(1, row))  # whole rows: no copy of a strided matrix
    return all(bool((np.abs(a[s : s + rows]) == 1).all()) for s in range(0, a.shape[0], rows))


def _check_signs(signs: NDArray[np.int8]) -> None:
    if signs.ndim != 2:
        raise ValueError(f"sign matrix must be 2-D (items x bits), got shape {signs.shape}")
    if not all_signs(signs):
        raise ValueError("sign matrix may only hold -1 and +1")


def pack_signs(signs: NDArray[np.int8]) -> NDArray[np.uint64]:
    """Pack an (m, f) matrix of ±1 into word-major (w, m) uint64 words (+1 → bit 1).

    Parameters
    ----------
    signs : (m, f) array of -1/+1 (any integer dtype)

    Returns
    -------
    (w, m) uint64, C-contiguous.
    """
    signs = np.asarray(signs)
    _check_signs(signs)
    m, f = signs.shape
    w = words_for(f)
    bits = np.zeros((m, w * 64), dtype=np.uint8)
    bits[:, :f] = signs > 0
    # packbits little-endian per byte, then view 8 bytes as one little-endian uint64.
    packed = np.packbits(bits, axis=1, bitorder="little")  # (m, w*8) uint8
    words = packed.view("<u8").reshape(m, w)
    return np.ascontiguousarray(words.T.astype(np.uint64))


def unpack_signs(words: NDArray[np.uint64], f: int) -> NDArray[np.int8]:
    """Inverse of :func:`pack_signs`: (w, m) words → (m, f) int8 of ±1."""
    words = np.asarray(words)
    w = words_for(f)
    if words.ndim != 2 or words.shape[0] != w:
        raise ValueError(f"expected packed words of shape ({w}, m) for f={f}, got {words.shape}")
    m = words.shape[1]
    as_bytes = np.ascontiguousarray(words.T.astype("<u8")).view(np.uint8).reshape(m, w * 8)
    signs = np.unpackbits(as_bytes, axis=1, count=f, bitorder="little").view(np.int8)  # (m, f) of 0 / 1
    signs *= 2
    signs -= 1
    return signs


def pack_user(sign: NDArray[np.int8]) -> NDArray[np.uint64]:
    """Pack one ±1 code of length f into its (w,) words."""
    sign = np.asarray(sign)
    if sign.ndim != 1:
        raise ValueError(f"a user code must be 1-D, got shape {sign.shape}")
    return pack_signs(sign[None, :])[:, 0].copy()


def to_bytes(words: NDArray[np.uint64]) -> bytes:
    """Wire form of packed words: little-endian bytes of the (w, m) array, row-major."""
    return np.ascontiguousarray(words, dtype="<u8").tobytes()


def from_bytes(data: bytes, f: int, m: int) -> NDArray[np.uint64]:
    """Parse the wire form back into (w, m) uint64 words, rejecting wrong lengths and stray padding."""
    w = words_for(f)
    if len(data) != w * m * 8:
        raise ValueError(f"expected {w * m * 8} bytes for {m} codes of {f} bits, got {len(data)}")
    words = np.frombuffer(data, dtype="<u8").reshape(w, m).astype(np.uint64)
    tail = f % 64
    if tail and (words[-1] >> np.uint64(tail)).any():
        raise ValueError("padding bits above the code length are set")
    return words


def random_signs(m: int, f: int, rng: np.random.Generator) -> NDArray[np.int8]:
    """Uniformly random (m, f) ±1 matrix from the given generator."""
    return (rng.integers(0, 2, size=(m, f), dtype=np.int8) * 2 - 1).astype(np.int8)


def float_matrix_to_bytes(matrix: NDArray[np.floating]) -> bytes:
    """A real-valued model matrix in the wire form of `ModelPayload.values`: little-endian float64,
    C order."""
    return np.ascontiguousarray(matrix, dtype="<f8").tobytes()


def float_matrix_from_bytes(values: bytes, shape: tuple[int, ...]) -> NDArray[np.float64]:
    """Inverse of `float_matrix_to_bytes`.

    Raises
    ------
    ValueError
        A length that does not fit ``shape``, or a NaN / infinite entry.
    """
    expected = 8 * int(np.prod(shape))
    if len(values) != expected:
        raise ValueError(f"model values are {len(values)} bytes, expected {expected} for shape {shape}")
    arr = np.frombuffer(values, dtype="<f8").astype(np.float64).reshape(shape)
    if not np.all(np.isfinite(arr)):
        raise ValueError("model values contain NaN or infinity")
    return arr
