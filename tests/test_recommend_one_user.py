"""The one-user `LightFRModel.recommend` (the default two-stage ranking, `device_sdk.lightfr_rank.top_one`)
against a slow, obvious numpy reference built from the ±1 matrices: stage 1's candidates, the exclusions,
the plane scores, N beyond what is left, ties drawn uniformly (counted over seeds, no timing); and the
same result as a batch row and as the ``items=`` path, which share none of its code; input checks."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from device_sdk import LightFRConfig, LightFRModel, lightfr
from protocol.codes import random_signs
from protocol.errors import ModelError
from protocol.families.lightfr import LEVEL_CENTER

S = lightfr.LEVEL_SHIFT


def _model(m: int, levels: bool, seed: int, users: int = 4) -> tuple[LightFRModel, np.ndarray, list[np.ndarray]]:
    """A default-config model over codes of a few clusters (exact Hamming ties), each user folded in from
    25 items of one cluster; (model, ±1 item codes, each user's items)."""
    rng = np.random.default_rng(seed)
    f = 64
    centres = random_signs(6, f, rng)
    group = rng.integers(0, 6, m)
    D = np.where(rng.random((m, f)) < 0.15, -centres[group], centres[group]).astype(np.int8)
    model = LightFRModel(m, LightFRConfig(bits=f), n_users=users, rng=np.random.default_rng(seed))
    model.set_item_codes(D, 1)
    if levels:
        model.item_levels, model.hamming_weight = rng.integers(0, 10, m).astype(np.uint8), 2
    liked = [np.sort(rng.choice(np.flatnonzero(group == u % 6), 25, replace=False)) for u in range(users)]
    for u in range(users):
        model.fold_in(liked[u], userid=u)
    assert (model.user_weight > 0).all()  # plane users: the default ranking
    return model, D, liked


def _reference(model: LightFRModel, D: np.ndarray, u: int, exclude: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """User u's stage-1 candidates (every item of v at or below the kk-th smallest v, kk = C + |excluded|,
    less the excluded) and each item's float32 plane score, from the ±1 matrices."""
    f, B = model.config.bits, model.hamming_weight
    q = model.user_q[u].astype(np.int64)
    a = int(model.user_weight[u])
    P = int(np.abs(q).max()).bit_length()
    sign = lightfr.sign_planes(q[None, :], P)[P - 1, 0]  # the top plane: stage 1's query
    v = (D != sign[None, :]).sum(axis=1).astype(np.int64)
    levels = model.item_levels
    if levels is not None:
        lam = 2.0**S / (2.0 * a * (2.0**P - 1))
        v += np.floor((int(levels.max()) - levels.astype(np.int64)) * lam).astype(np.int64)
    kk = model.config.candidates + exclude.size
    t = np.sort(v)[kk - 1]
    assert (v <= t).sum() <= 2 * kk + 256  # below the tie cap: the set does not depend on the generator
    cand = np.setdiff1d(np.flatnonzero(v <= t), exclude)
    lv = np.full(D.shape[0], LEVEL_CENTER, np.int64) if levels is None else levels.astype(np.int64)
    exact = a * (D.astype(np.int64) @ q) + (lv << S)
    score = ((exact - (LEVEL_CENTER << S)) * (2.0 / (2**S * B * f))).astype(np.float32)
    return cand, score


@pytest.mark.parametrize("levels", [False, True])
@pytest.mark.parametrize("m", [3000, 40000])
def test_one_user_is_the_brute_force_top_n_of_its_candidates(m: int, levels: bool) -> None:
    model, D, liked = _model(m, levels, seed=m + levels)
    for u in range(4):
        cand, score = _reference(model, D, u, liked[u])
        for N in (10, cand.size + 50):  # N beyond what is left: every candidate, best first
            ids, got = model.recommend(liked[u], N=N, userid=u, rng=np.random.default_rng(u))
            assert ids.dtype == np.int64 and got.dtype == np.float32
            assert ids.size == min(N, cand.size) and np.unique(ids).size == ids.size
            assert np.isin(ids, cand).all() and not np.isin(ids, liked[u]).any()
            np.testing.assert_array_equal(got, score[ids])
            assert (np.diff(got) <= 0).all()
            # Everything the reference ranks strictly above the last one returned is returned.
            assert np.isin(cand[score[cand] > got[-1]], ids).all()


def test_one_user_equals_a_batch_row_and_the_items_path() -> None:
    model, D, liked = _model(20000, False, seed=5)
    m = model.n_items
    for u in range(4):
        one = model.recommend(liked[u], N=25, userid=u, rng=np.random.default_rng(7))
        row = model.recommend([liked[u]], N=25, userid=np.array([u]), rng=np.random.default_rng(7))
        every = model.recommend(liked[u], N=25, userid=u, items=np.arange(m), rng=np.random.default_rng(7))
        for other in (row[0][0], every[0]):
            np.testing.assert_array_equal(one[0], other)
        np.testing.assert_array_equal(one[1], row[1][0])
        np.testing.assert_array_equal(one[1], every[1])
    # A batch: each row as the one-user call that follows the previous rows' draws.
    users = np.arange(4)
    batch = model.recommend(liked, N=25, userid=users, rng=np.random.default_rng(3))
    rng = np.random.default_rng(3)
    for u in users:
        np.testing.assert_array_equal(batch[0][u], model.recommend(liked[u], N=25, userid=u, rng=rng)[0])


def test_one_user_draws_the_ties_at_the_nth_score_uniformly() -> None:
    # Three distinct codes: items of one code tie exactly, whatever the user's vector.
    rng = np.random.default_rng(11)
    m, f = 400, 64
    centres = random_signs(3, f, rng)
    group = np.repeat([0, 1, 2], [4, 60, m - 64])
    model = LightFRModel(m, LightFRConfig(bits=f, candidates=100), n_users=1, rng=np.random.default_rng(0))
    model.set_item_codes(centres[group], 1)
    liked = np.array([0, 1, 4, 5, 6])
    model.fold_in(liked, userid=0)
    first = model.recommend(liked, N=10, userid=0, rng=np.random.default_rng(0))[1]
    tied = np.flatnonzero(model.recommend(liked, N=m, userid=0, rng=np.random.default_rng(0))[1] == first[-1])
    assert 10 > (first > first[-1]).sum() and tied.size > 10  # the 10th score is shared by many items
    counts = np.zeros(m, np.int64)
    seeds = 600
    for seed in range(seeds):
        ids, got = model.recommend(liked, N=10, userid=0, rng=np.random.default_rng(seed))
        np.testing.assert_array_equal(got, first)  # the same scores every time
        counts[ids[got == first[-1]]] += 1
    at_tie = counts[counts > 0]
    slots = int((first == first[-1]).sum())
    pool = np.flatnonzero(group == group[ids[-1]])
    pool = pool[~np.isin(pool, liked)]
    assert (counts[pool] > 0).all() and counts.sum() == seeds * slots
    expected = seeds * slots / pool.size  # each tied item equally likely: binomial, sd about 8.5 here
    assert np.abs(at_tie - expected).max() < 5 * np.sqrt(expected)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"userid": -1}, ValueError, r"userid out of range \[0, 2\)"),
        ({"userid": 2}, ValueError, r"userid out of range \[0, 2\)"),
        ({"userid": 0.5}, ValueError, "userid must be integer"),
        ({"userid": 0, "N": -1}, ValueError, "N must be an integer >= 0"),
        ({"userid": 0, "user_items": [3, 500]}, ValueError, r"item id out of range \[0, 500\)"),
        ({"userid": 0, "filter_items": [-1]}, ValueError, r"item id out of range \[0, 500\)"),
        ({"userid": 0, "user_items": [0.5]}, ValueError, "item ids must be integers"),
        ({"userid": 1}, ModelError, "no trained code yet"),
    ],
)
def test_one_user_checks_its_inputs_in_one_line(kwargs: dict, error: type, message: str) -> None:
    rng = np.random.default_rng(2)
    model = LightFRModel(500, LightFRConfig(bits=64), n_users=2, rng=rng)
    model.set_item_codes(random_signs(500, 64, rng), 1)
    model.fold_in(np.arange(20), userid=0)
    with pytest.raises(error, match=message) as info:
        model.recommend(**kwargs)
    assert "\n" not in str(info.value)


