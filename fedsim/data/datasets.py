# Invariants of this module:
# - A `Ratings` holds parallel arrays of one length: `users`/`items` are int64 dense indices in
#   [0, n_users) / [0, n_items); `ratings` is finite float64; `timestamps` is int64 or None.
#   `user_ids[u]` / `item_ids[i]` give the raw id of dense index u / i.  Arrays are read-only views.
# - Dense ids are assigned in ascending raw-id order (`np.unique`), so a file always maps the same way.
# - Row order is file order (after de-duplication, which keeps the surviving rows in file order).
# - Loaders never raise on the first bad line: they collect every malformed line and raise ONE
#   `DatasetError` naming the file, up to `_MAX_REPORTED` lines with their reasons, and the total.
# - Randomness only through an explicit `np.random.default_rng(seed)`; no global state.
"""Rating datasets for fedsim: the `Ratings` container, file loaders and a synthetic generator."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from protocol.errors import DatasetError

__all__ = [
    "Ratings",
    "UserIndex",
    "CandidateBlocks",
    "LightFRSplit",
    "TrainTestSplit",
    "load_movielens",
    "load_filmtrust",
    "load_generic",
    "load_lightfr_split",
    "load_kgat",
    "load_amazon_book",
    "synthetic",
    "find_data_dir",
    "load_dataset",
    "DATASET_NAMES",
]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

_MAX_REPORTED = 20
LIGHTFR_BLOCK = 50
DATASET_NAMES = ("ml-100k", "filmtrust", "filmtrust-lightfr", "amazon-book", "synthetic")
AMAZON_BOOK_DIR = "amazon-book-kgat"


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


# ----------------------------------------------------------------------------------------------
# Parsing


class _Problems:
    """Collects the malformed lines of one file (several reasons per line allowed) and raises them
    together as one `DatasetError`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.by_line: dict[int, list[str]] = {}

    def add(self, line_nos: npt.NDArray[np.int64], reason: str | list[str]) -> None:
        reasons = [reason] * len(line_nos) if isinstance(reason, str) else reason
        for ln, why in zip(line_nos.tolist(), reasons, strict=True):  # error path only
            self.by_line.setdefault(ln, []).append(why)

    def raise_if_any(self) -> None:
        if not self.by_line:
            return
        lines = sorted(self.by_line)
        total = len(lines)
        shown = "\n".join(f"  {self.path}:{ln}: {'; '.join(self.by_line[ln])}" for ln in lines[:_MAX_REPORTED])
        more = f"\n  ... and {total - _MAX_REPORTED} more" if total > _MAX_REPORTED else ""
        raise DatasetError(f"{self.path}: {total} malformed line(s):\n{shown}{more}")


def _read_bytes(path: Path) -> bytes:
    """A data file's bytes, or one `DatasetError` naming the file and why it cannot be read."""
    if not path.exists():
        raise DatasetError(f"{path}: file not found")
    if not path.is_file():
        raise DatasetError(f"{path}: not a regular file")
    try:
        return path.read_bytes()
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read ({exc.strerror})") from exc


