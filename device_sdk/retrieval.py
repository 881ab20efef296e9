"""Retrieval helpers every device model shares: reading item ids from the implicit-style API's
arguments, and top-N over real-valued scores with the filtering contract of `recommend`.

Invariants:
- Item ids are validated against the catalogue before any use; an out-of-range id is a ValueError.
- `top_n_scores` never returns a filtered item; a row with fewer than N eligible items is padded
  with -1 / -inf (batch) or shortened (single user).
- Ties are broken uniformly at random by the generator given, or by the lower item id when none is
  (models that hold no generator of their own stay deterministic).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = ["as_items", "liked_per_user", "top_n_scores"]


def _csr(user_items: object) -> object | None:
    """A scipy sparse matrix or array as CSR, else None: duck-typed, so the device path never imports scipy."""
    tocsr = getattr(user_items, "tocsr", None)
    return tocsr() if callable(tocsr) else None


def as_items(user_items: ArrayLike, n_items: int) -> NDArray[np.int64]:
    """One user's item ids from an array of ids or a 1 × n_items sparse row."""
    row: Any = _csr(user_items)
    if row is not None:
        if row.shape[0] != 1:
            raise ValueError("pass one user's items as a 1 × n_items sparse row or an array of ids")
        items = row.indices.astype(np.int64)
    else:
        items = np.asarray(user_items, dtype=np.int64).ravel()
    if items.size and (items.min() < 0 or items.max() >= n_items):
        raise ValueError(f"item id out of range [0, {n_items})")
    return items


def liked_per_user(user_items: ArrayLike | None, n: int, batch: bool, n_items: int) -> list[NDArray[np.int64] | None]:
    """Each of ``n`` users' items: from ids (one user), a sparse (n × m) matrix or a list of id arrays."""
    if user_items is None:
        return [None] * n
    if not batch:
        return [as_items(user_items, n_items)]
    mat: Any = _csr(user_items)
    if mat is not None:
        if mat.shape[0] != n:
            raise ValueError(f"user_items has {mat.shape[0]} rows for {n} users")
        return [mat.indices[mat.indptr[i] : mat.indptr[i + 1]].astype(np.int64) for i in range(n)]
    rows = list(user_items)  # type: ignore[arg-type]
    if len(rows) != n:
        raise ValueError(f"user_items has {len(rows)} rows for {n} users")
    return [as_items(r, n_items) for r in rows]


def _best(
    s: NDArray[np.float64], eligible: NDArray[np.int64], N: int, rng: np.random.Generator | None
) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
    """The N best of ``s[eligible]``, best first."""
    if N == 0 or eligible.size == 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float64)
    v = s[eligible]
    k = min(N, v.size)
    tau = v[np.argpartition(-v, k - 1)[k - 1]]  # the k-th best score
    above = np.flatnonzero(v > tau)
    tied = np.flatnonzero(v == tau)
    if rng is None:
        pick = np.r_[above, tied[: k - above.size]]
        pick = pick[np.lexsort((eligible[pick], -v[pick]))]
    else:
        pick = np.r_[above, rng.choice(tied, size=k - above.size, replace=False)]
        pick = pick[rng.permutation(pick.size)]
        pick = pick[np.argsort(-v[pick], kind="stable")]
    pick = pick.astype(np.int64)
    return eligible[pick], v[pick]


def top_n_scores(
    scores: NDArray[np.floating],
    N: int,
    *,
    liked: list[NDArray[np.int64] | None],
    filter_already_liked_items: bool,
    filter_items: ArrayLike | None,
    items: ArrayLike | None,
    batch: bool,
    rng: np.random.Generator | None,
) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
    """Top-N per row of ``scores`` (n, m) under `recommend`'s filters.

    Parameters
    ----------
    scores : one row of item scores per user.
    N : items per user (>= 0).
    liked : each user's items (from `liked_per_user`), excluded when ``filter_already_liked_items``.
    filter_items : item ids never returned.
    items : if given, only these ids are ranked.
    batch : return (n, N) arrays padded with -1 / -inf; else the single row, shortened.
    rng : tie-breaking generator (None: the lower item id wins).
    """
    if N < 0:
        raise ValueError(f"N must be >= 0, got {N}")
    s = np.asarray(scores, dtype=np.float64)
    n, m = s.shape
    allowed = np.ones(m, dtype=bool)
    if items is not None:
        allowed[:] = False
        allowed[as_items(items, m)] = True
    if filter_items is not None:
        allowed[as_items(filter_items, m)] = False
    out_ids = np.full((n, N), -1, dtype=np.int64)
    out_scores = np.full((n, N), -np.inf, dtype=np.float64)
    for row in range(n):  # loop over the (few) users of a batch; each row is vectorized
        ok = allowed.copy()
        if filter_already_liked_items and liked[row] is not None:
            ok[liked[row]] = False
        ids, best = _best(s[row], np.flatnonzero(ok), N, rng)
        out_ids[row, : ids.size] = ids
        out_scores[row, : ids.size] = best
    if batch:
        return out_ids, out_scores
    n_ok = int((out_ids[0] >= 0).sum())
    return out_ids[0, :n_ok], out_scores[0, :n_ok]
