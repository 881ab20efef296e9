"""Private federated MF in-process: real-coordinator runs and, at scale, private-round simulator runs.

`run_private_mf`: one simulated device per user, every round through the real `RoundCoordinator`
(SecAgg+ with dropouts, distributed Skellam DP calibrated for per-user privacy, the privacy ledger,
`MFStrategy`), then stage-3 fine-tuning on each device and evaluation.  `run_private_mf_scaled`: every
device of a large dataset through the simulator's `MFCohort`, with a private popularity release.

Invariants:
- The devices run exactly `device_sdk.mf.MFModel` through `device_sdk.training.local_round` (clip,
  quantize) and `DeviceSecAggSession`; the server learns only the noisy secure sum
  (`fedsim.private.coordinator_rounds.run_private`).
- The per-user ε reported is the ledger's: the coordinator charges every round for every device
  (no amplification by sampling is claimed); the per-rating ε comes from `fedsim.federation.mf.mf_epsilons`
  with the same noise.
- ``epsilon = 0`` means no DP noise (SecAgg only), the ε = ∞ row.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from agg_server.config import ServerConfig, config_from_dict
from agg_server.storage import Storage
from device_sdk.family import LocalRatings
from device_sdk.mf import MFConfig, MFModel
from fedsim.data.ratings import Ratings
from fedsim.evaluation.experiment import Candidates
from fedsim.federation.mf import MFEvaluation, evaluate_mf, mf_epsilons
from fedsim.fleets.faults import DropoutAt
from fedsim.private.coordinator_rounds import PrivateRun, run_private
from fedsim.private.simulator import run_simulated

__all__ = ["PrivateMFSettings", "PrivateMFResult", "run_private_mf"]

_PHASES = (DropoutAt.BEFORE_KEYS, DropoutAt.BEFORE_SHARES, DropoutAt.BEFORE_MASKED, DropoutAt.BEFORE_UNMASK)


@dataclass(frozen=True, slots=True)
class PrivateMFSettings:
    """One private MF run.

    Attributes
    ----------
    epsilon : per-user ε over the whole run at ``delta`` (0 = no DP noise).
    delta : δ.
    rounds : server rounds T (the noise is calibrated for exactly these).
    cohort : devices per round (at most the number of users).
    dropout_rate : ω, the fraction of the cohort SecAgg+ and the DP correction tolerate losing.
    drop_chance : chance a device actually drops in a round (at a random phase).
    clip_norm : C, the L2 clip of a device's upload (its per-user sensitivity).
    example_cap : θ, ratings a device uses per round.
    scale_bits : fixed-point scale 2**s.
    factors, max_norm2, server_lr, learning_rate, pretrain_epochs, fine_tune_epochs : the model.
    negatives : unobserved items per kept rating fitted as 0.
    seed : seeds the server, the devices and the dropout schedule.
    simulator : run the rounds through `fedsim.private.simulator` (the released sums computed directly, exact
        in distribution, the survivors' noise drawn in one piece; no crypto) instead of the real coordinator
        with SecAgg+.
    pop_share, pop_theta : with DP (simulator only), the private popularity channel: a release of every
        device's items clipped to √θ (`fedsim.private.scaled_lightfr.release_counts`) calibrated for ``pop_share``·ε,
        the rounds' μ bisected so the ledger's composed ε meets ε (`fedsim.private.scaled_lightfr.split_budget`);
        its log counts, spread over [0, R], are added to u·v with a weight α chosen on validation from a
        grid that includes popularity alone.  ``pop_share = 0``: no channel.
    """

    epsilon: float = 8.0
    delta: float = 1e-5
    rounds: int = 10
    cohort: int = 943
    dropout_rate: float = 0.3
    drop_chance: float = 0.05
    clip_norm: float = 20.0
    example_cap: int = 20
    scale_bits: int = 12
    factors: int = 32
    max_norm2: float = 5.0
    server_lr: float = 0.3
    learning_rate: float = 0.1
    pretrain_epochs: int = 50
    fine_tune_epochs: int = 50
    negatives: int = 0
    seed: int = 0
    simulator: bool = True
    pop_share: float = 0.5
    pop_theta: int = 20


@dataclass(frozen=True, slots=True)
class PrivateMFResult:
    """Figures of a run: evaluation, ε per user (ledger) and per rating, rounds committed, time."""

    test: MFEvaluation
    val: MFEvaluation | None
    epsilon_user: float
    epsilon_rating: float
    mu: float
    committed: int
    seconds: float
    user_factors: Any = None  # (n_users, f) after stage-3 fine-tuning, for full-ranking evaluation
    item_factors: Any = None  # (m, f) the server's final V
    alpha: float | None = None  # weight of the private popularity level chosen on validation (inf: alone)
    private_popularity: MFEvaluation | None = None  # the private popularity level alone, on test
    mf_only: MFEvaluation | None = None  # u·v alone, on test


def _server_config(data_dir: Path, s: PrivateMFSettings, n_items: int, n_users: int) -> ServerConfig:
    privacy: dict[str, object] = {"enabled": s.epsilon > 0}
    if s.epsilon > 0:
        privacy.update({"epsilon": s.epsilon, "delta": s.delta, "planned_rounds": s.rounds})
    return config_from_dict(
        {
            "server": {"data_dir": str(data_dir)},
            "model": {"kind": "mf", "n_items": n_items},
            "mf": {
                "rank": s.factors,
                "max_norm2": s.max_norm2,
                "server_lr": s.server_lr,
                "learning_rate": s.learning_rate,
                "pretrain_epochs": s.pretrain_epochs,
                "negatives": s.negatives,
            },
            "rounds": {
                "cohort_size": min(s.cohort, n_users),
                "min_cohort": min(s.cohort, n_users),
                "dropout_rate": s.dropout_rate,
                "clip_norm": s.clip_norm,
                "scale_bits": s.scale_bits,
                "example_cap": s.example_cap,
                "seed": s.seed,
            },
            "privacy": privacy,
        },
        base_dir=data_dir,
    )


def run_private_mf(
    train: Ratings,
    test: Ratings,
    test_blocks: Candidates,
    settings: PrivateMFSettings,
    *,
    val: tuple[Ratings, Candidates] | None = None,
    workdir: Path | None = None,
    on_round: Callable[[PrivateRun], None] | None = None,
) -> PrivateMFResult:
    """Train MF privately (one device per user of ``train``) and evaluate on the held-out data.

    Parameters
    ----------
    train : training ratings (raw scale within [0, max_norm2]); user u is device u.
    test, test_blocks : held-out ratings (RMSE) and candidate blocks (HR@10 / NDCG@10).
    settings : the run.
    val : optional validation ratings and blocks, evaluated too.
    workdir : server data folder (default: a temporary one, removed afterwards).
    on_round : progress callback after each round.
    """
    start = time.perf_counter()
    s = settings
    clients = _clients_of(train)
    device_cfg = _device_config(s)
    dropout = _dropout_schedule(s)

    def new_model(device_id: int) -> MFModel:
        return MFModel(
            train.n_items, device_cfg, rng=np.random.default_rng(np.random.SeedSequence([s.seed, 1, device_id]))
        )

    with tempfile.TemporaryDirectory(prefix="fedrec-private-mf-") as tmp:
        cfg = _server_config(workdir or Path(tmp), s, train.n_items, len(clients))
        counts = None
        mu_rounds: float | None = None
        charges: list[tuple[float, float, float]] = []
        if s.epsilon > 0 and s.pop_share > 0:
            if not s.simulator:
                raise ValueError("the private popularity channel (pop_share > 0) runs through the simulator only")
            counts, mu_rounds, charges = _popularity_release(train, s, cfg)
        run_rounds = _simulated_rounds if s.simulator else _coordinator_rounds
        trained = run_rounds(cfg, s, clients, new_model, dropout, on_round, mu_rounds, charges)
    V, committed, mu = trained.V, trained.committed, trained.mu
    U = _fine_tune_all(trained, clients, train.n_users, s)
    eps_rating = _epsilon_per_rating(s, mu, committed)
    test_ev = evaluate_mf(U, V, test, test_blocks)
    val_ev = evaluate_mf(U, V, val[0], val[1]) if val is not None else None
    alpha = pop_ev = mf_ev = None
    if counts is not None:
        if val is None:
            raise ValueError("the private popularity channel needs validation blocks to choose its weight")
        mf_ev = test_ev
        alpha, pop_ev, test_ev, val_ev = _with_popularity_level(U, V, counts, s, test, test_blocks, val)
    return PrivateMFResult(
        test_ev,
        val_ev,
        trained.eps_user,
        eps_rating,
        mu,
        committed,
        time.perf_counter() - start,
        U,
        V,
        alpha,
        pop_ev,
        mf_ev,
    )


def _clients_of(train: Ratings) -> dict[int, LocalRatings]:
    """One device's data per user with at least one training rating, keyed by dense user index."""
    idx = train.by_user()
    return {
        int(u): LocalRatings.single_user(idx.items[lo:hi], idx.ratings[lo:hi])
        for u, (lo, hi) in enumerate(zip(idx.indptr[:-1], idx.indptr[1:], strict=True))
        if hi > lo
    }


def _device_config(s: PrivateMFSettings) -> MFConfig:
    return MFConfig(
        factors=s.factors,
        max_norm2=s.max_norm2,
        learning_rate=s.learning_rate,
        pretrain_epochs=s.pretrain_epochs,
        example_cap=s.example_cap,
        fine_tune_epochs=s.fine_tune_epochs,
        negatives=s.negatives,
    )


def _dropout_schedule(s: PrivateMFSettings) -> Callable[[int, int], DropoutAt]:
    """Seeded dropouts: each (round, device) drops with chance ``drop_chance`` at a random phase,
    drawn the first time the pair is asked about and remembered after."""
    schedule_rng = np.random.default_rng(np.random.SeedSequence([s.seed, 7]))
    drops: dict[tuple[int, int], DropoutAt] = {}

    def dropout(round_id: int, device_id: int) -> DropoutAt:
        key = (round_id, device_id)
        if key not in drops:
            hit = schedule_rng.random() < s.drop_chance
            drops[key] = _PHASES[int(schedule_rng.integers(len(_PHASES)))] if hit else DropoutAt.NONE
        return drops[key]

    return dropout


class _Trained(NamedTuple):
    """The outcome of the private rounds: the server's final V and what the ledger says."""

    V: npt.NDArray[np.float64]
    committed: int  # rounds committed
    mu: float
    eps_user: float  # the ledger's per-user ε (∞ without DP)
    devices: dict[int, Any]


def _simulated_rounds(
    cfg: ServerConfig,
    s: PrivateMFSettings,
    clients: dict[int, LocalRatings],
    new_model: Callable[[int], MFModel],
    dropout: Callable[[int, int], DropoutAt],
    on_round: Callable[[PrivateRun], None] | None,
    mu_rounds: float | None,
    charges: list[tuple[float, float, float]],
) -> _Trained:
    srun = run_simulated(
        cfg,
        clients,
        new_model,
        rounds=s.rounds,
        seed=s.seed,
        dropout=dropout,
        after_round=on_round,  # type: ignore[arg-type]
        per_device_noise=False,
        mu=mu_rounds,
        prior_charges=charges,
    )
    sim = srun.simulator
    eps_user = sim.ledger.spent() if sim.ledger is not None else math.inf
    return _Trained(
        np.asarray(sim.model_state, dtype=np.float64), sim.model_version - 1, sim.mu, eps_user, srun.devices
    )


def _coordinator_rounds(
    cfg: ServerConfig,
    s: PrivateMFSettings,
    clients: dict[int, LocalRatings],
    new_model: Callable[[int], MFModel],
    dropout: Callable[[int, int], DropoutAt],
    on_round: Callable[[PrivateRun], None] | None,
    mu_rounds: float | None,
    charges: list[tuple[float, float, float]],
) -> _Trained:
    """Every round through the real `RoundCoordinator` (``mu_rounds`` and ``charges`` are the
    simulator's popularity channel, never set on this path)."""
    store = Storage(cfg.data_dir)
    try:
        run = run_private(
            cfg,
            clients,
            new_model,
            rounds=s.rounds,
            seed=s.seed,
            dropout=dropout,
            storage=store,
            after_round=on_round,
        )
        coord = run.coordinator
        eps_user = coord.ledger.spent() if coord.ledger is not None else math.inf
        V = np.asarray(coord.model_state, dtype=np.float64)
        return _Trained(V, coord.model_version - 1, coord.mu, eps_user, run.devices)
    finally:
        store.close()


def _fine_tune_all(
    trained: _Trained, clients: dict[int, LocalRatings], n_users: int, s: PrivateMFSettings
) -> npt.NDArray[np.float64]:
    """Stage 3 on every device against the final V; returns the user factors (n_users, f)."""
    # `run_private` registers the clients in the mapping's order: the k-th device id is the k-th user.
    user_of = dict(zip(sorted(trained.devices), clients, strict=True))
    U = np.zeros((n_users, s.factors))
    wire = trained.V.astype("<f8").tobytes()
    for device_id, dev in trained.devices.items():
        model: MFModel = dev.model
        model.set_global(b"", wire, trained.committed + 1)
        model.fine_tune(dev.data, s.fine_tune_epochs)
        U[user_of[device_id]] = model.user_factors[0]
    return U


def _epsilon_per_rating(s: PrivateMFSettings, mu: float, committed: int) -> float:
    if s.epsilon <= 0:
        return math.inf
    return mf_epsilons(
        mu,
        s.scale_bits,
        s.example_cap,
        s.max_norm2,
        s.factors,
        committed,
        s.delta,
        negatives=s.negatives,
        clip_norm=s.clip_norm,
    ).per_rating


def _with_popularity_level(
    U: npt.NDArray[np.float64],
    V: npt.NDArray[np.float64],
    counts: npt.NDArray[np.float64],
    s: PrivateMFSettings,
    test: Ratings,
    test_blocks: Candidates,
    val: tuple[Ratings, Candidates],
) -> tuple[float, MFEvaluation, MFEvaluation, MFEvaluation]:
    """Choose the weight α of the private popularity level on validation HR; returns α, the level
    alone on test, and the test and validation figures of u·v + α level."""
    from fedsim.private.scaled_lightfr import item_levels

    level = item_levels(counts, s.max_norm2)

    def ranked(ev: MFEvaluation) -> float:
        return ev.ranking.hr if ev.ranking is not None else 0.0

    best: tuple[float, float] | None = None
    for a in _ALPHAS:
        inf = math.isinf(a)
        v = ranked(evaluate_mf(U, V, val[0], val[1], item_term=level if inf else a * level, term_only=inf))
        if best is None or v > best[1]:
            best = (a, v)
    assert best is not None
    alpha = best[0]
    pop_ev = evaluate_mf(U, V, test, test_blocks, item_term=level, term_only=True)
    inf = math.isinf(alpha)
    test_ev = evaluate_mf(U, V, test, test_blocks, item_term=level if inf else alpha * level, term_only=inf)
    val_ev = evaluate_mf(U, V, val[0], val[1], item_term=level if inf else alpha * level, term_only=inf)
    return alpha, pop_ev, test_ev, val_ev


#: The weights of the private popularity level tried on validation (∞ = the level alone).
_ALPHAS: tuple[float, ...] = (0.0, 0.25, 1.0, 4.0, 16.0, math.inf)


def _popularity_release(
    train: Ratings, s: PrivateMFSettings, cfg: ServerConfig
) -> tuple[np.ndarray, float, list[tuple[float, float, float]]]:
    """(private counts, μ of every round, [(μ, Δ1, Δ2) of the popularity release]) for ``s``'s ε."""
    from fedsim.private.scaled_lightfr import _per_user, seeded_release, split_budget, widest_quantization
    from protocol.quantization import sensitivity

    n, m = train.n_users, train.n_items
    qm = cfg.rounds.quantization()
    l2m, l1m = sensitivity(qm, m * s.factors)
    theta = s.pop_theta
    qp = widest_quantization(n, math.sqrt(theta))
    l2p, l1p = sensitivity(qp, m)
    mu_rounds, mu_pop = split_budget(s.epsilon, s.delta, s.rounds, (l1m, l2m), (l1p, l2p), s.pop_share)
    counts = seeded_release(_per_user(train), m, theta, qp, mu_pop, s.seed)
    return counts, mu_rounds, [(mu_pop, l1p, l2p)]


@dataclass
class ScaledMFResult:
    """Factors, private counts and the ledger's ε of a scaled private MF run (`run_private_mf_scaled`)."""

    user_factors: np.ndarray  # (n_users, f) after stage-3 fine-tuning against the final V
    item_factors: np.ndarray  # (m, f) the server's final V
    private_counts: np.ndarray | None  # the popularity release (None without the channel)
    epsilon: float  # the ledger's (inf without DP)
    mu: float  # every round's noise variance (quantized units)
    mu_pop: float
    committed: int
    seconds: float
    round_seconds: list[float]


def run_private_mf_scaled(
    train: Ratings,
    settings: PrivateMFSettings,
    *,
    on_round: Callable[[int, float], None] | None = None,
) -> ScaledMFResult:
    """Private MF over every user of ``train`` in one cohort, through the simulator's scale mode
    (`fedsim.private.cohorts.MFCohort`: the devices' sparse uploads summed directly, the released noise drawn in
    one piece; exact in distribution, no dropouts), with the private popularity channel of
    `run_private_mf` (``pop_share`` of ε; without DP the same release without noise), then stage-3
    fine-tuning of every user vector against the final V (on the device; nothing uploaded).

    A simulation: the rounding coins and the noise come from seeded test streams, so the ε it reports is
    the accountant's figure for the noise it draws, not a guarantee against whoever knows the seed.
    """
    from device_sdk.mf import fit_users
    from fedsim.private.cohorts import MFCohort
    from fedsim.private.scaled_lightfr import _per_user, seeded_release, widest_quantization
    from fedsim.private.simulator import PrivateSimulator
    from protocol.families.mf import project_rows

    start = time.perf_counter()
    s = settings
    n, m = train.n_users, train.n_items
    idx = train.by_user()
    users = [
        (idx.items[lo:hi].astype(np.int64), idx.ratings[lo:hi].astype(np.float64))
        for lo, hi in zip(idx.indptr[:-1], idx.indptr[1:], strict=True)
    ]
    with tempfile.TemporaryDirectory(prefix="fedrec-private-mf-") as tmp:
        cfg = _server_config(Path(tmp), replace(s, cohort=n), m, n)
        counts = None
        mu_rounds: float | None = None
        mu_pop = 0.0
        charges: list[tuple[float, float, float]] = []
        if s.pop_share > 0:
            if s.epsilon > 0:
                counts, mu_rounds, charges = _popularity_release(train, s, cfg)
                mu_pop = charges[0][0]
            else:
                qp = widest_quantization(n, math.sqrt(s.pop_theta))
                counts = seeded_release(_per_user(train), m, s.pop_theta, qp, 0.0, s.seed)
        sim = PrivateSimulator(cfg, mu=mu_rounds)
        for charge in charges:
            assert sim.ledger is not None
            sim.ledger.record_round(*charge)
        cohort = MFCohort(users, m, s.factors, max_norm2=s.max_norm2)
        round_seconds = sim.run_scaled_rounds(cohort, s.rounds, sim_seed=s.seed, on_round=on_round)
    V = project_rows(np.asarray(sim.model_state, dtype=np.float64), s.max_norm2)  # what the devices download
    # Stage 3 (`MFModel.fine_tune`): every user refits u against the final V on all its ratings.
    owner = np.repeat(np.arange(n), np.diff(idx.indptr))
    trained = cohort.trained
    U = np.where(trained[:, None], cohort.user_factors, 0.0)
    U = fit_users(U, V, owner, idx.items, idx.ratings, s.learning_rate, 0.0, s.max_norm2, s.fine_tune_epochs)
    eps = sim.ledger.spent() if sim.ledger is not None else math.inf
    return ScaledMFResult(
        U, V, counts, eps, sim.mu, mu_pop, sim.model_version - 1, time.perf_counter() - start, round_seconds
    )


#: MF on an implicit published split (amazon-book) through `run_private_mf_scaled`: chosen on the validation
#: item at 5,000 amazon-book devices and ε = 8 (docs/dp-accounting.md §8).
IMPLICIT_MF = PrivateMFSettings(
    rounds=5, clip_norm=0.5, max_norm2=1.0, factors=32, negatives=1, example_cap=20, server_lr=100.0, pop_theta=50
)


def evaluate_private_mf_scaled(
    data: Any,
    settings: PrivateMFSettings,
    *,
    eval_seed: int = 0,
    val_users: int = 4000,
    test_users: int | None = None,
    on_round: Callable[[int, float], None] | None = None,
) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
    """Private MF on a published split (`fedsim.data.kgat.TrainTestSplit`) by full ranking, as
    `fedsim.private.scaled_lightfr.evaluate_private` evaluates LightFR: trained (`run_private_mf_scaled`) on train
    minus one carved validation item per user, scored u·v + α·level (the private counts on a log scale
    over [0, R]) with α chosen on that item from a grid holding the level alone (α = inf), then the test
    split scored once for the chosen α, for u·v alone, for private popularity, popularity and random
    (random ties).  ``test_users``: a seeded sample of that many users instead of all.

    Returns
    -------
    (metrics, extra) : ``metrics`` maps "model", "mf_alone", "private_popularity", "popularity" and
        "random" to {"recall@20", "ndcg@20"}; ``extra`` holds "epsilon" (the ledger's), "delta",
        "alpha", "mu", "protocol" and "train_seconds".  Without the channel (``pop_share = 0``) there is no
        "private_popularity" and α is 0.
    """
    from fedsim.evaluation.ranking import popularity_scorer, random_scorer
    from fedsim.private.scaled_lightfr import ALPHAS, item_levels
    from fedsim.private.served import carve_validation, choose_alpha_full_ranking, full_ranking_metrics

    fit, val = carve_validation(data.train, eval_seed)
    res = run_private_mf_scaled(fit, replace(settings, cohort=fit.n_users), on_round=on_round)
    U, V = res.user_factors, res.item_factors
    counts = res.private_counts if res.private_counts is not None else np.zeros(fit.n_items)
    level = item_levels(counts, settings.max_norm2)

    def scorer(alpha: float) -> Callable[[np.ndarray], np.ndarray]:
        if math.isinf(alpha):
            return lambda users: np.broadcast_to(level, (np.asarray(users).size, level.size))
        return lambda users: U[np.asarray(users)] @ V.T + alpha * level

    grid = ALPHAS if res.private_counts is not None else (0.0,)
    chosen = choose_alpha_full_ranking(scorer, fit, val, grid, val_users=val_users, eval_seed=eval_seed)
    seen = data.train
    full = full_ranking_metrics(data, eval_seed=eval_seed, test_users=test_users)
    metrics = {"model": full(scorer(chosen[0])), "mf_alone": full(scorer(0.0))}
    if res.private_counts is not None:
        metrics["private_popularity"] = full(scorer(math.inf))
    metrics["popularity"] = full(popularity_scorer(seen))
    metrics["random"] = full(random_scorer(seen.n_items, eval_seed))
    extra = {
        "epsilon": res.epsilon,
        "delta": settings.delta,
        "alpha": chosen[0] if math.isfinite(chosen[0]) else "popularity only",
        "mu": res.mu,
        "protocol": "full",
        "train_seconds": res.seconds,
    }
    return metrics, extra
