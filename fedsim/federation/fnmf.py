"""In-process federated NMF runs (no sockets, no masking): FedAvg, FedProx, FNMF over sums (the secure
variant) and FNMF with the paper's trusted barycenter, all with the same device model
(`device_sdk.fnmf.FNMFModel`) and the metrics of the FNMF paper (`docs/design.md` §3.3).

Invariants:
- Devices and server exchange exactly what they would over HTTP: V̄ as `ModelPayload` bytes, a
  `TrainingPlan`, and — in every mode but `Method.FNMF_TRUSTED` — only the float **sum** of the
  uploads and the survivor count (secure aggregation without quantization).  The trusted mode hands
  each client's own matrix to `TrustedBarycenterFNMF` and is labelled as such.
- Every random draw comes from the generator passed in: the server's initial V̄ first, then one
  child generator per client (``rng.spawn``), so a seed gives the same run.
- With ``independent_init`` (the paper's setting: every client starts from its own random V) the
  secure variant closes round 0 with the exact barycenter fixed point over sums (`secure_fixed_point`:
  one plain-mean round, then align-only rounds), because the anchored step has nothing to anchor to
  before the first aggregate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
from numpy.typing import NDArray
from scipy.optimize import linear_sum_assignment

from agg_server.strategy.base import round_plan
from agg_server.strategy.fnmf import FNMFStrategy, TrustedBarycenterFNMF
from device_sdk.family import LocalRatings
from device_sdk.fnmf import ALIGNMENTS, FNMFConfig, FNMFModel, align, upload_vector

__all__ = [
    "FNMFRun",
    "FNMFRunConfig",
    "Method",
    "matched_cosine",
    "orthogonality_gap",
    "run_fnmf",
    "secure_fixed_point",
    "sigma_rmsd",
]

Array = NDArray[np.float64]


class Method(StrEnum):
    """Federated NMF methods compared in the FNMF paper."""

    FEDAVG = "fedavg"  # local projected gradient, plain mean
    FEDPROX = "fedprox"  # + proximal pull towards the unaligned V̄
    FNMF = "fnmf"  # client-side alignment, anchored one-round aggregation of sums (secure)
    FNMF_TRUSTED = "fnmf_trusted"  # the paper's barycenter over individual matrices (trusted aggregator)


@dataclass(frozen=True, slots=True)
class FNMFRunConfig:
    """One in-process run.

    Attributes
    ----------
    method : which federated NMF.
    alignment : the FNMF alignment ("lap", "lap_rho", "sinkhorn"); FedAvg/FedProx use "none".
    rounds : synchronisation rounds with training.
    local_steps : T local projected-gradient steps per round.
    proximity : γ (ignored by FedAvg).
    inertia : iPALM β.
    scaled_prox : exact frozen-P prox (tγ) rather than the paper's printed form (γ).
    independent_init : every client starts from its own random V (the paper's setting).
    fixed_point_iterations : align-only rounds closing round 0 (secure, independent init) and the
        trusted barycenter's passes per aggregation.
    fixed_point_every_round : aggregate every round with the exact fixed point started at the plain
        mean (secure: `secure_fixed_point` over sums; trusted: `trusted_barycenter` without warm
        start) instead of the anchored step (secure) or the warm-started barycenter (trusted).
    sinkhorn_eps, rho_alpha : alignment parameters.
    """

    method: Method = Method.FNMF
    alignment: str = "lap"
    rounds: int = 10
    local_steps: int = 100
    proximity: float = 1.0
    inertia: float = 0.0
    scaled_prox: bool = True
    independent_init: bool = True
    fixed_point_iterations: int = 10
    fixed_point_every_round: bool = False
    sinkhorn_eps: float = 0.05
    rho_alpha: float = 0.05

    def __post_init__(self) -> None:
        if self.alignment not in ALIGNMENTS or self.alignment == "none":
            raise ValueError(f"alignment must be 'lap', 'lap_rho' or 'sinkhorn', got {self.alignment!r}")
        if self.rounds < 1 or self.fixed_point_iterations < 0:
            raise ValueError("rounds must be >= 1 and fixed_point_iterations >= 0")


@dataclass(frozen=True)
class FNMFRun:
    """What a run produced.

    Attributes
    ----------
    v_bar : (k, m) final global matrix.
    models : the clients' device models (U, local V, last V̄).
    sigma_rmsd : Σ_i RMSD(X_i, U_i V̄) with V̄ in each client's order.
    matched_cosine : mean cosine of Hungarian-matched rows of V̄ and the planted V (nan without truth).
    orthogonality_gap : (1/c) Σ_i ‖P_iᵀP_i − I‖_F of the clients' final alignments.
    sync_rounds : secure-sum rounds used (training rounds plus align-only rounds).
    """

    v_bar: Array
    models: tuple[FNMFModel, ...]
    sigma_rmsd: float
    matched_cosine: float
    orthogonality_gap: float
    sync_rounds: int


def sigma_rmsd(clients: Sequence[NDArray[Any]], reconstructions: Sequence[NDArray[Any]]) -> float:
    """Σ_i RMSD(X_i, X̂_i), the FNMF paper's Table 1 metric."""
    return float(sum(np.sqrt(np.mean((x - r) ** 2)) for x, r in zip(clients, reconstructions, strict=True)))


def matched_cosine(v_bar: Array, truth: Array) -> float:
    """Mean cosine similarity between rows of ``v_bar`` and ``truth`` matched one-to-one (Hungarian)."""
    a = v_bar / np.maximum(np.linalg.norm(v_bar, axis=1, keepdims=True), 1e-300)
    b = truth / np.maximum(np.linalg.norm(truth, axis=1, keepdims=True), 1e-300)
    cos = a @ b.T
    rows, cols = linear_sum_assignment(-cos)
    return float(cos[rows, cols].mean())


def orthogonality_gap(alignments: Sequence[Array]) -> float:
    """(1/c) Σ_i ‖P_iᵀP_i − I‖_F: 0 for permutations, > 0 for soft or partial alignments."""
    k = alignments[0].shape[0]
    return float(np.mean([np.linalg.norm(p.T @ p - np.eye(k)) for p in alignments]))


def secure_fixed_point(
    matrices: Sequence[Array],
    strategy: FNMFStrategy,
    state: Array,
    iterations: int,
    *,
    eps: float = 0.05,
    alpha: float = 0.05,
) -> tuple[Array, int]:
    """The barycenter fixed point of FNMF Alg. 1 computed from sums only (notes C, "T+1 rounds").

        Round 0: every client uploads V_j − V̄ unaligned, so the server gets the plain mean.  Then each
        align-only round: client j aligns its V_j to the broadcast V̄ itself and uploads P_jV_j − V̄; the
        server adds the mean.  Stops after ``iterations`` align-only rounds or when V̄ stops changing
    (to 1e-12 relative).
        On the same matrices this equals `agg_server.strategy.fnmf.trusted_barycenter` (to rounding).

        ``eps`` and ``alpha`` are the Sinkhorn ε and the LAP_ρ level the clients align with.

    Returns (V̄, rounds used).
    """
    k = strategy.rank
    rng = np.random.default_rng(0)  # the strategy's rule is deterministic; the argument is unused
    total = np.sum([upload_vector(v, state, np.eye(k), "none") for v in matrices], axis=0)
    if strategy.alignment == "lap_rho":
        total = np.concatenate([total, np.full(k, float(len(matrices)))])
    v_bar = strategy.aggregate(state, total, len(matrices), rng, round_index=0)
    rounds = 1
    for _ in range(iterations):  # loop over align-only rounds
        method = strategy.alignment
        uploads = [upload_vector(v, v_bar, align(v, v_bar, method, eps=eps, alpha=alpha), method) for v in matrices]
        new = strategy.aggregate(v_bar, np.sum(uploads, axis=0), len(matrices), rng, round_index=0)
        rounds += 1
        # The server sees only V̄ (not the assignments): it stops when V̄ no longer moves beyond the
        # rounding of the Δ form V̄ + (ΣP_jV_j − cV̄)/c.
        settled = float(np.abs(new - v_bar).max()) <= 1e-12 * (1.0 + float(np.abs(v_bar).max()))
        v_bar = new
        if settled:
            break
    return v_bar, rounds


def _server_side(config: FNMFRunConfig, k: int, m: int) -> tuple[FNMFStrategy, TrustedBarycenterFNMF | None]:
    """The method's strategy, and for the trusted barycenter the aggregator that sees every matrix."""
    aligned = config.method in (Method.FNMF, Method.FNMF_TRUSTED)
    strategy = FNMFStrategy(
        rank=k,
        n_items=m,
        local_steps=config.local_steps,
        proximity=0.0 if config.method is Method.FEDAVG else config.proximity,
        inertia=config.inertia,
        alignment=config.alignment if aligned else "none",
    )
    trusted = (
        TrustedBarycenterFNMF(
            k, m, iterations=config.fixed_point_iterations, warm_start=not config.fixed_point_every_round
        )
        if config.method is Method.FNMF_TRUSTED
        else None
    )
    return strategy, trusted


def _fnmf_round(
    r: int,
    v_bar: NDArray[np.float64],
    config: FNMFRunConfig,
    strategy: FNMFStrategy,
    trusted: TrustedBarycenterFNMF | None,
    models: tuple[FNMFModel, ...],
    data: list[LocalRatings],
    client_rngs: list[np.random.Generator],
    rng: np.random.Generator,
) -> tuple[NDArray[np.float64], int]:
    """Round ``r`` (0-based): every client trains from V̄ and the server forms the next V̄; returns it
    and the synchronisation rounds the aggregation used."""
    aligned = config.method in (Method.FNMF, Method.FNMF_TRUSTED)
    plan = round_plan(strategy, r + 1)
    values = strategy.to_wire(v_bar)["values"]
    for model in models:
        model.set_global(b"", values, r + 1)
    if trusted is not None:
        mats = [mdl.train(plan, d, g) for mdl, d, g in zip(models, data, client_rngs, strict=True)]
        v_bar, _ = trusted.aggregate_matrices(v_bar if r > 0 else None, mats)
        return v_bar, 1
    if aligned and (config.fixed_point_every_round or (r == 0 and config.independent_init)):
        mats = [mdl.train(plan, d, g) for mdl, d, g in zip(models, data, client_rngs, strict=True)]
        return secure_fixed_point(
            mats, strategy, v_bar, config.fixed_point_iterations, eps=config.sinkhorn_eps, alpha=config.rho_alpha
        )
    results = [mdl.local_update(plan, d, g) for mdl, d, g in zip(models, data, client_rngs, strict=True)]
    total = np.sum([res.vector for res in results], axis=0)
    return strategy.aggregate(v_bar, total, len(models), rng, round_index=r), 1


def run_fnmf(
    clients: Sequence[NDArray[Any]],
    k: int,
    config: FNMFRunConfig,
    rng: np.random.Generator,
    *,
    truth: NDArray[Any] | None = None,
) -> FNMFRun:
    """Run one federated NMF method in process on the clients' (n_i, m) non-negative matrices.

    Parameters
    ----------
    clients : each client's rows.
    k : component count.
    config : method and hyper-parameters.
    rng : generator for the server's initial V̄ and (spawned) each client's draws.
    truth : (k, m) planted components for `matched_cosine`.
    """
    clients = [np.asarray(x, dtype=np.float64) for x in clients]
    if not clients or any(x.ndim != 2 or x.shape[1] != clients[0].shape[1] for x in clients):
        raise ValueError("clients must be 2-D matrices with one column count")
    if any(np.any(x < 0.0) or not np.all(np.isfinite(x)) for x in clients):
        raise ValueError("client matrices must be finite and non-negative")
    m = clients[0].shape[1]
    strategy, trusted = _server_side(config, k, m)
    v_bar = strategy.initialize(rng)
    client_rngs = rng.spawn(len(clients))
    device_cfg = FNMFConfig(
        rank=k,
        scaled_prox=config.scaled_prox,
        sinkhorn_eps=config.sinkhorn_eps,
        rho_alpha=config.rho_alpha,
        independent_init=config.independent_init,
    )
    models = tuple(FNMFModel(m, device_cfg) for _ in clients)
    data = [LocalRatings.from_matrix(x) for x in clients]
    sync_rounds = 0
    for r in range(config.rounds):
        v_bar, used = _fnmf_round(r, v_bar, config, strategy, trusted, models, data, client_rngs, rng)
        sync_rounds += used
    values = strategy.to_wire(v_bar)["values"]
    for model in models:
        model.set_global(b"", values, config.rounds + 1)
    recon = []
    for model in models:
        if model.u is None:  # pragma: no cover - every client trained at least once
            raise RuntimeError("a client never trained")
        recon.append(model.u @ model.item_matrix())
    gap = orthogonality_gap([mdl.alignment_matrix() for mdl in models])
    return FNMFRun(
        v_bar=v_bar,
        models=models,
        sigma_rmsd=sigma_rmsd(clients, recon),
        matched_cosine=float("nan") if truth is None else matched_cosine(v_bar, np.asarray(truth, dtype=np.float64)),
        orthogonality_gap=gap,
        sync_rounds=sync_rounds,
    )
