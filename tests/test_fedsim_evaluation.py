"""Tests of fedsim.evaluation: tie-aware ranks, HR/NDCG, negative sampling, full ranking, baselines."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from fedsim.datasets import Ratings, load_lightfr_split, load_movielens
from fedsim.evaluation import (
    EvalResult,
    TieMode,
    evaluate_candidates,
    evaluate_full_ranking,
    hit_ratio,
    interaction_csr,
    ndcg,
    popularity_scores,
    random_scores,
    rank_of_positive,
    sample_negatives,
)
from fedsim.splits import leave_one_out

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
        start = time.perf_counter()
        cand = sample_negatives(3_706, users, indices[indptr[:-1]], (indptr, indices), 99, seed=0)
        assert time.perf_counter() - start < 2.0
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
        """DESIGN.md section 8: item popularity reaches HR@10 0.924 / NDCG@10 0.771 with random ties."""
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
