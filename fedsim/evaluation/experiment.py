"""Evaluation set-ups shared by the CLI, the benchmarks and the tests: a dataset turned into a
training log plus validation/test candidate blocks under a named protocol, and the baselines every
figure is printed beside.

Invariants:
- Candidate blocks hold the held-out positive in column 0 and sampled negatives after it; negatives
  are never items the user interacted with anywhere (train, validation or test), and are seeded.
- The LightFR authors' FilmTrust split keeps its published blocks (49 negatives each).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedsim.data.datasets import load_dataset
from fedsim.data.kgat import TrainTestSplit
from fedsim.data.loaders import LightFRSplit
from fedsim.data.ratings import Ratings
from fedsim.data.splits import carve_validation, chronological_split, holdout_rule, leave_one_out
from fedsim.evaluation.ranking import (
    EvalResult,
    InteractionCSR,
    TieMode,
    evaluate_candidates,
    interaction_csr,
    popularity_scores,
    sample_negatives,
    sample_test_blocks,
)
from protocol.errors import DatasetError

__all__ = [
    "Protocol",
    "Candidates",
    "Experiment",
    "prepare",
    "require_validation",
    "DEFAULT_NEGATIVES",
    "validation_carves",
    "replicated",
    "baselines",
    "item_titles",
    "dataset_titles",
]


class Protocol(StrEnum):
    """How held-out positives are chosen."""

    LOO = "loo"  # per-user leave-one-out: latest (random without timestamps) → test, next → validation
    CHRONO = "chrono"  # per-user chronological 80/10/10; every held-out rating is a positive
    LIGHTFR_SPLIT = "lightfr-split"  # the published FilmTrust blocks of the LightFR authors
    FULL = "full"  # a dataset's own train/test split, Recall@20 / NDCG@20 ranking all non-train items
    SAMPLED = "sampled"  # a dataset's own split: one random test item per user among sampled negatives


@dataclass(frozen=True, slots=True)
class Candidates:
    """Ranking blocks: ``users[j]`` ranks ``items[j]`` (positive first)."""

    users: NDArray[np.int64]
    items: NDArray[np.int64]

    def __len__(self) -> int:
        return int(self.users.size)


@dataclass(frozen=True, slots=True)
class Experiment:
    """A dataset ready for training and evaluation."""

    name: str
    train: Ratings
    val: Candidates
    test: Candidates
    protocol: Protocol
    n_negatives: int
    rating_range: tuple[float, float] | None
    holdout: str = ""
    """How held-out ratings were chosen (e.g. "latest by timestamp", "uniformly random (...)"); on a small
    catalogue also how many negatives fit and which users could not be ranked."""
    val_pairs: Ratings | None = None
    """FULL / SAMPLED: the validation pairs carved from the published train (``train`` excludes them)."""
    test_pairs: Ratings | None = None
    """FULL / SAMPLED: the published test pairs."""
    seen: Ratings | None = None
    """FULL / SAMPLED: the whole published train, excluded from every user's test ranking."""

    def describe(self) -> str:
        head = (
            f"{self.name}: {self.train.n_users} users, {self.train.n_items} items, "
            f"{len(self.train)} training ratings; protocol {self.protocol.value}"
        )
        if self.protocol is Protocol.FULL and self.test_pairs is not None:
            n_users = int(np.unique(self.test_pairs.users).size)
            tail = (
                f", {len(self.test_pairs)} test pairs of {n_users} users, each user ranking every item not in "
                f"its train set (Recall@20 / NDCG@20, random ties)"
            )
        else:
            tail = f", {len(self.test)} test positives each ranked among {self.n_negatives} sampled negatives"
        rule = f"; held-out ratings: {self.holdout}" if self.holdout else ""
        return head + tail + rule


def _blocks(
    n_items: int,
    held: Ratings,
    interacted: tuple[NDArray[np.int64], NDArray[np.int64]],
    n_neg: int,
    seed: int,
) -> Candidates:
    cand = sample_negatives(n_items, held.users, held.items, interacted, n_neg, seed)
    return Candidates(np.asarray(held.users, dtype=np.int64), cand)


DEFAULT_NEGATIVES = 99
"""Sampled negatives per held-out positive (HR@10 of 100) when the caller asks for none in particular."""

#: On a catalogue too small for `DEFAULT_NEGATIVES`, the share of held-out rows the chosen count must fit.
FITTING_SHARE = 0.9


def _never_held(inter: InteractionCSR, n_items: int, held: Ratings) -> NDArray[np.int64]:
    """Per held-out row, how many items its user never interacted with (what its negatives are drawn from)."""
    return n_items - np.diff(inter.indptr)[np.asarray(held.users, dtype=np.int64)]


