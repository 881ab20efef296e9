"""Budget split, private counts, noise-aware aggregation and a small scaled run."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agg_server.strategy.lightfr import LightFRServerParams, LightFRServerStrategy
from fedsim.data.synthetic import synthetic
from fedsim.private.scaled_lightfr import (
    ALPHAS,
    NoiseAwareLightFR,
    ScaledSettings,
    candidate_scores,
    release_counts,
    run_private_scaled,
    split_budget,
)
from protocol.accounting import composed_rdp, epsilon_from_rdp
from protocol.plan import LightFRParams
from protocol.quantization import QuantizationConfig, sensitivity


def test_split_budget_meets_the_target_composed() -> None:
    qm = QuantizationConfig(clip_norm=4.0, scale_bits=12)
    qp = QuantizationConfig(clip_norm=math.sqrt(20), scale_bits=12)
    l2m, l1m = sensitivity(qm, 1000 * 64)
    l2p, l1p = sensitivity(qp, 1000)
    mu, mu_pop = split_budget(8.0, 1e-5, 3, (l1m, l2m), (l1p, l2p), 0.3)
    eps = epsilon_from_rdp(composed_rdp([(mu_pop, l1p, l2p), *[(mu, l1m, l2m)] * 3]), 1e-5)
    assert 7.99 < eps <= 8.0
    # A tighter μ for the rounds would overspend.
    assert epsilon_from_rdp(composed_rdp([(mu_pop, l1p, l2p), *[(0.99 * mu, l1m, l2m)] * 3]), 1e-5) > 8.0


def test_release_counts_are_exact_without_noise_and_clipped() -> None:
    users = [np.array([0, 1, 2]), np.array([1]), np.arange(10)]
    q = QuantizationConfig(clip_norm=2.0, scale_bits=10)  # θ = 4 → norm 2
    counts = release_counts(users, 10, 4, q, 0.0, np.random.default_rng(0))
    # Devices with at most θ items add 1 per item; the one with 10 spreads norm 2 over them: 2/√10 each.
    tail = 2 / np.sqrt(10)
    assert counts[3:] == pytest.approx(np.full(7, tail), abs=1 / q.scale)
    assert counts[1] == pytest.approx(2 + tail, abs=1 / q.scale) and counts[0] == pytest.approx(
        1 + tail, abs=1 / q.scale
    )
    with pytest.raises(ValueError, match="√θ"):
        release_counts(users, 10, 9, q, 0.0, np.random.default_rng(0))
    noisy = release_counts([np.zeros(0, np.int64)] * 3, 20_000, 4, q, 1e6, np.random.default_rng(1))
    assert abs(np.var(noisy * q.scale) - 1e6) < 0.05 * 1e6


def test_noise_aware_aggregation_keeps_bits_below_the_threshold() -> None:
    base = LightFRServerStrategy(
        n_items=4, params=LightFRParams(unobserved_weight=0.0), server=LightFRServerParams(bits=8, flip_fraction=1.0)
    )
    D = np.ones((4, 8), dtype=np.int8)
    total = np.full(32, -1.0)
    total[:8] = -10.0  # item 0: strong evidence against every bit
    aware = NoiseAwareLightFR(base, sigma=1.0, threshold=3.0)
    out = aware.aggregate(D, total, 10, np.random.default_rng(0), round_index=0)
    assert (out[0] == -1).all() and (out[1:] == 1).all()
    plain = base.aggregate(D, total, 10, np.random.default_rng(0), round_index=0)
    assert (plain == -1).all()


def test_scaled_run_charges_the_ledger_and_learns_popularity() -> None:
    data = synthetic(n_users=300, n_items=80, n_clusters=4, ratings_per_user=15, seed=0)
    st = ScaledSettings(epsilon=8.0, rounds=2, bits=16, pop_share=0.5, example_cap=10)
    res = run_private_scaled(data, st)
    assert res.epsilon is not None and 7.9 < res.epsilon <= 8.0
    assert res.user_codes.shape == (300, 16) and res.item_codes.shape == (80, 16)
    users = np.repeat(np.arange(300), 1)
    items = np.stack([np.random.default_rng(u).permutation(80)[:10] for u in range(300)])
    for a in ALPHAS:
        s = candidate_scores(res, users, items, a)
        assert s.shape == (300, 10) and np.isfinite(s).all()
    true = np.bincount(data.items, minlength=80)
    assert np.corrcoef(true, res.private_counts)[0, 1] > 0.8


def test_private_mf_popularity_channel_is_charged_and_chosen_on_validation() -> None:
    # MF with the private popularity channel: the ledger holds the release and every round within ε,
    # and the weight of the level comes from validation (a grid that includes the level alone).
    from fedsim.data.splits import leave_one_out
    from fedsim.data.synthetic import synthetic
    from fedsim.evaluation.experiment import prepare
    from fedsim.private.mf import PrivateMFSettings, run_private_mf

    data = synthetic(n_users=60, n_items=50, ratings_per_user=12, seed=1)
    exp = prepare(data, n_negatives=20, seed=0)
    train, val, test = leave_one_out(data, seed=0)
    s = PrivateMFSettings(epsilon=4.0, rounds=2, cohort=60, factors=4, pretrain_epochs=5, fine_tune_epochs=5)
    res = run_private_mf(train, test, exp.test, s, val=(val, exp.val))
    assert 3.99 < res.epsilon_user <= 4.0 and res.committed == 2
    assert res.alpha is not None and res.private_popularity is not None and res.mf_only is not None
    assert res.test.ranking is not None and res.private_popularity.ranking is not None
    if np.isinf(res.alpha):  # the level alone: the model's ranking is private popularity's
        assert res.test.ranking.hr == res.private_popularity.ranking.hr
    # Without the channel the rounds get the whole ε (a smaller μ) and nothing is chosen.
    plain = run_private_mf(train, test, exp.test, replace(s, pop_share=0.0), val=(val, exp.val))
    assert plain.alpha is None and plain.mu < res.mu and 3.99 < plain.epsilon_user <= 4.0


def test_scaled_private_mf_charges_the_ledger_and_keeps_the_clipping_constraint() -> None:
    # Every device in one cohort through the sparse MF cohort: ε composed with the popularity release,
    # the factors inside Π's set, and the private counts following true popularity.
    from fedsim.private.mf import PrivateMFSettings, run_private_mf_scaled

    data = synthetic(n_users=300, n_items=80, n_clusters=4, ratings_per_user=15, seed=0)
    s = PrivateMFSettings(
        epsilon=8.0, rounds=3, factors=4, pretrain_epochs=5, fine_tune_epochs=5, clip_norm=2.0, pop_theta=10
    )
    res = run_private_mf_scaled(data, s)
    assert 7.99 < res.epsilon <= 8.0 and res.committed == 3 and res.mu > 0 and res.mu_pop > 0
    U, V = res.user_factors, res.item_factors
    assert U.shape == (300, 4) and V.shape == (80, 4)
    for X in (U, V):
        assert X.min() >= 0 and np.einsum("ij,ij->i", X, X).max() <= s.max_norm2 * (1 + 1e-9)
    assert res.private_counts is not None
    assert np.corrcoef(np.bincount(data.items, minlength=80), res.private_counts)[0, 1] > 0.8
    # Without DP: no ledger, the counts are the clipped counts exactly, and the ratings are fitted.
    plain = run_private_mf_scaled(data, replace(s, epsilon=0.0))
    assert math.isinf(plain.epsilon) and plain.mu == 0.0
    assert plain.private_counts is not None and np.all(plain.private_counts >= 0)
    pred = np.einsum("ij,ij->i", plain.user_factors[data.users], plain.item_factors[data.items])
    assert float(np.sqrt(np.mean((data.ratings - pred) ** 2))) < float(np.sqrt(np.mean(data.ratings**2)))


def test_scaled_run_with_query_planes_scores_by_the_users_vectors() -> None:
    # Asymmetric scoring in the plan (protocol 1.6) under DP: every device ends with a snapped bit-plane
    # vector, the scores are its real score against the codes, and the ledger is charged as with codes.
    from device_sdk.lightfr import LEVEL_SHIFT

    data = synthetic(n_users=200, n_items=60, n_clusters=4, ratings_per_user=12, seed=1)
    st = ScaledSettings(
        epsilon=8.0, rounds=2, bits=16, pop_share=0.5, example_cap=10, unobserved_weight="auto", query_planes=2
    )
    res = run_private_scaled(data, st)
    assert res.epsilon is not None and 7.9 < res.epsilon <= 8.0
    assert res.user_vectors is not None and res.user_vectors.shape == (200, 16)
    # Δ'·q: odd multiples of one step per user, at most 2^P − 1 = 3 steps.
    steps = np.abs(res.user_vectors).min(axis=1)
    q = res.user_vectors / steps[:, None]
    assert np.allclose(q, np.rint(q)) and set(np.unique(np.abs(np.rint(q)))) <= {1.0, 3.0}
    weight = steps * 2**LEVEL_SHIFT * 2 / 2  # a = 2^s·B·Δ'/2 with the server's default B = 2: an integer
    assert np.allclose(weight, np.rint(weight)) and weight.min() >= 1
    users = np.arange(200)
    items = np.stack([np.random.default_rng(u).permutation(60)[:8] for u in range(200)])
    s = candidate_scores(res, users, items, 0.0)
    own = res.item_bias[items] if res.item_bias is not None else 0.0
    want = (16 + np.einsum("uf,ukf->uk", res.user_vectors, res.item_codes[items].astype(float))) / 2.0 + own
    assert np.allclose(s, want)


@pytest.mark.parametrize("clip", [1e4, 2.0])
def test_scaled_round_without_dp_releases_every_cohort_devices_clipped_quantized_upload(
    clip: float, tmp_path: Path
) -> None:
    # ε = 0 is SecAgg+ without DP: the one thing a round releases is Σ over its cohort (⌈p·n⌉ devices) of each
    # device's upload under the plan (asymmetric scoring: the ridge vector as 2 planes, w0 = 0.01), clipped to
    # C and in fixed point with stochastic rounding, so within one unit per device of the clipped exact sum.
    # With C out of the way that is the plain federation's exact sum (`full_upload`); with C = 2 the clip bites.
    from agg_server.strategy import build_strategy
    from device_sdk.batched import snapped_vectors as _quantized
    from device_sdk.lightfr import full_upload, ridge_users
    from fedsim.private.scaled_lightfr import scaled_config
    from protocol.families.lightfr import UploadLayout, bias_from_levels
    from protocol.quantization import clip_l2

    n, m, f, s_bits = 40, 30, 16, 12
    data = synthetic(n_users=n, n_items=m, n_clusters=3, ratings_per_user=8, seed=2)
    st = ScaledSettings(
        epsilon=0.0,
        rounds=1,
        bits=f,
        clip_norm=clip,
        scale_bits=s_bits,
        example_cap=0,
        pop_share=0.0,
        unobserved_weight=0.01,
        query_planes=2,
        user_reg=1.0,
        fraction=0.5,
        code_sweeps=3,
        rank_planes=3,
    )
    res = run_private_scaled(data, st)
    strategy: Any = build_strategy(scaled_config(n, m, st, tmp_path))
    assert strategy.server.code_sweeps == 3 and strategy.current_weight == 0.01
    state = strategy.initialize(np.random.default_rng(np.random.SeedSequence([st.seed, 0])))  # the round's model
    D = strategy.codes(state)
    beta = bias_from_levels(strategy.levels(state), m, f, strategy.hamming_weight)
    assert res.last_release is not None and res.last_users is not None
    assert res.last_users.size == 20 and np.unique(res.last_users).size == 20
    idx = data.by_user()
    layout = UploadLayout(m, f, full=True)
    exact, clipped = np.zeros(layout.length), np.zeros(layout.length)
    for u in res.last_users:
        items = idx.items[idx.indptr[u] : idx.indptr[u + 1]].astype(np.int64)
        ptr, ones = np.array([0, items.size]), np.ones(items.size)
        vec = _quantized(ridge_users(ptr, items, ones, D, beta, 0.01, 0.0, 1.0), 2, strategy.hamming_weight)
        upload = layout.join(**full_upload(ptr, items, ones, vec, D, beta, 0.01, 0.0))
        exact += upload
        clipped += clip_l2(upload, clip)[0]
    got = res.last_release / 2.0**s_bits
    assert np.abs(got - clipped).max() <= 20 / 2.0**s_bits  # stochastic rounding: < 1 unit per device
    assert np.count_nonzero(np.rint(clipped * 2**s_bits)) > 500
    if clip > 100:
        assert np.allclose(clipped, exact)
    else:  # the clip bit: a sum that skipped it would be far off
        assert np.abs(exact - got).max() > 1000 / 2.0**s_bits
    # After the round each device ranks with its vector re-solved as rank_planes = 3 planes: odd multiples ≤ 7.
    assert res.user_vectors is not None
    q = res.user_vectors / np.abs(res.user_vectors).min(axis=1)[:, None]
    assert set(np.unique(np.abs(np.rint(q)))) <= {1.0, 3.0, 5.0, 7.0} and np.abs(q).max() > 3.5


def test_scaled_settings_refuse_bad_fraction_and_rank_planes() -> None:
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="fraction"):
            ScaledSettings(fraction=bad)
    with pytest.raises(ValueError, match="rank_planes needs the all-items objective"):
        ScaledSettings(rank_planes=3, unobserved_weight=0.0)
    for ridge in (0.0, -1.0, math.inf, math.nan, True):
        with pytest.raises(ValueError, match="rank_ridge"):
            ScaledSettings(rank_planes=3, unobserved_weight="auto", rank_ridge=ridge)
    with pytest.raises(ValueError, match="rank_planes"):
        ScaledSettings(query_planes=2, rank_planes=9)


def test_symmetric_scaled_run_ranks_like_the_default_device_when_asked() -> None:
    # rank_planes without query_planes: training and uploads stay ±1 codes (the same model as without it),
    # and every user ranks with what a real LightFRModel (rank_planes = 3, rank_ridge = 2) holds after
    # installing the final codes and levels: its ridge vector (2·w0·m, w0 the run's) as 3 planes.
    from device_sdk.batched import plane_vectors
    from device_sdk.models import LightFRConfig, LightFRModel

    data = synthetic(n_users=60, n_items=40, n_clusters=3, ratings_per_user=8, seed=3)
    st = ScaledSettings(epsilon=0.0, rounds=2, bits=16, pop_share=0.0, example_cap=0, unobserved_weight="auto")
    codes = run_private_scaled(data, st)
    res = run_private_scaled(data, replace(st, rank_planes=3, rank_ridge=2.0))
    assert codes.user_vectors is None and res.user_vectors is not None
    np.testing.assert_array_equal(res.item_codes, codes.item_codes)
    np.testing.assert_array_equal(res.user_codes, codes.user_codes)
    assert res.item_levels is not None and res.unobserved_weight > 0
    idx = data.by_user()
    for u in (0, 17, 59):
        cfg = LightFRConfig(
            bits=16, rating_range=None, binary_positives=True, unobserved_weight=res.unobserved_weight, rank_planes=3
        )
        device = LightFRModel(40, cfg, rng=np.random.default_rng(0))
        device.set_item_codes(res.item_codes, 1)
        device.item_levels, device.hamming_weight = res.item_levels, res.hamming_weight
        device.fold_in(idx.items[idx.indptr[u] : idx.indptr[u + 1]])
        want = plane_vectors(device.user_q[:1], device.user_weight[:1], res.hamming_weight)[0]
        np.testing.assert_allclose(res.user_vectors[u], want, rtol=1e-12)
    users = np.arange(60)
    items = np.stack([np.random.default_rng(u).permutation(40)[:8] for u in range(60)])
    assert not np.allclose(candidate_scores(res, users, items, 0.0), candidate_scores(codes, users, items, 0.0))
