# Invariants of this module:
# - Every split returns (train, val, test) `Ratings` in the SAME id space as the input (same n_users,
#   n_items, user_ids, item_ids); together they hold every input row exactly once.
# - "Later" means larger timestamp, ties by file order.  A log WITHOUT timestamps has no "later":
#   its order is a seeded random permutation (`np.random.default_rng(seed)`), so held-out ratings
#   are a random sample of each user's, never silently the last lines of the file.  ``seed=None``
#   asks for file order explicitly.  Every part's ``meta["holdout"]`` says which rule was used.
# - Vectorised: one lexsort by (user, timestamp or random key, row), ranks from the CSR indptr.
"""Per-user train / validation / test splits of a rating log."""

from __future__ import annotations

from types import MappingProxyType
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from fedsim.data.ratings import Ratings

__all__ = ["Split", "chronological_split", "leave_one_out", "split_counts", "carve_validation", "holdout_rule"]

IntArray = npt.NDArray[np.int64]
Seed = int | np.random.Generator | None


class Split(NamedTuple):
    """Train, validation and test parts of one rating log (a tuple, so ``a, b, c = split`` works)."""

    train: Ratings
    val: Ratings
    test: Ratings


def holdout_rule(ratings: Ratings, seed: Seed) -> str:
    """How a split of ``ratings`` picks held-out ratings (the text stored in ``meta["holdout"]``)."""
    if ratings.timestamps is not None:
        return "latest by timestamp"
    if seed is None:
        return "last lines of the file (no timestamps; file order taken as time order)"
    label = f"seed {seed}" if isinstance(seed, int) else "seeded"
    return f"uniformly random (no timestamps; {label})"


def _recency(ratings: Ratings, seed: Seed = None) -> tuple[IntArray, IntArray]:
    """For each row: its user's rating count, and its position from the end in that user's history
    (0 = latest), ordered by (timestamp, file row); without timestamps by a seeded random key (file
    order when ``seed`` is None)."""
    n = len(ratings)
    row = np.arange(n, dtype=np.int64)
    if ratings.timestamps is not None:
        order = np.lexsort((row, ratings.timestamps, ratings.users))
    elif seed is None:
        order = np.lexsort((row, ratings.users))
    else:
        rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
        order = np.lexsort((rng.permutation(n), ratings.users))
    counts = np.bincount(ratings.users, minlength=ratings.n_users).astype(np.int64)
    indptr = np.zeros(ratings.n_users + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    sorted_users = ratings.users[order]
    rank = row - indptr[sorted_users]  # 0 = earliest within the user
    from_end = np.empty(n, dtype=np.int64)
    from_end[order] = counts[sorted_users] - 1 - rank
    return counts[ratings.users], from_end


def _with_rule(part: Ratings, rule: str) -> Ratings:
    return Ratings(
        users=part.users,
        items=part.items,
        ratings=part.ratings,
        timestamps=part.timestamps,
        n_users=part.n_users,
        n_items=part.n_items,
        user_ids=part.user_ids,
        item_ids=part.item_ids,
        name=part.name,
        meta=MappingProxyType(dict(part.meta) | {"holdout": rule}),
    )


def _assemble(ratings: Ratings, part: npt.NDArray[np.int8], rule: str) -> Split:
    base = ratings.name
    return Split(
        _with_rule(ratings.subset(part == 0, name=f"{base}[train]"), rule),
        _with_rule(ratings.subset(part == 1, name=f"{base}[val]"), rule),
        _with_rule(ratings.subset(part == 2, name=f"{base}[test]"), rule),
    )


def split_counts(n: npt.ArrayLike, fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)) -> IntArray:
    """Per-user sizes of the (train, val, test) parts used by `chronological_split`.

    ``test = round_half_up(n * f_test)`` and ``val = round_half_up(n * f_val)``; train gets the rest.
    If that leaves no training rating, validation then test give one back, so every user with at
    least one rating keeps at least one in train.  With 80/10/10: n = 1..4 -> all train;
    n = 5 -> (3, 1, 1); n = 10 -> (8, 1, 1); n = 15 -> (11, 2, 2); n = 25 -> (19, 3, 3).

    Parameters
    ----------
    n : array_like of int
        Ratings per user.
    fractions : (float, float, float)
        Train, validation and test fractions (validated by `chronological_split`).

    Returns
    -------
    ndarray of int64, shape (len(n), 3)
    """
    counts = np.asarray(n, dtype=np.int64)
    _, f_val, f_test = fractions
    # + 1e-9 so that e.g. 5 * 0.1 = 0.5 rounds up despite binary floating point
    n_test = np.floor(counts * f_test + 0.5 + 1e-9).astype(np.int64)
    n_val = np.floor(counts * f_val + 0.5 + 1e-9).astype(np.int64)
    over = np.maximum(n_test + n_val - (counts - 1), 0) * (counts > 0)
    give_val = np.minimum(over, n_val)
    n_val -= give_val
    n_test -= over - give_val
    n_test = np.maximum(n_test, 0)
    return np.stack([counts - n_val - n_test, n_val, n_test], axis=-1)


