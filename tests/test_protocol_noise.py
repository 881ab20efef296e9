"""Skellam noise, binomial thinning and the corrected two-round DP scheme (docs/design.md §5)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from protocol.errors import ConfigError, NotEnoughParticipants
from protocol.noise import (
    SkellamDraw,
    StoredSkellam,
    colluding_devices,
    correct_noise,
    correction_keep_fraction,
    device_noise,
    device_variance,
    minimum_survivors,
    released_variance,
    sample_skellam,
    thin,
    to_ring,
)
from protocol.samplers import NoiseStream, insecure_test_noise_stream

N, OMEGA, MU = 100, 0.3, 400.0
TRIALS = 20_000  # relative std. error of a variance estimate ~ sqrt(2 / TRIALS) = 1%


def test_minimum_survivors_exact_rounding() -> None:
    assert minimum_survivors(100, 0.3) == 70
    assert minimum_survivors(10, 0.7) == 3  # float: (1 - 0.7) * 10 = 3.0000000000000004
    assert minimum_survivors(1000, 0.33) == 670
    assert minimum_survivors(3, 0.5) == 2
    assert minimum_survivors(7, 0.0) == 7
    for bad in (1.0, -0.01, math.nan):
        with pytest.raises(ConfigError, match="dropout_rate"):
            minimum_survivors(100, bad)
    with pytest.raises(ConfigError):
        minimum_survivors(0, 0.3)


def test_device_variance_and_keep_fraction() -> None:
    assert device_variance(MU, N, OMEGA) == pytest.approx(MU / 70)
    assert correction_keep_fraction(N, OMEGA, 70) == 1.0
    assert correction_keep_fraction(N, OMEGA, 100) == pytest.approx(0.7)
    with pytest.raises(NotEnoughParticipants, match="t_min=70"):
        correction_keep_fraction(N, OMEGA, 69)
    with pytest.raises(ValueError, match="exceed"):
        correction_keep_fraction(N, OMEGA, 101)
    with pytest.raises(ConfigError):
        device_variance(-1.0, N, OMEGA)


def test_the_noise_is_sized_for_the_honest_survivors() -> None:
    # Protocol 1.12: f = ⌊γ n⌋ colluders may add nothing, so each device adds μ/(t_min − f), keeps μ/(s − f).
    assert colluding_devices(100, 0.05) == 5
    assert colluding_devices(20, 0.05) == 1 and colluding_devices(19, 0.05) == 0  # exact, not 0.05 * 20 in floats
    assert colluding_devices(70_679, 0.05) == 3533
    assert device_variance(MU, N, OMEGA, 0.05) == pytest.approx(MU / 65)
    assert correction_keep_fraction(N, OMEGA, 70, 0.05) == 1.0
    assert correction_keep_fraction(N, OMEGA, 100, 0.05) == pytest.approx(65 / 95)
    # Every survivor corrects: s·μ/(s − f); any s − f of them keep μ.
    assert released_variance(MU, 70, 100, 100, colluders=5) == pytest.approx(MU * 100 / 95)
    assert released_variance(MU, 70, 100, 100, colluders=0) == pytest.approx(MU)
    for bad in (1.0, -0.01, math.nan):
        with pytest.raises(ConfigError, match="adversary_rate"):
            colluding_devices(100, bad)
    with pytest.raises(ConfigError):
        colluding_devices(0, 0.05)
    rng = insecure_test_noise_stream(1)
    with pytest.raises(ConfigError, match="colluders"):
        device_noise(MU, 70, 4, rng, colluders=70)  # no honest survivor left to carry the noise
    with pytest.raises(ValueError, match="colluders"):
        correct_noise(device_noise(MU, 70, 4, rng, colluders=5), 70, 80, rng, colluders=70)
    with pytest.raises(ValueError, match="colluders"):
        released_variance(MU, 70, 100, 100, colluders=-1)


def test_skellam_moments_and_types() -> None:
    rng = insecure_test_noise_stream(0)
    d = sample_skellam(50.0, 200_000, rng)
    assert d.pos.dtype == np.int64 and d.neg.dtype == np.int64
    v = d.value()
    assert abs(v.mean()) < 5 * math.sqrt(50 / v.size)
    assert v.var() == pytest.approx(50.0, rel=0.02)
    assert sample_skellam(0.0, 5, rng).value().tolist() == [0] * 5
    with pytest.raises(ConfigError):
        sample_skellam(math.inf, 5, rng)
    with pytest.raises(ValueError):
        SkellamDraw(pos=np.zeros(2, np.int64), neg=np.zeros(3, np.int64))


def test_thinning_marginals_and_independence() -> None:
    rng = insecure_test_noise_stream(1)
    d = sample_skellam(30.0, 200_000, rng)
    kept, excess = thin(d, 0.25, rng)
    assert np.array_equal(kept.value() + excess, d.value())
    assert np.all(kept.pos <= d.pos) and np.all(kept.neg <= d.neg)
    assert kept.value().var() == pytest.approx(7.5, rel=0.03)
    assert excess.var() == pytest.approx(22.5, rel=0.03)
    assert abs(np.corrcoef(kept.value(), excess)[0, 1]) < 0.01
    # independence beyond correlation: the halves are independent Poissons
    assert abs(np.corrcoef(kept.pos, d.pos - kept.pos)[0, 1]) < 0.01
    assert abs(np.corrcoef(kept.value() ** 2, excess**2)[0, 1]) < 0.01
    with pytest.raises(ValueError):
        thin(d, 1.5, rng)


def test_to_ring_twos_complement() -> None:
    v = np.array([0, 1, -1, 2**31 - 1, -(2**31), 2**32 + 5], dtype=np.int64)
    r = to_ring(v)
    assert r.dtype == np.uint32
    assert r.tolist() == [0, 1, 2**32 - 1, 2**31 - 1, 2**31, 5]
    assert np.array_equal(r.view(np.int32)[:5], v[:5])


def _best_combination_variance(pre: np.ndarray, post: np.ndarray) -> float:
    """Variance of the minimum-variance unbiased combination a*pre + (1-a)*post (empirical covariance).

    Both views are X + noise, so any a gives an unbiased estimate of X; the optimum is
    a* = (C22 - C12) / (C11 + C22 - 2 C12) with variance (C11 C22 - C12^2) / (C11 + C22 - 2 C12).
    """
    c = np.cov(np.stack([pre, post]).astype(np.float64))
    denom = c[0, 0] + c[1, 1] - 2 * c[0, 1]
    if denom <= 1e-9 * c[1, 1]:  # the two views coincide (s = t_min: nothing removed)
        return float(c[1, 1])
    return float((c[0, 0] * c[1, 1] - c[0, 1] ** 2) / denom)


def _simulate_correction(s: int, rng: NoiseStream) -> tuple[np.ndarray, np.ndarray]:
    """Noise in the server's pre- and post-correction sums over TRIALS rounds with s survivors."""
    draw = sample_skellam(device_variance(MU, N, OMEGA), TRIALS * s, rng)
    kept, _excess = thin(draw, correction_keep_fraction(N, OMEGA, s), rng)
    pre = draw.value().reshape(TRIALS, s).sum(axis=1)
    post = kept.value().reshape(TRIALS, s).sum(axis=1)
    return pre, post


