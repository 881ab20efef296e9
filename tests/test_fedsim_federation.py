"""In-process federated LightFR: it learns on real data, is reproducible, and the server only ever
needs the cohort's sum."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from agg_server.strategy import LightFRStrategy
from device_sdk import lightfr
from device_sdk.models import LightFRConfig, LightFRModel
from fedsim.evaluation.experiment import baselines, prepare
from fedsim.evaluation.ranking import TieMode, evaluate_candidates
from fedsim.federation.lightfr import FederationConfig, run_lightfr, user_data, with_negatives
from protocol.codes import random_signs
from protocol.spec import Aggregation


@pytest.mark.data
def test_lightfr_learns_on_the_filmtrust_split(shared_data: Path) -> None:
    exp = prepare("filmtrust-lightfr", data_dir=shared_data)
    cfg = LightFRConfig(rating_range=None, binary_positives=True)
    state = run_lightfr(user_data(exp.train, cfg), cfg, FederationConfig(rounds=15, seed=0, flip_fraction=0.1))
    res = evaluate_candidates(state.scores(exp.test.users, exp.test.items), 10, TieMode.RANDOM)
    chance = baselines(exp)["random"]
    # 15 rounds are far from converged; this asserts that training moves far above chance (0.19).
    assert res.hr > 0.75 and res.hr > chance.hr + 0.4


def test_paper_lambda_leaves_codes_random() -> None:
    """With λ = 0.6 at f = 64 the balance term outweighs the data term: DCD flips (almost) nothing."""
    from fedsim.data.synthetic import synthetic

    data = synthetic(n_users=200, n_items=150, ratings_per_user=25, seed=1)
    rng = np.random.default_rng(0)
    cfg = LightFRConfig(bits=64, rating_range=(1.0, 5.0), negatives=0)
    ud = user_data(data, cfg)
    D = random_signs(data.n_items, 64, rng)
    B = random_signs(ud.n_users, 64, rng)
    # Balanced start codes (Σ_k b_k = 0) are the paper's target; the balance term then pins them.
    B[:, :32], B[:, 32:] = 1, -1
    _, paper = lightfr.dcd_update(ud.indptr, ud.items, ud.targets, B, D, 0.6, max_sweeps=5)
    _, ours = lightfr.dcd_update(ud.indptr, ud.items, ud.targets, B, D, 0.0, max_sweeps=5)
    assert paper.flips < 0.02 * ours.flips


def test_runs_are_reproducible_and_para_works() -> None:
    from fedsim.data.synthetic import synthetic

    data = synthetic(n_users=120, n_items=80, ratings_per_user=15, seed=2)
    cfg = LightFRConfig(bits=32, rating_range=(1.0, 5.0))
    ud = user_data(data, cfg)
    a = run_lightfr(ud, cfg, FederationConfig(rounds=4, seed=5, flip_fraction=0.3))
    b = run_lightfr(ud, cfg, FederationConfig(rounds=4, seed=5, flip_fraction=0.3))
    assert np.array_equal(a.item_codes, b.item_codes) and np.array_equal(a.user_codes, b.user_codes)
    assert len(a.history) == 4 and all(r.cohort == 72 for r in a.history)
    para = LightFRConfig(bits=32, rating_range=(1.0, 5.0), unobserved_weight=0.0)
    p = run_lightfr(user_data(data, para), para, FederationConfig(rounds=3, seed=5, aggregation=Aggregation.PARA))
    assert p.item_codes.shape == (80, 32)


def test_cohort_sum_equals_sum_of_device_uploads() -> None:
    """What the simulator aggregates is exactly Σ of what each LightFRModel device would upload."""
    from fedsim.data.synthetic import synthetic

    data = synthetic(n_users=30, n_items=40, ratings_per_user=8, seed=3)
    cfg = LightFRConfig(bits=16, rating_range=None, negatives=0, binary_positives=True, unobserved_weight=0.0)
    ud = user_data(data, cfg)
    rng = np.random.default_rng(0)
    strategy = LightFRStrategy(bits=16)
    D = strategy.initialize(40, rng)
    B = random_signs(30, 16, rng)
    batch = with_negatives(ud, 0, rng)
    B1, _ = lightfr.dcd_update(batch.indptr, batch.items, batch.targets, B, D, 0.0, max_sweeps=10)
    total = lightfr.item_gradient_sum(batch.indptr, batch.items, batch.targets, B1, D)
    devices = np.zeros_like(total)
    for u in range(30):
        dev = LightFRModel(40, cfg, rng=np.random.default_rng(u))
        dev.set_item_codes(D, 1)
        dev.user_codes[0] = B[u]
        up = dev.fit_local(ud.items[ud.indptr[u] : ud.indptr[u + 1]])
        assert np.array_equal(dev.user_codes[0], B1[u])
        devices += up.values
    np.testing.assert_allclose(devices, total, atol=1e-9)


@pytest.mark.data
def test_all_items_objective_beats_popularity_on_ml100k_validation(shared_data: Path) -> None:
    """The default recipe (all-items objective, learned item levels) clears item popularity on the
    ML-100K validation blocks after a short run (8 rounds; longer runs: benchmarks/quality_lightfr.py)."""
    exp = prepare("ml-100k", data_dir=shared_data)
    cfg = LightFRConfig(rating_range=exp.rating_range, binary_positives=True, unobserved_weight=0.1)
    state = run_lightfr(user_data(exp.train, cfg), cfg, FederationConfig(rounds=8, seed=0, flip_fraction=0.3))
    assert state.item_levels is not None and state.item_levels.dtype == np.uint8
    res = evaluate_candidates(state.scores(exp.val.users, exp.val.items), 10, TieMode.RANDOM)
    pop = evaluate_candidates(
        np.bincount(exp.train.items, minlength=exp.train.n_items)[exp.val.items], 10, TieMode.RANDOM
    )
    assert res.hr > pop.hr + 0.03


@pytest.mark.parametrize("levels", [False, True])
def test_full_ranking_scores_equal_the_candidate_scores(levels: bool) -> None:
    from fedsim.federation.lightfr import FederatedLightFR

    rng = np.random.default_rng(3)
    n, m, f = 7, 50, 64
    state = FederatedLightFR(
        user_codes=random_signs(n, f, rng),
        item_codes=random_signs(m, f, rng),
        item_levels=rng.integers(0, 256, m).astype(np.uint8) if levels else None,
        hamming_weight=4 if levels else 1,
    )
    users = np.array([0, 3, 6])
    every = np.broadcast_to(np.arange(m), (users.size, m))
    np.testing.assert_array_equal(state.all_scores(users), state.scores(users, every).astype(np.float32))


def test_density_derived_w0_is_what_the_server_reads_off_the_counts() -> None:
    """With unobserved_scale > 0 and every user in every cohort, the w0 of the run is the density rule
    at the training set's exact density (the counts slice sums to the number of distinct ratings)."""
    from fedsim.data.synthetic import synthetic
    from protocol.families.lightfr import density_weight

    data = synthetic(n_users=40, n_items=60, ratings_per_user=10, seed=4)
    cfg = LightFRConfig(bits=16, rating_range=(1.0, 5.0), binary_positives=True, unobserved_weight=0.5)
    fed = FederationConfig(rounds=2, fraction=1.0, flip_fraction=0.3, unobserved_scale=0.6)
    ud = user_data(data, cfg)
    state = run_lightfr(ud, cfg, fed)
    pairs = np.unique(np.repeat(np.arange(ud.n_users), np.diff(ud.indptr)) * data.n_items + ud.items).size
    assert state.unobserved_weight == pytest.approx(density_weight(float(pairs), ud.n_users, data.n_items))
    fixed = run_lightfr(ud, cfg, FederationConfig(rounds=1, fraction=1.0, flip_fraction=0.3))
    assert fixed.unobserved_weight == 0.5


