"""The contract every server strategy keeps: turn the cohort's secure **sum** into the next global
model.  `RoundCoordinator` speaks only to this interface, so a new model family (or an operator's
own aggregation rule) plugs in without touching the round machinery.

Invariants:
- A strategy is pure numpy: no I/O, no clock, no global randomness (the round's generator is passed
  in).  Its only view of the devices is ``total`` — the dequantized sum of the survivors' uploads,
  DP noise included — and the number of survivors.
- ``state`` is the global model as a float64 or int8 array in the family's own shape; `to_wire` and
  `from_wire` convert it to and from the flat little-endian bytes of a `ModelPayload`, and
  ``from_wire(to_wire(s)) == s`` exactly.
- `plan` names only `RoundInvite` fields: it is the training plan every invited device receives.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from protocol.codes import float_matrix_from_bytes, float_matrix_to_bytes
from protocol.plan import FamilyParams, TrainingPlan

# The float wire form lives in `protocol.codes` (devices decode it too); kept here under its old names.
float_state_to_bytes = float_matrix_to_bytes
float_state_from_bytes = float_matrix_from_bytes

__all__ = [
    "FloatStrategy",
    "Strategy",
    "check_aggregate_inputs",
    "float_state_from_bytes",
    "float_state_to_bytes",
    "round_plan",
]


@runtime_checkable
class Strategy(Protocol):
    """A model family's server side.

    Attributes
    ----------
    kind : str
        `protocol.spec.ModelKind` value; the devices' model must be of the same kind.
    rank : int
        Code length f (LightFR), factor count (MF) or component count k (FELB, FNMF): the
        ``bits`` field of `ModelPayload` and `RoundInvite`.
    n_items : int
        Catalogue size m (columns of the item matrix).
    vector_length : int
        Number of elements of one device upload (the SecAgg ring vector).
    """

    @property
    def kind(self) -> str: ...

    @property
    def rank(self) -> int: ...

    @property
    def n_items(self) -> int: ...

    @property
    def vector_length(self) -> int: ...

    def initialize(self, rng: np.random.Generator) -> NDArray[Any]:
        """The version-1 global model, drawn from ``rng``."""
        ...

    def plan(self) -> FamilyParams:
        """The family's training parameters every device of a round receives (`protocol.plan`)."""
        ...

    def aggregate(
        self,
        state: NDArray[Any],
        total: NDArray[np.float64],
        survivors: int,
        rng: np.random.Generator,
        *,
        round_index: int,
    ) -> NDArray[Any]:
        """The next global model from the current one and the survivors' summed uploads.

        Parameters
        ----------
        state : the current global model.
        total : (vector_length,) float64 sum of the survivors' uploads (after dequantization).
        survivors : how many uploads the sum holds (>= 1).
        rng : the round's generator (damping, tie breaking).
        round_index : 0 for the round that trains version 1, 1 for version 2, ... (schedules).
        """
        ...

    def to_wire(self, state: NDArray[Any]) -> dict[str, Any]:
        """``{"words": ...}`` (packed LightFR codes, plus ``item_levels`` and ``hamming_weight`` under
        LightFR's all-items objective) or ``{"values": ...}`` (float64 little-endian): `ModelPayload`
        fields."""
        ...

    def from_wire(self, words: bytes, values: bytes) -> NDArray[Any]:
        """Inverse of `to_wire`; raises ValueError on a wrong length."""
        ...

    def describe(self, old: NDArray[Any], new: NDArray[Any]) -> str:
        """One log phrase on what the round changed (e.g. "212 bits flipped")."""
        ...


