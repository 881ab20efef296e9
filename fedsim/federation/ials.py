"""Federated implicit ALS in the simulator: in-process federation (plain sums, no secure aggregation), the
choice of α, λ, d and the item term's weight w on validation, and the one scoring call every evaluation of the
family goes through.

Invariants:
- Devices run exactly `device_sdk.ials.IALSModel.local_update`, and the server exactly
  `agg_server.strategy.ials.IALSStrategy.aggregate`, on the plain **sum** of the cohort's uploads: the split
  of work of a real round, without masking or noise.  Every part of the upload is a sum over users, so the
  cohort's uploads are computed by one `local_update` on a model holding every user: the same function of
  the data as the sum of one call per device.
- After the last round every device adopts the final V (`IALSModel.adopted`: its exact user step against
  it, nothing uploaded), as a device does when it downloads a new version.
- Every score of a trained model comes from `IALSRun.score` (validation and test alike), so the ranking a
  device uses is switched in one place: u·v + w·level / 255, the levels those the server sends with the last
  round's model (`protocol.families.ials.item_levels` of the sum's holder counts), w = 0 for u·v alone.
- All randomness comes from one generator seeded by the schedule: a run is reproducible from its seed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from typing import Protocol as TypingProtocol

import numpy as np
from numpy.typing import NDArray

from agg_server.strategy.base import round_plan
from agg_server.strategy.ials import IALSStrategy
from device_sdk.family import LocalRatings
from device_sdk.ials import IALSConfig, IALSModel
from fedsim.data.ratings import Ratings
from fedsim.evaluation.experiment import Experiment, Protocol
from fedsim.evaluation.ranking import TieMode, evaluate_all_items, evaluate_candidates
from protocol.families.ials import DEFAULT_FACTORS, LEVEL_TOP, item_levels
from protocol.plan import IALSParams

__all__ = [
    "ALPHA_GRID",
    "FACTOR_GRID",
    "IALSRoundReport",
    "IALSRun",
    "IALSSchedule",
    "IALSSelection",
    "LEVEL_WEIGHTS",
    "RankedModel",
    "STRONG_RIDGE",
    "run_federated_ials",
    "ridge_grid",
    "select_and_train",
    "validation_metric",
]

#: The confidences α tried on validation when none is given (one training each; the best is kept).
ALPHA_GRID: tuple[float, ...] = (5.0, 20.0, 100.0)
#: The strong ridge tried on validation when no λ is given, per unit of a held item's confidence: λ = ρ·(1 + α).
#: Divided by 1 + α, the user step weighs a held item about 1 and λ as ρ, so ρ is the ridge on the scale of the
#: data whatever α is (the figures that chose it: docs/results/2026-11-27-auto-default.md).  A strong ridge shrinks
#: the factors towards the few directions the data supports, what sparse logs (a few items per user, most items
#: held once or twice) need; dense logs keep the family's weak default, λ = 0.1.
STRONG_RIDGE = 5.0


def ridge_grid(alpha: float) -> tuple[float, ...]:
    """The λ tried at confidence α when none is given: the family's default, then the strong ridge ρ·(1 + α)."""
    return (IALSParams().reg, STRONG_RIDGE * (1.0 + alpha))


#: The factor counts d tried on validation when none is given: the first with every α, the others at the best
#: (α, λ).
FACTOR_GRID: tuple[int, ...] = (DEFAULT_FACTORS, 128, 32)
#: The weights w of the item term (u·v + w·level / 255) tried on the kept model; 0 = u·v alone.
LEVEL_WEIGHTS: tuple[float, ...] = (0.0, 0.01, 0.03, 0.1)


@dataclass(frozen=True, slots=True)
class IALSSchedule:
    """Federation schedule of an in-process iALS run.

    Attributes
    ----------
    rounds : global rounds T (>= 1; default 5).
    fraction : share of the devices (users) invited per round, in (0, 1] (default 1: every device).
    seed : seed of the run's generator (initial V, cohorts).
    """

    rounds: int = 5
    fraction: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 1:
            raise ValueError(f"rounds must be an integer >= 1, got {self.rounds!r}")
        if not (isinstance(self.fraction, int | float) and 0 < self.fraction <= 1):
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction!r}")


@dataclass(frozen=True, slots=True)
class IALSRoundReport:
    """One round: index, devices that uploaded, positives in the sum, the server's change, seconds."""

    round: int
    devices: int
    positives: int
    change: str
    seconds: float