@pytest.mark.parametrize("s", [70, 85, 100])
def test_corrected_scheme_keeps_variance_mu(s: int) -> None:
    pre, post = _simulate_correction(s, insecure_test_noise_stream(1000 + s))
    # before the correction the noise is s/t_min times larger than needed ...
    assert pre.var() == pytest.approx(MU * s / 70, rel=0.05)
    # ... after it, exactly mu ...
    assert post.var() == pytest.approx(MU, rel=0.05)
    # ... and the server, which sees both sums, cannot do better than mu: the exact optimum is mu
    # (pre = post + E with E independent of post, so a*pre + (1-a)*post has variance mu + a^2 Var(E)).
    best = _best_combination_variance(pre, post)
    assert best >= 0.95 * MU
    assert best == pytest.approx(MU, rel=0.05)


@pytest.mark.parametrize("s", [70, 85, 100])
def test_naive_replacement_correction_leaks(s: int) -> None:
    # FMF paper §6: "send -xi + xi'" with fresh xi' ~ Sk(mu/s).  The two sums the server sees have
    # independent noise of variances s*mu/t_min and mu; combined, mu * s / (s + t_min) < mu.
    rng = insecure_test_noise_stream(2000 + s)
    draw = sample_skellam(device_variance(MU, N, OMEGA), TRIALS * s, rng)
    fresh = sample_skellam(MU / s, TRIALS * s, rng)
    pre = draw.value().reshape(TRIALS, s).sum(axis=1)
    post = fresh.value().reshape(TRIALS, s).sum(axis=1)
    assert post.var() == pytest.approx(MU, rel=0.05)  # looks fine on its own ...
    best = _best_combination_variance(pre, post)
    assert best < 0.95 * MU  # ... but the combination falls short
    assert best == pytest.approx(MU * s / (s + 70), rel=0.05)


