# Invariants of this module:
# - Dense ids are assigned in ascending raw-id order (`np.unique`), so a file always maps the same way.
# - Row order is file order (after de-duplication, which keeps the surviving rows in file order).
# - Parsers never raise on the first bad line: they collect every malformed line and raise ONE
#   `DatasetError` naming the file, up to `_MAX_REPORTED` lines with their reasons, and the total.
"""Text parsing shared by the rating-file loaders: columns to arrays, value checks, densified `Ratings`."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import zipfile
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from fedsim.data.ratings import FloatArray, IntArray, Ratings
from protocol.errors import DatasetError

__all__ = ["Parsed", "Problems", "densify", "parse", "read_bytes", "to_ratings"]

_MAX_REPORTED = 20


class Problems:
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


#: Leading bytes of the compressed layouts a data file may come in, and how to open each.
_COMPRESSED: tuple[tuple[bytes, str], ...] = (
    (b"\x1f\x8b", "gzip"),
    (b"BZh", "bzip2"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"PK\x03\x04", "zip"),
)


def read_bytes(path: Path) -> bytes:
    """A data file's bytes, unpacked when it is gzip, bzip2, xz or a zip archive of one file (public rating
    sets often ship so), or one `DatasetError` naming the file and why it cannot be read."""
    if not path.exists():
        raise DatasetError(f"{path}: file not found")
    if not path.is_file():
        raise DatasetError(f"{path}: not a regular file")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read ({exc.strerror})") from exc
    kind = next((name for magic, name in _COMPRESSED if raw.startswith(magic)), None)
    return raw if kind is None else _unpack(path, raw, kind)


def _unpack(path: Path, raw: bytes, kind: str) -> bytes:
    """The content of a compressed data file, or one `DatasetError` naming the file and what is wrong."""
    try:
        if kind == "gzip":
            return gzip.decompress(raw)
        if kind == "bzip2":
            return bz2.decompress(raw)
        if kind == "xz":
            return lzma.decompress(raw)
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            files = [info for info in archive.infolist() if not info.is_dir()]
            if len(files) == 1:
                return archive.read(files[0])
    except (OSError, EOFError, ValueError, lzma.LZMAError, zipfile.BadZipFile) as exc:
        raise DatasetError(f"{path}: damaged {kind} data ({exc})") from None
    names = ", ".join(info.filename for info in files[:5]) + (", ..." if len(files) > 5 else "")
    raise DatasetError(
        f"{path}: a zip archive of {len(files)} files ({names or 'none'}); unpack it and pass the ratings file"
    )


def _read_lines(path: Path) -> list[str]:
    raw = read_bytes(path)
    nul = raw.find(b"\x00", 0, 1 << 16)
    if nul >= 0:
        raise DatasetError(
            f"{path}: binary content (a NUL byte at offset {nul}), not a text ratings file; expected lines "
            "of 'user item rating [timestamp]' (plain text, or gzip, bzip2, xz or a zip of one file)"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")  # never fails; bad bytes then show up as non-numeric fields
    # a byte-order mark (files saved by spreadsheet programs) is not part of the first field
    text = text.removeprefix("\ufeff")
    # split on "\n" only (str.splitlines also splits on \x0b, \x1c ... and would shift line numbers)
    return text.split("\n")


def _detect_sep(line: str) -> str | None:
    if "\t" in line:
        return "\t"
    if "::" in line:
        return "::"
    if "," in line:
        return ","
    if ";" in line:
        return ";"
    return None


def _unquote(s: str) -> str:
    """A field without the double quotes some exports put around every value."""
    s = s.strip()
    return s[1:-1].strip() if len(s) >= 2 and s[0] == s[-1] == '"' else s


def _is_header(fields: list[str]) -> bool:
    """Whether a first line is a header: none of its first three fields is a number (``user,item,rating``),
    and for a two-field line (ids only) no field holds a digit either (``user,item``, not ``u1,i7``)."""
    fields = [_unquote(f) for f in fields]
    if any(_is_number(f) for f in fields[:3]):
        return False
    return len(fields) > 2 or not any(ch.isdigit() for f in fields for ch in f)


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


def _to_time(col: npt.NDArray[np.str_]) -> tuple[IntArray, npt.NDArray[np.bool_]]:
    """Timestamps as int64: integers, or finite numbers (``1391619.0``, ``1.5e9``, as spreadsheets and
    data-frame exports write them) rounded down; they only order a user's ratings."""
    vals, bad = _to_int(col)
    if bad.any():
        floats, bad_f = _to_float(col[bad])
        ok = ~bad_f & np.isfinite(floats) & (np.abs(floats) < 2.0**62)
        idx = np.flatnonzero(bad)
        vals[idx[ok]] = np.floor(floats[ok]).astype(np.int64)
        bad[idx[ok]] = False
    return vals, bad


