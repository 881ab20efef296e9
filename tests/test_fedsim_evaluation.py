"""Tests of fedsim.evaluation.ranking: tie-aware ranks, HR/NDCG, negative sampling, full ranking, baselines."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from fedsim.data.datasets import load_amazon_book
from fedsim.data.loaders import load_lightfr_split, load_movielens
from fedsim.data.ratings import Ratings
from fedsim.data.splits import leave_one_out
from fedsim.evaluation.ranking import (
    EvalResult,
    TieMode,
    evaluate_all_items,
    evaluate_candidates,
    evaluate_full_ranking,
    evaluate_sampled,
    hamming_scorer,
    hit_ratio,
    interaction_csr,
    ndcg,
    popularity_scorer,
    popularity_scores,
    random_scorer,
    random_scores,
    rank_of_positive,
    sample_negatives,
    sample_test_blocks,
)
from protocol.codes import pack_signs

LOG2_3 = float(np.log2(3.0))

# Hand-built blocks, positive in column 0:
#   row 0: all four other candidates tie     -> greater 0, tied 4
#   row 1: three candidates strictly better  -> greater 3, tied 0
#   row 2: one tie, the rest worse           -> greater 0, tied 1
#   row 3: one better, two tied, one worse   -> greater 1, tied 2
SCORES = np.array(
    [
        [5.0, 5.0, 5.0, 5.0, 5.0],
        [1.0, 2.0, 3.0, 4.0, 0.0],
        [3.0, 3.0, 1.0, 1.0, -np.inf],
        [2.0, 9.0, 2.0, 2.0, 0.0],
    ]
)


def _brute_expectation(scores: npt.NDArray[np.float64], k: int) -> tuple[float, float]:
    """Enumerate every tie position of every row (the obvious definition of RANDOM ties)."""
    hrs, nds = [], []
    for row in scores:
        greater = int((row[1:] > row[0]).sum())
        tied = int((row[1:] == row[0]).sum())
        ranks = np.arange(greater, greater + tied + 1)
        hrs.append(float((ranks < k).mean()))
        nds.append(float(np.where(ranks < k, 1.0 / np.log2(ranks + 2.0), 0.0).mean()))
    return float(np.mean(hrs)), float(np.mean(nds))


class TestRanks:
    def test_optimistic_known_answer(self) -> None:
        np.testing.assert_array_equal(rank_of_positive(SCORES, TieMode.OPTIMISTIC), [0, 3, 0, 1])
        res = evaluate_candidates(SCORES, k=2, tie_mode=TieMode.OPTIMISTIC)
        assert res.hr == pytest.approx(3 / 4)
        assert res.ndcg == pytest.approx((1 + 0 + 1 + 1 / LOG2_3) / 4)

    def test_random_exact_expectation_known_answer(self) -> None:
        res = evaluate_candidates(SCORES, k=2)
        # row 0: ranks 0..4 -> HR 2/5; row 1: 0; row 2: ranks 0..1 -> 1; row 3: ranks 1..3 -> 1/3
        assert res.expected and res.tie_mode is TieMode.RANDOM
        assert res.hr == pytest.approx((2 / 5 + 0 + 1 + 1 / 3) / 4)
        nd = ((1 + 1 / LOG2_3) / 5 + 0 + (1 + 1 / LOG2_3) / 2 + (1 / LOG2_3) / 3) / 4
        assert res.ndcg == pytest.approx(nd)

    def test_random_sampling_converges_to_expectation(self) -> None:
        tiled = np.tile(SCORES, (500, 1))
        runs = [evaluate_candidates(tiled, k=2, rng=np.random.default_rng(s)) for s in range(40)]
        exact = evaluate_candidates(tiled, k=2)
        assert not runs[0].expected
        assert np.mean([r.hr for r in runs]) == pytest.approx(exact.hr, abs=3e-3)
        assert np.mean([r.ndcg for r in runs]) == pytest.approx(exact.ndcg, abs=3e-3)
        ranks = np.stack([rank_of_positive(SCORES, TieMode.RANDOM, np.random.default_rng(s)) for s in range(4000)])
        # row 0 lands uniformly on 0..4, row 3 uniformly on 1..3, rows 1-2 as expected
        np.testing.assert_allclose(np.bincount(ranks[:, 0], minlength=5) / 4000, 0.2, atol=0.03)
        assert set(np.unique(ranks[:, 3]).tolist()) == {1, 2, 3}
        assert set(np.unique(ranks[:, 1]).tolist()) == {3}
        assert set(np.unique(ranks[:, 2]).tolist()) == {0, 1}

    @pytest.mark.parametrize("k", [1, 3, 10])
    def test_closed_form_matches_enumeration(self, k: int) -> None:
        rng = np.random.default_rng(k)
        scores = rng.integers(0, 4, size=(300, 20)).astype(np.float64)  # heavy ties
        hr, nd = _brute_expectation(scores, k)
        res = evaluate_candidates(scores, k=k)
        assert (res.hr, res.ndcg) == pytest.approx((hr, nd))
        # optimistic >= expected random, with equality only without ties
        opt = evaluate_candidates(scores, k=k, tie_mode=TieMode.OPTIMISTIC)
        assert opt.hr > res.hr and opt.ndcg > res.ndcg

    def test_no_ties_modes_agree(self) -> None:
        scores = np.random.default_rng(0).random((200, 50))
        a = evaluate_candidates(scores, tie_mode=TieMode.OPTIMISTIC)
        b = evaluate_candidates(scores, rng=np.random.default_rng(1))
        c = evaluate_candidates(scores)
        assert a.hr == b.hr == pytest.approx(c.hr)
        assert a.ndcg == b.ndcg == pytest.approx(c.ndcg)

    def test_errors(self) -> None:
        with pytest.raises(ValueError, match="needs an rng"):
            rank_of_positive(SCORES, TieMode.RANDOM)
        with pytest.raises(ValueError, match="NaN"):
            evaluate_candidates(np.array([[np.nan, 1.0]]))
        with pytest.raises(ValueError, match="2-D"):
            evaluate_candidates(np.array([1.0, 2.0]))
        with pytest.raises(ValueError, match="no test rows"):
            evaluate_candidates(np.zeros((0, 5)))
        with pytest.raises(ValueError, match="k must be"):
            evaluate_candidates(SCORES, k=0)


class TestMetrics:
    def test_hit_ratio_and_ndcg(self) -> None:
        ranks = np.array([0, 1, 9, 10, 40])
        assert hit_ratio(ranks, 10) == pytest.approx(3 / 5)
        assert ndcg(ranks, 10) == pytest.approx((1 + 1 / LOG2_3 + 1 / np.log2(11)) / 5)
        assert hit_ratio(ranks, 1) == ndcg(ranks, 1) == pytest.approx(1 / 5)
        with pytest.raises(ValueError, match="non-empty"):
            hit_ratio(np.array([], dtype=np.int64), 10)

    def test_str(self) -> None:
        res = EvalResult(0.924, 0.771, 1002, 10, TieMode.RANDOM)
        assert str(res) == "HR@10 0.9240  NDCG@10 0.7710  (n=1002, ties=random)"
        opt = EvalResult(0.5, 0.25, 3, 5, TieMode.OPTIMISTIC)
        assert str(opt) == "HR@5 0.5000  NDCG@5 0.2500  (n=3, ties=optimistic)"
        assert "ties=random, expected" in str(EvalResult(0.1, 0.1, 1, 10, TieMode.RANDOM, expected=True))


def _random_csr(n_users: int, n_items: int, per_user: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Each user gets ``per_user`` distinct items: a random offset plus a fixed stride (cheap to build)."""
    stride = n_items // per_user
    offsets = np.random.default_rng(seed).integers(0, n_items, size=(n_users, 1))
    items = np.sort((offsets + np.arange(per_user) * stride) % n_items, axis=1)
    indptr = np.arange(n_users + 1, dtype=np.int64) * per_user
    return indptr, items.ravel().astype(np.int64)


