"""Server side of federated implicit ALS (docs/design.md §3.5), pure numpy.

Each device uploads, over its users, B (row j = Σ u of the users holding item j), c (how many hold j),
Σ u uᵀ, Σ |I|·u uᵀ and Σ |I| (`protocol.families.ials.IALSLayout`); secure aggregation reveals only the
cohort's sum.  The exact iALS item step needs, per item, Σ_{u ∈ N(j)} u uᵀ (d² numbers per item, which the
sum does not hold); the server replaces it by the **shared curvature** c_j·M, M = Σ|I|·u uᵀ / Σ|I| (the
raters' Gram weighted by activity), and solves

    v_j = (A + α·c_j·M)⁻¹ (1 + α)·B_j,   A = Σ u uᵀ + λI,

for every item at once by simultaneous diagonalisation: L = chol(A), (μ, Q) = eigh(L⁻¹ M L⁻ᵀ),
W = L⁻ᵀQ (so WᵀAW = I and WᵀMW = diag μ), V = ((1 + α)·B W / (1 + α·c ⊗ μ)) Wᵀ.  An item nobody holds gets
v_j = 0 (B_j = 0).

Invariants:
- The state is V, (n_items, d) float64, finite.
- `aggregate` is a function of the sum only (the survivor count and the old V are not used): it runs
  unchanged behind SecAgg+.
- Wire form: ``values`` = float64 little-endian C-order bytes of V, ``words`` empty.  With ``level_weight``
  w > 0 (protocol 1.10) also ``item_levels``, the uint8 log-scale holder counts c of the sum that produced V
  (`protocol.families.ials.item_levels`; noisy under DP), and w: a device ranks by u·v + w·level / 255.  The
  levels go with the model version (`to_wire` right after `aggregate`; `from_wire` gives a checkpoint's back).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from agg_server.strategy.base import FloatStrategy, float_state_from_bytes
from protocol.families.ials import DEFAULT_FACTORS, IALSLayout, initial_item_factors, item_levels
from protocol.plan import IALSParams
from protocol.spec import MAX_LEVEL_WEIGHT, MAX_RANK, ModelKind

__all__ = ["IALSStrategy", "solve_items"]

def solve_items(
    B: NDArray[np.float64],
    c: NDArray[np.float64],
    G: NDArray[np.float64],
    M: NDArray[np.float64],
    alpha: float,
    reg: float,
) -> NDArray[np.float64]:
    """v_j = (G + λI + α·c_j·M)⁻¹ (1 + α)·B_j for every item j, by simultaneous diagonalisation of
    A = G + λI and M (see the module docstring).

    Parameters
    ----------
    B : (m, d) summed user vectors per item; c : (m,) holder counts (clipped at 0: noise may push one below).
    G : (d, d) Σ u uᵀ; M : (d, d) the shared curvature (symmetric positive semi-definite).
    alpha, reg : α >= 0 and λ > 0.

    Returns
    -------
    (m, d) float64.
    """
    d = G.shape[0]
    A = 0.5 * (G + G.T) + reg * np.eye(d)
    L = np.linalg.cholesky(A)
    Li = np.linalg.inv(L)
    mu, Q = np.linalg.eigh(Li @ (0.5 * (M + M.T)) @ Li.T)
    mu = np.maximum(mu, 0.0)  # M is a sum of u uᵀ terms: rounding (or noise) must not make A + α c M indefinite
    W = Li.T @ Q
    denom = 1.0 + alpha * np.maximum(c, 0.0)[:, None] * mu[None, :]
    return (((1.0 + alpha) * (B @ W)) / denom) @ W.T


@dataclass(frozen=True, slots=True)
class IALSStrategy(FloatStrategy):
    """The iALS server strategy: initial item factors, the plan devices train with, the shared-curvature
    item solve per round.

    Attributes
    ----------
    n_items : catalogue size m.
    rank : factor count d (default 64).
    alpha, reg : confidence α and ridge weight λ (`protocol.plan.IALSParams`: their defaults and bounds).
    theta, gram_weight : θ >= 1 asks the devices for the bounded upload of a DP round (unit user vectors, rows
        weighted 1/√max(|I|, θ), the Gram part scaled by γ, no weighted Gram); the item solve then takes
        M = G / tr G, the mean u uᵀ of unit vectors (`step`).  0: the plain upload.
    level_weight : w in [0, 1000] of the item term sent with each model (protocol 1.10): > 0 adds the levels of
        the round's holder counts to the payload (`to_wire`), and devices rank by u·v + w·level / 255.  0 (the
        default): V alone, a payload every 1.9 device reads.
    """

    n_items: int
    rank: int = DEFAULT_FACTORS
    alpha: float = IALSParams().alpha
    reg: float = IALSParams().reg
    theta: int = IALSParams().theta
    gram_weight: float = IALSParams().gram_weight
    level_weight: float = 0.0
    kind: str = ModelKind.IALS.value
    # The levels of the model `aggregate` made last (or `from_wire` read): [] before the first round.
    _levels: list[NDArray[np.uint8]] = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.n_items, bool) or not isinstance(self.n_items, int) or self.n_items <= 0:
            raise ValueError(f"n_items must be a positive integer, got {self.n_items!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 1 <= self.rank <= MAX_RANK:
            raise ValueError(f"rank must be an integer in [1, {MAX_RANK}], got {self.rank!r}")
        self.plan()  # the plan's bounds: `protocol.plan.IALSParams` checks them
        w = self.level_weight
        number = isinstance(w, int | float) and not isinstance(w, bool)
        if not (number and math.isfinite(w) and 0 <= w <= MAX_LEVEL_WEIGHT):
            raise ValueError(f"level_weight must be a finite number in [0, {MAX_LEVEL_WEIGHT:g}], got {w!r}")
        if self.kind != ModelKind.IALS.value:
            raise ValueError(f"kind must be {ModelKind.IALS.value!r}, got {self.kind!r}")

    @property
    def shape(self) -> tuple[int, int]:
        """V is (n_items, d)."""
        return (self.n_items, self.rank)

    @property
    def layout(self) -> IALSLayout:
        """Where each part of an upload sits."""
        return IALSLayout(self.n_items, self.rank)

    @property
    def vector_length(self) -> int:
        """One upload: m·d + m + 2·d² + 1 (`IALSLayout`)."""
        return self.layout.length

    def initialize(self, rng: np.random.Generator) -> NDArray[np.float64]:
        """V ~ N(0, 0.01²) (the version-1 item factors, `protocol.families.ials.initial_item_factors`)."""
        return initial_item_factors(self.n_items, self.rank, rng)

    def plan(self) -> IALSParams:
        """What every device trains with."""
        return IALSParams(alpha=self.alpha, reg=self.reg, theta=self.theta, gram_weight=self.gram_weight)

    def step(
        self, state: NDArray[np.float64], total: NDArray[np.float64], survivors: int, round_index: int
    ) -> NDArray[np.float64]:
        """The shared-curvature item solve on the cohort's sum (``state``, ``survivors`` and ``round_index``
        are unused: the new V is a function of the sum alone)."""
        parts = self.layout.split(total)
        if self.level_weight > 0:
            self._levels[:] = [item_levels(parts["counts"])]
        if self.theta:
            return self._bounded_step(parts)
        positives = float(parts["positives"])
        M = parts["weighted_gram"] / positives if positives > 0 else np.zeros((self.rank, self.rank))
        return solve_items(parts["factors"], parts["counts"], parts["gram"], M, self.alpha, self.reg)

    def _bounded_step(self, parts: dict[str, NDArray[np.float64]]) -> NDArray[np.float64]:
        """The item solve on a sum of bounded uploads (noised under DP).  G = (Gram part)/γ is made symmetric and
        positive semi-definite (noise may leave a negative eigenvalue); each user's weighted curvature
        Σ_{u ∈ N(j)} w_u u uᵀ is taken as c_j·M with M = G / tr G (tr G = the number of unit vectors summed), and
        B and c are the weighted sums (`device_sdk.ials.upload_sums`)."""
        G = parts["gram"] / self.gram_weight
        evals, Q = np.linalg.eigh(0.5 * (G + G.T))
        G = (Q * np.maximum(evals, 0.0)) @ Q.T
        trace = float(np.trace(G))
        M = G / trace if trace > 0 else np.zeros_like(G)
        return solve_items(parts["factors"], parts["counts"], G, M, self.alpha, self.reg)

    @property
    def levels(self) -> NDArray[np.uint8] | None:
        """The item levels of the model `aggregate` made last (or `from_wire` read); None before any."""
        return self._levels[-1] if self._levels else None

    def to_wire(self, state: NDArray[Any]) -> dict[str, Any]:
        """``values`` (V); with w > 0, once a round has summed counts, also ``item_levels`` and ``level_weight``
        (called right after `aggregate`: the levels of the sum that produced ``state``)."""
        wire: dict[str, Any] = dict(FloatStrategy.to_wire(self, state))
        if self.level_weight > 0 and self._levels:
            wire["item_levels"] = self._levels[-1].tobytes()
            wire["level_weight"] = float(self.level_weight)
        return wire

    def from_wire(self, words: bytes, values: bytes, item_levels: bytes = b"") -> NDArray[np.float64]:
        """Inverse of `to_wire` (the levels are kept for the next `to_wire`); raises ValueError on packed words,
        a wrong length or non-finite values."""
        if words:
            raise ValueError("an iALS model payload carries no packed words")
        if item_levels and len(item_levels) != self.n_items:
            raise ValueError(f"an iALS model needs {self.n_items} item levels, got {len(item_levels)} bytes")
        state = float_state_from_bytes(values, self.shape)
        self._levels[:] = [np.frombuffer(item_levels, dtype=np.uint8).copy()] if item_levels else []
        return state

    def describe(self, old: NDArray[Any], new: NDArray[Any]) -> str:
        """E.g. "mean |ΔV| = 0.0123, 17 items held by nobody"."""
        delta = float(np.mean(np.abs(np.asarray(new, np.float64) - np.asarray(old, np.float64))))
        empty = int(np.count_nonzero(~np.any(np.asarray(new) != 0.0, axis=1)))
        return f"mean |ΔV| = {delta:.4g}, {empty} items held by nobody"
