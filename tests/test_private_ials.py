"""Private federated implicit ALS: the bounded upload, the server's solve on it, the scaled cohort against real
devices, bit-identity with the real coordinator under DP and dropouts, the released noise, and the CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from agg_server.config import ServerConfig, config_from_dict
from agg_server.strategy.base import round_plan
from agg_server.strategy.ials import IALSStrategy, solve_items
from device_sdk.family import LocalRatings
from device_sdk.ials import IALSConfig, IALSModel, upload_sums
from device_sdk.training import local_round
from fedsim.fleets.faults import DropoutAt
from fedsim.private.coordinator_rounds import run_private
from fedsim.private.scaled_ials import IALSCohort, PrivateIALSSettings, run_private_ials
from fedsim.private.simulator import PrivateSimulator
from protocol.errors import ConfigError
from protocol.families.ials import IALSLayout
from protocol.plan import IALSParams
from protocol.samplers import insecure_test_noise_stream
from protocol.session import RoundParameters

M, D = 30, 4


def _config(data_dir: Path, n: int, *, dp: bool, rounds: int = 2, m: int = M, theta: int = 3) -> ServerConfig:
    return config_from_dict(
        {
            "server": {"data_dir": str(data_dir), "port": 0},
            "model": {"kind": "ials", "n_items": m},
            "ials": {"rank": D, "alpha": 5.0, "theta": theta},
            "rounds": {
                "cohort_size": n,
                "min_cohort": n,
                "seed": 5,
                "clip_norm": IALSParams(theta=1).bounded_norm,
                "scale_bits": 12,
                "dropout_rate": 0.3,
            },
            "privacy": {"enabled": True, "epsilon": 4.0, "delta": 1e-5, "planned_rounds": rounds} if dp else {},
        },
        base_dir=data_dir,
    )


def _users(n: int, m: int = M, seed: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.sort(rng.choice(m, size=int(rng.integers(1, 12)), replace=False)) for _ in range(n)]


def _csr(users: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    indptr = np.concatenate(([0], np.cumsum([u.size for u in users]))).astype(np.int64)
    return indptr, np.concatenate(users).astype(np.int64)


def test_a_bounded_upload_has_norm_at_most_sqrt_2_plus_gamma_squared() -> None:
    rng = np.random.default_rng(0)
    for theta, gamma in ((1, 0.1), (10, 0.5), (50, 1.0)):
        for deg in (1, 3, 10, 200):
            items = rng.choice(500, size=deg, replace=False)
            u = rng.normal(size=(1, 8)) * rng.uniform(0.01, 100)
            vec = upload_sums(u, np.array([0, deg]), np.sort(items), 500, theta=theta, gram_weight=gamma)
            bound = IALSParams(theta=theta, gram_weight=gamma).bounded_norm
            assert np.linalg.norm(vec) <= bound * (1 + 1e-12)
            parts = IALSLayout(500, 8).split(vec)
            w = 1 / math.sqrt(max(deg, theta))
            assert np.allclose(np.linalg.norm(parts["factors"][items], axis=1), w)  # unit u, weighted
            assert np.allclose(parts["counts"][items], w) and parts["counts"].sum() == pytest.approx(deg * w)
            assert np.trace(parts["gram"]) == pytest.approx(gamma)
            assert not parts["weighted_gram"].any() and float(parts["positives"]) == 0.0
            if deg >= theta:  # the bound is reached: B and c each carry norm 1
                assert np.linalg.norm(vec) == pytest.approx(bound)


def test_the_plain_upload_is_unchanged_by_the_new_parameters() -> None:
    users = _users(6)
    indptr, cols = _csr(users)
    U = np.random.default_rng(1).normal(size=(6, D))
    plain = upload_sums(U, indptr, cols, M)
    parts = IALSLayout(M, D).split(plain)
    assert np.allclose(parts["gram"], U.T @ U)
    assert float(parts["positives"]) == cols.size


def test_the_bounded_step_solves_with_the_mean_unit_gram() -> None:
    users = _users(40)
    indptr, cols = _csr(users)
    U = np.random.default_rng(2).normal(size=(40, D))
    total = upload_sums(U, indptr, cols, M, theta=3, gram_weight=0.2)
    st = IALSStrategy(n_items=M, rank=D, alpha=5.0, reg=0.1, theta=3, gram_weight=0.2)
    got = st.step(np.zeros((M, D)), total, 40, 0)
    unit = U / np.linalg.norm(U, axis=1, keepdims=True)
    G = unit.T @ unit
    parts = IALSLayout(M, D).split(total)
    want = solve_items(parts["factors"], parts["counts"], G, G / np.trace(G), 5.0, 0.1)
    assert np.allclose(got, want)
    # Each item's direct solve with the shared curvature c_j·G/tr G agrees.
    j = int(cols[0])
    A = G + 0.1 * np.eye(D) + 5.0 * parts["counts"][j] * G / np.trace(G)
    assert np.allclose(got[j], np.linalg.solve(A, 6.0 * parts["factors"][j]))


def test_a_private_ials_server_needs_the_bounded_upload(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="ials.theta"):
        _config(tmp_path, 10, dp=True, theta=0)
    with pytest.raises(ValueError, match="theta"):
        IALSParams(theta=-1)
    with pytest.raises(ValueError, match="gram_weight"):
        IALSParams(gram_weight=0.0)


def test_the_scaled_cohort_matches_real_devices(tmp_path: Path) -> None:
    n = 15
    users = _users(n)
    sim = PrivateSimulator(_config(tmp_path, n, dp=False, theta=3))
    params = RoundParameters(
        round_id=1,
        vector_length=sim.vector_length,
        k=n,
        t=1,
        clip_norm=sim.quantization.clip_norm,
        scale_bits=12,
        deadlines=(0.0,) * 4,
    )
    invite = params.invite(0).with_plan(round_plan(sim.strategy, 1))
    wire = sim.payload()
    expected = np.zeros(sim.vector_length, dtype=np.int64)
    for j, items in enumerate(users):
        model = IALSModel(M, IALSConfig(factors=D))
        model.set_global(wire.words, wire.values, wire.model_version)
        ring, _ = local_round(
            model,
            invite,
            LocalRatings.single_user(items),
            None,
            np.random.default_rng(j),
            coins=insecure_test_noise_stream(j),
        )
        expected += ring.view(np.int32)
    cohort = IALSCohort(users, M, D, batch=4)  # several batches
    got = cohort.quantized_sum(
        sim.model_state,
        invite,
        cohort.device_ids,
        cohort.device_ids,
        np.random.default_rng(0),
        insecure_test_noise_stream(9),
    )
    assert np.max(np.abs(got - expected)) <= n  # stochastic rounding: < 1 per device and coordinate
    assert np.count_nonzero(expected) > 100
    # A device not among the survivors adds nothing; its user step still runs.
    alive = cohort.device_ids[1:]
    part = cohort.quantized_sum(
        sim.model_state, invite, cohort.device_ids, alive, np.random.default_rng(0), insecure_test_noise_stream(9)
    )
    assert np.max(np.abs(got - part)) > 0
    assert np.count_nonzero(cohort.user_factors[0]) == D


def _schedule(r: int, d: int) -> DropoutAt:
    phases = [DropoutAt.BEFORE_KEYS, DropoutAt.BEFORE_MASKED, DropoutAt.BEFORE_UNMASK, DropoutAt.DISCONNECT_MASKED]
    slot = (d + 3 * r) % 10
    return phases[slot] if slot < len(phases) else DropoutAt.NONE


@pytest.mark.parametrize("dp", [True, False])
def test_private_ials_simulator_is_bit_identical_to_the_coordinator(dp: bool, tmp_path: Path) -> None:
    n, rounds, seed = 10, 2, 13
    data = [LocalRatings.single_user(u) for u in _users(n)]

    def new_model() -> IALSModel:
        return IALSModel(M, IALSConfig(factors=D), rng=np.random.default_rng(0))

    ref = run_private(
        _config(tmp_path / "ref", n, dp=dp, rounds=rounds),
        dict(enumerate(data)),
        lambda device_id: new_model(),
        rounds=rounds,
        seed=seed,
        dropout=_schedule,
    )
    sim = PrivateSimulator(_config(tmp_path / "sim", n, dp=dp, rounds=rounds))
    ids = sorted(ref.devices)
    models = {d: new_model() for d in ids}
    local = {d: data[i] for i, d in enumerate(ids)}
    outcomes = [sim.run_round(models, local, seed=seed, dropout=_schedule) for _ in range(rounds)]
    assert all(o is not None and o.committed for o in outcomes)
    coord = ref.coordinator
    assert np.array_equal(np.asarray(sim.model_state), np.asarray(coord.model_state))
    assert np.abs(np.asarray(coord.model_state)).sum() > 0
    if dp:
        assert coord.ledger is not None and sim.ledger is not None
        assert sim.ledger.spent() == coord.ledger.spent() > 0
        assert all(o is not None and o.noise_variance > 0 for o in outcomes)


def test_a_scaled_private_ials_round_releases_noise_of_variance_mu(tmp_path: Path) -> None:
    # Devices with no items upload nothing: the released sum is pure noise, of variance n/(n - f)·μ (each of
    # the n keeps μ/(n - f), so the honest ones alone carry μ if the f = ⌊γ n⌋ = 10 colluders add none).
    n, m = 200, 400
    sim = PrivateSimulator(_config(tmp_path, n, dp=True, rounds=1, m=m))
    cohort = IALSCohort([np.zeros(0, np.int64)] * n, m, D)
    out = sim.run_scaled_round(cohort, sim_seed=1)  # type: ignore[arg-type]
    want = sim.mu * n / (n - 10)
    assert out is not None and out.committed and out.noise_variance == pytest.approx(want)
    assert sim.last_release is not None and sim.last_release.size == IALSLayout(m, D).length
    assert abs(float(np.var(sim.last_release)) - want) <= 0.05 * want


def test_a_private_run_spends_its_epsilon_and_learns_the_planted_structure() -> None:
    from fedsim.data.ratings import Ratings

    # Two groups of users, each holding items of its own half: the learned scores must rank a user's own half
    # first; the ledger spends the whole ε over the release and the rounds.
    rng = np.random.default_rng(0)
    n, m = 3000, 40
    users, items = [], []
    for u in range(n):
        half = (u % 2) * (m // 2)
        own = rng.choice(m // 2, size=6, replace=False) + half
        users += [u] * own.size
        items += own.tolist()
    train = Ratings(
        np.array(users, dtype=np.int64),
        np.array(items, dtype=np.int64),
        np.ones(len(items)),
        None,
        n,
        m,
        np.arange(n),
        np.arange(m),
        name="halves",
    )
    res = run_private_ials(train, PrivateIALSSettings(epsilon=8.0, rounds=2, factors=4, alpha=5.0, pop_share=0.2))
    assert res.epsilon == pytest.approx(8.0, rel=1e-6)
    scores = res.user_factors @ res.item_factors.T
    own_half = (np.arange(n) % 2)[:, None] == (np.arange(m) // (m // 2))[None, :]
    assert scores[own_half].mean() > scores[~own_half].mean() + 0.1
    alone = run_private_ials(train, PrivateIALSSettings(epsilon=8.0, rounds=0, factors=4))
    assert alone.epsilon == pytest.approx(8.0, rel=1e-6) and alone.mu_model == 0.0


def test_simulate_model_ials_with_epsilon_reports_the_plan_and_the_budget(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    lines = ["user,item,rating"]
    for u in range(300):
        for i in rng.choice(200, size=int(rng.integers(3, 12)), replace=False):
            lines.append(f"{u},{i},1")
    path = tmp_path / "log.csv"
    path.write_text("\n".join(lines) + "\n")
    cmd = [sys.executable, "-m", "fedsim.cli", "simulate", "--model", "ials", "--dataset", str(path), "--epsilon", "4"]
    proc = subprocess.run([*cmd, "--seed", "0", "--json", "--quiet"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert record["family"] == "ials" and record["epsilon"] <= 4.0 + 1e-9 and record["delta"] == 1e-5
    assert "plan" in record and set(record["metrics"]) >= {"model", "private_popularity", "popularity"}
    bad = subprocess.run([*cmd, "--fraction", "0.5"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--fraction" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_a_noisier_round_keeps_fewer_factors() -> None:
    from fedsim.private.scaled_ials import FACTOR_RANGE, FACTOR_SNR, choose_factors, item_signal

    # amazon-book's validation choices: S/σ 24.2 / 13.3 / 7.2 / 3.8 kept d = 64 / 32 / 16 / 16.
    assert [choose_factors(s, 1.0) for s in (24.2, 13.3, 7.2, 3.8)] == [64, 32, 16, 16]
    assert choose_factors(1.0, 0.0) == FACTOR_RANGE[1]
    sigmas = np.linspace(0.1, 50, 40)
    ds = [choose_factors(40.0, sigma) for sigma in sigmas]
    assert ds == sorted(ds, reverse=True) and set(ds) <= {16, 32, 64}
    assert all(d <= max(FACTOR_RANGE[0], FACTOR_SNR * 40.0 / sig) for d, sig in zip(ds, sigmas, strict=True))
    from fedsim.data.ratings import Ratings

    # Two users: one with 4 items (weight 1/2 each), one with 1 item (weight 1) shared with the first.
    train = Ratings(
        np.array([0, 0, 0, 0, 1], dtype=np.int64),
        np.array([0, 1, 2, 3, 0], dtype=np.int64),
        np.ones(5),
        None,
        2,
        4,
        np.arange(2),
        np.arange(4),
    )
    c = np.array([1.5, 0.5, 0.5, 0.5])
    assert item_signal(train, 1) == pytest.approx(float((c * c).sum() / c.sum()))