class TestSampleNegatives:
    def test_properties(self) -> None:
        n_users, n_items = 300, 120
        indptr, indices = _random_csr(n_users, n_items, 40, seed=1)
        users = np.arange(n_users)
        positives = indices[indptr[:-1]]  # one interacted item per user
        cand = sample_negatives(n_items, users, positives, (indptr, indices), 49, seed=7)
        assert cand.shape == (n_users, 50) and cand.dtype == np.int64
        np.testing.assert_array_equal(cand[:, 0], positives)
        for u in range(n_users):
            row = cand[u]
            assert np.unique(row).size == 50
            assert not np.isin(row[1:], indices[indptr[u] : indptr[u + 1]]).any()
        again = sample_negatives(n_items, users, positives, (indptr, indices), 49, seed=7)
        np.testing.assert_array_equal(cand, again)
        other = sample_negatives(n_items, users, positives, (indptr, indices), 49, seed=8)
        assert not np.array_equal(cand, other)

    def test_uniform_over_allowed_items(self) -> None:
        # one user who rated items 0..9 of 20; 10 free items, draw 5 each time
        indptr, indices = np.array([0, 10]), np.arange(10)
        cand = sample_negatives(
            20, np.zeros(4000, dtype=np.int64), np.zeros(4000, dtype=np.int64), (indptr, indices), 5, seed=0
        )
        counts = np.bincount(cand[:, 1:].ravel(), minlength=20)
        assert counts[:10].sum() == 0
        np.testing.assert_allclose(counts[10:] / counts[10:].sum(), 0.1, atol=0.01)

    def test_dense_users_and_infeasible(self) -> None:
        n_items = 200
        # user 0 rated all but 6 items (forces the exact fallback), user 1 rated nothing
        indptr = np.array([0, 194, 194])
        indices = np.arange(194)
        cand = sample_negatives(n_items, [0, 1, 0], [3, 199, 5], (indptr, indices), 6, seed=1)
        assert sorted(cand[0, 1:].tolist()) == list(range(194, 200))
        assert 199 not in cand[1, 1:] and np.unique(cand[1]).size == 7
        with pytest.raises(ValueError, match="fewer than 7 items"):
            sample_negatives(n_items, [0], [3], (indptr, indices), 7, seed=1)
        with pytest.raises(ValueError, match="outside"):
            sample_negatives(n_items, [5], [3], (indptr, indices), 3, seed=1)

    def test_fast_at_ml_1m_scale(self) -> None:
        indptr, indices = _random_csr(6_040, 3_706, 165, seed=3)
        users = np.arange(6_040)
        start = time.process_time()  # CPU time: a loaded machine does not lengthen it
        cand = sample_negatives(3_706, users, indices[indptr[:-1]], (indptr, indices), 99, seed=0)
        # 0.09-0.13 s of CPU, idle or beside two CPU burners; numpy 2's hash-based np.unique in place of
        # the sort-based one takes 0.77-0.88 s (and 2-8 s of wall time on a loaded machine)
        assert time.process_time() - start < 0.5
        assert cand.shape == (6_040, 100)

    def test_interaction_csr(self) -> None:
        r = Ratings(
            users=np.array([1, 0, 1, 1], dtype=np.int64),
            items=np.array([2, 1, 0, 2], dtype=np.int64),
            ratings=np.ones(4),
            timestamps=None,
            n_users=3,
            n_items=3,
            user_ids=np.arange(3),
            item_ids=np.arange(3),
        )
        csr = interaction_csr(r, r.subset(np.array([1])))
        np.testing.assert_array_equal(csr.indptr, [0, 1, 3, 3])
        np.testing.assert_array_equal(csr.indices, [1, 0, 2])