def _read_lines(path: Path) -> list[str]:
    raw = _read_bytes(path)
    nul = raw.find(b"\x00", 0, 1 << 16)
    if nul >= 0:
        raise DatasetError(
            f"{path}: binary content (a NUL byte at offset {nul}), not a text ratings file; expected lines "
            "of 'user item rating [timestamp]' (compressed? unpack it first)"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")  # never fails; bad bytes then show up as non-numeric fields
    # split on "\n" only (str.splitlines also splits on \x0b, \x1c ... and would shift line numbers)
    return text.split("\n")


def _detect_sep(line: str) -> str | None:
    if "\t" in line:
        return "\t"
    if "::" in line:
        return "::"
    if "," in line:
        return ","
    return None


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def _to_int(col: npt.NDArray[np.str_]) -> tuple[IntArray, npt.NDArray[np.bool_]]:
    """Vectorised int conversion; only when it fails, find the bad entries one by one."""
    try:
        return col.astype(np.int64), np.zeros(col.shape[0], dtype=np.bool_)
    except (ValueError, OverflowError):
        pass
    vals = np.zeros(col.shape[0], dtype=np.int64)
    bad = np.zeros(col.shape[0], dtype=np.bool_)
    for j, s in enumerate(col):  # error path only
        try:
            vals[j] = np.asarray(s).astype(np.int64)
        except (ValueError, OverflowError):
            bad[j] = True
    return vals, bad


def _to_float(col: npt.NDArray[np.str_]) -> tuple[FloatArray, npt.NDArray[np.bool_]]:
    try:
        return col.astype(np.float64), np.zeros(col.shape[0], dtype=np.bool_)
    except ValueError:
        pass
    vals = np.zeros(col.shape[0], dtype=np.float64)
    bad = np.zeros(col.shape[0], dtype=np.bool_)
    for j, s in enumerate(col):  # error path only
        try:
            vals[j] = np.asarray(s).astype(np.float64)
        except ValueError:
            bad[j] = True
    return vals, bad


class _Parsed(NamedTuple):
    line_nos: IntArray
    users: IntArray
    items: IntArray
    ratings: FloatArray
    timestamps: IntArray | None


def _value_checks(
    users: IntArray,
    items: IntArray,
    ratings: FloatArray,
    rating_range: tuple[float, float] | None,
    bad: tuple[npt.NDArray[np.bool_], ...] | None = None,
) -> list[tuple[npt.NDArray[np.bool_], str]]:
    """Masks of rows with bad values, each with its reason (``bad``: unparsable u, i, r, ts)."""
    none = np.zeros(users.shape[0], dtype=np.bool_)
    bad_u, bad_i, bad_r, bad_t = bad if bad is not None else (none, none, none, none)
    finite = np.isfinite(ratings)
    checks = [
        (bad_u, "user id is not an integer"),
        (~bad_u & (users < 0), "negative user id"),
        (bad_i, "item id is not an integer"),
        (~bad_i & (items < 0), "negative item id"),
        (bad_r, "rating is not a number"),
        (~bad_r & ~finite, "rating is NaN or infinite"),
        (bad_t, "timestamp is not an integer"),
    ]
    if rating_range is not None:
        lo, hi = rating_range
        checks.append((~bad_r & finite & ((ratings < lo) | (ratings > hi)), f"rating outside [{lo:g}, {hi:g}]"))
    return [(mask, why) for mask, why in checks if mask.any()]


def _fast_parse(
    lines: list[str], sep: str | None, width: int, rating_range: tuple[float, float] | None
) -> tuple[IntArray, FloatArray] | None:
    """numpy's C parser for the common case of a clean file; None means "take the slow path", which
    is the authority and finds every problem."""
    if sep == "::":
        lines = [ln.replace("::", "\t") for ln in lines]
        sep = "\t"
    int_cols = (0, 1, 3) if width == 4 else (0, 1)
    try:
        floats = np.loadtxt(lines, delimiter=sep, dtype=np.float64, comments=None, ndmin=2)
        ints = np.loadtxt(lines, delimiter=sep, dtype=np.int64, comments=None, ndmin=2, usecols=int_cols)
    except ValueError:
        return None
    if floats.shape != (len(lines), width):
        return None
    ratings = floats[:, 2].copy()
    if _value_checks(ints[:, 0], ints[:, 1], ratings, rating_range):
        return None
    return ints, ratings


def _parse(
    path: Path,
    *,
    sep: str | None,
    n_fields: tuple[int, ...],
    rating_range: tuple[float, float] | None = None,
    allow_comments: bool = True,
    allow_header: bool = True,
) -> _Parsed:
    """Parse ``user item rating [timestamp]`` lines, reporting every malformed line at once."""
    lines = _read_lines(path)
    stripped = [ln.strip() for ln in lines]
    keep = [j for j, s in enumerate(stripped) if s and not (allow_comments and s.startswith("#"))]
    if not keep:
        raise DatasetError(f"{path}: no data lines (empty file, or only blank/comment lines)")
    if sep is None:
        sep = _detect_sep(stripped[keep[0]])
    # a header is a first line none of whose first three fields is a number (`user,item,rating`)
    if allow_header and not any(_is_number(f.strip()) for f in stripped[keep[0]].split(sep)[:3]):
        keep = keep[1:]
        if not keep:
            raise DatasetError(f"{path}: only a header line, no data lines")
    line_nos = np.asarray(keep, dtype=np.int64) + 1
    data = [stripped[j] for j in keep]
    first_width = len(data[0].split(sep))
    width = first_width if first_width in n_fields else max(n_fields)

    fast = _fast_parse(data, sep, width, rating_range)
    if fast is not None:
        ints, ratings = fast
        ts = ints[:, 2].copy() if width == 4 else None
        return _Parsed(line_nos, ints[:, 0].copy(), ints[:, 1].copy(), ratings, ts)

    # slow path: split every line, report every problem
    problems = _Problems(path)
    rows = [ln.split(sep) for ln in data]
    if sep is not None and sep != "\t" and sep != "::":
        rows = [[f.strip() for f in r] for r in rows]
    counts = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    bad_count = counts != width
    if bad_count.any():
        if len(n_fields) > 1 and first_width in n_fields:
            expected = f"expected {width} fields (as on line {line_nos[0]})"
        else:
            expected = f"expected {' or '.join(map(str, n_fields))} fields"
        idx = np.flatnonzero(bad_count)
        problems.add(line_nos[idx], [f"{expected}, got {counts[j]}" for j in idx.tolist()])
    good = np.flatnonzero(~bad_count)
    table = np.array([rows[j] for j in good.tolist()], dtype=np.str_).reshape(len(good), width)
    ln = line_nos[good]
    users, bad_u = _to_int(table[:, 0])
    items, bad_i = _to_int(table[:, 1])
    ratings, bad_r = _to_float(table[:, 2])
    ts_arr: IntArray | None = None
    bad_t = np.zeros(len(good), dtype=np.bool_)
    if width >= 4:
        ts_arr, bad_t = _to_int(table[:, 3])
    for mask, why in _value_checks(users, items, ratings, rating_range, (bad_u, bad_i, bad_r, bad_t)):
        idx = np.flatnonzero(mask)
        problems.add(ln[idx], [f"{why}: {' | '.join(table[j].tolist())!r}" for j in idx.tolist()])
    problems.raise_if_any()
    return _Parsed(ln, users, items, ratings, ts_arr)


def _densify(raw: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], IntArray]:
    ids, inverse = np.unique(raw, return_inverse=True)
    return ids.astype(np.int64), inverse.astype(np.int64).reshape(-1)


