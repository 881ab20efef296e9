"""Two-stage ranking: stage 1's Hamming candidates (`HammingIndex.candidates`), the implicit-ALS user step,
stage 2's re-rank by E·u (`device_sdk.realvalued`) and `LightFRModel` with item embeddings, each against a
slow, obvious numpy reference; the store with and without embeddings; input validation."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from device_sdk import LightFRConfig, LightFRModel, realvalued
from device_sdk.family import LocalRatings
from device_sdk.store import load_store, save_store
from device_sdk.topk import HammingIndex
from protocol.codes import pack_signs, random_signs
from protocol.errors import StorageError


def _clustered(rng: np.random.Generator, m: int, f: int, groups: int = 4) -> np.ndarray:
    """Codes of a few groups with 10% of bits flipped: many exact Hamming ties."""
    base = random_signs(groups, f, rng)[rng.integers(0, groups, m)]
    return np.where(rng.random(base.shape) < 0.1, -base, base).astype(np.int8)


def _values_reference(D: np.ndarray, b: np.ndarray, levels: np.ndarray | None, lam: float) -> np.ndarray:
    """v_i = dist + ⌊(L − level_i)·λ⌋ from the ±1 matrices, the slow way."""
    dist = (D != b[None, :]).sum(axis=1).astype(np.int64)
    if levels is None or lam == 0:
        return dist
    return dist + np.floor((int(levels.max()) - levels.astype(np.int64)) * lam).astype(np.int64)


@pytest.mark.parametrize("m", [50, 3000, 20000])
@pytest.mark.parametrize("with_levels", [False, True])
def test_stage1_candidates_are_every_item_at_or_below_the_kth_value(m: int, with_levels: bool) -> None:
    rng = np.random.default_rng(m + with_levels)
    f = 64
    D = _clustered(rng, m, f)
    levels = rng.integers(0, 40, m).astype(np.uint8) if with_levels else None
    index = HammingIndex(pack_signs(D), f, levels, 3)
    users = random_signs(5, f, rng)
    kk = np.array([1, 7, 60, 200, m + 5])
    lam = np.array([0.0, 0.25, 1 / 3, 2.0, 0.5])
    got = index.candidates(np.ascontiguousarray(pack_signs(users).T), kk, lam, np.random.default_rng(1))
    for u in range(5):
        ids = got[u][got[u] >= 0]
        assert np.unique(ids).size == ids.size
        v = _values_reference(D, users[u], levels, lam[u])
        k = min(int(kk[u]), m)
        t = np.sort(v)[k - 1]
        assert np.isin(np.flatnonzero(v < t), ids).all()  # everything strictly better is in
        assert (v[ids] <= t).all() and ids.size >= k
        if ids.size < 2 * k + 256:  # below the cap: every tie at the k-th value too
            assert np.array_equal(np.sort(ids), np.flatnonzero(v <= t))


def test_stage1_caps_heavy_ties_and_draws_them_uniformly() -> None:
    m, f = 4000, 32
    D = np.tile(random_signs(1, f, np.random.default_rng(0)), (m, 1))  # every item at the same distance
    index = HammingIndex(pack_signs(D), f)
    user = np.ascontiguousarray(pack_signs(random_signs(1, f, np.random.default_rng(1))).T)
    counts = np.zeros(m)
    for seed in range(60):
        got = index.candidates(user, np.array([10]), np.array([0.0]), np.random.default_rng(seed))[0]
        assert got.size == 2 * 10 + 256 and np.unique(got).size == got.size
        counts[got] += 1
    # 60 draws of 276 of 4000: each item about 4.1 times; none far off.
    assert counts.max() < 20 and (counts > 0).mean() > 0.9


def test_stage1_restricted_to_items() -> None:
    rng = np.random.default_rng(3)
    m, f = 500, 64
    D = _clustered(rng, m, f)
    index = HammingIndex(pack_signs(D), f)
    user = random_signs(1, f, rng)
    items = np.unique(rng.choice(m, 80, replace=False))
    got = index.candidates(np.ascontiguousarray(pack_signs(user).T), np.array([10]), np.array([0.0]), None, items=items)
    ids = got[0][got[0] >= 0]
    v = _values_reference(D[items], user[0], None, 0.0)
    t = np.sort(v)[9]
    assert set(ids) == set(items[v <= t])


def _ials_reference(E: np.ndarray, items: np.ndarray, alpha: float, reg: float) -> np.ndarray:
    """u = (G + α E_Iᵀ E_I + reg I)⁻¹ (1 + α) E_Iᵀ 1 for one user, by np.linalg.solve in float64."""
    Ef = E.astype(np.float64)
    EI = Ef[np.unique(items)]
    A = Ef.T @ Ef + alpha * EI.T @ EI + reg * np.eye(E.shape[1])
    return np.linalg.solve(A, (1 + alpha) * EI.sum(axis=0))


def test_ials_user_vectors_match_a_direct_solve_per_user() -> None:
    rng = np.random.default_rng(7)
    m, d = 300, 12
    E = (rng.standard_normal((m, d)) * 0.3).astype(np.float16)
    lists = [rng.choice(m, int(rng.integers(1, 40)), replace=True) for _ in range(25)]  # repeats count once
    lists[3] = np.zeros(0, np.int64)  # a user without items: 0
    G = realvalued.embedding_gram(E)
    for budget in (1 << 22, 200):  # one batched solve, then many small chunks
        U = realvalued.ials_user_vectors(E, G, lists, 4.0, 0.5, budget=budget)
        assert U.dtype == np.float32 and U.shape == (25, d)
        for u, items in enumerate(lists):
            want = np.zeros(d) if items.size == 0 else _ials_reference(E, items, 4.0, 0.5)
            np.testing.assert_allclose(U[u], want, rtol=2e-4, atol=1e-5)
    rows = np.repeat(np.arange(25), [r.size for r in lists])
    mat = sp.csr_matrix((np.ones(rows.size), (rows, np.concatenate(lists))), shape=(25, m))
    np.testing.assert_allclose(realvalued.ials_user_vectors(E, G, mat, 4.0, 0.5), U, rtol=1e-5, atol=1e-6)


def test_rerank_is_exact_on_the_candidates() -> None:
    rng = np.random.default_rng(11)
    m, d, n, K = 400, 8, 6, 50
    E = rng.standard_normal((m, d)).astype(np.float16)
    U = rng.standard_normal((n, d)).astype(np.float32)
    cand = np.array([rng.choice(m, K, replace=False) for _ in range(n)])
    cand[2, 40:] = -1  # a short row
    excl = [cand[0, :5], None, None, np.array([1, 2, 3]), None, cand[5, :K]]
    for budget in (1 << 22, 64):  # chunks of users and blocks of candidates
        ids, scores = realvalued.rerank(cand, E, U, 10, exclude=excl, rng=None, budget=budget)
        for u in range(n):
            c = cand[u][cand[u] >= 0]
            if excl[u] is not None:
                c = c[~np.isin(c, excl[u])]
            s = E[c].astype(np.float32) @ U[u]
            order = np.lexsort((c, -s))[:10]
            k = order.size
            assert np.array_equal(ids[u, :k], c[order]) and np.all(ids[u, k:] == -1)
            np.testing.assert_allclose(scores[u, :k], s[order], rtol=1e-6)
            assert np.all(scores[u, k:] == -np.inf)
    assert np.all(ids[5] == -1)  # every candidate excluded


def test_rerank_breaks_ties_at_random() -> None:
    E = np.ones((20, 4), np.float16)  # every item scores the same
    cand = np.arange(20)[None, :]
    firsts = [
        int(realvalued.rerank(cand, E, np.ones((1, 4)), 1, rng=np.random.default_rng(s))[0][0, 0]) for s in range(400)
    ]
    counts = np.bincount(firsts, minlength=20)
    assert counts.min() > 5 and counts.max() < 45  # about 20 each


def test_two_stage_topk_is_stage_one_then_the_exact_rerank() -> None:
    rng = np.random.default_rng(5)
    m, f, d, n = 2000, 64, 16, 7
    D = _clustered(rng, m, f)
    levels = rng.integers(0, 30, m).astype(np.uint8)
    E = rng.standard_normal((m, d)).astype(np.float16)
    users = random_signs(n, f, rng)
    U = rng.standard_normal((n, d)).astype(np.float32)
    excl = [rng.choice(m, 15, replace=False) for _ in range(n)]
    words = np.ascontiguousarray(pack_signs(users).T)
    for chunk in (1024, 3):
        ids, scores = realvalued.two_stage_topk(
            pack_signs(D),
            f,
            words,
            E,
            U,
            10,
            candidates=40,
            levels=levels,
            lift=0.5,
            exclude=excl,
            users_per_chunk=chunk,
        )
        for u in range(n):
            v = _values_reference(D, users[u], levels, 0.5)
            t = np.sort(v)[40 + 15 - 1]
            c = np.setdiff1d(np.flatnonzero(v <= t), excl[u])
            s = E[c].astype(np.float32) @ U[u]
            order = np.lexsort((c, -s))[:10]
            assert np.array_equal(ids[u], c[order])
            np.testing.assert_allclose(scores[u], s[order], rtol=1e-6)


def test_stage1_recall_counts_the_real_valued_top_found() -> None:
    rng = np.random.default_rng(2)
    m, d = 100, 4
    E = rng.standard_normal((m, d)).astype(np.float16)
    U = rng.standard_normal((2, d)).astype(np.float32)
    s = E.astype(np.float32) @ U.T
    top0 = np.argsort(-s[:, 0])[:10]
    cand = np.full((2, m), -1)
    cand[0, :4] = top0[:4]  # 4 of user 0's top 10
    cand[1] = np.arange(m)  # everything
    got = realvalued.stage1_recall(cand, E, U, 10)
    assert got[0] == pytest.approx(0.4) and got[1] == 1.0
    excluded = realvalued.stage1_recall(cand[:1], E, U[:1], 10, exclude=[top0[:4]])
    assert excluded[0] == 0.0  # those 4 are out of the ranking; the other 6 of the top and 4 more are not found


def _embedded_model(seed: int = 0, **config: object) -> tuple[LightFRModel, np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    m, f, d = 600, 64, 16
    E = rng.standard_normal((m, d)).astype(np.float32)
    codes = np.where(E @ rng.standard_normal((d, f)) > 0, 1, -1).astype(np.int8)
    model = LightFRModel(m, LightFRConfig(bits=f, **config), n_users=4, rng=np.random.default_rng(seed))  # type: ignore[arg-type]
    model.set_item_codes(codes, 3)
    model.set_embeddings(E, alpha=5.0, reg=0.1)
    liked = [rng.choice(m, 20, replace=False) for _ in range(4)]
    for u in range(4):
        model.fold_in(liked[u], userid=u)
    return model, E, liked


def test_model_folds_in_the_ials_vector_and_reranks_its_stage_one_candidates() -> None:
    model, E, liked = _embedded_model(candidates=60)
    E16 = model.item_embeddings
    assert E16 is not None and E16.dtype == np.float16 and model.user_vector_ok.all()
    want = realvalued.ials_user_vectors(E16, realvalued.embedding_gram(E16), liked, 5.0, 0.1)
    np.testing.assert_allclose(model.user_vectors, want, rtol=1e-6)
    for u in range(4):
        cand = model.stage1_candidates(liked[u], userid=u, rng=np.random.default_rng(0))
        assert cand.size >= 60 and not np.isin(cand, liked[u]).any()
        ids, scores = model.recommend(liked[u], N=10, userid=u, rng=np.random.default_rng(0))
        s = E16[cand].astype(np.float32) @ model.user_vectors[u]
        order = np.argsort(-s, kind="stable")[:10]
        np.testing.assert_allclose(scores, s[order], rtol=1e-6)
        assert set(ids) == set(cand[order]) or np.unique(s).size < s.size
    # A batch gives the same scores row by row.
    ids, scores = model.recommend(liked, N=10, userid=np.arange(4), rng=np.random.default_rng(0))
    for u in range(4):
        np.testing.assert_array_equal(scores[u], model.recommend(liked[u], N=10, userid=u)[1])


def test_model_without_stage_one_ranks_every_item_by_e_dot_u_and_rerank_off_by_stage_one() -> None:
    model, _, liked = _embedded_model(candidates=0)
    E16 = model.item_embeddings
    assert E16 is not None
    s = E16.astype(np.float32) @ model.user_vectors[1]
    s[liked[1]] = -np.inf
    ids, scores = model.recommend(liked[1], N=10, userid=1)
    np.testing.assert_allclose(scores, np.sort(s)[::-1][:10], rtol=1e-6)
    # Stage 2 off: stage 1's own 10 best by the Hamming distance of the vector's sign plane (no levels
    # here), scored 1 − v/f, the liked items out; a batch row gives the same scores.
    model.config = replace(model.config, rerank=False, candidates=200)
    assert model.user_weight[1] > 0
    sign = np.where(model.user_q[1] > 0, 1, -1)
    v = (model.item_codes != sign[None, :]).sum(axis=1)
    v[liked[1]] = 10**6
    ids, scores = model.recommend(liked[1], N=10, userid=1, rng=np.random.default_rng(1))
    np.testing.assert_allclose(scores, 1 - np.sort(v)[:10] / 64)
    assert np.array_equal(v[ids], np.sort(v)[:10]) and not np.isin(ids, liked[1]).any()
    batch = model.recommend(liked, N=10, userid=np.arange(4))[1]
    np.testing.assert_array_equal(batch[1], scores)
    # A user holding only a ±1 code ranks as always: the exact Hamming search.
    model.user_weight[2], model.user_vector_ok[2] = 0, False
    plain = LightFRModel(model.n_items, LightFRConfig(rank_planes=0), n_users=4)
    plain.set_item_codes(model.item_codes, 3)
    plain.set_user_code(model.user_codes[2], userid=2)
    np.testing.assert_array_equal(
        model.recommend(liked[2], N=10, userid=2)[1], plain.recommend(liked[2], N=10, userid=2)[1]
    )


def test_planes_two_stage_equals_the_exact_plane_ranking_when_the_candidates_cover_the_catalogue() -> None:
    rng = np.random.default_rng(9)
    m, f = 300, 64
    codes = _clustered(rng, m, f)
    levels = rng.integers(0, 9, m).astype(np.uint8)
    liked = [rng.choice(m, 15, replace=False) for _ in range(3)]
    scores = {}
    for C in (0, m):
        model = LightFRModel(m, LightFRConfig(bits=f, candidates=C), n_users=3, rng=np.random.default_rng(0))
        model.set_item_codes(codes, 1)
        model.item_levels, model.hamming_weight = levels, 2
        for u in range(3):
            model.fold_in(liked[u], userid=u)
        assert (model.user_weight > 0).all()
        scores[C] = model.recommend(liked, N=20, userid=np.arange(3))[1]
    np.testing.assert_array_equal(scores[0], scores[m])


def test_store_round_trip_with_and_without_embeddings_and_an_old_store_loads(tmp_path: Path) -> None:
    model, _, liked = _embedded_model()
    model.save(tmp_path / "with.fedrec")
    back = LightFRModel.load(tmp_path / "with.fedrec")
    assert back.item_embeddings is not None and model.item_embeddings is not None
    np.testing.assert_array_equal(back.item_embeddings, model.item_embeddings)
    np.testing.assert_array_equal(back.embedding_gram, model.embedding_gram)
    np.testing.assert_array_equal(back.user_vectors, model.user_vectors)
    assert (back.ials_alpha, back.ials_reg) == (5.0, 0.1) and back.user_vector_ok.all()
    a = model.recommend(liked[0], N=8, userid=0, rng=np.random.default_rng(4))
    b = back.recommend(liked[0], N=8, userid=0, rng=np.random.default_rng(4))
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    # Without embeddings the file holds none of their keys: what a store written before them looks like.
    model.set_embeddings(None)
    model.save(tmp_path / "old.fedrec")
    state = load_store(tmp_path / "old.fedrec", "lightfr")
    assert not any("embedding" in k or k.startswith("user_vector") for k in state)
    old = LightFRModel.load(tmp_path / "old.fedrec")
    assert old.item_embeddings is None and not old.user_vector_ok.any()
    assert np.array_equal(old.recommend(liked[0], N=8, userid=0)[1], model.recommend(liked[0], N=8, userid=0)[1])
    # A layout this SDK does not know is refused, in one line.
    model, _, _ = _embedded_model()
    model.save(tmp_path / "new.fedrec")
    state = load_store(tmp_path / "new.fedrec", "lightfr")
    state["embedding_format"] = 2
    save_store(tmp_path / "future.fedrec", "lightfr", state)
    with pytest.raises(StorageError, match="unknown embedding format 2") as info:
        LightFRModel.load(tmp_path / "future.fedrec")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda E, G: realvalued.ials_user_vectors(E[:, 0], G, [np.array([1])], 1.0, 1.0), "2-D"),
        (lambda E, G: realvalued.ials_user_vectors(E.astype(np.int32), G, [np.array([1])], 1.0, 1.0), "float16"),
        (lambda E, G: realvalued.ials_user_vectors(np.where(E > 0, np.nan, E), G, [np.array([1])], 1.0, 1.0), "finite"),
        (lambda E, G: realvalued.ials_user_vectors(E, G[:3], [np.array([1])], 1.0, 1.0), "Gram matrix must be"),
        (lambda E, G: realvalued.ials_user_vectors(E, G * np.inf, [np.array([1])], 1.0, 1.0), "finite float"),
        (lambda E, G: realvalued.ials_user_vectors(E, G, [np.array([50])], 1.0, 1.0), "out of range"),
        (lambda E, G: realvalued.ials_user_vectors(E, G, [np.array([0.5])], 1.0, 1.0), "integer ids"),
        (lambda E, G: realvalued.ials_user_vectors(E, G, [np.array([1])], -1.0, 1.0), "alpha must be"),
        (lambda E, G: realvalued.ials_user_vectors(E, G, [np.array([1])], 1.0, 0.0), "reg must be"),
        (lambda E, G: realvalued.rerank(np.array([[1, 60]]), E, np.ones((1, 4)), 3), "out of range"),
        (lambda E, G: realvalued.rerank(np.array([[1, 2]]), E, np.ones((1, 5)), 3), "user vectors must be"),
        (lambda E, G: realvalued.rerank(np.array([[1, 2]]), E, np.full((1, 4), np.nan), 3), "user vectors must be"),
        (lambda E, G: realvalued.rerank(np.array([1, 2]), E, np.ones((1, 4)), 3), r"\(n, K\)"),
    ],
)
def test_bad_input_is_one_clear_error_line(call, message: str) -> None:  # type: ignore[no-untyped-def]
    E = np.random.default_rng(0).standard_normal((50, 4)).astype(np.float16)
    G = realvalued.embedding_gram(E)
    with pytest.raises(ValueError, match=message) as info:
        call(E, G)
    assert "\n" not in str(info.value)


def test_set_embeddings_checks_everything_before_changing_anything() -> None:
    model, _, liked = _embedded_model()
    before = model.item_embeddings
    for bad, message in [
        (np.ones((599, 16)), "599 rows for 600 items"),
        (np.full((600, 16), 1e6), "fit float16"),
        (np.ones((600, 16), np.int64), "float16, float32 or float64"),
    ]:
        with pytest.raises(ValueError, match=message):
            model.set_embeddings(bad, alpha=1.0, reg=1.0)
    with pytest.raises(ValueError, match="reg must be"):
        model.set_embeddings(np.ones((600, 16)), alpha=1.0, reg=-1.0)
    with pytest.raises(ValueError, match=r"Gram matrix must be \(16, 16\)"):
        model.set_embeddings(np.ones((600, 16)), gram=np.eye(3))
    assert model.item_embeddings is before and model.user_vector_ok.all()
    model.set_embeddings(np.ones((600, 16)))  # new embeddings: vectors stale until the next fold-in
    assert not model.user_vector_ok.any()
    model.fold_in(liked[0], userid=0)
    assert model.user_vector_ok[0] and not model.user_vector_ok[1]
    with pytest.raises(ValueError, match="candidates must be an integer"):
        LightFRConfig(candidates=-1)
    with pytest.raises(ValueError, match="rerank must be a bool"):
        LightFRConfig(rerank=1)  # type: ignore[arg-type]


def test_fit_local_and_refresh_ranking_solve_the_vectors_again() -> None:
    """`fit_local` solves the user's real-valued vector too; after new embeddings the vectors are stale until
    `refresh_ranking` (what a device runs on adopting a model) solves them in one batch, with any rank mode."""
    model, E, liked = _embedded_model()
    users = np.repeat(np.arange(4), [a.size for a in liked])
    data = LocalRatings(users.astype(np.int64), np.concatenate(liked).astype(np.int64), None, 4)
    rng = np.random.default_rng(3)
    model.set_embeddings(E[:, ::-1].copy(), alpha=2.0, reg=0.5)
    assert not model.user_vector_ok.any()
    assert model.refresh_ranking(data) == 4 and model.user_vector_ok.all()
    E16 = model.item_embeddings
    assert E16 is not None
    want = realvalued.ials_user_vectors(E16, realvalued.embedding_gram(E16), liked, 2.0, 0.5)
    np.testing.assert_allclose(model.user_vectors, want, rtol=1e-6)
    model.config = replace(model.config, rank_planes=0)  # no planes to refresh: the vectors still are
    model.set_embeddings(E, alpha=2.0, reg=0.5)
    assert model.refresh_ranking(data) == 4 and model.user_vector_ok.all()
    one = LightFRModel(model.n_items, LightFRConfig(bits=64), rng=rng)
    one.set_item_codes(model.item_codes, 3)
    one.set_embeddings(E, alpha=2.0, reg=0.5)
    one.fit_local(liked[2], rng=rng)
    assert one.user_vector_ok[0]
    np.testing.assert_allclose(one.user_vectors[0], model.user_vectors[2], rtol=1e-6)


def test_two_stage_topk_checks_its_inputs_in_one_line() -> None:
    rng = np.random.default_rng(0)
    D = random_signs(100, 64, rng)
    E = rng.standard_normal((100, 8)).astype(np.float16)
    users = np.ascontiguousarray(pack_signs(random_signs(3, 64, rng)).T)
    U = rng.standard_normal((3, 8)).astype(np.float32)
    for kwargs, message in [
        ({"candidates": 0}, "candidates must be an integer >= 1"),
        ({"user_vectors": U[:2]}, r"user vectors must be a finite \(3, 8\)"),
        ({"embeddings": E[:50]}, "50 rows for 100 items"),
        ({"user_words": users.astype(np.int64)}, "uint64 words"),
        ({"exclude": [None]}, "exclude has 1 rows for 3 users"),
        ({"N": -1}, "N must be an integer >= 0"),
    ]:
        args = {"user_words": users, "embeddings": E, "user_vectors": U, "N": 5}
        args.update(kwargs)
        with pytest.raises(ValueError, match=message) as info:
            realvalued.two_stage_topk(pack_signs(D), 64, **args)  # type: ignore[arg-type]
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_all_finite_answers_as_isfinite_does(dtype: type) -> None:
    """float16 is read by its bits (exponent all ones): every special value, at either end of a chunk, in a
    strided view, and the extremes that are finite."""
    all_finite = realvalued.all_finite
    base = np.random.default_rng(0).standard_normal((70_000, 3)).astype(dtype)
    assert all_finite(base) and all_finite(base[:0]) and all_finite(base[:, ::2])
    assert all_finite(np.array([[np.finfo(dtype).max, -np.finfo(dtype).max, np.finfo(dtype).tiny, -0.0]], dtype))
    for value in (np.inf, -np.inf, np.nan):
        for at in ((0, 0), (65_535, 2), (65_536, 0), (69_999, 2)):
            bad = base.copy()
            bad[at] = value
            assert all_finite(bad) is bool(np.isfinite(bad).all()) is False
            assert all_finite(bad[:, ::2]) is bool(np.isfinite(bad[:, ::2]).all())


def test_loaded_embeddings_view_the_file_and_a_callers_rows_are_copied(tmp_path: Path) -> None:
    """A load installs E as a read-only view of the bytes it read (no second copy of 2·m·d bytes); rows a
    caller passes are copied even when float16 and read-only, so writing through their base changes nothing,
    and held read-only too."""
    model, _, _ = _embedded_model()
    model.save(tmp_path / "with.fedrec")
    back = LightFRModel.load(tmp_path / "with.fedrec")
    E16 = back.item_embeddings
    assert E16 is not None and not E16.flags.writeable and isinstance(E16.base, bytes | memoryview | np.ndarray)
    np.testing.assert_array_equal(E16, model.item_embeddings)
    with pytest.raises(ValueError, match="read-only"):
        E16[0, 0] = 1.0
    mine = np.ones((600, 16), np.float16)
    view = mine.view()
    view.flags.writeable = False
    model.set_embeddings(view, alpha=5.0, reg=0.1)
    mine[0, 0] = 7.0
    held = model.item_embeddings
    assert held is not None and held[0, 0] == 1.0 and not held.flags.writeable  # read-only, as after a load
