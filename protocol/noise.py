"""Integer Skellam noise in the ring Z_{2^32} and the corrected two-round DP scheme (docs/design.md §5).

Invariants of this module:

* Noise is integer-valued, so it adds exactly to quantized updates and pairwise masks mod 2^32.
* A `SkellamDraw` keeps its two Poisson halves, because the dropout correction thins each half
  separately; `value()` is always ``pos - neg`` and nothing else.
* Thinning never creates noise: the kept part and the revealed excess are functions of one draw plus
  fresh binomial coins, and by the Poisson thinning theorem they are independent.
* Every rate is turned into an exact fraction from its shortest decimal form before it meets ``n``,
  so ``0.3 * 100`` is 30 and not 30.000000000000004.
* All randomness comes from the `protocol.samplers.NoiseStream` passed in (a ChaCha20 keystream; numpy
  generators are refused), through the pure samplers of `protocol.samplers`; nothing here touches a clock
  or I/O.  A device keys its stream from `secrets` (`NoiseStream.from_os`), so the server cannot predict its
  noise; simulations key it from a seed only through `protocol.samplers.insecure_test_noise_stream`.

The scheme (docs/design.md §5, correcting section 6 of the FMF privacy paper): each device of a cohort of
``n`` adds Skellam(mu / (t_min - f)), with t_min = ceil((1 - omega) * n) and f = floor(gamma * n) the
devices that may collude with the server (protocol 1.12), so that the honest devices of any surviving
set of at least t_min carry aggregate variance >= mu even when the f colluders add no noise.  When the
server announces s survivors, each survivor splits its draw by binomial thinning with keep fraction
(t_min - f) / (s - f): it keeps Skellam(mu / (s - f)) and reveals the excess, which is independent of the
kept part.  At least s - f survivors are honest, so the final sum carries variance >= mu from them alone
(s / (s - f) * mu when nobody cheats), and the server, holding both the pre- and post-correction sums,
learns only the excess, which is independent of what protects the data.  The paper's own correction
("subtract my noise, add fresh noise") gives the server two independent noisy views whose best
combination has variance mu * s / (s + t_min) < mu; tests/test_protocol_noise.py demonstrates both facts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
from numpy.typing import NDArray

from protocol.errors import ConfigError, NotEnoughParticipants
from protocol.samplers import NoiseStream, binomial, poisson

__all__ = [
    "SkellamDraw",
    "StoredSkellam",
    "sample_skellam",
    "thin",
    "to_ring",
    "exact_rate",
    "minimum_survivors",
    "colluding_devices",
    "device_variance",
    "correction_keep_fraction",
    "device_noise",
    "correct_noise",
    "released_variance",
]

_RING_MASK = np.int64(0xFFFFFFFF)


@dataclass(frozen=True, slots=True)
class SkellamDraw:
    """One Skellam noise vector, kept as its two independent Poisson halves.

    Attributes
    ----------
    pos, neg : NDArray[np.int64]
        Non-negative Poisson(variance / 2) counts of equal shape; the noise is ``pos - neg``.
    """

    pos: NDArray[np.int64]
    neg: NDArray[np.int64]

    def __post_init__(self) -> None:
        if self.pos.shape != self.neg.shape:
            raise ValueError(f"Skellam halves differ in shape: {self.pos.shape} vs {self.neg.shape}")
        if self.pos.dtype != np.int64 or self.neg.dtype != np.int64:
            raise ValueError(f"Skellam halves must be int64, got {self.pos.dtype} and {self.neg.dtype}")

    def value(self) -> NDArray[np.int64]:
        """Return the noise vector ``pos - neg`` (int64)."""
        return self.pos - self.neg


@dataclass(frozen=True, slots=True)
class StoredSkellam:
    """A `SkellamDraw` stored exactly as offsets from each half's smallest count, in the narrowest
    unsigned integer type (uint8 to uint64) that holds them.

    A device keeps its DP noise from the masked input to the unmask reply: as two int64 vectors that
    is 16 bytes per coordinate, held by every device of a round at once in a simulated fleet.  The
    counts of a Poisson half spread over a few standard deviations around their mean, so the offsets
    fit in 1 or 2 bytes even when the counts themselves need 4; `draw` gives back the identical
    int64 halves.
    """

    pos_base: int
    neg_base: int
    pos: NDArray[np.unsignedinteger]
    neg: NDArray[np.unsignedinteger]

    @classmethod
    def of(cls, draw: SkellamDraw) -> StoredSkellam:
        """Store ``draw`` exactly (its halves must be non-negative counts)."""
        pos_base, pos = _narrow(draw.pos)
        neg_base, neg = _narrow(draw.neg)
        return cls(pos_base, neg_base, pos, neg)

    def draw(self) -> SkellamDraw:
        """The stored draw as int64 halves (fresh arrays)."""
        return SkellamDraw(
            self.pos.astype(np.int64) + np.int64(self.pos_base), self.neg.astype(np.int64) + np.int64(self.neg_base)
        )


def _narrow(counts: NDArray[np.int64]) -> tuple[int, NDArray[np.unsignedinteger]]:
    if not counts.size:
        return 0, np.zeros(counts.shape, dtype=np.uint8)
    base, top = int(counts.min()), int(counts.max())
    if base < 0:
        raise ValueError("Poisson counts must be non-negative")
    span = top - base
    return base, (counts - np.int64(base)).astype(np.min_scalar_type(span) if span > 0 else np.uint8)


def _check_variance(variance: float) -> float:
    v = float(variance)
    if not math.isfinite(v) or v < 0.0:
        raise ConfigError(f"noise variance must be finite and >= 0, got {variance!r}")
    return v


def sample_skellam(variance: float, size: int, rng: NoiseStream) -> SkellamDraw:
    """Draw a Skellam vector of the given per-coordinate variance.

    Skellam(v) is the difference of two independent Poisson(v / 2) variables: mean 0, variance v,
    integer-valued (Agarwal, Kairouz, Liu 2021, §3).

    Parameters
    ----------
    variance : float
        Per-coordinate variance v >= 0 (in quantized units).
    size : int
        Number of coordinates.
    rng : NoiseStream
        Source of randomness (keyed by the caller from ``secrets``).

    Returns
    -------
    SkellamDraw
        The two Poisson halves.

    Raises
    ------
    ConfigError
        If the variance is negative or not finite.
    ValueError
        If ``size`` is negative.
    """
    v = _check_variance(variance)
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    lam = v / 2.0
    pos = poisson(lam, size, rng)
    neg = poisson(lam, size, rng)
    return SkellamDraw(pos=pos, neg=neg)


def thin(draw: SkellamDraw, keep_fraction: float, rng: NoiseStream) -> tuple[SkellamDraw, NDArray[np.int64]]:
    """Split a Skellam draw into a kept part and an independent revealed excess.

    Each Poisson count N ~ Poisson(lam) is thinned as K | N ~ Binomial(N, p).  By the Poisson
    thinning theorem K ~ Poisson(p * lam) and N - K ~ Poisson((1 - p) * lam) and the two are
    independent; applying it to both halves gives kept ~ Skellam(p * v), excess ~ Skellam((1 - p) * v),
    independent.  Independence is what lets the excess travel in the clear (docs/design.md §5).

    Parameters
    ----------
    draw : SkellamDraw
        The device's original noise.
    keep_fraction : float
        p in [0, 1]; normally `correction_keep_fraction`.
    rng : NoiseStream
        Source of the binomial coins.

    Returns
    -------
    kept : SkellamDraw
        The part that stays in the sum.
    excess : NDArray[np.int64]
        ``draw.value() - kept.value()``, to be revealed.

    Raises
    ------
    ValueError
        If ``keep_fraction`` is not in [0, 1].
    """
    p = float(keep_fraction)
    if not (0.0 <= p <= 1.0):
        raise ValueError(f"keep_fraction must be in [0, 1], got {keep_fraction!r}")
    kept_pos = binomial(draw.pos, p, rng)
    kept_neg = binomial(draw.neg, p, rng)
    kept = SkellamDraw(pos=kept_pos, neg=kept_neg)
    excess = (draw.pos - kept_pos) - (draw.neg - kept_neg)
    return kept, excess


def to_ring(values: NDArray[np.int64]) -> NDArray[np.uint32]:
    """Reduce signed integers into the ring Z_{2^32} (two's complement).

    Parameters
    ----------
    values : NDArray[np.int64]
        Signed integers.

    Returns
    -------
    NDArray[np.uint32]
        ``values mod 2**32``.
    """
    v = np.asarray(values)
    if not np.issubdtype(v.dtype, np.integer):
        raise ValueError(f"to_ring needs integers, got dtype {v.dtype}")
    return np.bitwise_and(v.astype(np.int64), _RING_MASK).astype(np.uint32)


def exact_rate(rate: float, name: str = "rate") -> Fraction:
    """Return a rate in [0, 1) as the exact fraction of its shortest decimal form.

    ``Fraction(0.3)`` is 0.299999999999999988...; ``Fraction(repr(0.3))`` is 3/10, which is what a
    person writing ``0.3`` in a config file means.  Counts derived from rates (minimum survivors, the
    adversary's size) then come out as integers with no rounding surprise.

    Parameters
    ----------
    rate : float
        A dropout or adversary rate.
    name : str
        Name used in the error message.

    Returns
    -------
    Fraction
        The exact rate.

    Raises
    ------
    ConfigError
        If the rate is not a finite number in [0, 1).
    """
    r = float(rate)
    if not math.isfinite(r) or not (0.0 <= r < 1.0):
        raise ConfigError(f"{name} must be a finite number in [0, 1), got {rate!r}")
    return Fraction(repr(r))


def minimum_survivors(n: int, dropout_rate: float) -> int:
    """Return t_min = ceil((1 - omega) * n), the fewest survivors a round may finish with.

    Parameters
    ----------
    n : int
        Cohort size (devices that advertised keys), n >= 1.
    dropout_rate : float
        omega in [0, 1).

    Returns
    -------
    int
        t_min, computed in exact rational arithmetic (see `exact_rate`); at least 1.

    Raises
    ------
    ConfigError
        If ``n < 1`` or the rate is outside [0, 1).
    """
    if n < 1:
        raise ConfigError(f"cohort size n must be >= 1, got {n}")
    omega = exact_rate(dropout_rate, "dropout_rate")
    return max(1, math.ceil((1 - omega) * n))


def colluding_devices(n: int, adversary_rate: float) -> int:
    """Return f = floor(gamma * n), the devices of a cohort of ``n`` that may collude with the server and
    skip their noise; the noise is sized so that the other survivors alone carry mu (protocol 1.12).
    ConfigError as `minimum_survivors` (n < 1, a rate outside [0, 1))."""
    minimum_survivors(n, 0.0)  # the cohort check
    return math.floor(exact_rate(adversary_rate, "adversary_rate") * n)


def _honest_floor(t_min: int, colluders: int) -> int:
    """t_min - f, the fewest honest survivors a round may finish with; ConfigError unless >= 1."""
    if colluders < 0 or t_min - colluders < 1:
        raise ConfigError(
            f"need 0 <= colluders < t_min for the noise to have honest survivors to rest on, "
            f"got t_min={t_min}, colluders={colluders}"
        )
    return t_min - colluders


def _keep_fraction(t_min: int, colluders: int, survivors: int) -> float:
    """(t_min - f) / (s - f): what a survivor keeps of its Skellam(mu / (t_min - f)), leaving mu / (s - f)."""
    return _honest_floor(t_min, colluders) / (survivors - colluders)


def device_variance(mu: float, n: int, dropout_rate: float, adversary_rate: float = 0.0) -> float:
    """Return the per-device Skellam variance mu / (t_min - f) (docs/design.md §5).

    Parameters
    ----------
    mu : float
        Aggregate variance the accountant requires, in quantized units.
    n : int
        Cohort size.
    dropout_rate : float
        omega in [0, 1).
    adversary_rate : float
        gamma in [0, 1): f = floor(gamma * n) survivors may add no noise.

    Returns
    -------
    float
        Per-device variance, so the honest devices of any t_min survivors together carry variance >= mu.

    Raises
    ------
    ConfigError
        If mu is negative or not finite, or n / omega / gamma are invalid.
    """
    m = _check_variance(mu)
    t_min = minimum_survivors(n, dropout_rate)
    return m / _honest_floor(t_min, colluding_devices(n, adversary_rate))


def correction_keep_fraction(n: int, dropout_rate: float, survivors: int, adversary_rate: float = 0.0) -> float:
    """Return the binomial-thinning keep fraction (t_min - f) / (s - f) for s announced survivors.

    Each survivor holds Skellam(mu / (t_min - f)); keeping the fraction (t_min - f) / (s - f) leaves
    Skellam(mu / (s - f)), so any s - f of the s survivors together keep mu.

    Parameters
    ----------
    n : int
        Cohort size.
    dropout_rate : float
        omega in [0, 1).
    survivors : int
        s = |U3|, the number of devices whose masked input the server holds.
    adversary_rate : float
        gamma in [0, 1).

    Returns
    -------
    float
        (t_min - f) / (s - f) in (0, 1].

    Raises
    ------
    NotEnoughParticipants
        If s < t_min: the noise cannot cover the DP guarantee and the round must abort unrevealed.
    ValueError
        If s > n.
    """
    t_min = minimum_survivors(n, dropout_rate)
    f = colluding_devices(n, adversary_rate)
    if survivors > n:
        raise ValueError(f"survivors ({survivors}) cannot exceed the cohort size n={n}")
    if survivors < t_min:
        raise NotEnoughParticipants(
            f"{survivors} survivors is below t_min={t_min} (n={n}, dropout_rate={dropout_rate}); "
            "the noise would be too small, so the round must abort"
        )
    return _keep_fraction(t_min, f, survivors)


def device_noise(mu: float, t_min: int, length: int, rng: NoiseStream, *, colluders: int) -> SkellamDraw:
    """The noise one device adds to its masked input: Skellam(mu / (t_min - colluders)) on each of
    ``length`` coordinates (docs/design.md §5).  The device session and the private-round simulator
    (`fedsim.private.simulator`) both draw it here, so they follow one sampler.

    Raises
    ------
    ConfigError
        If ``t_min < 1``, ``colluders`` is not in [0, t_min), or mu is negative or not finite.
    """
    if t_min < 1:
        raise ConfigError(f"t_min must be >= 1 when noise is added, got {t_min}")
    return sample_skellam(_check_variance(mu) / _honest_floor(t_min, colluders), length, rng)


def correct_noise(
    draw: SkellamDraw, t_min: int, n_survivors: int, rng: NoiseStream, *, colluders: int
) -> tuple[SkellamDraw, NDArray[np.int64]]:
    """A survivor's correction once the server announced ``n_survivors``: thin ``draw`` with keep
    fraction (t_min - f) / (s - f); returns (kept noise, revealed excess), independent of each other.

    Raises
    ------
    ValueError
        If ``n_survivors < t_min``, ``t_min < 1`` or ``colluders`` is not in [0, t_min) (the caller must
        refuse the round instead).
    """
    if t_min < 1 or n_survivors < t_min or not 0 <= colluders < t_min:
        raise ValueError(f"need n_survivors={n_survivors} >= t_min={t_min} > colluders={colluders} >= 0")
    return thin(draw, _keep_fraction(t_min, colluders, n_survivors), rng)


def released_variance(mu: float, t_min: int, survivors: int, corrected: int, *, colluders: int) -> float:
    """Per-coordinate variance of the noise left in a released sum when every survivor adds its noise:
    ``corrected`` survivors keep Skellam(mu / (s - f)) each and the other ``survivors - corrected`` keep
    their Skellam(mu / (t_min - f)).

    Skellam laws add, so the released noise is Skellam of exactly this variance (at least
    s / (s - f) * mu, and at least mu from any s - f survivors); the simulator draws it in one piece at
    scale.
    """
    if not 1 <= t_min <= survivors or not 0 <= corrected <= survivors or not 0 <= colluders < t_min:
        raise ValueError(
            f"need 0 <= colluders={colluders} < t_min={t_min} <= survivors={survivors}, "
            f"0 <= corrected={corrected} <= survivors"
        )
    m = _check_variance(mu)
    return corrected * m / (survivors - colluders) + (survivors - corrected) * m / (t_min - colluders)
