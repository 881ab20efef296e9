"""The one `recommend` every device model family shares (implicit's contract), and its helpers.

A family subclasses `Recommender` and supplies only its scores: `_held_users` and `_check_ready`
(which user rows exist and are trained) and either `_scores` (a dense (n, m) row of real-valued
scores per user; MF, FELB, FNMF) or its own `_top_n` (LightFR ranks in Hamming space without ever
forming a float score row).  Argument parsing, batching, the filters and tie-breaking live here once.

Invariants:
- `recommend(user_items, N, filter_already_liked_items, filter_items, items, *, userid, rng)` returns
  ``(item_ids, scores)``: int64 ids, best first, and **float32 scores, higher is better** (the score
  dtype policy of every family).  One user (a scalar ``userid``) gives 1-D arrays of at most N
  items; a batch (an array of ``userid``) gives (n, N) arrays, padded with -1 / -inf where fewer
  than N items are eligible.
- A filtered item (already liked when ``filter_already_liked_items``, or in ``filter_items``, or
  outside ``items`` when given) is never returned.
- Ties are broken uniformly at random by the generator passed as ``rng``, or by the model's own
  generator (every family holds one); seeding that generator is the way to get a repeatable order.
- Item ids are validated against the catalogue before any use: an out-of-range id, a wrong shape
  or N < 0 is a `ValueError`; asking for an untrained user is a `ModelError`.
- Nothing here imports scipy: a sparse matrix is recognised by its ``tocsr`` method.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = ["Recommender", "as_items", "check_userid", "fold_in_items", "liked_per_user", "top_n_scores"]

# Score rows materialised at once by the float path: users are taken in chunks of this many pairs.
_CHUNK_PAIRS = 1 << 22


def _is_sparse(x: Any) -> bool:
    return hasattr(x, "tocsr") and hasattr(x, "shape")


def as_items(user_items: ArrayLike, n_items: int) -> NDArray[np.int64]:
    """One user's item ids from an array of ids or a 1 × n_items sparse row."""
    if _is_sparse(user_items):
        row: Any = user_items.tocsr()  # type: ignore[union-attr]
        if row.shape[0] != 1:
            raise ValueError("pass one user's items as a 1 × n_items sparse row or an array of ids")
        items = np.asarray(row.indices, dtype=np.int64)
    else:
        arr = np.asarray(user_items)
        if arr.dtype.kind not in "iu" and arr.size and not np.issubdtype(arr.dtype, np.integer):
            if not (np.issubdtype(arr.dtype, np.floating) and np.all(arr == np.round(arr))):
                raise ValueError(f"item ids must be integers, got {arr.dtype}")
        items = arr.astype(np.int64).ravel()
    if items.size and (items.min() < 0 or items.max() >= n_items):
        raise ValueError(f"item id out of range [0, {n_items})")
    return items


def check_userid(userid: int, n_users: int) -> None:
    """Raise ValueError unless ``userid`` names one of the ``n_users`` user rows a model holds."""
    if not 0 <= userid < n_users:
        raise ValueError(f"userid {userid} out of range [0, {n_users})")


def fold_in_items(user_items: ArrayLike, n_items: int, userid: int, n_users: int) -> NDArray[np.int64]:
    """The items of a ``fold_in`` call (see `as_items`), checked: a held ``userid`` and at least one item."""
    items = as_items(user_items, n_items)
    check_userid(userid, n_users)
    if items.size == 0:
        raise ValueError("fold_in needs at least one rated item")
    return items


def liked_per_user(user_items: ArrayLike | None, n: int, batch: bool, n_items: int) -> list[NDArray[np.int64] | None]:
    """Each of ``n`` users' items: from ids (one user), a sparse (n × m) matrix or a list of id arrays."""
    if user_items is None:
        return [None] * n
    if not batch:
        return [as_items(user_items, n_items)]
    if _is_sparse(user_items):
        mat: Any = user_items.tocsr()  # type: ignore[union-attr]
        if mat.shape[0] != n:
            raise ValueError(f"user_items has {mat.shape[0]} rows for {n} users")
        if mat.shape[1] != n_items:
            raise ValueError(f"user_items has {mat.shape[1]} columns for {n_items} items")
        indptr, indices = np.asarray(mat.indptr), np.asarray(mat.indices, dtype=np.int64)
        return [indices[indptr[i] : indptr[i + 1]] for i in range(n)]
    rows = list(user_items)  # type: ignore[arg-type]
    if len(rows) != n:
        raise ValueError(f"user_items has {len(rows)} rows for {n} users")
    return [as_items(r, n_items) for r in rows]


