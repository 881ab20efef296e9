"""In-process FELB federation: every client runs the device code (`FELBModel.local_update`), the
server runs `FELBStrategy.aggregate` on the plain sum of the uploads (what secure aggregation would
reveal), with optional per-upload Gaussian noise; plus the paper's quality metrics and a binarized
MovieLens-100K split.

Metrics (`docs/design.md` §3.2):
- F1 over matrix entries, pooled over clients, of the Boolean reconstruction [round(U_i)∘round(V̂)]
  against the clients' data; F1* the same against the planted noise-free signal;
- factor-F1: rows of round(V̂) matched to the planted components by the Hungarian method (maximum
  total F1), averaged over the planted components;
- Σ-RMSD = Σ_i √mean((A_i − Â_i)²) over clients, beside the all-zero model's Σ_i √density_i.

Invariants:
- Every random choice comes from the one generator passed to `run_felb`, in a fixed order: the
  initial V̂, then one child generator per client (its U_i draw) and one for the upload noise.
- The server sees only the sum of the uploads and the client count.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.optimize import linear_sum_assignment

from agg_server.strategy.base import round_plan
from agg_server.strategy.felb import FELBStrategy
from device_sdk.family import LocalRatings
from device_sdk.felb import FELBConfig, FELBModel, boolean_product, integrality_gap
from fedsim.data.loaders import load_movielens
from protocol.plan import TrainingPlan

__all__ = [
    "FELBMetrics",
    "FELBRun",
    "binary_ratings",
    "evaluate_felb",
    "f1_score",
    "factor_f1",
    "felb_plan",
    "load_ml100k_binary",
    "run_felb",
    "sigma_rmsd",
]


def binary_ratings(block: ArrayLike) -> LocalRatings:
    """A client's Boolean block (n_i, m) as implicit `LocalRatings` (every nonzero entry is a 1)."""
    a = np.asarray(block)
    if a.ndim != 2:
        raise ValueError(f"expected a 2-D block, got shape {a.shape}")
    users, items = np.nonzero(a)
    return LocalRatings(users.astype(np.int64), items.astype(np.int64), None, a.shape[0])


def felb_plan(strategy: FELBStrategy, version: int, round_index: int) -> TrainingPlan:
    """The training plan a device receives for this round (in process: nothing clipped)."""
    return round_plan(strategy, version, round_index=round_index)


@dataclass
class FELBRun:
    """The outcome of `run_felb`: the final global V̂, every client's device model, and per-round
    figures (mean integrality gap of V̂ and mean local objective)."""

    item_factors: NDArray[np.float64]
    models: list[FELBModel]
    gap: list[float] = field(default_factory=list)
    objective: list[float] = field(default_factory=list)

    def reconstructions(self) -> list[NDArray[np.uint8]]:
        """Each client's Boolean reconstruction [round(U_i) ∘ round(V̂)]."""
        return [boolean_product(m.user_factors, self.item_factors) for m in self.models if m.user_factors is not None]


def run_felb(
    clients: Sequence[ArrayLike],
    strategy: FELBStrategy,
    *,
    rounds: int,
    rng: np.random.Generator,
    noise_sigma: float = 0.0,
) -> FELBRun:
    """Federate ``clients`` (Boolean blocks, each (n_i, m)) for ``rounds`` rounds.

    Each round every client adopts V̂, runs the plan's local iterations and uploads ΔV_i (plus
    N(0, σ²) per entry if ``noise_sigma`` > 0); the strategy turns the sum into the next V̂.

    Returns
    -------
    FELBRun with the last V̂ and the clients' models (their U_i are the last round's).
    """
    if rounds < 0:
        raise ValueError(f"rounds must be >= 0, got {rounds}")
    if not (np.isfinite(noise_sigma) and noise_sigma >= 0):
        raise ValueError(f"noise_sigma must be finite and >= 0, got {noise_sigma}")
    data = [binary_ratings(c) for c in clients]
    if not data:
        raise ValueError("need at least one client")
    V = strategy.initialize(rng)
    client_rngs = rng.spawn(len(data))
    noise_rng = rng.spawn(1)[0]
    config = FELBConfig(rank=strategy.rank)
    models = [FELBModel(strategy.n_items, config) for _ in data]
    run = FELBRun(item_factors=V, models=models)
    version = 1
    for r in range(rounds):
        payload = strategy.to_wire(V)["values"]
        plan = felb_plan(strategy, version, r)
        total = np.zeros(strategy.vector_length)
        objective = 0.0
        for model, local, crng in zip(models, data, client_rngs, strict=True):
            model.set_global(b"", payload, version)
            result = model.local_update(plan, local, crng)
            upload = result.vector
            if noise_sigma > 0:
                upload = upload + noise_rng.normal(0.0, noise_sigma, size=upload.size)
            total += upload
            objective += float(result.info["objective"])
        V = strategy.aggregate(V, total, len(data), noise_rng, round_index=r)
        version += 1
        run.gap.append(integrality_gap(V))
        run.objective.append(objective / len(data))
    for model in models:
        model.set_global(b"", strategy.to_wire(V)["values"], version)
    run.item_factors = V
    return run


