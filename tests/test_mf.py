"""Real-valued MF with embedding clipping: the vectorised kernels against slow literal references
(tests/mf_reference.py), the clipping and sensitivity invariants, the device model's contract and
persistence, the server strategy, in-process federation on planted data, and the privacy figures."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st

from agg_server.strategy.base import Strategy, round_plan
from agg_server.strategy.mf import MFStrategy
from device_sdk import mf
from device_sdk.family import FederatedModel, LocalRatings
from device_sdk.mf import MFConfig, MFModel
from device_sdk.store import save_store
from fedsim.data.ratings import Ratings
from fedsim.federation.mf import (
    MFSchedule,
    centralized_mf,
    evaluate_mf,
    mf_epsilons,
    mf_sensitivity,
    run_federated_mf,
)
from protocol.accounting import compute_epsilon
from protocol.errors import ModelError, StorageError
from protocol.messages import RoundInvite
from protocol.plan import LightFRParams, MFParams
from tests.mf_reference import (
    aggregate_reference,
    item_gradient_reference,
    project_reference,
    user_step_reference,
)

R = 5.0


def _in_set(X: np.ndarray, R: float = R) -> bool:
    return bool(X.min() >= 0 and np.einsum("ij,ij->i", X, X).max() <= R * (1 + 1e-12))


def _examples(rng: np.random.Generator, n: int, m: int, per_user: int):
    counts = rng.integers(0, per_user + 1, n)
    users = np.repeat(np.arange(n), counts).astype(np.int64)
    items = np.concatenate([rng.choice(m, c, replace=False) for c in counts]).astype(np.int64)
    r = rng.integers(0, 11, users.size) / 2.0  # 0, 0.5, ..., 5
    return users, items, r


def _invite(m: int, f: int, example_cap: int = 0, **plan) -> RoundInvite:
    base = {"learning_rate": 0.1, "reg": 0.0, "max_norm2": R, "pretrain_epochs": 5, "local_epochs": 1}
    base.update(plan)
    return RoundInvite(
        round_id=1,
        device_id=1,
        vector_length=m * f,
        graph_k=1,
        graph_t=1,
        clip_norm=1.0,
        scale_bits=0,
        advertise_deadline=0.0,
        share_keys_deadline=0.0,
        masked_input_deadline=0.0,
        unmask_deadline=0.0,
        model_kind="mf",
        bits=f,
        n_items=m,
        example_cap=example_cap,
        params=MFParams(**base),
    )


# -- kernels against the references ------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), f=st.sampled_from([1, 2, 5, 8]), spread=st.sampled_from([0.1, 1.0, 10.0]))
def test_projection_matches_reference_and_lands_in_the_set(seed: int, f: int, spread: float) -> None:
    rng = np.random.default_rng(seed)
    X = rng.normal(0.0, spread, (7, f))
    got = mf.project_rows(X, R)
    assert np.allclose(got, project_reference(X, R), rtol=1e-12, atol=1e-15)
    assert _in_set(got)
    assert np.allclose(mf.project_rows(got, R), got, rtol=1e-12, atol=0)  # idempotent
    # Lemma 3: Π(x) is the closest point of the set; no random feasible point is closer.
    feasible = mf.project_rows(np.abs(rng.normal(0.0, 2.0, (200, f))), R)
    for i in range(X.shape[0]):
        assert np.linalg.norm(X[i] - got[i]) <= np.linalg.norm(X[i] - feasible, axis=1).min() + 1e-12


def test_projection_leaves_feasible_rows_untouched() -> None:
    X = np.array([[1.0, 2.0], [0.0, 0.0], [2.0, 1.0], [0.5, 0.0]])
    assert np.array_equal(mf.project_rows(X, R), X)
    assert np.allclose(
        mf.project_rows(np.array([[-1.0, 3.0], [3.0, 4.0]]), R),
        [[0.0, math.sqrt(5)], [3 / 5 * math.sqrt(5), 4 / 5 * math.sqrt(5)]],
    )
    with pytest.raises(ValueError, match="R"):
        mf.project_rows(X, 0.0)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), f=st.sampled_from([1, 3, 8]), reg=st.sampled_from([0.0, 0.05]))
def test_user_step_matches_reference(seed: int, f: int, reg: float) -> None:
    rng = np.random.default_rng(seed)
    n, m = 6, 12
    users, items, r = _examples(rng, n, m, 5)
    U = mf.project_rows(rng.normal(0.5, 1.0, (n, f)), R)
    V = mf.project_rows(rng.normal(0.5, 1.0, (m, f)), R)
    got = mf.user_step(U, V, users, items, r, 0.1, reg, R)
    want = user_step_reference(U, V, users, items, r, 0.1, reg, R)
    assert np.allclose(got, want, rtol=1e-12, atol=1e-13)
    absent = np.setdiff1d(np.arange(n), users)
    assert np.array_equal(got[absent], U[absent])  # users without examples are not touched
    assert _in_set(got)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), f=st.sampled_from([1, 4, 9]))
def test_item_gradient_sum_matches_reference(seed: int, f: int) -> None:
    rng = np.random.default_rng(seed)
    n, m = 5, 11
    users, items, r = _examples(rng, n, m, 6)
    U = mf.project_rows(rng.random((n, f)) * 2, R)
    V = mf.project_rows(rng.random((m, f)) * 2, R)
    got = mf.item_gradient_sum(U, V, users, items, r)
    assert got.shape == (m * f,) and got.dtype == np.float64
    assert np.allclose(got.reshape(m, f), item_gradient_reference(U, V, users, items, r), rtol=1e-12, atol=1e-12)
    unrated = np.setdiff1d(np.arange(m), items)
    assert not got.reshape(m, f)[unrated].any()  # only rated rows are non-zero


def test_descent_pretraining_lowers_the_user_loss() -> None:
    rng = np.random.default_rng(4)
    m, f = 30, 4
    V = mf.project_rows(rng.random((m, f)) * 1.5, R)
    items = np.arange(0, 30, 2, dtype=np.int64)
    users = np.zeros(items.size, dtype=np.int64)
    r = np.clip(V[items] @ np.array([1.0, 0.5, 0.0, 1.2]), 0, R)  # a reachable target
    U0 = mf.initial_factors(1, f, R, 0.1, rng)
    losses = [
        mf.example_rmse(mf.fit_users(U0, V, users, items, r, 0.1, 0.0, R, e), V, users, items, r)
        for e in (0, 5, 50, 500)
    ]
    assert all(b <= a + 1e-12 for a, b in zip(losses, losses[1:], strict=False))
    assert losses[-1] < 0.05 * losses[0]


# -- sensitivity -----------------------------------------------------------------------------------


def test_gradient_norm_bound_holds_for_adversarial_inputs_and_is_tight() -> None:
    rng = np.random.default_rng(0)
    m, f, theta = 40, 6, 3
    worst = 2 * R**1.5
    for _trial in range(20):
        model = MFModel(m, MFConfig(factors=f, max_norm2=R), n_users=1, rng=rng)
        # A malicious server: huge, negative, spiky item rows.  The device projects them.
        V = rng.normal(0.0, 10.0 ** rng.integers(0, 6), (m, f))
        model.set_global(b"", V.astype("<f8").tobytes(), 2)
        assert _in_set(model.item_factors)
        items = rng.choice(m, 15, replace=False)
        ratings = rng.choice([0.0, R], 15)  # extreme ratings maximise |r − u·v|
        inv = _invite(m, f, learning_rate=float(rng.choice([0.0, 0.1, 10.0])), example_cap=theta)
        out = model.local_update(inv.plan, LocalRatings.single_user(items, ratings), rng)
        rows = out.vector.reshape(m, f)
        assert (np.linalg.norm(rows, axis=1) <= worst * (1 + 1e-12)).all()
        assert np.linalg.norm(out.vector) <= theta * worst * (1 + 1e-12)
        assert np.count_nonzero(np.abs(rows).sum(axis=1)) <= theta
        assert _in_set(model.user_factors) and out.examples == theta
    # Tight: u = v = √R·e_1 and r = 0 give exactly 2R^{3/2}.
    U = np.zeros((1, f))
    U[0, 0] = math.sqrt(R)
    g = mf.item_gradient_sum(U, U.copy(), np.array([0]), np.array([0]), np.array([0.0]))
    assert np.linalg.norm(g) == pytest.approx(worst, rel=1e-12)


def test_sensitivity_and_epsilons() -> None:
    s = mf_sensitivity(10, 5.0)
    assert s.per_rating == pytest.approx(2 * 5**1.5) and s.per_user == pytest.approx(10 * 2 * 5**1.5)
    assert mf_sensitivity(10, 5.0, negatives=1).per_user == pytest.approx(2 * s.per_user)
    with pytest.raises(ValueError, match="theta"):
        mf_sensitivity(0, 5.0)
    e = mf_epsilons(1e8, 10, 10, 5.0, 32, 50, 1e-5)
    l2_user = 2**10 * s.per_user + math.sqrt(10 * 32)
    assert e.l2_user == pytest.approx(l2_user) and e.l1_user == pytest.approx(math.sqrt(320) * l2_user)
    assert e.l2_rating == pytest.approx(2**10 * s.per_rating + math.sqrt(32))
    assert e.per_user == pytest.approx(compute_epsilon(1e8, e.l1_user, e.l2_user, 50, 1e-5))
    assert 0 < e.per_rating < e.per_user
    assert mf_epsilons(4e8, 10, 10, 5.0, 32, 50, 1e-5).per_user < e.per_user  # more noise, less ε
    capped = mf_epsilons(1e8, 10, 10, 5.0, 32, 50, 1e-5, clip_norm=1.0)
    assert capped.l2_user == pytest.approx(2**10 + math.sqrt(320)) and capped.per_user < e.per_user


# -- the device model ------------------------------------------------------------------------------


def test_local_update_is_deterministic_given_the_generator_and_trims() -> None:
    m, f, theta = 50, 4, 5
    rng = np.random.default_rng(1)
    data = LocalRatings(
        users=np.repeat(np.arange(3), [20, 3, 12]).astype(np.int64),
        items=np.concatenate([rng.choice(m, 20, False), rng.choice(m, 3, False), rng.choice(m, 12, False)]),
        ratings=rng.integers(1, 6, 35).astype(np.float64),
        n_users=3,
    )
    inv = _invite(m, f, example_cap=theta)

    def run(seed: int):
        model = MFModel(m, MFConfig(factors=f), n_users=3, rng=np.random.default_rng(7))
        return model.local_update(inv.plan, data, np.random.default_rng(seed)), model

    (a, ma), (b, mb), (c, _) = run(11), run(11), run(12)
    assert np.array_equal(a.vector, b.vector) and np.array_equal(ma.user_factors, mb.user_factors)
    assert not np.array_equal(a.vector, c.vector)  # another draw of the θ kept ratings
    assert a.examples == 5 + 3 + 5 and a.info["kept_ratings"] == 13 and a.info["pretrained"] == 3
    assert ma.user_trained.all()
    # cross-silo: the upload is the sum over users, each trimmed to θ
    keep = mf.trim_per_user(data.users, theta, np.random.default_rng(3))
    assert np.bincount(data.users[keep], minlength=3).tolist() == [5, 3, 5]
    assert np.array_equal(mf.trim_per_user(data.users, 0, np.random.default_rng(3)), np.arange(35))
    # every rating is kept with about the same probability (uniform trimming)
    g = np.random.default_rng(5)
    hits = np.zeros(20)
    for _ in range(400):
        hits += np.bincount(mf.trim_per_user(np.zeros(20, np.int64), 5, g), minlength=20)
    assert np.allclose(hits / 400, 0.25, atol=0.08)


def test_local_update_with_negatives_and_refusals() -> None:
    m, f = 30, 3
    model = MFModel(m, MFConfig(factors=f), rng=np.random.default_rng(0))
    items = np.array([1, 2, 3])
    res = model.local_update(
        _invite(m, f, negatives=2).plan, LocalRatings.single_user(items, [5.0, 4.0, 1.0]), np.random.default_rng(0)
    )
    assert res.examples == 9
    nz = np.flatnonzero(np.abs(res.vector.reshape(m, f)).sum(axis=1))
    assert set(items) <= set(nz) and nz.size <= 9
    with pytest.raises(ValueError, match=r"\[0, R\]"):
        model.local_update(_invite(m, f).plan, LocalRatings.single_user([1], [6.0]), np.random.default_rng(0))
    with pytest.raises(ValueError, match="lightfr"):
        model.local_update(
            dataclasses.replace(_invite(m, f), model_kind="lightfr", params=LightFRParams(unobserved_weight=0.0)).plan,
            LocalRatings.single_user([1], [3.0]),
            np.random.default_rng(0),
        )
    with pytest.raises(ValueError, match="rank"):
        model.local_update(_invite(m, f + 1).plan, LocalRatings.single_user([1], [3.0]), np.random.default_rng(0))
    with pytest.raises(ValueError, match="bytes"):
        model.set_global(b"", b"\x00" * 8, 1)
    with pytest.raises(ValueError, match="words"):
        model.set_global(b"\x01", np.zeros(m * f).tobytes(), 1)


def test_model_implements_the_family_protocol() -> None:
    model = MFModel(10, MFConfig(factors=3), rng=np.random.default_rng(0))
    assert isinstance(model, FederatedModel) and model.KIND == "mf" and model.rank == 3


def _checkerboard_train(n_users: int = 40, n_items: int = 20) -> Ratings:
    """Even users rate even items 5 and odd items 1; odd users the reverse (every pair observed)."""
    uu, ii = np.meshgrid(np.arange(n_users), np.arange(n_items), indexing="ij")
    r = np.where((uu + ii) % 2 == 0, 5.0, 1.0)
    return Ratings(
        users=uu.ravel().astype(np.int64),
        items=ii.ravel().astype(np.int64),
        ratings=r.ravel(),
        timestamps=None,
        n_users=n_users,
        n_items=n_items,
        user_ids=np.arange(n_users),
        item_ids=np.arange(n_items),
    )


@pytest.fixture(scope="module")
def trained_items() -> np.ndarray:
    train = _checkerboard_train()
    strategy = MFStrategy(20, rank=4, server_lr=0.5, pretrain_epochs=20, init_scale=0.5)
    return run_federated_mf(train, strategy, MFSchedule(rounds=40, seed=0, fine_tune_epochs=0)).item_factors


def _model_with(V: np.ndarray, n_users: int = 1) -> MFModel:
    model = MFModel(
        V.shape[0], MFConfig(factors=V.shape[1], pretrain_epochs=200), n_users=n_users, rng=np.random.default_rng(0)
    )
    model.set_global(b"", V.astype("<f8").tobytes(), 1)
    return model


class TestMFContract:
    """The recommend contract of tests/test_device_model.py, for MF."""

    def test_withheld_item_liked_by_similar_users_ranks_first(self, trained_items: np.ndarray) -> None:
        model = _model_with(trained_items)
        liked = np.arange(2, 20, 2)  # an "even" user who has not seen item 0
        model.fold_in(np.r_[liked, [1, 3]], np.r_[np.full(liked.size, 5.0), [1.0, 1.0]])
        ids, scores = model.recommend(np.r_[liked, [1, 3]], N=5)
        assert ids[0] == 0 and scores[0] > 4.0
        assert np.all(np.diff(scores) <= 0)
        assert not np.isin(ids, np.r_[liked, [1, 3]]).any()
        assert model.predict([0, 5])[0] > model.predict([0, 5])[1]

    def test_recommend_filters_and_batches(self, trained_items: np.ndarray) -> None:
        model = _model_with(trained_items)
        model.fold_in(np.arange(0, 20, 2), np.full(10, 5.0))
        ids, _ = model.recommend(np.arange(0, 20, 2), N=20)
        assert ids.size == 10 and set(ids) == set(range(1, 20, 2))
        ids, _ = model.recommend(np.array([2]), N=20, filter_items=np.array([0, 4]))
        assert not np.isin(ids, [0, 2, 4]).any() and ids.size == 17
        ids, _ = model.recommend(np.array([2]), N=20, filter_already_liked_items=False)
        assert 2 in ids and ids.size == 20
        ids, _ = model.recommend(None, N=3, items=np.array([1, 3, 5, 7]))
        assert set(ids) <= {1, 3, 5, 7} and ids.size == 3
        ids, _ = model.recommend(sp.csr_matrix(np.eye(20)[[2]]), N=5)
        assert 2 not in ids and ids.size == 5

    def test_batch_recommend_pads(self, trained_items: np.ndarray) -> None:
        model = _model_with(trained_items, n_users=3)
        for u, liked in enumerate([np.arange(0, 20, 2), np.arange(1, 20, 2), np.arange(19)]):
            model.fold_in(liked, np.full(liked.size, 5.0), userid=u)
        ids, scores = model.recommend(
            [np.arange(0, 20, 2), np.arange(1, 20, 2), np.arange(19)], N=2, userid=np.arange(3)
        )
        assert ids.shape == (3, 2) and ids[2].tolist() == [19, -1] and scores[2, 1] == -np.inf

    def test_ties_are_broken_at_random(self) -> None:
        V = np.ones((6, 2))  # every item scores the same
        model = _model_with(V)
        model.fold_in([0], [2.0])
        firsts = {int(model.recommend(None, N=1, rng=np.random.default_rng(s))[0][0]) for s in range(40)}
        assert firsts == set(range(6))

    def test_misuse_raises(self, trained_items: np.ndarray) -> None:
        model = _model_with(trained_items)
        with pytest.raises(ModelError):
            model.recommend(np.array([1]))  # no user vector trained yet
        model.fold_in(np.array([1, 2]), np.array([5.0, 5.0]))
        with pytest.raises(ValueError, match="out of range"):
            model.recommend(np.array([99]))
        with pytest.raises(ValueError):
            model.recommend(np.array([1]), N=-1)
        with pytest.raises(ValueError, match="userid"):
            model.recommend(np.array([1]), userid=3)
        with pytest.raises(ValueError, match="at least one"):
            model.fold_in(np.array([], dtype=np.int64))


def test_config_validation_names_the_field() -> None:
    for kwargs, word in [
        ({"factors": 0}, "factors"),
        ({"max_norm2": 0.0}, "max_norm2"),
        ({"learning_rate": -1.0}, "learning_rate"),
        ({"example_cap": -1}, "example_cap"),
    ]:
        with pytest.raises(ValueError, match=word):
            MFConfig(**kwargs)  # type: ignore[arg-type]


# -- persistence -----------------------------------------------------------------------------------


def _saved_model(tmp_path: Path) -> tuple[MFModel, Path]:
    model = MFModel(25, MFConfig(factors=5), n_users=2, rng=np.random.default_rng(2))
    model.set_global(b"", mf.project_rows(np.random.default_rng(3).random((25, 5)) * 2, R).tobytes(), 9)
    model.fold_in([1, 2, 3], [5.0, 3.0, 1.0], userid=1)
    path = tmp_path / "mf.fedrec"
    model.save(path)
    return model, path


def test_save_load_roundtrip(tmp_path: Path) -> None:
    model, path = _saved_model(tmp_path)
    back = MFModel.load(path, rng=np.random.default_rng(0))
    assert back.config == model.config and back.model_version == 9
    assert np.array_equal(back.item_factors, model.item_factors) and np.array_equal(
        back.user_factors, model.user_factors
    )
    assert back.user_trained.tolist() == [False, True]
    a, sa = model.recommend([1, 2, 3], N=10, userid=1, rng=np.random.default_rng(1))
    b, sb = back.recommend([1, 2, 3], N=10, userid=1, rng=np.random.default_rng(1))
    assert np.array_equal(a, b) and np.array_equal(sa, sb)


def test_corrupt_or_invalid_file_raises_storage_error(tmp_path: Path) -> None:
    _, path = _saved_model(tmp_path)
    data = bytearray(path.read_bytes())
    data[len(data) - 50] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(StorageError, match="corrupt"):
        MFModel.load(path)
    assert (tmp_path / "mf.fedrec.corrupt-1").exists()
    # A well-formed file whose factors break the clipping constraint is refused, naming the problem.
    bad = tmp_path / "bad.fedrec"
    state = {
        "config": {"factors": 2, "max_norm2": 5.0},
        "n_items": 3,
        "n_users": 1,
        "model_version": 1,
        "item_factors": np.array([[1.0, 1.0], [-1.0, 0.0], [0.0, 0.0]]).tobytes(),
        "user_factors": np.zeros(2).tobytes(),
        "user_trained": b"\x00",
    }
    save_store(bad, "fedrec.mf-model", state)
    with pytest.raises(StorageError, match="clipping constraint"):
        MFModel.load(bad)
    save_store(bad, "fedrec.mf-model", {**state, "item_factors": b"\x00" * 7})
    with pytest.raises(StorageError, match="bytes"):
        MFModel.load(bad)
    save_store(bad, "lightfr", state)
    with pytest.raises(StorageError, match="expected 'fedrec.mf-model'"):
        MFModel.load(bad)


# -- the server strategy ---------------------------------------------------------------------------


def test_strategy_contract_wire_and_plan() -> None:
    s = MFStrategy(n_items=7, rank=3, server_lr=0.5)
    assert isinstance(s, Strategy) and s.kind == "mf" and s.vector_length == 21
    V = s.initialize(np.random.default_rng(0))
    assert V.shape == (7, 3) and _in_set(V) and np.array_equal(V, s.initialize(np.random.default_rng(0)))
    wire = s.to_wire(V)
    assert set(wire) == {"values"} and np.array_equal(s.from_wire(b"", wire["values"]), V)
    with pytest.raises(ValueError, match="bytes"):
        s.from_wire(b"", wire["values"][:-8])
    with pytest.raises(ValueError, match="words"):
        s.from_wire(b"\x00", wire["values"])
    names = ("learning_rate", "reg", "max_norm2", "pretrain_epochs", "local_epochs", "negatives")
    assert {f.name for f in dataclasses.fields(s.plan())} == set(names)
    record = round_plan(s, 1).record()
    inv = _invite(7, 3, **{k: record[k] for k in names})  # every name is an MFParams field with a valid value
    assert inv.params == s.plan() and inv.plan.params == s.plan()
    assert "mean |ΔV|" in s.describe(V, V)


def test_strategy_aggregate_hand_computed() -> None:
    s = MFStrategy(n_items=2, rank=2, max_norm2=4.0, server_lr=2.0)
    V = np.array([[1.0, 1.0], [0.5, 0.0]])
    total = np.array([-4.0, 2.0, 1.0, -30.0])
    # V − 2/2 · total = [[5, −1], [−0.5, 30]] → clip negatives → [[5, 0], [0, 30]] → norm² ≤ 4 → [[2, 0], [0, 2]]
    new = s.aggregate(V, total, 2, np.random.default_rng(0), round_index=0)
    assert np.array_equal(new, [[2.0, 0.0], [0.0, 2.0]])
    small = s.aggregate(V, np.array([0.2, 0.4, 0.0, 0.0]), 4, np.random.default_rng(0), round_index=3)
    assert np.allclose(small, [[0.9, 0.8], [0.5, 0.0]], rtol=0, atol=1e-15)
    rng = np.random.default_rng(1)
    for _ in range(5):
        V = s.initialize(rng)
        total = rng.normal(0, 3, 4)
        got = s.aggregate(V, total, 3, rng, round_index=0)
        assert np.allclose(got, aggregate_reference(V, total, 3, 2.0, 4.0), rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match="survivors"):
        s.aggregate(V, total, 0, rng, round_index=0)
    with pytest.raises(ValueError, match="elements"):
        s.aggregate(V, total[:3], 1, rng, round_index=0)
    with pytest.raises(ValueError, match="elements"):  # the contract's sum is a (vector_length,) vector
        s.aggregate(V, total.reshape(2, 2), 1, rng, round_index=0)
    with pytest.raises(ValueError, match="non-finite"):
        s.aggregate(V, np.array([0.0, np.nan, 0.0, 0.0]), 1, rng, round_index=0)


# -- federation on planted data ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def planted() -> tuple[Ratings, Ratings]:
    """Ratings 1 + 4·(u*·v*)/3 with u*, v* ∈ [0, 1]^3 (a non-negative rank-4 matrix), 30% observed,
    one in ten observed ratings held out."""
    rng = np.random.default_rng(42)
    n, m = 200, 80
    Us, Vs = rng.random((n, 3)), rng.random((m, 3))
    full = 1.0 + 4.0 * (Us @ Vs.T) / 3.0
    users, items = np.nonzero(rng.random((n, m)) < 0.3)
    test = rng.random(users.size) < 0.1

    def part(mask: np.ndarray) -> Ratings:
        u, i = users[mask].astype(np.int64), items[mask].astype(np.int64)
        return Ratings(u, i, full[u, i], None, n, m, np.arange(n), np.arange(m))

    return part(~test), part(test)


def _mean_baseline(train: Ratings, test: Ratings) -> float:
    return float(np.sqrt(np.mean((test.ratings - train.ratings.mean()) ** 2)))


@pytest.mark.parametrize("silos", [0, 5])
def test_federated_run_learns_planted_structure(planted: tuple[Ratings, Ratings], silos: int) -> None:
    train, test = planted
    # γ applies to the mean upload: a silo's upload sums its 40 users, so it gets a ~40× smaller step.
    lr = 2.0 if silos == 0 else 0.1
    strategy = MFStrategy(train.n_items, rank=8, server_lr=lr, pretrain_epochs=30, init_scale=0.3)
    schedule = MFSchedule(rounds=60, fraction=0.6 if silos == 0 else 1.0, example_cap=10, silos=silos, seed=1)
    reports = []
    state = run_federated_mf(train, strategy, schedule, on_round=reports.append)
    assert len(reports) == 60 and reports[-1].train_rmse < reports[0].train_rmse
    assert reports[0].clients == (120 if silos == 0 else 5)
    assert _in_set(state.item_factors) and _in_set(state.user_factors)
    ev = evaluate_mf(state.user_factors, state.item_factors, test)
    assert ev.rmse < 0.5 * _mean_baseline(train, test), (ev.rmse, _mean_baseline(train, test))
    again = run_federated_mf(train, strategy, schedule)
    assert np.array_equal(again.item_factors, state.item_factors)  # reproducible from the seed


def test_centralized_reference_learns_planted_structure(planted: tuple[Ratings, Ratings]) -> None:
    train, test = planted
    U, V = centralized_mf(train, factors=8, epochs=40, learning_rate=0.02, init_scale=0.3, rng=np.random.default_rng(0))
    assert _in_set(U) and _in_set(V)
    assert evaluate_mf(U, V, test).rmse < 0.5 * _mean_baseline(train, test)