def _last_of_each_pair(users: IntArray, items: IntArray, n_items: int, parsed: _Parsed) -> tuple[IntArray, int, int]:
    """Rows to keep when a user-item pair repeats: the last line of each pair, in file order.

    Also returns the number of exact duplicate lines (same pair, rating and timestamp) and of
    conflicting ones (same pair, different values) that were dropped.
    """
    n = users.shape[0]
    key = users * n_items + items
    order = np.argsort(key, kind="stable")  # equal keys keep file order
    k_sorted = key[order]
    is_last = np.ones(n, dtype=np.bool_)
    np.not_equal(k_sorted[1:], k_sorted[:-1], out=is_last[:-1])
    keep = np.sort(order[is_last])
    if keep.shape[0] == n:
        return keep, 0, 0
    # duplicates are rare: count distinct (pair, rating, timestamp) among the repeated pairs only
    repeated = np.isin(key, k_sorted[~is_last])
    cols = [key[repeated], parsed.ratings[repeated].view(np.int64)]
    if parsed.timestamps is not None:
        cols.append(parsed.timestamps[repeated])
    distinct_lines = np.unique(np.stack(cols, axis=1), axis=0).shape[0]
    distinct_pairs = np.unique(cols[0]).shape[0]
    exact = int(repeated.sum()) - distinct_lines
    return keep, exact, distinct_lines - distinct_pairs


def _to_ratings(
    p: _Parsed, name: str, meta: dict[str, int | str] | None = None, *, deduplicate: bool = False
) -> Ratings:
    user_ids, users = _densify(p.users)
    item_ids, items = _densify(p.items)
    info: dict[str, int | str] = dict(meta or {})
    ratings = p.ratings.astype(np.float64)
    timestamps = p.timestamps
    if deduplicate:
        keep, exact, conflicting = _last_of_each_pair(users, items, int(item_ids.shape[0]), p)
        info |= {"exact_duplicates": exact, "conflicting_duplicates": conflicting}
        if keep.shape[0] != users.shape[0]:
            # every user and item keeps at least one row (its last pair), so the id maps stay dense
            users, items, ratings = users[keep], items[keep], ratings[keep]
            timestamps = None if timestamps is None else timestamps[keep]
    return Ratings(
        users=users,
        items=items,
        ratings=ratings,
        timestamps=timestamps,
        n_users=int(user_ids.shape[0]),
        n_items=int(item_ids.shape[0]),
        user_ids=user_ids,
        item_ids=item_ids,
        name=name,
        meta=MappingProxyType(info),
    )


# ----------------------------------------------------------------------------------------------
# Loaders


def load_movielens(path: str | os.PathLike[str]) -> Ratings:
    """Load MovieLens ML-100K ``u.data`` (tab-separated) or ML-1M ``ratings.dat`` (``::``).

    Parameters
    ----------
    path : path-like
        The file, or the folder holding ``u.data`` or ``ratings.dat``.

    Returns
    -------
    Ratings
        With timestamps; ratings must lie in [1, 5].

    Raises
    ------
    DatasetError
        If the file is missing, empty, or has malformed lines (all are listed).
    """
    p = Path(path)
    if p.is_dir():
        for fname in ("u.data", "ratings.dat"):
            if (p / fname).is_file():
                p = p / fname
                break
        else:
            raise DatasetError(f"{p}: no u.data or ratings.dat in this folder")
    sep = "::" if p.suffix == ".dat" else "\t"
    parsed = _parse(p, sep=sep, n_fields=(4,), rating_range=(1.0, 5.0), allow_comments=False, allow_header=False)
    name = "ml-100k" if p.name == "u.data" else ("ml-1m" if p.name == "ratings.dat" else p.stem)
    return _to_ratings(parsed, name, {"source": str(p)})


