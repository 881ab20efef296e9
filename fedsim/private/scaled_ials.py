"""Private federated implicit ALS over a whole dataset through the private-round simulator.

One run (`run_private_ials`):

1. **Private popularity**, as for LightFR (`fedsim.private.scaled_lightfr.release_counts`): one release of
   each device's item indicator clipped to L2 norm √θ_pop, with the share of ε the privacy planner gives it.
2. **T iALS rounds** of every device, each charged in full.  Each device solves its user vector exactly
   against the downloaded item factors and uploads the **bounded** sums (`device_sdk.ials.upload_sums` with
   θ >= 1: unit u, its item rows and counts weighted 1/√max(|I|, θ), the Gram part γ·u uᵀ), L2 norm at most
   √(2 + γ²), the clip norm; the coordinator adds the Skellam noise; the server solves every item from the
   noisy sums with the shared curvature (`agg_server.strategy.ials.IALSStrategy`).  The weighted sums are
   sufficient statistics of an item step (as in private alternating least squares), so a few rounds are
   enough: each round re-solves V from scratch instead of stepping on a gradient, and noise does not pile up.
3. Each device re-solves its user vector against the final V (local; nothing is uploaded) and ranks by
   u·v + α·level, level the private popularity on a log scale over [0, 1]; α is chosen on validation from a
   grid holding the list alone (α = ∞), which the learned score must beat by `MARGIN_SE` standard errors.

The ε reported is the ledger's: the popularity release and every round composed (RDP) and converted once.
The rounds' devices are simulated in batches with the device's own kernels; the sum is exact in
distribution (rounding coins and noise from seeded streams: a simulation, ε is not a guarantee here).
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from agg_server.config import ServerConfig, config_from_dict
from agg_server.strategy import build_strategy
from device_sdk.ials import solve_users
from fedsim.data.ratings import Ratings
from fedsim.private.cohorts import cohort_rows
from fedsim.private.planner import POP_THETA, PrivatePlan
from fedsim.private.scaled_lightfr import (
    _largest_scale_bits,
    _per_user,
    colluder_inflation,
    item_levels,
    plan_split,
    popularity_only,
    seeded_release,
    split_budget,
    split_run_budget,
    widest_quantization,
)
from fedsim.private.served import PrivateRunResult, ServedScore, evaluate_served, validate
from fedsim.private.simulator import PrivateSimulator, one_blas_thread
from protocol.errors import ConfigError
from protocol.families.ials import IALSLayout
from protocol.messages import RoundInvite
from protocol.plan import IALSParams
from protocol.quantization import sensitivity, stochastic_round
from protocol.samplers import NoiseStream

__all__ = [
    "IALSCohort",
    "PrivateIALSResult",
    "PrivateIALSSettings",
    "PRIVATE_IALS_ROUNDS",
    "evaluate_private_ials",
    "plan_private_ials",
    "run_private_ials",
    "validate_private_ials",
    "with_plan",
]

#: Rounds of a private iALS run: validation Recall@20 of the served score on amazon-book at ε = 8 (θ = 10, α = 100,
#: γ = 0.1) was 0.0940 / 0.0987 / 0.0926 at T = 2 / 3 / 4; at ε = 1, 0.0484 / 0.0480 / 0.0475 at T = 1 / 2 / 3
#: (docs/dp-accounting.md §7.2).
PRIVATE_IALS_ROUNDS = 3


@dataclass(frozen=True, slots=True)
class PrivateIALSSettings:
    """One private iALS run.

    Attributes
    ----------
    epsilon, delta : user-level ε over the whole run at δ (0 = no DP noise).
    rounds : iALS rounds T (0 = the popularity release alone, with the whole ε).
    factors : d; 0 (the default) lets the noise choose it (`choose_factors`).
    alpha, reg : the confidence α and ridge λ of both solves.
    theta : θ of the bounded upload (rows weighted 1/√max(|I|, θ)); 1: every device's rows have total weight 1,
        which per unit of noise gives each item the most signal (as the popularity release's θ = 1). Validation
        Recall@20 on amazon-book at ε = 8: θ = 30 / 10 / 5 / 3 / 2: 0.0853 / 0.0987 / 0.1021 / 0.1054 / 0.1054
        (its devices hold at least 3 items after the carve, so θ <= 3 are one setting there).
    gram_weight : γ of the bounded upload's Gram part.
    pop_theta, pop_share : the popularity release's θ and share of ε (the planner's choice by default).
    dropout_rate : ω tolerated by SecAgg+ and the DP correction.
    seed : seeds the server generators and the simulation.
    """

    epsilon: float = 8.0
    delta: float = 1e-5
    rounds: int = PRIVATE_IALS_ROUNDS
    factors: int = 0
    alpha: float = 100.0
    reg: float = 0.1
    theta: int = 1
    gram_weight: float = 0.1
    pop_theta: int = POP_THETA
    pop_share: float = 0.1
    dropout_rate: float = 0.3
    seed: int = 0

    def __post_init__(self) -> None:
        IALSParams(alpha=self.alpha, reg=self.reg, theta=self.theta, gram_weight=self.gram_weight)
        if self.theta < 1:
            raise ValueError(f"theta must be >= 1 (the bounded upload), got {self.theta}")
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 0:
            raise ValueError(f"rounds must be an integer >= 0, got {self.rounds!r}")
        if not (isinstance(self.epsilon, int | float) and math.isfinite(self.epsilon) and self.epsilon >= 0):
            raise ValueError(f"epsilon must be a finite number >= 0, got {self.epsilon!r}")
        if isinstance(self.factors, bool) or not isinstance(self.factors, int) or not 0 <= self.factors <= 4096:
            raise ValueError(f"rank must be an integer in [1, 4096] (0: chosen from the noise), got {self.factors!r}")

    @property
    def clip_norm(self) -> float:
        """√(2 + γ²): the bounded upload's largest norm, so nothing is clipped."""
        return IALSParams(theta=self.theta, gram_weight=self.gram_weight).bounded_norm