def check_aggregate_inputs(
    state: NDArray[Any],
    total: NDArray[np.float64],
    survivors: int,
    *,
    shape: tuple[int, int],
    vector_length: int,
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """The checks a float family's `Strategy.aggregate` makes before its step, in one place.

    Parameters
    ----------
    state : the current global model; must have ``shape``.
    total : the survivors' summed uploads; must be a vector of ``vector_length`` finite values.
    survivors : how many uploads the sum holds; must be >= 1.
    shape : the family's state shape.
    vector_length : the family's upload length.

    Returns
    -------
    (state, total) as float64 arrays.

    Raises
    ------
    ValueError
        One of the conditions fails.
    """
    state = np.asarray(state, dtype=np.float64)
    if state.shape != shape:
        raise ValueError(f"state has shape {state.shape}, expected {shape}")
    total = np.asarray(total, dtype=np.float64)
    if total.shape != (vector_length,):
        raise ValueError(f"aggregate must be a vector of {vector_length} elements, got shape {total.shape}")
    if not np.all(np.isfinite(total)):
        raise ValueError("aggregate contains non-finite values")
    if survivors < 1:
        raise ValueError(f"survivors must be >= 1, got {survivors}")
    return state, total


class FloatStrategy(ABC):
    """What the float-valued families (MF, FELB, FNMF) share of `Strategy`: `aggregate` checks its inputs
    once (`check_aggregate_inputs`) and hands them to the family's `step`; the state travels as float64
    little-endian values (`to_wire`).  A family sets `shape` and `vector_length` and writes `step` (and its
    own `from_wire`, which checks the family's invariants on a download).
    """

    __slots__ = ()

    @property
    @abstractmethod
    def shape(self) -> tuple[int, int]:
        """The state's shape."""

    @property
    @abstractmethod
    def vector_length(self) -> int:
        """Number of elements of one device upload."""

    @abstractmethod
    def step(
        self, state: NDArray[np.float64], total: NDArray[np.float64], survivors: int, round_index: int
    ) -> NDArray[np.float64]:
        """The family's update from checked inputs: ``state`` of `shape`, ``total`` a finite
        (`vector_length`,) sum of ``survivors`` >= 1 uploads."""

    def aggregate(
        self,
        state: NDArray[Any],
        total: NDArray[np.float64],
        survivors: int,
        rng: np.random.Generator,
        *,
        round_index: int,
    ) -> NDArray[np.float64]:
        """`Strategy.aggregate`: the checks, then `step` (``rng`` is unused: every float family's step is
        deterministic)."""
        V, g = check_aggregate_inputs(state, total, survivors, shape=self.shape, vector_length=self.vector_length)
        return self.step(V, g, survivors, round_index)

    def to_wire(self, state: NDArray[Any]) -> dict[str, bytes]:
        """``{"values": float64 little-endian bytes of the state, C order}``."""
        return {"values": float_state_to_bytes(np.asarray(state, dtype=np.float64))}


def round_plan(
    strategy: Strategy,
    model_version: int,
    *,
    example_cap: int = 0,
    round_index: int | None = None,
    clip_norm: float = math.inf,
) -> TrainingPlan:
    """The training plan of a round that trains ``model_version``: the strategy's parameters plus the
    model's shape (a `RoundInvite` carries it as `TrainingPlan.invite_fields`).

    ``round_index`` defaults to ``model_version - 1`` (0 for the round that trains version 1);
    ``clip_norm`` is the upload's clipping bound (infinity: in-process runs clip nothing).

    Raises
    ------
    ValueError
        The strategy's parameters are not its family's (``strategy.kind``) or its `vector_length`
        is not the plan's upload.
    """
    params = strategy.plan()
    plan = TrainingPlan(
        params=params,
        n_items=strategy.n_items,
        rank=strategy.rank,
        model_version=model_version,
        round_index=model_version - 1 if round_index is None else round_index,
        example_cap=example_cap,
        clip_norm=clip_norm,
    )
    if plan.kind != strategy.kind:
        raise ValueError(f"strategy of kind {strategy.kind!r} returned {plan.kind.value!r} parameters")
    if plan.vector_length != strategy.vector_length:
        raise ValueError(f"strategy uploads {strategy.vector_length} entries, its plan {plan.vector_length}")
    return plan