def load_filmtrust(path: str | os.PathLike[str]) -> Ratings:
    """Load FilmTrust ``ratings.txt`` (space-separated ``user item rating``, no timestamps).

    Exact duplicate lines are dropped; for a user-item pair listed with different ratings the last
    line wins.  ``meta["exact_duplicates"]`` and ``meta["conflicting_duplicates"]`` count them.

    Parameters
    ----------
    path : path-like
        ``ratings.txt`` or its folder.

    Raises
    ------
    DatasetError
        If the file is missing, empty, or has malformed lines (all are listed).
    """
    p = Path(path)
    if p.is_dir():
        p = p / "ratings.txt"
    parsed = _parse(p, sep=None, n_fields=(3,), rating_range=(0.0, 5.0), allow_header=False)
    return _to_ratings(parsed, "filmtrust", {"source": str(p)}, deduplicate=True)


def load_generic(path: str | os.PathLike[str], sep: str | None = None, *, deduplicate: bool = True) -> Ratings:
    """Load a ``user item rating [timestamp]`` file with integer ids.

    Parameters
    ----------
    path : path-like
        The file.  Blank lines and lines starting with ``#`` are skipped; a first line none of whose
        first three fields is a number is taken as a header (e.g. ``user,item,rating``).
    sep : str, optional
        Field separator; auto-detected from the first data line (tab, ``::``, comma, else whitespace).
    deduplicate : bool
        Drop repeated user-item pairs, keeping the last line (counts in ``meta``).

    Raises
    ------
    DatasetError
        If the file is missing, empty, or has malformed lines (all are listed).
    """
    p = Path(path)
    parsed = _parse(p, sep=sep, n_fields=(3, 4))
    return _to_ratings(parsed, p.stem, {"source": str(p)}, deduplicate=deduplicate)


@dataclass(frozen=True, slots=True, eq=False)
class CandidateBlocks:
    """Per-user ranking blocks: the positive item in column 0, then sampled negatives.

    Attributes
    ----------
    users : ndarray of int64, shape (n_blocks,)
        Dense user index of each block.
    candidates : ndarray of int64, shape (n_blocks, n_candidates)
        Dense item indices; column 0 is the held-out positive.
    positive_ratings : ndarray of float64, shape (n_blocks,)
        Rating of the positive as listed in the file.
    """

    users: IntArray
    candidates: IntArray
    positive_ratings: FloatArray

    def __len__(self) -> int:
        return int(self.users.shape[0])


@dataclass(frozen=True, slots=True, eq=False)
class LightFRSplit:
    """The LightFR authors' FilmTrust split: train ratings plus validation / test candidate blocks,
    all in one dense id space (items seen only in val/test still have an index)."""

    train: Ratings
    val: CandidateBlocks
    test: CandidateBlocks


def _blocks(path: Path, p: _Parsed, users: IntArray, items: IntArray) -> CandidateBlocks:
    n = users.shape[0]
    problems = _Problems(path)
    if n % LIGHTFR_BLOCK:
        raise DatasetError(f"{path}: {n} rows is not a multiple of {LIGHTFR_BLOCK} (one block per user)")
    u = users.reshape(-1, LIGHTFR_BLOCK)
    r = p.ratings.reshape(-1, LIGHTFR_BLOCK)
    ln = p.line_nos.reshape(-1, LIGHTFR_BLOCK)
    mixed = (u != u[:, :1]).any(axis=1)
    problems.add(ln[mixed, 0], f"block of {LIGHTFR_BLOCK} rows mixes users")
    no_pos = r[:, 0] <= 0.0
    problems.add(ln[no_pos, 0], "first row of a block must be the positive (rating > 0)")
    bad_neg = r[:, 1:] != 0.0
    problems.add(ln[:, 1:][bad_neg], "negative candidate must have rating 0.0")
    block_users = u[:, 0]
    counts = np.bincount(block_users)
    dup = counts[block_users] > 1
    problems.add(ln[dup, 0], f"user has more than one block ({LIGHTFR_BLOCK} rows per user expected)")
    problems.raise_if_any()
    return CandidateBlocks(block_users, items.reshape(-1, LIGHTFR_BLOCK), r[:, 0].copy())


