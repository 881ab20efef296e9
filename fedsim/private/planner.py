"""The privacy planner: how a private run spends its ε, chosen from the data's shape before anything is spent.

The private popularity list is the floor a private model stands on, so the planner first buys the floor and
gives personalisation only what the floor does not need:

1. **The floor.**  Every device releases a 1 for each of its items, its indicator clipped to L2 norm √θ
   (θ = `POP_THETA` = 1: a device with k items adds 1/√k to each).  θ = 1 gives every device's item the
   largest share of the noise it pays for (min(1, √(θ/k))/√θ is largest at θ = 1 for every k), and the
   weighting it implies ranks items as raw counts do on every set measured (docs/results/).  For each
   share s of ε (`SHARES`) the planner reads the noise σ the accountant gives that release
   (`fedsim.private.scaled_lightfr.split_budget`, the same numbers the run will use) and forecasts the
   ratio private popularity / popularity on the run's own metric by Monte-Carlo over the training
   interactions (`forecast_ratio`): which items a held-out interaction falls on, and how often noise of
   that σ lifts other items over it.  It takes the smallest s whose forecast reaches `TARGET_RATIO`.
2. **Personalisation** gets the rest of ε over ``rounds`` rounds, unless the floor needs more than
   `MAX_SHARE` of it, or cannot reach the target at all: then the whole ε goes to the popularity release,
   no round runs, and the private model **is** the private popularity list, which the plan says first.

What the rounds buy is judged after training, on validation: the learned score replaces the private
list only when it beats it there by more than `MARGIN_SE` standard errors (`choose_with_margin`), so a
private model is never silently worse than its own floor.

The forecast uses the shape a planner is allowed to read (devices, items, interactions per device, the
item-frequency curve) and the accountant; it is checked against measured runs in
``tests/test_private_planner.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedsim.data.ratings import Ratings

__all__ = [
    "POP_THETA",
    "TARGET_RATIO",
    "MAX_SHARE",
    "SHARES",
    "MARGIN_SE",
    "PRIVATE_ROUNDS",
    "PrivatePlan",
    "popularity_weights",
    "forecast_ratio",
    "plan_private_run",
    "choose_with_margin",
]

#: θ of the popularity release: each device's item indicator clipped to L2 norm √θ.
POP_THETA = 1
#: The forecast private popularity / popularity the floor must reach.
TARGET_RATIO = 0.97
#: The shares of ε the planner tries for the popularity release, smallest first.
SHARES: tuple[float, ...] = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)
#: A floor needing more than this share leaves the rounds too little: the whole ε goes to it.
MAX_SHARE = SHARES[-1]
#: The learned score must beat the private list on validation by this many standard errors.
MARGIN_SE = 2.0
#: Rounds when ε buys personalisation: the best validation Recall@20 on amazon-book at ε = 8 among
#: T ∈ {3, 5, 8, 12} (0.0620, 0.0698, 0.0671, 0.0604; docs/results/2026-11-27-private-planner.md).
PRIVATE_ROUNDS = 5
#: Monte-Carlo draws of the forecast (sampled protocol: held-out interactions; full ranking: noise vectors).
_DRAWS = 20_000
_FULL_REPEATS = 8


@dataclass(frozen=True, slots=True)
class PrivatePlan:
    """How one private run spends ε (all figures from the accountant and the data's shape).

    Attributes
    ----------
    epsilon, delta : the run's budget.
    devices, items : the data's size.
    pop_theta : θ of the popularity release.
    pop_share : share of ε calibrating the popularity release (1.0: the whole ε, no round).
    rounds : model rounds (0: none; the private model is the private popularity list).
    sigma_pop : standard deviation of the released popularity noise, in devices of one item each.
    forecast : forecast private popularity / popularity at ``pop_share``.
    forecast_all : the same with the whole ε on popularity.
    metric : the metric the forecast is on ("HR@10 among 100" or "Recall@20").
    """

    epsilon: float
    delta: float
    devices: int
    items: int
    pop_theta: int
    pop_share: float
    rounds: int
    sigma_pop: float
    forecast: float
    forecast_all: float
    metric: str

    @property
    def personalises(self) -> bool:
        """Whether any ε goes to model rounds."""
        return self.rounds > 0

    def verdict(self) -> str:
        """The plan in one or two sentences, printed before the run."""
        head = f"plan: at {self.devices} devices and ε = {self.epsilon:g}, "
        if not self.personalises:
            return (
                head + f"the private model is the private popularity list: the whole ε buys its release (noise σ = "
                f"{self.sigma_pop:.3g} devices per item, forecast {self.forecast:.2f}× popularity by {self.metric}); "
                "personalisation cannot be afforded at this size"
            )
        return (
            head + f"{self.pop_share:g} of ε buys the private popularity list (σ = {self.sigma_pop:.3g}, forecast "
            f"{self.forecast:.2f}× popularity by {self.metric}) and {1 - self.pop_share:g} buys {self.rounds} "
            "rounds of personalisation; the learned model replaces the list only if it beats it on validation"
        )

    def record(self) -> dict[str, Any]:
        """The plan as a JSON object (``--json`` output)."""
        return {
            "pop_theta": self.pop_theta,
            "pop_share": self.pop_share,
            "rounds": self.rounds,
            "sigma_pop": self.sigma_pop,
            "forecast_ratio": self.forecast,
            "forecast_ratio_all_popularity": self.forecast_all,
            "metric": self.metric,
            "personalises": self.personalises,
        }


def popularity_weights(train: Ratings, theta: int = POP_THETA) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """(per-item released sums without noise, per-interaction weight): a device with k items adds
    min(1, √(θ/k)) to each (its indicator clipped to L2 norm √θ)."""
    k = np.bincount(train.users, minlength=train.n_users).astype(np.float64)
    per_user = np.minimum(1.0, np.sqrt(theta / np.maximum(k, 1.0)))
    w = per_user[train.users]
    return np.bincount(train.items, weights=w, minlength=train.n_items), w


def forecast_ratio(
    train: Ratings,
    sigma: float,
    *,
    negatives: int | None,
    theta: int = POP_THETA,
    seed: int = 0,
) -> float:
    """Forecast private popularity / popularity, with noise ``sigma`` on the released sums.

    Sampled protocol (``negatives`` sampled items per positive): held-out interactions drawn from train (the
    item's count less that device's own contribution), each ranked with ``negatives`` uniform items by
    HR@10 (exact expectation over random ties).  Full ranking (``negatives`` None): the share of
    interactions whose item is in the top 20 of the catalogue.
    A seeded simulation over the public shape; nothing is released.
    """
    rng = np.random.default_rng(seed)
    counts = np.bincount(train.items, minlength=train.n_items).astype(np.float64)
    released, w = popularity_weights(train, theta)
    if negatives is None:
        return _forecast_full(counts, released, sigma, rng)
    n = len(train)
    if n == 0:
        return 1.0
    pick = rng.integers(0, n, size=min(_DRAWS, n))
    pos = train.items[pick]
    neg = rng.integers(0, train.n_items, size=(pick.size, negatives))
    exact = _hit_at(counts[pos] - 1.0, counts[neg], rng, 0.0, 10)
    noisy = _hit_at(released[pos] - w[pick], released[neg], rng, sigma, 10)
    return float(noisy / exact) if exact > 0 else 1.0


def _hit_at(
    pos: NDArray[np.float64], neg: NDArray[np.float64], rng: np.random.Generator, sigma: float, k: int
) -> float:
    """Mean HR@k of positives scored ``pos`` among negatives ``neg`` (+ N(0, σ²) each), random ties exact."""
    if sigma > 0:
        pos = pos + rng.normal(0.0, sigma, pos.shape)
        neg = neg + rng.normal(0.0, sigma, neg.shape)
    greater = (neg > pos[:, None]).sum(axis=1)
    tied = (neg == pos[:, None]).sum(axis=1)
    hit = (np.minimum(greater + tied + 1, k) - np.minimum(greater, k)) / (tied + 1.0)
    return float(hit.mean())


def _forecast_full(
    counts: NDArray[np.float64], released: NDArray[np.float64], sigma: float, rng: np.random.Generator, k: int = 20
) -> float:
    """Share of interactions on the top-k items by noisy released sums, over the share on the top-k by counts."""
    total = counts.sum()
    if total == 0 or counts.size <= k:
        return 1.0
    exact = np.sort(counts)[::-1][:k].sum() / total
    got = []
    for _ in range(_FULL_REPEATS):
        noisy = released + rng.normal(0.0, sigma, released.shape)
        top = np.argpartition(-noisy, k)[:k]
        got.append(counts[top].sum() / total)
    return float(np.mean(got) / exact)


def plan_private_run(
    train: Ratings,
    *,
    epsilon: float,
    delta: float,
    negatives: int | None,
    sigma_at: Callable[[float], float],
    sigma_all: float,
    rounds: int = PRIVATE_ROUNDS,
    target: float = TARGET_RATIO,
    shares: Sequence[float] = SHARES,
    seed: int = 0,
) -> PrivatePlan:
    """Choose the popularity share and the rounds (see the module docstring).

    ``sigma_at(s)`` is the popularity release's noise (devices per item) when it gets share s of ε and
    ``rounds`` rounds get the rest; ``sigma_all`` its noise with the whole ε.  ``rounds`` = 0 plans the
    popularity list alone.  ``negatives``: sampled items per held-out positive (None: full ranking).
    """
    metric = "Recall@20" if negatives is None else f"HR@10 among {negatives + 1}"
    forecast_all = forecast_ratio(train, sigma_all, negatives=negatives, seed=seed)

    def plan(share: float, r: int, sigma: float, forecast: float) -> PrivatePlan:
        return PrivatePlan(
            epsilon=epsilon,
            delta=delta,
            devices=train.n_users,
            items=train.n_items,
            pop_theta=POP_THETA,
            pop_share=share,
            rounds=r,
            sigma_pop=sigma,
            forecast=forecast,
            forecast_all=forecast_all,
            metric=metric,
        )

    if rounds > 0:
        for share in sorted(shares):
            if share > MAX_SHARE:
                break
            sigma = sigma_at(share)
            forecast = forecast_ratio(train, sigma, negatives=negatives, seed=seed)
            if forecast >= target:
                return plan(share, rounds, sigma, forecast)
    return plan(1.0, 0, sigma_all, forecast_all)


def choose_with_margin(
    per_user: Mapping[float, NDArray[np.float64]], *, floor: float = math.inf, margin_se: float = MARGIN_SE
) -> tuple[float, str]:
    """The α whose validation metric is best, if it beats ``floor``'s (the private list) by more than
    ``margin_se`` standard errors of the paired per-user difference; else ``floor``.  Returns (α, why)."""
    if floor not in per_user:
        raise ValueError("the floor's validation results are missing")
    base = per_user[floor]
    best = max((a for a in per_user if a != floor), key=lambda a: float(per_user[a].mean()), default=None)
    if best is None:
        return floor, "no learned score to compare"
    diff = per_user[best] - base
    se = float(diff.std(ddof=1) / math.sqrt(diff.size)) if diff.size > 1 else math.inf
    gain = float(diff.mean())
    if gain > margin_se * se:
        return best, f"the learned score beats the private popularity list on validation by {gain:+.4f} (SE {se:.4f})"
    return floor, (
        f"the learned score does not beat the private popularity list on validation ({gain:+.4f}, SE {se:.4f}): "
        "serving the private popularity list"
    )
