"""FNMF server side (Dalleiger & Gionis, coherent federated NMF; `docs/design.md` §3.3),
pure numpy: the secure "anchored" aggregation of client-aligned differences, and — for the in-process
simulator only — the paper's trusted barycenter over individual client matrices.

Invariants:
- `FNMFStrategy` sees only the cohort's **sum** S of uploads Δ_j = P_jV_j − diag(P_j𝟙)V̄ (clients
  align themselves to the broadcast V̄) and the survivor count c.  Its update
  V̄ ← max(0, V̄ + S/c) (per component V̄_l ← V̄_l + S_l/n_l for "lap_rho", unchanged where n_l = 0)
  is one step of the barycenter fixed point warm-started at V̄; with alignment "none" it is FedAvg's
  plain mean.  It runs under secure aggregation.
- `TrustedBarycenterFNMF` needs every client's own matrix, so it can never run under secure
  aggregation; building it logs a WARNING saying so.  The HTTP server never receives individual
  matrices; only `fedsim` uses it.
- V̄ is a (k, m) float64 non-negative matrix; its wire form is k·m little-endian float64 in C order.
- The alignment (`lap_align`) and the upload layout (`split_upload`) are the devices' own, from
  `protocol.families.fnmf`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from agg_server.strategy.base import FloatStrategy, float_state_from_bytes
from protocol.families.fnmf import lap_align, split_upload, upload_length
from protocol.plan import FNMFParams
from protocol.spec import MAX_RANK, Alignment, ModelKind

__all__ = [
    "FNMFStrategy",
    "TrustedBarycenterFNMF",
    "fedavg_mean",
    "trusted_barycenter",
]

_log = logging.getLogger(__name__)

Array = NDArray[np.float64]


def fedavg_mean(matrices: Sequence[Array]) -> Array:
    """FedAvg's aggregate: the plain (unaligned) mean of the client matrices."""
    if not matrices:
        raise ValueError("no client matrices")
    return np.mean(np.stack([np.asarray(v, dtype=np.float64) for v in matrices]), axis=0)


def trusted_barycenter(
    matrices: Sequence[Array], iterations: int = 10, *, init: Array | None = None
) -> tuple[Array, list[Array]]:
    """FNMF Alg. 1: the LAP fixed point B(𝒱) ≈ argmin_V̄ Σ_j min_P ½‖V̄ − PV_j‖²_F.

    V̄ starts at the plain mean (or ``init``); then, until V̄ stops changing or ``iterations`` passes,
    every P_j ← argmin_P ‖V̄ − PV_j‖ and V̄ ← (1/c) Σ_j P_jV_j.  This is Lloyd's algorithm with a
    one-to-one matching step, a heuristic for an NP-hard problem (paper Thm. 1).

    Needs every client's individual matrix: a trusted aggregator only.

    Returns
    -------
    (V̄, [P_j]) with the assignments of the last pass.
    """
    if iterations < 0:
        raise ValueError(f"iterations must be >= 0, got {iterations}")
    mats = [np.asarray(v, dtype=np.float64) for v in matrices]
    if not mats:
        raise ValueError("no client matrices")
    k = mats[0].shape[0]
    v_bar = fedavg_mean(mats) if init is None else np.asarray(init, dtype=np.float64).copy()
    perms = [np.eye(k) for _ in mats]
    for _ in range(iterations):  # loop over fixed-point passes (clients inside: c is small)
        perms = [lap_align(v, v_bar) for v in mats]
        new = np.mean(np.stack([p @ v for p, v in zip(perms, mats, strict=True)]), axis=0)
        if np.array_equal(new, v_bar):
            break
        v_bar = new
    return v_bar, perms


