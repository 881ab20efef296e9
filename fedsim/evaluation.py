# Invariants of this module:
# - Higher score = better.  Ranks are 0-based: rank r means r candidates are placed above the positive.
# - A positive's rank = (#candidates scoring strictly higher) + tie offset, where the tie offset is 0
#   in OPTIMISTIC mode and uniform on {0, ..., #tied} in RANDOM mode (the positive lands at a uniformly
#   random position among the items sharing its score).  NaN scores are rejected, never ranked.
# - With RANDOM ties and no rng, evaluation returns the exact expectation over tie-breaking
#   (closed form), so results are deterministic without a hidden seed.
# - Kernels take an explicit `np.random.Generator` (or a seed) and never touch global random state.
"""Ranking evaluation: negative sampling, rank of the positive, HR@k / NDCG@k, baselines."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from fedsim.datasets import Ratings

__all__ = [
    "TieMode",
    "EvalResult",
    "InteractionCSR",
    "interaction_csr",
    "sample_negatives",
    "rank_of_positive",
    "hit_ratio",
    "ndcg",
    "evaluate_candidates",
    "evaluate_full_ranking",
    "popularity_scores",
    "random_scores",
]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
ScoreFn = Callable[[IntArray], npt.ArrayLike]


class TieMode(enum.Enum):
    """How a positive is ranked among candidates with exactly its score."""

    RANDOM = "random"
    """Uniformly random position among the tied items (the honest figure; default)."""
    OPTIMISTIC = "optimistic"
    """Ties favour the positive, as the LightFR reference evaluation does (inflates HR/NDCG)."""


@dataclass(frozen=True, slots=True)
class EvalResult:
    """HR@k and NDCG@k averaged over ``n`` ranked positives.

    ``expected`` is True when RANDOM ties were averaged exactly (no rng) rather than sampled.
    """

    hr: float
    ndcg: float
    n: int
    k: int
    tie_mode: TieMode
    expected: bool = False

    def __str__(self) -> str:
        ties = self.tie_mode.value + (", expected" if self.expected else "")
        return f"HR@{self.k} {self.hr:.4f}  NDCG@{self.k} {self.ndcg:.4f}  (n={self.n}, ties={ties})"


class InteractionCSR(NamedTuple):
    """Items of each user: ``indices[indptr[u]:indptr[u + 1]]`` (sorted, distinct)."""

    indptr: IntArray
    indices: IntArray


def _unique_sorted(a: IntArray) -> IntArray:
    """Sorted distinct values; sort-based, as numpy 2.x's plain `np.unique` (hash-based) is ~15x
    slower on a million int64 keys."""
    s = np.sort(a, kind="stable")
    if s.size == 0:
        return s
    keep = np.empty(s.shape[0], dtype=np.bool_)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


def interaction_csr(*parts: Ratings) -> InteractionCSR:
    """Union of the user-item pairs of several `Ratings` in one id space, as CSR.

    Parameters
    ----------
    *parts : Ratings
        E.g. ``train, val, test``; all must share ``n_users`` and ``n_items``.

    Raises
    ------
    ValueError
        If no part is given or the id spaces differ.
    """
    if not parts:
        raise ValueError("need at least one Ratings")
    n_users, n_items = parts[0].n_users, parts[0].n_items
    if any(p.n_users != n_users or p.n_items != n_items for p in parts):
        raise ValueError("all parts must share one id space (n_users, n_items)")
    keys = _unique_sorted(np.concatenate([p.users * n_items + p.items for p in parts]))
    users = keys // max(n_items, 1)
    indptr = np.zeros(n_users + 1, dtype=np.int64)
    np.cumsum(np.bincount(users, minlength=n_users), out=indptr[1:])
    return InteractionCSR(indptr, (keys - users * n_items).astype(np.int64))


def _pair_keys(interacted: tuple[npt.ArrayLike, npt.ArrayLike], n_items: int) -> IntArray:
    indptr = np.asarray(interacted[0], dtype=np.int64)
    indices = np.asarray(interacted[1], dtype=np.int64)
    if indptr.ndim != 1 or indptr.shape[0] < 1 or indptr[-1] != indices.shape[0]:
        raise ValueError("interacted must be a CSR (indptr, indices) with indptr[-1] == len(indices)")
    if indices.size and (indices.min() < 0 or indices.max() >= n_items):
        raise ValueError(f"interacted item index outside [0, {n_items})")
    owners = np.repeat(np.arange(indptr.shape[0] - 1, dtype=np.int64), np.diff(indptr))
    return _unique_sorted(owners * n_items + indices)


def _is_member(sorted_keys: IntArray, query: IntArray) -> npt.NDArray[np.bool_]:
    if sorted_keys.size == 0:
        return np.zeros(query.shape, dtype=np.bool_)
    pos = np.minimum(np.searchsorted(sorted_keys, query), sorted_keys.size - 1)
    return np.asarray(sorted_keys[pos] == query)


def sample_negatives(
    n_items: int,
    user_of_test: npt.ArrayLike,
    positive_items: npt.ArrayLike,
    interacted: tuple[npt.ArrayLike, npt.ArrayLike],
    n_negatives: int,
    seed: int | np.random.Generator,
) -> IntArray:
    """Sample negatives for each test positive, uniformly among items the user never interacted with.

    Bulk rejection sampling: every pending row draws a batch of items at once, drops interacted items,
    the positive and repeats, and keeps the first ``n_negatives`` survivors in draw order; rows short of
    survivors redraw (rows of very dense users end with an exact draw from their complement).

    Parameters
    ----------
    n_items : int
        Size of the item space.
    user_of_test : array_like of int, shape (n_test,)
        Dense user of each test positive.
    positive_items : array_like of int, shape (n_test,)
        The held-out item of each row.
    interacted : (indptr, indices)
        CSR of every item each user has in train, validation and test (see `interaction_csr`).
    n_negatives : int
        Negatives per row (49 as in the LightFR split, 99 as in NCF).
    seed : int or np.random.Generator
        Seed of `np.random.default_rng` (or a generator); equal seeds give equal candidates.

    Returns
    -------
    ndarray of int64, shape (n_test, 1 + n_negatives)
        Column 0 is the positive; the other columns are distinct negatives in random order.

    Raises
    ------
    ValueError
        On inconsistent inputs, or if a user has fewer than ``n_negatives`` items left to sample.
    """
    users = np.asarray(user_of_test, dtype=np.int64)
    positives = np.asarray(positive_items, dtype=np.int64)
    if users.ndim != 1 or positives.shape != users.shape:
        raise ValueError("user_of_test and positive_items must be 1-D arrays of one length")
    if n_negatives < 0:
        raise ValueError("n_negatives must be >= 0")
    if positives.size and (positives.min() < 0 or positives.max() >= n_items):
        raise ValueError(f"positive item outside [0, {n_items})")
    keys = _pair_keys(interacted, n_items)
    n_known_users = np.asarray(interacted[0]).shape[0] - 1
    if users.size and (users.min() < 0 or users.max() >= n_known_users):
        raise ValueError(f"test user outside the interacted CSR [0, {n_known_users})")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    n = users.shape[0]
    out = np.empty((n, 1 + n_negatives), dtype=np.int64)
    out[:, 0] = positives
    if n == 0 or n_negatives == 0:
        return out

    key_users = keys // n_items
    degree = np.bincount(key_users, minlength=n_known_users)[users]
    pos_known = _is_member(keys, users * n_items + positives)
    available = n_items - degree - (~pos_known)
    short = np.flatnonzero(available < n_negatives)
    if short.size:
        j = int(short[0])
        raise ValueError(
            f"{short.size} test row(s) have fewer than {n_negatives} items to sample from "
            f"(e.g. row {j}: user {users[j]} has {available[j]} non-interacted items)"
        )

    pending = np.arange(n)
    for attempt in range(4):  # rounds over all pending rows, not a loop per candidate
        frac = available[pending] / n_items
        draws = int(np.ceil((1.3 * n_negatives + 8) / max(float(frac.min()), 1e-3)))
        draws = min(draws, 4 * n_items) if attempt else min(draws, 2 * n_negatives + 32)
        cand = rng.integers(0, n_items, size=(pending.size, draws), dtype=np.int64)
        ok = ~_is_member(keys, users[pending, None] * n_items + cand)
        ok &= cand != positives[pending, None]
        flat = (np.arange(pending.size, dtype=np.int64)[:, None] * n_items + cand).ravel()
        first = np.zeros(flat.shape[0], dtype=np.bool_)
        first[np.unique(flat, return_index=True)[1]] = True
        ok &= first.reshape(cand.shape)
        done = ok.sum(axis=1) >= n_negatives
        take = ok & (np.cumsum(ok, axis=1) <= n_negatives) & done[:, None]
        out[pending[done], 1:] = cand[take].reshape(-1, n_negatives)
        pending = pending[~done]
        if pending.size == 0:
            return out
    for row in pending.tolist():  # only users who rated almost every item get here
        u = int(users[row])
        seen = keys[(keys >= u * n_items) & (keys < (u + 1) * n_items)] - u * n_items
        free = np.setdiff1d(np.arange(n_items), np.append(seen, positives[row]))
        out[row, 1:] = rng.choice(free, size=n_negatives, replace=False)
    return out


def _validate_scores(scores: npt.ArrayLike) -> FloatArray:
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 2 or s.shape[1] < 1:
        raise ValueError(f"scores must be 2-D (n, candidates) with the positive in column 0, got {s.shape}")
    if np.isnan(s).any():
        raise ValueError("scores contain NaN")
    return s


def _tie_counts(scores: FloatArray) -> tuple[IntArray, IntArray]:
    positive = scores[:, :1]
    greater = (scores[:, 1:] > positive).sum(axis=1).astype(np.int64)
    tied = (scores[:, 1:] == positive).sum(axis=1).astype(np.int64)
    return greater, tied


def _break_ties(greater: IntArray, tied: IntArray, tie_mode: TieMode, rng: np.random.Generator | None) -> IntArray:
    if tie_mode is TieMode.OPTIMISTIC:
        return greater.copy()
    if rng is None:
        raise ValueError("TieMode.RANDOM needs an rng")
    return greater + rng.integers(0, tied + 1, dtype=np.int64)


def _expected_hr_ndcg(greater: IntArray, tied: IntArray, k: int) -> tuple[float, float]:
    """Exact mean HR@k / NDCG@k when the positive's offset is uniform on {0, ..., tied}."""
    if k < 1:
        raise ValueError("k must be >= 1")
    gain = 1.0 / np.log2(np.arange(k, dtype=np.float64) + 2.0)
    cum = np.concatenate([[0.0], np.cumsum(gain)])  # cum[m] = sum of gains of ranks < m
    lo = np.minimum(greater, k)
    hi = np.minimum(greater + tied + 1, k)  # ranks greater .. greater+tied, cut at k
    width = (tied + 1).astype(np.float64)
    hr = (hi - lo) / width
    nd = (cum[hi] - cum[lo]) / width
    return float(hr.mean()), float(nd.mean())