def test_rank_planes_set_the_planes_of_the_refreshed_vectors_only() -> None:
    """With rank_planes the final vectors (what a device ranks with) are the ridge solve against the final
    model quantized to that many planes; training (the uploads) is the query_planes run's, unchanged."""
    from device_sdk.batched import snapped_vectors as _quantized
    from fedsim.data.synthetic import synthetic
    from protocol.families.lightfr import bias_from_levels

    data = synthetic(n_users=40, n_items=60, ratings_per_user=10, seed=4)
    cfg = LightFRConfig(bits=16, rating_range=(1.0, 5.0), binary_positives=True, unobserved_weight=0.05)
    ud = user_data(data, cfg)
    base = FederationConfig(rounds=3, fraction=0.5, query_planes=2, mean_field=True)
    two = run_lightfr(ud, cfg, base)
    three = run_lightfr(
        ud, cfg, FederationConfig(rounds=3, fraction=0.5, query_planes=2, mean_field=True, rank_planes=3)
    )
    np.testing.assert_array_equal(two.item_codes, three.item_codes)
    np.testing.assert_array_equal(two.item_levels, three.item_levels)
    beta = bias_from_levels(three.item_levels, data.n_items, 16, base.hamming_weight)
    U = lightfr.ridge_users(ud.indptr, ud.items, ud.targets, three.item_codes, beta, 0.05, 0.0, base.user_reg)
    np.testing.assert_array_equal(three.user_vectors, _quantized(U, 3, base.hamming_weight))
    np.testing.assert_array_equal(two.user_vectors, _quantized(U, 2, base.hamming_weight))
    assert not np.array_equal(two.user_vectors, three.user_vectors)
    with pytest.raises(ValueError, match="rank_planes must be"):
        FederationConfig(query_planes=2, rank_planes=9)


