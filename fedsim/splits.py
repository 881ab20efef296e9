# Invariants of this module:
# - Every split returns (train, val, test) `Ratings` in the SAME id space as the input (same n_users,
#   n_items, user_ids, item_ids); together they hold every input row exactly once.
# - "Later" means larger timestamp; ties (and logs without timestamps) fall back to file order, so a
#   split is a pure function of the input (no randomness).
# - Vectorised: one lexsort by (user, timestamp, row), ranks within a user from the CSR indptr.
"""Per-user train / validation / test splits of a rating log."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from fedsim.datasets import Ratings

__all__ = ["Split", "chronological_split", "leave_one_out", "split_counts"]

IntArray = npt.NDArray[np.int64]


class Split(NamedTuple):
    """Train, validation and test parts of one rating log (a tuple, so ``a, b, c = split`` works)."""

    train: Ratings
    val: Ratings
    test: Ratings


def _recency(ratings: Ratings) -> tuple[IntArray, IntArray]:
    """For each row: its user's rating count, and its position from the end in that user's history
    (0 = latest), ordered by (timestamp, file row)."""
    n = len(ratings)
    row = np.arange(n, dtype=np.int64)
    if ratings.timestamps is None:
        order = np.lexsort((row, ratings.users))
    else:
        order = np.lexsort((row, ratings.timestamps, ratings.users))
    counts = np.bincount(ratings.users, minlength=ratings.n_users).astype(np.int64)
    indptr = np.zeros(ratings.n_users + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    sorted_users = ratings.users[order]
    rank = row - indptr[sorted_users]  # 0 = earliest within the user
    from_end = np.empty(n, dtype=np.int64)
    from_end[order] = counts[sorted_users] - 1 - rank
    return counts[ratings.users], from_end


def _assemble(ratings: Ratings, part: npt.NDArray[np.int8]) -> Split:
    base = ratings.name
    return Split(
        ratings.subset(part == 0, name=f"{base}[train]"),
        ratings.subset(part == 1, name=f"{base}[val]"),
        ratings.subset(part == 2, name=f"{base}[test]"),
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


def chronological_split(ratings: Ratings, fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)) -> Split:
    """Split each user's history in time order: earliest ratings train, then validation, latest test.

    Part sizes per user follow `split_counts` (round half up for val and test, train keeps the rest
    and at least one rating).  Without timestamps, file order is time order; equal timestamps keep
    file order.

    Parameters
    ----------
    ratings : Ratings
        The log to split.
    fractions : (float, float, float)
        Train, validation, test fractions: non-negative, summing to 1, train > 0.

    Returns
    -------
    Split
        ``(train, val, test)`` in the input's id space.

    Raises
    ------
    ValueError
        If the fractions are invalid.
    """
    if len(fractions) != 3 or min(fractions) < 0 or fractions[0] <= 0 or abs(sum(fractions) - 1) > 1e-9:
        raise ValueError(f"fractions must be 3 non-negative numbers summing to 1 with train > 0: {fractions}")
    count, from_end = _recency(ratings)
    sizes = split_counts(np.arange(int(count.max(initial=0)) + 1), fractions)
    n_val, n_test = sizes[count, 1], sizes[count, 2]
    part = np.zeros(len(ratings), dtype=np.int8)
    part[from_end < n_test + n_val] = 1
    part[from_end < n_test] = 2
    return _assemble(ratings, part)


def leave_one_out(ratings: Ratings, validation: bool = True) -> Split:
    """Hold out each user's latest rating for test and (optionally) the second latest for validation.

    A user with one rating keeps it in train; with two, one train and one test; validation is taken
    only from users with at least three ratings.  Order is by timestamp, ties and missing timestamps
    by file order.

    Parameters
    ----------
    ratings : Ratings
        The log to split.
    validation : bool
        Also hold out a validation rating; if False, ``val`` is empty.

    Returns
    -------
    Split
        ``(train, val, test)`` in the input's id space.
    """
    count, from_end = _recency(ratings)
    part = np.zeros(len(ratings), dtype=np.int8)
    part[(from_end == 0) & (count >= 2)] = 2
    if validation:
        part[(from_end == 1) & (count >= 3)] = 1
    return _assemble(ratings, part)