def _fitting_negatives(n_items: int, inter: InteractionCSR, held: Sequence[Ratings]) -> tuple[int, int]:
    """(negatives, rows too short for them) of the default on this log: `DEFAULT_NEGATIVES` when every held-out
    row can draw that many never-interacted items, else the most that `FITTING_SHARE` of the rows can draw.

    Raises
    ------
    DatasetError
        Fewer than one negative fits (every user holds nearly the whole catalogue).
    """
    available = np.concatenate([_never_held(inter, n_items, h) for h in held])
    if available.size == 0 or int(available.min()) >= DEFAULT_NEGATIVES:
        return DEFAULT_NEGATIVES, 0
    fit = int(min(DEFAULT_NEGATIVES, np.quantile(available, 1.0 - FITTING_SHARE, method="lower")))
    if fit < 1:
        raise DatasetError(
            f"{n_items} items, and most users hold nearly all of them: no item is left to rank a held-out one against"
        )
    return fit, int(np.count_nonzero(available < fit))


def _rankable(held: Ratings, inter: InteractionCSR, n_items: int, n_neg: int) -> Ratings:
    """``held`` without the rows whose user has fewer than ``n_neg`` never-interacted items."""
    keep = _never_held(inter, n_items, held) >= n_neg
    return held if bool(keep.all()) else held.subset(keep)


def require_validation(exp: Experiment) -> Experiment:
    """``exp`` if it has validation rows to choose models on, else one clear error naming why not.

    Raises
    ------
    DatasetError
        No validation rows: leave-one-out validates on users with three or more ratings.
    """
    if len(exp.val) == 0:
        raise DatasetError(
            f"{exp.name}: no validation rows to choose the model on: leave-one-out takes one rating of each user "
            "for test and one more for validation, so it needs users with at least 3 ratings, and this log has none"
        )
    return exp


def prepare(
    dataset: str | Path | Ratings | LightFRSplit,
    protocol: Protocol | None = None,
    *,
    n_negatives: int | None = DEFAULT_NEGATIVES,
    seed: int = 0,
    data_dir: Path | None = None,
) -> Experiment:
    """Load (if needed) and split a dataset, and sample its candidate blocks.

    Parameters
    ----------
    dataset : a dataset name or path (see `fedsim.data.datasets.load_dataset`) or loaded data.
    protocol : LOO by default; the LightFR split always uses its own blocks.
    n_negatives : sampled negatives per held-out positive (49 or 99 are the usual choices).  None: 99, or on a
        rating log whose catalogue is too small for 99, the most that 90% of the held-out rows can draw; the
        rows that cannot are left out of the ranking, and ``holdout`` says so.
    seed : the evaluation seed: which ratings a log without timestamps holds out, the validation
        carve of a published split, and the negatives (validation uses ``seed``, test ``seed + 1``).
        Keep it apart from the model's seed, so that changing the model seed never changes the test.
    """
    data = dataset if isinstance(dataset, Ratings | LightFRSplit) else load_dataset(dataset, data_dir)
    if n_negatives is not None and n_negatives < 1:
        raise ValueError(f"n_negatives must be >= 1, got {n_negatives}")
    if isinstance(data, TrainTestSplit):
        return _prepare_published(data, protocol or Protocol.FULL, n_negatives or DEFAULT_NEGATIVES, seed)
    if isinstance(data, LightFRSplit):
        if protocol not in (None, Protocol.LIGHTFR_SPLIT):
            raise ValueError("the LightFR split comes with its own blocks; use protocol lightfr-split")
        return Experiment(
            name="filmtrust-lightfr",
            train=data.train,
            val=Candidates(data.val.users, data.val.candidates),
            test=Candidates(data.test.users, data.test.candidates),
            protocol=Protocol.LIGHTFR_SPLIT,
            n_negatives=data.test.candidates.shape[1] - 1,
            rating_range=None,  # the authors normalised the training ratings already
        )
    protocol = protocol or Protocol.LOO
    if protocol is Protocol.LIGHTFR_SPLIT:
        raise ValueError("protocol lightfr-split needs the filmtrust-lightfr dataset")
    if protocol in (Protocol.FULL, Protocol.SAMPLED):
        raise ValueError(f"protocol {protocol.value} needs a dataset with its own train/test split (amazon-book)")
    if protocol is Protocol.LOO:
        train, val, test = leave_one_out(data, seed=seed)
    else:
        train, val, test = chronological_split(data, seed=seed)
    inter = interaction_csr(train, val, test)
    lo, hi = float(np.min(data.ratings)), float(np.max(data.ratings))
    rule = holdout_rule(data, seed)
    if n_negatives is None:
        n_negatives, short = _fitting_negatives(data.n_items, inter, (val, test))
        if n_negatives < DEFAULT_NEGATIVES:
            rule += (
                f"; {data.n_items} items are too few for {DEFAULT_NEGATIVES} negatives, so {n_negatives} "
                f"(what {FITTING_SHARE:.0%} of the held-out rows can draw) and {short} held-out row(s) of users "
                "holding nearly every item left unranked"
            )
            val, test = (_rankable(h, inter, data.n_items, n_negatives) for h in (val, test))
    return Experiment(
        name=data.name,
        train=train,
        val=_blocks(data.n_items, val, inter, n_negatives, seed),
        test=_blocks(data.n_items, test, inter, n_negatives, seed + 1),
        protocol=protocol,
        n_negatives=n_negatives,
        rating_range=(lo, hi) if hi > lo else None,
        holdout=rule,
    )


