"""The DP samplers over a ChaCha20 keystream: exact distributions, a frozen word order, no numpy generator."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from scipy import stats

from protocol.device_session import DeviceSecAggSession
from protocol.errors import CryptoError
from protocol.noise import sample_skellam, thin
from protocol.samplers import NoiseStream, binomial, insecure_test_noise_stream, log_factorial, poisson

from .secagg_helpers import sample_messages


def _fits(draws: np.ndarray, pmf: np.ndarray) -> float:
    """Chi-square p-value of integer draws against a pmf on 0..len(pmf)-1, bins pooled to >= 20 expected."""
    n = draws.size
    observed = np.bincount(draws, minlength=pmf.size)[: pmf.size].astype(np.float64)
    observed[-1] += np.sum(draws >= pmf.size)
    expected = pmf * n
    expected[-1] += n - expected.sum()
    obs_bins, exp_bins, o, e = [], [], 0.0, 0.0
    for ob, ex in zip(observed, expected, strict=True):
        o, e = o + ob, e + ex
        if e >= 20:
            obs_bins.append(o)
            exp_bins.append(e)
            o = e = 0.0
    obs_bins[-1] += o
    exp_bins[-1] += e
    return float(stats.chisquare(obs_bins, exp_bins).pvalue)


@pytest.mark.parametrize("lam", [0.2, 4.0, 9.99, 10.0, 37.5, 2_500.0, 4.0e6])
def test_poisson_matches_the_exact_law(lam: float) -> None:
    draws = poisson(lam, 200_000, insecure_test_noise_stream(1, int(lam * 100)))
    assert draws.dtype == np.int64 and draws.min() >= 0
    ks = np.arange(int(lam + 12 * np.sqrt(lam) + 20))
    lo = max(0, int(lam - 12 * np.sqrt(lam)))
    pmf = stats.poisson.pmf(ks, lam)
    pmf[lo] += stats.poisson.cdf(lo - 1, lam) if lo else 0.0
    assert _fits(draws, pmf) > 1e-4


@pytest.mark.parametrize(("n", "p"), [(7, 0.3), (25, 0.35), (40, 0.6), (1_000, 0.5), (200_000, 0.97), (10**6, 0.01)])
def test_binomial_matches_the_exact_law(n: int, p: float) -> None:
    draws = binomial(np.full(100_000, n, dtype=np.int64), p, insecure_test_noise_stream(2, n))
    assert draws.min() >= 0 and draws.max() <= n
    pmf = stats.binom.pmf(np.arange(n + 1), n, p)
    assert _fits(draws, pmf) > 1e-4


def test_binomial_with_mixed_counts_and_edge_probabilities() -> None:
    s = insecure_test_noise_stream(3)
    n = np.array([0, 1, 5, 30, 10**4, 10**7, 3], dtype=np.int64)
    assert binomial(n, 0.0, s).tolist() == [0] * 7
    assert binomial(n, 1.0, s).tolist() == n.tolist()
    k = binomial(np.tile(n, 20_000), 0.4, s).reshape(20_000, 7)
    assert np.all(k >= 0) and np.all(k <= n)
    assert np.allclose(k.mean(axis=0)[1:], 0.4 * n[1:], rtol=0.02)
    with pytest.raises(ValueError):
        binomial(n, 1.5, s)
    with pytest.raises(ValueError):
        binomial(np.array([-1]), 0.5, s)


def test_log_factorial_is_exact_to_rounding() -> None:
    from math import lgamma

    k = np.array([0, 1, 2, 10, 255, 256, 257, 1000, 123_456, 10**9], dtype=np.float64)
    expected = np.array([lgamma(x + 1) for x in k])
    assert np.allclose(log_factorial(k), expected, rtol=1e-14, atol=1e-12)


def test_word_order_is_frozen() -> None:
    # The simulator and the device must draw bit-identical noise from one key: any change in how the
    # samplers consume the keystream changes this digest and must be a deliberate, documented change.
    s = insecure_test_noise_stream(7)
    out = [
        poisson(3.0, 1000, s),
        poisson(5e4, 1000, s),
        binomial(np.arange(1000), 0.3, s),
        binomial(np.full(1000, 10**5), 0.99, s),
    ]
    digest = hashlib.sha256(b"".join(o.astype("<i8").tobytes() for o in out)).hexdigest()
    assert digest == "4f6148912d6f984935fb8496228b69ad183a1c234c78909879c7c795ce4a81cb"


def test_noise_needs_a_keystream_never_a_numpy_generator() -> None:
    numpy_rng = np.random.default_rng(0)
    with pytest.raises(TypeError, match="NoiseStream"):
        poisson(3.0, 5, numpy_rng)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="NoiseStream"):
        sample_skellam(3.0, 5, numpy_rng)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="NoiseStream"):
        DeviceSecAggSession(sample_messages()[0], rng=numpy_rng)  # type: ignore[arg-type]
    draw = sample_skellam(3.0, 5, insecure_test_noise_stream(0))
    with pytest.raises(TypeError, match="NoiseStream"):
        thin(draw, 0.5, numpy_rng)  # type: ignore[arg-type]


def test_streams_from_the_os_differ_and_test_streams_are_keyed_by_their_context() -> None:
    assert not np.array_equal(NoiseStream.from_os().uint64(4), NoiseStream.from_os().uint64(4))
    assert np.array_equal(insecure_test_noise_stream(5, 1, 2).uint64(4), insecure_test_noise_stream(5, 1, 2).uint64(4))
    assert not np.array_equal(
        insecure_test_noise_stream(5, 1, 2).uint64(4), insecure_test_noise_stream(5, 2, 1).uint64(4)
    )
    u = NoiseStream.from_os().uniform(100_000)
    assert 0.0 < u.min() and u.max() < 1.0 and abs(u.mean() - 0.5) < 0.01
    with pytest.raises(CryptoError):
        NoiseStream(b"short")
    with pytest.raises(ValueError):
        insecure_test_noise_stream(-1)


def test_a_device_session_keys_its_noise_from_the_os_by_default() -> None:
    invite = sample_messages()[0]
    a, b = DeviceSecAggSession(invite), DeviceSecAggSession(invite)
    assert not np.array_equal(a._rng.uint64(2), b._rng.uint64(2))
