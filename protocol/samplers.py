# Invariants:
# - `NoiseStream` is the only randomness of the DP noise: a ChaCha20 keystream whose key expands exactly one
#   stream; a device keys it from `secrets`, a simulation only through `insecure_test_noise_stream`, whose
#   name says what it is.  A bad key leaves as `CryptoError`.
# - The samplers are pure functions of the words they read from the stream passed in: no global state, no numpy
#   generator, no clock.  Two callers holding streams with the same key and making the same calls get
#   bit-identical results (the device session and the private-round simulator rely on this).
# - Exact samplers: inversion for small means, and the transformed-rejection methods of Hörmann (PTRS for
#   Poisson, 1993; BTRS for the binomial, 1993) above; the acceptance tests use an exact log-factorial
#   (a table below 256, Stirling's series with three correction terms, error < 1e-16 relative, above).
# - The order in which words are consumed is part of the contract: changing it changes every seeded
#   simulation, so it is fixed here and covered by a known-answer test.
"""The DP noise's keystream (`NoiseStream`, ChaCha20) and the Poisson and binomial samplers over it (the DP
noise and thinning coins).

Word consumption, per call: inversion draws one uniform per coordinate (one block of ``size``);
rejection draws, per pass, two uniforms (u, then v) for every coordinate still pending, as two
consecutive blocks of the pending count, and repeats on the coordinates that were rejected, in index
order.  `protocol.noise.thin` samples the positive half, then the negative half.
"""

from __future__ import annotations

import hashlib
import logging
import math
import secrets
import struct

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from numpy.typing import NDArray

from protocol.errors import CryptoError

__all__ = [
    "NoiseStream",
    "insecure_test_noise_stream",
    "INSECURE_NOISE_NOTICE",
    "log_factorial",
    "poisson",
    "binomial",
]

_KEY_BYTES = 32  # a ChaCha20 key
_LABEL_INSECURE_NOISE = b"fedrec/INSECURE-test-only/noise-stream"

#: What every run that keys DP noise from a public seed prints (one text, so it can be grepped for).
INSECURE_NOISE_NOTICE = (
    "WARNING: this run seeds the devices' DP noise from a public seed (a test hook): anyone who knows the "
    "seed can predict and remove the noise, so any ε it reports is NOT a privacy guarantee."
)
_log = logging.getLogger(__name__)


class NoiseStream:
    """The randomness of the DP noise and of the thinning coins: a ChaCha20 keystream (RFC 8439 cipher, as
    implemented by `cryptography`), read as little-endian words.

    Whoever does not know the 32-byte key cannot predict a word of the stream, so the server cannot
    predict a device's noise from anything it sees (round id, device id, earlier excesses).  The samplers
    of `protocol.noise` are pure functions of the words they read, so two parties holding the same key
    (a simulation and a device driven over HTTP, both given one test seed) draw bit-identical noise.

    Parameters
    ----------
    key : bytes
        32 secret bytes.  Production code uses `NoiseStream.from_os`; known-answer tests and simulations
        use `insecure_test_noise_stream`, whose name says what it is.

    Raises
    ------
    CryptoError
        The key is not 32 bytes.
    """

    __slots__ = ("_encryptor", "words_read")

    def __init__(self, key: bytes) -> None:
        if type(key) is not bytes or len(key) != _KEY_BYTES:
            raise CryptoError(f"a noise-stream key is {_KEY_BYTES} bytes")
        # ChaCha20 with a zero 16-byte (counter ‖ nonce) block: each key expands exactly one stream.
        self._encryptor = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()
        self.words_read = 0

    @classmethod
    def from_os(cls) -> NoiseStream:
        """A stream keyed with 32 bytes from `secrets` (the only constructor a real device uses)."""
        return cls(secrets.token_bytes(_KEY_BYTES))

    def uint64(self, count: int) -> NDArray[np.uint64]:
        """The next ``count`` 64-bit words of the keystream.

        Raises
        ------
        ValueError
            ``count < 0``.
        """
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        self.words_read += count
        return np.frombuffer(self._encryptor.update(bytes(8 * count)), dtype="<u8").astype(np.uint64)

    def uniform(self, count: int) -> NDArray[np.float64]:
        """The next ``count`` uniforms in the open interval (0, 1): (top 53 bits of a word + 1/2) / 2**53."""
        words = self.uint64(count) >> np.uint64(11)
        return (words.astype(np.float64) + 0.5) * (1.0 / 9007199254740992.0)