VALIDATION_FRACTION = 0.1


def _prepare_published(data: TrainTestSplit, protocol: Protocol, n_negatives: int, seed: int) -> Experiment:
    if protocol not in (Protocol.FULL, Protocol.SAMPLED):
        raise ValueError(f"{data.name} comes with its own train/test split: use protocol full or sampled")
    fit, val_pairs = carve_validation(data.train, VALIDATION_FRACTION, seed=seed)
    vu, vc = sample_test_blocks(data.train, val_pairs, n_negatives, seed)
    tu, tc = sample_test_blocks(data.train, data.test, n_negatives, seed + 1)
    return Experiment(
        name=data.name,
        train=fit,
        val=Candidates(vu, vc),
        test=Candidates(tu, tc),
        protocol=protocol,
        n_negatives=n_negatives,
        rating_range=None,
        holdout=f"the dataset's own test split; {val_pairs.meta['holdout']}",
        val_pairs=val_pairs,
        test_pairs=data.test,
        seen=data.train,
    )


def replicated(exp: Experiment, copies: int) -> Experiment:
    """``exp`` as a fleet ``copies`` times larger: every user with training ratings becomes ``copies`` users
    (copy k of the j-th such user is user k·n + j, n of them), each with the user's training ratings and
    validation block; items are unchanged.  The test blocks are left empty, so whatever is computed on the
    copy reads validation only.

    Raises
    ------
    ValueError
        ``copies`` < 1, or a protocol with pairs beside the blocks (a published split: full or sampled).
    """
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
        raise ValueError(f"copies must be a whole number >= 1, got {copies!r}")
    if exp.val_pairs is not None or exp.test_pairs is not None or exp.seen is not None:
        raise ValueError(f"{exp.name}: a published split ({exp.protocol.value}) cannot be replicated by blocks")
    tr = exp.train
    present = np.unique(tr.users)
    n = int(present.size)
    dense = np.full(tr.n_users, -1, dtype=np.int64)
    dense[present] = np.arange(n, dtype=np.int64)
    keep = dense[exp.val.users] >= 0
    val_users, val_items = dense[exp.val.users[keep]], exp.val.items[keep]
    shift = np.repeat(np.arange(copies, dtype=np.int64) * n, len(tr))
    ids = np.asarray(tr.user_ids)[present]
    train = Ratings(
        users=np.tile(dense[tr.users], copies) + shift,
        items=np.tile(tr.items, copies),
        ratings=np.tile(tr.ratings, copies),
        timestamps=None if tr.timestamps is None else np.tile(tr.timestamps, copies),
        n_users=n * copies,
        n_items=tr.n_items,
        user_ids=np.array([f"{u}#{k}" for k in range(copies) for u in ids], dtype=object),
        item_ids=tr.item_ids,
        name=f"{tr.name} ×{copies}",
    )
    val_shift = np.repeat(np.arange(copies, dtype=np.int64) * n, val_users.size)
    width = exp.test.items.shape[1] if exp.test.items.ndim == 2 else 0
    return replace(
        exp,
        name=f"{exp.name} ×{copies}",
        train=train,
        val=Candidates(np.tile(val_users, copies) + val_shift, np.tile(val_items, (copies, 1))),
        test=Candidates(np.zeros(0, np.int64), np.zeros((0, width), np.int64)),
    )


