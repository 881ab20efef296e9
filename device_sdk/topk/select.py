"""Selection for the top-k searches: the k best of each row's candidates by counting or one sort, ties
broken with the caller's generator, excluded items removed by sorted keys row·m + item; the input checks
shared by the search entry points.

Invariants:
- A row's candidates hold every eligible item at or below its k-th eligible cost (ties included), so
  selecting among them is exact; padded slots are id -1 with score -1 (Hamming) or ``PLANE_PAD`` (planes).
- Costs are small non-negative integers: thresholds are found by histogram (`_tau`) or by a partial
  sort of few candidates (`_row_kth`), never by sorting floats.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
from numpy.typing import ArrayLike, NDArray

# The score of a padded slot of a batched plane search (no item there), and the largest cost.
PLANE_PAD = np.iinfo(np.int64).min
_COST_MAX = np.iinfo(np.int64).max


def _check_shift(level_shift: int) -> int:
    if isinstance(level_shift, bool) or int(level_shift) != level_shift or not 0 <= level_shift <= 16:
        raise ValueError(f"level shift must be an integer in [0, 16], got {level_shift!r}")
    return int(level_shift)


def _check_candidates(candidates: ArrayLike, m: int) -> NDArray[np.int64]:
    """The sorted unique ids of an ``items=`` restriction, validated."""
    cand = np.asarray(candidates, dtype=np.int64)
    if cand.ndim != 1:
        raise ValueError("candidates must be a 1-D array of item ids")
    if cand.size and (cand.min() < 0 or cand.max() >= m):
        raise ValueError(f"candidate item index out of range [0, {m})")
    return np.unique(cand)


def _check_levels(levels: ArrayLike, m: int) -> NDArray[np.uint8]:
    lv = np.asarray(levels)
    if lv.shape != (m,):
        raise ValueError(f"item levels must have shape ({m},), got {lv.shape}")
    if lv.dtype != np.uint8:
        if not np.issubdtype(lv.dtype, np.integer) or (lv.size and (lv.min() < 0 or lv.max() > 255)):
            raise ValueError("item levels must be integers in [0, 255]")
        lv = lv.astype(np.uint8)
    return lv


def _exclusion_keys(exclude: Sequence[NDArray[np.int64] | None] | None, n: int, m: int) -> NDArray[np.int64] | None:
    """Sorted unique keys row·m + item of every excluded (user, item) pair, or None."""
    if exclude is None:
        return None
    parts = []
    for row, e in enumerate(exclude):
        if e is None or len(e) == 0:
            continue
        items = np.asarray(e, dtype=np.int64).ravel()
        if items.min() < 0 or items.max() >= m:
            raise ValueError(f"excluded item id out of range [0, {m})")
        parts.append(items + row * m)
    return np.unique(np.concatenate(parts)) if parts else None


_Cost = TypeVar("_Cost", bound=np.integer)


def _order_one(
    ids: NDArray[np.int64],
    cost: NDArray[_Cost],
    k: int,
    excl: NDArray[np.int64] | None,
    rng: np.random.Generator | None,
) -> tuple[NDArray[np.int64], NDArray[_Cost], NDArray[np.intp]]:
    """One user's candidates without the excluded ids (sorted ``excl``), and the positions of its best
    ``k`` by cost: ties in a random order from ``rng``, or by lower id when ``rng`` is None."""
    if excl is not None and ids.size:
        at = np.searchsorted(excl, ids)
        ok = excl[np.minimum(at, excl.size - 1)] != ids
        ids, cost = ids[ok], cost[ok]
    if rng is None:
        order = np.lexsort((ids, cost))[:k]
    else:
        perm = rng.permutation(ids.size)
        order = perm[np.argsort(cost[perm], kind="stable")[:k]]
    return ids, cost, order


def _select_one(
    ids: NDArray[np.int64],
    cost: NDArray[np.integer],
    k: int,
    excl: NDArray[np.int64] | None,
    rng: np.random.Generator | None,
    table: NDArray[np.int32] | None,
    score_of_cost: Callable[[NDArray[np.integer]], NDArray[np.int32]],
) -> tuple[NDArray[np.int64], NDArray[np.int32]]:
    """`_select` for a single user: a random order, then a stable counting sort by cost.  ``table`` holds
    the score of every cost when the costs are few (else None: ``score_of_cost`` maps them)."""
    ids, cost, order = _order_one(ids, cost, k, excl, rng)
    best = cost[order]
    scores = table[best] if table is not None else score_of_cost(best.astype(np.int64))
    if order.size == k:
        return ids[order][None, :], scores[None, :]
    out_ids = np.full((1, k), -1, np.int64)
    out_scores = np.full((1, k), -1, np.int32)
    out_ids[0, : order.size] = ids[order]
    out_scores[0, : order.size] = scores
    return out_ids, out_scores


def _select(
    rows: NDArray[np.int64],
    ids: NDArray[np.int64],
    cost: NDArray[np.int64],
    n: int,
    k: int,
    m: int,
    excl: NDArray[np.int64] | None,
    rng: np.random.Generator | None,
    score_of_cost: Callable[[NDArray[np.integer]], NDArray[np.int32]],
) -> tuple[NDArray[np.int64], NDArray[np.int32]]:
    """The k best candidates of every user (``m`` items), ties in uniformly random order (the candidates
    already hold every item at or below each user's k-th cost, so this is exact), scored by
    ``score_of_cost``."""
    out_ids = np.full((n, k), -1, np.int64)
    out_scores = np.full((n, k), -1, np.int32)
    if excl is not None and rows.size:
        keys = rows * m + ids
        at = np.searchsorted(excl, keys)
        ok = excl[np.minimum(at, excl.size - 1)] != keys
        rows, ids, cost = rows[ok], ids[ok], cost[ok]
    if rows.size == 0:
        return out_ids, out_scores
    # Order by (user, cost, random key): a uniformly random order among equal costs, so the
    # first k of a user take its ties at the threshold uniformly at random.
    key = ids if rng is None else rng.permutation(ids.size)
    if n == 1:
        order = np.lexsort((key, cost))[:k]
        out_ids[0, : order.size] = ids[order]
        out_scores[0, : order.size] = score_of_cost(cost[order])
        return out_ids, out_scores
    span, kspan = int(cost.max()) + 1, (m if rng is None else ids.size)
    if n * span * kspan < 1 << 62:
        # The same order as lexsort((key, cost, rows)), from one int64 key: one sort instead of three.
        order = np.argsort((rows * span + cost) * kspan + key)
    else:
        order = np.lexsort((key, cost, rows))
    rows, ids, cost = rows[order], ids[order], cost[order]
    rank = np.arange(rows.size) - np.searchsorted(rows, np.arange(n))[rows]
    sel = rank < k
    out_ids[rows[sel], rank[sel]] = ids[sel]
    out_scores[rows[sel], rank[sel]] = score_of_cost(cost[sel])
    return out_ids, out_scores


def _row_hist(cost: NDArray[np.integer], nb: int) -> NDArray[np.int64]:
    """(n, nb) histogram of each row of an (n, size) cost matrix."""
    n = cost.shape[0]
    if n == 1:
        return np.bincount(cost[0], minlength=nb)[None, :]
    offs = (np.arange(n, dtype=np.int64) * nb)[:, None]
    return np.bincount((cost + offs).ravel(), minlength=n * nb).reshape(n, nb)


def _pair_hist(rows: NDArray[np.int64], cost: NDArray[np.int64], n: int, nb: int) -> NDArray[np.int64]:
    """(n, nb) histogram of the costs of (row, cost) pairs."""
    if n == 1:
        return np.bincount(cost, minlength=nb)[None, :]
    return np.bincount(rows * nb + cost, minlength=n * nb).reshape(n, nb)


def _tau(hist: NDArray[np.int64], kk: NDArray[np.int64], nb: int) -> NDArray[np.int64]:
    """Per row, the smallest τ with at least kk of the row's costs ≤ τ (nb when it has fewer)."""
    cum = np.cumsum(hist, axis=1)
    tau = np.argmax(cum >= kk[:, None], axis=1)
    return np.where(cum[:, -1] >= kk, tau, nb)


def _row_kth(rows: NDArray[np.int64], cost: NDArray[np.int64], kk: NDArray[np.int64], n: int) -> NDArray[np.int64]:
    """Per row, the kk-th smallest cost of its (row, cost) pairs (int64 max when it has fewer)."""
    order = np.lexsort((cost, rows))
    srow, scost = rows[order], cost[order]
    starts = np.searchsorted(srow, np.arange(n))
    counts = np.diff(starts, append=srow.size)
    ok = counts >= kk
    at = np.minimum(starts + kk - 1, max(srow.size - 1, 0))
    return np.where(ok, scost[at] if scost.size else 0, _COST_MAX)


def _plane_select(
    rows: NDArray[np.int64],
    ids: NDArray[np.int64],
    cost: NDArray[np.int64],
    top: NDArray[np.int64],
    n: int,
    k: int,
    m: int,
    excl: NDArray[np.int64] | None,
    rng: np.random.Generator | None,
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """The k best candidates of every row, (n, k) ids (-1 padded) and scores top_u − cost (PLANE_PAD
    padded), for the plane searches, single or batched alike.

    The candidates of a row may be any superset of its eligible items at or below its k-th eligible
    cost; they are first cut to exactly that set (its canonical form, whatever scan found it), in
    (row, id) order, and the tie keys are then drawn from ``rng`` in that order, one uniform double
    per candidate: ordering by (cost, key) puts equal costs in uniformly random order, and a batch
    draws the very keys its rows would draw one call at a time.  Without a generator the lower id
    wins ties."""
    out_ids = np.full((n, k), -1, np.int64)
    out_scores = np.full((n, k), PLANE_PAD, np.int64)
    if excl is not None and rows.size:
        keys = rows * m + ids
        at = np.searchsorted(excl, keys)
        ok = excl[np.minimum(at, excl.size - 1)] != keys
        rows, ids, cost = rows[ok], ids[ok], cost[ok]
    if rows.size == 0:
        return out_ids, out_scores
    keep = cost <= _row_kth(rows, cost, np.full(n, k, np.int64), n)[rows]
    rows, ids, cost = rows[keep], ids[keep], cost[keep]
    order = np.lexsort((ids, rows))
    rows, ids, cost = rows[order], ids[order], cost[order]
    key = ids if rng is None else rng.random(ids.size)
    order = np.lexsort((key, cost, rows))
    rows, ids, cost = rows[order], ids[order], cost[order]
    rank = np.arange(rows.size) - np.searchsorted(rows, np.arange(n))[rows]
    sel = rank < k
    out_ids[rows[sel], rank[sel]] = ids[sel]
    out_scores[rows[sel], rank[sel]] = top[rows[sel]] - cost[sel]
    return out_ids, out_scores
