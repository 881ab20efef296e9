"""Real-valued MF with embedding clipping in the simulator: the non-private centralized reference,
in-process federation (cross-device LFL or cross-silo HFL, no secure aggregation), evaluation (test
RMSE and sampled-negative ranking), and the sensitivity / ε figures of the Skellam noise the
coordinator adds (FMF paper sections 4–6, `docs/design.md` §3.1).

Invariants:
- Devices run exactly `device_sdk.mf.MFModel.local_update` / `fine_tune`, and the server exactly
  `agg_server.strategy.mf.MFStrategy.aggregate`, on the plain **sum** of the cohort's uploads — the
  split of work of a real round, without masking or noise.
- In the cross-device mode every user is one device.  Users' local computations are independent
  (their own u, their own trimming and negatives), so the cohort's uploads are computed by one
  `local_update` call on a model holding every user: the sum is the same function of the data as
  the sum of one call per device; only the order of draws from the generator differs.
- All randomness comes from one generator seeded by the schedule: a run is reproducible from its seed.
- Ratings stay on their raw scale [0, R] (R = ``max_norm2``), the scale the sensitivity 2R^{3/2}
  is derived for.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from agg_server.strategy.base import round_plan
from agg_server.strategy.mf import MFStrategy
from device_sdk.family import LocalRatings
from device_sdk.mf import MFConfig, MFModel, example_rmse, initial_factors, project_rows, sample_negatives
from fedsim.data.ratings import Ratings
from fedsim.evaluation.experiment import Candidates
from fedsim.evaluation.ranking import EvalResult, TieMode, evaluate_candidates
from protocol.accounting import compute_epsilon

__all__ = [
    "FederatedMF",
    "MFEpsilons",
    "MFEvaluation",
    "MFRoundReport",
    "MFSchedule",
    "MFSensitivity",
    "centralized_mf",
    "device_config",
    "evaluate_mf",
    "mf_epsilons",
    "mf_sensitivity",
    "run_federated_mf",
]


# -- centralized reference ---------------------------------------------------------------------------


def centralized_mf(
    train: Ratings,
    *,
    factors: int = 32,
    max_norm2: float = 5.0,
    learning_rate: float = 0.01,
    reg: float = 0.0,
    epochs: int = 40,
    batch_size: int = 256,
    negatives: int = 0,
    init_scale: float = 0.1,
    rng: np.random.Generator,
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """The non-private centralized reference: the same loss (r − u·v)² (+ λ‖u‖²) and the same
    clipping Π on U and V, optimised by shuffled mini-batch projected SGD over all training ratings.

    Every mini-batch takes one step η·Σ(per-example gradients) on the user and item rows it touches
    and projects them; ``negatives`` unobserved items per rating, fitted as 0, are redrawn each epoch.

    Parameters
    ----------
    train : training ratings on the raw scale [0, max_norm2].
    factors, max_norm2 : f and R.
    learning_rate : per-example step η; reg : λ on u.
    epochs, batch_size : passes over the data and examples per step.
    negatives : sampled unobserved items per rating (0 = explicit ratings only).
    init_scale : initial rows are Π(init_scale · Uniform[0, 1)).
    rng : generator for initial factors, shuffling and negatives.

    Returns
    -------
    (U, V): (n_users, f) and (n_items, f) float64, every row inside the clipping set.
    """
    R = float(max_norm2)
    if len(train) and (train.ratings.min() < 0 or train.ratings.max() > R):
        raise ValueError(f"ratings must lie in [0, R] = [0, {R}]")
    if epochs < 0 or batch_size < 1:
        raise ValueError(f"need epochs >= 0 and batch_size >= 1, got {epochs}, {batch_size}")
    U = initial_factors(train.n_users, factors, R, init_scale, rng)
    V = initial_factors(train.n_items, factors, R, init_scale, rng)
    users, items, r = train.users, train.items, np.asarray(train.ratings, dtype=np.float64)
    for _ in range(epochs):
        eu, ei, er = users, items, r
        if negatives:
            nu, ni = sample_negatives(np.repeat(users, negatives), users, items, train.n_items, rng)
            eu, ei, er = np.r_[users, nu], np.r_[items, ni], np.r_[r, np.zeros(nu.size)]
        order = rng.permutation(eu.size)
        for start in range(0, order.size, batch_size):  # loop over mini-batches (iterations)
            b = order[start : start + batch_size]
            bu, bi, br = eu[b], ei[b], er[b]
            Ub, Vb = U[bu], V[bi]
            w = -2.0 * (br - np.einsum("ij,ij->i", Ub, Vb))
            tu, iu = np.unique(bu, return_inverse=True)
            ti, ii = np.unique(bi, return_inverse=True)
            gu = np.zeros((tu.size, factors))
            gv = np.zeros((ti.size, factors))
            np.add.at(gu, iu, w[:, None] * Vb)
            np.add.at(gv, ii, w[:, None] * Ub)
            U[tu] = project_rows(U[tu] - learning_rate * (gu + 2.0 * reg * U[tu]), R)
            V[ti] = project_rows(V[ti] - learning_rate * gv, R)
    return U, V


# -- in-process federation ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MFSchedule:
    """Federation schedule of an in-process MF run.

    Attributes
    ----------
    rounds : global rounds T.
    fraction : share of the clients (devices, or silos) invited per round.
    example_cap : θ, ratings per user per round (0 = all).
    silos : 0 for cross-device (one device per user); K ≥ 1 partitions the users at random into K
        silo clients (HFL), each uploading the sum over its users.  The server step γ/|uploads|
        applies to the mean *upload*, so a silo run wants γ about (users per silo) times smaller
        than a cross-device run for the same step per user.
    fine_tune_epochs : stage-3 steps on u after the last round (0 = none).
    seed : seed of the run's generator.
    """

    rounds: int = 100
    fraction: float = 1.0
    example_cap: int = 0
    silos: int = 0
    fine_tune_epochs: int = 50
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rounds < 0:
            raise ValueError(f"rounds must be >= 0, got {self.rounds}")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction}")
        for name in ("example_cap", "silos", "fine_tune_epochs"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class MFRoundReport:
    """One round: index, clients that uploaded, examples in the sum, the server's change, seconds."""

    round: int
    clients: int
    examples: int
    change: str
    seconds: float
    train_rmse: float


