# Invariants: all arithmetic is in Z_{2^32} on np.uint32 arrays, where numpy's wrap-around is exactly the
# ring operation.  Device u adds +PRG(s_uv) for a neighbour v with a larger id and -PRG(s_uv) for a smaller
# one, so the pair's masks cancel in the sum (Bonawitz et al. 2017 §3, eq. for y_u).  The server holds one
# accumulator of length L however many devices report (never a list of n vectors), and every mask is
# expanded into one reusable scratch buffer.
"""Masking kernels: the device's masked input and the server's streaming mask removal."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from numpy.typing import NDArray

from protocol.crypto import MaskPrg, key_pair_from_private_bytes, pair_mask_key, self_mask_key, x25519

__all__ = ["pair_sign", "pair_mask_keys", "mask_input", "MaskedSumAccumulator"]


def pair_sign(u: int, v: int) -> int:
    """Sign with which device ``u`` adds the pairwise mask shared with ``v``: +1 if u < v else -1."""
    if u == v:
        raise ValueError("a device has no pairwise mask with itself")
    return 1 if u < v else -1


def pair_mask_keys(
    s_private_key: bytes | X25519PrivateKey, peers: Mapping[int, bytes], session: bytes, own_id: int
) -> dict[int, bytes]:
    """PRG keys s_uv for each peer: HKDF(X25519(s_u, s_v), pair-mask label, session, pair).

    Parameters
    ----------
    s_private_key : bytes or X25519PrivateKey
        Our raw 32-byte s private key (or a dropped device's, reconstructed by the server); parsed
        once for all peers.
    peers : mapping of int to bytes
        Peer id → its 32-byte s public key.
    session : bytes
        Session id.
    own_id : int
        The id whose private key this is.

    Returns
    -------
    dict of int to bytes
        Peer id → 32-byte PRG key.

    Raises
    ------
    CryptoError
        Bad key bytes.
    """
    private = s_private_key
    if isinstance(private, bytes):
        private = key_pair_from_private_bytes(private).private_key
    return {v: pair_mask_key(x25519(private, pk), session, own_id, v) for v, pk in peers.items() if v != own_id}


def mask_input(
    value: NDArray[np.uint32],
    *,
    device_id: int,
    self_key: bytes,
    pair_keys: Mapping[int, bytes],
    prg: MaskPrg | None = None,
) -> NDArray[np.uint32]:
    """y_u = value + PRG(b_u) + Σ_v sign(u, v)·PRG(s_uv) mod 2**32.

    Parameters
    ----------
    value : ndarray of uint32, shape (L,)
        q(x_u) + noise_u in the ring.
    device_id : int
        u.
    self_key : bytes
        PRG key derived from the self-mask seed b_u.
    pair_keys : mapping of int to bytes
        PRG keys for the neighbours in N(u) ∩ U2 (u itself excluded).
    prg : MaskPrg, optional
        Scratch expander of length L to reuse.

    Returns
    -------
    ndarray of uint32, shape (L,)
        A new array; ``value`` is not modified.
    """
    if value.dtype != np.uint32 or value.ndim != 1:
        raise ValueError("value must be a 1-D uint32 array")
    if prg is None or prg.length != value.shape[0]:
        prg = MaskPrg(value.shape[0])
    y = value.copy()
    np.add(y, prg.expand(self_key), out=y)
    for v, key in pair_keys.items():
        if pair_sign(device_id, v) > 0:
            np.add(y, prg.expand(key), out=y)
        else:
            np.subtract(y, prg.expand(key), out=y)
    return y


class MaskedSumAccumulator:
    """Streaming Σ y_u with mask removal, in one uint32 vector.

    Parameters
    ----------
    length : int
        L, the vector length.
    """

    __slots__ = ("_sum", "_prg", "count")

    def __init__(self, length: int) -> None:
        self._sum: NDArray[np.uint32] = np.zeros(length, dtype=np.uint32)
        self._prg = MaskPrg(length)
        #: Number of masked inputs added.
        self.count = 0

    @property
    def length(self) -> int:
        """L."""
        return int(self._sum.shape[0])

    def _check(self, vector: NDArray[np.uint32]) -> None:
        if vector.dtype != np.uint32 or vector.shape != self._sum.shape:
            raise ValueError(f"expected a uint32 vector of shape {self._sum.shape}, got {vector.dtype} {vector.shape}")

    def add(self, vector: NDArray[np.uint32]) -> None:
        """Add one masked input (or any ring vector)."""
        self._check(vector)
        np.add(self._sum, vector, out=self._sum)
        self.count += 1

    def subtract(self, vector: NDArray[np.uint32]) -> None:
        """Subtract a ring vector (e.g. a revealed DP excess)."""
        self._check(vector)
        np.subtract(self._sum, vector, out=self._sum)

    def remove_self_mask(self, seed: bytes, session: bytes, device_id: int) -> None:
        """Remove PRG(b_u) of a survivor whose seed b_u was reconstructed."""
        np.subtract(self._sum, self._prg.expand(self_mask_key(seed, session, device_id)), out=self._sum)

    def remove_pair_mask(self, survivor: int, dropped: int, key: bytes) -> None:
        """Remove the mask ``survivor`` added for its pair with ``dropped`` (key s_uv from either side)."""
        mask = self._prg.expand(key)
        if pair_sign(survivor, dropped) > 0:
            np.subtract(self._sum, mask, out=self._sum)
        else:
            np.add(self._sum, mask, out=self._sum)

    def total(self) -> NDArray[np.uint32]:
        """A copy of the current sum."""
        return self._sum.copy()