@dataclass
class PrivateIALSResult(PrivateRunResult):
    """User vectors against the final V and V of one run, beside its private counts and the ledger's ε
    (`PrivateRunResult`, keyword fields)."""

    user_factors: NDArray[np.float64]
    item_factors: NDArray[np.float64]
    settings: PrivateIALSSettings


class IALSCohort:
    """Every iALS device of a dataset at once, for `PrivateSimulator.run_scaled_round`: each device's exact user
    step (`device_sdk.ials.solve_users`) and its bounded upload (`device_sdk.ials.upload_sums`'s θ >= 1 form),
    computed in batches; each device's upload is clipped to the round's C and rounded at its scale, and the
    survivors' rounded uploads are summed as signed integers (the value secure aggregation releases)."""

    def __init__(self, per_user: list[NDArray[np.int64]], n_items: int, factors: int, *, batch: int = 2048) -> None:
        self.n_items, self.factors, self.batch = int(n_items), int(factors), int(batch)
        self.device_ids = list(range(1, 1 + len(per_user)))
        self._index = {d: i for i, d in enumerate(self.device_ids)}
        items = [np.unique(np.asarray(u, dtype=np.int64)) for u in per_user]
        lengths = np.array([u.size for u in items], dtype=np.int64)
        self.indptr = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        self.items = np.concatenate(items) if items else np.zeros(0, np.int64)
        self.user_factors = np.zeros((len(per_user), self.factors))

    def quantized_sum(
        self,
        V: NDArray[np.float64],
        invite: RoundInvite,
        cohort: Iterable[int],
        survivors: Iterable[int],
        rng: np.random.Generator,
        coins: NoiseStream,
    ) -> NDArray[np.int64]:
        """Every cohort device's round against the item factors ``V``; Σ over ``survivors`` of their
        quantized uploads as signed integers (`IALSLayout` order).  ``rng`` is unused (the step is exact)."""
        p = invite.plan.params
        if not isinstance(p, IALSParams) or p.theta < 1:
            raise ConfigError(f"an iALS cohort needs an iALS plan with the bounded upload (theta >= 1), got {p!r}")
        m, d = self.n_items, self.factors
        layout = IALSLayout(m, d)
        if int(invite.vector_length) != layout.length:
            raise ConfigError(f"the round expects {invite.vector_length} values, an iALS upload has {layout.length}")
        Vd = np.asarray(V, dtype=np.float64).reshape(m, d)
        q = invite.quantization()
        alive, rows_all = cohort_rows(self._index, cohort, survivors)
        total = np.zeros(layout.length, dtype=np.int64)
        gram_at = m * d + m
        for lo in range(0, rows_all.size, self.batch):
            rows = rows_all[lo : lo + self.batch]
            starts, ends = self.indptr[rows], self.indptr[rows + 1]
            deg = ends - starts
            indptr = np.concatenate(([0], np.cumsum(deg))).astype(np.int64)
            take = np.concatenate([np.arange(a, b) for a, b in zip(starts, ends, strict=True)]) if rows.size else []
            cols = self.items[np.asarray(take, dtype=np.int64)]
            U = solve_users(Vd, indptr, cols, p.alpha, p.reg)
            self.user_factors[rows] = U
            keep = alive[rows] & (deg > 0)
            self._add_uploads(total, U[keep], deg[keep], cols[np.repeat(keep, deg)], p, q, coins, gram_at)
        return total

    def _add_uploads(
        self,
        total: NDArray[np.int64],
        U: NDArray[np.float64],
        deg: NDArray[np.int64],
        cols: NDArray[np.int64],
        p: IALSParams,
        q: Any,
        coins: NoiseStream,
        gram_at: int,
    ) -> None:
        """Add the bounded uploads of devices with vectors ``U`` and items ``cols`` (grouped by device, ``deg``
        each), each clipped to ``q.clip_norm`` and rounded at ``q.scale`` with ``coins``."""
        m, d = self.n_items, self.factors
        if not U.shape[0]:
            return
        norms = np.linalg.norm(U, axis=1)
        unit = np.divide(U, norms[:, None], out=np.zeros_like(U), where=norms[:, None] > 0)
        w = 1.0 / np.sqrt(np.maximum(deg, p.theta).astype(np.float64))
        sq = np.einsum("ij,ij->i", unit, unit)  # 1, or 0 for a zero vector
        norm = np.sqrt(w * w * deg * sq + w * w * deg + (p.gram_weight * sq) ** 2)
        factor = np.minimum(1.0, q.clip_norm / np.maximum(norm, 1e-300)) * q.scale  # `clip_l2`, then the scale
        owner = np.repeat(np.arange(U.shape[0]), deg)
        rows = (unit * (w * factor)[:, None])[owner]  # (nnz, d)
        counts = (w * factor)[owner]
        grams = np.einsum(
            "ij,ik->ijk",
            unit * np.sqrt(p.gram_weight * factor)[:, None],
            unit * np.sqrt(p.gram_weight * factor)[:, None],
        )
        values = np.concatenate([rows.ravel(), counts, grams.ravel()])
        rounded = stochastic_round(values, coins).astype(np.float64)
        n_rows = rows.size
        idx = (cols[:, None] * d + np.arange(d)[None, :]).ravel()
        total[: m * d] += np.bincount(idx, weights=rounded[:n_rows], minlength=m * d).astype(np.int64)
        total[m * d : m * d + m] += np.bincount(cols, weights=rounded[n_rows : n_rows + cols.size], minlength=m).astype(
            np.int64
        )
        total[gram_at : gram_at + d * d] += (
            rounded[n_rows + cols.size :].reshape(-1, d * d).sum(axis=0).astype(np.int64)
        )