def rank_of_positive(
    scores: npt.ArrayLike, tie_mode: TieMode = TieMode.RANDOM, rng: np.random.Generator | None = None
) -> IntArray:
    """0-based rank of the positive (column 0) among each row's candidates.

    Parameters
    ----------
    scores : array_like, shape (n, C)
        Candidate scores, higher is better; column 0 is the positive.  ``-inf`` is allowed, NaN not.
    tie_mode : TieMode
        OPTIMISTIC ranks the positive first among equal scores; RANDOM places it uniformly at random.
    rng : np.random.Generator, optional
        Required for RANDOM.

    Returns
    -------
    ndarray of int64, shape (n,)

    Raises
    ------
    ValueError
        Bad shape, NaN scores, or RANDOM without an rng.
    """
    greater, tied = _tie_counts(_validate_scores(scores))
    return _break_ties(greater, tied, tie_mode, rng)


def _check_ranks(ranks: npt.ArrayLike, k: int) -> IntArray:
    r = np.asarray(ranks, dtype=np.int64)
    if r.ndim != 1 or r.size == 0:
        raise ValueError("ranks must be a non-empty 1-D array")
    if k < 1:
        raise ValueError("k must be >= 1")
    return r


def hit_ratio(ranks: npt.ArrayLike, k: int) -> float:
    """Fraction of positives ranked in the top k (rank < k).

    Raises
    ------
    ValueError
        If ``ranks`` is empty or ``k < 1``.
    """
    r = _check_ranks(ranks, k)
    return float((r < k).mean())