def validation_carves(exp: Experiment, k: int, seed: int = 0, *, exclude_interacted: bool = True) -> list[Experiment]:
    """``k`` further validation sets carved from ``exp.train``, for selecting hyper-parameters on more
    than one sample of held-out positives (one block per user is a noisy estimate: with ~1,000 users
    and HR@10 ≈ 0.95 its standard error is ≈ 0.007).

    Carve ``j`` holds out one training rating of every user with at least two, by the protocol's own
    rule applied to the training log: the latest by timestamp (every carve then holds out the same
    rating and differs only in its negatives), or a seeded uniformly random one without timestamps
    (seed ``(seed, j)``); it is ranked among ``exp.n_negatives`` negatives sampled, with the same seed,
    from the items the user has nowhere (train, validation or test positives), or, with
    ``exclude_interacted=False``, from every item but the positive: how the LightFR authors' FilmTrust
    blocks were drawn (1.6 % of their negatives are the user's own training items, about half of their
    blocks hold at least one), so that a carve ranks like the published blocks.  Each returned
    experiment trains on ``exp.train`` minus its carve and validates on the carve; ``test`` is
    ``exp.test`` unchanged (never read it during selection).

    Raises
    ------
    ValueError
        If ``k`` < 0 or the protocol has no per-user blocks (FULL).
    """
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if exp.protocol is Protocol.FULL:
        raise ValueError("validation_carves needs per-user candidate blocks (not the full-ranking protocol)")
    train = exp.train
    n_items = train.n_items
    keys = np.unique(
        np.concatenate(
            [
                train.users * n_items + train.items,
                exp.val.users * n_items + exp.val.items[:, 0],
                exp.test.users * n_items + exp.test.items[:, 0],
            ]
        )
    )
    out = []
    for j in range(k):
        rng = np.random.default_rng([seed, j])
        fit, _, held = leave_one_out(train, validation=False, seed=rng)
        cand = sample_negatives(
            n_items,
            held.users,
            held.items,
            _csr(keys if exclude_interacted else held.users * n_items + held.items, train.n_users, n_items),
            exp.n_negatives,
            rng,
        )
        rule = "latest training rating" if train.timestamps is not None else "random training rating"
        out.append(
            replace(
                exp,
                train=fit,
                val=Candidates(np.asarray(held.users, dtype=np.int64), cand),
                holdout=f"validation carve {j} (seed ({seed}, {j})): {rule} of each user with >= 2",
            )
        )
    return out


def _csr(keys: NDArray[np.int64], n_users: int, n_items: int) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """(indptr, items) of the user-item pairs ``user * n_items + item`` (sorted, unique)."""
    keys = np.unique(keys)
    users = keys // max(n_items, 1)
    indptr = np.zeros(n_users + 1, dtype=np.int64)
    np.cumsum(np.bincount(users, minlength=n_users), out=indptr[1:])
    return indptr, (keys - users * n_items).astype(np.int64)


def baselines(exp: Experiment, tie_mode: TieMode = TieMode.RANDOM, seed: int = 0) -> dict[str, EvalResult]:
    """Item popularity (training counts) and random scores on the test blocks."""
    pop = popularity_scores(exp.train)[exp.test.items]
    rnd = np.random.default_rng(seed).random(exp.test.items.shape)
    return {
        "popularity": evaluate_candidates(pop, 10, tie_mode),
        "random": evaluate_candidates(rnd, 10, tie_mode),
    }


def item_titles(exp: Experiment, data_dir: Path | None) -> list[str] | None:
    """Movie titles for MovieLens-100K (from ``u.item``), indexed by dense item index, if present."""
    return dataset_titles(exp.name, data_dir, exp.train.item_ids)


def dataset_titles(
    dataset: str, data_dir: Path | None, item_ids: Sequence[Any] | NDArray[Any] | None
) -> list[str] | None:
    """Titles of ``item_ids`` (the dataset's raw item ids, in dense index order) when ``dataset`` is
    MovieLens-100K and its ``u.item`` is under ``data_dir/ml-100k`` (or beside a ``u.data`` path); else None."""
    if item_ids is None:
        return None
    given = Path(dataset)
    if given.name == "u.data" and given.parent != Path(".") and (given.parent / "u.item").is_file():
        path = given.parent / "u.item"
    elif data_dir is not None and dataset in ("u", "u.data", "ml-100k"):
        path = data_dir / "ml-100k" / "u.item"
    else:
        return None
    if not path.is_file():
        return None
    titles: dict[str, str] = {}
    for line in path.read_text(encoding="latin-1").splitlines():
        parts = line.split("|")
        if len(parts) > 1:
            titles[parts[0]] = parts[1]
    return [titles.get(str(raw), f"item {raw}") for raw in item_ids]
