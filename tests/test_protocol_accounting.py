"""Skellam RDP bound against the exact Renyi divergence, composition, calibration and the ledger."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.special import ive, logsumexp

from protocol.accounting import (
    ORDERS,
    PrivacyLedger,
    RoundCharge,
    calibrate_mu,
    composed_rdp,
    compute_epsilon,
    default_delta,
    epsilon_from_rdp,
    skellam_rdp,
)
from protocol.errors import ConfigError, PrivacyBudgetExceeded, StorageError

MUS = (10.0, 100.0, 1000.0, 10_000.0)


def _log_bessel_i(mu: float, top: int) -> np.ndarray:
    """log I_k(mu) for k = 0..top, by Miller's backward recurrence normalised with I_0.

    I_{k-1}(x) = (2k/x) I_k(x) + I_{k+1}(x) is stable downwards; starting well above ``top`` from
    (0, 1) and rescaling gives every order, including those where ``ive`` underflows.
    """
    start = top + 60 + int(10 * math.sqrt(top + mu))
    out = np.empty(top + 1)
    nxt, cur, log_scale = 0.0, 1.0, 0.0
    for k in range(start, 0, -1):
        nxt, cur = cur, (2.0 * k / mu) * cur + nxt
        if cur > 1e250:
            nxt, cur, log_scale = nxt / 1e250, cur / 1e250, log_scale + math.log(1e250)
        if k - 1 <= top:
            out[k - 1] = math.log(cur) + log_scale
    return out - out[0] + (math.log(ive(0, mu)) + mu)


class _Skellam:
    """Exact log-pmf of the variance-mu Skellam law: P(k) = exp(-mu) I_|k|(mu)."""

    def __init__(self, mu: float, top: int) -> None:
        self.top = top
        self.table = _log_bessel_i(mu, top) - mu

    def logpmf(self, k: np.ndarray) -> np.ndarray:
        return self.table[np.abs(k)]


def _renyi(sk: _Skellam, mu: float, shift: int, alpha: int) -> float:
    """D_alpha(Sk_mu + shift || Sk_mu) by direct summation over a range that provably holds the mass."""
    reach = int(alpha * shift + shift + 60 * math.sqrt(mu) + 200)
    assert reach + shift <= sk.top
    k = np.arange(-reach, reach + 1)
    terms = alpha * sk.logpmf(k - shift) + (1 - alpha) * sk.logpmf(k)
    peak = terms.max()
    assert terms[0] < peak - 60 and terms[-1] < peak - 60  # the tails we cut are negligible
    return float(logsumexp(terms) / (alpha - 1))


def _shifts(mu: float) -> list[int]:
    r = math.sqrt(mu)
    return sorted({1, 2, math.ceil(r / 2), math.ceil(r), math.ceil(3 * r)})


def test_bessel_table_matches_scipy_where_it_does_not_underflow() -> None:
    mu = 300.0
    table = _log_bessel_i(mu, 2000)
    with np.errstate(divide="ignore"):
        ref = np.log(ive(np.arange(2001), mu)) + mu
    ok = np.isfinite(ref)
    assert ok.sum() > 500
    assert np.max(np.abs(table[ok] - ref[ok])) < 1e-9


def test_skellam_pmf_is_normalised_with_variance_mu() -> None:
    for mu in (10.0, 1000.0):
        sk = _Skellam(mu, 3000)
        k = np.arange(-3000, 3001)
        p = np.exp(sk.logpmf(k))
        assert p.sum() == pytest.approx(1.0, abs=1e-10)
        assert (p * k**2).sum() == pytest.approx(mu, rel=1e-10)


@pytest.mark.parametrize("mu", MUS)
def test_rdp_bound_upper_bounds_exact_divergence(mu: float) -> None:
    shifts = _shifts(mu)
    sk = _Skellam(mu, int(max(ORDERS) * max(shifts) * 1.05 + 60 * math.sqrt(mu) + 600))
    worst_rel = math.inf
    for shift in shifts:
        # 1-D: Delta_1 = Delta_2 = |shift|.  By symmetry of the Skellam law, the reverse divergence and
        # negative shifts are the same numbers.
        bounds = skellam_rdp(mu, shift, shift)
        for alpha, bound in zip(ORDERS, bounds, strict=True):
            exact = _renyi(sk, mu, shift, alpha)
            assert exact <= bound * (1 + 1e-12), (mu, shift, alpha, exact, bound)
            worst_rel = min(worst_rel, (bound - exact) / exact)
    assert worst_rel >= 0  # reported in docs/dp-accounting.md: smallest relative margin ~2e-5


def test_rdp_bound_for_vector_shifts() -> None:
    # independent coordinates: the exact divergence is the sum of the per-coordinate ones
    mu = 200.0
    sk = _Skellam(mu, 20_000)
    for vector in ([1, 1, 1, 1], [3, 0, 1], [1] * 16, [5, 2, 2, 1, 1]):
        v = np.asarray(vector)
        l1, l2 = float(np.abs(v).sum()), float(np.linalg.norm(v))
        bounds = skellam_rdp(mu, l1, l2)
        for alpha, bound in zip(ORDERS, bounds, strict=True):
            if alpha > 64:
                continue
            exact = sum(_renyi(sk, mu, int(s), alpha) for s in v if s)
            assert exact <= bound * (1 + 1e-12), (vector, alpha, exact, bound)


def test_rdp_formula_values() -> None:
    got = skellam_rdp(100.0, 10.0, 5.0, orders=[2.0, 40.0])
    # alpha=2: 2*25/200 + min((3*25 + 60)/160000, 30/400)
    assert got[0] == pytest.approx(0.25 + 135 / 160_000)
    assert got[1] == pytest.approx(40 * 25 / 200 + (79 * 25 + 60) / 160_000)
    # tiny mu: the 3 Delta_1 / (4 mu) branch of the min is the smaller one
    assert skellam_rdp(0.25, 1.0, 1.0, orders=[2.0])[0] == pytest.approx(2 / 0.5 + 3.0)
    for bad in ((0.0, 1.0, 1.0), (10.0, -1.0, 1.0), (10.0, 1.0, math.nan)):
        with pytest.raises(ConfigError):
            skellam_rdp(*bad)
    with pytest.raises(ConfigError, match="orders"):
        skellam_rdp(10.0, 1.0, 1.0, orders=[1.0])


def test_composition_is_additive_and_monotone() -> None:
    mu, l1, l2, delta = 5e4, 300.0, 40.0, 1e-5
    one = skellam_rdp(mu, l1, l2)
    assert np.allclose(composed_rdp([(mu, l1, l2)] * 7), 7 * one)
    eps = [compute_epsilon(mu, l1, l2, t, delta) for t in range(0, 60, 5)]
    assert eps[0] == 0.0
    assert all(b > a for a, b in zip(eps, eps[1:], strict=False))
    # more noise, less epsilon; larger delta, less epsilon
    assert compute_epsilon(2 * mu, l1, l2, 10, delta) < compute_epsilon(mu, l1, l2, 10, delta)
    assert compute_epsilon(mu, l1, l2, 10, 1e-3) < compute_epsilon(mu, l1, l2, 10, delta)


def test_epsilon_agrees_with_gaussian_accounting_when_noise_is_large() -> None:
    # for mu >> Delta the Skellam bound tends to the Gaussian one: compare with dp_accounting's
    # Gaussian RDP at noise multiplier z = sqrt(mu)/Delta_2 (same orders).
    import dp_accounting

    mu, l2, rounds, delta = 1e8, 1000.0, 50, 1e-5
    acc = dp_accounting.rdp.RdpAccountant(orders=list(ORDERS))
    acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(math.sqrt(mu) / l2), rounds))
    ours = compute_epsilon(mu, l2, l2, rounds, delta)
    assert ours >= acc.get_epsilon(delta)
    assert ours == pytest.approx(acc.get_epsilon(delta), rel=1e-3)


@pytest.mark.parametrize(("epsilon", "rounds"), [(1.0, 10), (3.0, 100), (8.0, 500), (0.3, 1)])
def test_calibrate_mu_round_trips(epsilon: float, rounds: int) -> None:
    l1, l2, delta = 5000.0, 300.0, 1e-5
    mu = calibrate_mu(epsilon, delta, rounds, l1, l2)
    assert compute_epsilon(mu, l1, l2, rounds, delta) <= epsilon
    assert compute_epsilon(mu * (1 - 1e-6), l1, l2, rounds, delta) > epsilon - 1e-6
    assert compute_epsilon(mu * 0.99, l1, l2, rounds, delta) > epsilon


def test_calibrate_mu_validation() -> None:
    for args in (
        (0.0, 1e-5, 10, 1.0, 1.0),
        (1.0, 0.0, 10, 1.0, 1.0),
        (1.0, 1e-5, 0, 1.0, 1.0),
        (1.0, 1e-5, 10, 1.0, 0.0),
    ):
        with pytest.raises(ConfigError):
            calibrate_mu(*args)


def test_default_delta() -> None:
    assert default_delta(1000) == 1e-5
    assert default_delta(10**6) == 1e-6
    with pytest.raises(ConfigError):
        default_delta(0)


def test_epsilon_from_rdp_validation() -> None:
    with pytest.raises(ConfigError, match="one per order"):
        epsilon_from_rdp(np.ones(3), 1e-5)
    with pytest.raises(ConfigError, match="delta"):
        epsilon_from_rdp(np.ones(len(ORDERS)), 1.5)
    assert epsilon_from_rdp(np.zeros(len(ORDERS)), 1e-5) == 0.0


def test_ledger_refuses_round_beyond_budget() -> None:
    l1, l2, delta = 5000.0, 300.0, 1e-5
    mu = calibrate_mu(2.0, delta, 10, l1, l2)  # exactly ten such rounds fit in epsilon = 2
    ledger = PrivacyLedger(epsilon_budget=2.0, delta=delta)
    assert ledger.spent() == 0.0
    spent = [ledger.record_round(mu, l1, l2, round_id=i) for i in range(10)]
    assert all(b > a for a, b in zip(spent, spent[1:], strict=False))
    assert spent[-1] <= 2.0
    with pytest.raises(PrivacyBudgetExceeded, match="over the budget"):
        ledger.check_round(mu, l1, l2)
    with pytest.raises(PrivacyBudgetExceeded):
        ledger.record_round(mu, l1, l2, round_id=10)
    assert len(ledger.rounds) == 10  # a refused round is not recorded
    assert ledger.remaining() == pytest.approx(2.0 - spent[-1])
    roomy = PrivacyLedger(epsilon_budget=2.0, delta=delta)
    roomy.check_round(mu, l1, l2)  # the same round fits an empty ledger


def test_ledger_dict_round_trip() -> None:
    ledger = PrivacyLedger(epsilon_budget=5.0, delta=1e-6)
    ledger.record_round(1e6, 2000.0, 150.0, round_id=3)
    ledger.record_round(2e6, 2000.0, 150.0)
    data = ledger.to_dict()
    # builtins only (msgpack/SQLite-safe)
    assert data == {
        "format": 1,
        "epsilon_budget": 5.0,
        "delta": 1e-6,
        "rounds": [
            {"mu": 1e6, "l1": 2000.0, "l2": 150.0, "round_id": 3},
            {"mu": 2e6, "l1": 2000.0, "l2": 150.0, "round_id": None},
        ],
    }
    again = PrivacyLedger.from_dict(data)
    assert again == ledger
    assert again.spent() == ledger.spent()
    assert again.rounds[0] == RoundCharge(mu=1e6, l1=2000.0, l2=150.0, round_id=3)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("rounds"),
        lambda d: d.update(format=99),
        lambda d: d.update(delta="tiny"),
        lambda d: d.update(delta=2.0),
        lambda d: d["rounds"].append({"mu": -1.0, "l1": 1.0, "l2": 1.0}),
        lambda d: d["rounds"].append({"mu": 1.0, "l1": 1.0}),
        lambda d: d["rounds"].append({"mu": 1.0, "l1": 1.0, "l2": 1.0, "round_id": "x"}),
        lambda d: d.update(rounds=[7]),
    ],
)
def test_ledger_from_malformed_dict_raises_storage_error(mutate: object) -> None:
    ledger = PrivacyLedger(epsilon_budget=5.0, delta=1e-6)
    ledger.record_round(1e6, 2000.0, 150.0)
    data = ledger.to_dict()
    mutate(data)  # type: ignore[operator]
    with pytest.raises(StorageError):
        PrivacyLedger.from_dict(data)


def test_ledger_validation() -> None:
    with pytest.raises(ConfigError):
        PrivacyLedger(epsilon_budget=0.0, delta=1e-5)
    with pytest.raises(ConfigError):
        PrivacyLedger(epsilon_budget=1.0, delta=0.0)