def top_n_scores(
    scores: NDArray[np.floating],
    N: int,
    *,
    exclude: list[NDArray[np.int64] | None],
    items: NDArray[np.int64] | None,
    rng: np.random.Generator | None,
) -> tuple[NDArray[np.int64], NDArray[np.float32]]:
    """Top-N of every row of ``scores`` (n, m), vectorised over the rows.

    Parameters
    ----------
    scores : one row of real-valued item scores per user (higher is better; NaN is never returned).
    N : items per user (>= 0).
    exclude : per row, item ids never returned (None: none).
    items : if given, only these ids are ranked.
    rng : tie-breaking generator (None: the lower item id wins).

    Returns
    -------
    (ids, scores): (n, N) int64 best first, padded with -1, and float32 scores padded with -inf.
    """
    s = np.array(scores, dtype=np.result_type(scores.dtype, np.float32), copy=True)
    n, m = s.shape
    out_ids = np.full((n, N), -1, dtype=np.int64)
    out_scores = np.full((n, N), -np.inf, dtype=np.float32)
    if N == 0 or n == 0 or m == 0:
        return out_ids, out_scores
    s[np.isnan(s)] = -np.inf
    ok = np.ones((n, m), dtype=bool)
    if items is not None:
        ok[:] = False
        ok[:, items] = True
    held = [(r, e) for r, e in enumerate(exclude) if e is not None and e.size]
    if held:
        rows = np.concatenate([np.full(e.size, r, np.int64) for r, e in held])
        ok[rows, np.concatenate([e for _, e in held])] = False
    ok &= s > -np.inf
    s[~ok] = -np.inf
    k = min(N, m)
    # The k-th best score per row; every eligible item at or above it is a candidate.
    kth = -np.partition(-s, k - 1, axis=1)[:, k - 1]
    r, c = np.nonzero(ok & (s >= kth[:, None]))
    v = s[r, c]
    # Order by (row, score descending, random key): equal scores in uniformly random order.
    key = c if rng is None else rng.permutation(c.size)
    order = np.lexsort((key, -v, r))
    r, c, v = r[order], c[order], v[order]
    rank = np.arange(r.size) - np.searchsorted(r, np.arange(n))[r]
    sel = rank < N
    out_ids[r[sel], rank[sel]] = c[sel]
    out_scores[r[sel], rank[sel]] = v[sel]
    return out_ids, out_scores


