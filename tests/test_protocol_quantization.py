"""Quantization: clipping, unbiased stochastic rounding, ring round-trip, bit budget, sensitivity."""

from __future__ import annotations

import math

import numpy as np
import pytest

from protocol.errors import ConfigError
from protocol.quantization import (
    QuantizationConfig,
    check_bit_budget,
    clip_l2,
    dequantize_sum,
    quantize,
    sensitivity,
    stochastic_round,
)
from protocol.samplers import NoiseStream, insecure_test_noise_stream


def test_config_validation() -> None:
    QuantizationConfig(clip_norm=1.0, scale_bits=0)
    QuantizationConfig(clip_norm=0.5, scale_bits=30)
    for kwargs, match in [
        ({"clip_norm": 0.0, "scale_bits": 10}, "clip_norm"),
        ({"clip_norm": -1.0, "scale_bits": 10}, "clip_norm"),
        ({"clip_norm": math.inf, "scale_bits": 10}, "clip_norm"),
        ({"clip_norm": math.nan, "scale_bits": 10}, "clip_norm"),
        ({"clip_norm": 1.0, "scale_bits": -1}, "scale_bits"),
        ({"clip_norm": 1.0, "scale_bits": 31}, "scale_bits"),
        ({"clip_norm": 1.0, "scale_bits": 10, "ring_bits": 64}, "ring_bits"),
        ({"clip_norm": 4.0, "scale_bits": 30}, "does not fit"),
    ]:
        with pytest.raises(ConfigError, match=match):
            QuantizationConfig(**kwargs)  # type: ignore[arg-type]


def test_clip_l2_norm_and_flag() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        x = rng.normal(size=37) * rng.uniform(0.01, 100)
        y, clipped = clip_l2(x, 1.0)
        assert np.linalg.norm(y) <= 1.0
        assert clipped == (np.linalg.norm(x) > 1.0)
        if clipped:
            assert np.linalg.norm(y) == pytest.approx(1.0, rel=1e-12)
            assert np.allclose(y * np.linalg.norm(x), x)  # direction kept
        else:
            assert np.array_equal(y, x)


def test_non_finite_input_refused() -> None:
    cfg = QuantizationConfig(clip_norm=1.0, scale_bits=10)
    for bad in (np.array([0.0, np.nan]), np.array([np.inf, 1.0])):
        with pytest.raises(ValueError, match="non-finite"):
            quantize(bad, cfg, insecure_test_noise_stream(0))
        with pytest.raises(ValueError, match="non-finite"):
            clip_l2(bad, 1.0)


def test_clipped_value_count_and_stats() -> None:
    cfg = QuantizationConfig(clip_norm=1.0, scale_bits=8)
    rng = insecure_test_noise_stream(1)
    x = np.array([3.0, 0.0, -4.0, 0.0, 0.0])
    _, stats = quantize(x, cfg, rng)
    assert stats.norm_before == pytest.approx(5.0)
    assert stats.clipped is True
    assert stats.clipped_values == 2  # zeros are unchanged by scaling
    _, stats = quantize(x / 10, cfg, rng)
    assert (stats.clipped, stats.clipped_values) == (False, 0)


def test_stochastic_rounding_is_unbiased() -> None:
    cfg = QuantizationConfig(clip_norm=10.0, scale_bits=2)
    x = np.array([0.1, -0.3, 0.6, -1.37, 0.0, 2.125, -0.01])  # norm < C: no clipping
    rng = insecure_test_noise_stream(2)
    draws = 20_000
    q = np.stack([quantize(x, cfg, rng)[0] for _ in range(draws)])
    ints = q.view(np.int32).astype(np.float64)
    target = x * 4
    # each coordinate takes floor or ceil of the target only
    assert np.all((ints == np.floor(target)) | (ints == np.ceil(target)))
    frac = target - np.floor(target)
    stderr = np.sqrt(frac * (1 - frac) / draws) + 1e-12
    assert np.all(np.abs(ints.mean(axis=0) - target) <= 5 * stderr)


def test_sum_round_trip_including_negatives() -> None:
    cfg = QuantizationConfig(clip_norm=1.0, scale_bits=16)
    rng = np.random.default_rng(3)
    n, dim = 50, 64
    updates = rng.normal(size=(n, dim)) * 0.1 - 0.05  # mostly negative sums
    coins = insecure_test_noise_stream(3)
    total = np.zeros(dim, dtype=np.uint32)
    int_sum = np.zeros(dim, dtype=np.int64)
    for u in updates:
        q, _ = quantize(u, cfg, coins)
        total += q  # uint32 wrap-around is the ring addition
        int_sum += q.view(np.int32)
    decoded = dequantize_sum(total, cfg)
    assert np.array_equal(decoded, int_sum / 2**16)
    assert np.any(decoded < 0)
    clipped = np.stack([clip_l2(u, 1.0)[0] for u in updates]).sum(axis=0)
    assert np.max(np.abs(decoded - clipped)) <= n / 2**16  # rounding error < 1 unit per device