def insecure_test_noise_stream(seed: int, *context: int) -> NoiseStream:
    """TEST HOOK: a noise stream derived from a public seed.  Its noise is predictable by anyone who knows
    the seed, so any ε reported for a run that uses it is NOT a privacy guarantee.

    Simulations use it to make runs reproducible and to draw bit-identical noise in two places (the
    in-process simulator and devices driven over HTTP); a production device never calls it.

    Parameters
    ----------
    seed : int
        The run's public seed (>= 0).
    *context : int
        Further non-negative integers separating streams (round id, device id, ...).

    Returns
    -------
    NoiseStream
        Keyed with SHA-256(label ‖ seed ‖ context).

    Raises
    ------
    ValueError
        A negative or non-integer argument.
    """
    parts = (seed, *context)
    for value in parts:
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or not 0 <= int(value) < 2**64:
            raise ValueError(f"test noise seeds are integers in [0, 2**64), got {value!r}")
    _log.debug("INSECURE test noise stream for seed %d: ε of this run is not a privacy guarantee", seed)
    key = hashlib.sha256(_LABEL_INSECURE_NOISE + b"".join(struct.pack(">Q", int(v)) for v in parts)).digest()
    return NoiseStream(key)


_TABLE_SIZE = 256
_LOG_FACTORIAL_TABLE = np.array([math.lgamma(k + 1.0) for k in range(_TABLE_SIZE)], dtype=np.float64)
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)
# Below this mean the samplers invert the CDF; above it they use transformed rejection.
_INVERSION_MAX_MEAN = 10.0


def _check_stream(stream: NoiseStream) -> None:
    if not isinstance(stream, NoiseStream):
        raise TypeError(
            f"DP noise needs a protocol.samplers.NoiseStream (a cryptographic keystream), got {type(stream).__name__}"
        )


def log_factorial(k: NDArray[np.float64]) -> NDArray[np.float64]:
    """log(k!) for non-negative integer-valued floats, vectorized (a table below 256, Stirling above)."""
    k = np.asarray(k, dtype=np.float64)
    x = np.maximum(k, float(_TABLE_SIZE)) + 1.0  # Stirling only where it is used; no log(0) below
    inv = 1.0 / x
    inv2 = inv * inv
    stirling = (x - 0.5) * np.log(x) - x + _HALF_LOG_2PI + inv * (1.0 / 12.0 - inv2 * (1.0 / 360.0 - inv2 / 1260.0))
    table = _LOG_FACTORIAL_TABLE[np.minimum(k, _TABLE_SIZE - 1).astype(np.int64)]
    return np.where(k < _TABLE_SIZE, table, stirling)


def poisson(lam: float, size: int, stream: NoiseStream) -> NDArray[np.int64]:
    """``size`` independent Poisson(lam) counts.

    Parameters
    ----------
    lam : float
        The mean, finite and >= 0.
    size : int
        Number of draws (>= 0).
    stream : NoiseStream
        Source of the uniforms.

    Returns
    -------
    NDArray[np.int64]

    Raises
    ------
    ValueError
        A negative or non-finite mean, a negative size.
    TypeError
        ``stream`` is not a `NoiseStream` (a numpy generator is refused).
    """
    _check_stream(stream)
    lam = float(lam)
    if not math.isfinite(lam) or lam < 0.0:
        raise ValueError(f"the Poisson mean must be finite and >= 0, got {lam!r}")
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    if lam == 0.0 or size == 0:
        return np.zeros(size, dtype=np.int64)
    if lam < _INVERSION_MAX_MEAN:
        return _poisson_inversion(lam, size, stream)
    return _poisson_ptrs(lam, size, stream)


def _poisson_inversion(lam: float, size: int, stream: NoiseStream) -> NDArray[np.int64]:
    # Inversion against the CDF table of k = 0..cap: the smallest k with u <= F(k).
    cap = int(lam + 40.0 * math.sqrt(lam) + 60.0)  # beyond it the tail mass is below 1e-300
    ks = np.arange(cap + 1, dtype=np.float64)
    cdf = np.cumsum(np.exp(ks * math.log(lam) - lam - log_factorial(ks)))
    u = stream.uniform(size)
    return np.minimum(np.searchsorted(cdf, u, side="left"), cap).astype(np.int64)


def _poisson_ptrs(lam: float, size: int, stream: NoiseStream) -> NDArray[np.int64]:
    # Hörmann 1993, "The transformed rejection method for generating Poisson random variables", PTRS.
    slam, loglam = math.sqrt(lam), math.log(lam)
    b = 0.931 + 2.53 * slam
    a = -0.059 + 0.02483 * b
    log_inv_alpha = math.log(1.1239 + 1.1328 / (b - 3.4))
    v_r = 0.9277 - 3.6224 / (b - 2.0)
    out = np.empty(size, dtype=np.int64)
    todo = np.arange(size)
    while todo.size:
        m = todo.size
        u = stream.uniform(m) - 0.5
        v = stream.uniform(m)
        us = 0.5 - np.abs(u)
        k = np.floor((2.0 * a / us + b) * u + lam + 0.43)
        accept = (us >= 0.07) & (v <= v_r)
        slow = np.flatnonzero(~accept & (k >= 0.0) & ~((us < 0.013) & (v > us)))
        if slow.size:
            ks, uss = k[slow], us[slow]
            lhs = np.log(v[slow]) + log_inv_alpha - np.log(a / (uss * uss) + b)
            accept[slow] = lhs <= -lam + ks * loglam - log_factorial(ks)
        out[todo[accept]] = k[accept].astype(np.int64)
        todo = todo[~accept]
    return out