def test_rerank_off_and_stage_one_alone_keep_their_contract() -> None:
    model, D, liked = _model(3000, True, seed=8)
    model.config = replace(model.config, rerank=False)
    for u in range(4):
        ids, got = model.recommend(liked[u], N=12, userid=u, rng=np.random.default_rng(u))
        row = model.recommend([liked[u]], N=12, userid=np.array([u]), rng=np.random.default_rng(u))
        np.testing.assert_array_equal(ids, row[0][0])
        np.testing.assert_array_equal(got, row[1][0])
        assert ids.size == 12 and not np.isin(ids, liked[u]).any() and (np.diff(got) <= 0).all()


def test_one_user_calls_from_several_threads_match_one_thread() -> None:
    # Each thread keeps its own scan state (the codes XOR its last user's word): calls interleaved over
    # threads return what the same calls return one after the other.
    from concurrent.futures import ThreadPoolExecutor

    model, _, liked = _model(3000, False, seed=4, users=6)
    calls = [(u % 6, seed) for seed in range(8) for u in range(6)]

    def one(call: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        u, seed = call
        return model.recommend(liked[u], N=15, userid=u, rng=np.random.default_rng(seed))

    alone = [one(c) for c in calls]
    with ThreadPoolExecutor(3) as pool:
        threaded = list(pool.map(one, calls))
    for (ids, scores), (tids, tscores) in zip(alone, threaded, strict=True):
        np.testing.assert_array_equal(ids, tids)
        np.testing.assert_array_equal(scores, tscores)
