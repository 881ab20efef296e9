"""Full-ranking private evaluations (LightFR and MF) on a small published-style split: the shape of what
they return, α from the grid, and the fixed test-user sample."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from fedsim.data.kgat import TrainTestSplit
from fedsim.data.ratings import Ratings
from fedsim.data.synthetic import synthetic
from fedsim.private.mf import IMPLICIT_MF, evaluate_private_mf_scaled
from fedsim.private.scaled_lightfr import ALPHAS, ScaledSettings, evaluate_private
from fedsim.private.served import full_ranking_metrics


def _split() -> TrainTestSplit:
    data = synthetic(n_users=120, n_items=80, ratings_per_user=12, seed=3)
    rng = np.random.default_rng(0)
    test = rng.random(data.users.size) < 0.2
    first = np.unique(data.users, return_index=True)[1]
    test[first] = False  # every user keeps a train item

    def part(mask: np.ndarray, name: str) -> Ratings:
        return Ratings(
            users=data.users[mask].astype(np.int64),
            items=data.items[mask].astype(np.int64),
            ratings=np.ones(int(mask.sum())),
            timestamps=None,
            n_users=data.n_users,
            n_items=data.n_items,
            user_ids=data.user_ids,
            item_ids=data.item_ids,
            name=name,
        )

    return TrainTestSplit(train=part(~test, "train"), test=part(test, "test"), name="tiny")


def _check(metrics: dict[str, dict[str, float]], extra: dict[str, object]) -> None:
    for name in ("model", "private_popularity", "popularity", "random"):
        assert set(metrics[name]) == {"recall@20", "ndcg@20"}
        assert all(0.0 <= v <= 1.0 for v in metrics[name].values())
    assert extra["protocol"] == "full" and math.isfinite(float(extra["epsilon"]))  # type: ignore[arg-type]
    alpha = extra["alpha"]
    assert alpha == "popularity only" or alpha in ALPHAS


def test_lightfr_full_ranking_evaluation() -> None:
    settings = ScaledSettings(epsilon=8.0, rounds=2, bits=16, example_cap=10)
    _check(*evaluate_private(_split(), settings, val_users=60))


def test_mf_full_ranking_evaluation() -> None:
    settings = replace(IMPLICIT_MF, rounds=2, factors=8, pretrain_epochs=5, fine_tune_epochs=5)
    metrics, extra = evaluate_private_mf_scaled(_split(), settings, val_users=60)
    _check(metrics, extra)
    assert set(metrics["mf_alone"]) == {"recall@20", "ndcg@20"}


def test_full_ranking_metrics_use_one_user_sample_for_every_scorer() -> None:
    split = _split()
    full = full_ranking_metrics(split, eval_seed=0, test_users=30)
    scores = np.random.default_rng(1).random((split.train.n_users, split.train.n_items))
    once, again = full(lambda users: scores[users]), full(lambda users: scores[users])
    assert once == again
    assert full_ranking_metrics(split, eval_seed=0, test_users=None)(lambda users: scores[users]) != once