def binomial(n: NDArray[np.int64], p: float, stream: NoiseStream) -> NDArray[np.int64]:
    """Independent Binomial(n_i, p) counts, one per entry of ``n``.

    Parameters
    ----------
    n : NDArray[np.int64]
        Non-negative trial counts.
    p : float
        Success probability in [0, 1].
    stream : NoiseStream
        Source of the uniforms.

    Returns
    -------
    NDArray[np.int64]
        Same shape as ``n``.

    Raises
    ------
    ValueError
        ``p`` outside [0, 1] or a negative count.
    TypeError
        ``stream`` is not a `NoiseStream`.
    """
    _check_stream(stream)
    counts = np.asarray(n)
    if not np.issubdtype(counts.dtype, np.integer):
        raise ValueError(f"binomial counts must be integers, got dtype {counts.dtype}")
    counts = counts.astype(np.int64).ravel()
    p = float(p)
    if not (0.0 <= p <= 1.0):
        raise ValueError(f"p must be in [0, 1], got {p!r}")
    if counts.size and counts.min() < 0:
        raise ValueError("binomial counts must be >= 0")
    shape = np.shape(n)
    if p == 0.0 or counts.size == 0:
        return np.zeros(shape, dtype=np.int64)
    if p == 1.0:
        return counts.reshape(shape).copy()
    flip = p > 0.5
    q = 1.0 - p if flip else p  # sample with q <= 1/2, reflect at the end
    out = np.zeros(counts.size, dtype=np.int64)
    small = counts.astype(np.float64) * q < _INVERSION_MAX_MEAN
    idx_small, idx_large = np.flatnonzero(small & (counts > 0)), np.flatnonzero(~small)
    if idx_small.size:
        out[idx_small] = _binomial_inversion(counts[idx_small], q, stream)
    if idx_large.size:
        out[idx_large] = _binomial_btrs(counts[idx_large], q, stream)
    if flip:
        out = counts - out
    return out.reshape(shape)


def _binomial_inversion(n: NDArray[np.int64], p: float, stream: NoiseStream) -> NDArray[np.int64]:
    # Sequential search of the CDF (Kachitvichyanukul & Schmeiser 1988, BINV); n * p < 10, p <= 1/2.
    q = 1.0 - p
    s = p / q
    nf = n.astype(np.float64)
    a = (nf + 1.0) * s
    r = np.exp(nf * math.log(q))
    u = stream.uniform(n.size)
    x = np.zeros(n.size, dtype=np.int64)
    active = np.flatnonzero((u > r) & (x < n))
    while active.size:
        u[active] -= r[active]
        x[active] += 1
        r[active] *= a[active] / x[active] - s
        active = active[(u[active] > r[active]) & (x[active] < n[active])]
    return x


def _binomial_btrs(n: NDArray[np.int64], p: float, stream: NoiseStream) -> NDArray[np.int64]:
    # Hörmann 1993, "The generation of binomial random variates", BTRS; n * p >= 10, p <= 1/2.
    q = 1.0 - p
    nf = n.astype(np.float64)
    spq = np.sqrt(nf * p * q)
    b = 1.15 + 2.53 * spq
    a = -0.0873 + 0.0248 * b + 0.01 * p
    c = nf * p + 0.5
    v_r = 0.92 - 4.2 / b
    alpha = (2.83 + 5.1 / b) * spq
    lpq = math.log(p / q)
    m = np.floor((nf + 1.0) * p)
    h = log_factorial(m) + log_factorial(nf - m)
    out = np.empty(n.size, dtype=np.int64)
    todo = np.arange(n.size)
    while todo.size:
        cnt = todo.size
        u = stream.uniform(cnt) - 0.5
        v = stream.uniform(cnt)
        us = 0.5 - np.abs(u)
        at, bt, ct, nt = a[todo], b[todo], c[todo], nf[todo]
        k = np.floor((2.0 * at / us + bt) * u + ct)
        accept = (us >= 0.07) & (v <= v_r[todo])
        slow = np.flatnonzero(~accept & (k >= 0.0) & (k <= nt))
        if slow.size:
            ks, uss, ns, ts = k[slow], us[slow], nt[slow], todo[slow]
            lhs = np.log(v[slow] * alpha[ts] / (at[slow] / (uss * uss) + bt[slow]))
            rhs = h[ts] - log_factorial(ks) - log_factorial(ns - ks) + (ks - m[ts]) * lpq
            accept[slow] = lhs <= rhs
        out[todo[accept]] = k[accept].astype(np.int64)
        todo = todo[~accept]
    return out