class Recommender:
    """Mixin giving a model family the implicit-style `recommend` (see the module docstring).

    A subclass provides ``n_items``, ``rng`` (the default tie-breaking generator), `_held_users`,
    `_check_ready`, and `_scores` or `_top_n` (and may provide `_top_one`).
    """

    n_items: int
    rng: np.random.Generator

    # -- what a family supplies -------------------------------------------------------------------
    def _held_users(self) -> int:
        """Number of user rows the model holds (valid ``userid`` values are 0 .. this − 1)."""
        raise NotImplementedError

    def _check_ready(self, users: NDArray[np.int64]) -> None:
        """Raise `ModelError` if any of ``users`` has no trained row (or there is no global model)."""
        raise NotImplementedError

    def _scores(self, users: NDArray[np.int64]) -> NDArray[np.floating]:
        """(len(users), n_items) real-valued scores, higher is better."""
        raise NotImplementedError

    def _top_n(
        self,
        users: NDArray[np.int64],
        N: int,
        exclude: list[NDArray[np.int64] | None],
        items: NDArray[np.int64] | None,
        rng: np.random.Generator,
    ) -> tuple[NDArray[np.int64], NDArray[np.float32]]:
        """(n, N) ids and float32 scores, padded with -1 / -inf; by default from `_scores`, a chunk
        of users at a time."""
        out_ids = np.full((users.size, N), -1, dtype=np.int64)
        out_scores = np.full((users.size, N), -np.inf, dtype=np.float32)
        step = max(1, _CHUNK_PAIRS // max(self.n_items, 1))
        for s in range(0, users.size, step):  # chunks of users, each vectorised
            ids, sc = top_n_scores(
                self._scores(users[s : s + step]), N, exclude=exclude[s : s + step], items=items, rng=rng
            )
            out_ids[s : s + step], out_scores[s : s + step] = ids, sc
        return out_ids, out_scores

    def _top_one(
        self, user: int, N: int, exclude: NDArray[np.int64] | None, rng: np.random.Generator
    ) -> tuple[NDArray[np.int64], NDArray[np.float32]] | None:
        """One user's top N over the whole catalogue as 1-D arrays (at most N, best first), for a family with a
        cheaper one-user path than `_top_n`; None (the default) sends the call through `_top_n`."""
        return None

    # -- the contract -----------------------------------------------------------------------------
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
        """Top-N items for one held user or a batch of them, best first.

        Parameters
        ----------
        user_items : the user's liked items (ids or a 1 × m sparse row); for a batch, a sparse
            (len(userid) × m) matrix or a list of id arrays.  Used only by the filter.
        N : number of items (>= 0).
        filter_already_liked_items : exclude ``user_items`` from the results.
        filter_items : item ids never to return.
        items : if given, rank only these item ids.
        userid : index of a held user row, or an array of them for a batch.
        rng : generator for tie-breaking (defaults to the model's own).

        Returns
        -------
        (item_ids, scores): int64 and float32 (higher is better).  1-D for one user; (n, N) for a
        batch, padded with -1 / -inf where fewer than N items are eligible.  ``item_ids`` (like every
        item id this model takes) are 0-based indices in the model's item order (the rows of the item
        codes), not the dataset's ids: a run saved by ``fedrec simulate --save`` maps index ``i`` to its
        dataset id with ``fedsim.federation.runs.load_run(path).item_label(i)`` (as ``fedrec recommend`` shows).

        Raises
        ------
        ValueError
            For N < 0, an item id outside the catalogue, a userid outside the held rows, or
            ``user_items`` that do not match the users.
        ModelError
            If a requested user has no trained row yet.
        """
        if isinstance(N, bool) or int(N) != N or N < 0:
            raise ValueError(f"N must be an integer >= 0, got {N!r}")
        N = int(N)
        held = self._held_users()
        batch = np.ndim(userid) > 0
        if not batch and isinstance(userid, int | np.integer) and not isinstance(userid, bool):
            users = np.array([int(userid)], dtype=np.int64)  # one user: no array checks to run
            if held == 0:
                self._check_ready(users)  # no user row at all: a model not trained yet, not a bad id
            if not 0 <= int(userid) < held:
                raise ValueError(f"userid out of range [0, {held})")
        else:
            users = np.atleast_1d(np.asarray(userid)).ravel()
            if users.size and not np.issubdtype(users.dtype, np.integer):
                raise ValueError(f"userid must be integer, got {users.dtype}")
            users = users.astype(np.int64)
            if held == 0:
                self._check_ready(users)
            if users.size and (users.min() < 0 or users.max() >= held):
                raise ValueError(f"userid out of range [0, {held})")
        self._check_ready(users)
        m = self.n_items
        liked = liked_per_user(user_items, users.size, batch, m)
        blocked = None if filter_items is None else as_items(filter_items, m)
        cand = None if items is None else np.unique(as_items(items, m))
        exclude: list[NDArray[np.int64] | None] = []
        for row in range(users.size):
            parts = [p for p in (liked[row] if filter_already_liked_items else None, blocked) if p is not None]
            exclude.append(np.concatenate(parts) if len(parts) > 1 else (parts[0] if parts else None))
        tie_rng = self.rng if rng is None else rng
        if not batch and cand is None:
            one = self._top_one(int(users[0]), N, exclude[0], tie_rng)
            if one is not None:
                return one
        ids, scores = self._top_n(users, N, exclude, cand, tie_rng)
        if batch:
            return ids, scores
        n_ok = int(np.count_nonzero(ids[0] >= 0))
        return ids[0, :n_ok], scores[0, :n_ok]