def load_lightfr_split(folder: str | os.PathLike[str], prefix: str = "filmtrust") -> LightFRSplit:
    """Load ``{prefix}_{train,val,test}.csv`` as published by the LightFR authors.

    Parameters
    ----------
    folder : path-like
        Folder with the three CSV files (``user_id,item_id,ratings`` with a header).
    prefix : str
        File name prefix.

    Returns
    -------
    LightFRSplit
        ``train`` ratings (already normalised by the authors to about 0.01-1.01) and ``val`` / ``test``
        blocks of 50 candidates per user, positive first; users and items share one dense mapping
        built over all three files.

    Raises
    ------
    DatasetError
        If a file is missing or malformed, or a block breaks the layout (50 rows per user, one user
        per block, positive first with rating > 0, negatives with rating 0.0).
    """
    base = Path(folder)
    paths = [base / f"{prefix}_{part}.csv" for part in ("train", "val", "test")]
    missing = [str(q) for q in paths if not q.is_file()]
    if missing:
        raise DatasetError(f"LightFR split incomplete, missing: {', '.join(missing)}")
    parts = [_parse(q, sep=",", n_fields=(3,)) for q in paths]
    user_ids, users = _densify(np.concatenate([q.users for q in parts]))
    item_ids, items = _densify(np.concatenate([q.items for q in parts]))
    bounds = np.cumsum([0] + [q.users.shape[0] for q in parts])
    sl = [slice(int(bounds[j]), int(bounds[j + 1])) for j in range(3)]
    train = Ratings(
        users=users[sl[0]],
        items=items[sl[0]],
        ratings=parts[0].ratings,
        timestamps=None,
        n_users=int(user_ids.shape[0]),
        n_items=int(item_ids.shape[0]),
        user_ids=user_ids,
        item_ids=item_ids,
        name=f"{prefix}-lightfr[train]",
        meta=MappingProxyType({"source": str(paths[0])}),
    )
    val = _blocks(paths[1], parts[1], users[sl[1]], items[sl[1]])
    test = _blocks(paths[2], parts[2], users[sl[2]], items[sl[2]])
    return LightFRSplit(train, val, test)


# ----------------------------------------------------------------------------------------------
# Implicit feedback with a published train/test split (KGAT format: amazon-book)


@dataclass(frozen=True, slots=True, eq=False)
class TrainTestSplit:
    """A dataset's own train/test split of implicit feedback, both parts in one dense id space.

    Attributes
    ----------
    train, test : Ratings
        User-item pairs (``ratings`` all 1.0, no timestamps); ``test`` never repeats a train pair.
    name : str
        Dataset name, e.g. ``"amazon-book"``.
    """

    train: Ratings
    test: Ratings
    name: str


_MAX_ID_DIGITS = 18  # int64 holds every 18-digit decimal
_POW10 = 10 ** np.arange(_MAX_ID_DIGITS, dtype=np.int64)


class _KgatLines(NamedTuple):
    line_nos: IntArray  # 1-based line number of each user line
    line_users: IntArray  # the user id opening each line
    pair_lines: IntArray  # 1-based line number of each (user, item) pair
    pair_users: IntArray
    pair_items: IntArray


def _line_text(raw: bytes, line_no: int) -> str:
    text = raw.split(b"\n")[line_no - 1].decode("latin-1").strip()  # error path only
    return text if len(text) <= 60 else text[:57] + "..."


def _parse_kgat_file(path: Path) -> _KgatLines:
    """Tokenise ``user item item ...`` lines with numpy over the raw bytes (no Python loop per line).

    Every problem is collected and raised as one `DatasetError`: a character that is not a digit or
    whitespace (signs, decimals, letters), an id of more than 18 digits, a user listed on two lines,
    an item listed twice on one line.
    """
    raw = _read_bytes(path)
    b = np.frombuffer(raw, dtype=np.uint8)
    digit = (b >= 48) & (b <= 57)
    newline = b == 10
    blank = (b == 32) | (b == 9) | (b == 13) | newline
    line_of = np.cumsum(newline) - newline  # 0-based line of each byte; a newline ends its own line
    if not digit.any():
        raise DatasetError(f"{path}: no data lines (empty file, or only blank lines)")
    problems = _Problems(path)
    bad = ~(digit | blank)
    if bad.any():
        lines = np.unique(line_of[bad]) + 1
        problems.add(
            lines,
            [
                f"expected non-negative integer ids separated by spaces: {_line_text(raw, ln)!r}"
                for ln in lines.tolist()
            ],
        )
    # tokens are maximal runs of digits
    prev = np.empty_like(digit)
    prev[0] = False
    prev[1:] = digit[:-1]
    is_start = digit & ~prev
    starts = np.flatnonzero(is_start)
    digit_pos = np.flatnonzero(digit)
    token_of_digit = np.cumsum(is_start)[digit_pos] - 1
    lengths = np.bincount(token_of_digit, minlength=starts.shape[0])
    ends = starts + lengths
    too_long = lengths > _MAX_ID_DIGITS
    if too_long.any():
        problems.add(np.unique(line_of[starts[too_long]]) + 1, f"id longer than {_MAX_ID_DIGITS} digits")
    power = np.minimum(ends[token_of_digit] - 1 - digit_pos, _MAX_ID_DIGITS - 1)
    offsets = np.zeros(starts.shape[0], dtype=np.int64)
    np.cumsum(lengths[:-1], out=offsets[1:])
    values = np.add.reduceat((b[digit_pos] - 48).astype(np.int64) * _POW10[power], offsets)

    token_line = line_of[starts]
    first = np.ones(starts.shape[0], dtype=np.bool_)
    first[1:] = token_line[1:] != token_line[:-1]
    line_users = values[first]
    line_nos = token_line[first] + 1
    owner = np.cumsum(first) - 1  # index of the user line each token belongs to
    pair_lines = (token_line + 1)[~first]
    pair_users = line_users[owner[~first]]
    pair_items = values[~first]

    order = np.argsort(line_users, kind="stable")
    dup_user = np.zeros(line_users.shape[0], dtype=np.bool_)
    dup_user[order[1:]] = line_users[order[1:]] == line_users[order[:-1]]
    if dup_user.any():
        firsts = dict(zip(line_users[order].tolist()[::-1], line_nos[order].tolist()[::-1], strict=True))
        idx = np.flatnonzero(dup_user)
        problems.add(
            line_nos[idx],
            [f"user {line_users[j]} already has a line (line {firsts[int(line_users[j])]})" for j in idx.tolist()],
        )
    # an item repeated on one line: sort the pairs by (line, item)
    o = np.lexsort((pair_items, pair_lines))
    rep = np.flatnonzero((pair_lines[o][1:] == pair_lines[o][:-1]) & (pair_items[o][1:] == pair_items[o][:-1])) + 1
    if rep.size:
        problems.add(pair_lines[o][rep], [f"item {i} listed twice" for i in pair_items[o][rep].tolist()])
    problems.raise_if_any()
    return _KgatLines(line_nos, line_users, pair_lines, pair_users, pair_items)