def chronological_split(
    ratings: Ratings, fractions: tuple[float, float, float] = (0.8, 0.1, 0.1), *, seed: Seed = 0
) -> Split:
    """Split each user's history in time order: earliest ratings train, then validation, latest test.

    Part sizes per user follow `split_counts` (round half up for val and test, train keeps the rest
    and at least one rating).  Equal timestamps keep file order.  Without timestamps the parts are
    a seeded uniformly random split of each user's ratings (``seed=None``: file order as time order).

    Parameters
    ----------
    ratings : Ratings
        The log to split.
    fractions : (float, float, float)
        Train, validation, test fractions: non-negative, summing to 1, train > 0.
    seed : int, np.random.Generator or None
        Order of a log without timestamps (ignored when it has timestamps).

    Returns
    -------
    Split
        ``(train, val, test)`` in the input's id space; each part's ``meta["holdout"]`` names the rule.

    Raises
    ------
    ValueError
        If the fractions are invalid.
    """
    if len(fractions) != 3 or min(fractions) < 0 or fractions[0] <= 0 or abs(sum(fractions) - 1) > 1e-9:
        raise ValueError(f"fractions must be 3 non-negative numbers summing to 1 with train > 0: {fractions}")
    count, from_end = _recency(ratings, seed)
    sizes = split_counts(np.arange(int(count.max(initial=0)) + 1), fractions)
    n_val, n_test = sizes[count, 1], sizes[count, 2]
    part = np.zeros(len(ratings), dtype=np.int8)
    part[from_end < n_test + n_val] = 1
    part[from_end < n_test] = 2
    return _assemble(ratings, part, holdout_rule(ratings, seed))


def leave_one_out(ratings: Ratings, validation: bool = True, *, seed: Seed = 0) -> Split:
    """Hold out each user's latest rating for test and (optionally) the second latest for validation.

    A user with one rating keeps it in train; with two, one train and one test; validation is taken
    only from users with at least three ratings.  Order is by timestamp, ties by file order.  A log
    without timestamps has no latest rating: a seeded uniformly random rating of each user is held
    out for test (and another for validation); ``seed=None`` takes the last lines of the file instead.

    Parameters
    ----------
    ratings : Ratings
        The log to split.
    validation : bool
        Also hold out a validation rating; if False, ``val`` is empty.
    seed : int, np.random.Generator or None
        Which ratings a log without timestamps holds out (ignored when it has timestamps).

    Returns
    -------
    Split
        ``(train, val, test)`` in the input's id space; each part's ``meta["holdout"]`` names the rule.
    """
    count, from_end = _recency(ratings, seed)
    part = np.zeros(len(ratings), dtype=np.int8)
    part[(from_end == 0) & (count >= 2)] = 2
    if validation:
        part[(from_end == 1) & (count >= 3)] = 1
    return _assemble(ratings, part, holdout_rule(ratings, seed))


def carve_validation(
    train: Ratings, fraction: float = 0.1, *, seed: int | np.random.Generator = 0
) -> tuple[Ratings, Ratings]:
    """Carve a validation part out of a training log: a seeded random ``fraction`` of each user's
    ratings (rounded half up), every user keeping at least one rating in train.

    For datasets that come with their own train/test split (amazon-book): choose hyper-parameters
    on ``(fit, val)``, then refit on the whole train and report the test split once.

    Parameters
    ----------
    train : Ratings
        The log to split (timestamps are ignored: the choice is random).
    fraction : float
        Share of each user's ratings moved to validation, in (0, 1).
    seed : int or np.random.Generator
        Equal seeds give equal parts.

    Returns
    -------
    (fit, val) : Ratings
        In the input's id space; together they hold every row of ``train`` once.

    Raises
    ------
    ValueError
        If ``fraction`` is not in (0, 1).
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction must be in (0, 1), got {fraction}")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    n = len(train)
    row = np.arange(n, dtype=np.int64)
    order = np.lexsort((rng.permutation(n), train.users))
    counts = np.bincount(train.users, minlength=train.n_users).astype(np.int64)
    indptr = np.zeros(train.n_users + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    sorted_users = train.users[order]
    rank = np.empty(n, dtype=np.int64)
    rank[order] = row - indptr[sorted_users]
    n_val = np.minimum(np.floor(counts * fraction + 0.5 + 1e-9).astype(np.int64), np.maximum(counts - 1, 0))
    is_val = rank < n_val[train.users]
    label = f"seed {seed}" if isinstance(seed, int) else "seeded"
    rule = f"validation carved from train: random {fraction:g} of each user's ratings ({label})"
    base = train.name
    return (
        _with_rule(train.subset(~is_val, name=f"{base}[fit]"), rule),
        _with_rule(train.subset(is_val, name=f"{base}[val]"), rule),
    )