def _ratings(users: list[int], items: list[int], n_users: int, n_items: int) -> Ratings:
    return Ratings(
        users=np.array(users, dtype=np.int64),
        items=np.array(items, dtype=np.int64),
        ratings=np.ones(len(users)),
        timestamps=None,
        n_users=n_users,
        n_items=n_items,
        user_ids=np.arange(n_users),
        item_ids=np.arange(n_items),
    )


class TestFullRanking:
    def test_known_answer(self) -> None:
        # 1 user, 5 items; train = {1}; test item 0 scores 2; item 1 (train) scores 9 and is excluded;
        # items 2, 3 tie with 2; item 4 scores 1 -> greater 0, tied 2
        train = _ratings([0], [1], 1, 5)
        test = _ratings([0], [0], 1, 5)
        scores = np.array([[2.0, 9.0, 2.0, 2.0, 1.0]])
        opt = evaluate_full_ranking(lambda u: scores[u], train, test, k=1, tie_mode=TieMode.OPTIMISTIC)
        assert (opt.hr, opt.ndcg, opt.n) == (1.0, 1.0, 1)
        rnd = evaluate_full_ranking(lambda u: scores[u], train, test, k=1)
        assert rnd.hr == pytest.approx(1 / 3) and rnd.expected

    def test_matches_candidate_reference(self) -> None:
        rng = np.random.default_rng(4)
        n_users, n_items = 37, 25
        pairs = np.unique(rng.integers(0, n_users, 400) * n_items + rng.integers(0, n_items, 400))
        users, items = pairs // n_items, pairs % n_items
        is_test = rng.random(pairs.size) < 0.2
        train = _ratings(users[~is_test].tolist(), items[~is_test].tolist(), n_users, n_items)
        test = _ratings(users[is_test].tolist(), items[is_test].tolist(), n_users, n_items)
        table = rng.integers(0, 5, size=(n_users, n_items)).astype(np.float64)
        # reference: build each test pair's candidate row = positive + every non-train item but itself
        rows = []
        for u, i in zip(test.users.tolist(), test.items.tolist(), strict=True):
            rated = set(train.items[train.users == u].tolist())
            others = [j for j in range(n_items) if j not in rated and j != i]
            rows.append(np.concatenate([[table[u, i]], table[u, others], np.full(n_items, -np.inf)])[:n_items])
        ref_scores = np.array(rows)
        for mode, k in itertools.product(TieMode, (1, 5)):
            got = evaluate_full_ranking(lambda b: table[b], train, test, k=k, tie_mode=mode, batch_size=4)
            want = evaluate_candidates(ref_scores, k=k, tie_mode=mode)
            assert (got.hr, got.ndcg, got.n) == pytest.approx((want.hr, want.ndcg, want.n))
        sampled = evaluate_full_ranking(lambda b: table[b], train, test, rng=np.random.default_rng(0))
        assert not sampled.expected and 0.0 <= sampled.hr <= 1.0

    def test_bad_score_shape(self) -> None:
        train, test = _ratings([0], [1], 1, 5), _ratings([0], [0], 1, 5)
        with pytest.raises(ValueError, match="shape"):
            evaluate_full_ranking(lambda u: np.zeros((len(u), 4)), train, test)


