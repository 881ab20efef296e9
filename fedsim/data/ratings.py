# Invariants of this module:
# - A `Ratings` holds parallel arrays of one length: `users`/`items` are int64 dense indices in
#   [0, n_users) / [0, n_items); `ratings` is finite float64; `timestamps` is int64 or None.
#   `user_ids[u]` / `item_ids[i]` give the raw id of dense index u / i.  Arrays are read-only views.
"""The `Ratings` container every loader returns, and its per-user CSR view `UserIndex`."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from protocol.errors import DatasetError

__all__ = ["Ratings", "UserIndex", "IntArray", "FloatArray"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


def _readonly(a: npt.NDArray[Any]) -> npt.NDArray[Any]:
    view = a.view()
    view.flags.writeable = False
    return view


class UserIndex(NamedTuple):
    """Ratings grouped by user, CSR style.

    The ratings of dense user ``u`` are ``items[indptr[u]:indptr[u + 1]]`` (and the same slice of
    ``ratings``), in file order; ``order`` maps each CSR position back to the row of the `Ratings`.
    """

    indptr: IntArray
    items: IntArray
    ratings: FloatArray
    order: IntArray


@dataclass(frozen=True, slots=True, eq=False)
class Ratings:
    """An explicit-feedback rating log over a dense id space.

    Parameters
    ----------
    users, items : ndarray of int64, shape (n,)
        Dense user / item index of each rating.
    ratings : ndarray of float64, shape (n,)
        Rating values (finite).
    timestamps : ndarray of int64, shape (n,), or None
        Unix time of each rating, if the source has one.
    n_users, n_items : int
        Size of the id space (may exceed the ids present, e.g. in a split).
    user_ids, item_ids : ndarray, shape (n_users,) / (n_items,)
        Raw id of each dense index.
    name : str
        Human-readable name (dataset and part).
    meta : mapping of str to int or str
        Load statistics, e.g. the number of dropped duplicate lines.

    Raises
    ------
    DatasetError
        If the arrays are inconsistent (lengths, dtypes, ranges, non-finite ratings).
    """

    users: IntArray
    items: IntArray
    ratings: FloatArray
    timestamps: IntArray | None
    n_users: int
    n_items: int
    user_ids: npt.NDArray[Any]
    item_ids: npt.NDArray[Any]
    name: str = "ratings"
    meta: MappingProxyType[str, int | str] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        users = np.asarray(self.users)
        items = np.asarray(self.items)
        ratings = np.asarray(self.ratings, dtype=np.float64)
        n = users.shape[0] if users.ndim == 1 else -1
        if users.ndim != 1 or items.shape != (n,) or ratings.shape != (n,):
            raise DatasetError(
                f"{self.name}: users, items and ratings must be 1-D arrays of one length "
                f"(got shapes {users.shape}, {items.shape}, {ratings.shape})"
            )
        for label, arr in (("users", users), ("items", items)):
            if arr.dtype != np.int64:
                raise DatasetError(f"{self.name}: {label} must be int64, got {arr.dtype}")
        if self.n_users < 0 or self.n_items < 0:
            raise DatasetError(f"{self.name}: n_users and n_items must be >= 0")
        if n and (users.min() < 0 or users.max() >= self.n_users):
            raise DatasetError(f"{self.name}: user index outside [0, {self.n_users})")
        if n and (items.min() < 0 or items.max() >= self.n_items):
            raise DatasetError(f"{self.name}: item index outside [0, {self.n_items})")
        if not np.isfinite(ratings).all():
            raise DatasetError(f"{self.name}: ratings must be finite")
        ts = self.timestamps
        if ts is not None:
            ts = np.asarray(ts)
            if ts.shape != (n,) or ts.dtype != np.int64:
                raise DatasetError(f"{self.name}: timestamps must be int64 of shape ({n},)")
            object.__setattr__(self, "timestamps", _readonly(ts))
        user_ids = np.asarray(self.user_ids)
        item_ids = np.asarray(self.item_ids)
        if user_ids.shape != (self.n_users,) or item_ids.shape != (self.n_items,):
            raise DatasetError(f"{self.name}: user_ids / item_ids must have n_users / n_items entries")
        object.__setattr__(self, "users", _readonly(users))
        object.__setattr__(self, "items", _readonly(items))
        object.__setattr__(self, "ratings", _readonly(ratings))
        object.__setattr__(self, "user_ids", _readonly(user_ids))
        object.__setattr__(self, "item_ids", _readonly(item_ids))
        if not isinstance(self.meta, MappingProxyType):
            object.__setattr__(self, "meta", MappingProxyType(dict(self.meta)))

    def __len__(self) -> int:
        return int(self.users.shape[0])

    def __repr__(self) -> str:
        ts = "with" if self.timestamps is not None else "no"
        return (
            f"Ratings(name={self.name!r}, n={len(self)}, n_users={self.n_users}, "
            f"n_items={self.n_items}, {ts} timestamps)"
        )

    def by_user(self) -> UserIndex:
        """Group the ratings by user.

        Returns
        -------
        UserIndex
            ``(indptr, items, ratings, order)``; within a user, ratings keep file order.
        """
        order = np.argsort(self.users, kind="stable")
        counts = np.bincount(self.users, minlength=self.n_users)
        indptr = np.zeros(self.n_users + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        return UserIndex(indptr, self.items[order], self.ratings[order], order.astype(np.int64))

    def user_counts(self) -> IntArray:
        """Number of ratings of each dense user, shape (n_users,)."""
        return np.bincount(self.users, minlength=self.n_users).astype(np.int64)

    def item_popularity(self) -> IntArray:
        """Number of ratings of each dense item, shape (n_items,)."""
        return np.bincount(self.items, minlength=self.n_items).astype(np.int64)

    def normalized(self, r_min: float | None = None, r_max: float | None = None) -> Ratings:
        """Return a copy with ratings mapped to [0, 1] by ``(r - r_min) / (r_max - r_min)``.

        Parameters
        ----------
        r_min, r_max : float, optional
            Scale bounds (e.g. 1 and 5 for MovieLens); default to the observed minimum / maximum.
            Values outside the bounds are not clipped.

        Raises
        ------
        ValueError
            If ``r_max <= r_min`` or the log is empty and a bound is missing.
        """
        if (r_min is None or r_max is None) and len(self) == 0:
            raise ValueError("cannot infer rating bounds of an empty Ratings")
        lo = float(self.ratings.min()) if r_min is None else float(r_min)
        hi = float(self.ratings.max()) if r_max is None else float(r_max)
        if not hi > lo:
            raise ValueError(f"need r_max > r_min, got r_min={lo}, r_max={hi}")
        return self._replace(ratings=(self.ratings - lo) / (hi - lo), name=f"{self.name}[normalized]")

    def subset(self, mask: npt.ArrayLike, name: str | None = None) -> Ratings:
        """Rows selected by a boolean mask or an index array, in the same id space.

        Parameters
        ----------
        mask : array_like of bool, shape (n,), or of int
            Rows to keep.
        name : str, optional
            Name of the result (default: this name).

        Raises
        ------
        ValueError
            If a boolean mask has the wrong length.
        """
        sel = np.asarray(mask)
        if sel.dtype == np.bool_ and sel.shape != (len(self),):
            raise ValueError(f"mask has shape {sel.shape}, expected ({len(self)},)")
        ts = None if self.timestamps is None else self.timestamps[sel]
        return Ratings(
            users=self.users[sel],
            items=self.items[sel],
            ratings=self.ratings[sel],
            timestamps=ts,
            n_users=self.n_users,
            n_items=self.n_items,
            user_ids=self.user_ids,
            item_ids=self.item_ids,
            name=self.name if name is None else name,
            meta=self.meta,
        )

    def _replace(self, *, ratings: FloatArray, name: str) -> Ratings:
        return Ratings(
            users=self.users,
            items=self.items,
            ratings=ratings,
            timestamps=self.timestamps,
            n_users=self.n_users,
            n_items=self.n_items,
            user_ids=self.user_ids,
            item_ids=self.item_ids,
            name=name,
            meta=self.meta,
        )