def ndcg(ranks: npt.ArrayLike, k: int) -> float:
    """Mean NDCG@k with one relevant item: ``1 / log2(rank + 2)`` if rank < k, else 0.

    Raises
    ------
    ValueError
        If ``ranks`` is empty or ``k < 1``.
    """
    r = _check_ranks(ranks, k)
    gains = np.where(r < k, 1.0 / np.log2(np.maximum(r, 0) + 2.0), 0.0)
    return float(gains.mean())


def _result(
    greater: IntArray, tied: IntArray, k: int, tie_mode: TieMode, rng: np.random.Generator | None
) -> EvalResult:
    if greater.size == 0:
        raise ValueError("nothing to evaluate (no test rows)")
    if tie_mode is TieMode.RANDOM and rng is None:
        hr, nd = _expected_hr_ndcg(greater, tied, k)
        return EvalResult(hr, nd, int(greater.size), k, tie_mode, expected=True)
    ranks = _break_ties(greater, tied, tie_mode, rng)
    return EvalResult(hit_ratio(ranks, k), ndcg(ranks, k), int(ranks.size), k, tie_mode)


def evaluate_candidates(
    scores: npt.ArrayLike,
    k: int = 10,
    tie_mode: TieMode = TieMode.RANDOM,
    rng: np.random.Generator | None = None,
) -> EvalResult:
    """HR@k and NDCG@k of candidate blocks (sampled-negatives protocol), averaged over rows.

    Parameters
    ----------
    scores : array_like, shape (n, C)
        Scores of each row's candidates, positive in column 0, higher is better.
    k : int
        Cut-off.
    tie_mode : TieMode
        Tie-breaking rule; report it with the figures.
    rng : np.random.Generator, optional
        For RANDOM ties: sample one tie-break per row.  If None, return the exact expectation over
        tie-breaking (``EvalResult.expected`` is True).

    Raises
    ------
    ValueError
        Bad shape, NaN scores, no rows or ``k < 1``.
    """
    greater, tied = _tie_counts(_validate_scores(scores))
    return _result(greater, tied, k, tie_mode, rng)


