"""The contract every device-side model family keeps, so that `DeviceClient`, the in-process
simulator and `device_sdk.training.local_round` drive LightFR, MF, FELB and FNMF the same way.

A device holds one or more local users' ratings (one user on a phone; many in the cross-silo mode,
where a hospital or an app back-end is the "device").  They are given as `LocalRatings`, a COO
triple over local user indices.  Each round the model adopts the global model it downloaded
(`set_global`), trains on its local data as the invitation's plan says, and returns the float
vector it wants summed (`local_update`); `local_round` then clips, quantizes and hands it to secure
aggregation.

Invariants:
- `local_update` draws every random choice from the generator passed in, in a fixed order: a device
  with the same generator state returns the same vector (the HTTP run and the in-process run agree
  bit for bit).
- The returned vector has exactly ``plan.vector_length`` finite float64 entries; ratings, user
  factors and anything else local never leave the model except through it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Self, runtime_checkable

import numpy as np
from numpy.typing import ArrayLike, NDArray

from protocol.plan import TrainingPlan

if TYPE_CHECKING:
    from protocol.messages import RoundInvite

__all__ = ["FederatedModel", "LocalRatings", "LocalResult", "RoundHooks"]


@dataclass(frozen=True)
class LocalRatings:
    """A device's local ratings as COO triples.

    Attributes
    ----------
    users : (nnz,) int64 local user index in ``[0, n_users)`` (all 0 on a single-user device).
    items : (nnz,) int64 item ids in ``[0, n_items)``.
    ratings : (nnz,) float64 raw ratings, or None for implicit feedback (every entry is a 1).
    n_users : number of local users (rows).
    """

    users: NDArray[np.int64]
    items: NDArray[np.int64]
    ratings: NDArray[np.float64] | None
    n_users: int

    @classmethod
    def single_user(cls, items: ArrayLike, ratings: ArrayLike | None = None) -> LocalRatings:
        """One user's rated items (and raw ratings)."""
        item_ids = np.asarray(items, dtype=np.int64).ravel()
        values = None if ratings is None else np.asarray(ratings, dtype=np.float64).ravel()
        return cls(np.zeros(item_ids.size, dtype=np.int64), item_ids, values, 1)

    @classmethod
    def from_matrix(cls, matrix: ArrayLike) -> LocalRatings:
        """Rows of a dense (n_users, n_items) matrix; zero entries are unobserved."""
        a = np.asarray(matrix, dtype=np.float64)
        if a.ndim != 2:
            raise ValueError(f"expected a 2-D matrix, got shape {a.shape}")
        users, items = np.nonzero(a)
        return cls(users.astype(np.int64), items.astype(np.int64), a[users, items], a.shape[0])

    def __post_init__(self) -> None:
        if self.users.shape != self.items.shape or self.users.ndim != 1:
            raise ValueError(f"users and items must be 1-D of one length, got {self.users.shape}, {self.items.shape}")
        if self.ratings is not None and self.ratings.shape != self.items.shape:
            raise ValueError(f"{self.items.size} items but {self.ratings.size} ratings")
        if self.ratings is not None and not np.all(np.isfinite(self.ratings)):
            raise ValueError("ratings contain NaN or infinity")
        if self.n_users < 1:
            raise ValueError(f"n_users must be >= 1, got {self.n_users}")
        if self.users.size and (self.users.min() < 0 or self.users.max() >= self.n_users):
            raise ValueError(f"a user index is outside [0, {self.n_users})")
        if self.items.size and self.items.min() < 0:
            raise ValueError("item ids must be non-negative")

    def check_items(self, n_items: int) -> None:
        """Raise ValueError if an item id is outside the catalogue."""
        if self.items.size and self.items.max() >= n_items:
            raise ValueError(f"item id {int(self.items.max())} is outside the catalogue [0, {n_items})")

    def dense(self, n_items: int, *, implicit_value: float = 1.0) -> NDArray[np.float64]:
        """The (n_users, n_items) matrix, zero where unobserved."""
        self.check_items(n_items)
        out = np.zeros((self.n_users, n_items), dtype=np.float64)
        out[self.users, self.items] = implicit_value if self.ratings is None else self.ratings
        return out


@dataclass(frozen=True, slots=True)
class LocalResult:
    """What one local round produced.

    Attributes
    ----------
    vector : (vector_length,) float64, the upload before clipping and quantization.
    examples : how many ratings (or matrix entries) the round trained on.
    info : family-specific figures for logs and tests (JSON-able scalars).
    """

    vector: NDArray[np.float64]
    examples: int
    info: dict[str, Any]


@runtime_checkable
class FederatedModel(Protocol):
    """A device-side model of one family (`protocol.spec.ModelKind`)."""

    KIND: ClassVar[str]

    @property
    def n_items(self) -> int: ...

    @property
    def model_version(self) -> int: ...

    @property
    def rank(self) -> int:
        """Code length / factor count / components: the ``bits`` field of the wire messages."""
        ...

    def set_global(self, words: bytes, values: bytes, version: int) -> None:
        """Adopt global model ``version`` from a `ModelPayload`'s ``words`` / ``values``; raises
        ValueError when they do not fit this model."""
        ...

    def start_round(self, invite: RoundInvite) -> None:
        """Called before `local_update` with the round's invite, for what a family reads of the round
        beyond its plan (`RoundHooks` gives the no-op default)."""
        ...

    def local_update(self, plan: TrainingPlan, data: LocalRatings, rng: np.random.Generator) -> LocalResult:
        """Train on ``data`` as ``plan`` says and return the upload (``plan.vector_length`` entries)."""
        ...

    def adopted(self, data: LocalRatings) -> None:
        """Called once after `set_global` adopted a new version, with the device's own ratings, before the
        model is saved (`RoundHooks` gives the no-op default)."""
        ...

    def recommend(
        self,
        user_items: ArrayLike | None = None,
        N: int = 10,
        filter_already_liked_items: bool = True,
        filter_items: ArrayLike | None = None,
        items: ArrayLike | None = None,
        *,
        userid: int | ArrayLike = 0,
        rng: np.random.Generator | None = None,
    ) -> tuple[NDArray[np.int64], NDArray[np.float32]]:
        """Top-N items for held user(s), best first, float32 scores (`device_sdk.retrieval.Recommender`)."""
        ...

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the model atomically to one store file (`device_sdk.store`)."""
        ...

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, rng: np.random.Generator | None = None) -> Self:
        """Read a model written by `save`; ``rng`` becomes its tie-breaking generator."""
        ...


class RoundHooks:
    """The no-op defaults of `FederatedModel.start_round` and `FederatedModel.adopted`: a family overrides
    the hook it needs, so the client and the trainer call both on every family and never branch on it."""

    def start_round(self, invite: RoundInvite) -> None:
        """Nothing to read from the invite beyond the plan."""

    def adopted(self, data: LocalRatings) -> None:
        """Nothing to recompute when a new global version arrives."""