@dataclass
class FederatedMF:
    """The result of `run_federated_mf`: every user's vector (after stage 3) and the global V."""

    user_factors: NDArray[np.float64]
    item_factors: NDArray[np.float64]
    history: list[MFRoundReport] = field(default_factory=list)


def device_config(strategy: MFStrategy, schedule: MFSchedule) -> MFConfig:
    """The device-side config matching a strategy's plan and the schedule's θ and stage 3."""
    return MFConfig(
        factors=strategy.rank,
        max_norm2=strategy.max_norm2,
        learning_rate=strategy.learning_rate,
        reg=strategy.reg,
        pretrain_epochs=strategy.pretrain_epochs,
        local_epochs=strategy.local_epochs,
        example_cap=schedule.example_cap,
        negatives=strategy.negatives,
        fine_tune_epochs=schedule.fine_tune_epochs,
        init_scale=strategy.init_scale,
    )


def run_federated_mf(
    train: Ratings,
    strategy: MFStrategy,
    schedule: MFSchedule,
    *,
    on_round: Callable[[MFRoundReport], None] | None = None,
) -> FederatedMF:
    """Federated MF (LFL-SGDMF / HFL-SGDMF without noise): T rounds; each round a random cohort of
    ⌈fraction · clients⌉ clients downloads V, runs `MFModel.local_update` (stage 1 for new users,
    u steps, trimmed V-gradient sum) and the server applies `MFStrategy.aggregate` to the plain sum.
    After the last round every client fine-tunes its users' vectors against the final V (stage 3).

    Parameters
    ----------
    train : training ratings (raw scale, within [0, strategy.max_norm2]).
    strategy : the server strategy (f, R, γ and the device plan).
    schedule : rounds, cohort fraction, θ, silos, stage-3 epochs, seed.
    on_round : called with each round's report.
    """
    if train.n_items != strategy.n_items:
        raise ValueError(f"the data has {train.n_items} items, the strategy {strategy.n_items}")
    rng = np.random.default_rng(schedule.seed)
    cfg = device_config(strategy, schedule)
    V = strategy.initialize(rng)
    n = train.n_users
    active = np.flatnonzero(train.user_counts() > 0)
    if schedule.silos:
        if schedule.silos > active.size:
            raise ValueError(f"{schedule.silos} silos for {active.size} users with ratings")
        groups = np.array_split(rng.permutation(active), schedule.silos)
    else:
        groups = [active]  # one pool model; its clients are the single users
    silos = _Silos.of(train, groups)
    models = [MFModel(strategy.n_items, cfg, n_users=g.size, rng=rng) for g in groups]
    clients = len(groups) if schedule.silos else active.size
    cohort_size = max(1, math.ceil(schedule.fraction * clients))
    state = FederatedMF(user_factors=np.zeros((n, strategy.rank)), item_factors=V)
    for t in range(schedule.rounds):
        start = time.perf_counter()
        cohort = rng.choice(clients, size=cohort_size, replace=False)
        if schedule.silos:
            parts = [(int(s), np.ones(len(train), dtype=bool)) for s in np.sort(cohort)]
        else:
            in_cohort = np.zeros(n, dtype=bool)
            in_cohort[active[cohort]] = True
            parts = [(0, in_cohort[train.users])]
        new_V, examples, train_rmse = _mf_round(t, V, parts, cohort_size, models, silos, strategy, schedule, rng)
        change = strategy.describe(V, new_V)
        V = new_V
        report = MFRoundReport(t + 1, cohort_size, examples, change, time.perf_counter() - start, train_rmse)
        state.history.append(report)
        if on_round is not None:
            on_round(report)
    wire = strategy.to_wire(V)["values"]
    everyone = np.ones(len(train), dtype=bool)
    for s, model in enumerate(models):  # stage 3 on every client
        model.set_global(b"", wire, schedule.rounds + 1)
        model.fine_tune(silos.data_of(s, everyone), schedule.fine_tune_epochs, rng=rng)
        state.user_factors[groups[s]] = model.user_factors
    state.item_factors = V
    return state


