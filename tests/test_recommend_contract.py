"""One `recommend` contract (`device_sdk.retrieval.Recommender`) checked against every model family.

Each family's test class is a few lines: it builds a model whose global item model has two taste
groups (even items and odd items, identical representations within a group, like implicit's
checkerboard) and folds in users.  The checks are shared (implicit's RecommenderBaseTestMixin idea).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import scipy.sparse as sp

from device_sdk.family import FederatedModel
from device_sdk.felb import FELBConfig, FELBModel
from device_sdk.fnmf import FNMFConfig, FNMFModel
from device_sdk.ials import IALSConfig, IALSModel
from device_sdk.mf import MFConfig, MFModel
from device_sdk.models import LightFRConfig, LightFRModel
from protocol.codes import random_signs
from protocol.errors import ModelError

M = 20
EVENS = np.arange(0, M, 2)
ODDS = np.arange(1, M, 2)


def _groups(k: int) -> np.ndarray:
    """(k, M) components: component 0 holds the even items, component 1 the odd ones."""
    V = np.zeros((k, M))
    V[0, EVENS] = 1.0
    V[1, ODDS] = 1.0
    return V


class RecommenderContract:
    """Checks every family passes; a subclass provides `make` (a model with the two-group item
    model and room for three users) and `fold` (fold in a user's liked items)."""

    def make(self, seed: int = 0) -> Any:
        raise NotImplementedError

    def fold(self, model: Any, liked: np.ndarray, userid: int) -> None:
        raise NotImplementedError

    def ready(self, seed: int = 0) -> Any:
        """A model with user 0 liking the even items but 0, user 1 the odd ones, user 2 item 2."""
        model = self.make(seed)
        for u, liked in enumerate([EVENS[1:], ODDS, np.array([2])]):
            self.fold(model, liked, u)
        return model

    def test_is_a_federated_model(self) -> None:
        assert isinstance(self.make(), FederatedModel)

    def test_withheld_item_liked_by_similar_users_ranks_first(self) -> None:
        model = self.ready()
        ids, scores = model.recommend(EVENS[1:], N=5)
        assert ids[0] == 0
        assert ids.dtype == np.int64 and scores.dtype == np.float32
        assert np.all(np.diff(scores) <= 0) and scores[0] > scores[1]
        assert not np.isin(ids, EVENS[1:]).any()
        ids, _ = model.recommend(ODDS, N=3, userid=1)
        assert ids.size == 3 and np.isin(ids, EVENS).all()  # odd items all liked: evens follow

    def test_filters(self) -> None:
        model = self.ready()
        ids, _ = model.recommend(EVENS[1:], N=M)
        assert ids.size == M - 9 and set(ids) == set(range(M)) - set(EVENS[1:])
        ids, _ = model.recommend(EVENS[1:], N=M, filter_items=np.array([0, 5]))
        assert ids.size == M - 11 and not np.isin(ids, [0, 5]).any()
        ids, _ = model.recommend(EVENS[1:], N=M, filter_already_liked_items=False)
        assert ids.size == M
        ids, _ = model.recommend(None, N=3, items=np.array([1, 3, 0, 7]))
        assert ids[0] == 0 and set(ids) <= {0, 1, 3, 7} and ids.size == 3
        ids, _ = model.recommend(sp.csr_matrix(np.eye(M)[[2]]), N=M)
        assert ids.size == M - 1 and 2 not in ids

    def test_batch_equals_single_calls_and_pads(self) -> None:
        model = self.ready()
        liked = [EVENS[1:], ODDS, np.arange(M - 1)]
        users = np.arange(3)
        for user_items in (
            liked,
            sp.csr_matrix(
                (
                    np.ones(sum(a.size for a in liked)),
                    (np.repeat(users, [a.size for a in liked]), np.concatenate(liked)),
                ),
                shape=(3, M),
            ),
        ):
            ids, scores = model.recommend(user_items, N=4, userid=users)
            assert ids.shape == scores.shape == (3, 4)
            assert ids.dtype == np.int64 and scores.dtype == np.float32
            assert ids[2].tolist()[1:] == [-1, -1, -1] and ids[2, 0] == M - 1
            assert np.all(scores[2, 1:] == -np.inf)
            for u in range(2):
                one_ids, one_scores = model.recommend(liked[u], N=4, userid=u)
                assert np.array_equal(scores[u], one_scores)  # the same scores, rank by rank
                assert not np.isin(ids[u], liked[u]).any()

    def test_ties_are_broken_at_random_by_default_and_repeatably_when_seeded(self) -> None:
        model = self.ready(seed=1)
        tied = np.array([0, 4, 6, 8])  # one group: identical scores for user 0
        firsts = [int(model.recommend(None, N=1, items=tied)[0][0]) for _ in range(200)]
        counts = np.bincount(firsts, minlength=M)[tied]
        assert counts.min() > 20, counts  # ~50 each
        a = model.recommend(None, N=3, items=tied, rng=np.random.default_rng(7))
        b = model.recommend(None, N=3, items=tied, rng=np.random.default_rng(7))
        assert np.array_equal(a[0], b[0])

    def test_misuse(self) -> None:
        model = self.make()
        with pytest.raises(ModelError):
            model.recommend(np.array([1]))  # no user trained yet
        model = self.ready()
        with pytest.raises(ValueError, match="out of range"):
            model.recommend(np.array([M]))
        with pytest.raises(ValueError, match="N must be"):
            model.recommend(np.array([1]), N=-1)
        with pytest.raises(ValueError, match="userid"):
            model.recommend(np.array([1]), userid=7)
        with pytest.raises(ValueError, match="rows"):
            model.recommend([EVENS], userid=np.arange(2))
        with pytest.raises(ValueError, match="out of range"):
            model.recommend(None, items=np.array([-1]))
        assert model.recommend(None, N=0)[0].size == 0

    def test_save_load_keeps_recommendations(self, tmp_path: Path) -> None:
        model = self.ready()
        model.save(tmp_path / "m.fedrec")
        back = type(model).load(tmp_path / "m.fedrec", rng=np.random.default_rng(3))
        a = model.recommend(EVENS[1:], N=8, userid=0, rng=np.random.default_rng(5))
        b = back.recommend(EVENS[1:], N=8, userid=0, rng=np.random.default_rng(5))
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


class TestLightFRPlanes(RecommenderContract):
    """The default device model: a ±1 code trained by DCD, ranking with its ridge vector's bit-planes."""

    CONFIG = LightFRConfig(bits=32, rating_range=None)

    def make(self, seed: int = 0) -> LightFRModel:
        model = LightFRModel(M, self.CONFIG, n_users=3, rng=np.random.default_rng(seed))
        c = random_signs(1, 32, np.random.default_rng(seed))[0]
        model.set_item_codes(np.where((np.arange(M) % 2 == 0)[:, None], c, -c).astype(np.int8), version=1)
        return model

    def fold(self, model: LightFRModel, liked: np.ndarray, userid: int) -> None:
        model.fold_in(liked, userid=userid)


class TestLightFR(TestLightFRPlanes):
    """Ranking with the ±1 code itself (rank_planes = 0)."""

    CONFIG = LightFRConfig(bits=32, rating_range=None, rank_planes=0)

    def test_item_levels_enter_the_score(self) -> None:
        model = self.ready()
        levels = np.zeros(M, np.uint8)
        levels[6] = 3
        model.item_levels, model.hamming_weight = levels, 2
        ids, scores = model.recommend(None, N=2, items=np.array([0, 4, 6]))
        assert ids[0] == 6 and scores[0] - scores[1] == pytest.approx(3 / (32 * 2))


class TestMF(RecommenderContract):
    def make(self, seed: int = 0) -> MFModel:
        model = MFModel(M, MFConfig(factors=2), n_users=3, rng=np.random.default_rng(seed))
        model.set_global(b"", (2.0 * _groups(2).T).astype("<f8").tobytes(), 1)
        return model

    def fold(self, model: MFModel, liked: np.ndarray, userid: int) -> None:
        model.fold_in(liked, np.full(liked.size, 5.0), userid=userid)


class TestFELB(RecommenderContract):
    def make(self, seed: int = 0) -> FELBModel:
        model = FELBModel(M, FELBConfig(rank=2), rng=np.random.default_rng(seed))
        model.set_global(b"", _groups(2).astype("<f8").tobytes(), 1)
        return model

    def fold(self, model: FELBModel, liked: np.ndarray, userid: int) -> None:
        model.fold_in(liked, userid=userid)


class TestFNMF(RecommenderContract):
    def make(self, seed: int = 0) -> FNMFModel:
        model = FNMFModel(M, FNMFConfig(rank=2), rng=np.random.default_rng(seed))
        model.set_global(b"", _groups(2).astype("<f8").tobytes(), 1)
        return model

    def fold(self, model: FNMFModel, liked: np.ndarray, userid: int) -> None:
        model.fold_in(liked, userid=userid)


class TestIALS(RecommenderContract):
    def make(self, seed: int = 0) -> IALSModel:
        model = IALSModel(M, IALSConfig(factors=2), n_users=3, rng=np.random.default_rng(seed))
        model.set_global(b"", _groups(2).T.astype("<f8").tobytes(), 1)
        return model

    def fold(self, model: IALSModel, liked: np.ndarray, userid: int) -> None:
        model.fold_in(liked, userid=userid)


def test_a_model_that_has_recommended_can_be_deep_copied() -> None:
    import copy

    model = TestLightFR().ready()
    a = model.recommend(EVENS[1:], N=5, rng=np.random.default_rng(2))
    b = copy.deepcopy(model).recommend(EVENS[1:], N=5, rng=np.random.default_rng(2))
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