#: A column of ids with more than this share of values that are not integers holds names (below it, those
#: values are reported as typos in a column of integers).
NAMES_SHARE = 0.01


def _to_ids(col: npt.NDArray[np.str_], names: bool) -> tuple[npt.NDArray[Any], npt.NDArray[np.bool_], bool]:
    """(raw ids, unparsable, whether they are names): integers; or, with ``names`` allowed and more than
    `NAMES_SHARE` of the column not integers (``u17``, ``B000FA64PK``, ISBNs ending in X), every value as it
    is written, as a name."""
    vals, bad = _to_int(col)
    if names and col.size and np.count_nonzero(bad) > NAMES_SHARE * col.size:
        return col, np.zeros(col.shape[0], dtype=np.bool_), True
    return vals, bad, False


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


class Parsed(NamedTuple):
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
    ratings = floats[:, 2].copy() if width > 2 else np.ones(len(lines))
    if _value_checks(ints[:, 0], ints[:, 1], ratings, rating_range):
        return None
    return ints, ratings


def parse(
    path: Path,
    *,
    sep: str | None,
    n_fields: tuple[int, ...],
    rating_range: tuple[float, float] | None = None,
    allow_comments: bool = True,
    allow_header: bool = True,
    names: bool = False,
) -> Parsed:
    """Parse ``user item rating [timestamp]`` lines, reporting every malformed line at once.  A width of 2
    in ``n_fields`` reads ``user item`` lines (implicit feedback, rating 1); ``names`` takes a column whose
    values are mostly not integers as names (`_to_ids`)."""
    lines = _read_lines(path)
    stripped = [ln.strip() for ln in lines]
    keep = [j for j, s in enumerate(stripped) if s and not (allow_comments and s.startswith("#"))]
    if not keep:
        raise DatasetError(f"{path}: no data lines (empty file, or only blank/comment lines)")
    if sep is None:
        sep = _detect_sep(stripped[keep[0]])
    # a header is a first line none of whose first three fields is a number (`user,item,rating`)
    if allow_header and _is_header(stripped[keep[0]].split(sep)):
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
        return Parsed(line_nos, ints[:, 0].copy(), ints[:, 1].copy(), ratings, ts)

    # slow path: split every line, report every problem
    problems = Problems(path)
    rows = [[_unquote(f) for f in ln.split(sep)] for ln in data]
    counts = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    bad_count = counts != width
    if bad_count.any():
        if len(n_fields) > 1 and first_width in n_fields:
            expected = f"expected {width} fields (as on line {line_nos[0]})"
        else:
            *most, last = map(str, n_fields)
            expected = f"expected {', '.join(most)} or {last} fields" if most else f"expected {last} fields"
        idx = np.flatnonzero(bad_count)
        problems.add(line_nos[idx], [f"{expected}, got {counts[j]}" for j in idx.tolist()])
    good = np.flatnonzero(~bad_count)
    table = np.array([rows[j] for j in good.tolist()], dtype=np.str_).reshape(len(good), width)
    ln = line_nos[good]
    users, bad_u, named_u = _to_ids(table[:, 0], names)
    items, bad_i, named_i = _to_ids(table[:, 1], names)
    none = np.zeros(len(good), dtype=np.bool_)
    ratings, bad_r = _to_float(table[:, 2]) if width > 2 else (np.ones(len(good)), none)
    ts_arr: IntArray | None = None
    bad_t = none
    if width >= 4:
        ts_arr, bad_t = _to_time(table[:, 3])
    zero = np.zeros(len(good), dtype=np.int64)  # names are never negative
    checked = (zero if named_u else users, zero if named_i else items)
    for mask, why in _value_checks(*checked, ratings, rating_range, (bad_u, bad_i, bad_r, bad_t)):
        idx = np.flatnonzero(mask)
        problems.add(ln[idx], [f"{why}: {' | '.join(table[j].tolist())!r}" for j in idx.tolist()])
    problems.raise_if_any()
    return Parsed(ln, users, items, ratings, ts_arr)


def densify(raw: npt.NDArray[Any]) -> tuple[npt.NDArray[Any], IntArray]:
    """(the distinct raw ids ascending: int64, or the names as written; each row's dense index)."""
    ids, inverse = np.unique(raw, return_inverse=True)
    return (ids if ids.dtype.kind in "US" else ids.astype(np.int64)), inverse.astype(np.int64).reshape(-1)


def _last_of_each_pair(users: IntArray, items: IntArray, n_items: int, parsed: Parsed) -> tuple[IntArray, int, int]:
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


def to_ratings(p: Parsed, name: str, meta: dict[str, int | str] | None = None, *, deduplicate: bool = False) -> Ratings:
    user_ids, users = densify(p.users)
    item_ids, items = densify(p.items)
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