@dataclass(frozen=True, slots=True)
class _Silos:
    """The clients' users: client model ``s`` holds ``groups[s]`` (cross-device: one pool of single users)."""

    train: Ratings
    groups: list[NDArray[np.int64]]
    local_of: NDArray[np.int64]  # each user's row in its client model (-1: no ratings)
    silo_of: NDArray[np.int64]  # each user's client model (-1: no ratings)

    @classmethod
    def of(cls, train: Ratings, groups: list[NDArray[np.int64]]) -> _Silos:
        local_of = np.full(train.n_users, -1, dtype=np.int64)
        silo_of = np.full(train.n_users, -1, dtype=np.int64)
        for s, g in enumerate(groups):  # loop over silos (few)
            local_of[g] = np.arange(g.size)
            silo_of[g] = s
        return cls(train, groups, local_of, silo_of)

    def data_of(self, s: int, mask: NDArray[np.bool_]) -> LocalRatings:
        """The ratings of client model ``s`` among the rows ``mask`` selects."""
        train = self.train
        sel = mask & (self.silo_of[train.users] == s)
        users = self.local_of[train.users[sel]]
        return LocalRatings(users, train.items[sel].astype(np.int64), train.ratings[sel], self.groups[s].size)


def _mf_round(
    t: int,
    V: NDArray[np.float64],
    parts: list[tuple[int, NDArray[np.bool_]]],
    cohort_size: int,
    models: list[MFModel],
    silos: _Silos,
    strategy: MFStrategy,
    schedule: MFSchedule,
    rng: np.random.Generator,
) -> tuple[NDArray[np.float64], int, float]:
    """Round ``t`` (0-based) over the cohort's ``(client model, rows)`` parts, ``cohort_size`` clients:
    the new V, the examples in the plain sum, and the cohort's train RMSE."""
    version = t + 1
    plan = round_plan(strategy, version, round_index=t, example_cap=schedule.example_cap)
    wire = strategy.to_wire(V)["values"]
    total = np.zeros(strategy.vector_length)
    examples, sq, count = 0, 0.0, 0
    for s, mask in parts:  # loop over the cohort's silos (one pool call in the cross-device mode)
        models[s].set_global(b"", wire, version)
        data = silos.data_of(s, mask)
        result = models[s].local_update(plan, data, rng)
        total += result.vector
        examples += result.examples
        sq += float(result.info["train_rmse"]) ** 2 * data.items.size
        count += data.items.size
    return strategy.aggregate(V, total, cohort_size, rng, round_index=t), examples, math.sqrt(sq / max(count, 1))


# -- evaluation ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MFEvaluation:
    """Test RMSE on held-out ratings and, if candidate blocks were given, HR@k / NDCG@k."""

    rmse: float
    n_ratings: int
    ranking: EvalResult | None

    def __str__(self) -> str:
        rank = "" if self.ranking is None else f"  {self.ranking}"
        return f"RMSE {self.rmse:.4f} (n={self.n_ratings}){rank}"