#: d from the noise: the largest power of two at most `FACTOR_SNR`·S/σ within `FACTOR_RANGE`, S the
#: interaction-weighted mean of the items' weighted holder counts and σ a round's noise per coordinate.
#: Calibrated on amazon-book's validation carve: the best d at ε = 8 / 4 / 2 / 1 was 64 / 32 / 16 / 16 (of 16, 32,
#: 64, 128) where S/σ is 24.2 / 13.3 / 7.2 / 3.8 (docs/results/2026-11-27-private-ials.md).
FACTOR_SNR = 2.7
FACTOR_RANGE = (16, 64)


def item_signal(train: Ratings, theta: int) -> float:
    """S = Σ_j c_j² / Σ_j c_j with c_j = Σ_{u holds j} 1/√max(|I_u|, θ): the weighted holder count of the item
    behind a typical interaction, what the bounded upload sums per item (0 for an empty log)."""
    deg = np.bincount(train.users, minlength=train.n_users).astype(np.float64)
    w = 1.0 / np.sqrt(np.maximum(deg, theta))
    c = np.bincount(train.items, weights=w[train.users], minlength=train.n_items)
    total = float(c.sum())
    return float((c * c).sum() / total) if total > 0 else 0.0


def choose_factors(signal: float, sigma: float) -> int:
    """The largest power of two d in `FACTOR_RANGE` with d <= `FACTOR_SNR`·signal/σ (the top without noise): each
    item's noisy sum carries σ·√d of noise against a signal that does not grow with d, so a noisier round keeps
    fewer factors."""
    lo, hi = FACTOR_RANGE
    if sigma <= 0:
        return hi
    d = lo
    while d * 2 <= hi and d * 2 <= FACTOR_SNR * signal / sigma:
        d *= 2
    return d