@dataclass(slots=True)
class FNMFStrategy(FloatStrategy):
    """The secure FNMF strategy (anchored one-round variant; "none" is FedAvg / FedProx).

    Attributes
    ----------
    rank : component count k (the ``bits`` wire field).
    n_items : catalogue size m.
    local_steps : T, local projected-gradient steps per round (``local_epochs``, 1..1000).
    proximity : γ, the pull towards the aligned V̄ (0 = FedAvg).
    inertia : iPALM β in [0, 1).
    alignment : "lap" (default), "lap_rho", "sinkhorn" or "none".
    """

    rank: int
    n_items: int
    local_steps: int = 100
    proximity: float = 1.0
    inertia: float = 0.0
    alignment: str = "lap"
    kind: str = field(default=ModelKind.FNMF.value, init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.rank <= MAX_RANK or self.n_items <= 0:
            raise ValueError(f"need 1 <= rank <= {MAX_RANK} and n_items > 0, got {self.rank}, {self.n_items}")
        self.plan()  # the plan's bounds: `protocol.plan.FNMFParams` checks them

    @property
    def shape(self) -> tuple[int, int]:
        """V̄ is (k, m)."""
        return (self.rank, self.n_items)

    @property
    def vector_length(self) -> int:
        """k·m, plus k match counts for "lap_rho"."""
        return upload_length(self.rank, self.n_items, self.alignment)

    def initialize(self, rng: np.random.Generator) -> Array:
        """Version-1 V̄ ~ Uniform[0, 1)^{k×m}."""
        return rng.random((self.rank, self.n_items))

    def plan(self) -> FNMFParams:
        """T, γ, β and the alignment the devices use."""
        return FNMFParams(
            local_steps=self.local_steps,
            proximity=self.proximity,
            inertia=self.inertia,
            alignment=Alignment(self.alignment),
        )

    def step(self, state: Array, total: Array, survivors: int, round_index: int) -> Array:
        """V̄ ← max(0, V̄ + S/c); "lap_rho": V̄_l ← max(0, V̄_l + S_l/n_l) where n_l ≥ 1, else unchanged.

        The counts n_l arrive summed (and possibly DP-noised), so they are rounded to integers first.
        ``round_index`` is unused: the rule has no schedule.
        """
        k, m = self.rank, self.n_items
        v_bar = state
        S, summed_counts = split_upload(total, k, m, self.alignment)
        if summed_counts is not None:
            counts = np.rint(summed_counts)
            ok = counts >= 1.0
            step = np.zeros((k, m))
            step[ok] = S[ok] / counts[ok, None]
            return np.maximum(0.0, v_bar + step)
        return np.maximum(0.0, v_bar + S / survivors)

    def from_wire(self, words: bytes, values: bytes) -> Array:
        """Inverse of `to_wire`; refuses packed words, a wrong length or a negative entry."""
        if words:
            raise ValueError("an FNMF model has no packed words")
        v = float_state_from_bytes(values, (self.rank, self.n_items))
        if np.any(v < 0.0):
            raise ValueError("V̄ must be non-negative")
        return v

    def describe(self, old: NDArray[Any], new: NDArray[Any]) -> str:
        """The largest and mean absolute change of V̄."""
        d = np.abs(np.asarray(new, dtype=np.float64) - np.asarray(old, dtype=np.float64))
        return f"max |ΔV̄| {float(d.max()):.3g}, mean {float(d.mean()):.3g}"


@dataclass(slots=True)
class TrustedBarycenterFNMF:
    """The paper's server (Alg. 1–2): a LAP fixed-point barycenter over **individual** client matrices.

    For a trusted aggregator only — it sees every client's V_j, which secure aggregation exists to
    hide.  Used by the in-process simulator as the reference the secure variant is compared with.

    Attributes
    ----------
    rank, n_items : k and m.
    iterations : fixed-point passes per aggregation.
    warm_start : start the fixed point at the current V̄ instead of the plain mean.
    """

    rank: int
    n_items: int
    iterations: int = 10
    warm_start: bool = True
    kind: str = field(default=ModelKind.FNMF.value, init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.rank <= MAX_RANK or self.n_items <= 0:
            raise ValueError(f"need 1 <= rank <= {MAX_RANK} and n_items > 0, got {self.rank}, {self.n_items}")
        if self.iterations < 0:
            raise ValueError(f"iterations must be >= 0, got {self.iterations}")
        _log.warning(
            "TrustedBarycenterFNMF: the aggregator sees individual client matrices (no secure aggregation); "
            "use it only in trusted, in-process simulations"
        )

    def initialize(self, rng: np.random.Generator) -> Array:
        """Version-1 V̄ ~ Uniform[0, 1)^{k×m} (the same draw as `FNMFStrategy.initialize`)."""
        return rng.random((self.rank, self.n_items))

    def aggregate_matrices(self, state: Array | None, matrices: Sequence[Array]) -> tuple[Array, list[Array]]:
        """The barycenter of the clients' own matrices (warm-started at ``state`` if configured).

        Returns (V̄, [P_j]).
        """
        mats = [np.asarray(v, dtype=np.float64) for v in matrices]
        for v in mats:
            if v.shape != (self.rank, self.n_items):
                raise ValueError(f"a client matrix has shape {v.shape}, expected {(self.rank, self.n_items)}")
        init = state if (self.warm_start and state is not None) else None
        return trusted_barycenter(mats, self.iterations, init=init)