def test_device_dropping_before_correction_keeps_more_noise() -> None:
    # survivors that never send their correction keep Skellam(mu/t_min) > Skellam(mu/s): safe side
    rng = insecure_test_noise_stream(3)
    s, silent = 100, 10
    draw = sample_skellam(device_variance(MU, N, OMEGA), TRIALS * s, rng)
    kept, _ = thin(draw, correction_keep_fraction(N, OMEGA, s), rng)
    values = kept.value().reshape(TRIALS, s)
    values[:, :silent] = draw.value().reshape(TRIALS, s)[:, :silent]
    assert values.sum(axis=1).var() >= 0.95 * MU


@pytest.mark.parametrize(
    ("variance", "dtype"), [(0.0, np.uint8), (40.0, np.uint8), (4e5, np.uint16), (4e12, np.uint32)]
)
def test_stored_skellam_is_exact_and_narrow(variance: float, dtype: type) -> None:
    draw = sample_skellam(variance, 5_000, insecure_test_noise_stream(7))
    stored = StoredSkellam.of(draw)
    assert stored.pos.dtype == dtype and stored.neg.dtype == dtype
    back = stored.draw()
    assert back.pos.dtype == np.int64 and back.neg.dtype == np.int64
    np.testing.assert_array_equal(back.pos, draw.pos)
    np.testing.assert_array_equal(back.neg, draw.neg)
    assert stored.draw().pos is not back.pos  # fresh arrays every time


def test_stored_skellam_rejects_negative_counts() -> None:
    bad = SkellamDraw(np.array([1, -1], dtype=np.int64), np.zeros(2, dtype=np.int64))
    with pytest.raises(ValueError, match="non-negative"):
        StoredSkellam.of(bad)


def test_a_survivor_keeps_the_honest_floors_fraction_exactly() -> None:
    # The keep fraction is (t_min − f)/(s − f), drawn from the survivor's stream: bit for bit what `thin` keeps
    # at that fraction, and not what the 1.11 fraction t_min/s keeps.
    draw = device_noise(MU, 70, 2000, insecure_test_noise_stream(2), colluders=5)
    assert draw.value().var() == pytest.approx(MU / 65, rel=0.1)
    kept, excess = correct_noise(draw, 70, 90, insecure_test_noise_stream(3), colluders=5)
    want_kept, want_excess = thin(draw, 65 / 85, insecure_test_noise_stream(3))
    assert np.array_equal(kept.value(), want_kept.value()) and np.array_equal(excess, want_excess)
    old, _ = thin(draw, 70 / 90, insecure_test_noise_stream(3))
    assert not np.array_equal(kept.value(), old.value())
    assert correction_keep_fraction(100, 0.3, 90, 0.05) == pytest.approx(65 / 85)