def resolve_factors(train: Ratings, settings: PrivateIALSSettings) -> tuple[PrivateIALSSettings, float]:
    """``settings`` with d chosen from the noise when ``factors`` is 0 (`choose_factors`, σ of a round at d = 64
    under the settings' split), and the S/σ it was chosen from (∞ without noise); given factors are kept."""
    s = settings
    if s.factors:
        return s, math.nan
    n, m = train.n_users, train.n_items
    probe = replace(s, factors=FACTOR_RANGE[1])
    if s.epsilon <= 0 or s.rounds == 0:
        return probe, math.inf
    cfg, model_sens = _sensitivities(n, m, probe)
    l2p, l1p = sensitivity(widest_quantization(n, math.sqrt(s.pop_theta)), m)
    mu, _ = split_budget(s.epsilon, s.delta, s.rounds, model_sens, (l1p, l2p), s.pop_share)
    inflation = colluder_inflation(cfg.rounds.cohort_size, cfg.rounds.adversary_rate)  # what the sum carries
    sigma = math.sqrt(mu * inflation) / cfg.rounds.quantization().scale
    signal = item_signal(train, s.theta)
    return replace(s, factors=choose_factors(signal, sigma)), signal / sigma


def _config(n: int, m: int, s: PrivateIALSSettings, data_dir: Path, scale_bits: int) -> ServerConfig:
    """The server configuration of a private iALS run over ``n`` devices (every device in every round)."""
    dp = s.epsilon > 0
    return config_from_dict(
        {
            "server": {"data_dir": str(data_dir)},
            "model": {"kind": "ials", "n_items": m},
            "ials": {
                "rank": s.factors,
                "alpha": s.alpha,
                "reg": s.reg,
                "theta": s.theta,
                "gram_weight": s.gram_weight,
            },
            "rounds": {
                "cohort_size": n,
                "min_cohort": n,
                "seed": s.seed,
                "clip_norm": s.clip_norm,
                "scale_bits": scale_bits,
                "dropout_rate": s.dropout_rate,
            },
            "privacy": (
                {"enabled": True, "epsilon": s.epsilon, "delta": s.delta, "planned_rounds": max(1, s.rounds)}
                if dp
                else {"enabled": False}
            ),
        },
        base_dir=data_dir,
    )


def _sensitivities(n: int, m: int, s: PrivateIALSSettings) -> tuple[ServerConfig, tuple[float, float]]:
    """(configuration, (Δ1, Δ2) of one round's quantized upload) of a run over ``n`` devices and ``m`` items."""
    tmp = tempfile.mkdtemp(prefix="fedrec-privials-")
    try:
        cfg = _config(n, m, s, Path(tmp), _largest_scale_bits(n, s.clip_norm))
        length = int(build_strategy(cfg).vector_length)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    l2, l1 = sensitivity(cfg.rounds.quantization(), length)
    return cfg, (l1, l2)


def plan_private_ials(train: Ratings, settings: PrivateIALSSettings, *, negatives: int | None) -> PrivatePlan:
    """The privacy planner's split (`fedsim.private.planner.plan_private_run`) for a private iALS run over
    ``train``: the popularity release's share and whether the rounds are afforded, from this run's own
    sensitivities and accountant."""
    s = settings if settings.factors else replace(settings, factors=FACTOR_RANGE[1])
    _, model_sens = _sensitivities(train.n_users, train.n_items, s)
    return plan_split(
        train,
        epsilon=s.epsilon,
        delta=s.delta,
        rounds=s.rounds,
        model_sens=model_sens,
        negatives=negatives,
        seed=s.seed,
    )


