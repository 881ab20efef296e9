# Invariants of this module:
# - Higher score = better.  Ranks are 0-based: rank r means r candidates are placed above the positive.
# - A positive's rank = (#candidates scoring strictly higher) + tie offset, where the tie offset is 0
#   in OPTIMISTIC mode and uniform on {0, ..., #tied} in RANDOM mode (the positive lands at a uniformly
#   random position among the items sharing its score).  NaN scores are rejected, never ranked.
# - With RANDOM ties and no rng, evaluation returns the exact expectation over tie-breaking
#   (closed form), so results are deterministic without a hidden seed.
# - Kernels take an explicit `np.random.Generator` (or a seed) and never touch global random state.
"""Ranking evaluation: negative sampling, rank of the positive, HR@k / NDCG@k, baselines.

Why one module: the sampled and the all-items protocols share TieMode, the CSR membership helpers and the
Scorer type; the all-items section, under its own banner and invariants below, is the seam to split along.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from fedsim.data.ratings import Ratings

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
    "expected_hits",
    "evaluate_full_ranking",
    "popularity_scores",
    "random_scores",
    "Scorer",
    "RankingResult",
    "evaluate_all_items",
    "hamming_scorer",
    "popularity_scorer",
    "random_scorer",
    "sample_test_blocks",
    "evaluate_sampled",
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

    def metrics(self) -> dict[str, float]:
        """``{"hr@k": ..., "ndcg@k": ...}``, the keys of the ``--json`` metric maps."""
        return {f"hr@{self.k}": self.hr, f"ndcg@{self.k}": self.ndcg}

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
    available = _available_items(keys, users, positives, n_items, n_known_users, n_negatives)
    pending = _draw_by_rejection(rng, keys, users, positives, available, n_items, out)
    for row in pending.tolist():  # only users who rated almost every item get here
        u = int(users[row])
        seen = keys[(keys >= u * n_items) & (keys < (u + 1) * n_items)] - u * n_items
        free = np.setdiff1d(np.arange(n_items), np.append(seen, positives[row]))
        out[row, 1:] = rng.choice(free, size=n_negatives, replace=False)
    return out


def _available_items(
    keys: IntArray, users: IntArray, positives: IntArray, n_items: int, n_known_users: int, n_negatives: int
) -> IntArray:
    """Items each test row may draw from (never interacted, not its positive); raises if a row has too few."""
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
    return available


def _draw_by_rejection(
    rng: np.random.Generator,
    keys: IntArray,
    users: IntArray,
    positives: IntArray,
    available: IntArray,
    n_items: int,
    out: IntArray,
) -> IntArray:
    """Fill ``out[:, 1:]`` by up to four rounds of bulk rejection sampling; returns the rows still short."""
    n_negatives = out.shape[1] - 1
    pending = np.arange(users.shape[0])
    for attempt in range(4):  # rounds over all pending rows, not a loop per candidate
        frac = available[pending] / n_items
        draws = int(np.ceil((1.3 * n_negatives + 8) / max(float(frac.min()), 1e-3)))
        draws = min(draws, 4 * n_items) if attempt else min(draws, 2 * n_negatives + 32)
        cand = rng.integers(0, n_items, size=(pending.size, draws), dtype=np.int64)
        ok = ~_is_member(keys, users[pending, None] * n_items + cand)
        ok &= cand != positives[pending, None]
        ok &= _first_in_row(cand)
        done = ok.sum(axis=1) >= n_negatives
        take = ok & (np.cumsum(ok, axis=1) <= n_negatives) & done[:, None]
        out[pending[done], 1:] = cand[take].reshape(-1, n_negatives)
        pending = pending[~done]
        if pending.size == 0:
            break
    return pending


def _first_in_row(cand: IntArray) -> npt.NDArray[np.bool_]:
    """Mask of the first occurrence of each item in its row, in draw order."""
    # a stable per-row sort (the same rows as one np.unique over all keys; sample_test_blocks on
    # amazon-book 5.7 s -> 4.1 s)
    o = np.argsort(cand, axis=1, kind="stable")
    s = np.take_along_axis(cand, o, axis=1)
    first_sorted = np.ones(s.shape, dtype=np.bool_)
    np.not_equal(s[:, 1:], s[:, :-1], out=first_sorted[:, 1:])
    first = np.empty_like(first_sorted)
    np.put_along_axis(first, o, first_sorted, axis=1)
    return first


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


def _expected_rows(greater: IntArray, tied: IntArray, k: int) -> tuple[FloatArray, FloatArray]:
    """Each row's exact HR@k / NDCG@k when the positive's offset is uniform on {0, ..., tied}."""
    if k < 1:
        raise ValueError("k must be >= 1")
    gain = 1.0 / np.log2(np.arange(k, dtype=np.float64) + 2.0)
    cum = np.concatenate([[0.0], np.cumsum(gain)])  # cum[m] = sum of gains of ranks < m
    lo = np.minimum(greater, k)
    hi = np.minimum(greater + tied + 1, k)  # ranks greater .. greater+tied, cut at k
    width = (tied + 1).astype(np.float64)
    return (hi - lo) / width, (cum[hi] - cum[lo]) / width


def _expected_hr_ndcg(greater: IntArray, tied: IntArray, k: int) -> tuple[float, float]:
    """Exact mean HR@k / NDCG@k when the positive's offset is uniform on {0, ..., tied}."""
    hr, nd = _expected_rows(greater, tied, k)
    return float(hr.mean()), float(nd.mean())


