"""FNMF: kernels against the slow references, alignments, the secure strategy and the trusted
barycenter, the device model, and the synthetic recipe of `docs/design.md` §3.4."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pytest

from agg_server.strategy.base import Strategy, round_plan
from agg_server.strategy.fnmf import (
    FNMFStrategy,
    TrustedBarycenterFNMF,
    fedavg_mean,
    trusted_barycenter,
)
from device_sdk.family import FederatedModel, LocalRatings
from device_sdk.fnmf import (
    FNMFConfig,
    FNMFModel,
    frozen_prox,
    lap_align,
    lap_rho_align,
    lipschitz_u,
    lipschitz_v,
    nmf_objective,
    pgd_steps,
    pgd_u,
    pgd_v,
    pull_target,
    sinkhorn_align,
    upload_length,
    upload_vector,
)
from fedsim.data.planted import planted_nonnegative
from fedsim.federation.fnmf import (
    FNMFRunConfig,
    Method,
    matched_cosine,
    orthogonality_gap,
    run_fnmf,
    secure_fixed_point,
    sigma_rmsd,
)
from protocol.errors import ModelError, StorageError
from protocol.messages import RoundInvite
from tests import fnmf_reference as ref


def _noisy_permutations(rng: np.random.Generator, k: int, m: int, c: int, noise: float) -> tuple[np.ndarray, list]:
    G = rng.random((k, m))
    return G, [G[rng.permutation(k)] + noise * rng.random((k, m)) for _ in range(c)]


def _invite(strategy: FNMFStrategy, round_index: int = 1) -> RoundInvite:
    return RoundInvite(
        round_id=1,
        device_id=1,
        vector_length=strategy.vector_length,
        graph_k=1,
        graph_t=1,
        clip_norm=100.0,
        scale_bits=0,
        advertise_deadline=0.0,
        share_keys_deadline=0.0,
        masked_input_deadline=0.0,
        unmask_deadline=0.0,
        **round_plan(strategy, 1, round_index=round_index).invite_fields(),
    )


# -- kernels vs reference ------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pgd_steps_match_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    X, U, V = rng.random((7, 9)), rng.random((7, 3)), rng.random((3, 9))
    U1, _ = pgd_u(X, U, V)
    np.testing.assert_allclose(U1, ref.pgd_u(X, U, V), rtol=0, atol=1e-12)
    V1, _ = pgd_v(X, U1, V)
    np.testing.assert_allclose(V1, ref.pgd_v(X, U1, V), rtol=0, atol=1e-12)
    assert lipschitz_u(V) == pytest.approx(ref.spectral_norm(V @ V.T), rel=1e-12)
    assert lipschitz_v(U) == pytest.approx(ref.spectral_norm(U.T @ U), rel=1e-12)
    # Projection: a step never leaves the non-negative orthant, and a zero Gram matrix means no step.
    assert U1.min() >= 0 and V1.min() >= 0
    np.testing.assert_array_equal(pgd_u(X, U, np.zeros_like(V))[0], U)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_lap_matches_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    V, V_bar = rng.random((5, 8)), rng.random((5, 8))
    P = lap_align(V, V_bar)
    np.testing.assert_array_equal(P, ref.lap(V, V_bar))


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5])
def test_lap_rho_matches_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    G = rng.random((4, 30))
    V_bar = G + 0.3 * rng.random((4, 30))
    V = G[rng.permutation(4)] + 0.8 * rng.random((4, 30))
    V[seed % 4] = rng.random(30)  # one local row unrelated to the global ones
    np.testing.assert_array_equal(lap_rho_align(V, V_bar, 0.05), ref.lap_rho(V, V_bar, 0.05))


@pytest.mark.parametrize("seed", [0, 1])
def test_sinkhorn_matches_reference_and_is_row_stochastic(seed: int) -> None:
    rng = np.random.default_rng(seed)
    V, V_bar = rng.random((4, 6)), rng.random((4, 6))
    P = sinkhorn_align(V, V_bar, 0.3, iterations=25, tol=0.0)
    np.testing.assert_allclose(P, ref.sinkhorn(V, V_bar, 0.3, 25), rtol=0, atol=1e-12)
    np.testing.assert_allclose(P.sum(axis=1), 1.0, atol=1e-14)
    assert P.min() >= 0.0
    # Uniform marginals: the plan is close to doubly stochastic as well.
    np.testing.assert_allclose(P.sum(axis=0), 1.0, atol=1e-6)


def test_sinkhorn_is_near_the_permutation_for_well_separated_rows() -> None:
    rng = np.random.default_rng(3)
    G = np.zeros((5, 50))
    for comp in range(5):
        G[comp, comp * 10 : comp * 10 + 10] = 1.0
    V = G[rng.permutation(5)] + 0.05 * rng.random((5, 50))
    P = sinkhorn_align(V, G, 0.02)
    assert np.abs(P - lap_align(V, G)).max() < 1e-6
    assert orthogonality_gap([P]) < 1e-5
    # A large ε blurs the plan towards uniform: still row-stochastic, no longer a permutation.
    soft = sinkhorn_align(V, G, 50.0)
    np.testing.assert_allclose(soft.sum(axis=1), 1.0, atol=1e-14)
    assert soft.max() < 0.3 and orthogonality_gap([soft]) > 1.0
    with pytest.raises(ValueError):
        sinkhorn_align(V, G, 0.0)


def test_frozen_prox_interpolates_and_spares_personal_rows() -> None:
    rng = np.random.default_rng(0)
    V, T = rng.random((3, 5)), rng.random((3, 5))
    mask = np.array([1.0, 0.0, 1.0])
    np.testing.assert_array_equal(frozen_prox(V, T, mask, 0.0), V)
    far = frozen_prox(V, T, mask, 1e12)
    np.testing.assert_allclose(far[[0, 2]], T[[0, 2]], atol=1e-11)
    np.testing.assert_array_equal(far[1], V[1])
    half = frozen_prox(V, T, np.ones(3), 1.0)
    np.testing.assert_allclose(half, (V + T) / 2, rtol=0, atol=1e-15)


def test_projected_gradient_with_lipschitz_steps_never_increases_the_objective() -> None:
    pl = planted_nonnegative(clients=1, rows_per_client=80, m=60, k=4, rng=np.random.default_rng(5))
    X = pl.data.astype(np.float64)
    rng = np.random.default_rng(6)
    U, V = rng.random((80, 4)), rng.random((4, 60))
    values = [nmf_objective(X, U, V)]
    for _ in range(150):
        U, V = pgd_steps(X, U, V, 1)
        values.append(nmf_objective(X, U, V))
    diffs = np.diff(values)
    assert diffs.max() <= 1e-9 * values[0]
    assert values[-1] < 0.05 * values[0]


# -- barycenters -----------------------------------------------------------------------------------
def test_idealized_barycenter_recovers_the_ground_matrix() -> None:
    rng = np.random.default_rng(11)
    G = rng.random((5, 40))
    mats = [G[rng.permutation(5)] for _ in range(6)]
    v_bar, perms = trusted_barycenter(mats, 20)
    loss = sum(float(np.sum((v_bar - p @ v) ** 2)) for p, v in zip(perms, mats, strict=True))
    assert loss < 1e-24
    assert orthogonality_gap(perms) == 0.0
    # V̄ is G up to a row permutation.
    np.testing.assert_allclose(lap_align(v_bar, G) @ v_bar, G, rtol=0, atol=1e-12)


def test_barycenter_matches_reference() -> None:
    rng = np.random.default_rng(2)
    _, mats = _noisy_permutations(rng, 4, 6, 5, 0.3)
    v_bar, _ = trusted_barycenter(mats, 10)
    np.testing.assert_allclose(v_bar, ref.barycenter(mats, 10), rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_client_side_fixed_point_equals_the_trusted_barycenter(seed: int) -> None:
    rng = np.random.default_rng(seed)
    _, mats = _noisy_permutations(rng, 5, 50, 8, 0.5)
    strategy = FNMFStrategy(rank=5, n_items=50)
    secure, rounds = secure_fixed_point(mats, strategy, strategy.initialize(rng), 10)
    trusted, _ = trusted_barycenter(mats, 10)
    np.testing.assert_allclose(secure, trusted, rtol=0, atol=1e-12)
    assert 2 <= rounds <= 11


def test_lap_rho_leaves_an_uncorrelated_component_unassigned_and_unpulled() -> None:
    rng = np.random.default_rng(4)
    m = 60
    G = np.zeros((4, m))
    for comp in range(4):
        G[comp, comp * 12 : comp * 12 + 12] = 1.0
    V = G[[2, 0, 3, 1]] + 0.05 * rng.random((4, m))
    V[1] = 0.0
    V[1, 48:] = 1.0  # local row 1 lives on columns no global component uses
    P = lap_rho_align(V, G)
    assert P[:, 1].sum() == 0.0 and P.sum() == 3.0
    assert P[0, 1] == 0.0 and P[0].sum() == 0.0  # global row 0 (matched to local row 1 by lap) stays free
    target, mask = pull_target(P, G)
    np.testing.assert_array_equal(mask, [1.0, 0.0, 1.0, 1.0])
    pulled = frozen_prox(V, target, mask, 1.0)
    np.testing.assert_array_equal(pulled[1], V[1])
    # The upload: unmatched global rows send 0, and the counts say which rows were matched.
    up = upload_vector(V, G, P, "lap_rho")
    assert up.size == upload_length(4, m, "lap_rho")
    np.testing.assert_array_equal(up[-4:], [0.0, 1.0, 1.0, 1.0])
    np.testing.assert_array_equal(up[:m], 0.0)


# -- strategy ------------------------------------------------------------------------------------
def test_strategy_contract_and_aggregation_rules() -> None:
    s: Strategy = FNMFStrategy(rank=3, n_items=4, local_steps=7)
    assert isinstance(s, Strategy) and s.kind == "fnmf" and s.vector_length == 12
    rng = np.random.default_rng(0)
    v = s.initialize(rng)
    assert v.shape == (3, 4) and v.min() >= 0
    np.testing.assert_array_equal(s.from_wire(b"", s.to_wire(v)["values"]), v)
    with pytest.raises(ValueError):
        s.from_wire(b"x", s.to_wire(v)["values"])
    with pytest.raises(ValueError):
        s.from_wire(b"", s.to_wire(-v)["values"])
    # FedAvg over sums: V̄ + Σ(V_j − V̄)/c is the plain mean.
    fedavg = FNMFStrategy(rank=3, n_items=4, alignment="none")
    mats = [rng.random((3, 4)) for _ in range(4)]
    total = np.sum([(x - v).ravel() for x in mats], axis=0)
    np.testing.assert_allclose(fedavg.aggregate(v, total, 4, rng, round_index=0), fedavg_mean(mats), atol=1e-15)
    # lap_rho: per-component counts; a component nobody matched stays as it was.
    rho = FNMFStrategy(rank=3, n_items=4, alignment="lap_rho")
    assert rho.vector_length == 15
    S = np.ones((3, 4))
    S[2] = 5.0
    new = rho.aggregate(v, np.concatenate([S.ravel(), [2.0, 0.0, 1.0]]), 3, rng, round_index=0)
    np.testing.assert_allclose(new[0], v[0] + 0.5)
    np.testing.assert_array_equal(new[1], v[1])
    np.testing.assert_allclose(new[2], v[2] + 5.0)
    # The result is clamped to be non-negative.
    assert fedavg.aggregate(v, np.full(12, -100.0), 1, rng, round_index=0).min() == 0.0
    with pytest.raises(ValueError):
        fedavg.aggregate(v, np.zeros(11), 1, rng, round_index=0)
    invite = _invite(FNMFStrategy(rank=3, n_items=4, local_steps=7))
    assert (invite.params.local_steps, invite.params.alignment, invite.bits) == (7, "lap", 3)
    assert "ΔV̄" in s.describe(v, v + 1)
    with pytest.raises(ValueError):
        FNMFStrategy(rank=3, n_items=4, alignment="kmeans")


def test_trusted_barycenter_warns_that_it_sees_individual_matrices(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="agg_server.strategy.fnmf"):
        t = TrustedBarycenterFNMF(rank=2, n_items=3)
    assert any("individual client matrices" in r.getMessage() for r in caplog.records)
    assert not hasattr(t, "vector_length")  # it is not a secure-aggregation Strategy
    with pytest.raises(ValueError):
        t.aggregate_matrices(None, [np.zeros((3, 3))])


# -- the device model ----------------------------------------------------------------------------
def _model_with_global(k: int = 3, m: int = 12, **cfg: object) -> tuple[FNMFModel, FNMFStrategy, np.ndarray]:
    strategy = FNMFStrategy(rank=k, n_items=m, local_steps=20, alignment=str(cfg.pop("alignment", "lap")))
    model = FNMFModel(m, FNMFConfig(rank=k, **cfg))  # type: ignore[arg-type]
    v_bar = strategy.initialize(np.random.default_rng(1))
    model.set_global(b"", strategy.to_wire(v_bar)["values"], 1)
    return model, strategy, v_bar


def test_local_update_uploads_the_aligned_difference() -> None:
    model, strategy, v_bar = _model_with_global(alignment="lap_rho")
    assert isinstance(model, FederatedModel)
    data = LocalRatings.from_matrix(np.random.default_rng(2).random((15, 12)))
    res = model.local_update(_invite(strategy).plan, data, np.random.default_rng(3))
    assert res.vector.shape == (strategy.vector_length,) and np.all(np.isfinite(res.vector))
    assert res.examples == 15 * 12 and res.info["steps"] == 20
    P = model.alignment_matrix()
    assert model.v_local is not None
    np.testing.assert_allclose(res.vector, upload_vector(model.v_local, v_bar, P, "lap_rho"))
    with pytest.raises(ValueError):
        model.local_update(_invite(FNMFStrategy(rank=3, n_items=11)).plan, data, np.random.default_rng(3))
    with pytest.raises(ValueError):
        model.set_global(b"", b"\x00" * 8, 2)
    with pytest.raises(ModelError):
        FNMFModel(12, FNMFConfig(rank=3)).item_matrix()


@pytest.mark.parametrize("independent", [False, True])
def test_first_round_starts_from_the_shared_or_the_clients_own_matrix(independent: bool) -> None:
    model, strategy, v_bar = _model_with_global(independent_init=independent)
    X = np.random.default_rng(2).random((6, 12))
    model.train(_invite(strategy, round_index=0).plan, LocalRatings.from_matrix(X), np.random.default_rng(3))
    g = np.random.default_rng(3)  # the documented draw order: U first, then the client's own V
    U0 = g.random((6, 3))
    V0 = g.random((3, 12)) if independent else v_bar
    U1, V1 = pgd_steps(X, U0, V0, 20)
    np.testing.assert_array_equal(model.u, U1)
    np.testing.assert_array_equal(model.v_local, V1)


def test_lap_rho_upload_keeps_its_counts_through_clipping() -> None:
    model, strategy, _ = _model_with_global(alignment="lap_rho")
    data = LocalRatings.from_matrix(np.random.default_rng(2).random((15, 12)))
    invite = replace(_invite(strategy, round_index=0), clip_norm=2.0)
    res = model.local_update(invite.plan, data, np.random.default_rng(3))
    assert np.linalg.norm(res.vector) <= 2.0
    np.testing.assert_array_equal(res.vector[-3:], [1.0, 1.0, 1.0])  # round 0: LAP matches all three
    with pytest.raises(ValueError, match="clip_norm"):
        model.local_update(replace(invite, clip_norm=1.5).plan, data, np.random.default_rng(3))


def test_recommend_ranks_by_u_vbar_and_filters() -> None:
    model, strategy, v_bar = _model_with_global()
    data = LocalRatings.from_matrix(np.random.default_rng(2).random((4, 12)))
    model.local_update(_invite(strategy).plan, data, np.random.default_rng(3))
    assert model.u is not None
    scores = model.u[1] @ model.item_matrix()
    ids, sc = model.recommend([0, 1], N=5, userid=1)
    expected = [i for i in np.argsort(-scores, kind="stable") if i not in (0, 1)][:5]
    np.testing.assert_array_equal(ids, expected)
    np.testing.assert_allclose(sc, scores[ids].astype(np.float32))
    ids, _ = model.recommend(None, N=20, items=[3, 4, 5], filter_items=[4])
    assert sorted(ids.tolist()) == [3, 5]
    bids, bsc = model.recommend([[0], [1]], N=3, userid=[0, 2], rng=np.random.default_rng(0))
    assert bids.shape == (2, 3) and bsc.dtype == np.float32
    with pytest.raises(ValueError):
        model.recommend(None, N=-1)
    with pytest.raises(ValueError):
        model.recommend(None, userid=9)


def test_fold_in_recovers_a_row_generated_from_the_components() -> None:
    model, _, _ = _model_with_global(k=3, m=40, fold_in_steps=2000)
    V = model.item_matrix()
    u_true = np.array([0.7, 0.0, 1.3])
    row = u_true @ V
    u = model.fold_in(np.arange(40), row)
    np.testing.assert_allclose(u, u_true, atol=1e-6)
    with pytest.raises(ValueError):
        model.fold_in([])


def test_save_load_roundtrip_and_invalid_files(tmp_path) -> None:
    model, strategy, _ = _model_with_global()
    data = LocalRatings.from_matrix(np.random.default_rng(2).random((5, 12)))
    model.local_update(_invite(strategy).plan, data, np.random.default_rng(3))
    path = tmp_path / "fnmf.store"
    model.save(path)
    back = FNMFModel.load(path)
    assert back.config == model.config and back.model_version == 1
    for name in ("u", "v_local", "v_bar"):
        np.testing.assert_array_equal(getattr(back, name), getattr(model, name))
    np.testing.assert_array_equal(back.recommend(None, N=4)[0], model.recommend(None, N=4)[0])
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(StorageError):
        FNMFModel.load(path)
    with pytest.raises(StorageError):
        FNMFModel.load(tmp_path / "missing.store")


# -- the synthetic recipe (notes D.3) ------------------------------------------------------------
@pytest.fixture(scope="module")
def planted():
    return planted_nonnegative(rng=np.random.default_rng(0))


def test_recipe_t100_fnmf_reaches_the_noise_floor_and_fedavg_drifts(planted) -> None:
    floor = sigma_rmsd(planted.clients, np.split(planted.signal, 10))
    assert floor == pytest.approx(0.705, abs=0.01)
    cfg = FNMFRunConfig(rounds=4, local_steps=100)
    secure = run_fnmf(planted.clients, 5, cfg, np.random.default_rng(1), truth=planted.v)
    trusted_cfg = FNMFRunConfig(method=Method.FNMF_TRUSTED, rounds=4)
    trusted = run_fnmf(planted.clients, 5, trusted_cfg, np.random.default_rng(1), truth=planted.v)
    fedavg_cfg = FNMFRunConfig(method=Method.FEDAVG, rounds=4)
    fedavg = run_fnmf(planted.clients, 5, fedavg_cfg, np.random.default_rng(1), truth=planted.v)
    assert secure.sigma_rmsd <= 1.1 * floor
    assert secure.matched_cosine >= 0.99
    assert secure.orthogonality_gap == 0.0
    assert fedavg.sigma_rmsd >= 3.0 * secure.sigma_rmsd
    assert abs(secure.sigma_rmsd - trusted.sigma_rmsd) <= 0.01 * trusted.sigma_rmsd
    assert matched_cosine(secure.v_bar, trusted.v_bar) > 0.999


def test_secure_fixed_point_runs_equal_trusted_barycenter_runs(planted) -> None:
    # Every round: the exact fixed point over sums vs the trusted barycenter over the same clients.
    cfg = FNMFRunConfig(rounds=3, local_steps=20, fixed_point_every_round=True)
    secure = run_fnmf(planted.clients, 5, cfg, np.random.default_rng(4))
    trusted = run_fnmf(planted.clients, 5, replace(cfg, method=Method.FNMF_TRUSTED), np.random.default_rng(4))
    np.testing.assert_allclose(secure.v_bar, trusted.v_bar, rtol=0, atol=1e-12)
    assert secure.sync_rounds > trusted.sync_rounds == 3


@pytest.mark.parametrize("alignment", ["lap", "lap_rho"])
def test_shared_init_anchored_from_round_zero(planted, alignment: str) -> None:
    # The HTTP path: every client starts from the server's seeded V̄ and each round is one secure sum.
    cfg = FNMFRunConfig(alignment=alignment, rounds=3, local_steps=100, independent_init=False)
    run = run_fnmf(planted.clients, 5, cfg, np.random.default_rng(2), truth=planted.v)
    floor = sigma_rmsd(planted.clients, np.split(planted.signal, 10))
    assert run.sync_rounds == 3
    assert run.sigma_rmsd <= 1.1 * floor and run.matched_cosine >= 0.99


def test_runs_are_deterministic_given_the_generator(planted) -> None:
    cfg = FNMFRunConfig(rounds=2, local_steps=10, alignment="sinkhorn")
    a = run_fnmf(planted.clients, 5, cfg, np.random.default_rng(7))
    b = run_fnmf(planted.clients, 5, cfg, np.random.default_rng(7))
    c = run_fnmf(planted.clients, 5, cfg, np.random.default_rng(8))
    np.testing.assert_array_equal(a.v_bar, b.v_bar)
    assert a.sigma_rmsd == b.sigma_rmsd
    assert not np.array_equal(a.v_bar, c.v_bar)
