"""Privacy accounting for the distributed Skellam mechanism, and the server's privacy ledger.

Invariants of this module:

* Every round is charged with the Renyi-DP curve of the Skellam mechanism at a fixed list of integer
  orders (`ORDERS`), computed from the round's aggregate variance mu and its sensitivities
  (Delta_1, Delta_2) in quantized units; curves add over rounds (RDP composition).
* The curve is an upper bound, never an estimate: the closed form below was checked against the exact
  Renyi divergence by direct summation (tests/test_protocol_accounting.py, docs/dp-accounting.md).
* (epsilon, delta) comes from one conversion only: `dp_accounting.rdp.compute_epsilon`, i.e. the
  improved RDP-to-DP conversion (Canonne, Kamath, Steinke 2020, Prop. 12; Asoodeh et al. 2020),
  minimised over `ORDERS`.
* No subsampling amplification: the server chooses the cohort, so every round is charged in full
  (notes/secagg-dp.md §9 pitfall 15).
* Adjacency is add/remove one device (the sum with or without its update), matching
  `protocol.quantization.sensitivity`.

Per-round bound (Agarwal, Kairouz, Liu, "The Skellam Mechanism for Differentially Private Federated
Learning", NeurIPS 2021, §3, the RDP theorem for the multidimensional Skellam mechanism): if the sum
carries independent Skellam noise of variance mu on each coordinate and one device moves the integer sum
by a vector of L1 norm <= Delta_1 and L2 norm <= Delta_2, then for every order alpha

    eps(alpha) <= alpha Delta_2^2 / (2 mu)
                  + min( ((2 alpha - 1) Delta_2^2 + 6 Delta_1) / (16 mu^2),  3 Delta_1 / (4 mu) ).

The first term is the Gaussian mechanism's; the second pays for Skellam not being Gaussian.  The
distributed scheme (protocol.noise) guarantees aggregate variance >= mu for every survivor set the round
can finish with, and a larger variance only lowers the divergence, so charging mu is safe.  A device
that holds back its correction adds noise, which is post-processing-safe as well.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from dp_accounting.rdp import compute_epsilon as _rdp_to_dp
from numpy.typing import NDArray

from protocol.errors import ConfigError, PrivacyBudgetExceeded, StorageError
from protocol.rdp import ORDERS, skellam_rdp
from protocol.rdp import ORDERS_ARRAY as _ORDERS_ARRAY
from protocol.rdp import check_delta as _check_delta
from protocol.rdp import check_positive as _check_positive

__all__ = [
    "ORDERS",
    "skellam_rdp",
    "composed_rdp",
    "epsilon_from_rdp",
    "compute_epsilon",
    "calibrate_mu",
    "default_delta",
    "RoundCharge",
    "PrivacyLedger",
]

_LEDGER_FORMAT = 1


def composed_rdp(rounds: Iterable[tuple[float, float, float]]) -> NDArray[np.float64]:
    """Sum the RDP curves (at `ORDERS`) of rounds given as (mu, l1, l2) triples.

    Parameters
    ----------
    rounds : iterable of (mu, l1, l2)
        One triple per round.

    Returns
    -------
    NDArray[np.float64]
        The composed curve (zeros if there are no rounds).
    """
    total = np.zeros_like(_ORDERS_ARRAY)
    for mu, l1, l2 in rounds:
        total += skellam_rdp(mu, l1, l2)
    return total


def epsilon_from_rdp(rdp: NDArray[np.float64], delta: float) -> float:
    """Convert an RDP curve at `ORDERS` to epsilon at ``delta``.

    Uses ``dp_accounting.rdp.compute_epsilon``: eps = min over alpha of
    RDP(alpha) + log(1 - 1/alpha) - log(delta * alpha) / (alpha - 1) (the improved conversion).

    Parameters
    ----------
    rdp : NDArray[np.float64]
        RDP values, one per entry of `ORDERS`.
    delta : float
        Target delta in (0, 1).

    Returns
    -------
    float
        epsilon (0.0 for an all-zero curve).

    Raises
    ------
    ConfigError
        If delta is outside (0, 1) or the curve has the wrong length.
    """
    d = _check_delta(delta)
    curve = np.asarray(rdp, dtype=np.float64)
    if curve.shape != _ORDERS_ARRAY.shape:
        raise ConfigError(f"an RDP curve needs {len(ORDERS)} values (one per order), got {curve.shape}")
    if not np.any(curve > 0):
        return 0.0
    eps, _order = _rdp_to_dp(list(ORDERS), curve.tolist(), d)
    return float(eps)


def compute_epsilon(mu: float, l1: float, l2: float, rounds: int, delta: float) -> float:
    """Return epsilon at ``delta`` after ``rounds`` identical rounds.

    Parameters
    ----------
    mu : float
        Aggregate noise variance per round (quantized units).
    l1, l2 : float
        Per-device sensitivities (quantized units).
    rounds : int
        Number of rounds, >= 0.
    delta : float
        Target delta in (0, 1).

    Returns
    -------
    float
        epsilon.

    Raises
    ------
    ConfigError
        On invalid arguments.
    """
    if isinstance(rounds, bool) or not isinstance(rounds, int | np.integer) or rounds < 0:
        raise ConfigError(f"rounds must be an integer >= 0, got {rounds!r}")
    return epsilon_from_rdp(int(rounds) * skellam_rdp(mu, l1, l2), delta)


def calibrate_mu(epsilon: float, delta: float, rounds: int, l1: float, l2: float, *, rel_tol: float = 1e-9) -> float:
    """Return the smallest aggregate variance mu meeting (epsilon, delta) over ``rounds`` rounds.

    epsilon is non-increasing in mu (each order's bound decreases in mu, and so does their minimum), so
    a bisection on log mu finds the boundary; the returned value is the upper end of the final bracket,
    so it always meets the target.

    Parameters
    ----------
    epsilon : float
        Target epsilon > 0.
    delta : float
        Target delta in (0, 1).
    rounds : int
        Number of rounds, >= 1.
    l1, l2 : float
        Per-device sensitivities (quantized units), l2 > 0.
    rel_tol : float
        Relative width of the final bracket.

    Returns
    -------
    float
        mu with ``compute_epsilon(mu, l1, l2, rounds, delta) <= epsilon``.

    Raises
    ------
    ConfigError
        On invalid arguments, or if no finite mu reaches the target.
    """
    eps_target = _check_positive("epsilon", epsilon)
    _check_delta(delta)
    _check_positive("l2 sensitivity", l2)
    _check_positive("l1 sensitivity", l1, allow_zero=True)
    if isinstance(rounds, bool) or not isinstance(rounds, int | np.integer) or rounds < 1:
        raise ConfigError(f"rounds must be an integer >= 1, got {rounds!r}")

    def eps_at(log_mu: float) -> float:
        return compute_epsilon(math.exp(log_mu), l1, l2, int(rounds), delta)

    # Start from the Gaussian-mechanism scale and widen the bracket geometrically.
    guess = math.log(rounds * float(l2) ** 2 * max(1.0, math.log(1.0 / delta)) / eps_target**2)
    lo, hi = guess - 1.0, guess + 1.0
    for _ in range(200):
        if eps_at(lo) > eps_target:
            break
        lo -= 2.0
    for _ in range(200):
        if eps_at(hi) <= eps_target:
            break
        hi += 2.0
    else:
        raise ConfigError(f"no finite noise variance reaches epsilon={epsilon} at delta={delta}")
    while hi - lo > rel_tol:
        mid = 0.5 * (lo + hi)
        if eps_at(mid) <= eps_target:
            hi = mid
        else:
            lo = mid
    return math.exp(hi)


def default_delta(registered_devices: int) -> float:
    """Return delta = min(1e-5, 1/N) for N registered devices (docs/design.md §5).

    Parameters
    ----------
    registered_devices : int
        N >= 1.

    Returns
    -------
    float
        The delta to report epsilon at.
    """
    if registered_devices < 1:
        raise ConfigError(f"registered_devices must be >= 1, got {registered_devices}")
    return min(1e-5, 1.0 / registered_devices)


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundCharge:
    """One round as the ledger records it.

    Attributes
    ----------
    mu : float
        Aggregate noise variance guaranteed in the released sum (quantized units).
    l1, l2 : float
        Per-device L1 / L2 sensitivity (quantized units).
    round_id : int or None
        The server's round identifier, if any.
    """

    mu: float
    l1: float
    l2: float
    round_id: int | None = None

    def __post_init__(self) -> None:
        _check_positive("mu", self.mu)
        _check_positive("l1 sensitivity", self.l1, allow_zero=True)
        _check_positive("l2 sensitivity", self.l2, allow_zero=True)
        if self.round_id is not None and (isinstance(self.round_id, bool) or not isinstance(self.round_id, int)):
            raise ConfigError(f"round_id must be an int or None, got {self.round_id!r}")

    def to_dict(self) -> dict[str, Any]:
        """Return the charge as a dict of builtins."""
        return {"mu": float(self.mu), "l1": float(self.l1), "l2": float(self.l2), "round_id": self.round_id}


@dataclass(slots=True)
class PrivacyLedger:
    """The server's running privacy account: a budget and the rounds charged against it.

    Attributes
    ----------
    epsilon_budget : float
        epsilon_max > 0 that the whole training may spend.
    delta : float
        delta in (0, 1) at which epsilon is reported.
    rounds : list[RoundCharge]
        Rounds recorded so far, in order.
    """

    epsilon_budget: float
    delta: float
    rounds: list[RoundCharge] = field(default_factory=list)
    _rdp: NDArray[np.float64] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_positive("epsilon_budget", self.epsilon_budget)
        _check_delta(self.delta)
        self.rounds = list(self.rounds)
        self._rdp = composed_rdp((r.mu, r.l1, r.l2) for r in self.rounds)

    def spent(self) -> float:
        """Return epsilon at `delta` spent by the recorded rounds."""
        return epsilon_from_rdp(self._rdp, self.delta)

    def epsilon_after(self, mu: float, l1: float, l2: float) -> float:
        """Return the epsilon the ledger would show after recording one more such round."""
        return epsilon_from_rdp(self._rdp + skellam_rdp(mu, l1, l2), self.delta)

    def check_round(self, mu: float, l1: float, l2: float) -> None:
        """Refuse a round that would take the ledger over budget.

        Parameters
        ----------
        mu, l1, l2 : float
            The proposed round's aggregate variance and sensitivities.

        Raises
        ------
        PrivacyBudgetExceeded
            If recording the round would make epsilon exceed ``epsilon_budget``.
        ConfigError
            If the arguments are invalid.
        """
        after = self.epsilon_after(mu, l1, l2)
        if after > self.epsilon_budget:
            raise PrivacyBudgetExceeded(
                f"round {len(self.rounds) + 1} (mu={mu:.6g}, l1={l1:.6g}, l2={l2:.6g}) would raise epsilon "
                f"from {self.spent():.4g} to {after:.4g} at delta={self.delta:g}, over the budget "
                f"{self.epsilon_budget:g}"
            )

    def record_round(self, mu: float, l1: float, l2: float, *, round_id: int | None = None) -> float:
        """Check and record a round whose sum has been (or is about to be) released.

        Parameters
        ----------
        mu, l1, l2 : float
            The round's aggregate variance and sensitivities.
        round_id : int or None
            The server's round identifier.

        Returns
        -------
        float
            epsilon spent after this round.

        Raises
        ------
        PrivacyBudgetExceeded
            If the round does not fit the budget (nothing is recorded then).
        """
        self.check_round(mu, l1, l2)
        charge = RoundCharge(mu=float(mu), l1=float(l1), l2=float(l2), round_id=round_id)
        self.rounds.append(charge)
        self._rdp = self._rdp + skellam_rdp(charge.mu, charge.l1, charge.l2)
        return self.spent()

    def remaining(self) -> float:
        """Return the budget left (epsilon_budget minus spent, at least 0)."""
        return max(0.0, self.epsilon_budget - self.spent())

    def to_dict(self) -> dict[str, Any]:
        """Return the ledger as a dict of builtins (for msgpack or SQLite JSON)."""
        return {
            "format": _LEDGER_FORMAT,
            "epsilon_budget": float(self.epsilon_budget),
            "delta": float(self.delta),
            "rounds": [r.to_dict() for r in self.rounds],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PrivacyLedger:
        """Rebuild a ledger from `to_dict` output.

        Parameters
        ----------
        data : Mapping[str, Any]
            A stored ledger.

        Returns
        -------
        PrivacyLedger
            The ledger.

        Raises
        ------
        StorageError
            If the data is malformed (missing keys, wrong types, invalid values, unknown format).
        """
        try:
            if data.get("format") != _LEDGER_FORMAT:
                raise StorageError(f"unknown privacy ledger format {data.get('format')!r}")
            rounds = []
            for item in data["rounds"]:
                rid = item.get("round_id")
                rounds.append(
                    RoundCharge(
                        mu=_as_float(item["mu"]),
                        l1=_as_float(item["l1"]),
                        l2=_as_float(item["l2"]),
                        round_id=None if rid is None else _as_int(rid),
                    )
                )
            return cls(
                epsilon_budget=_as_float(data["epsilon_budget"]),
                delta=_as_float(data["delta"]),
                rounds=rounds,
            )
        except StorageError:
            raise
        except (KeyError, TypeError, AttributeError, ConfigError) as exc:
            raise StorageError(f"malformed privacy ledger: {exc}") from exc


def _as_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"expected a number, got {value!r}")
    return float(value)


def _as_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value