def expected_hits(scores: npt.ArrayLike, k: int = 10) -> FloatArray:
    """Each candidate block's HR@k, exact in expectation over random ties (positive in column 0): the
    per-row values whose mean `evaluate_candidates` reports, for paired comparisons of two scorers."""
    greater, tied = _tie_counts(_validate_scores(scores))
    return _expected_rows(greater, tied, k)[0]


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


# ----------------------------------------------------------------------------------------------
# The published full-ranking protocol (Recall@k / NDCG@k over all items not in the user's train set)
#
# Invariants of this part:
# - Candidates of user u: every item not in u's train set and not scored -inf.  Relevant items:
#   u's test items that are not in its train set (a test pair repeating a train pair is dropped).
#   Users with no relevant item are not evaluated; every other user counts once (a per-user mean).
# - Recall@k = hits / |relevant| (the LightGCN / KGAT convention, not / min(k, |relevant|));
#   NDCG@k = Σ_hits 1/log2(p+2) over 0-based positions p < k, over the ideal Σ_{p < min(k, |relevant|)}.
# - RANDOM ties: the top k is the first k of a uniformly random order among equal scores (one
#   uniform key per candidate from `np.random.default_rng(seed)`); OPTIMISTIC puts relevant items
#   first among equal scores.  Scores are never perturbed, so no order between unequal scores changes.
# - Vectorised per batch of users: a lower bound on the k-th best score (the k-th largest of
#   per-chunk maxima) keeps only a few candidates per user, which are then sorted exactly.

Scorer = Callable[[IntArray], npt.ArrayLike] | tuple[npt.ArrayLike, npt.ArrayLike]
"""A score function ``f(users) -> (len(users), n_items)`` (any real or integer dtype, higher is
better), or a factor form ``(user_factors, item_factors)`` scored as their float32 inner products."""

_N_CHUNKS = 256  # chunks per row for the k-th-score lower bound (>= k)


@dataclass(frozen=True, slots=True)
class RankingResult:
    """Mean Recall@k and NDCG@k over ``n_users`` users (full ranking over all non-train items).

    ``seed`` is the tie-breaking seed (None for OPTIMISTIC ties).
    """

    recall: float
    ndcg: float
    n_users: int
    k: int
    tie_mode: TieMode
    seed: int | None
    #: Each evaluated user's Recall@k (for paired comparisons), in the order of the evaluated users.
    per_user: FloatArray | None = field(default=None, compare=False, repr=False)

    def metrics(self) -> dict[str, float]:
        """``{"recall@k": ..., "ndcg@k": ...}``, the keys of the ``--json`` metric maps."""
        return {f"recall@{self.k}": self.recall, f"ndcg@{self.k}": self.ndcg}

    def __str__(self) -> str:
        ties = self.tie_mode.value + (f", seed {self.seed}" if self.seed is not None else "")
        return (
            f"Recall@{self.k} {self.recall:.4f}  NDCG@{self.k} {self.ndcg:.4f}  "
            f"(n={self.n_users} users, full ranking, ties={ties})"
        )


