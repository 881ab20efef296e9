"""The score a private run serves: chosen on validation, then tested once.

What `fedsim.private.scaled_lightfr.evaluate_private` (LightFR) and
`fedsim.private.scaled_ials.evaluate_private_ials` (implicit ALS) share, and what ``fedrec simulate``'s default
(``--model auto``) compares the two families on before it tests only the one it keeps; private MF's
`fedsim.private.mf.evaluate_private_mf_scaled` uses the same carve, α choice and full-ranking metrics.

Invariants:
- The validation figure of a `ServedScore` is the one its item-level weight α was chosen on: Recall@20 by full
  ranking of one train item carved per user (`carve_validation` with the evaluation seed, the same seeded
  sample of users for every family) for a published split, else HR@10 of the experiment's validation blocks;
  random ties.  Two families validated on the same data with the same seed are judged on the same held-out
  items and negatives.
- The test split is read only by `evaluate_served`, after the choice; `validate` never reads it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedsim.data.kgat import TrainTestSplit
from fedsim.data.ratings import Ratings
from fedsim.evaluation.ranking import (
    TieMode,
    evaluate_all_items,
    evaluate_candidates,
    expected_hits,
    popularity_scorer,
    random_scorer,
)
from fedsim.private.planner import choose_with_margin

__all__ = [
    "PrivateRunResult",
    "ServedScore",
    "carve_validation",
    "choose_alpha_full_ranking",
    "evaluate_served",
    "full_ranking_metrics",
    "validate",
]

#: A trained run and α -> a full-ranking scorer (users -> their scores of every item).
FullScorer = Callable[[Any, float], Callable[[NDArray[np.int64]], NDArray[np.float64]]]
#: A trained run, users (n,), candidate blocks (n, c) and α -> the blocks' scores (n, c).
BlockScorer = Callable[[Any, NDArray[np.int64], NDArray[np.int64], float], Any]


def carve_validation(train: Ratings, seed: int) -> tuple[Ratings, Ratings]:
    """(fit, validation): one random train item of every user with at least two moves to validation."""
    rng = np.random.default_rng(seed)
    order = np.lexsort((rng.random(len(train)), train.users))
    users = train.users[order]
    first = np.ones(users.size, dtype=bool)
    first[1:] = users[1:] != users[:-1]
    counts = np.bincount(train.users, minlength=train.n_users)
    held = first & (counts[users] >= 2)
    pick = order[held]
    rest = np.setdiff1d(np.arange(len(train)), pick)
    return train.subset(rest), train.subset(np.sort(pick))


def choose_alpha_full_ranking(
    scorer_for: Callable[[float], Any],
    fit: Any,
    val: Any,
    alphas: Sequence[float],
    *,
    val_users: int,
    eval_seed: int,
    say: Callable[[str], None] = lambda text: None,
) -> tuple[float, float]:
    """The item-level weight α by validation Recall@20 (full ranking over ``fit``'s items, a seeded sample of
    ``val_users`` users, random ties) and that Recall: the best α only if it beats the private popularity
    list (α = ∞) by more than `MARGIN_SE` paired standard errors, else ∞; without ∞ in ``alphas``, the best."""
    users = np.random.default_rng(eval_seed).choice(fit.n_users, min(val_users, fit.n_users), replace=False)
    per_user: dict[float, NDArray[np.float64]] = {}
    for a in alphas:
        r = evaluate_all_items(scorer_for(a), fit, val, k=20, users=users, seed=eval_seed)
        say(f"  validation Recall@20 with item level α={a:g}: {r.recall:.4f}")
        assert r.per_user is not None
        per_user[a] = r.per_user
    return _chosen(per_user, say)


def _chosen(per_user: dict[float, NDArray[np.float64]], say: Callable[[str], None]) -> tuple[float, float]:
    """`choose_with_margin` over the α grid's per-user validation results, against the private popularity
    list (α = ∞) when the grid has it, else the best mean (the first of equals); (α, its mean)."""
    if not per_user:
        raise ValueError("no α to choose from")
    if math.inf in per_user:
        alpha, why = choose_with_margin(per_user, floor=math.inf)
        say(f"  {why}")
    else:
        alpha = max(per_user, key=lambda a: float(per_user[a].mean()))
    return alpha, float(per_user[alpha].mean())


def full_ranking_metrics(data: Any, *, eval_seed: int, test_users: int | None) -> Callable[[Any], dict[str, float]]:
    """A function scoring one scorer on ``data``'s test split once: Recall@20 and NDCG@20 by full
    ranking over the items not in each user's train set (random ties), over every test user or a seeded
    sample of ``test_users`` of them (the same sample for every scorer)."""
    seen, test = data.train, data.test
    users = None
    if test_users is not None and test_users < seen.n_users:
        users = np.random.default_rng(eval_seed + 1).choice(seen.n_users, test_users, replace=False)

    def full(score: Any) -> dict[str, float]:
        r = evaluate_all_items(score, seen, test, k=20, seed=eval_seed, users=users)
        return {"recall@20": r.recall, "ndcg@20": r.ndcg}

    return full


@dataclass(kw_only=True)
class PrivateRunResult:
    """What every private run reports beside its model (its result types extend this), and what a `ServedScore`
    reads of it.

    Attributes
    ----------
    private_counts : the popularity release, noisy counts per item.
    epsilon : the ledger's ε (None without DP).
    delta : δ.
    mu_model, mu_pop : μ of each model round and of the popularity release (0 where nothing is noised).
    seconds, round_seconds : the run's wall time and each round's.
    """

    private_counts: NDArray[np.float64]
    epsilon: float | None
    delta: float
    mu_model: float
    mu_pop: float
    seconds: float
    round_seconds: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class ServedScore:
    """A trained private run and the score it serves, chosen on validation; not yet tested.

    Attributes
    ----------
    result : the trained run, a `PrivateRunResult` (its ``epsilon``, ``delta``, ``mu_model``, ``mu_pop``,
        ``seconds``: the ledger's).
    alpha : the chosen weight of the private item level (∞: the private popularity list alone).
    metric : what ``validation`` measures, "recall@20" (published split) or "hr@10" (validation blocks).
    validation : the chosen score's validation figure.
    protocol : the test protocol ("full", or the experiment's).
    """

    result: Any
    alpha: float
    metric: str
    validation: float
    protocol: str
    full_scorer: FullScorer
    block_scorer: BlockScorer

    def extra(self) -> dict[str, Any]:
        """The ``extra`` map of an evaluation: the ledger's ε and δ, the chosen α and its validation figure,
        the μ's, the protocol and the training seconds."""
        res = self.result
        return {
            "epsilon": res.epsilon if res.epsilon is not None else math.inf,
            "delta": res.delta,
            "alpha": self.alpha if math.isfinite(self.alpha) else "popularity only",
            "validation": self.validation,
            "validation_metric": self.metric,
            "mu_model": res.mu_model,
            "mu_popularity": res.mu_pop,
            "protocol": self.protocol,
            "train_seconds": res.seconds,
        }


def validate(
    data: Any,
    run: Callable[..., Any],
    settings: Any,
    full_scorer: FullScorer,
    block_scorer: BlockScorer,
    alphas: Sequence[float],
    *,
    eval_seed: int,
    val_users: int,
    on_round: Callable[[int, float], None] | None = None,
    log: Callable[[str], None] | None = None,
) -> ServedScore:
    """Train on ``data`` (a `TrainTestSplit`: on its train minus one carved item per user; an `Experiment`: on
    its train) with ``run(train, settings, on_round=on_round)`` and choose α from ``alphas`` on validation
    (`choose_alpha_full_ranking` or `fedsim.private.planner.choose_with_margin` against the private list, α = ∞);
    settings without rounds serve the private list alone.  ``log`` hears the validation figures."""
    say: Callable[[str], None] = log or (lambda text: None)
    alphas = alphas if settings.rounds else (math.inf,)

    def train(ratings: Ratings) -> Any:
        return run(ratings, settings, on_round=on_round)

    if isinstance(data, TrainTestSplit):
        fit, val = carve_validation(data.train, eval_seed)
        res = train(fit)
        alpha, value = choose_alpha_full_ranking(
            lambda a: full_scorer(res, a), fit, val, alphas, val_users=val_users, eval_seed=eval_seed, say=say
        )
        return ServedScore(res, alpha, "recall@20", value, "full", full_scorer, block_scorer)
    exp = data
    res = train(exp.train)
    hits: dict[float, NDArray[np.float64]] = {}
    for a in alphas:
        hits[a] = expected_hits(np.asarray(block_scorer(res, exp.val.users, exp.val.items, a)), 10)
        say(f"  validation HR@10 with item level α={a:g}: {hits[a].mean():.4f}")
    alpha, value = _chosen(hits, say)
    return ServedScore(res, alpha, "hr@10", value, exp.protocol.value, full_scorer, block_scorer)


def evaluate_served(
    data: Any, served: ServedScore, *, eval_seed: int, test_users: int | None = None
) -> dict[str, dict[str, float]]:
    """The test split scored once: the served score ("model"), the run's private popularity list
    ("private_popularity"), and the non-private popularity and random baselines; random ties.
    ``test_users`` scores a seeded sample of that many users instead of all (full ranking only)."""
    res = served.result
    if isinstance(data, TrainTestSplit):
        full = full_ranking_metrics(data, eval_seed=eval_seed, test_users=test_users)
        return {
            "model": full(served.full_scorer(res, served.alpha)),
            "private_popularity": full(served.full_scorer(res, math.inf)),
            "popularity": full(popularity_scorer(data.train)),
            "random": full(random_scorer(data.train.n_items, eval_seed)),
        }
    exp = data

    def blocks(scores: Any) -> dict[str, float]:
        r = evaluate_candidates(np.asarray(scores, dtype=np.float64), 10, TieMode.RANDOM)
        return {"hr@10": r.hr, "ndcg@10": r.ndcg}

    pop = np.bincount(exp.train.items, minlength=exp.train.n_items).astype(np.float64)
    users, items = exp.test.users, exp.test.items
    return {
        "model": blocks(served.block_scorer(res, users, items, served.alpha)),
        "private_popularity": blocks(served.block_scorer(res, users, items, math.inf)),
        "popularity": blocks(pop[items]),
        "random": blocks(np.random.default_rng(eval_seed).random(items.shape)),
    }