def evaluate_mf(
    user_factors: NDArray[np.float64],
    item_factors: NDArray[np.float64],
    held_out: Ratings,
    candidates: Candidates | None = None,
    *,
    k: int = 10,
    tie_mode: TieMode = TieMode.RANDOM,
    item_term: NDArray[np.float64] | None = None,
    term_only: bool = False,
) -> MFEvaluation:
    """Test RMSE of u·v on ``held_out`` ratings and the ranking metrics of the candidate blocks
    (positive in column 0; RANDOM ties are averaged exactly, see `fedsim.evaluation.ranking`).  The blocks
    are ranked by u·v + ``item_term[i]`` when given (a private popularity level), or by the term
    alone with ``term_only``; the RMSE is always that of u·v."""
    U, V = np.asarray(user_factors, np.float64), np.asarray(item_factors, np.float64)
    if U.shape[1] != V.shape[1] or U.shape[0] < held_out.n_users or V.shape[0] < held_out.n_items:
        raise ValueError(f"factors {U.shape} / {V.shape} do not cover the held-out id space")
    rmse = example_rmse(U, V, held_out.users, held_out.items, np.asarray(held_out.ratings, np.float64))
    ranking = None
    if candidates is not None and len(candidates):
        if term_only and item_term is not None:
            scores = np.asarray(item_term, np.float64)[candidates.items]
        else:
            scores = np.einsum("nf,ncf->nc", U[candidates.users], V[candidates.items])
            if item_term is not None:
                scores = scores + np.asarray(item_term, np.float64)[candidates.items]
        ranking = evaluate_candidates(scores, k, tie_mode)
    return MFEvaluation(rmse, len(held_out), ranking)


# -- privacy figures --------------------------------------------------------------------------------


class MFSensitivity(NamedTuple):
    """L2 sensitivities of one upload in model units (FMF paper section 4.1.1 / 4.2)."""

    per_rating: float  # 2R^{3/2}: one example's V-gradient
    per_user: float  # θ·(1 + negatives)·2R^{3/2}: all of a user's kept examples


def mf_sensitivity(theta: int, R: float, *, negatives: int = 0) -> MFSensitivity:
    """Per-rating and per-user L2 sensitivity of the V-gradient sum.

    With u, v in the clipping set, |r − u·v| ≤ R and ‖u‖ ≤ √R, so one example's gradient
    −2(r − u·v)·u has norm ≤ 2R^{3/2}; a user keeps at most θ ratings per round (plus ``negatives``
    sampled zeros per rating, each an example of the same bound).

    Raises
    ------
    ValueError
        If θ < 1 (θ = 0, "all ratings", has no bound) or R ≤ 0.
    """
    if theta < 1:
        raise ValueError(f"theta must be >= 1 to bound a user's contribution, got {theta}")
    if not (R > 0 and math.isfinite(R)) or negatives < 0:
        raise ValueError(f"need R > 0 and negatives >= 0, got {R}, {negatives}")
    per_rating = 2.0 * R**1.5
    return MFSensitivity(per_rating, theta * (1 + negatives) * per_rating)


class MFEpsilons(NamedTuple):
    """ε after ``rounds`` rounds and the quantized sensitivities it was computed from."""

    per_user: float
    per_rating: float
    l2_user: float
    l1_user: float
    l2_rating: float
    l1_rating: float


def mf_epsilons(
    mu: float,
    scale_bits: int,
    theta: int,
    R: float,
    f: int,
    rounds: int,
    delta: float,
    *,
    negatives: int = 0,
    clip_norm: float | None = None,
) -> MFEpsilons:
    """Per-user and per-rating ε of the aggregate Skellam noise of variance ``mu`` (quantized units)
    over ``rounds`` rounds in which a device takes part, with `protocol.accounting.compute_epsilon`.

    Quantized sensitivities (cf. `protocol.quantization.sensitivity`): the scaled bound 2^s·Δ plus
    the stochastic-rounding slack, which touches only non-zero coordinates (zeros round to zero).
    A user's upload is non-zero on at most E = θ·(1 + negatives) rows of f entries, so

    * per user:   l2 = 2^s·Δ_user + √(E·f),   l1 = √(E·f)·l2;
    * per rating: l2 = 2^s·Δ_rating + √f,     l1 = √f·l2.

    ``clip_norm`` (the coordinator's C, if given) caps Δ: the upload is clipped to C before scaling.

    The per-user figure is the rigorous one.  The per-rating one follows the paper's accounting,
    which treats u as fixed: u is refitted on all of the user's ratings, so removing one rating also
    moves the other kept examples' gradients; it is exact only for θ = 1 (then it equals per-user
    with no negatives) or with u frozen.
    """
    sens = mf_sensitivity(theta, R, negatives=negatives)
    cap = math.inf if clip_norm is None else float(clip_norm)
    scale = float(2**scale_bits)
    e = theta * (1 + negatives) * f
    l2_user = scale * min(sens.per_user, cap) + math.sqrt(e)
    l2_rating = scale * min(sens.per_rating, cap) + math.sqrt(f)
    l1_user, l1_rating = math.sqrt(e) * l2_user, math.sqrt(f) * l2_rating
    return MFEpsilons(
        per_user=compute_epsilon(mu, l1_user, l2_user, rounds, delta),
        per_rating=compute_epsilon(mu, l1_rating, l2_rating, rounds, delta),
        l2_user=l2_user,
        l1_user=l1_user,
        l2_rating=l2_rating,
        l1_rating=l1_rating,
    )