def test_dequantize_requires_uint32() -> None:
    cfg = QuantizationConfig(clip_norm=1.0, scale_bits=4)
    with pytest.raises(ValueError, match="uint32"):
        dequantize_sum(np.array([1, 2], dtype=np.int64), cfg)
    assert dequantize_sum(np.array([2**32 - 16], dtype=np.uint32), cfg)[0] == -1.0


def test_bit_budget_boundary() -> None:
    cfg = QuantizationConfig(clip_norm=1.0, scale_bits=20)  # each device sends |q_i| <= 2^20
    check_bit_budget(2047, cfg, 1000, 0.0)  # 2047 * 2^20 < 2^31
    with pytest.raises(ConfigError, match=r"n_max=2048 .* >= 2\^31"):
        check_bit_budget(2048, cfg, 1000, 0.0)  # exactly 2^31: would wrap
    # noise head-room: 8 sigma of the noise must fit in what the data leaves free
    free = 2**31 - 2047 * 2**20  # = 2^20
    sigma_ok = (free - 1) / 8
    check_bit_budget(2047, cfg, 1000, sigma_ok**2)
    with pytest.raises(ConfigError, match="noise head-room"):
        check_bit_budget(2047, cfg, 1000, (free / 8) ** 2)


def test_bit_budget_counts_rounding() -> None:
    # 2^s * C = 1000.5 rounds up to 1001 per device; 2^31 // 1001 devices fit, one more does not
    cfg = QuantizationConfig(clip_norm=1000.5, scale_bits=0)
    fit = (2**31 - 1) // 1001
    check_bit_budget(fit, cfg, 10, 0.0)
    with pytest.raises(ConfigError):
        check_bit_budget(fit + 1, cfg, 10, 0.0)


def test_bit_budget_argument_validation() -> None:
    cfg = QuantizationConfig(clip_norm=1.0, scale_bits=10)
    for args in ((0, cfg, 10, 0.0), (10, cfg, 0, 0.0), (10, cfg, 10, -1.0), (10, cfg, 10, math.nan)):
        with pytest.raises(ConfigError):
            check_bit_budget(*args)


def test_sensitivity_bounds_actual_quantized_norms() -> None:
    cfg = QuantizationConfig(clip_norm=2.0, scale_bits=6)
    dim = 100
    l2, l1 = sensitivity(cfg, dim)
    assert l2 == pytest.approx(2.0 * 64 + 10.0)
    assert l1 == pytest.approx(10.0 * 2.0 * 64 + 100)
    rng = np.random.default_rng(4)
    coins = insecure_test_noise_stream(4)
    for _ in range(200):
        x = rng.normal(size=dim) * 5
        q = quantize(x, cfg, coins)[0].view(np.int32).astype(np.float64)
        assert np.linalg.norm(q) <= l2
        assert np.abs(q).sum() <= l1
    with pytest.raises(ConfigError):
        sensitivity(cfg, 0)


def test_rounding_coins_come_from_the_keystream_and_a_numpy_generator_is_refused() -> None:
    # The rounding residue enters the sum the server sees, so its coins come from the
    # device's ChaCha20 stream: one word per element, in order, and nothing else is accepted.
    cfg = QuantizationConfig(clip_norm=100.0, scale_bits=3)
    x = np.linspace(-2.0, 2.0, 257)
    q, _ = quantize(x, cfg, insecure_test_noise_stream(9, 1))
    twin = insecure_test_noise_stream(9, 1)
    scaled = x * 8
    expected = np.floor(scaled) + (twin.uniform(x.size) < scaled - np.floor(scaled))
    assert np.array_equal(q.view(np.int32), expected.astype(np.int32))
    stream = insecure_test_noise_stream(9, 1)
    stochastic_round(scaled.reshape(1, -1), stream)
    assert stream.words_read == x.size
    for bad in (np.random.default_rng(0), np.random.RandomState(0), None):
        with pytest.raises(TypeError, match="NoiseStream"):
            quantize(x, cfg, bad)  # type: ignore[arg-type]
    # two different secret streams give different roundings of the same update (the server cannot
    # predict the residue from anything it sees)
    a, _ = quantize(x, cfg, NoiseStream.from_os())
    b, _ = quantize(x, cfg, NoiseStream.from_os())
    assert not np.array_equal(a, b)
