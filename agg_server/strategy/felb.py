"""FELB server side (Dalleiger, Vreeken, Kamp, federated binary MF, eq. 10 / Alg. 1 line 14), pure
numpy: the global Boolean components V̂ from the cohort's secure sum, and the one-shot baselines
of the paper's Alg. 2 (majority vote, rounded mean, logical OR), which need only a sum as well.

Devices upload ΔV_i = V_i − V̂ (see `device_sdk.felb`), so the sum S = Σ ΔV_i gives the cohort's
mean local copy as V̂ + S/C, and the new model is the soft majority vote

    V̂ ← clamp01(prox^r_{s·κ, s·λ_r}(V̂ + S/C)),   λ_r = reg · reg_growth**round_index,

with ``server_scale`` s (1 by default: the unscaled prox the paper's Alg. 1 prints; s = 1/C is the
exact minimizer of eq. 10).  Clipping and DP noise act on ΔV, which leaves the mean unbiased.

Invariants:
- The only input from devices is a sum and the survivor count; nothing needs one device's upload.
- The state is (k, m) float64 with entries in [0, 1]; on the wire it is float64 little-endian in C
  order (`ModelPayload.values`), and ``from_wire(to_wire(V)) == V`` exactly.
- No randomness is used in aggregation: the same sum gives the same model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from agg_server.strategy.base import FloatStrategy, float_state_from_bytes
from protocol.families.felb import prox_elb, schedule
from protocol.plan import FELBParams
from protocol.spec import MAX_RANK, ModelKind, StepRule

__all__ = [
    "FELBStrategy",
    "logical_or",
    "majority_vote",
    "prox_elb",
    "rounded_mean",
]


def _sum_of(total: ArrayLike, survivors: int) -> NDArray[np.float64]:
    s = np.asarray(total, dtype=np.float64)
    if survivors < 1:
        raise ValueError(f"survivors must be >= 1, got {survivors}")
    if not np.all(np.isfinite(s)):
        raise ValueError("aggregate contains non-finite values")
    return s


def majority_vote(total: ArrayLike, survivors: int) -> NDArray[np.uint8]:
    """[S ≥ C/2] for S the sum of C Boolean uploads (ties go to 1)."""
    s = _sum_of(total, survivors)
    return (2.0 * s >= survivors).astype(np.uint8)


def rounded_mean(total: ArrayLike, survivors: int) -> NDArray[np.uint8]:
    """round(S/C), half to even: equal to `majority_vote` except where S = C/2 exactly (there 0)."""
    s = _sum_of(total, survivors)
    return np.clip(np.rint(s / survivors), 0, 1).astype(np.uint8)


def logical_or(total: ArrayLike, survivors: int) -> NDArray[np.uint8]:
    """[S ≥ 1]: an entry is 1 if any upload has it."""
    s = _sum_of(total, survivors)
    return (s >= 1.0).astype(np.uint8)


@dataclass(frozen=True, slots=True)
class FELBStrategy(FloatStrategy):
    """The FELB strategy: a (k, m) global component matrix in [0, 1] and the devices' plan.

    Attributes
    ----------
    rank : number of components k.
    n_items : catalogue size m.
    kappa : ELB L1 weight κ (paper 0.001).
    reg : ELB L2 weight λ at round 0 (paper 0.1).
    reg_growth : λ_r = reg · reg_growth**round_index (paper 1.05).
    proximity : γ, the devices' pull towards V̂ (not given in the paper; 1 works).
    inertia : iPALM β (paper 0.001).
    local_epochs : local iterations b per round (paper 10 on real data).
    step_rule : "lipschitz" (FELB) or "mu" (FELB^MU).
    server_scale : s in the server prox prox^r_{s·κ, s·λ_r}; 1 = the paper's Alg. 1.
    """

    rank: int
    n_items: int
    kappa: float = 1e-3
    reg: float = 0.1
    reg_growth: float = 1.05
    proximity: float = 1.0
    inertia: float = 1e-3
    local_epochs: int = 10
    step_rule: str = StepRule.LIPSCHITZ.value
    server_scale: float = 1.0
    kind: str = field(default=ModelKind.FELB.value, init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.rank <= MAX_RANK:
            raise ValueError(f"rank must be in [1, {MAX_RANK}], got {self.rank}")
        if self.n_items < 1:
            raise ValueError(f"n_items must be positive, got {self.n_items}")
        if not (np.isfinite(self.server_scale) and self.server_scale >= 0):
            raise ValueError(f"server_scale must be finite and >= 0, got {self.server_scale}")
        self.plan()  # the plan's bounds: `protocol.plan.FELBParams` checks them

    @property
    def vector_length(self) -> int:
        """k·m: a device uploads its whole ΔV."""
        return self.rank * self.n_items

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rank, self.n_items)

    def initialize(self, rng: np.random.Generator) -> NDArray[np.float64]:
        """The shared version-1 V̂, Uniform[0, 1] (one seeded start for every client avoids the
        permutation drift of independent starts)."""
        return rng.random(self.shape)

    def plan(self) -> FELBParams:
        return FELBParams(
            local_epochs=self.local_epochs,
            reg=self.reg,
            reg_growth=self.reg_growth,
            kappa=self.kappa,
            proximity=self.proximity,
            inertia=self.inertia,
            step_rule=StepRule(self.step_rule),
        )

    def reg_at(self, round_index: int) -> float:
        """λ_r for round ``round_index``."""
        return schedule(self.reg, self.reg_growth, round_index)

    def step(
        self, state: NDArray[np.float64], total: NDArray[np.float64], survivors: int, round_index: int
    ) -> NDArray[np.float64]:
        """V̂ ← clamp01(prox^r_{s·κ, s·λ_r}(V̂ + S/C))."""
        if round_index < 0:
            raise ValueError(f"round_index must be >= 0, got {round_index}")
        mean = state + total.reshape(self.shape) / survivors
        sc = self.server_scale
        return prox_elb(mean, sc * self.kappa, sc * self.reg_at(round_index))

    def from_wire(self, words: bytes, values: bytes) -> NDArray[np.float64]:
        if words:
            raise ValueError("FELB models carry float values, not packed words")
        V = float_state_from_bytes(values, self.shape)
        if V.min() < 0.0 or V.max() > 1.0:
            raise ValueError("FELB components must lie in [0, 1]")
        return V

    def describe(self, old: NDArray[Any], new: NDArray[Any]) -> str:
        o = np.asarray(old, dtype=np.float64)
        n = np.asarray(new, dtype=np.float64)
        flipped = int(np.count_nonzero((o >= 0.5) != (n >= 0.5)))
        gap = float(np.minimum(n, 1.0 - n).mean())
        return f"{flipped} rounded entries changed, integrality gap {gap:.4f}"
