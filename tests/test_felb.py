"""FELB (federated Boolean MF with the ELB prox): kernels against the papers' identities and a literal
reference (tests/felb_reference.py), the server strategy and baselines on hand examples, the device
model (determinism, persistence, retrieval) and the synthetic recovery recipe of
`docs/design.md` §3.4."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from agg_server.strategy.base import Strategy
from agg_server.strategy.felb import FELBStrategy, logical_or, majority_vote, rounded_mean
from device_sdk import felb
from device_sdk.family import FederatedModel, LocalRatings
from device_sdk.felb import FELBConfig, FELBModel
from device_sdk.store import save_store
from fedsim.data.planted import planted_binary
from fedsim.federation.felb import binary_ratings, evaluate_felb, f1_score, factor_f1, felb_plan, run_felb, sigma_rmsd
from protocol.errors import ModelError, StorageError
from tests.felb_reference import iteration_reference, local_reference, prox_scalar

# -- 1. the ELB prox ------------------------------------------------------------------------------


@pytest.mark.parametrize("kappa, lam", [(0.0, 0.0), (1e-3, 0.1), (0.3, 5.0), (0.05, 1e9)])
def test_prox_fixed_points(kappa: float, lam: float) -> None:
    out = felb.prox_elb(np.array([0.0, 1.0]), kappa, lam)
    assert out.tolist() == [0.0, 1.0]


def test_prox_binarizes_at_half_as_lambda_grows() -> None:
    x = np.linspace(-0.5, 1.5, 401)
    out = felb.prox_elb(x, 1e-3, 1e12)
    want = (x > 0.5).astype(float)
    np.testing.assert_allclose(out, want, atol=1e-9)
    # A moderate λ keeps intermediate values strictly inside (0, 1) around ½.
    mid = felb.prox_elb(np.array([0.45, 0.55]), 0.0, 1.0)
    assert 0 < mid[0] < 0.5 < mid[1] < 1


def test_prox_elementwise_matches_scalar_reference_and_is_monotone() -> None:
    rng = np.random.default_rng(1)
    x = rng.uniform(-0.5, 1.5, size=(7, 9))
    kap = rng.uniform(0, 0.3, size=x.shape)
    lam = rng.uniform(0, 4, size=x.shape)
    got = felb.prox_elb(x, kap, lam)
    want = np.vectorize(prox_scalar)(x, kap, lam)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-15)
    assert got.min() >= 0.0 and got.max() <= 1.0
    for kappa, lamb in [(0.0, 0.0), (0.01, 0.1), (0.2, 3.0)]:
        xs = np.sort(rng.uniform(-1, 2, 2000))
        ys = felb.prox_elb(xs, kappa, lamb)
        assert np.all(np.diff(ys) >= 0)


def test_prox_known_values_and_validation() -> None:
    # κ = 0.1, λ = 1: soft-threshold then shrink by 1/(1+λ) towards the nearer of 0 and 1.
    x = np.array([-0.05, 0.05, 0.3, 0.7, 0.95, 1.2])
    np.testing.assert_allclose(felb.prox_elb(x, 0.1, 1.0), [0.0, 0.0, 0.1, 0.9, 1.0, 1.0], atol=1e-15)
    with pytest.raises(ValueError):
        felb.prox_elb(x, -0.1, 1.0)
    with pytest.raises(ValueError):
        felb.prox_elb(x, 0.1, np.inf)


# -- 2. prox^p --------------------------------------------------------------------------------------


def test_prox_proximity_interpolates() -> None:
    rng = np.random.default_rng(2)
    X, Vh = rng.random((3, 8)), rng.random((3, 8))
    np.testing.assert_array_equal(felb.prox_proximity(X, Vh, 0.0), X)
    np.testing.assert_allclose(felb.prox_proximity(X, Vh, 1e12), Vh, atol=1e-11)
    np.testing.assert_allclose(felb.prox_proximity(X, Vh, 1.0), (X + Vh) / 2, atol=1e-15)
    g = rng.random((3, 8))
    np.testing.assert_allclose(felb.prox_proximity(X, Vh, g), (X + g * Vh) / (1 + g), atol=1e-15)


# -- 3. FELB^MU is Lee–Seung ----------------------------------------------------------------------


def test_mu_step_known_answer() -> None:
    # U = [½, ¼], V = [[1, 1], [0, 1]], A = [1, 0]: VVᵀ = [[2, 1], [1, 1]], UVVᵀ = [1.25, 0.75],
    # AVᵀ = [1, 0]; Lee–Seung gives U ⊙ AVᵀ ⊘ UVVᵀ = [0.4, 0].
    U = np.array([[0.5, 0.25]])
    V = np.array([[1.0, 1.0], [0.0, 1.0]])
    A = np.array([[1.0, 0.0]])
    eta, grad, _ = felb.mu_steps(A, U, V, eps=0.0)
    np.testing.assert_allclose(eta, [[0.4, 1 / 3]], atol=1e-16)
    np.testing.assert_allclose(grad, [[0.25, 0.75]], atol=1e-16)
    np.testing.assert_allclose(U - eta * grad, [[0.4, 0.0]], atol=1e-16)


@pytest.mark.parametrize("seed", range(4))
def test_mu_iteration_is_lee_seung(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, m, k = 6, 9, 3
    A = (rng.random((n, m)) < 0.4).astype(float)
    U, V = rng.uniform(0.1, 1, (n, k)), rng.uniform(0.1, 1, (k, m))
    eta, grad, _ = felb.mu_steps(A, U, V)
    lee_seung_u = U * (A @ V.T + 1e-12) / (U @ V @ V.T + 1e-12)
    np.testing.assert_allclose(U - eta * grad, lee_seung_u, rtol=1e-12, atol=1e-15)
    # With κ = λ = γ = β = 0 the prox is the box projection: one FELB^MU iteration is the clamped
    # Lee–Seung update of U, then of V with the new U.
    U1, V1 = felb.felb_local(A, U, V, V, kappa=0.0, lam=0.0, gamma=0.0, beta=0.0, step_rule="mu", iterations=1)
    want_u = np.clip(lee_seung_u, 0, 1)
    np.testing.assert_allclose(U1, want_u, rtol=1e-12, atol=1e-15)
    want_v = np.clip(V * (want_u.T @ A + 1e-12) / (want_u.T @ want_u @ V + 1e-12), 0, 1)
    np.testing.assert_allclose(V1, want_v, rtol=1e-12, atol=1e-15)


# -- 4. Lipschitz steps descend -------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_lipschitz_steps_never_increase_objective(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, m, k = 30, 40, 4
    A = (rng.random((n, m)) < 0.3).astype(float)
    U, V = rng.random((n, k)), rng.random((k, m))
    Vh = rng.random((k, m))
    lam = float(rng.choice([0.0, 0.1, 2.0]))
    phi = [felb.local_objective(A, U, V, Vh, kappa=1e-3, lam=lam, gamma=0.0)]
    for _ in range(150):
        U, V = felb.felb_local(A, U, V, Vh, kappa=1e-3, lam=lam, gamma=0.0, beta=0.0, iterations=1)
        phi.append(felb.local_objective(A, U, V, Vh, kappa=1e-3, lam=lam, gamma=0.0))
    steps = np.diff(phi)
    assert np.all(steps <= 1e-12 * np.abs(phi[:-1])), steps.max()
    assert phi[-1] < 0.9 * phi[0]


def test_lipschitz_steps_are_spectral() -> None:
    rng = np.random.default_rng(3)
    U, V = rng.random((5, 3)), rng.random((3, 7))
    su, sv = felb.lipschitz_steps(U, V)
    assert su == pytest.approx(1 / (1.1 * np.linalg.norm(V @ V.T, 2)), rel=1e-12)
    assert sv == pytest.approx(1 / (1.1 * np.linalg.norm(U.T @ U, 2)), rel=1e-12)
    # An all-zero block would have L = 0: the step is floored instead of infinite.
    assert np.isfinite(felb.lipschitz_steps(np.zeros((2, 3)), V)[1])


# -- the local iteration against the literal reference ---------------------------------------------


@pytest.mark.parametrize("rule", ["lipschitz", "mu"])
@pytest.mark.parametrize("seed", range(3))
def test_local_iterations_match_reference(rule: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, m, k = 4, 6, 3
    A = (rng.random((n, m)) < 0.5).astype(float)
    U, V, Vh = rng.random((n, k)), rng.random((k, m)), rng.random((k, m))
    kw = {"kappa": 0.02, "lam": 0.3, "gamma": 0.7}
    # One iteration from a given history (strong inertia so extrapolation and its clamp matter).
    Up, Vp = rng.random((n, k)), rng.random((k, m))
    got = felb.felb_iteration(A, U, V, Up, Vp, Vh, beta=0.3, step_rule=rule, **kw)
    want = iteration_reference(A, U, V, Up, Vp, Vh, beta=0.3, rule=rule, **kw)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-12)
    got_u, got_v = felb.felb_local(A, U, V, Vh, beta=1e-3, step_rule=rule, iterations=6, **kw)
    want_u, want_v = local_reference(A, U, V, Vh, beta=1e-3, rule=rule, iterations=6, **kw)
    np.testing.assert_allclose(got_u, want_u, rtol=0, atol=1e-12)
    np.testing.assert_allclose(got_v, want_v, rtol=0, atol=1e-12)
    assert got_u.min() >= 0 and got_u.max() <= 1 and got_v.min() >= 0 and got_v.max() <= 1


def test_felb_local_validates() -> None:
    A, U, V = np.zeros((2, 3)), np.zeros((2, 2)), np.zeros((2, 3))
    with pytest.raises(ValueError):
        felb.felb_local(A, U, V[:, :2], V, kappa=0, lam=0, gamma=0)
    with pytest.raises(ValueError):
        felb.felb_local(A, U, V, V, kappa=0, lam=0, gamma=0, beta=1.0)
    with pytest.raises(ValueError):
        felb.felb_local(A, U, V, V, kappa=0, lam=0, gamma=0, step_rule="adam", iterations=1)


def test_boolean_product() -> None:
    U = np.array([[0.9, 0.1], [0.4, 0.6], [0.2, 0.3]])
    V = np.array([[1.0, 0.7, 0.0], [0.0, 0.5, 0.49]])
    assert felb.boolean_product(U, V).tolist() == [[1, 1, 0], [0, 1, 0], [0, 0, 0]]


# -- 7. server strategy and the sum-only baselines -------------------------------------------------


def test_baseline_aggregators() -> None:
    S = np.array([0.0, 1.0, 2.0, 3.0, 4.0])  # sums of C = 4 Boolean uploads
    assert majority_vote(S, 4).tolist() == [0, 0, 1, 1, 1]
    assert rounded_mean(S, 4).tolist() == [0, 0, 0, 1, 1]  # ½ rounds to even: differs only at the tie
    assert logical_or(S, 4).tolist() == [0, 1, 1, 1, 1]
    rng = np.random.default_rng(4)
    for C in (3, 5, 8):
        uploads = (rng.random((C, 200)) < 0.5).astype(float)
        total = uploads.sum(axis=0)
        mv, rm = majority_vote(total, C), rounded_mean(total, C)
        np.testing.assert_array_equal(mv, (total >= C / 2).astype(np.uint8))
        tie = 2 * total == C
        np.testing.assert_array_equal(mv[~tie], rm[~tie])
        np.testing.assert_array_equal(logical_or(total, C), uploads.max(axis=0).astype(np.uint8))
    with pytest.raises(ValueError):
        majority_vote(S, 0)


def test_strategy_hand_example() -> None:
    st = FELBStrategy(rank=1, n_items=4, kappa=0.1, reg=1.0, reg_growth=2.0)
    assert isinstance(st, Strategy)
    assert st.kind == "felb" and st.vector_length == 4
    V = np.full((1, 4), 0.5)
    # Two devices' ΔV sum to 2·(mean − V̂) with mean = [0, 0.3, 0.7, 1.2].
    total = 2 * (np.array([0.0, 0.3, 0.7, 1.2]) - 0.5)
    new = st.aggregate(V, total, 2, np.random.default_rng(0), round_index=0)  # λ_0 = 1
    np.testing.assert_allclose(new, [[0.0, 0.1, 0.9, 1.0]], atol=1e-15)
    new1 = st.aggregate(V, total, 2, np.random.default_rng(0), round_index=1)  # λ_1 = 2
    np.testing.assert_allclose(new1, [[0.0, 0.2 / 3, 1 - 0.2 / 3, 1.0]], atol=1e-15)
    scaled = FELBStrategy(rank=1, n_items=4, kappa=0.1, reg=1.0, server_scale=0.5)  # prox_{κ/2, λ/2}
    np.testing.assert_allclose(
        scaled.aggregate(V, total, 2, np.random.default_rng(0), round_index=0),
        [[0.0, 0.25 / 1.5, 1 - 0.25 / 1.5, 1.0]],
        atol=1e-15,
    )
    wire = st.to_wire(new)
    assert set(wire) == {"values"}
    np.testing.assert_array_equal(st.from_wire(b"", wire["values"]), new)
    with pytest.raises(ValueError):
        st.from_wire(b"", wire["values"][:-8])
    with pytest.raises(ValueError):
        st.from_wire(b"x", wire["values"])
    with pytest.raises(ValueError):
        st.from_wire(b"", np.full(4, 1.5).tobytes())
    with pytest.raises(ValueError):
        st.aggregate(V, total[:3], 2, np.random.default_rng(0), round_index=0)
    assert "2 rounded entries changed" in st.describe(
        np.array([[0.4, 0.6, 0.4, 0.6]]), np.array([[0.6, 0.4, 0.4, 0.6]])
    )
    # The plan is a valid RoundInvite, and λ_r stays finite on a long-running server.
    plan = felb_plan(st, 3, 7)
    assert (plan.kind, plan.rank, plan.n_items, plan.params.reg_growth) == ("felb", 1, 4, 2.0)
    assert st.reg_at(100_000) == 1e12


# -- the device model --------------------------------------------------------------------------------


def _model_with_global(k: int = 3, m: int = 12, seed: int = 0) -> tuple[FELBModel, FELBStrategy, np.ndarray]:
    st = FELBStrategy(rank=k, n_items=m, local_epochs=4)
    V = st.initialize(np.random.default_rng(seed))
    model = FELBModel(m, FELBConfig(rank=k))
    model.set_global(b"", st.to_wire(V)["values"], 1)
    return model, st, V


def test_local_update_is_delta_and_deterministic() -> None:
    rng = np.random.default_rng(5)
    A = (rng.random((5, 12)) < 0.4).astype(np.uint8)
    data = binary_ratings(A)
    a, st, V = _model_with_global()
    b, _, _ = _model_with_global()
    assert isinstance(a, FederatedModel)
    plan = felb_plan(st, 1, 0)
    ra = a.local_update(plan, data, np.random.default_rng(11))
    rb = b.local_update(plan, data, np.random.default_rng(11))
    assert ra.vector.shape == (36,) and ra.examples == 60
    np.testing.assert_array_equal(ra.vector, rb.vector)
    # The upload is V_i − V̂ after b local iterations from U ~ Uniform[0,1] (drawn from the rng).
    U0 = np.random.default_rng(11).random((5, 3))
    U, Vi = felb.felb_local(A, U0, V, V, kappa=1e-3, lam=0.1, gamma=1.0, beta=1e-3, iterations=4)
    np.testing.assert_allclose(ra.vector, (Vi - V).ravel(), atol=1e-15)
    assert a.user_factors is not None
    np.testing.assert_allclose(a.user_factors, U, atol=1e-15)
    c, _, _ = _model_with_global()
    rc = c.local_update(plan, data, np.random.default_rng(12))
    assert not np.array_equal(rc.vector, ra.vector)
    # U persists: a second round uses no randomness.
    r2 = a.local_update(plan, data, np.random.default_rng(99))
    r3 = b.local_update(plan, data, np.random.default_rng(7))
    np.testing.assert_array_equal(r2.vector, r3.vector)


def test_local_update_rejects_mismatched_plans() -> None:
    model, st, _ = _model_with_global()
    data = binary_ratings(np.eye(2, 12))
    rng = np.random.default_rng(0)
    for bad in (
        FELBStrategy(rank=4, n_items=12),
        FELBStrategy(rank=3, n_items=11),
    ):
        with pytest.raises(ValueError):
            model.local_update(felb_plan(bad, 1, 0), data, rng)
    with pytest.raises(ValueError):
        model.local_update(felb_plan(st, 2, 0), data, rng)  # the device holds version 1
    fresh = FELBModel(12, FELBConfig(rank=3))
    with pytest.raises(ModelError):
        fresh.local_update(felb_plan(st, 0, 0), data, rng)
    with pytest.raises(ValueError):
        model.set_global(b"", np.full(36, 2.0).tobytes(), 2)
    with pytest.raises(ValueError):
        model.set_global(b"", b"\0" * 8, 2)


def test_binarize_threshold() -> None:
    cfg = FELBConfig(rank=2, binarize_at=4.0)
    data = LocalRatings.single_user([0, 1, 2, 3], [5.0, 4.0, 3.5, 1.0])
    assert cfg.binarize(data, 5).tolist() == [[1, 1, 0, 0, 0]]
    assert cfg.binarize(LocalRatings.single_user([0, 3]), 5).tolist() == [[1, 0, 0, 1, 0]]


def test_fold_in_and_recommend() -> None:
    # Two Boolean components over 10 items; a user liking items 0–2 belongs to component 0.
    V = np.zeros((2, 10))
    V[0, :5] = 1.0
    V[1, 5:] = 1.0
    model = FELBModel(10, FELBConfig(rank=2))
    with pytest.raises(ModelError):
        model.fold_in([0, 1, 2])
    model.set_global(b"", V.tobytes(), 4)
    with pytest.raises(ModelError):
        model.recommend([0])
    u = model.fold_in([0, 1, 2])
    assert u[0] > 0.5 and u[1] < 0.1  # rounds to component 0 (u₀ → (3 + λ)/(5 + λ) as λ grows)
    ids, scores = model.recommend([0, 1, 2], N=3)
    assert set(ids[:2].tolist()) == {3, 4}  # the rest of component 0 (tied: in random order)
    assert scores[0] > 0.5 and scores[2] < 0.1
    ids, _ = model.recommend([0, 1, 2], N=20, filter_items=[3])
    assert ids.size == 6 and 3 not in ids and 0 not in ids
    ids, _ = model.recommend([0], N=2, filter_already_liked_items=False, items=[0, 7, 8])
    assert ids[0] == 0 and ids[1] in (7, 8)  # 7 and 8 tie: one of them at random
    assert model.reconstruct().tolist() == [[1] * 5 + [0] * 5]
    # A second user is added as a new row.
    model.fold_in([6, 7, 8], userid=1)
    assert set(model.recommend([6, 7, 8], N=2, userid=1)[0].tolist()) == {5, 9}
    with pytest.raises(ValueError):
        model.recommend(N=1, userid=5)


def test_save_load_round_trip(tmp_path: Path) -> None:
    model, st, _ = _model_with_global()
    path = tmp_path / "felb.store"
    model.save(path)
    empty = FELBModel.load(path)
    assert empty.user_factors is None and empty.model_version == 1
    rng = np.random.default_rng(6)
    model.local_update(felb_plan(st, 1, 0), binary_ratings(rng.random((3, 12)) < 0.5), rng)
    model.save(path)
    back = FELBModel.load(path)
    assert back.config == model.config and back.model_version == 1
    np.testing.assert_array_equal(back.item_factors, model.item_factors)
    assert back.user_factors is not None and model.user_factors is not None
    np.testing.assert_array_equal(back.user_factors, model.user_factors)
    assert back.recommend(N=5, userid=2)[0].tolist() == model.recommend(N=5, userid=2)[0].tolist()
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(StorageError):
        FELBModel.load(path)
    bad = tmp_path / "bad.store"
    save_store(bad, "felb", {"config": {"rank": 3}, "n_items": 12, "model_version": 1, "item_factors": b"xx"})
    with pytest.raises(StorageError):
        FELBModel.load(bad)


# -- metrics and the synthetic recipe ---------------------------------------------------------------


def test_metrics_known_values() -> None:
    assert f1_score([[1, 1, 0, 0]], [[1, 0, 1, 0]]) == pytest.approx(0.5)
    Vt = np.array([[1, 1, 0, 0], [0, 0, 1, 1]])
    assert factor_f1(np.array([[0.2, 0.1, 0.9, 0.8], [0.9, 0.6, 0.0, 0.0]]), Vt) == 1.0
    assert factor_f1(np.array([[0.9, 0.9, 0.9, 0.0]]), Vt) == pytest.approx((0.8 + 0.0) / 2)
    blocks = [np.array([[1, 0], [0, 0]]), np.array([[1, 1]])]
    assert sigma_rmsd(blocks) == pytest.approx(0.5 + 1.0)
    assert sigma_rmsd(blocks, [np.array([[1, 0], [0, 0]]), np.array([[0, 1]])]) == pytest.approx(np.sqrt(0.5))


@pytest.mark.parametrize("p, rules", [(0.0, ("lipschitz",)), (0.1, ("lipschitz", "mu"))])
def test_synthetic_recovery(p: float, rules: tuple[str, ...]) -> None:
    out = {}
    for rule in rules:
        rng = np.random.default_rng(2024)
        planted = planted_binary(10, 100, 100, 5, xor_noise=p, rng=rng)
        st = FELBStrategy(rank=5, n_items=100, step_rule=rule)
        run = run_felb(planted.clients, st, rounds=100, rng=rng)
        out[rule] = evaluate_felb(run, planted.clients, signal=planted.signal, planted_v=planted.v)
    for met in out.values():
        if p == 0.0:
            assert met.f1 >= 0.90
        else:
            assert met.f1_star >= 0.90 and met.factor_f1 >= 0.95
            assert met.rmsd <= 0.8 * met.zero_rmsd
        assert met.gap <= 0.05
    if len(out) == 2:
        assert abs(out["lipschitz"].f1_star - out["mu"].f1_star) <= 0.05
        assert abs(out["lipschitz"].factor_f1 - out["mu"].factor_f1) <= 0.05


def test_synthetic_with_upload_noise_and_negative_control() -> None:
    rng = np.random.default_rng(7)
    planted = planted_binary(10, 100, 100, 5, xor_noise=0.1, rng=rng)
    st = FELBStrategy(rank=5, n_items=100)
    noisy = run_felb(planted.clients, st, rounds=100, rng=np.random.default_rng(8), noise_sigma=0.2)
    met = evaluate_felb(noisy, planted.clients, signal=planted.signal, planted_v=planted.v)
    assert met.f1_star >= 0.85
    # Negative control: no rounds leaves the random initial V̂, which explains nothing.
    none = run_felb(planted.clients, st, rounds=0, rng=np.random.default_rng(8))
    assert none.models[0].user_factors is None
    assert factor_f1(none.item_factors, planted.v) < 0.6
