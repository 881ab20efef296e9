# Invariants of this module:
# - Every loader parses through `fedsim.data.parsing`, so ids densify the same way and every malformed
#   line of a file is reported in one `DatasetError`.
"""Loaders of explicit-feedback rating files: MovieLens, FilmTrust, generic, and the LightFR split."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np

from fedsim.data.parsing import Parsed, Problems, densify, parse, to_ratings
from fedsim.data.ratings import FloatArray, IntArray, Ratings
from protocol.errors import DatasetError

__all__ = [
    "CandidateBlocks",
    "LightFRSplit",
    "load_filmtrust",
    "load_generic",
    "load_lightfr_split",
    "load_movielens",
]

LIGHTFR_BLOCK = 50


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
    parsed = parse(p, sep=sep, n_fields=(4,), rating_range=(1.0, 5.0), allow_comments=False, allow_header=False)
    name = "ml-100k" if p.name == "u.data" else ("ml-1m" if p.name == "ratings.dat" else p.stem)
    return to_ratings(parsed, name, {"source": str(p)})


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
    parsed = parse(p, sep=None, n_fields=(3,), rating_range=(0.0, 5.0), allow_header=False)
    return to_ratings(parsed, "filmtrust", {"source": str(p)}, deduplicate=True)


def load_generic(path: str | os.PathLike[str], sep: str | None = None, *, deduplicate: bool = True) -> Ratings:
    """Load a ``user item rating [timestamp]`` file, or ``user item`` lines (implicit feedback, rating 1).

    Parameters
    ----------
    path : path-like
        The file.  Blank lines and lines starting with ``#`` are skipped; a first line none of whose
        first three fields is a number is taken as a header (e.g. ``user,item,rating``; for ``user item``
        lines, one that also holds no digit).  A byte-order mark and double quotes around fields are
        ignored; gzip, bzip2, xz and a zip archive of one file are unpacked.  Ids are integers, or names
        (``u17``, ``B000FA64PK``) when more than 1% of a column is not an integer (`parsing.NAMES_SHARE`);
        timestamps are integers or finite numbers (rounded down).
    sep : str, optional
        Field separator; auto-detected from the first data line (tab, ``::``, comma, semicolon, else
        whitespace).
    deduplicate : bool
        Drop repeated user-item pairs, keeping the last line (counts in ``meta``).

    Raises
    ------
    DatasetError
        If the file is missing, empty, or has malformed lines (all are listed).
    """
    p = Path(path)
    parsed = parse(p, sep=sep, n_fields=(2, 3, 4), names=True)
    name = p.name
    for suffix in (".gz", ".bz2", ".xz", ".zip"):
        name = name.removesuffix(suffix)
    return to_ratings(parsed, Path(name).stem, {"source": str(p)}, deduplicate=deduplicate)


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


def _blocks(path: Path, p: Parsed, users: IntArray, items: IntArray) -> CandidateBlocks:
    n = users.shape[0]
    problems = Problems(path)
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
    parts = [parse(q, sep=",", n_fields=(3,)) for q in paths]
    user_ids, users = densify(np.concatenate([q.users for q in parts]))
    item_ids, items = densify(np.concatenate([q.items for q in parts]))
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
