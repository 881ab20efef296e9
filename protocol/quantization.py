"""Fixed-point encoding of device updates into the ring Z_{2^32} (docs/design.md §4, with its quantization pitfalls).

Invariants of this module:

* `quantize` clips in L2 to C first, so every encoded vector q satisfies
  ||q||_2 <= 2^s * C + sqrt(L) and |q_i| <= ceil(2^s * C) (the DP sensitivity relies on this).
* Stochastic rounding is unbiased: E[q_i] = 2^s * x_i for the clipped x.
* Ring elements are uint32 holding two's complement; `dequantize_sum` reads them back as int32,
  which is exact only while the true integer sum stays inside [-2^31, 2^31); `check_bit_budget` is the
  guard that refuses configurations where it might not.
* Non-finite inputs are refused (`ValueError`), never silently clipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from protocol.errors import ConfigError
from protocol.samplers import NoiseStream

__all__ = [
    "DEFAULT_SCALE_BITS",
    "MAX_SCALE_BITS",
    "QuantizationConfig",
    "QuantizationStats",
    "clip_l2",
    "quantize",
    "stochastic_round",
    "dequantize_sum",
    "check_bit_budget",
    "sensitivity",
]

_SIGNED_LIMIT = 2**31  # |sum| must stay strictly below this to be read back as int32
MAX_SCALE_BITS = 30
"""Largest fixed-point scale s (values times 2**s must leave head-room in the 32-bit ring)."""
DEFAULT_SCALE_BITS = 10
"""The quantization scale s a server uses unless configured (`rounds.scale_bits`); the one default."""


@dataclass(frozen=True, slots=True)
class QuantizationConfig:
    """How a float update becomes ring elements.

    Attributes
    ----------
    clip_norm : float
        C > 0: updates are clipped to L2 norm C (float units).
    scale_bits : int
        s in [0, 30]: values are scaled by 2^s before stochastic rounding.
    ring_bits : int
        log2 of the ring size; only 32 is supported.
    """

    clip_norm: float
    scale_bits: int
    ring_bits: int = 32

    def __post_init__(self) -> None:
        if isinstance(self.clip_norm, bool) or not isinstance(self.clip_norm, int | float | np.floating):
            raise ConfigError(f"clip_norm must be a number, got {self.clip_norm!r}")
        if not math.isfinite(self.clip_norm) or self.clip_norm <= 0:
            raise ConfigError(f"clip_norm must be finite and > 0, got {self.clip_norm!r}")
        if isinstance(self.scale_bits, bool) or not isinstance(self.scale_bits, int | np.integer):
            raise ConfigError(f"scale_bits must be an integer, got {self.scale_bits!r}")
        if not 0 <= self.scale_bits <= MAX_SCALE_BITS:
            raise ConfigError(f"scale_bits must be in [0, {MAX_SCALE_BITS}], got {self.scale_bits}")
        if self.ring_bits != 32:
            raise ConfigError(f"ring_bits must be 32 (the only supported ring), got {self.ring_bits!r}")
        if self.max_abs_value >= _SIGNED_LIMIT:
            raise ConfigError(
                f"clip_norm={self.clip_norm} with scale_bits={self.scale_bits} gives coordinates up to "
                f"{self.max_abs_value:.6g}, which does not fit a signed 32-bit ring element "
                "even for one device"
            )

    @property
    def scale(self) -> float:
        """The fixed-point scale 2^s."""
        return float(2**self.scale_bits)

    @property
    def max_abs_value(self) -> float:
        """Largest |q_i| one device can send: 2^s * C rounded up (stochastic rounding adds < 1)."""
        return math.ceil(self.scale * self.clip_norm)


@dataclass(frozen=True, slots=True)
class QuantizationStats:
    """What quantization did to one update (for metrics; contains no update values).

    Attributes
    ----------
    norm_before : float
        L2 norm of the input, before clipping (float units).
    clipped : bool
        Whether the update was scaled down to norm C.
    clipped_values : int
        Number of coordinates changed by clipping (the non-zero ones when clipped, else 0).
    """

    norm_before: float
    clipped: bool
    clipped_values: int


def _as_finite_float64(x: NDArray[np.floating] | NDArray[np.integer]) -> NDArray[np.float64]:
    arr = np.asarray(x)
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"update must be a real numeric array, got dtype {arr.dtype}")
    out = arr.astype(np.float64)
    if not np.all(np.isfinite(out)):
        bad = int(np.count_nonzero(~np.isfinite(out)))
        raise ValueError(f"update contains {bad} non-finite value(s) (NaN or inf); refusing to quantize")
    return out


def clip_l2(x: NDArray[np.floating] | NDArray[np.integer], clip_norm: float) -> tuple[NDArray[np.float64], bool]:
    """Scale ``x`` down to L2 norm ``clip_norm`` if it is longer.

    Parameters
    ----------
    x : NDArray
        The update (any shape).
    clip_norm : float
        C > 0.

    Returns
    -------
    clipped : NDArray[np.float64]
        A new array with ||clipped||_2 <= C (guaranteed in floating point, not just mathematically).
    was_clipped : bool
        Whether scaling happened.

    Raises
    ------
    ValueError
        If ``x`` has a non-finite value or C is not finite and positive.
    """
    if not math.isfinite(clip_norm) or clip_norm <= 0:
        raise ValueError(f"clip_norm must be finite and > 0, got {clip_norm!r}")
    y = _as_finite_float64(x)
    norm = float(np.linalg.norm(y))
    if norm <= clip_norm:
        return y.copy(), False
    factor = clip_norm / norm
    y = y * factor
    # Rounding can leave the norm an ulp above C; shrink until the guarantee holds exactly.
    while float(np.linalg.norm(y)) > clip_norm:
        factor = math.nextafter(factor, 0.0)
        y = _as_finite_float64(x) * factor
    return y, True


def quantize(
    x: NDArray[np.floating], cfg: QuantizationConfig, coins: NoiseStream
) -> tuple[NDArray[np.uint32], QuantizationStats]:
    """Clip, scale and stochastically round an update into ring elements.

    q_i = floor(2^s x_i) + Bernoulli(frac(2^s x_i)), which is unbiased, then stored mod 2^32 as
    two's complement (pitfall 6 of the notes: stochastic, not deterministic, rounding).

    Parameters
    ----------
    x : NDArray[np.floating]
        The float update (any shape; the output has the same shape).
    cfg : QuantizationConfig
        Clip norm and scale.
    coins : NoiseStream
        Source of the rounding coins: the device's ChaCha20 keystream (`protocol.samplers.NoiseStream`),
        which the server cannot predict; a numpy generator is refused.

    Returns
    -------
    q : NDArray[np.uint32]
        The encoded update.
    stats : QuantizationStats
        Norm before clipping and how much clipping changed.

    Raises
    ------
    ValueError
        If ``x`` contains NaN or inf.
    TypeError
        ``coins`` is not a `NoiseStream`.
    """
    raw = _as_finite_float64(x)
    norm_before = float(np.linalg.norm(raw))
    clipped, was_clipped = clip_l2(raw, cfg.clip_norm)
    changed = int(np.count_nonzero(clipped != raw)) if was_clipped else 0
    ints = stochastic_round(clipped * cfg.scale, coins)
    ring = np.bitwise_and(ints, np.int64(0xFFFFFFFF)).astype(np.uint32)
    return ring, QuantizationStats(norm_before=norm_before, clipped=was_clipped, clipped_values=changed)


def stochastic_round(scaled: NDArray[np.float64], coins: NoiseStream) -> NDArray[np.int64]:
    """Unbiased stochastic rounding: floor(v) + Bernoulli(frac(v)), one uniform coin per element.

    An element that is already an integer (a zero coordinate in particular) comes out unchanged
    whatever its coin, which is why a sparse update can be rounded on its non-zero part alone
    (`fedsim.private.simulator` at scale) with the same law as the dense vector a device rounds.

    Parameters
    ----------
    scaled : NDArray[np.float64]
        Finite values already multiplied by 2^s.
    coins : NoiseStream
        Source of the coins: ``coins.uniform(scaled.size)``, one 64-bit keystream word per element in C
        order, drawn once (the rounding residue feeds the sum the server sees, so its coins must be as
        unpredictable to the server as the DP noise; a numpy generator is refused).

    Raises
    ------
    TypeError
        ``coins`` is not a `NoiseStream`.
    """
    if not isinstance(coins, NoiseStream):
        raise TypeError(
            f"stochastic rounding needs a protocol.samplers.NoiseStream (a cryptographic keystream), got "
            f"{type(coins).__name__}"
        )
    low = np.floor(scaled)
    up = coins.uniform(low.size).reshape(low.shape) < (scaled - low)
    return low.astype(np.int64) + up.astype(np.int64)


def dequantize_sum(total: NDArray[np.uint32], cfg: QuantizationConfig) -> NDArray[np.float64]:
    """Decode a ring sum back to floats: read as signed int32, divide by 2^s.

    Parameters
    ----------
    total : NDArray[np.uint32]
        Sum of quantized updates (plus noise) mod 2^32.
    cfg : QuantizationConfig
        The configuration used to quantize.

    Returns
    -------
    NDArray[np.float64]
        The decoded sum; exact if the integer sum stayed in [-2^31, 2^31) (see `check_bit_budget`).

    Raises
    ------
    ValueError
        If ``total`` is not a uint32 array.
    """
    arr = np.asarray(total)
    if arr.dtype != np.uint32:
        raise ValueError(f"dequantize_sum expects uint32 ring elements, got dtype {arr.dtype}")
    return arr.view(np.int32).astype(np.float64) / cfg.scale


def check_bit_budget(
    n_max: int,
    cfg: QuantizationConfig,
    dimension: int,
    noise_variance: float,
    *,
    tail_sigmas: float = 8.0,
) -> None:
    """Refuse a configuration whose secure sum could wrap around the signed 32-bit range.

    Worst case per coordinate: n_max devices each send |q_i| <= ceil(2^s * C) (the whole clipped norm on
    one coordinate, rounding up), plus noise head-room of ``tail_sigmas`` standard deviations of the total
    noise.  The bound must stay strictly below 2^31 (notes §9 pitfall 4: the budget depends on the number
    of summands).  Eight sigmas leave a per-coordinate Gaussian-tail wrap chance of about 1e-15, which the
    caller can union-bound over ``dimension`` coordinates; raise ``tail_sigmas`` for very long vectors.

    Parameters
    ----------
    n_max : int
        Largest number of devices whose updates are summed (the cohort size).
    cfg : QuantizationConfig
        Quantization in use.
    dimension : int
        Number of coordinates L (>= 1).
    noise_variance : float
        Largest total per-coordinate noise variance the sum can carry (quantized units), e.g.
        ``n_max * device_variance(mu, n_max, omega, gamma)`` before the correction.
    tail_sigmas : float
        Head-room in standard deviations of the noise.

    Raises
    ------
    ConfigError
        With the numbers, if n_max * ceil(2^s C) + tail_sigmas * sqrt(noise_variance) >= 2^31,
        or if an argument is invalid.
    """
    if isinstance(n_max, bool) or not isinstance(n_max, int | np.integer) or n_max < 1:
        raise ConfigError(f"n_max must be an integer >= 1, got {n_max!r}")
    if isinstance(dimension, bool) or not isinstance(dimension, int | np.integer) or dimension < 1:
        raise ConfigError(f"dimension must be an integer >= 1, got {dimension!r}")
    if not math.isfinite(noise_variance) or noise_variance < 0:
        raise ConfigError(f"noise_variance must be finite and >= 0, got {noise_variance!r}")
    if not math.isfinite(tail_sigmas) or tail_sigmas < 0:
        raise ConfigError(f"tail_sigmas must be finite and >= 0, got {tail_sigmas!r}")
    per_device = cfg.max_abs_value
    data_bound = int(n_max) * per_device
    headroom = tail_sigmas * math.sqrt(noise_variance)
    bound = data_bound + headroom
    if bound >= _SIGNED_LIMIT:
        raise ConfigError(
            f"the secure sum could wrap: n_max={n_max} devices x {per_device:.6g} (2^{cfg.scale_bits} x "
            f"clip_norm {cfg.clip_norm}, rounded up) = {data_bound:.6g}, plus noise head-room "
            f"{tail_sigmas} x sqrt({noise_variance:.6g}) = {headroom:.6g}, totals {bound:.6g} >= 2^31 = "
            f"{_SIGNED_LIMIT}; lower scale_bits, clip_norm, n_max or the noise"
        )


def sensitivity(cfg: QuantizationConfig, dimension: int) -> tuple[float, float]:
    """Return the (L2, L1) sensitivity of one device's quantized update, in quantized units.

    Adding or removing one device changes the sum by its own q.  After clipping ||2^s x||_2 <= 2^s C,
    and stochastic rounding moves each of the L coordinates by less than 1, so the rounding error r has
    ||r||_2 < sqrt(L) and ||r||_1 < L.  Hence (worst case, no conditional rounding):

    * Delta_2 = 2^s C + sqrt(L)                    (triangle inequality);
    * Delta_1 = sqrt(L) 2^s C + L                  (||v||_1 <= sqrt(L) ||v||_2 for the scaled part).

    These are for add/remove-one adjacency; replace-one doubles both.  Conditional randomized rounding
    (Kairouz et al. 2021) would give a tighter Delta_2 with high probability; not used here.

    Parameters
    ----------
    cfg : QuantizationConfig
        Quantization in use.
    dimension : int
        Number of coordinates L (>= 1).

    Returns
    -------
    tuple[float, float]
        (Delta_2, Delta_1).

    Raises
    ------
    ConfigError
        If ``dimension < 1``.
    """
    if isinstance(dimension, bool) or not isinstance(dimension, int | np.integer) or dimension < 1:
        raise ConfigError(f"dimension must be an integer >= 1, got {dimension!r}")
    root_l = math.sqrt(int(dimension))
    scaled_c = cfg.scale * cfg.clip_norm
    return scaled_c + root_l, root_l * scaled_c + int(dimension)