def test_symmetric_training_ranks_with_vectors_of_its_own_ridge() -> None:
    """rank_planes without query_planes: training (codes, levels, w0) is the symmetric run's, unchanged, and
    the vectors the devices rank with are the ridge solve (weight rank_ridge·w0·m) against the final model,
    as rank_planes planes; the scores are theirs, not the codes'."""
    from device_sdk.batched import snapped_vectors as _quantized
    from fedsim.data.synthetic import synthetic
    from protocol.families.lightfr import bias_from_levels

    data = synthetic(n_users=40, n_items=60, ratings_per_user=10, seed=4)
    cfg = LightFRConfig(bits=16, rating_range=(1.0, 5.0), binary_positives=True, unobserved_weight=0.05)
    ud = user_data(data, cfg)
    base = FederationConfig(rounds=3, fraction=0.5, mean_field=True, unobserved_scale=0.6)
    codes = run_lightfr(ud, cfg, base)
    ranked = run_lightfr(ud, cfg, replace(base, rank_planes=3, rank_ridge=2.0))
    assert codes.user_vectors is None
    np.testing.assert_array_equal(codes.item_codes, ranked.item_codes)
    np.testing.assert_array_equal(codes.user_codes, ranked.user_codes)
    np.testing.assert_array_equal(codes.item_levels, ranked.item_levels)
    w0 = ranked.unobserved_weight
    beta = bias_from_levels(ranked.item_levels, data.n_items, 16, base.hamming_weight)
    reg = 2.0 * w0 * data.n_items
    U = lightfr.ridge_users(ud.indptr, ud.items, ud.targets, ranked.item_codes, beta, w0, 0.0, reg)
    np.testing.assert_array_equal(ranked.user_vectors, _quantized(U, 3, base.hamming_weight))
    users = np.arange(5)
    cand = np.tile(np.arange(data.n_items), (5, 1))
    assert not np.array_equal(np.argsort(-codes.scores(users, cand)), np.argsort(-ranked.scores(users, cand)))
    with pytest.raises(ValueError, match="rank_ridge must be"):
        FederationConfig(rank_planes=3, rank_ridge=0.0)
    with pytest.raises(ValueError, match="rank_planes needs the all-items objective"):
        run_lightfr(ud, replace(cfg, unobserved_weight=0.0), FederationConfig(rounds=1, rank_planes=2))