class _Factors(NamedTuple):
    X: npt.NDArray[np.float32]  # (n_users, f), C-contiguous
    Yt: npt.NDArray[np.float32]  # (f, n_items), C-contiguous


def _score_batch(scorer: _Factors | ScoreFn, batch: IntArray, n_items: int) -> npt.NDArray[np.floating]:
    """A fresh, writable float32/float64 (len(batch), n_items) score matrix of the batch."""
    if isinstance(scorer, _Factors):
        return np.asarray(scorer.X[batch] @ scorer.Yt, dtype=np.float32)
    raw = np.asarray(scorer(batch))
    if raw.shape != (batch.shape[0], n_items):
        raise ValueError(f"score function returned shape {raw.shape}, expected {(batch.shape[0], n_items)}")
    if raw.dtype.kind in "biu":
        if raw.size and max(abs(int(raw.min())), abs(int(raw.max()))) < 2**24:
            return raw.astype(np.float32, order="C")  # exact: float32 holds every integer below 2**24
        return raw.astype(np.float64, order="C")
    if raw.dtype.kind != "f":
        raise ValueError(f"score function returned dtype {raw.dtype}, expected real or integer scores")
    s: npt.NDArray[np.floating] = raw.astype(np.float64 if raw.dtype == np.float64 else np.float32, order="C")
    if np.isnan(s).any():  # astype always copies: the caller's array is never written
        raise ValueError("score function returned NaN")
    return s


def _prepare_scorer(scorer: Scorer, n_users: int, n_items: int) -> _Factors | ScoreFn:
    if not isinstance(scorer, tuple):
        if not callable(scorer):
            raise ValueError("scorer must be a callable or a (user_factors, item_factors) pair")
        return scorer
    X = np.ascontiguousarray(scorer[0], dtype=np.float32)
    Y = np.asarray(scorer[1], dtype=np.float32)
    if X.ndim != 2 or Y.ndim != 2 or X.shape[1] != Y.shape[1]:
        raise ValueError(f"factors must be (n_users, f) and (n_items, f), got {X.shape} and {Y.shape}")
    if X.shape[0] != n_users or Y.shape[0] != n_items:
        raise ValueError(f"factors cover {X.shape[0]} users x {Y.shape[0]} items, the data {n_users} x {n_items}")
    if not (np.isfinite(X).all() and np.isfinite(Y).all()):
        raise ValueError("factors must be finite")
    return _Factors(X, np.ascontiguousarray(Y.T))


def _kth_lower_bound(S: npt.NDArray[np.floating], k: int) -> npt.NDArray[np.floating]:
    """Per row, a value <= the k-th largest entry: the k-th largest of the maxima of ``_N_CHUNKS``
    column chunks (each of the k best chunks holds an entry >= its maximum)."""
    m = S.shape[1]
    if m <= k:
        return np.full(S.shape[0], -np.inf, dtype=S.dtype)
    n_chunks = min(m, max(_N_CHUNKS, 4 * k))
    starts = (np.arange(n_chunks, dtype=np.int64) * m) // n_chunks
    maxima = np.maximum.reduceat(S, starts, axis=1)
    return np.partition(maxima, n_chunks - k, axis=1)[:, n_chunks - k]


def _top_k(
    S: npt.NDArray[np.floating],
    k: int,
    relevant_key: Callable[[IntArray, IntArray], npt.NDArray[np.bool_]],
    tie_mode: TieMode,
    rng: np.random.Generator | None,
) -> tuple[IntArray, IntArray, npt.NDArray[np.bool_]]:
    """(row, 0-based position, is relevant) of every top-k entry of each row of S (-inf = excluded)."""
    bound = _kth_lower_bound(S, k)
    flat = np.flatnonzero(S >= bound[:, None])  # 1-D flatnonzero is ~30x faster than 2-D nonzero
    vals = S.reshape(-1)[flat]
    keep = vals > -np.inf
    flat, vals = flat[keep], vals[keep]
    rows, cols = np.divmod(flat, S.shape[1])
    rel = relevant_key(rows, cols)
    if tie_mode is TieMode.OPTIMISTIC:
        order = np.lexsort((cols, ~rel, -vals, rows))
    elif rng is not None:
        keys = np.asarray(rng.random(size=rows.shape[0]), dtype=np.float64)
        order = np.lexsort((keys, -vals, rows))
    else:
        raise ValueError("TieMode.RANDOM needs an rng")
    rows, rel = rows[order], rel[order]
    first = np.searchsorted(rows, rows, side="left")
    pos = np.arange(rows.shape[0], dtype=np.int64) - first
    top = pos < k
    return rows[top], pos[top], rel[top]