def run_private_ials(
    train: Ratings, settings: PrivateIALSSettings, *, on_round: Callable[[int, float], None] | None = None
) -> PrivateIALSResult:
    """The popularity release and T private iALS rounds over every user of ``train`` (T = 0: the release alone,
    with the whole ε)."""
    start = time.perf_counter()
    s, _ = resolve_factors(train, settings)
    n, m, d = train.n_users, train.n_items, s.factors
    per_user = _per_user(train)
    if s.rounds == 0:
        counts, mu_pop, eps = popularity_only(
            per_user, m, epsilon=s.epsilon, delta=s.delta, theta=s.pop_theta, seed=s.seed
        )
        zeros = np.zeros((n, d)), np.zeros((m, d))
        return PrivateIALSResult(
            *zeros,
            s,
            private_counts=counts,
            epsilon=eps,
            delta=s.delta,
            mu_model=0.0,
            mu_pop=mu_pop,
            seconds=time.perf_counter() - start,
            round_seconds=[],
        )
    qp = widest_quantization(n, math.sqrt(s.pop_theta))
    l2p, l1p = sensitivity(qp, m)
    dp = s.epsilon > 0
    cfg, model_sens = _sensitivities(n, m, s)
    mu_model, mu_pop = split_run_budget(s.epsilon, s.delta, s.rounds, model_sens, (l1p, l2p), s.pop_share)
    tmp = tempfile.mkdtemp(prefix="fedrec-privials-")
    try:
        cfg = _config(n, m, s, Path(tmp), cfg.rounds.scale_bits)
        sim = PrivateSimulator(cfg, mu=mu_model if dp else None)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    counts = seeded_release(per_user, m, s.pop_theta, qp, mu_pop, s.seed, sim.ledger)
    cohort = IALSCohort(per_user, m, d)
    with one_blas_thread():
        round_seconds = sim.run_scaled_rounds(cohort, s.rounds, sim_seed=s.seed, on_round=on_round)  # type: ignore[arg-type]
        V = np.asarray(sim.model_state, dtype=np.float64)
        # Each device re-solves its vector against the final V (local; nothing uploaded).
        U = solve_users(V, cohort.indptr, cohort.items, s.alpha, s.reg)
    eps = sim.ledger.spent() if sim.ledger is not None else None
    return PrivateIALSResult(
        U,
        V,
        s,
        private_counts=counts,
        epsilon=eps,
        delta=s.delta,
        mu_model=mu_model,
        mu_pop=mu_pop,
        seconds=time.perf_counter() - start,
        round_seconds=round_seconds,
    )


def _scorer(res: PrivateIALSResult, alpha: float) -> Callable[[NDArray[np.int64]], NDArray[np.float64]]:
    level = item_levels(res.private_counts, 1)  # the log-scale private counts over [0, 1]
    U, Vt = res.user_factors, np.ascontiguousarray(res.item_factors.T)

    def score(users: NDArray[np.int64]) -> NDArray[np.float64]:
        users = np.asarray(users, dtype=np.int64)
        if math.isinf(alpha):
            return np.broadcast_to(level, (users.size, level.size)).astype(np.float64)
        return U[users] @ Vt + alpha * level

    return score


#: The item-level weights tried on validation (∞ = the private popularity list alone, 0 = u·v alone).
IALS_ALPHAS: tuple[float, ...] = (0.0, 0.1, 0.3, 1.0, 3.0, math.inf)


def evaluate_private_ials(
    data: Any,
    settings: PrivateIALSSettings,
    *,
    eval_seed: int = 0,
    val_users: int = 8000,
    on_round: Callable[[int, float], None] | None = None,
    log: Callable[[str], None] | None = None,
) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
    """Train privately on ``data`` (an `Experiment` with candidate blocks, or a `TrainTestSplit` evaluated by
    full ranking) and evaluate its test split once, as `fedsim.private.scaled_lightfr.evaluate_private` does:
    α of the item level chosen on validation against the private list with a margin (`validate_private_ials`);
    ``extra`` holds the chosen score's validation figure as "validation"."""
    served = validate_private_ials(data, settings, eval_seed=eval_seed, val_users=val_users, on_round=on_round, log=log)
    return evaluate_served(data, served, eval_seed=eval_seed), served.extra()


def _block_scores(
    res: PrivateIALSResult, users: NDArray[np.int64], items: NDArray[np.int64], alpha: float
) -> NDArray[np.float64]:
    """Scores of candidate blocks (``items[j]`` ranked for ``users[j]``), as `_scorer` scores them."""
    level = item_levels(res.private_counts, 1)  # the log-scale private counts over [0, 1]
    if math.isinf(alpha):
        return level[items]
    dots = np.einsum("ud,ukd->uk", res.user_factors[users], res.item_factors[items])
    return dots + alpha * level[items]


def validate_private_ials(
    data: Any,
    settings: PrivateIALSSettings,
    *,
    eval_seed: int = 0,
    val_users: int = 8000,
    on_round: Callable[[int, float], None] | None = None,
    log: Callable[[str], None] | None = None,
) -> ServedScore:
    """Train privately on ``data`` and choose α of the item level on validation, without reading the test
    split: a `fedsim.private.served.ServedScore`, on the same validation as private LightFR's."""
    return validate(
        data,
        run_private_ials,
        settings,
        _scorer,
        _block_scores,
        IALS_ALPHAS,
        eval_seed=eval_seed,
        val_users=val_users,
        on_round=on_round,
        log=log,
    )


def with_plan(settings: PrivateIALSSettings, plan: PrivatePlan) -> PrivateIALSSettings:
    """``settings`` with the plan's popularity share and rounds."""
    return replace(settings, pop_share=plan.pop_share if plan.rounds else settings.pop_share, rounds=plan.rounds)
