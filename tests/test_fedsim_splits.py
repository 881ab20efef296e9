"""Tests of fedsim.data.splits: per-user chronological and leave-one-out splits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedsim.data.loaders import load_movielens
from fedsim.data.ratings import Ratings
from fedsim.data.splits import Split, carve_validation, chronological_split, leave_one_out, split_counts
from fedsim.data.synthetic import synthetic


def _log(users: list[int], ts: list[int] | None, n_items: int = 50) -> Ratings:
    n = len(users)
    n_users = max(users) + 1
    return Ratings(
        users=np.array(users, dtype=np.int64),
        items=np.arange(n, dtype=np.int64) % n_items,
        ratings=np.arange(n, dtype=np.float64),  # rating = original row, to trace rows
        timestamps=None if ts is None else np.array(ts, dtype=np.int64),
        n_users=n_users,
        n_items=n_items,
        user_ids=np.arange(n_users),
        item_ids=np.arange(n_items),
    )


def _rows(r: Ratings) -> list[int]:
    return sorted(r.ratings.astype(int).tolist())


def _reference_chrono(r: Ratings, fractions: tuple[float, float, float]) -> tuple[set[int], ...]:
    """Slow, obvious per-user reference."""
    parts: tuple[set[int], set[int], set[int]] = (set(), set(), set())
    ts = r.timestamps if r.timestamps is not None else np.zeros(len(r), dtype=np.int64)
    for u in range(r.n_users):
        rows = sorted(np.flatnonzero(r.users == u).tolist(), key=lambda j: (ts[j], j))
        n_train, n_val, n_test = split_counts([len(rows)], fractions)[0].tolist()
        parts[0].update(rows[:n_train])
        parts[1].update(rows[n_train : n_train + n_val])
        parts[2].update(rows[n_train + n_val :])
    return parts


class TestSplitCounts:
    def test_documented_table(self) -> None:
        got = split_counts([0, 1, 2, 3, 4, 5, 9, 10, 14, 15, 25]).tolist()
        assert got == [
            [0, 0, 0],
            [1, 0, 0],
            [2, 0, 0],
            [3, 0, 0],
            [4, 0, 0],
            [3, 1, 1],  # 0.5 rounds up
            [7, 1, 1],
            [8, 1, 1],
            [12, 1, 1],
            [11, 2, 2],
            [19, 3, 3],
        ]

    def test_train_keeps_one_even_with_small_train_fraction(self) -> None:
        counts = split_counts(np.arange(1, 40), (0.1, 0.45, 0.45))
        assert (counts[:, 0] >= 1).all()
        assert (counts.sum(axis=1) == np.arange(1, 40)).all()
        assert counts[1].tolist() == [1, 0, 1]  # validation gives back first


class TestChronological:
    def test_hand_example_with_ties_and_file_order(self) -> None:
        # user 0: 10 ratings; ts ties between rows 8 and 9 (file order decides), row 0 is the latest
        users = [0] * 10 + [1] * 5 + [2]
        ts = [99, 1, 2, 3, 4, 5, 6, 7, 50, 50] + [5, 4, 3, 2, 1] + [7]
        train, val, test = chronological_split(_log(users, ts))
        assert _rows(test) == [0, 10]  # user 0 latest (ts 99), user 1 latest (ts 5, row 10)
        assert _rows(val) == [9, 11]  # equal ts 50: row 9 comes after row 8 in file order
        assert _rows(train) == [1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 14, 15]

    def test_without_timestamps_uses_file_order(self) -> None:
        train, val, test = chronological_split(_log([0] * 5, None), seed=None)
        assert (_rows(train), _rows(val), _rows(test)) == ([0, 1, 2], [3], [4])

    @pytest.mark.parametrize("fractions", [(0.8, 0.1, 0.1), (0.6, 0.2, 0.2), (0.7, 0.0, 0.3), (1.0, 0.0, 0.0)])
    def test_matches_reference_on_random_logs(self, fractions: tuple[float, float, float]) -> None:
        rng = np.random.default_rng(1)
        n = 3_000
        users = rng.integers(0, 120, size=n).tolist()
        ts = rng.integers(0, 40, size=n).tolist()  # many ties
        r = _log(users, ts)
        got = chronological_split(r, fractions)
        want = _reference_chrono(r, fractions)
        for part, ref in zip(got, want, strict=True):
            assert set(_rows(part)) == ref

    def test_partition_and_shared_id_space(self) -> None:
        r = synthetic(n_users=80, n_items=60, ratings_per_user=12, seed=2)
        split = chronological_split(r)
        assert isinstance(split, Split)
        assert sum(len(p) for p in split) == len(r)
        for part in split:
            assert (part.n_users, part.n_items) == (r.n_users, r.n_items)
            assert part.user_ids is r.user_ids or np.array_equal(part.user_ids, r.user_ids)
        assert split.train.name.endswith("[train]")
        # per user, every train timestamp <= every val timestamp <= every test timestamp
        ts = {name: part for name, part in zip(("train", "val", "test"), split, strict=True)}
        for later, earlier in (("val", "train"), ("test", "val"), ("test", "train")):
            a, b = ts[later], ts[earlier]
            assert a.timestamps is not None and b.timestamps is not None
            lo = np.full(r.n_users, np.iinfo(np.int64).max)
            np.minimum.at(lo, a.users, a.timestamps)
            hi = np.full(r.n_users, np.iinfo(np.int64).min)
            np.maximum.at(hi, b.users, b.timestamps)
            assert (hi <= lo).all()

    @pytest.mark.parametrize("bad", [(0.5, 0.5), (0.0, 0.5, 0.5), (0.8, 0.3, -0.1), (0.8, 0.1, 0.2)])
    def test_invalid_fractions(self, bad: tuple[float, ...]) -> None:
        with pytest.raises(ValueError, match="fractions"):
            chronological_split(_log([0, 0], None), bad)  # type: ignore[arg-type]


class TestLeaveOneOut:
    def test_hand_example(self) -> None:
        # user 0: 4 ratings; user 1: 2 ratings; user 2: 1 rating; user 3: 3 ratings with a ts tie
        users = [0, 0, 0, 0, 1, 1, 2, 3, 3, 3]
        ts = [4, 1, 3, 2, 9, 8, 5, 7, 7, 1]
        train, val, test = leave_one_out(_log(users, ts))
        assert _rows(test) == [0, 4, 8]
        assert _rows(val) == [2, 7]
        assert _rows(train) == [1, 3, 5, 6, 9]

    def test_without_validation(self) -> None:
        train, val, test = leave_one_out(_log([0, 0, 0, 1], None), validation=False, seed=None)
        assert (_rows(train), _rows(val), _rows(test)) == ([0, 1, 3], [], [2])
        assert val.n_items == 50

    def test_large_log_is_fast_and_one_test_per_user(self) -> None:
        r = synthetic(n_users=2_000, n_items=500, ratings_per_user=50, seed=0)
        train, val, test = leave_one_out(r)
        np.testing.assert_array_equal(np.sort(test.users), np.arange(r.n_users))
        np.testing.assert_array_equal(np.sort(val.users), np.arange(r.n_users))
        assert len(train) + len(val) + len(test) == len(r)


class TestWithoutTimestamps:
    def test_leave_one_out_holds_out_a_seeded_random_rating_and_says_so(self) -> None:
        r = _log([0] * 4 + [1] * 4, None)
        counts = np.zeros(8, dtype=np.int64)
        for seed in range(400):
            train, val, test = leave_one_out(r, seed=seed)
            assert np.array_equal(np.sort(test.users), [0, 1]) and np.array_equal(np.sort(val.users), [0, 1])
            assert len(train) + len(val) + len(test) == 8
            counts[test.ratings.astype(int)] += 1
        assert counts.min() > 70  # each of a user's 4 ratings is held out about 100 times in 400
        a, b = leave_one_out(r, seed=3), leave_one_out(r, seed=3)
        assert _rows(a.test) == _rows(b.test)
        assert test.meta["holdout"] == "uniformly random (no timestamps; seed 399)"
        assert leave_one_out(r, seed=None).test.meta["holdout"].startswith("last lines of the file")
        timed = leave_one_out(_log([0, 0], [2, 1]), seed=5)
        assert _rows(timed.test) == [0] and timed.test.meta["holdout"] == "latest by timestamp"

    def test_chronological_without_timestamps_is_a_random_split(self) -> None:
        r = _log([0] * 10, None)
        seen = {tuple(_rows(chronological_split(r, seed=s).test)) for s in range(60)}
        assert len(seen) == 10 and all(len(t) == 1 for t in seen)  # one rating per split, each held out by some seed


class TestCarveValidation:
    def test_fraction_per_user_and_partition(self) -> None:
        r = synthetic(n_users=300, n_items=200, ratings_per_user=20, seed=1)
        fit, val = carve_validation(r, 0.1, seed=0)
        assert len(fit) + len(val) == len(r)
        keys = np.concatenate([fit.users * r.n_items + fit.items, val.users * r.n_items + val.items])
        assert np.unique(keys).size == len(r)
        want = np.minimum(np.floor(r.user_counts() * 0.1 + 0.5), r.user_counts() - 1)
        np.testing.assert_array_equal(val.user_counts(), want)
        assert (fit.user_counts() >= 1).all()
        assert "seed 0" in val.meta["holdout"] and fit.name.endswith("[fit]")
        again = carve_validation(r, 0.1, seed=0)[1]
        assert np.array_equal(again.items, val.items) and not np.array_equal(
            carve_validation(r, 0.1, seed=1)[1].items, val.items
        )

    def test_invalid_fraction(self) -> None:
        with pytest.raises(ValueError, match="fraction"):
            carve_validation(_log([0, 0], None), 1.0)


@pytest.mark.data
def test_ml_100k_splits(shared_data: Path) -> None:
    r = load_movielens(shared_data / "ml-100k")
    train, val, test = leave_one_out(r)
    assert (len(train), len(val), len(test)) == (98_114, 943, 943)  # every ML-100K user has >= 20
    train, val, test = chronological_split(r)
    assert len(train) + len(val) + len(test) == 100_000
    assert np.unique(test.users).size == 943


def test_validation_carves_hold_out_unseen_positives_among_fresh_negatives() -> None:
    from dataclasses import replace

    from fedsim.evaluation.experiment import prepare, validation_carves

    timed = synthetic(n_users=120, n_items=300, ratings_per_user=15, seed=3)
    exp = prepare(replace(timed, timestamps=None), seed=0, n_negatives=20)
    carves = validation_carves(exp, 3, seed=0)
    assert [c.val.items.shape[1] for c in carves] == [21, 21, 21]
    everywhere = set(zip(exp.train.users.tolist(), exp.train.items.tolist(), strict=True))
    everywhere |= set(zip(exp.val.users.tolist(), exp.val.items[:, 0].tolist(), strict=True))
    everywhere |= set(zip(exp.test.users.tolist(), exp.test.items[:, 0].tolist(), strict=True))
    for c in carves:
        fit = set(zip(c.train.users.tolist(), c.train.items.tolist(), strict=True))
        held = list(zip(c.val.users.tolist(), c.val.items[:, 0].tolist(), strict=True))
        assert len(c.train) + len(held) == len(exp.train)
        assert not fit & set(held)  # the carve's positive is not trained on
        assert set(held) <= everywhere
        for u, row in zip(c.val.users.tolist(), c.val.items[:, 1:].tolist(), strict=True):
            assert not {(u, i) for i in row} & everywhere  # negatives: items the user has nowhere
        assert c.test is exp.test
    # Different seeds hold out different ratings (no timestamps: random); the same seed the same ones.
    assert not np.array_equal(carves[0].val.items[:, 0], carves[1].val.items[:, 0])
    again = validation_carves(exp, 2, seed=0)
    assert np.array_equal(again[1].val.items, carves[1].val.items)
    with pytest.raises(ValueError, match="k must be"):
        validation_carves(exp, -1)
    # Drawn like the LightFR authors' blocks: negatives from every item but the positive, so some are
    # the user's own training items (≈ 15 / 300 of them here).
    (loose,) = validation_carves(exp, 1, seed=0, exclude_interacted=False)
    fit = set(zip(loose.train.users.tolist(), loose.train.items.tolist(), strict=True))
    rows = zip(loose.val.users.tolist(), loose.val.items[:, 1:].tolist(), strict=True)
    negs = [(u, i) for u, row in rows for i in row]
    assert 0.02 < np.mean([p in fit for p in negs]) < 0.08
    assert not (loose.val.items[:, 1:] == loose.val.items[:, :1]).any()
    # With timestamps every carve holds out each user's latest training rating; only negatives differ.
    exp_t = prepare(timed, seed=0, n_negatives=20)
    a, b = validation_carves(exp_t, 2, seed=0)
    assert np.array_equal(a.val.items[:, 0], b.val.items[:, 0])
    assert not np.array_equal(a.val.items[:, 1:], b.val.items[:, 1:])
    ts = exp_t.train.timestamps
    assert ts is not None
    for u, i in zip(a.val.users.tolist(), a.val.items[:, 0].tolist(), strict=True):
        mine = exp_t.train.users == u
        assert ts[mine & (exp_t.train.items == i)].max() == ts[mine].max()