def load_kgat(folder: str | os.PathLike[str], name: str | None = None) -> TrainTestSplit:
    """Load an implicit-feedback dataset in the KGAT release format (e.g. amazon-book).

    ``train.txt`` and ``test.txt`` hold one line per user: ``user item item ...``, space-separated,
    0-based integer ids (a test line may list no item).  Ids are used as dense indices unchanged:
    ``n_users`` / ``n_items`` are one more than the largest id in either file.

    Parameters
    ----------
    folder : path-like
        Folder with ``train.txt`` and ``test.txt``.
    name : str, optional
        Dataset name (default: the folder name).

    Returns
    -------
    TrainTestSplit
        The files' own split; every rating is 1.0 (implicit), no timestamps.  ``test.meta`` counts
        ``users_without_test`` (train users whose test line is missing or empty).

    Raises
    ------
    DatasetError
        A file missing or empty, or malformed lines (every one named by file and line): non-integer
        or negative ids, a user on two lines, an item twice on a line, a test pair already in train.
    """
    base = Path(folder)
    label = name if name is not None else base.name
    tr_path, te_path = base / "train.txt", base / "test.txt"
    missing = [str(q) for q in (tr_path, te_path) if not q.is_file()]
    if missing:
        raise DatasetError(f"{label}: KGAT-format folder incomplete, missing: {', '.join(missing)}")
    tr, te = _parse_kgat_file(tr_path), _parse_kgat_file(te_path)
    n_users = int(max(tr.line_users.max(), te.line_users.max())) + 1
    n_items = int(max(tr.pair_items.max(initial=-1), te.pair_items.max(initial=-1))) + 1
    if n_users * max(n_items, 1) >= 2**62:
        raise DatasetError(f"{label}: ids too large ({n_users} users x {n_items} items)")
    train_keys = np.sort(tr.pair_users * n_items + tr.pair_items)
    test_keys = te.pair_users * n_items + te.pair_items
    pos = np.minimum(np.searchsorted(train_keys, test_keys), max(train_keys.shape[0] - 1, 0))
    overlap = np.flatnonzero(train_keys[pos] == test_keys) if train_keys.size else np.zeros(0, dtype=np.int64)
    if overlap.size:
        problems = _Problems(te_path)
        problems.add(
            te.pair_lines[overlap],
            [f"item {te.pair_items[j]} of user {te.pair_users[j]} is also in train.txt" for j in overlap.tolist()],
        )
        problems.raise_if_any()
    train_users = np.zeros(n_users, dtype=np.bool_)
    train_users[tr.pair_users] = True
    test_users = np.zeros(n_users, dtype=np.bool_)
    test_users[te.pair_users] = True
    ids_u, ids_i = np.arange(n_users, dtype=np.int64), np.arange(n_items, dtype=np.int64)

    base_meta: dict[str, int | str] = {"implicit": 1}

    def part(p: _KgatLines, which: str, meta: dict[str, int | str]) -> Ratings:
        return Ratings(
            users=p.pair_users,
            items=p.pair_items,
            ratings=np.ones(p.pair_users.shape[0]),
            timestamps=None,
            n_users=n_users,
            n_items=n_items,
            user_ids=ids_u,
            item_ids=ids_i,
            name=f"{label}[{which}]",
            meta=MappingProxyType(base_meta | {"source": str(base / f"{which}.txt")} | meta),
        )

    return TrainTestSplit(
        train=part(tr, "train", {}),
        test=part(te, "test", {"users_without_test": int((train_users & ~test_users).sum())}),
        name=label,
    )