def evaluate_all_items(
    scorer: Scorer,
    train: Ratings,
    test: Ratings,
    *,
    k: int = 20,
    tie_mode: TieMode = TieMode.RANDOM,
    seed: int | np.random.Generator = 0,
    batch_size: int = 512,
    users: npt.ArrayLike | None = None,
) -> RankingResult:
    """Recall@k and NDCG@k, each user ranking every item not in its train set (the published
    amazon-book protocol of KGAT / LightGCN), averaged over users with at least one test item.

    Parameters
    ----------
    scorer : callable or (user_factors, item_factors)
        ``f(users) -> (len(users), n_items)`` scores (float or integer, e.g. ``f - hamming``),
        higher is better; an item scored ``-inf`` is never recommended.  Or a factor pair
        ``(X (n_users, f), Y (n_items, f))`` scored as ``X[u] @ Y.T`` in float32.
    train, test : Ratings
        One id space.  Train items are excluded from each user's candidates; test items are relevant.
    k : int
        Cut-off (20 in the published protocol).
    tie_mode : TieMode
        RANDOM (default): equal scores in uniformly random order, seeded; OPTIMISTIC: relevant
        items first among equal scores (an upper bound, for comparison only).
    seed : int or np.random.Generator
        Tie-breaking randomness for RANDOM; equal seeds give equal results.
    batch_size : int
        Users scored per call (memory is about ``batch_size * n_items * 4`` bytes per copy).
    users : array_like of int, optional
        Evaluate only these users (e.g. a subsample); default every user with a test item.

    Returns
    -------
    RankingResult

    Raises
    ------
    ValueError
        Mismatched id spaces, no user to evaluate, ``k < 1``, bad scores (shape, dtype, NaN).
    """
    if (train.n_users, train.n_items) != (test.n_users, test.n_items):
        raise ValueError("train and test must share one id space")
    if k < 1 or batch_size < 1:
        raise ValueError("k and batch_size must be >= 1")
    n_users, n_items = train.n_users, train.n_items
    score = _prepare_scorer(scorer, n_users, n_items)
    rng = None
    if tie_mode is TieMode.RANDOM:
        rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    train_keys = _unique_sorted(train.users * n_items + train.items)
    rel_keys = _unique_sorted(test.users * n_items + test.items)
    rel_keys = rel_keys[~_is_member(train_keys, rel_keys)]
    n_rel = np.bincount(rel_keys // max(n_items, 1), minlength=n_users)
    targets = _target_users(n_rel, users)
    tr_indptr = np.zeros(n_users + 1, dtype=np.int64)
    np.cumsum(np.bincount(train_keys // max(n_items, 1), minlength=n_users), out=tr_indptr[1:])
    tr_items = train_keys % max(n_items, 1)
    gain = 1.0 / np.log2(np.arange(k, dtype=np.float64) + 2.0)
    ideal = np.concatenate([[0.0], np.cumsum(gain)])
    hits, dcg = _hits_and_dcg(score, targets, (tr_indptr, tr_items), rel_keys, n_items, gain, tie_mode, rng, batch_size)
    n = n_rel[targets]
    recall = hits / n
    nd = dcg / ideal[np.minimum(n, k)]
    used_seed = None if rng is None else (seed if isinstance(seed, int) else -1)
    return RankingResult(
        float(recall.mean()), float(nd.mean()), int(targets.size), k, tie_mode, used_seed, per_user=recall
    )


def _target_users(n_rel: IntArray, users: npt.ArrayLike | None) -> IntArray:
    """Users with a relevant test item, restricted to ``users`` if given; raises if none is left."""
    n_users = n_rel.shape[0]
    targets = np.flatnonzero(n_rel)
    if users is not None:
        want = np.asarray(users, dtype=np.int64)
        if want.ndim != 1 or (want.size and (want.min() < 0 or want.max() >= n_users)):
            raise ValueError(f"users must be a 1-D array of user indices in [0, {n_users})")
        targets = np.intersect1d(targets, want)
    if targets.size == 0:
        raise ValueError("no user has a test item outside its train set: nothing to evaluate")
    return targets


def _hits_and_dcg(
    score: _Factors | ScoreFn,
    targets: IntArray,
    train_csr: tuple[IntArray, IntArray],
    rel_keys: IntArray,
    n_items: int,
    gain: FloatArray,
    tie_mode: TieMode,
    rng: np.random.Generator | None,
    batch_size: int,
) -> tuple[IntArray, FloatArray]:
    """Relevant items in the top k (k = len(gain)) of each target user, train items excluded, and
    their DCG@k; users scored ``batch_size`` at a time."""
    tr_indptr, tr_items = train_csr
    k = gain.shape[0]
    hits = np.zeros(targets.shape[0], dtype=np.int64)
    dcg = np.zeros(targets.shape[0], dtype=np.float64)
    for start in range(0, targets.shape[0], batch_size):  # loop over user batches
        batch = targets[start : start + batch_size]
        S = _score_batch(score, batch, n_items)
        lo, hi = tr_indptr[batch], tr_indptr[batch + 1]
        counts = hi - lo
        seen_rows = np.repeat(np.arange(batch.shape[0]), counts)
        seen_at = np.repeat(lo - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
        S[seen_rows, tr_items[seen_at]] = -np.inf

        def relevant(r: IntArray, c: IntArray, b: IntArray = batch) -> npt.NDArray[np.bool_]:
            return _is_member(rel_keys, b[r] * n_items + c)

        rows, pos, rel = _top_k(S, k, relevant, tie_mode, rng)
        hits[start : start + batch.shape[0]] = np.bincount(rows[rel], minlength=batch.shape[0])
        dcg[start : start + batch.shape[0]] = np.bincount(rows[rel], weights=gain[pos[rel]], minlength=batch.shape[0])
    return hits, dcg


def hamming_scorer(user_words: npt.ArrayLike, item_words: npt.ArrayLike, bits: int) -> ScoreFn:
    """Score function of packed ±1 codes: ``bits - hamming(b_u, d_i)`` as int16 (ties are common).

    Parameters
    ----------
    user_words, item_words : array_like of uint64, shape (W, n_users) / (W, n_items)
        Word-major codes as `protocol.codes.pack_signs` packs them (W = ceil(bits / 64)).
    bits : int
        Code length f; scores lie in [0, f].

    Raises
    ------
    ValueError
        Mismatched word counts or dtypes.
    """
    Uw, Vw = np.asarray(user_words), np.asarray(item_words)
    if Uw.dtype != np.uint64 or Vw.dtype != np.uint64 or Uw.ndim != 2 or Vw.ndim != 2 or Uw.shape[0] != Vw.shape[0]:
        raise ValueError("user_words and item_words must be word-major uint64 arrays (W, n) with one W")
    U, V = np.ascontiguousarray(Uw.T), np.ascontiguousarray(Vw.T)  # code-major for row gathers
    if not 1 <= bits <= 64 * U.shape[1]:
        raise ValueError(f"bits must be in [1, {64 * U.shape[1]}], got {bits}")

    def score(users: IntArray) -> npt.NDArray[np.int16]:
        out = np.empty((users.shape[0], V.shape[0]), dtype=np.int16)
        for start in range(0, users.shape[0], 64):  # bounded temporaries: 64 users x items x W words
            u = U[users[start : start + 64]]
            dist = np.bitwise_count(u[:, None, :] ^ V[None, :, :]).sum(axis=2, dtype=np.int16)
            np.subtract(bits, dist, out=out[start : start + 64])
        return out

    return score


def popularity_scorer(train: Ratings) -> ScoreFn:
    """Item popularity baseline as a score function: each item's training count, equal for every user."""
    pop = popularity_scores(train).astype(np.float32)
    return lambda users: np.broadcast_to(pop, (np.asarray(users).shape[0], pop.shape[0]))


def random_scorer(n_items: int, seed: int | np.random.Generator = 0) -> ScoreFn:
    """Random baseline as a score function: i.i.d. uniform integer scores in [0, 2**16) from one seeded
    generator.  With random tie-breaking the order they induce is uniformly random; integers are
    drawn because float draws cost 7x more (65 s vs 10 s over amazon-book's 1.8e9 user-item pairs)."""
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    return lambda users: rng.integers(0, 2**16, size=(np.asarray(users).shape[0], n_items), dtype=np.uint16)


# ----------------------------------------------------------------------------------------------
# The sampled protocol on a train/test split: one random test item per user among sampled negatives


def sample_test_blocks(
    train: Ratings, test: Ratings, n_negatives: int = 99, seed: int | np.random.Generator = 0
) -> tuple[IntArray, IntArray]:
    """One candidate block per user with a test item: a uniformly random test item of the user
    (column 0) and ``n_negatives`` items the user has in neither train nor test.

    Parameters
    ----------
    train, test : Ratings
        One id space (e.g. amazon-book's own split).
    n_negatives : int
        Negatives per block (99 as in NCF).
    seed : int or np.random.Generator
        Chooses the test item and the negatives; equal seeds give equal blocks.

    Returns
    -------
    (users, candidates) : ndarray of int64, shapes (n,) and (n, 1 + n_negatives)
        Users in increasing order.

    Raises
    ------
    ValueError
        Mismatched id spaces, no test item, or a user with too few items to sample from.
    """
    if (train.n_users, train.n_items) != (test.n_users, test.n_items):
        raise ValueError("train and test must share one id space")
    if len(test) == 0:
        raise ValueError("test is empty: nothing to sample")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    n_items = test.n_items
    keys = _unique_sorted(test.users * n_items + test.items)
    owners = keys // n_items
    users = _unique_sorted(owners)
    first = np.searchsorted(owners, users, side="left")
    count = np.searchsorted(owners, users, side="right") - first
    pick = first + (rng.random(users.shape[0]) * count).astype(np.int64)
    positives = keys[pick] - users * n_items
    inter = interaction_csr(train, test)
    return users, sample_negatives(n_items, users, positives, inter, n_negatives, rng)


def evaluate_sampled(
    scorer: Scorer,
    users: npt.ArrayLike,
    candidates: npt.ArrayLike,
    *,
    k: int = 10,
    tie_mode: TieMode = TieMode.RANDOM,
    rng: np.random.Generator | None = None,
    batch_size: int = 512,
) -> EvalResult:
    """HR@k / NDCG@k of candidate blocks (positive in column 0) scored by a `Scorer`.

    Parameters
    ----------
    scorer : callable or (user_factors, item_factors)
        As in `evaluate_all_items`.
    users, candidates : array_like of int
        From `sample_test_blocks` (or any blocks): ``candidates[j]`` are the items user ``users[j]`` ranks.
    k, tie_mode, rng
        As in `evaluate_candidates` (RANDOM without rng = exact expectation over tie-breaking).
    batch_size : int
        Users scored per call of a score function.

    Raises
    ------
    ValueError
        Bad shapes or scores.
    """
    u = np.asarray(users, dtype=np.int64)
    cand = np.asarray(candidates, dtype=np.int64)
    if u.ndim != 1 or cand.ndim != 2 or cand.shape[0] != u.shape[0]:
        raise ValueError("users must be (n,) and candidates (n, C)")
    if isinstance(scorer, tuple):
        X = np.asarray(scorer[0], dtype=np.float32)
        Y = np.asarray(scorer[1], dtype=np.float32)
        if X.ndim != 2 or Y.ndim != 2 or X.shape[1] != Y.shape[1]:
            raise ValueError(f"factors must be (n_users, f) and (n_items, f), got {X.shape} and {Y.shape}")
        scores = np.empty(cand.shape, dtype=np.float64)
        for start in range(0, u.shape[0], 1024):  # batched float32 matmul; einsum is ~50x slower
            sl = slice(start, start + 1024)
            scores[sl] = np.matmul(Y[cand[sl]], X[u[sl], :, None])[..., 0]
    else:
        scores = np.empty(cand.shape, dtype=np.float64)
        for start in range(0, u.shape[0], batch_size):  # loop over user batches
            sl = slice(start, start + batch_size)
            full = np.asarray(scorer(u[sl]))
            if full.ndim != 2 or full.shape[0] != u[sl].shape[0]:
                raise ValueError(f"score function returned shape {full.shape} for {u[sl].shape[0]} users")
            scores[sl] = np.take_along_axis(full, cand[sl], axis=1)
    return evaluate_candidates(scores, k, tie_mode, rng)
