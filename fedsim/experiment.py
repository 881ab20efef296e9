"""Evaluation set-ups shared by the CLI, the benchmarks and the tests: a dataset turned into a
training log plus validation/test candidate blocks under a named protocol, and the baselines every
figure is printed beside.

Invariants:
- Candidate blocks hold the held-out positive in column 0 and sampled negatives after it; negatives
  are never items the user interacted with anywhere (train, validation or test), and are seeded.
- The LightFR authors' FilmTrust split keeps its published blocks (49 negatives each).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from fedsim.datasets import LightFRSplit, Ratings, TrainTestSplit, load_dataset
from fedsim.evaluation import (
    EvalResult,
    TieMode,
    evaluate_candidates,
    interaction_csr,
    popularity_scores,
    sample_negatives,
)
from fedsim.splits import chronological_split, leave_one_out

__all__ = ["Protocol", "Candidates", "Experiment", "prepare", "baselines", "item_titles"]


class Protocol(StrEnum):
    """How held-out positives are chosen."""

    LOO = "loo"  # per-user chronological leave-one-out: latest → test, second latest → validation
    CHRONO = "chrono"  # per-user chronological 80/10/10; every held-out rating is a positive
    LIGHTFR_SPLIT = "lightfr-split"  # the published FilmTrust blocks of the LightFR authors


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

    def describe(self) -> str:
        return (
            f"{self.name}: {self.train.n_users} users, {self.train.n_items} items, "
            f"{len(self.train)} training ratings; protocol {self.protocol.value}, "
            f"{len(self.test)} test positives each ranked among {self.n_negatives} sampled negatives"
        )


def _blocks(
    n_items: int,
    held: Ratings,
    interacted: tuple[NDArray[np.int64], NDArray[np.int64]],
    n_neg: int,
    seed: int,
) -> Candidates:
    cand = sample_negatives(n_items, held.users, held.items, interacted, n_neg, seed)
    return Candidates(np.asarray(held.users, dtype=np.int64), cand)


def prepare(
    dataset: str | Path | Ratings | LightFRSplit,
    protocol: Protocol | None = None,
    *,
    n_negatives: int = 99,
    seed: int = 0,
    data_dir: Path | None = None,
) -> Experiment:
    """Load (if needed) and split a dataset, and sample its candidate blocks.

    Parameters
    ----------
    dataset : a dataset name or path (see `fedsim.datasets.load_dataset`) or loaded data.
    protocol : LOO by default; the LightFR split always uses its own blocks.
    n_negatives : sampled negatives per held-out positive (49 or 99 are the usual choices).
    seed : seed for negative sampling (validation uses ``seed``, test ``seed + 1``).
    """
    data = dataset if isinstance(dataset, Ratings | LightFRSplit) else load_dataset(dataset, data_dir)
    if n_negatives < 1:
        raise ValueError(f"n_negatives must be >= 1, got {n_negatives}")
    if isinstance(data, TrainTestSplit):
        raise ValueError(
            f"{data.name} comes with its own train/test split of implicit feedback: evaluate it with "
            "fedsim.evaluation.evaluate_full_ranking (Recall@20 / NDCG@20 over all items)"
        )
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
    train, val, test = leave_one_out(data) if protocol is Protocol.LOO else chronological_split(data)
    inter = interaction_csr(train, val, test)
    lo, hi = float(np.min(data.ratings)), float(np.max(data.ratings))
    return Experiment(
        name=data.name,
        train=train,
        val=_blocks(data.n_items, val, inter, n_negatives, seed),
        test=_blocks(data.n_items, test, inter, n_negatives, seed + 1),
        protocol=protocol,
        n_negatives=n_negatives,
        rating_range=(lo, hi) if hi > lo else None,
    )


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
    if data_dir is None or exp.name not in ("u", "u.data", "ml-100k"):
        return None
    path = data_dir / "ml-100k" / "u.item"
    if not path.is_file():
        return None
    titles: dict[str, str] = {}
    for line in path.read_text(encoding="latin-1").splitlines():
        parts = line.split("|")
        if len(parts) > 1:
            titles[parts[0]] = parts[1]
    return [titles.get(str(raw), f"item {raw}") for raw in exp.train.item_ids]
