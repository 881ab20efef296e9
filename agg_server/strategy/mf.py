"""Server side of real-valued MF with embedding clipping (FMF paper, LFL-SGDMF section 6 and
HFL-SGDMF section 5; docs/design.md §3.1), pure numpy.

Each device uploads the sum of the V-gradients of at most θ of its ratings per user (see
`device_sdk.mf`); secure aggregation reveals only their noisy sum over the survivors, and the server
takes one projected step  V ← Π_V(V − γ/|survivors| · Σ uploads).

Invariants:
- The state is V, (n_items, f) float64, every row non-negative with squared norm ≤ R after every
  `initialize` and `aggregate` (the projection Π the devices use, `protocol.families.mf.project_rows`).
- `aggregate` is a function of the current V, the sum and the survivor count only: it needs no
  individual upload, so it runs unchanged behind SecAgg+ and DP noise.
- Wire form: ``values`` = float64 little-endian C-order bytes of V, ``words`` empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from agg_server.strategy.base import FloatStrategy, float_state_from_bytes
from protocol.families.mf import project_rows
from protocol.plan import MFParams
from protocol.spec import MAX_RANK, ModelKind

__all__ = ["MFStrategy"]


@dataclass(frozen=True, slots=True)
class MFStrategy(FloatStrategy):
    """The MF server strategy: initial item matrix, the plan devices train with, one projected step
    per round.

    Attributes
    ----------
    n_items : catalogue size m.
    rank : factor count f.
    max_norm2 : R, the clipping bound (the top of the rating scale).
    server_lr : γ, the server step on the survivors' mean upload.
    learning_rate, reg : device step and L2 weight for the user vectors.
    pretrain_epochs : device stage-1 steps for a user's first round.
    local_epochs : device steps on u per round before taking the V-gradient.
    negatives : unobserved items per kept rating the devices fit as 0 (0 = explicit only).
    init_scale : initial rows are Π(init_scale · Uniform[0, 1)).
    """

    n_items: int
    rank: int = 32
    max_norm2: float = 5.0
    server_lr: float = 1.0
    learning_rate: float = 0.1
    reg: float = 0.0
    pretrain_epochs: int = 50
    local_epochs: int = 1
    negatives: int = 0
    init_scale: float = 0.1
    kind: str = ModelKind.MF.value

    def __post_init__(self) -> None:
        if self.n_items <= 0:
            raise ValueError(f"n_items must be positive, got {self.n_items}")
        if not 1 <= self.rank <= MAX_RANK:
            raise ValueError(f"rank must be in [1, {MAX_RANK}], got {self.rank}")
        for name in ("server_lr", "init_scale"):
            v = getattr(self, name)
            if not (np.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be finite and > 0, got {v}")
        self.plan()  # the plan's bounds: `protocol.plan.MFParams` checks them
        if self.kind != ModelKind.MF.value:
            raise ValueError(f"kind must be {ModelKind.MF.value!r}, got {self.kind!r}")

    @property
    def shape(self) -> tuple[int, int]:
        """V is (n_items, f)."""
        return (self.n_items, self.rank)

    @property
    def vector_length(self) -> int:
        """One upload: the dense (n_items·f,) V-gradient."""
        return self.n_items * self.rank

    def initialize(self, rng: np.random.Generator) -> NDArray[np.float64]:
        """Small non-negative random rows, projected (the version-1 item matrix)."""
        return project_rows(self.init_scale * rng.random((self.n_items, self.rank)), self.max_norm2)

    def plan(self) -> MFParams:
        """What every device trains with."""
        return MFParams(
            learning_rate=self.learning_rate,
            reg=self.reg,
            max_norm2=self.max_norm2,
            pretrain_epochs=self.pretrain_epochs,
            local_epochs=self.local_epochs,
            negatives=self.negatives,
        )

    def step(
        self, state: NDArray[np.float64], total: NDArray[np.float64], survivors: int, round_index: int
    ) -> NDArray[np.float64]:
        """V ← Π(V − γ/|survivors| · Σ uploads) (FMF paper section 6.1; ``round_index`` is unused: the
        step is constant)."""
        return project_rows(state - (self.server_lr / survivors) * total.reshape(state.shape), self.max_norm2)

    def from_wire(self, words: bytes, values: bytes) -> NDArray[np.float64]:
        """Inverse of `to_wire`; raises ValueError on packed words, a wrong length or non-finite values."""
        if words:
            raise ValueError("an MF model payload carries no packed words")
        return float_state_from_bytes(values, (self.n_items, self.rank))

    def describe(self, old: NDArray[Any], new: NDArray[Any]) -> str:
        """E.g. "mean |ΔV| = 0.0123, 17 rows at the norm bound"."""
        delta = float(np.mean(np.abs(np.asarray(new, np.float64) - np.asarray(old, np.float64))))
        n2 = np.einsum("ij,ij->i", new, new)
        at_bound = int(np.count_nonzero(n2 >= self.max_norm2 * (1 - 1e-9)))
        return f"mean |ΔV| = {delta:.4g}, {at_bound} rows at the norm bound"