def evaluate_full_ranking(
    score_fn: ScoreFn,
    train: Ratings,
    test: Ratings,
    k: int = 10,
    tie_mode: TieMode = TieMode.RANDOM,
    rng: np.random.Generator | None = None,
    batch_size: int = 128,
) -> EvalResult:
    """HR@k / NDCG@k with each held-out item ranked among all items the user has not rated in train.

    Metrics are averaged per test pair (``n`` = number of test ratings); with leave-one-out splits
    that is one pair per user, i.e. per user.  A user's other held-out items stay in the candidate
    set (they are unrated in train), as in the usual "all unrated items" protocol.

    Parameters
    ----------
    score_fn : callable
        ``score_fn(user_indices) -> (len(user_indices), n_items)`` scores, higher is better.
    train, test : Ratings
        One id space; train items are excluded from each user's candidates.
    k : int
        Cut-off.
    tie_mode : TieMode
        Tie-breaking rule.
    rng : np.random.Generator, optional
        As in `evaluate_candidates` (None with RANDOM = exact expectation).
    batch_size : int
        Users scored per `score_fn` call.

    Raises
    ------
    ValueError
        Mismatched id spaces, empty test, bad score shape or NaN scores of candidates.
    """
    if (train.n_users, train.n_items) != (test.n_users, test.n_items):
        raise ValueError("train and test must share one id space")
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    n_items = train.n_items
    train_keys = _unique_sorted(train.users * n_items + train.items)
    order = np.argsort(test.users, kind="stable")
    t_users, t_items = test.users[order], test.items[order]
    test_users = _unique_sorted(t_users)
    greater = np.empty(t_users.shape[0], dtype=np.int64)
    tied = np.empty(t_users.shape[0], dtype=np.int64)
    all_items = np.arange(n_items, dtype=np.int64)
    for start in range(0, test_users.shape[0], batch_size):  # loop over user batches
        batch = test_users[start : start + batch_size]
        scores = np.asarray(score_fn(batch), dtype=np.float64)
        if scores.shape != (batch.shape[0], n_items):
            raise ValueError(f"score_fn returned shape {scores.shape}, expected {(batch.shape[0], n_items)}")
        # the batch is a run of sorted distinct test users, so its pairs are one contiguous slice
        lo = int(np.searchsorted(t_users, batch[0], side="left"))
        hi = int(np.searchsorted(t_users, batch[-1], side="right"))
        rows = np.searchsorted(batch, t_users[lo:hi])
        items = t_items[lo:hi]
        s = scores[rows]  # (pairs, n_items)
        candidate = ~_is_member(train_keys, batch[rows, None] * n_items + all_items[None, :])
        pos_score = s[np.arange(rows.shape[0]), items][:, None]
        candidate[np.arange(rows.shape[0]), items] = False  # the positive is not its own rival
        if np.isnan(pos_score).any() or np.isnan(s[candidate]).any():
            raise ValueError("score_fn returned NaN for a candidate item")
        greater[lo:hi] = ((s > pos_score) & candidate).sum(axis=1)
        tied[lo:hi] = ((s == pos_score) & candidate).sum(axis=1)
    return _result(greater, tied, k, tie_mode, rng)


def popularity_scores(train: Ratings) -> FloatArray:
    """Item popularity baseline: the number of training ratings of each item, as float64 (n_items,)."""
    return train.item_popularity().astype(np.float64)


def random_scores(shape: int | tuple[int, ...], rng: np.random.Generator) -> FloatArray:
    """Random baseline: i.i.d. uniform [0, 1) scores of the given shape."""
    return rng.random(shape)
