# Invariants of this module:
# - KGAT ids are used as dense indices unchanged; train and test share one id space and never a pair.
# - The tokenizer is numpy over the raw bytes (no Python loop per line) and reports every malformed line
#   of a file in one `DatasetError`.
"""Implicit feedback with a published train/test split, in the KGAT release format (amazon-book)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import NamedTuple

import numpy as np

from fedsim.data.parsing import Problems, read_bytes
from fedsim.data.ratings import IntArray, Ratings
from protocol.errors import DatasetError

__all__ = ["TrainTestSplit", "load_kgat"]


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
    raw = read_bytes(path)
    b = np.frombuffer(raw, dtype=np.uint8)
    digit = (b >= 48) & (b <= 57)
    newline = b == 10
    blank = (b == 32) | (b == 9) | (b == 13) | newline
    line_of = np.cumsum(newline) - newline  # 0-based line of each byte; a newline ends its own line
    if not digit.any():
        raise DatasetError(f"{path}: no data lines (empty file, or only blank lines)")
    problems = Problems(path)
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
        problems = Problems(te_path)
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
