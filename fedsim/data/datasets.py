# Invariants of this module:
# - One table (`_LAYOUT_FILES`) says where each named dataset lives under the data folder; names and paths
#   resolve to a loader only here.
"""Dataset names, the data folder, and `load_dataset`, which turns a name or a path into loaded data."""

from __future__ import annotations

import os
from pathlib import Path

from fedsim.data.kgat import TrainTestSplit, load_kgat
from fedsim.data.loaders import LightFRSplit, load_filmtrust, load_generic, load_lightfr_split, load_movielens
from fedsim.data.ratings import Ratings
from fedsim.data.synthetic import synthetic
from protocol.errors import DatasetError

__all__ = [
    "DATASET_NAMES",
    "DATA_LAYOUT",
    "LightFRSplit",
    "Ratings",
    "TrainTestSplit",
    "find_data_dir",
    "load_amazon_book",
    "load_dataset",
    "synthetic",
]

DATASET_NAMES = ("ml-100k", "filmtrust", "filmtrust-lightfr", "amazon-book", "synthetic")
AMAZON_BOOK_DIR = "amazon-book-kgat"


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
        return _load_named(name, data_dir)
    return _load_path(Path(name_or_path), name)


def _load_named(name: str, data_dir: Path | None) -> Ratings | LightFRSplit | TrainTestSplit:
    """A named dataset (other than ``"synthetic"``) from its place in the data folder."""
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


def _load_path(p: Path, name: str) -> Ratings | LightFRSplit | TrainTestSplit:
    """A dataset file or folder, its loader picked by the file names it holds."""
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