def test_baselines() -> None:
    train = _ratings([0, 1, 1, 2], [2, 2, 0, 2], 3, 4)
    pop = popularity_scores(train)
    assert pop.dtype == np.float64
    np.testing.assert_array_equal(pop, [1.0, 0.0, 3.0, 0.0])
    a = random_scores((3, 4), np.random.default_rng(0))
    b = random_scores((3, 4), np.random.default_rng(0))
    assert a.shape == (3, 4) and np.array_equal(a, b)
    # a random scorer ranks uniformly: HR@10 among 50 candidates is about 10/50
    res = evaluate_candidates(random_scores((20_000, 50), np.random.default_rng(1)))
    assert res.hr == pytest.approx(0.2, abs=0.01)


@pytest.mark.data
class TestKnownAnswersRealData:
    def test_popularity_on_lightfr_filmtrust_split(self, shared_data: Path) -> None:
        """docs/design.md §8: item popularity reaches HR@10 0.924 / NDCG@10 0.771 with random ties."""
        sp = load_lightfr_split(shared_data / "filmtrust-lightfr-split")
        scores = popularity_scores(sp.train)[sp.test.candidates]
        runs = [evaluate_candidates(scores, k=10, rng=np.random.default_rng(s)) for s in range(5)]
        assert np.mean([r.hr for r in runs]) == pytest.approx(0.924, abs=0.01)
        assert np.mean([r.ndcg for r in runs]) == pytest.approx(0.771, abs=0.01)
        exact = evaluate_candidates(scores, k=10)
        assert (exact.hr, exact.ndcg) == pytest.approx((0.9236, 0.7701), abs=1e-4)
        opt = evaluate_candidates(scores, k=10, tie_mode=TieMode.OPTIMISTIC)
        assert (opt.hr, opt.ndcg) == pytest.approx((0.9271, 0.7749), abs=1e-4)

    def test_popularity_on_ml_100k_leave_one_out_99_negatives(self, shared_data: Path) -> None:
        r = load_movielens(shared_data / "ml-100k")
        train, val, test = leave_one_out(r)
        cand = sample_negatives(r.n_items, test.users, test.items, interaction_csr(train, val, test), 99, seed=0)
        scores = popularity_scores(train)[cand]
        rnd = evaluate_candidates(scores)
        opt = evaluate_candidates(scores, tie_mode=TieMode.OPTIMISTIC)
        assert (rnd.hr, rnd.ndcg) == pytest.approx((0.4016, 0.2234), abs=1e-3)
        assert (opt.hr, opt.ndcg) == pytest.approx((0.4030, 0.2246), abs=1e-3)


