"""Federated implicit ALS: the device's user step and the server's item solve against direct per-row solves, the
upload layout, a run on a small synthetic set, the same rounds through SecAgg+ against the plain federation,
and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from agg_server.config import ServerConfig, config_from_dict
from agg_server.coordinator import RoundCoordinator
from agg_server.storage import Storage
from agg_server.strategy import build_strategy
from agg_server.strategy.base import round_plan
from agg_server.strategy.ials import IALSStrategy, solve_items
from device_sdk.family import LocalRatings
from device_sdk.ials import IALSConfig, IALSModel, solve_users, upload_sums, user_item_csr
from fedsim.cli import main
from fedsim.data.ratings import Ratings
from fedsim.evaluation.experiment import baselines, prepare
from fedsim.federation.ials import IALSSchedule, run_federated_ials, select_and_train, validation_metric
from fedsim.private.coordinator_rounds import run_private
from protocol.errors import ConfigError
from protocol.families.ials import IALSLayout
from protocol.plan import IALSParams, TrainingPlan

M, D = 30, 4


def _random_log(rng: np.random.Generator, n_users: int = 12, nnz: int = 90) -> tuple[np.ndarray, np.ndarray]:
    return rng.integers(0, n_users, nnz), rng.integers(0, M, nnz)


# -- kernels against the obvious per-row solves --------------------------------------------------------


@pytest.mark.parametrize("budget", [40, 1 << 22])  # many small chunks, one chunk
def test_user_step_is_the_exact_per_user_solve(budget: int) -> None:
    rng = np.random.default_rng(0)
    V = rng.normal(size=(M, D))
    users, items = _random_log(rng)
    users = np.r_[users, users[:5]]  # repeated pairs count once
    items = np.r_[items, items[:5]]
    indptr, cols = user_item_csr(users, items, 13, M)  # user 12 holds nothing
    alpha, reg = 7.0, 0.3
    U = solve_users(V, indptr, cols, alpha, reg, budget=budget)
    for u in range(13):
        held = np.unique(items[users == u])
        if held.size == 0:
            assert not U[u].any()
            continue
        A = V.T @ V + alpha * V[held].T @ V[held] + reg * np.eye(D)
        np.testing.assert_allclose(U[u], np.linalg.solve(A, (1 + alpha) * V[held].sum(axis=0)), rtol=1e-9, atol=1e-12)


def test_item_solve_is_the_shared_curvature_per_item_solve() -> None:
    rng = np.random.default_rng(1)
    U = rng.normal(size=(9, D))
    B, c = rng.normal(size=(M, D)), rng.integers(0, 5, M).astype(float)
    B[3] = 0.0  # an item nobody holds
    G = U.T @ U
    M_ = (U * rng.integers(1, 9, 9)[:, None]).T @ U / 40.0
    alpha, reg = 20.0, 0.1
    V = solve_items(B, c, G, M_, alpha, reg)
    for j in range(M):
        A = G + reg * np.eye(D) + alpha * c[j] * M_
        np.testing.assert_allclose(V[j], np.linalg.solve(A, (1 + alpha) * B[j]), rtol=1e-8, atol=1e-12)
    assert not V[3].any()


def test_strategy_step_reads_the_layout() -> None:
    rng = np.random.default_rng(2)
    s = IALSStrategy(M, rank=D, alpha=5.0, reg=0.2)
    users, items = _random_log(rng)
    indptr, cols = user_item_csr(users, items, 12, M)
    U = rng.normal(size=(12, D))
    total = upload_sums(U, indptr, cols, M)
    parts = s.layout.split(total)
    expected = solve_items(
        parts["factors"], parts["counts"], parts["gram"], parts["weighted_gram"] / cols.size, 5.0, 0.2
    )
    np.testing.assert_array_equal(s.aggregate(np.zeros((M, D)), total, 3, rng, round_index=0), expected)


# -- the upload --------------------------------------------------------------------------------------


def test_upload_layout_holds_the_sums_in_order() -> None:
    rng = np.random.default_rng(3)
    layout = IALSLayout(M, D)
    assert (
        layout.length == M * D + M + 2 * D * D + 1 == TrainingPlan(params=IALSParams(), n_items=M, rank=D).vector_length
    )
    users, items = _random_log(rng)
    indptr, cols = user_item_csr(users, items, 12, M)
    U = rng.normal(size=(12, D))
    x = upload_sums(U, indptr, cols, M)
    parts = layout.split(x)
    deg = np.diff(indptr)
    for j in range(M):
        holders = [u for u in range(12) if j in cols[indptr[u] : indptr[u + 1]]]
        np.testing.assert_allclose(parts["factors"][j], U[holders].sum(axis=0) if holders else np.zeros(D))
        assert parts["counts"][j] == len(holders)
    np.testing.assert_allclose(parts["gram"], U[deg > 0].T @ U[deg > 0])
    np.testing.assert_allclose(parts["weighted_gram"], (U * deg[:, None]).T @ U)
    assert float(parts["positives"]) == cols.size
    np.testing.assert_array_equal(layout.join(**{k: v for k, v in parts.items()}), x)
    with pytest.raises(ValueError, match="an iALS upload has"):
        layout.split(x[:-1])


def test_a_silo_uploads_the_sum_of_its_users_uploads() -> None:
    rng = np.random.default_rng(4)
    V = rng.normal(size=(M, D))
    plan = TrainingPlan(params=IALSParams(alpha=3.0), n_items=M, rank=D)
    users, items = _random_log(rng, n_users=4, nnz=30)
    silo = IALSModel(M, IALSConfig(factors=D), n_users=4)
    silo.set_global(b"", V.astype("<f8").tobytes(), 1)
    whole = silo.local_update(plan, LocalRatings(users, items, None, 4), rng).vector
    parts = np.zeros_like(whole)
    for u in range(4):
        phone = IALSModel(M, IALSConfig(factors=D))
        phone.set_global(b"", V.astype("<f8").tobytes(), 1)
        parts += phone.local_update(plan, LocalRatings.single_user(items[users == u]), rng).vector
    np.testing.assert_allclose(whole, parts, rtol=1e-12, atol=1e-12)


def test_model_refuses_misfit_plans_and_round_trips_its_store(tmp_path: Path) -> None:
    model = IALSModel(M, IALSConfig(factors=D), rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match="rank"):
        model.local_update(
            TrainingPlan(params=IALSParams(), n_items=M, rank=D + 1),
            LocalRatings.single_user([1]),
            np.random.default_rng(0),
        )
    with pytest.raises(ValueError, match="packed words"):
        model.set_global(b"x", b"", 2)
    model.fold_in([1, 2, 3])
    model.save(tmp_path / "m.fedrec")
    again = IALSModel.load(tmp_path / "m.fedrec")
    np.testing.assert_array_equal(again.user_factors, model.user_factors)
    np.testing.assert_array_equal(again.item_factors, model.item_factors)
    for bad in ({"alpha": -1.0}, {"reg": 0.0}, {"alpha": float("nan")}, {"factors": 0}):
        with pytest.raises(ValueError):
            IALSConfig(**bad)  # type: ignore[arg-type]


# -- training ------------------------------------------------------------------------------------------


def test_a_run_on_synthetic_data_learns_and_picks_on_validation() -> None:
    exp = prepare("synthetic")
    schedule = IALSSchedule(rounds=3, seed=0)
    sel = select_and_train(exp, schedule, factors=(16, 8), alphas=(1.0, 10.0), regs=(0.1, 10.0), level_weights=(0, 1))
    # The coordinate search: every α at (16, 0.1), the other λ at the best α, the other d at the best (α, λ).
    alpha = max((1.0, 10.0), key=lambda a: sel.validation[(16, a, 0.1)])
    reg = max((0.1, 10.0), key=lambda r: sel.validation[(16, alpha, r)])
    assert set(sel.validation) == {(16, 1.0, 0.1), (16, 10.0, 0.1), (16, alpha, 10.0), (8, alpha, reg)}
    assert sel.validation[(sel.factors, sel.alpha, sel.reg)] == max(sel.validation.values())
    # Then the item term's weight, on the kept run's scores only: w = 0 is its u·v figure.
    assert set(sel.level_validation) == {0.0, 1.0} and sel.level_validation[0.0] == max(sel.validation.values())
    assert sel.value == max(sel.level_validation.values()) and sel.run.level_weight == sel.level_weight
    assert validation_metric(exp, sel.run) == ("hr@10", sel.value)
    pop = baselines(exp)["popularity"].hr
    from fedsim.evaluation.ranking import TieMode, evaluate_candidates

    test_hr = evaluate_candidates(sel.run.scores(exp.test.users, exp.test.items), 10, TieMode.RANDOM).hr
    assert test_hr > pop + 0.05, (test_hr, pop)
    # The same schedule and seed give the same model.
    strategy = IALSStrategy(exp.train.n_items, rank=sel.factors, alpha=sel.alpha, reg=sel.reg)
    again = run_federated_ials(exp.train, strategy, schedule)
    np.testing.assert_array_equal(again.item_factors, sel.run.item_factors)
    np.testing.assert_array_equal(again.item_levels, sel.run.item_levels)


# -- the same rounds through SecAgg+ ---------------------------------------------------------------------

DEVICES, SCALE_BITS = 8, 16


def _secagg_config(data_dir: Path) -> ServerConfig:
    return config_from_dict(
        {
            "server": {"data_dir": str(data_dir)},
            "model": {"kind": "ials", "n_items": M},
            "rounds": {
                "cohort_size": DEVICES,
                "min_cohort": DEVICES,
                "seed": 5,
                "clip_norm": 1000.0,
                "scale_bits": SCALE_BITS,
            },
            "ials": {"rank": D, "alpha": 5.0, "reg": 0.1},
        },
        base_dir=data_dir,
    )


def test_secure_rounds_give_the_plain_federations_model(tmp_path: Path) -> None:
    """Three rounds through the real coordinator (SecAgg+ masking, clip + quantize on every device, no DP) end
    with the item factors of the plain in-process federation started from the server's version 1.

    Tolerance: nothing is clipped (clip_norm 1000 is above every upload's norm), so the only difference is the
    stochastic rounding at scale 2^-16: each entry of the sum is off by less than DEVICES·2^-16 ≈ 1.2e-4.  The
    item solve divides by A ⪰ λI, so the item factors move by about that much times ‖(A + αcM)⁻¹‖·(1 + α); a
    relative error of 1e-3 on V is above what rounding explains (measured 8e-5 here) and far below what a wrong
    sum (one upload missing, or a part misplaced) would give (order 1)."""
    rng = np.random.default_rng(6)
    users, items = _random_log(rng, n_users=DEVICES, nnz=70)
    clients = {d: LocalRatings.single_user(items[users == d]) for d in range(DEVICES)}
    cfg = _secagg_config(tmp_path / "srv")
    store = Storage(cfg.data_dir)
    try:
        run = run_private(
            cfg,
            clients,
            lambda device_id: IALSModel(M, IALSConfig(factors=D, alpha=5.0)),
            rounds=3,
            seed=11,
            storage=store,
        )
        assert run.coordinator.model_version == 4
        secure = np.asarray(run.coordinator.model_state)
        # Version 1 as the coordinator drew it (the same configuration, a fresh data folder).
        first = Storage(tmp_path / "v1")
        try:
            v1 = np.asarray(RoundCoordinator(_secagg_config(tmp_path / "v1"), first, now=0.0).model_state)
        finally:
            first.close()
    finally:
        store.close()
    train = Ratings(
        users.astype(np.int64),
        items.astype(np.int64),
        np.ones(users.size),
        None,
        DEVICES,
        M,
        np.arange(DEVICES),
        np.arange(M),
    )
    plain = run_federated_ials(
        train, IALSStrategy(M, rank=D, alpha=5.0, reg=0.1), IALSSchedule(rounds=3), initial=v1
    ).item_factors
    err = np.linalg.norm(secure - plain) / np.linalg.norm(plain)
    assert err < 1e-3, err
    assert not np.allclose(plain, v1)  # the rounds did move the model


def test_round_plan_carries_alpha_and_reg() -> None:
    plan = round_plan(IALSStrategy(M, rank=D, alpha=7.0, reg=0.5), 3)
    assert plan.params == IALSParams(alpha=7.0, reg=0.5) and plan.vector_length == IALSLayout(M, D).length


# -- the CLI ---------------------------------------------------------------------------------------------


def test_simulate_ials_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--model", "ials", "--dataset", "synthetic", "--rounds", "2", "--rank", "8", "--json"]
    assert main(argv) == 0
    cap = capsys.readouterr()
    rec = json.loads(cap.out.splitlines()[-1])
    assert (rec["dataset"], rec["protocol"], rec["rounds"], rec["family"], rec["factors"]) == (
        "synthetic",
        "loo",
        2,
        "ials",
        8,
    )
    assert rec["alpha"] in (5.0, 20.0, 100.0) and len(rec["validation"]) == 4  # 3 α, then λ = 100 at the best
    # λ = 0.1 with every α, then the strong ridge 5·(1 + α) at the best α.
    best_alpha = max(rec["validation"][:3], key=lambda c: c["hr@10"])["alpha"]
    assert [c["reg"] for c in rec["validation"]] == [0.1, 0.1, 0.1, 5.0 * (1 + best_alpha)]
    assert rec["reg"] in (0.1, 5.0 * (1 + best_alpha))
    assert [c["level_weight"] for c in rec["level_weights"]] == [0.0, 0.01, 0.03, 0.1]
    assert rec["level_weight"] in (0.0, 0.01, 0.03, 0.1)
    assert rec["metrics"]["model"]["hr@10"] > rec["metrics"]["popularity"]["hr@10"]
    assert "chosen on validation: d=8" in cap.err and "validation d=8, α=5" in cap.err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--epsilon", "1", "--fraction", "0.5"], "--fraction does not apply to private iALS runs"),
        (["--alpha", "2e6"], "--alpha: must be a finite number in [0.0, 1000000.0]"),
        (["--reg", "1e7"], "--reg: must be a finite number in [1e-06, 1000000.0]"),
        (["--rounds", "0"], "--rounds must be >= 1 for --model ials"),
        (["--rank", "5000"], "--rank must be in [1, 4096] for --model ials"),
        (["--epsilon", "1", "--save", "x"], "--save is not available for private iALS runs (--epsilon) yet"),
        (["--lam", "1"], "--lam applies to --model lightfr only; --model ials"),
    ],
)
def test_ials_misuse_is_one_clear_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--model", "ials", "--dataset", "synthetic", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedrec simulate: error:") and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"alpha": -1.0}, "ials.alpha: must be a finite number in [0.0, 1000000.0], got -1.0"),
        ({"reg": 0.0}, "ials.reg: must be a finite number in [1e-06, 1000000.0], got 0.0"),
        ({"rank": 0}, "ials.rank"),
        ({"alpha": True}, "ials.alpha"),
    ],
)
def test_server_config_refuses_bad_ials_values_in_one_line(table: dict[str, object], message: str) -> None:
    data = {"server": {"data_dir": "/srv"}, "model": {"kind": "ials", "n_items": 10}, "ials": table}
    with pytest.raises(ConfigError) as info:
        config_from_dict(data, base_dir=Path("/srv"))
    assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)


def test_server_config_builds_the_ials_strategy() -> None:
    cfg = config_from_dict(
        {"server": {"data_dir": "/srv"}, "model": {"kind": "ials", "n_items": 10}, "ials": {"rank": 8, "alpha": 3}},
        base_dir=Path("/srv"),
    )
    assert build_strategy(cfg) == IALSStrategy(10, rank=8, alpha=3.0, reg=0.1)