@dataclass
class IALSRun:
    """A trained model: every user's vector (against the final V), the global V, the item levels of the last
    round's holder counts (None before a round) and the weight w the scores give them."""

    user_factors: NDArray[np.float64]
    item_factors: NDArray[np.float64]
    history: list[IALSRoundReport] = field(default_factory=list)
    item_levels: NDArray[np.uint8] | None = None
    level_weight: float = 0.0

    def score(self, users: NDArray[np.int64]) -> NDArray[np.float64]:
        """(len(users), m) scores u·v + w·level / 255 of every item, as `device_sdk.ials.IALSModel` ranks: the
        one ranking call of the family's evaluation."""
        scores = self.user_factors[np.asarray(users, dtype=np.int64)] @ self.item_factors.T
        if self.item_levels is not None and self.level_weight > 0:
            scores += (self.level_weight / LEVEL_TOP) * self.item_levels.astype(np.float64)
        return scores

    def scores(self, users: NDArray[np.int64], candidates: NDArray[np.int64]) -> NDArray[np.float64]:
        """The scores of each user's candidate items ((n, c) from `score`)."""
        return np.take_along_axis(self.score(users), np.asarray(candidates, dtype=np.int64), axis=1)

    def all_scores(self, users: NDArray[np.int64]) -> NDArray[np.float64]:
        """Scores against every item, a full-ranking scorer (`fedsim.evaluation.ranking.evaluate_all_items`)."""
        return self.score(users)


def _pool(train: Ratings) -> LocalRatings:
    return LocalRatings(train.users.astype(np.int64), train.items.astype(np.int64), None, max(train.n_users, 1))


def run_federated_ials(
    train: Ratings,
    strategy: IALSStrategy,
    schedule: IALSSchedule,
    *,
    initial: NDArray[np.float64] | None = None,
    on_round: Callable[[IALSRoundReport], None] | None = None,
) -> IALSRun:
    """Federated iALS with plain sums: T rounds; each round a random cohort of ⌈fraction · devices⌉
    devices (one per user with a rating) downloads V and runs `IALSModel.local_update` (exact user step,
    upload sums), and the server applies `IALSStrategy.aggregate` to the sum.  Then every device adopts
    the final V.  The run keeps the item levels of the last sum's holder counts and the strategy's w
    (`IALSStrategy.to_wire` sends both when w > 0).

    Parameters
    ----------
    train : the training log (implicit: every (user, item) pair counts once).
    strategy : the server strategy (d, α, λ).
    schedule : rounds, cohort fraction, seed.
    initial : the version-1 V (default: `IALSStrategy.initialize` from the schedule's generator), e.g. a
        real server's, to compare a run through secure aggregation with this one.
    on_round : called with each round's report.
    """
    if train.n_items != strategy.n_items:
        raise ValueError(f"the data has {train.n_items} items, the strategy {strategy.n_items}")
    rng = np.random.default_rng(schedule.seed)
    V = strategy.initialize(rng) if initial is None else np.array(initial, dtype=np.float64)
    cfg = IALSConfig(factors=strategy.rank, alpha=strategy.alpha, reg=strategy.reg)
    data = _pool(train)
    model = IALSModel(strategy.n_items, cfg, n_users=data.n_users, rng=rng)
    active = np.flatnonzero(np.bincount(train.users, minlength=data.n_users) > 0)
    cohort_size = max(1, math.ceil(schedule.fraction * active.size))
    run = IALSRun(user_factors=model.user_factors, item_factors=V, level_weight=strategy.level_weight)
    for t in range(schedule.rounds):
        start = time.perf_counter()
        cohort = active if cohort_size == active.size else np.sort(rng.choice(active, cohort_size, replace=False))
        in_cohort = np.zeros(data.n_users, dtype=bool)
        in_cohort[cohort] = True
        rows = in_cohort[data.users]
        part = LocalRatings(data.users[rows], data.items[rows], None, data.n_users)
        _download(model, strategy, V, t + 1)
        result = model.local_update(round_plan(strategy, t + 1, round_index=t), part, rng)
        new_V = strategy.aggregate(V, result.vector, cohort_size, rng, round_index=t)
        run.item_levels = item_levels(strategy.layout.split(result.vector)["counts"])
        change, V = strategy.describe(V, new_V), new_V
        run.history.append(IALSRoundReport(t + 1, cohort_size, result.examples, change, time.perf_counter() - start))
        if on_round is not None:
            on_round(run.history[-1])
    _download(model, strategy, V, schedule.rounds + 1)
    model.adopted(data)
    run.user_factors, run.item_factors = model.user_factors, V
    return run


def _download(model: IALSModel, strategy: IALSStrategy, V: NDArray[np.float64], version: int) -> None:
    """What a device does with a `ModelPayload` of ``V``: V and, with w > 0, the item term."""
    wire = strategy.to_wire(V)
    extras = {k: wire[k] for k in ("item_levels", "level_weight") if k in wire}
    model.set_global(b"", wire["values"], version, **extras)


# -- choice on validation ---------------------------------------------------------------------------