# ------------------------------------------------------------------ full ranking, Recall@k / NDCG@k


def _split_log(n_users: int, n_items: int, density: float, test_share: float, seed: int) -> tuple[Ratings, Ratings]:
    rng = np.random.default_rng(seed)
    inter = rng.random((n_users, n_items)) < density
    users, items = np.nonzero(inter)
    is_test = rng.random(users.size) < test_share
    return (
        _ratings(users[~is_test].tolist(), items[~is_test].tolist(), n_users, n_items),
        _ratings(users[is_test].tolist(), items[is_test].tolist(), n_users, n_items),
    )


def _orders(scores: npt.NDArray[np.float64], cands: list[int]) -> list[list[int]]:
    """Every order of ``cands`` that sorts them by decreasing score (all equally likely under RANDOM ties)."""
    groups = sorted({float(scores[i]) for i in cands}, reverse=True)
    blocks = [[i for i in cands if scores[i] == g] for g in groups]
    return [sum(map(list, combo), []) for combo in itertools.product(*(itertools.permutations(b) for b in blocks))]


def _metrics_of_order(order: list[int], relevant: set[int], k: int) -> tuple[float, float]:
    gains = [1.0 / np.log2(p + 2.0) for p, i in enumerate(order[:k]) if i in relevant]
    ideal = sum(1.0 / np.log2(p + 2.0) for p in range(min(k, len(relevant))))
    return len(gains) / len(relevant), sum(gains) / ideal


def _reference(
    table: npt.NDArray[np.float64], train: Ratings, test: Ratings, k: int, mode: str
) -> tuple[float, float, int]:
    """The obvious per-user definition: candidates = items not in train and not -inf; relevant = test
    items not in train; ``mode`` "expected" averages over every tie order, "optimistic" puts relevant
    items first among equal scores."""
    recalls, ndcgs = [], []
    for u in range(train.n_users):
        seen = set(train.items[train.users == u].tolist())
        relevant = set(test.items[test.users == u].tolist()) - seen
        if not relevant:
            continue
        cands = [i for i in range(train.n_items) if i not in seen and table[u, i] > -np.inf]
        if mode == "optimistic":
            orders = [sorted(cands, key=lambda i: (-table[u, i], i not in relevant))]
        else:
            orders = _orders(table[u], cands)
        per = np.array([_metrics_of_order(o, relevant, k) for o in orders])
        recalls.append(per[:, 0].mean())
        ndcgs.append(per[:, 1].mean())
    return float(np.mean(recalls)), float(np.mean(ndcgs)), len(recalls)