def load_amazon_book(data_dir: str | os.PathLike[str] | None = None) -> TrainTestSplit:
    """Amazon-book as released with KGAT, with its own train/test split (see `load_kgat`).

    Parameters
    ----------
    data_dir : path-like, optional
        The folder holding ``amazon-book-kgat/`` (default: `find_data_dir`).

    Raises
    ------
    DatasetError
        Data folder not found, or a loader error.
    """
    base = Path(data_dir) if data_dir is not None else find_data_dir()
    if base is None:
        raise DatasetError(
            f"dataset 'amazon-book': data folder not found (set FEDREC_DATA or --data-dir to the folder "
            f"holding {AMAZON_BOOK_DIR}/)"
        )
    return load_kgat(base / AMAZON_BOOK_DIR, name="amazon-book")


# ----------------------------------------------------------------------------------------------
# Synthetic data


def synthetic(
    n_users: int = 600,
    n_items: int = 400,
    n_clusters: int = 8,
    ratings_per_user: int = 40,
    seed: int = 0,
    *,
    in_cluster_share: float = 0.8,
    popularity_exponent: float = 0.8,
) -> Ratings:
    """Generate a rating log with planted taste clusters.

    Each user belongs to one of ``n_clusters`` clusters, each item to one cluster.  A user rates
    about ``ratings_per_user`` distinct items (Poisson, at least 3), drawn without replacement with
    weights favouring its cluster's items (``in_cluster_share`` of the weight mass) and popular items
    (Zipf-like weights with ``popularity_exponent``).  Ratings 1-5 are high on in-cluster items and
    low elsewhere, plus item, user and noise terms; timestamps are random in 1998.

    Parameters
    ----------
    n_users, n_items, n_clusters, ratings_per_user : int
        Shape of the log.  ``ratings_per_user`` must be at most ``n_items // 2``.
    seed : int
        Seed of `np.random.default_rng`; equal seeds give equal logs (simulation data, not security).
    in_cluster_share : float
        Fraction in [0, 1] of a user's sampling weight on its own cluster's items.
    popularity_exponent : float
        Skew of item popularity (0 = uniform).

    Returns
    -------
    Ratings
        Named ``"synthetic"``; raw ids are 1-based; ``meta`` has no cluster labels (use the seed).

    Raises
    ------
    ValueError
        If a size is not positive or ``ratings_per_user`` is too large.
    """
    if min(n_users, n_items, n_clusters, ratings_per_user) < 1:
        raise ValueError("n_users, n_items, n_clusters and ratings_per_user must be >= 1")
    if ratings_per_user > n_items // 2:
        raise ValueError(f"ratings_per_user={ratings_per_user} exceeds n_items // 2 = {n_items // 2}")
    if not 0.0 <= in_cluster_share <= 1.0:
        raise ValueError("in_cluster_share must be in [0, 1]")
    rng = np.random.default_rng(seed)
    user_cluster = rng.integers(n_clusters, size=n_users)
    item_cluster = rng.permutation(np.arange(n_items) % n_clusters)
    popularity = 1.0 / (rng.permutation(n_items) + 1.0) ** popularity_exponent
    item_quality = rng.normal(0.0, 0.5, size=n_items)
    user_bias = rng.normal(0.0, 0.3, size=n_users)
    n_per_user = np.clip(rng.poisson(ratings_per_user, size=n_users), 3, n_items // 2)

    # per-cluster log sampling weights, normalised so in-cluster items carry `in_cluster_share`
    member = item_cluster[None, :] == np.arange(n_clusters)[:, None]  # (clusters, items)
    w_in = np.where(member, popularity, 0.0)
    w_out = np.where(member, 0.0, popularity)
    share = min(max(in_cluster_share, 1e-9), 1 - 1e-9)
    weights = share * w_in / w_in.sum(1, keepdims=True) + (1 - share) * w_out / np.maximum(
        w_out.sum(1, keepdims=True), 1e-300
    )
    log_w = np.log(np.maximum(weights, 1e-300))

    users_out: list[IntArray] = []
    items_out: list[IntArray] = []
    batch = max(1, 2_000_000 // n_items)  # bounded memory for ML-1M-sized logs
    for start in range(0, n_users, batch):  # loop over user batches, not ratings
        us = np.arange(start, min(start + batch, n_users))
        # Gumbel top-k = weighted sampling without replacement, for every user of the batch at once
        keys = log_w[user_cluster[us]] + rng.gumbel(size=(us.shape[0], n_items))
        order = np.argsort(-keys, axis=1)
        take = np.arange(n_items)[None, :] < n_per_user[us][:, None]
        users_out.append(np.broadcast_to(us[:, None], order.shape)[take])
        items_out.append(order[take])
    users = np.concatenate(users_out).astype(np.int64)
    items = np.concatenate(items_out).astype(np.int64)
    in_cluster = user_cluster[users] == item_cluster[items]
    raw = (
        np.where(in_cluster, 4.0, 2.3)
        + item_quality[items]
        + user_bias[users]
        + rng.normal(0.0, 0.6, size=users.shape[0])
    )
    ratings = np.clip(np.rint(raw), 1.0, 5.0)
    t0 = 883_612_800  # 1998-01-01 UTC
    timestamps = np.asarray(rng.integers(0, 365 * 86_400, size=users.shape[0], dtype=np.int64) + t0)
    # shuffle rows so file order is not user-sorted, like real logs
    perm = rng.permutation(users.shape[0])
    return Ratings(
        users=users[perm],
        items=items[perm],
        ratings=ratings[perm],
        timestamps=timestamps[perm],
        n_users=n_users,
        n_items=n_items,
        user_ids=np.arange(1, n_users + 1, dtype=np.int64),
        item_ids=np.arange(1, n_items + 1, dtype=np.int64),
        name="synthetic",
        meta=MappingProxyType({"seed": int(seed), "n_clusters": int(n_clusters)}),
    )


# ----------------------------------------------------------------------------------------------
# Locating and naming datasets


#: The file of each named dataset, relative to the data folder (what `load_dataset` looks for first).
_LAYOUT_FILES = {
    "ml-100k": "ml-100k/u.data",
    "filmtrust": "filmtrust/ratings.txt",
    "filmtrust-lightfr": "filmtrust-lightfr-split/filmtrust_train.csv",
    "amazon-book": f"{AMAZON_BOOK_DIR}/train.txt",
}
#: The expected folder layout, for error messages.
DATA_LAYOUT = (
    "expected layout: DATA/ml-100k/u.data (+ u.item), DATA/filmtrust/ratings.txt, "
    "DATA/filmtrust-lightfr-split/filmtrust_{train,val,test}.csv, DATA/amazon-book-kgat/{train,test}.txt "
    "(see docs/datasets.md)"
)


def find_data_dir() -> Path | None:
    """Locate the shared dataset folder.

    Returns ``$FEDREC_DATA`` if that variable is set (even if the folder is missing, so that a typo
    fails loudly later); else the first ``<ancestor>/../shared/data`` folder found walking up from
    this file and then from the current directory; else None.
    """
    env = os.environ.get("FEDREC_DATA")
    if env:
        return Path(env)
    for start in (Path(__file__).resolve().parent, Path.cwd().resolve()):
        for anc in (start, *start.parents):
            cand = anc.parent / "shared" / "data"
            if cand.is_dir():
                return cand
    return None


def load_dataset(
    name_or_path: str | os.PathLike[str], data_dir: Path | None = None
) -> Ratings | LightFRSplit | TrainTestSplit:
    """Load a dataset by name or path.

    Parameters
    ----------
    name_or_path : str or path-like
        ``"ml-100k"``, ``"filmtrust"``, ``"filmtrust-lightfr"`` (returns a `LightFRSplit`),
        ``"amazon-book"`` (returns its own split, a `TrainTestSplit`), ``"synthetic"`` (default
        arguments), or a path: a MovieLens file or folder (``u.data``, ``ratings.dat``), a LightFR
        split folder, a KGAT-format folder (``train.txt`` + ``test.txt``), a FilmTrust
        ``ratings.txt``, else a generic file.
    data_dir : Path, optional
        Where the named datasets live (default: `find_data_dir`).

    Raises
    ------
    DatasetError
        Unknown name, data folder not found, or a loader error.
    """
    name = str(name_or_path)
    if name == "synthetic":
        return synthetic()
    if name in DATASET_NAMES:
        base = data_dir if data_dir is not None else find_data_dir()
        if base is None:
            raise DatasetError(
                f"dataset {name!r}: no data folder (pass --data-dir, set FEDREC_DATA, or place it at "
                f"../shared/data); {DATA_LAYOUT}"
            )
        expected = base / _LAYOUT_FILES[name]
        if not expected.exists():
            raise DatasetError(f"dataset {name!r}: {expected} not found; {DATA_LAYOUT}")
        if name == "ml-100k":
            return load_movielens(base / "ml-100k")
        if name == "filmtrust":
            return load_filmtrust(base / "filmtrust" / "ratings.txt")
        if name == "amazon-book":
            return load_amazon_book(base)
        return load_lightfr_split(base / "filmtrust-lightfr-split")
    p = Path(name_or_path)
    if p.is_dir():
        if (p / "u.data").is_file() or (p / "ratings.dat").is_file():
            return load_movielens(p)
        if (p / "filmtrust_train.csv").is_file():
            return load_lightfr_split(p)
        if (p / "ratings.txt").is_file():
            return load_filmtrust(p)
        if (p / "train.txt").is_file() and (p / "test.txt").is_file():
            return load_kgat(p)
        raise DatasetError(f"{p}: folder holds no known dataset files")
    if not p.exists():
        raise DatasetError(f"{name!r} is neither a dataset name ({', '.join(DATASET_NAMES)}) nor a file")
    if p.name in ("u.data", "ratings.dat") or p.suffix == ".dat":
        return load_movielens(p)
    if p.name == "ratings.txt" and "filmtrust" in p.parent.name.lower():
        return load_filmtrust(p)
    return load_generic(p)