def f1_score(pred: ArrayLike, truth: ArrayLike) -> float:
    """2TP / (2TP + FP + FN) over all entries of two Boolean arrays (1.0 when both are all zero)."""
    p = np.asarray(pred).astype(bool)
    t = np.asarray(truth).astype(bool)
    if p.shape != t.shape:
        raise ValueError(f"shapes differ: {p.shape} vs {t.shape}")
    tp = int(np.count_nonzero(p & t))
    wrong = int(np.count_nonzero(p ^ t))
    return 1.0 if tp + wrong == 0 else 2.0 * tp / (2.0 * tp + wrong)


def factor_f1(V_hat: ArrayLike, V_true: ArrayLike) -> float:
    """Mean F1 of the planted components (rows of ``V_true``) against the rows of round(V̂),
    matched one-to-one for the largest total F1 (Hungarian method); unmatched planted rows score 0."""
    Vb = (np.asarray(V_hat, dtype=np.float64) >= 0.5).astype(np.int64)
    Vt = (np.asarray(V_true) != 0).astype(np.int64)
    if Vb.ndim != 2 or Vt.ndim != 2 or Vb.shape[1] != Vt.shape[1]:
        raise ValueError(f"component matrices do not fit: {Vb.shape} vs {Vt.shape}")
    tp = Vb @ Vt.T
    denom = Vb.sum(axis=1)[:, None] + Vt.sum(axis=1)[None, :]
    F = np.where(denom > 0, 2.0 * tp / np.maximum(denom, 1), 1.0)
    rows, cols = linear_sum_assignment(F, maximize=True)
    return float(F[rows, cols].sum() / Vt.shape[0])


def sigma_rmsd(blocks: Sequence[ArrayLike], recon: Sequence[ArrayLike] | None = None) -> float:
    """Σ_i √mean((A_i − Â_i)²) over clients; ``recon=None`` scores the all-zero model."""
    total = 0.0
    for i, a in enumerate(blocks):
        af = np.asarray(a, dtype=np.float64)
        diff = af if recon is None else af - np.asarray(recon[i], dtype=np.float64)
        total += float(np.sqrt(np.mean(diff * diff)))
    return total


@dataclass(frozen=True, slots=True)
class FELBMetrics:
    """Quality of a FELB run (see the module docstring); F1* and factor-F1 are NaN without a
    planted truth."""

    f1: float
    f1_star: float
    factor_f1: float
    rmsd: float
    zero_rmsd: float
    gap: float


def evaluate_felb(
    run: FELBRun,
    clients: Sequence[ArrayLike],
    *,
    signal: ArrayLike | None = None,
    planted_v: ArrayLike | None = None,
) -> FELBMetrics:
    """F1 (vs the clients' data), F1* (vs ``signal``, the stacked noise-free rows), factor-F1 (vs
    ``planted_v``), Σ-RMSD and the all-zero Σ-RMSD, and the integrality gap of V̂."""
    recon = run.reconstructions()
    if len(recon) != len(clients):
        raise ValueError(f"{len(recon)} reconstructions for {len(clients)} clients")
    stacked = np.vstack(recon)
    data = np.vstack([np.asarray(c) for c in clients])
    f1s = f1_score(stacked, signal) if signal is not None else float("nan")
    ff1 = factor_f1(run.item_factors, planted_v) if planted_v is not None else float("nan")
    return FELBMetrics(
        f1=f1_score(stacked, data),
        f1_star=f1s,
        factor_f1=ff1,
        rmsd=sigma_rmsd(clients, recon),
        zero_rmsd=sigma_rmsd(clients),
        gap=integrality_gap(run.item_factors),
    )


def load_ml100k_binary(
    path: str | os.PathLike[str], clients: int = 50, *, threshold: float = 4.0
) -> tuple[NDArray[np.uint8], ...]:
    """MovieLens-100K as a Boolean users × items matrix (rating ≥ ``threshold`` → 1), split by rows
    (users in index order) into ``clients`` blocks of near-equal size.

    Parameters
    ----------
    path : ``u.data`` or the folder holding it.
    clients : number of clients C (1 ≤ C ≤ number of users).
    threshold : binarization threshold.
    """
    ratings = load_movielens(path)
    if not 1 <= clients <= ratings.n_users:
        raise ValueError(f"clients must be in [1, {ratings.n_users}], got {clients}")
    A = np.zeros((ratings.n_users, ratings.n_items), dtype=np.uint8)
    keep = ratings.ratings >= threshold
    A[ratings.users[keep], ratings.items[keep]] = 1
    return tuple(np.array_split(A, clients))