class TestAllItems:
    @pytest.mark.parametrize("k", [1, 5, 20])
    def test_matches_reference_without_ties(self, k: int) -> None:
        train, test = _split_log(60, 700, 0.03, 0.3, seed=k)
        rng = np.random.default_rng(1)
        X, Y = rng.normal(size=(60, 8)), rng.normal(size=(700, 8))
        table = (X.astype(np.float32) @ Y.astype(np.float32).T).astype(np.float64)
        want = _reference(table, train, test, k, "optimistic")
        for scorer in ((X, Y), lambda u: table[u]):
            for mode in TieMode:
                got = evaluate_all_items(scorer, train, test, k=k, tie_mode=mode, batch_size=7)
                assert (got.recall, got.ndcg, got.n_users) == pytest.approx(want, rel=1e-9)
                assert got.metrics() == {f"recall@{k}": got.recall, f"ndcg@{k}": got.ndcg}

    def test_optimistic_with_ties_matches_reference(self) -> None:
        train, test = _split_log(50, 400, 0.05, 0.4, seed=3)
        table = np.random.default_rng(2).integers(0, 4, size=(50, 400)).astype(np.float64)
        for k in (3, 20):
            got = evaluate_all_items(lambda u: table[u].astype(np.int8), train, test, k=k, tie_mode=TieMode.OPTIMISTIC)
            assert (got.recall, got.ndcg, got.n_users) == pytest.approx(_reference(table, train, test, k, "optimistic"))

    def test_random_ties_average_to_the_exact_expectation(self) -> None:
        # 4 users x 7 items, scores in {0, 1, 2}: few enough tie orders to enumerate
        train = _ratings([0, 1, 2, 2, 3], [0, 1, 2, 3, 6], 4, 7)
        test = _ratings([0, 0, 1, 2, 3, 3], [1, 4, 2, 5, 0, 5], 4, 7)
        table = np.array(
            [[2, 1, 1, 1, 2, 0, 1], [1, 2, 1, 1, 1, 0, 0], [0, 0, 2, 2, 1, 1, 1], [1, 1, 0, 1, 2, 1, 0]],
            dtype=np.float64,
        )
        table[1, 6] = -np.inf  # never recommended
        want = _reference(table, train, test, 2, "expected")
        runs = np.array(
            [
                [r.recall, r.ndcg]
                for r in (evaluate_all_items(lambda u: table[u], train, test, k=2, seed=s) for s in range(1500))
            ]
        )
        sem = runs.std(axis=0) / np.sqrt(len(runs))
        assert np.all(np.abs(runs.mean(axis=0) - want[:2]) < 4 * sem + 1e-12)
        a = evaluate_all_items(lambda u: table[u], train, test, k=2, seed=7)
        b = evaluate_all_items(lambda u: table[u], train, test, k=2, seed=7)
        assert a == b and a.seed == 7  # seeded: reproducible

    def test_edge_cases(self) -> None:
        # 3 items < k; user 1's test item is also in train (dropped: user 1 not evaluated); user 2 has none
        train = _ratings([0, 1, 1], [0, 0, 2], 3, 3)
        test = _ratings([0, 0, 1], [1, 2, 0], 3, 3)
        got = evaluate_all_items(lambda u: np.zeros((len(u), 3)), train, test, k=20)
        assert (got.recall, got.ndcg, got.n_users) == (1.0, 1.0, 1)
        with pytest.raises(ValueError, match="nothing to evaluate"):
            evaluate_all_items(lambda u: np.zeros((len(u), 3)), train, test, users=[1, 2])

    def test_users_subset(self) -> None:
        train, test = _split_log(40, 100, 0.1, 0.3, seed=5)
        table = np.random.default_rng(0).random((40, 100))
        full = evaluate_all_items(lambda u: table[u], train, test, k=5)
        part = evaluate_all_items(lambda u: table[u], train, test, k=5, users=np.arange(20))
        assert part.n_users < full.n_users
        sub_train, sub_test = train.subset(train.users < 20), test.subset(test.users < 20)
        assert part == evaluate_all_items(lambda u: table[u], sub_train, sub_test, k=5)

    def test_errors(self) -> None:
        train, test = _split_log(10, 30, 0.2, 0.3, seed=0)
        with pytest.raises(ValueError, match="shape"):
            evaluate_all_items(lambda u: np.zeros((len(u), 29)), train, test)
        with pytest.raises(ValueError, match="NaN"):
            evaluate_all_items(lambda u: np.full((len(u), 30), np.nan), train, test)
        with pytest.raises(ValueError, match="factors"):
            evaluate_all_items((np.zeros((10, 4)), np.zeros((29, 4))), train, test)
        with pytest.raises(ValueError, match="dtype"):
            evaluate_all_items(lambda u: np.zeros((len(u), 30), dtype=np.complex64), train, test)
        with pytest.raises(ValueError, match="id space"):
            evaluate_all_items(lambda u: np.zeros((len(u), 30)), train, _ratings([0], [0], 10, 31))

    def test_hamming_scorer(self) -> None:
        rng = np.random.default_rng(0)
        for bits in (5, 64, 100):
            b = np.where(rng.random((9, bits)) < 0.5, -1, 1).astype(np.int8)
            d = np.where(rng.random((40, bits)) < 0.5, -1, 1).astype(np.int8)
            score = hamming_scorer(pack_signs(b), pack_signs(d), bits)
            want = bits - (b[:, None, :] != d[None, :, :]).sum(axis=2)
            got = score(np.arange(9))
            assert got.dtype == np.int16
            np.testing.assert_array_equal(got, want)
        with pytest.raises(ValueError, match="word-major"):
            hamming_scorer(pack_signs(b), pack_signs(d).astype(np.int64), 100)

    def test_baseline_scorers(self) -> None:
        train, test = _split_log(30, 50, 0.2, 0.3, seed=1)
        pop = popularity_scorer(train)(np.arange(3))
        np.testing.assert_array_equal(pop, np.broadcast_to(popularity_scores(train), (3, 50)))
        r1 = random_scorer(50, seed=4)(np.arange(3))
        assert r1.shape == (3, 50) and np.array_equal(r1, random_scorer(50, seed=4)(np.arange(3)))
        res = evaluate_all_items(popularity_scorer(train), train, test, k=10)
        assert 0.0 < res.recall <= 1.0