class RankedModel(TypingProtocol):
    """What `validation_metric` scores: a trained model of any family (`IALSRun`,
    `fedsim.federation.lightfr.FederatedLightFR`)."""

    def scores(self, users: NDArray[np.int64], candidates: NDArray[np.int64]) -> Any:
        """Each user's scores of its candidate items, (n, c)."""
        ...

    def all_scores(self, users: NDArray[np.int64]) -> Any:
        """Scores against every item, (len(users), m)."""
        ...


def validation_metric(exp: Experiment, run: RankedModel, *, eval_seed: int = 0) -> tuple[str, float]:
    """The validation figure a choice is made on: Recall@20 of a full ranking over the carved validation
    pairs (protocol full), else HR@10 of the validation blocks; random ties.  Any family's trained model is
    judged by the same figure on the same held-out items and negatives (``fedrec simulate``'s default compares
    LightFR and iALS with it)."""
    if exp.protocol is Protocol.FULL:
        if exp.val_pairs is None:
            raise ValueError("a full-ranking experiment without validation pairs")
        res = evaluate_all_items(run.all_scores, exp.train, exp.val_pairs, k=20, seed=eval_seed)
        return "recall@20", res.recall
    return "hr@10", evaluate_candidates(run.scores(exp.val.users, exp.val.items), 10, TieMode.RANDOM).hr


@dataclass(frozen=True, slots=True)
class IALSSelection:
    """The outcome of `select_and_train`: the kept run, its (d, α, λ, w), every trained candidate's validation
    figure (u·v alone) and the kept run's figure at each w."""

    run: IALSRun
    factors: int
    alpha: float
    reg: float
    level_weight: float
    metric: str
    validation: dict[tuple[int, float, float], float]
    level_validation: dict[float, float]
    seconds: float

    @property
    def value(self) -> float:
        """The kept model's validation figure (with its w)."""
        return self.level_validation[self.level_weight]


def select_and_train(
    exp: Experiment,
    schedule: IALSSchedule,
    *,
    factors: Sequence[int] = FACTOR_GRID,
    alphas: Sequence[float] = ALPHA_GRID,
    regs: Sequence[float] | None = None,
    level_weights: Sequence[float] = LEVEL_WEIGHTS,
    eval_seed: int = 0,
    on_candidate: Callable[[int, float, float, str, float, float], None] | None = None,
) -> IALSSelection:
    """Choose (d, α, λ) on validation by a coordinate search and keep the best run, then the weight w of its
    item term; nothing is refitted.

    Every α of ``alphas`` is trained at ``factors[0]`` and ``regs[0]``; then every other λ at the best α; then
    every other factor count at the best (α, λ).  ``regs`` None: `ridge_grid` of each α (λ = 0.1 with every α,
    then ρ·(1 + α) at the best).  Each run trains on ``exp.train`` and is judged by
    `validation_metric` on u·v (the first of equal figures wins).  Then the kept run is judged at every w of
    ``level_weights`` (scores only: w changes no training) and keeps the best (the first of equal figures).
    ``on_candidate(d, α, λ, metric, value, seconds)`` is called after each training.
    """
    if not factors or not alphas or (regs is not None and not regs) or not level_weights:
        raise ValueError("need at least one factor count, one α, one λ and one item-term weight")
    t0 = time.perf_counter()
    best: tuple[float, IALSRun, int, float, float] | None = None
    seen: dict[tuple[int, float, float], float] = {}
    metric = ""

    def trial(d: int, alpha: float, reg: float) -> None:
        nonlocal best, metric
        start = time.perf_counter()
        strategy = IALSStrategy(exp.train.n_items, rank=d, alpha=alpha, reg=reg)
        run = run_federated_ials(exp.train, strategy, schedule)
        metric, value = validation_metric(exp, run, eval_seed=eval_seed)
        seen[(d, alpha, reg)] = value
        if on_candidate is not None:
            on_candidate(d, alpha, reg, metric, value, time.perf_counter() - start)
        if best is None or value > best[0]:
            best = (value, run, d, alpha, reg)

    for alpha in alphas:  # loop over the few candidates
        trial(int(factors[0]), float(alpha), float((regs or ridge_grid(alpha))[0]))
    assert best is not None
    for reg in (regs or ridge_grid(best[3]))[1:]:
        trial(int(factors[0]), best[3], float(reg))
    chosen_alpha, chosen_reg = best[3], best[4]
    for d in factors[1:]:
        trial(int(d), chosen_alpha, chosen_reg)
    _, run, d, alpha, reg = best
    by_weight = {}
    for w in level_weights:  # loop over the few weights
        run.level_weight = float(w)
        by_weight[float(w)] = seen[(d, alpha, reg)] if w == 0 else validation_metric(exp, run, eval_seed=eval_seed)[1]
    run.level_weight = max(by_weight, key=lambda w: (by_weight[w], -list(by_weight).index(w)))
    return IALSSelection(run, d, alpha, reg, run.level_weight, metric, seen, by_weight, time.perf_counter() - t0)