class TestSampledOnSplit:
    def test_blocks(self) -> None:
        train, test = _split_log(80, 300, 0.05, 0.4, seed=2)
        users, cand = sample_test_blocks(train, test, n_negatives=20, seed=3)
        assert np.array_equal(users, np.unique(test.users)) and cand.shape == (users.size, 21)
        for u, row in zip(users.tolist(), cand, strict=True):
            tr = set(train.items[train.users == u].tolist())
            te = set(test.items[test.users == u].tolist())
            assert int(row[0]) in te
            assert not (set(row[1:].tolist()) & (tr | te)) and len(set(row.tolist())) == 21
        again = sample_test_blocks(train, test, n_negatives=20, seed=3)
        assert np.array_equal(again[1], cand)

    def test_test_item_is_uniform(self) -> None:
        train = _ratings([0], [0], 1, 60)
        test = _ratings([0, 0, 0], [1, 2, 3], 1, 60)
        rng = np.random.default_rng(0)
        picks = [int(sample_test_blocks(train, test, 5, rng)[1][0, 0]) for _ in range(1500)]
        counts = np.bincount(picks, minlength=4)[1:]
        assert counts.min() > 420  # each about 500

    def test_scoring_matches_candidates(self) -> None:
        train, test = _split_log(50, 200, 0.05, 0.4, seed=4)
        users, cand = sample_test_blocks(train, test, n_negatives=30, seed=0)
        rng = np.random.default_rng(1)
        X, Y = rng.normal(size=(50, 6)), rng.normal(size=(200, 6))
        table = X.astype(np.float32) @ Y.astype(np.float32).T
        want = evaluate_candidates(np.take_along_axis(table[users], cand, axis=1), k=10)
        for scorer in ((X, Y), lambda u: table[u]):
            got = evaluate_sampled(scorer, users, cand, k=10, batch_size=9)
            assert (got.hr, got.ndcg, got.n) == pytest.approx((want.hr, want.ndcg, want.n), rel=1e-5)
        assert got.metrics() == {"hr@10": got.hr, "ndcg@10": got.ndcg}


@pytest.mark.data
def test_popularity_on_amazon_book_full_ranking(shared_data: Path) -> None:
    """Item popularity on amazon-book's own split, Recall@20 / NDCG@20 over all non-train items
    (every 5th user, to stay fast; all 70,591 users give 0.0287 / 0.0123)."""
    sp = load_amazon_book(shared_data)
    every_5th = np.arange(0, sp.train.n_users, 5)
    res = evaluate_all_items(popularity_scorer(sp.train), sp.train, sp.test, k=20, seed=0, users=every_5th)
    assert res.n_users == 14_115
    assert (res.recall, res.ndcg) == pytest.approx((0.0285, 0.0121), abs=2e-4)
