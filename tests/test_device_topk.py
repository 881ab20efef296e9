from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from device_sdk.topk import HammingIndex, hamming_distances, topk_hamming
from device_sdk.topk import planes as topk_planes
from device_sdk.topk import scan as topk_scan
from device_sdk.topk import substring as topk_substring
from protocol.codes import pack_signs, pack_user, random_signs
from tests.lightfr_reference import hamming_distances_reference


@settings(max_examples=120, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    m=st.integers(1, 400),
    f=st.sampled_from([1, 3, 8, 63, 64, 65, 128, 256]),
    k=st.integers(0, 30),
    n_excl=st.integers(0, 12),
    block=st.sampled_from([1, 7, 64, 1 << 16]),
)
def test_topk_equals_sorted_reference(seed: int, m: int, f: int, k: int, n_excl: int, block: int) -> None:
    rng = np.random.default_rng(seed)
    # Few distinct codes → many exact ties, the hard case for threshold selection.
    base = random_signs(int(rng.integers(1, 6)), f, rng)
    D = base[rng.integers(0, base.shape[0], m)]
    flip = rng.random(D.shape) < 0.1
    D = np.where(flip, -D, D).astype(np.int8)
    u = random_signs(1, f, rng)[0]
    excl = rng.choice(m, min(n_excl, m), replace=False)
    idx, dist = topk_hamming(pack_user(u), pack_signs(D), f, k, rng, exclude=excl, block=block)
    ref = hamming_distances_reference(u, D)
    eligible = np.setdiff1d(np.arange(m), excl)
    assert np.array_equal(dist, np.sort(ref[eligible])[: min(k, eligible.size)])
    assert np.array_equal(ref[idx], dist)
    assert np.unique(idx).size == idx.size and not np.isin(idx, excl).any()
    assert np.array_equal(hamming_distances(pack_user(u), pack_signs(D)), ref)


def test_ties_are_broken_uniformly_at_random() -> None:
    f, m = 16, 10
    D = np.tile(random_signs(1, f, np.random.default_rng(0)), (m, 1))  # every item ties
    u = pack_user(D[0])
    rng = np.random.default_rng(1)
    counts = np.zeros(m)
    for _ in range(4000):
        idx, _ = topk_hamming(u, pack_signs(D), f, 1, rng)
        counts[idx[0]] += 1
    # Each item should win ~400 times; a chi-square-style bound keeps this deterministic per seed.
    assert counts.min() > 320 and counts.max() < 480


def test_candidates_subset_and_edge_cases() -> None:
    rng = np.random.default_rng(2)
    f, m = 64, 100
    D = random_signs(m, f, rng)
    u = random_signs(1, f, rng)[0]
    ref = hamming_distances_reference(u, D)
    cand = np.array([5, 17, 42, 99])
    idx, dist = topk_hamming(pack_user(u), pack_signs(D), f, 10, rng, candidates=cand, exclude=np.array([17]))
    assert set(idx) == {5, 42, 99} and np.array_equal(dist, np.sort(ref[[5, 42, 99]]))
    idx, _ = topk_hamming(pack_user(u), pack_signs(D), f, 0, rng)
    assert idx.size == 0
    idx, _ = topk_hamming(pack_user(u), pack_signs(D), f, 500, rng)
    assert idx.size == m
    with pytest.raises(ValueError):
        topk_hamming(pack_user(u), pack_signs(D), f, -1, rng)
    with pytest.raises(ValueError, match="words"):
        topk_hamming(pack_user(random_signs(1, 128, rng)[0]), pack_signs(D), f, 3, rng)


def _reference_scores(U: np.ndarray, D: np.ndarray, levels: np.ndarray | None, weight: int) -> np.ndarray:
    """(n, m) integer scores (f − dist)·B + level, straight from the ±1 codes."""
    f = D.shape[1]
    dist = (f - U.astype(np.int64) @ D.T.astype(np.int64)) // 2
    return (f - dist) * weight + (0 if levels is None else levels.astype(np.int64)[None, :])


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    m=st.integers(1, 300),
    n=st.integers(1, 6),
    f=st.sampled_from([3, 64, 65, 128, 300]),
    k=st.integers(0, 25),
    n_levels=st.sampled_from([0, 1, 2, 5, 256]),
    weight=st.sampled_from([1, 2, 7]),
    block=st.sampled_from([1, 5, 64, 1 << 16]),
    n_excl=st.integers(0, 10),
)
def test_index_search_equals_sorted_reference(
    seed: int, m: int, n: int, f: int, k: int, n_levels: int, weight: int, block: int, n_excl: int
) -> None:
    rng = np.random.default_rng(seed)
    base = random_signs(int(rng.integers(1, 4)), f, rng)  # few distinct codes: many ties
    D = base[rng.integers(0, base.shape[0], m)]
    D = np.where(rng.random(D.shape) < 0.05, -D, D).astype(np.int8)
    U = random_signs(n, f, rng)
    levels = None if n_levels == 0 else rng.integers(0, n_levels, m).astype(np.uint8)
    index = HammingIndex(pack_signs(D), f, levels, weight)
    exclude = [rng.choice(m, min(n_excl, m), replace=False) if u % 2 == 0 else None for u in range(n)]
    ids, scores = index.search(pack_signs(U).T.copy(), k, rng, exclude=exclude, block_pairs=block)
    ref = _reference_scores(U, D, levels, weight)
    assert ids.shape == scores.shape == (n, k)
    for u in range(n):
        eligible = np.setdiff1d(np.arange(m), exclude[u] if exclude[u] is not None else [])
        want = np.sort(ref[u, eligible])[::-1][: min(k, eligible.size)]
        got = ids[u][ids[u] >= 0]
        assert np.array_equal(scores[u, : got.size], want)
        assert np.array_equal(ref[u, got], want)  # the scores returned are the items' scores
        assert np.unique(got).size == got.size and np.all(ids[u, got.size :] == -1)
        if exclude[u] is not None:
            assert not np.isin(got, exclude[u]).any()
    # Restricting to candidate items ranks exactly those.
    cand = rng.choice(m, min(m, 7), replace=False)
    ids, scores = index.search(pack_signs(U).T.copy(), k, rng, candidates=cand)
    for u in range(n):
        got = ids[u][ids[u] >= 0]
        assert set(got) <= set(cand) and got.size == min(k, cand.size)
        assert np.array_equal(scores[u, : got.size], np.sort(ref[u, cand])[::-1][: got.size])


def test_index_ties_with_levels_are_random_and_levels_break_hamming_ties() -> None:
    f, m = 16, 12
    D = np.tile(random_signs(1, f, np.random.default_rng(0)), (m, 1))  # every item at distance 0
    levels = np.zeros(m, np.uint8)
    levels[[3, 7]] = 1
    index = HammingIndex(pack_signs(D), f, levels, weight=2)
    u = pack_user(D[0])[None, :]
    rng = np.random.default_rng(4)
    counts = np.zeros(m)
    for _ in range(3000):
        ids, scores = index.search(u, 3, rng)
        assert set(ids[0, :2]) == {3, 7} and scores[0].tolist() == [2 * f + 1, 2 * f + 1, 2 * f]
        counts[ids[0, 2]] += 1
    others = np.delete(counts, [3, 7])
    assert counts[[3, 7]].sum() == 0 and others.min() > 220 and others.max() < 380  # ~300 each
    # Without a generator the lower id wins.
    ids, _ = index.search(u, 4, None)
    assert ids[0].tolist() == [3, 7, 0, 1]


def test_index_validates_its_inputs() -> None:
    words = pack_signs(random_signs(5, 64, np.random.default_rng(0)))
    with pytest.raises(ValueError, match="levels"):
        HammingIndex(words, 64, np.arange(4))
    with pytest.raises(ValueError, match="levels"):
        HammingIndex(words, 64, np.array([0, 1, 2, 3, 256]))
    with pytest.raises(ValueError, match="weight"):
        HammingIndex(words, 64, None, 0)
    with pytest.raises(ValueError, match="bits"):
        HammingIndex(words, 129)
    index = HammingIndex(words, 64)
    with pytest.raises(ValueError, match="user codes"):
        index.search(np.zeros((2, 2), np.uint64), 3, None)
    with pytest.raises(ValueError, match="exclude"):
        index.search(np.zeros((2, 1), np.uint64), 3, None, exclude=[None])
    with pytest.raises(ValueError, match="out of range"):
        index.search(np.zeros((1, 1), np.uint64), 3, None, exclude=[np.array([5])])


def test_index_survives_copies() -> None:
    import copy

    rng = np.random.default_rng(5)
    D = random_signs(300, 64, rng)
    levels = rng.integers(0, 4, 300).astype(np.uint8)
    index = HammingIndex(pack_signs(D), 64, levels, 3)
    u = pack_signs(random_signs(2, 64, rng)).T.copy()
    before = index.search(u, 7, np.random.default_rng(1))
    clone = copy.deepcopy(index)
    after = clone.search(u, 7, np.random.default_rng(1))
    assert np.array_equal(before[0], after[0]) and np.array_equal(before[1], after[1])


def _reference_ranking(ref: np.ndarray, k: int, exclude: np.ndarray | None) -> np.ndarray:
    """Item ids by score, best first, the lower id first among equal scores (the rng=None rule)."""
    ok = np.ones(ref.size, bool)
    if exclude is not None:
        ok[exclude] = False
    ids = np.flatnonzero(ok)
    return ids[np.lexsort((ids, -ref[ids]))][:k]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.sampled_from([1, 3]),
    f=st.sampled_from([8, 64, 250, 300]),
    n_levels=st.sampled_from([0, 3, 256]),
    weight=st.sampled_from([1, 4]),
    k=st.sampled_from([1, 10, 40]),
    block=st.sampled_from([16, 100, 1 << 17]),
    n_excl=st.sampled_from([0, 5]),
)
def test_index_without_generator_is_the_reference_ranking(
    seed: int, n: int, f: int, n_levels: int, weight: int, k: int, block: int, n_excl: int
) -> None:
    """rng=None: the ids themselves, not only the scores, equal a sort by (score desc, id asc); the
    single-user path (first block of up to ``block`` items, head of 2048) and the batched scan alike,
    including catalogues around the 2048-item head."""
    rng = np.random.default_rng(seed)
    m = int(rng.choice([k, 4 * k + 63, 2047, 2048, 2049, 2600]))
    base = random_signs(3, f, rng)
    D = base[rng.integers(0, 3, m)]
    D = np.where(rng.random(D.shape) < 0.08, -D, D).astype(np.int8)
    U = random_signs(n, f, rng)
    levels = None if n_levels == 0 else rng.integers(0, n_levels, m).astype(np.uint8)
    index = HammingIndex(pack_signs(D), f, levels, weight)
    exclude = [rng.choice(m, min(n_excl, m), replace=False) for _ in range(n)]
    ids, scores = index.search(pack_signs(U).T.copy(), k, None, exclude=exclude, block_pairs=block)
    ref = _reference_scores(U, D, levels, weight)
    for u in range(n):
        want = _reference_ranking(ref[u], k, exclude[u])
        assert np.array_equal(ids[u, : want.size], want) and np.all(ids[u, want.size :] == -1)
        assert np.array_equal(scores[u, : want.size], ref[u, want])


@pytest.mark.parametrize("m", [(1 << 17) - 1, 1 << 17, (1 << 17) + 1, (1 << 17) + 8192 + 5])
@pytest.mark.parametrize("n_levels", [0, 16])
def test_single_user_path_at_the_default_block_boundary(m: int, n_levels: int) -> None:
    """A catalogue of up to one first segment (2^17 items) is one pass; one item more takes the
    segment loop, and 8197 more a later segment compared eight values at a time (8192 of them, then
    a tail of 5).  All give the reference ranking (rng=None) and the reference scores (random ties)."""
    rng = np.random.default_rng(m + n_levels)
    f = 64
    base = random_signs(8, f, rng)
    D = base[rng.integers(0, 8, m)]
    D = np.where(rng.random(D.shape) < 0.15, -D, D).astype(np.int8)
    levels = None if n_levels == 0 else rng.integers(0, n_levels, m).astype(np.uint8)
    index = HammingIndex(pack_signs(D), f, levels, 4)
    for u in random_signs(3, f, rng):
        ref = _reference_scores(u[None, :], D, levels, 4)[0]
        excl = rng.choice(m, 20, replace=False)
        ids, scores = index.search(pack_user(u), 25, None, exclude=[excl])
        want = _reference_ranking(ref, 25, excl)
        assert np.array_equal(ids[0], want) and np.array_equal(scores[0], ref[want])
        ids, scores = index.search(pack_user(u), 25, rng, exclude=[excl])
        assert np.array_equal(scores[0], ref[want]) and np.array_equal(ref[ids[0]], ref[want])
        assert not np.isin(ids[0], excl).any() and np.unique(ids[0]).size == 25


def test_threshold_from_the_head_keeps_a_cheaper_remainder_in_a_later_block() -> None:
    """With an item term the head's bound is τ = B·t + B − 1, not B·t: items of a later block whose
    dist + q equals t but whose remainder r is smaller cost less than the head's and must be found."""
    f, B = 8, 4
    u = np.ones(f, np.int8)

    def at(dist: int) -> np.ndarray:
        code = np.ones(f, np.int8)
        code[:dist] = -1
        return code

    # Levels 12 (cost term 15 − 12 = 3 = 0·4 + 3) in the first block, 10 (5 = 1·4 + 1) after it.
    D = np.array([at(3)] * 16 + [at(6)] * 15 + [at(2)])
    levels = np.array([12] * 16 + [10] * 16, np.uint8)
    levels[-17] = 15  # the top level, so that L = 15
    D[-17] = at(8)  # ... on an item far away (cost 32 + 0)
    index = HammingIndex(pack_signs(D), f, levels, B)
    ref = _reference_scores(u[None, :], D, levels, B)[0]
    for block in (16, 1 << 17):
        ids, scores = index.search(pack_user(u), 1, None, block_pairs=block)
        assert ids[0].tolist() == [31] and scores[0, 0] == ref.max()


def test_single_user_later_segments_compare_each_level_run_with_its_own_threshold() -> None:
    """After the first segment, the item term is not added: each run of equal q = (L − level) // B
    within a segment has its distances compared with t − q.  Segments of 9000 items here cross several
    runs of 2000–7000 items (q = 0..4), with near items planted in every run and on run and segment
    boundaries; the result must be the reference ranking, for several k and both tie rules."""
    rng = np.random.default_rng(7)
    f, B, m = 64, 3, 40_000
    sizes = [3000, 7000, 2000, 6500, 9000, 5000, 7500]  # one run per level, sorted by level
    levels = np.repeat(np.array([14, 12, 9, 7, 4, 2, 0], np.uint8), sizes)
    D = random_signs(m, f, rng)
    u = random_signs(1, f, rng)[0]
    edges = np.cumsum(sizes)
    for at in [*edges[:-1] - 1, *edges[:-1], 9000, 9001, 17999, 18000, 27000, m - 1, *rng.choice(m, 30)]:
        D[at] = u
        D[at, rng.choice(f, rng.integers(0, 9), replace=False)] *= -1  # 0..8 bits away
    perm = rng.permutation(m)  # the index sorts by level itself
    D, levels = D[perm], levels[perm]
    index = HammingIndex(pack_signs(D), f, levels, B)
    ref = _reference_scores(u[None, :], D, levels, B)[0]
    for k in (1, 10, 50):
        want = _reference_ranking(ref, k, None)
        ids, scores = index.search(pack_user(u), k, None, block_pairs=9000)
        assert np.array_equal(ids[0], want) and np.array_equal(scores[0], ref[want])
        ids, scores = index.search(pack_user(u), k, rng, block_pairs=9000)
        assert np.array_equal(np.sort(scores[0]), np.sort(ref[want]))
        assert np.array_equal(ref[ids[0]], scores[0])


def _index_buffers(index: HammingIndex, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.empty(n, np.bool_), np.empty(n // 8, np.uint64), np.empty(n // 8, np.bool_)


@pytest.mark.parametrize(
    ("f", "n_levels", "weight", "top"),
    [(64, 0, 1, 64), (64, 256, 2, 191), (250, 0, 1, 250), (64, 256, 1, 319)],
)
def test_grouped_compare_finds_exactly_the_values_at_or_below_the_threshold(
    f: int, n_levels: int, weight: int, top: int
) -> None:
    """`_hits` on the values v = dist + q of a segment: the positions of v <= t, whatever the length
    (multiples of 8 and tails), t (0, mid, t = top, t above 127) and the largest value (64 with plain
    codes; 191 = 64 + 127 when bytes reach past 128 + t for small t; 250 and 319 never by words)."""
    rng = np.random.default_rng(f + n_levels + weight)
    m = 9000
    levels = None if n_levels == 0 else np.arange(m) % n_levels
    index = HammingIndex(np.zeros(((f + 63) // 64, m), np.uint64), f, levels, weight)
    assert index._vmax == top
    vdt = np.uint8 if top < 256 else np.uint16
    mask, wtmp, wflag = _index_buffers(index, 1 << 14)
    for n in (8191, 8192, 8193, 8199, 8200, 16000 + 3):
        for t in sorted({0, 1, 31, 62, 63, 64, 100, 127, 128, 200, top - 1, top}):
            if t > top:
                continue
            v = rng.integers(0, top + 1, n).astype(vdt)
            v[rng.integers(0, n, 40)] = t  # values at the threshold ...
            v[rng.integers(0, n, 40)] = min(t + 1, top)  # ... and just above it
            v[-1] = rng.integers(0, top + 1)
            got = topk_scan._hits(v, t, mask, wtmp, wflag)
            assert np.array_equal(np.sort(got), np.flatnonzero(v <= t)), (n, t)
            # Sparse hits, the usual case: most words hold none.
            v = np.full(n, top, vdt)
            at = rng.choice(n, 5, replace=False)
            v[at] = rng.integers(0, t + 1, 5)
            assert np.array_equal(
                np.sort(topk_scan._hits(v, t, mask, wtmp, wflag)), np.sort(at) if t < top else np.arange(n)
            )


def test_single_user_head_threshold_falls_back_when_too_few_items_pass_its_low_rank() -> None:
    """With 10^5 items the first segment is compared against the head's 2nd smallest value, not its
    10th; when fewer than k items reach that, the head's k-th must be used, or the top 10 would come
    back short.  Items 0 and 1 at distance 0, all others at 30."""
    m, k = 100_000, 10
    user = np.uint64(0x0123456789ABCDEF)
    far = np.uint64((1 << 30) - 1)
    words = np.full((1, m), user ^ far, np.uint64)
    words[0, :2] = user
    dist = np.bitwise_count(words[0] ^ user).astype(np.int64)
    for levels, weight in ((None, 1), (np.arange(m) % 2, 4)):
        index = HammingIndex(words, 64, levels, weight)
        ref = (64 - dist) * weight + (0 if levels is None else levels)
        ids, scores = index.search(np.array([user]), k, None)
        want = _reference_ranking(ref, k, None)
        assert np.array_equal(ids[0], want) and np.array_equal(scores[0], ref[want])


@settings(max_examples=120, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    m=st.integers(1, 3000),
    f=st.sampled_from([8, 64, 65, 128, 200]),
    n_levels=st.sampled_from([0, 2, 16, 256]),
    weight=st.sampled_from([1, 2, 4]),
    k=st.integers(1, 30),
    block=st.sampled_from([8, 64, 100, 1024, 1 << 20]),
    n_excl=st.integers(0, 5),
    far=st.booleans(),
    clustered=st.booleans(),
)
def test_single_user_segments_on_small_catalogues(
    seed: int, m: int, f: int, n_levels: int, weight: int, k: int, block: int, n_excl: int, far: bool, clustered: bool
) -> None:
    """The single-user scan with its sizes shrunk (head 16 items, 32 items per XOR call, word compare
    from 8 values), so that small catalogues take every path: the low head rank and its fallback,
    several segments, the word compare and its tails, the early stop on the item term, values above
    127 (``far``: a user opposite to the items, f = 200); codes in a few clusters (many ties) or not."""

    rng = np.random.default_rng(seed)
    if clustered:
        base = random_signs(3, f, rng)
        D = base[rng.integers(0, 3, m)]
        D = np.where(rng.random(D.shape) < 0.08, -D, D).astype(np.int8)
    else:
        D = random_signs(m, f, rng)
    u = -D[0] if far else random_signs(1, f, rng)[0]
    levels = None if n_levels == 0 else rng.integers(0, n_levels, m).astype(np.uint8)
    ref = _reference_scores(u[None, :], D, levels, weight)[0]
    excl = rng.choice(m, min(n_excl, m), replace=False)
    with _patch_topk(_FIRST_BLOCK=16, _CHUNK=32, _GROUPED_COMPARE_MIN=8, _GROUPS=4):
        index = HammingIndex(pack_signs(D), f, levels, weight)
        ids, scores = index.search(pack_user(u), k, None, exclude=[excl], block_pairs=block)
        want = _reference_ranking(ref, k, excl)
        assert np.array_equal(ids[0, : want.size], want) and np.all(ids[0, want.size :] == -1)
        assert np.array_equal(scores[0, : want.size], ref[want])
        ids, scores = index.search(pack_user(u), k, rng, exclude=[excl], block_pairs=block)
        assert np.array_equal(scores[0, : want.size], ref[want]) and np.array_equal(ref[ids[0, : want.size]], ref[want])


def test_single_user_later_segment_whose_item_term_equals_the_threshold() -> None:
    """A later segment is cut where q exceeds t, not where it reaches t: an item there with q = t and
    distance 0 costs B·t + r with a smaller remainder r than the head's best, and is the top item.
    f = 8, B = 4, L = 15; head (16 items): level 13 (q 0, r 2) at distance 1, cost 6; later: level 11
    (q 1, r 0) at distance 0, cost 4."""

    f, B = 8, 4
    u = np.ones(f, np.int8)
    near, far = u.copy(), -u
    near[0] = -1  # distance 1
    D = np.array([far] + [near] * 15 + [far] * 15 + [u])
    levels = np.array([15] + [13] * 15 + [11] * 16, np.uint8)
    ref = _reference_scores(u[None, :], D, levels, B)[0]
    with _patch_topk(_FIRST_BLOCK=16):
        index = HammingIndex(pack_signs(D), f, levels, B)
        for block in (16, 17, 1 << 20):
            ids, scores = index.search(pack_user(u), 1, None, block_pairs=block)
            assert ids[0].tolist() == [31] and scores[0, 0] == ref.max() == (f - 0) * B + 11


def test_single_user_threshold_of_the_rest_is_the_kth_of_the_first_segment() -> None:
    """After the first segment, the rest of the catalogue is scanned against the kk-th smallest value
    of its candidates, not a smaller one: here the first segment (1024 items of random codes) holds
    the whole top k and the 8 items after it are far, so a threshold at the (kk − 1)-th would return
    fewer than k items."""

    rng = np.random.default_rng(7)
    f, m = 64, 1024 + 8
    with _patch_topk(_FIRST_BLOCK=16):
        for _ in range(20):
            u = random_signs(1, f, rng)[0]
            D = random_signs(m, f, rng)
            D[-8:] = -u
            ref = _reference_scores(u[None, :], D, None, 1)[0]
            index = HammingIndex(pack_signs(D), f)
            for k in (2, 3, 5):
                ids, scores = index.search(pack_user(u), k, None, block_pairs=1024)
                want = _reference_ranking(ref, k, None)
                assert np.array_equal(ids[0], want) and np.array_equal(scores[0], ref[want])


def _plane_case(
    rng: np.random.Generator, m: int, f: int, P: int, n_levels: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
    """Item codes with many exact ties, one user's odd integers q in [−(2^P − 1), 2^P − 1] as P packed
    planes, and levels."""
    from device_sdk import lightfr

    base = random_signs(3, f, rng)
    D = base[rng.integers(0, 3, m)]
    D = np.where(rng.random(D.shape) < 0.05, -D, D).astype(np.int8)
    top = 2**P - 1
    q = (2 * rng.integers(0, top + 1, (1, f)) - top).astype(np.int16)
    planes = pack_signs(lightfr.sign_planes(q, P)[:, 0, :]).T.copy()
    levels = None if n_levels == 0 else rng.integers(0, n_levels, m).astype(np.uint8)
    return D, q[0], levels, planes


def _plane_reference(D: np.ndarray, q: np.ndarray, a: int, levels: np.ndarray | None, s: int = 8) -> np.ndarray:
    """S_i = a·qᵀd_i + 2^s·level_i, straight from the ±1 codes."""
    return a * (D.astype(np.int64) @ q.astype(np.int64)) + (0 if levels is None else levels.astype(np.int64) << s)


@settings(max_examples=120, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    m=st.integers(1, 500),
    f=st.sampled_from([5, 64, 70, 130]),
    P=st.integers(1, 4),
    a=st.sampled_from([1, 3, 64, 1000]),
    n_levels=st.sampled_from([0, 1, 4, 256]),
    k=st.integers(0, 30),
    block=st.sampled_from([1, 16, 100, 1 << 17]),
    n_excl=st.integers(0, 8),
)
def test_plane_search_is_the_reference_ranking(
    seed: int, m: int, f: int, P: int, a: int, n_levels: int, k: int, block: int, n_excl: int
) -> None:
    """The counting top-k on plane scores returns, with rng=None, exactly a sort by (score desc, id
    asc); with a generator, the same scores (items may differ only among ties)."""
    from device_sdk.topk import plane_scores

    rng = np.random.default_rng(seed)
    D, q, levels, planes = _plane_case(rng, m, f, P, n_levels)
    index = HammingIndex(pack_signs(D), f, levels, int(rng.integers(1, 5)))
    ref = _plane_reference(D, q, a, levels)
    assert np.array_equal(plane_scores(planes, pack_signs(D), f, a, levels), ref)
    excl = rng.choice(m, min(n_excl, m), replace=False)
    ids, scores = index.search_planes(planes, a, k, None, exclude=excl, block=block)
    want = _reference_ranking(ref, k, excl)
    assert np.array_equal(ids, want) and np.array_equal(scores, ref[want])
    ids, scores = index.search_planes(planes, a, k, rng, exclude=excl, block=block)
    assert np.array_equal(scores, ref[want]) and np.array_equal(ref[ids], scores)
    assert np.unique(ids).size == ids.size and not np.isin(ids, excl).any()
    cand = rng.choice(m, min(m, 9), replace=False)
    ids, scores = index.search_planes(planes, a, k, None, candidates=cand, exclude=excl)
    keep = np.setdiff1d(cand, excl)
    sub = keep[np.lexsort((keep, -ref[keep]))][:k]
    assert np.array_equal(ids, sub) and np.array_equal(scores, ref[sub])


@pytest.mark.parametrize("m", [2047, 2048, 2049, (1 << 17) - 1, 1 << 17, (1 << 17) + 1])
def test_plane_search_at_the_head_and_block_boundaries(m: int) -> None:
    rng = np.random.default_rng(m)
    for P in (1, 2, 3):
        D, q, levels, planes = _plane_case(rng, m, 64, P, 16)
        index = HammingIndex(pack_signs(D), 64, levels, 2)
        for a in (1, 37):
            ref = _plane_reference(D, q, a, levels)
            ids, scores = index.search_planes(planes, a, 20, None)
            want = _reference_ranking(ref, 20, None)
            assert np.array_equal(ids, want) and np.array_equal(scores, ref[want])


def test_plane_search_breaks_ties_uniformly_at_random() -> None:
    f, m = 16, 12
    D = np.tile(random_signs(1, f, np.random.default_rng(0)), (m, 1))  # every item ties
    levels = np.zeros(m, np.uint8)
    levels[[2, 9]] = 1  # ... except two, one level above
    index = HammingIndex(pack_signs(D), f, levels, 1)
    planes = pack_signs(np.stack([D[0], -D[0]])).T.copy()  # q = d_0 − 2·d_0 = −d_0: every item at −a·f
    rng = np.random.default_rng(3)
    counts = np.zeros(m)
    for _ in range(3000):
        ids, scores = index.search_planes(planes, 5, 3, rng)
        assert set(ids[:2]) == {2, 9} and scores.tolist() == [-5 * f + 256, -5 * f + 256, -5 * f]
        counts[ids[2]] += 1
    others = np.delete(counts, [2, 9])
    assert counts[[2, 9]].sum() == 0 and others.min() > 220 and others.max() < 380  # ~300 each


def test_plane_search_validates_its_inputs() -> None:
    words = pack_signs(random_signs(5, 64, np.random.default_rng(0)))
    index = HammingIndex(words, 64)
    planes = words[:, :2].T.copy()
    with pytest.raises(ValueError, match="planes"):
        index.search_planes(np.zeros((2, 2), np.uint64), 1, 3, None)
    with pytest.raises(ValueError, match="planes"):
        index.search_planes(np.zeros((9, 1), np.uint64), 1, 3, None)
    with pytest.raises(ValueError, match="weight"):
        index.search_planes(planes, 0, 3, None)
    with pytest.raises(ValueError, match="k must"):
        index.search_planes(planes, 1, -1, None)
    with pytest.raises(ValueError, match="out of range"):
        index.search_planes(planes, 1, 3, None, exclude=np.array([5]))
    with pytest.raises(ValueError, match="out of range"):
        index.search_planes(planes, 1, 3, None, candidates=np.array([-1]))
    ids, scores = index.search_planes(planes, 1, 0, None)
    assert ids.size == 0 and scores.size == 0


def test_plane_search_reaches_a_later_block_whose_lift_equals_the_threshold() -> None:
    """The scan stops at a block only when its q exceeds the threshold: an item there with W = 0 and
    q = t costs as much as the head's best (here they tie and its lower id wins)."""
    f = 128
    u = random_signs(1, f, np.random.default_rng(1))[0]
    D = np.array([u] + [-u] * 16)  # item 0: W = 0 at level 0; items 1..16: W = f at level 1
    levels = np.array([0] + [1] * 16, np.uint8)
    index = HammingIndex(pack_signs(D), f, levels, 1)
    planes = pack_user(u)[None, :]  # P = 1, a = 1: cost = 2·W + 256·(1 − level), q = 128·(1 − level)
    for block in (16, 1 << 17):
        ids, scores = index.search_planes(planes, 1, 1, None, block=block)
        assert ids.tolist() == [0] and scores.tolist() == [f]


def test_model_recommend_with_planes_and_codes_in_one_batch() -> None:
    """`LightFRModel.recommend` for a batch holding a bit-plane user (counting plane top-k) and a ±1
    code user (Hamming scan), restricted to candidate items, without levels: the plane user's scores
    are the real scores Δ'·qᵀd/f of its reference ranking, padded where too few items are eligible."""
    from device_sdk import lightfr
    from device_sdk.models import LightFRConfig, LightFRModel

    rng = np.random.default_rng(8)
    m, f = 300, 64
    cfg = LightFRConfig(bits=f, rating_range=None, binary_positives=True, unobserved_weight=0.05, query_planes=3)
    model = LightFRModel(m, cfg, n_users=2, rng=np.random.default_rng(0))
    model.set_item_codes(random_signs(m, f, rng), 1)
    liked = rng.choice(m, 15, replace=False)
    model.fold_in(liked, userid=0)
    model.set_user_code(random_signs(1, f, rng)[0], userid=1)
    assert model.user_weight[0] > 0 and model.user_weight[1] == 0
    cand = rng.choice(m, 40, replace=False)
    ids, scores = model.recommend(
        userid=np.array([0, 1]), N=50, items=cand, filter_items=liked, filter_already_liked_items=False
    )
    eligible = np.setdiff1d(cand, liked)
    delta = 2.0 * model.user_weight[0] / (2**lightfr.LEVEL_SHIFT * model.hamming_weight)
    real = delta * (model.item_codes.astype(np.int64) @ model.user_q[0].astype(np.int64)) / f
    n_ok = eligible.size
    np.testing.assert_allclose(scores[0, :n_ok], np.sort(real[eligible])[::-1], rtol=1e-6)
    assert set(ids[0, :n_ok]) == set(eligible) and np.all(ids[0, n_ok:] == -1)
    assert np.all(np.isneginf(scores[0, n_ok:]))
    hamming = 1 - (f - model.item_codes.astype(np.int64) @ model.user_codes[1].astype(np.int64)) / (2 * f)
    np.testing.assert_allclose(scores[1, :n_ok], np.sort(hamming[eligible])[::-1], rtol=1e-6)
    one, one_scores = model.recommend(userid=0, N=5, filter_already_liked_items=False)
    np.testing.assert_allclose(one_scores, np.sort(real)[::-1][:5], rtol=1e-6)


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    m=st.integers(1, 600),
    f=st.sampled_from([5, 64, 130]),
    P=st.integers(1, 4),
    n=st.integers(1, 20),
    n_levels=st.sampled_from([0, 1, 4, 256]),
    k=st.integers(0, 30),
    block_pairs=st.sampled_from([1, 64, 1000, 1 << 15]),
    n_excl=st.integers(0, 8),
    with_cand=st.booleans(),
)
def test_batched_plane_search_is_the_per_user_search(
    seed: int, m: int, f: int, P: int, n: int, n_levels: int, k: int, block_pairs: int, n_excl: int, with_cand: bool
) -> None:
    """One batched scan for n plane users returns, row by row, exactly what `search_planes` returns
    for each user in turn: the same items and scores with rng=None (the reference ranking), and the
    same items, ties included, with a generator seeded alike."""
    from device_sdk import lightfr
    from device_sdk.topk import PLANE_PAD

    rng = np.random.default_rng(seed)
    D = random_signs(3, f, rng)[rng.integers(0, 3, m)]
    D = np.where(rng.random(D.shape) < 0.05, -D, D).astype(np.int8)
    levels = None if n_levels == 0 else rng.integers(0, n_levels, m).astype(np.uint8)
    index = HammingIndex(pack_signs(D), f, levels, int(rng.integers(1, 5)))
    top = 2**P - 1
    q = (2 * rng.integers(0, top + 1, (n, f)) - top).astype(np.int16)
    planes = np.ascontiguousarray(pack_signs(np.swapaxes(lightfr.sign_planes(q, P), 0, 1).reshape(-1, f)).T)
    planes = planes.reshape(n, P, -1)
    a = rng.choice([1, 3, 64, 1000], n)
    excl = [None if u % 3 == 2 else rng.choice(m, min(n_excl, m), replace=False) for u in range(n)]
    cand = rng.choice(m, min(m, 40), replace=False) if with_cand else None
    for tie_seed in (None, seed):
        gen = None if tie_seed is None else np.random.default_rng(tie_seed)
        ids, scores = index.search_planes_batch(
            planes, a, k, gen, exclude=excl, candidates=cand, block_pairs=block_pairs
        )
        assert ids.shape == scores.shape == (n, k)
        gen = None if tie_seed is None else np.random.default_rng(tie_seed)
        for u in range(n):
            one_ids, one_scores = index.search_planes(planes[u], int(a[u]), k, gen, exclude=excl[u], candidates=cand)
            got = ids[u] >= 0
            assert np.array_equal(ids[u, got], one_ids) and np.array_equal(scores[u, got], one_scores)
            assert np.all(scores[u, ~got] == PLANE_PAD) and not got[one_ids.size :].any()
            if tie_seed is None:
                ref = _plane_reference(D, q[u], int(a[u]), levels)
                pool = np.arange(m) if cand is None else cand
                want = _reference_ranking_in(ref, k, excl[u], pool)
                assert np.array_equal(one_ids, want) and np.array_equal(one_scores, ref[want])


def _reference_ranking_in(ref: np.ndarray, k: int, excl: np.ndarray | None, pool: np.ndarray) -> np.ndarray:
    keep = pool if excl is None else np.setdiff1d(pool, excl)
    return keep[np.lexsort((keep, -ref[keep]))][:k]


def test_batched_plane_search_validates_its_inputs() -> None:
    words = pack_signs(random_signs(5, 64, np.random.default_rng(0)))
    index = HammingIndex(words, 64)
    planes = words.T[None, :2].copy()  # (1, 2, 1)
    with pytest.raises(ValueError, match="planes"):
        index.search_planes_batch(planes[0], [1], 3, None)
    with pytest.raises(ValueError, match="weights"):
        index.search_planes_batch(planes, [0], 3, None)
    with pytest.raises(ValueError, match="weights"):
        index.search_planes_batch(planes, [1, 2], 3, None)
    with pytest.raises(ValueError, match="exclude"):
        index.search_planes_batch(planes, [1], 3, None, exclude=[None, None])
    with pytest.raises(ValueError, match="out of range"):
        index.search_planes_batch(planes, [1], 3, None, exclude=[np.array([5])])
    with pytest.raises(ValueError, match="level shift"):
        index.search_planes_batch(planes, [1], 3, None, level_shift=17)


def test_model_batch_recommend_is_the_per_user_recommend() -> None:
    """`LightFRModel.recommend(userid=array)` for plane users of two plane counts (3 and 2) and a ±1
    code user, with levels and per-user filters: row for row what one call per user gives with a
    generator seeded alike (the batch ranks each plane count in one scan)."""
    from device_sdk.models import LightFRConfig, LightFRModel

    rng = np.random.default_rng(11)
    m, f, n = 3000, 64, 6
    model = LightFRModel(m, LightFRConfig(bits=f, rating_range=None), n_users=n, rng=np.random.default_rng(0))
    base = random_signs(4, f, rng)[rng.integers(0, 4, m)]  # many exact ties
    model.set_item_codes(np.where(rng.random(base.shape) < 0.1, -base, base).astype(np.int8), 1)
    model.item_levels, model.hamming_weight = rng.integers(100, 110, m).astype(np.uint8), 2
    liked = [rng.choice(m, 20, replace=False) for _ in range(n)]
    for u in range(n):
        model.fold_in(liked[u], userid=u)
    model.user_q[4] = np.clip(model.user_q[4], -3, 3) | 1  # a vector of 2 planes
    model.set_user_code(random_signs(1, f, rng)[0], userid=5)  # a ±1 code
    assert (model.user_weight[:5] > 0).all() and model.user_weight[5] == 0
    users = np.array([3, 0, 5, 4, 1, 2])
    ids, scores = model.recommend([liked[u] for u in users], N=15, userid=users, rng=np.random.default_rng(5))
    for row, u in enumerate(users):
        one_ids, one_scores = model.recommend(liked[u], N=15, userid=int(u), rng=np.random.default_rng(row))
        assert np.array_equal(scores[row], one_scores)  # the same scores; items may differ among ties
        assert not np.isin(ids[row], liked[u]).any() and np.unique(ids[row]).size == 15
        sure = scores[row] > scores[row, -1]
        assert set(ids[row, sure]) == set(one_ids[sure])
    # Plane users of one plane count: one scan, the same tie draws as one call per user in turn.
    same = np.array([2, 0, 3, 1])
    ids, scores = model.recommend([liked[u] for u in same], N=15, userid=same, rng=np.random.default_rng(7))
    gen = np.random.default_rng(7)
    for row, u in enumerate(same):
        one_ids, one_scores = model.recommend(liked[u], N=15, userid=int(u), rng=gen)
        assert np.array_equal(ids[row], one_ids) and np.array_equal(scores[row], one_scores)


def test_plane_search_with_the_byte_bound_is_the_reference_ranking() -> None:
    """From 2^19 items, P = 3 at f = 64 scans with the high planes' byte bound: still exactly the
    reference ranking, with exclusions, a few levels and a second block."""
    rng = np.random.default_rng(19)
    m = (1 << 19) + 777
    D, q, levels, planes = _plane_case(rng, m, 64, 3, 6)
    index = HammingIndex(pack_signs(D), 64, levels, 2)
    for a in (1, 9):
        ref = _plane_reference(D, q, a, levels)
        excl = rng.choice(m, 30, replace=False)
        for block in (1 << 16, 1 << 18):
            ids, scores = index.search_planes(planes, a, 25, None, exclude=excl, block=block)
            want = _reference_ranking(ref, 25, excl)
            assert np.array_equal(ids, want) and np.array_equal(scores, ref[want])


def _substring_sizes(**sizes: float) -> Any:
    """The substring (multi-index) search's sizes patched down, so that small catalogues take it."""
    return _patch_topk(**{"_MIH_MIN": 1, "_PLANE_MIH_MIN": 1, "_MIH_GROUP_MIN": 16, **sizes})


def _patch_topk(**values: Any) -> Any:
    """The top-k package's module constants patched to ``values`` (a context manager), in each of its
    modules that holds the name: a constant shared by several modules is imported into each."""
    from contextlib import ExitStack
    from unittest import mock

    from device_sdk.topk import index, select

    stack = ExitStack()
    for name, value in values.items():
        held = [mod for mod in (index, topk_scan, topk_substring, topk_planes, select) if hasattr(mod, name)]
        assert held, f"no topk module holds {name}"
        for mod in held:
            stack.enter_context(mock.patch.object(mod, name, value))
    return stack


def _clustered_codes(rng: np.random.Generator, m: int, n_centres: int, flip: float) -> np.ndarray:
    base = random_signs(n_centres, 64, rng)
    D = base[rng.integers(0, n_centres, m)]
    return np.where(rng.random(D.shape) < flip, -D, D).astype(np.int8)


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    m=st.integers(1, 2500),
    n_levels=st.sampled_from([0, 2, 16, 256]),
    weight=st.sampled_from([1, 2, 4]),
    k=st.integers(1, 40),
    n_excl=st.integers(0, 6),
    shape=st.sampled_from(["random", "clustered", "tight", "far"]),
    radius=st.sampled_from([0, 1, 2]),
    margin=st.sampled_from([0.01, 0.5, 3.0]),
    rounds=st.sampled_from([2, 80, 80, 80]),
    fallback=st.sampled_from([0.3, 8.0, 8.0, 8.0]),
    group_min=st.sampled_from([1, 16, 400]),
)
def test_substring_search_is_the_reference_ranking(
    seed: int,
    m: int,
    n_levels: int,
    weight: int,
    k: int,
    n_excl: int,
    shape: str,
    radius: int,
    margin: float,
    rounds: int,
    fallback: float,
    group_min: int,
) -> None:
    """One user's multi-index search (f = 64) with its sizes patched down: every catalogue size from
    one item, random codes, clustered ones (many exact ties, repeats across the 4 substrings, dense
    buckets that take the fallback), a user far from every item, levels (level groups scanned or
    indexed), exclusions, k above what is left; a first radius of 0-2, a first threshold far too low
    (``margin`` 0.01: T grows round by round) or high, and rounds and a fallback budget that end the
    search early.  Ranking (rng=None) and scores (random ties) are the reference's."""
    rng = np.random.default_rng(seed)
    if shape == "random":
        D = random_signs(m, 64, rng)
    else:
        D = _clustered_codes(rng, m, 3, 0.02 if shape == "tight" else 0.1)
    u = -D[0] if shape == "far" else random_signs(1, 64, rng)[0] if shape == "random" else D[-1]
    levels = None if n_levels == 0 else rng.integers(0, n_levels, m).astype(np.uint8)
    ref = _reference_scores(u[None, :], D, levels, weight)[0]
    excl = rng.choice(m, min(n_excl, m), replace=False)
    with _substring_sizes(
        _MIH_FIRST_RADIUS=radius,
        _MIH_MARGIN=margin,
        _MIH_ROUNDS=rounds,
        _MIH_FALLBACK=fallback,
        _MIH_GROUP_MIN=group_min,
    ):
        index = HammingIndex(pack_signs(D), 64, levels, weight)
        found = topk_substring._substring_one(index, pack_user(u), min(k + excl.size, m))
        if found is not None:
            ids, cost = found
            assert np.unique(ids).size == ids.size  # an item found in several substrings counts once
            kth = np.sort(ref[np.setdiff1d(np.arange(m), [])])[::-1][min(k + excl.size, m) - 1]
            assert set(np.flatnonzero(ref >= kth)) <= set(ids.tolist())
        ids, scores = index.search(pack_user(u), k, None, exclude=[excl])
        want = _reference_ranking(ref, k, excl)
        assert np.array_equal(ids[0, : want.size], want) and np.all(ids[0, want.size :] == -1)
        assert np.array_equal(scores[0, : want.size], ref[want])
        ids, scores = index.search(pack_user(u), k, rng, exclude=[excl])
        assert np.array_equal(scores[0, : want.size], ref[want]) and np.array_equal(ref[ids[0, : want.size]], ref[want])
        assert np.unique(ids[0, : want.size]).size == want.size and not np.isin(ids[0], excl).any()


def _count_rounds(index: HammingIndex, user: np.ndarray, kk: int) -> tuple[Any, int]:
    """The substring search's answer and how many times it gathered finds (round 1 is one)."""
    from unittest import mock

    real = topk_substring._SubstringTables.expand
    calls = []

    def counted(self: Any, *args: Any) -> Any:
        calls.append(args[3])
        return real(self, *args)

    with mock.patch.object(topk_substring._SubstringTables, "expand", counted):
        out = topk_substring._substring_one(index, user, kk)
    return out, len(calls)


def test_substring_search_grows_its_threshold_round_by_round() -> None:
    """A first threshold far too low (the estimate asked for 0.01 items): T grows by one a round until
    kk distinct items are found under a complete probe; the answer is the linear scan's, and it stops
    (the linear scan is taken) when the rounds run out."""
    rng = np.random.default_rng(5)
    m = 4000
    D = random_signs(m, 64, rng)
    levels = rng.integers(0, 16, m).astype(np.uint8)
    for lv in (None, levels):
        ref_index = HammingIndex(pack_signs(D), 64, lv, 4)
        with _substring_sizes(_MIH_MARGIN=0.01, _MIH_FIRST_RADIUS=2, _MIH_ROUNDS=80, _MIH_FALLBACK=8.0):
            index = HammingIndex(pack_signs(D), 64, lv, 4)
            for u in random_signs(3, 64, rng):
                ref = _reference_scores(u[None, :], D, lv, 4)[0]
                found, rounds = _count_rounds(index, pack_user(u), 12)
                assert found is not None and rounds >= 3  # round 1, then T grew at least twice
                ids, scores = index.search(pack_user(u), 12, None)
                want = _reference_ranking(ref, 12, None)
                assert np.array_equal(ids[0], want) and np.array_equal(scores[0], ref[want])
                assert np.array_equal(ref_index.search(pack_user(u), 12, None)[0], ids)
        with _substring_sizes(_MIH_MARGIN=0.01, _MIH_FIRST_RADIUS=2, _MIH_ROUNDS=1, _MIH_FALLBACK=8.0):
            index = HammingIndex(pack_signs(D), 64, lv, 4)
            u = random_signs(1, 64, rng)[0]
            assert _count_rounds(index, pack_user(u), 12)[0] is None
            ref = _reference_scores(u[None, :], D, lv, 4)[0]
            want = _reference_ranking(ref, 12, None)
            assert np.array_equal(index.search(pack_user(u), 12, None)[0][0], want)


def test_substring_search_falls_back_to_the_scan_on_dense_buckets() -> None:
    """Codes in two tight clusters and a user inside one: the probes would find most of the catalogue,
    so the search gives up before gathering (the bucket counts say so) and the linear scan answers."""
    rng = np.random.default_rng(9)
    m = 5000
    D = _clustered_codes(rng, m, 2, 0.01)
    levels = None  # no item term: nothing bounds the scan early (see the level-group tests for levels)
    with _substring_sizes(_MIH_GROUP_MIN=64):
        index = HammingIndex(pack_signs(D), 64, levels, 2)
        for inside, u in ((True, D[0]), (True, D[1]), (False, -D[2])):
            ref = _reference_scores(u[None, :], D, levels, 2)[0]
            found, rounds = _count_rounds(index, pack_user(u), 10)
            # Inside a cluster nothing is gathered (the first probe's counts are enough to give up); the
            # user opposite to both clusters may gather a few first finds, then the needed radius is too large.
            assert found is None and (rounds == 0 or not inside)
            ids, scores = index.search(pack_user(u), 10, None)
            want = _reference_ranking(ref, 10, None)
            assert np.array_equal(ids[0], want) and np.array_equal(scores[0], ref[want])
    with _substring_sizes(_MIH_GROUP_MIN=64, _MIH_FALLBACK=8.0, _MIH_ROUNDS=80):
        # Without the budget, the same searches answer, and exactly: it was the budget that gave up.
        index = HammingIndex(pack_signs(D), 64, levels, 2)
        for u in (D[0], D[1], -D[2]):
            ref = _reference_scores(u[None, :], D, levels, 2)[0]
            ids, cost = topk_substring._substring_one(index, pack_user(u), 10)
            assert np.sort(ref[ids])[::-1][9] == np.sort(ref)[::-1][9]


@pytest.mark.parametrize("lv", [None, 3])
def test_substring_search_at_the_pigeonhole_bound_and_substring_edges(lv: int | None) -> None:
    """Items at distance d from the user, their d flipped bits dealt round-robin over the 4 substrings
    from the substrings' edges (bits 0, 16, 32, 48, 15, 31, 47, 63, 1, 17, ...): each substring then
    differs in about d/4 bits, the largest radius that still finds them.  For d = 4, 8, 12, 16 such an
    item ties (same distance and level) with a twin of a higher id whose flips all sit in the lowest
    substrings, which a smaller probe finds: a search whose probes stopped one short of the pigeonhole
    bound would count the twin and miss the spread item, which the lower id must win.  The nearest items
    must all be found, with the rest of the catalogue random and far."""
    rng = np.random.default_rng(21)
    m = 3000
    u = random_signs(1, 64, rng)[0]
    D = random_signs(m, 64, rng)
    levels = None if lv is None else rng.integers(0, 16, m).astype(np.uint8)
    edges = [16 * s + (r // 2 if r % 2 == 0 else 15 - r // 2) for r in range(16) for s in range(4)]
    near = {}
    for i, d in enumerate(range(4, 24)):
        item = 5 + 37 * i
        D[item] = u
        D[item, edges[:d]] *= -1
        near[item] = d
        if d % 4 == 0 and d <= 16:
            twin = item + 1000
            D[twin] = u
            D[twin, :d] *= -1
            near[twin] = d
            if levels is not None:
                levels[twin] = levels[item]
    for k in (1, 2, 5, 10, 20):
        ref = _reference_scores(u[None, :], D, levels, 4)[0]
        want = _reference_ranking(ref, k, None)
        for radius, margin in ((0, 0.01), (2, 0.5), (1, 3.0)):
            with _substring_sizes(_MIH_FIRST_RADIUS=radius, _MIH_MARGIN=margin, _MIH_ROUNDS=80, _MIH_FALLBACK=8.0):
                index = HammingIndex(pack_signs(D), 64, levels, 4)
                assert topk_substring._substring_one(index, pack_user(u), k) is not None
                ids, scores = index.search(pack_user(u), k, None)
                assert np.array_equal(ids[0], want) and np.array_equal(scores[0], ref[want])
    assert all(hamming_distances_reference(u, D[i : i + 1])[0] == d for i, d in near.items())


def test_substring_search_breaks_ties_uniformly_at_random() -> None:
    """Exact ties through the substring search: 30 items at the user's code, found 4 times each (once
    per substring), and the rest far; k = 3 of the 30 tied (and, with the item term, 6 tied of 12 at
    the top level).  Over 3000 draws each tied item is chosen about equally often (the draw is over the
    distinct tied items, each once), and no other item ever is."""
    rng = np.random.default_rng(3)
    m = 2000
    u = random_signs(1, 64, rng)[0]
    D = random_signs(m, 64, rng)
    tied = rng.choice(m, 30, replace=False)
    D[tied] = u
    levels = np.zeros(m, np.uint8)
    levels[tied[:12]] = 9
    for lv, k, pool in ((None, 3, tied), (levels, 6, tied[:12])):
        with _substring_sizes():
            index = HammingIndex(pack_signs(D), 64, lv, 4)
            assert topk_substring._substring_one(index, pack_user(u), k) is not None
            counts = np.zeros(m)
            draw = np.random.default_rng(11)
            for _ in range(3000):
                ids, _ = index.search(pack_user(u), k, draw)
                counts[ids[0]] += 1
        expect = 3000 * k / pool.size
        assert counts.sum() == 3000 * k and set(np.flatnonzero(counts)) == set(pool.tolist())
        # Binomial(3000, k/|pool|) counts: 4.5 sigma either side.
        sigma = np.sqrt(3000 * (k / pool.size) * (1 - k / pool.size))
        assert np.all(np.abs(counts[pool] - expect) < 4.5 * sigma)


def test_substring_search_scans_a_dense_level_group_and_probes_the_rest() -> None:
    """A level group whose probes would find most of it (2000 items in one tight cluster, the top
    level) is scanned instead, while the larger random group (4000 items, a lower level) is still
    probed (a budget of 0.7 of a group: random codes of a few thousand items need much of it): the
    search answers (no fallback to the whole scan) with the reference ranking.  A dense
    group of half the catalogue or more makes the whole search fall back."""
    rng = np.random.default_rng(13)
    dense, rest = _clustered_codes(rng, 2000, 1, 0.01), random_signs(4000, 64, rng)
    D = np.concatenate((dense, rest))
    levels = np.concatenate((np.full(2000, 3), np.zeros(4000))).astype(np.uint8)
    for u in (dense[0], -dense[0], rest[5]):
        ref = _reference_scores(u[None, :], D, levels, 2)[0]
        want = _reference_ranking(ref, 10, None)
        with _substring_sizes(_MIH_GROUP_MIN=64, _MIH_FALLBACK=0.7):
            index = HammingIndex(pack_signs(D), 64, levels, 2)
            assert topk_substring._substring_one(index, pack_user(u), 10) is not None
            ids, scores = index.search(pack_user(u), 10, None)
            assert np.array_equal(ids[0], want) and np.array_equal(scores[0], ref[want])
    D = np.concatenate((_clustered_codes(rng, 3000, 1, 0.01), random_signs(3000, 64, rng)))
    levels = np.concatenate((np.full(3000, 3), np.zeros(3000))).astype(np.uint8)
    with _substring_sizes(_MIH_GROUP_MIN=64):
        assert topk_substring._substring_one(HammingIndex(pack_signs(D), 64, levels, 2), pack_user(D[0]), 10) is None


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    m=st.integers(1, 3000),
    n=st.integers(1, 7),
    n_levels=st.sampled_from([0, 4, 256]),
    k=st.integers(1, 30),
    n_excl=st.integers(0, 5),
)
def test_substring_batch_is_the_reference_ranking(
    seed: int, m: int, n: int, n_levels: int, k: int, n_excl: int
) -> None:
    """A batch of users through one substring search each (sizes patched down), some of them in a
    tight cluster (their searches give up and are scanned together): each row is the reference."""
    rng = np.random.default_rng(seed)
    D = np.concatenate((_clustered_codes(rng, m // 2, 1, 0.01), random_signs(m - m // 2, 64, rng)))
    U = np.where(rng.random(n)[:, None] < 0.5, D[rng.integers(0, m, n)], random_signs(n, 64, rng)).astype(np.int8)
    levels = None if n_levels == 0 else rng.integers(0, n_levels, m).astype(np.uint8)
    ref = _reference_scores(U, D, levels, 2)
    excl = [rng.choice(m, min(n_excl, m), replace=False) for _ in range(n)]
    with _substring_sizes(_MIH_ROUNDS=80, _MIH_FALLBACK=0.5):
        index = HammingIndex(pack_signs(D), 64, levels, 2)
        ids, scores = index.search(pack_signs(U).T.copy(), k, None, exclude=excl)
        for i in range(n):
            want = _reference_ranking(ref[i], k, excl[i])
            assert np.array_equal(ids[i, : want.size], want) and np.all(ids[i, want.size :] == -1)
            assert np.array_equal(scores[i, : want.size], ref[i, want])
        ids, scores = index.search(pack_signs(U).T.copy(), k, rng, exclude=excl)
        for i in range(n):
            want = _reference_ranking(ref[i], k, excl[i])
            assert np.array_equal(scores[i, : want.size], ref[i, want])
            assert np.unique(ids[i, : want.size]).size == want.size and not np.isin(ids[i], excl[i]).any()


def test_substring_search_leaves_a_strong_item_term_to_the_scan() -> None:
    """With a strong item term the top-level items win and the scan, reading the codes by level, stops
    after them: when the kk-th value of the first items bounds the search within fewer than _MIH_MIN
    items, the substring search gives up at once; with a smaller _MIH_MIN it answers, probing only the
    level groups that can hold a wanted item and scanning only up to that bound.  Exact either way, also
    with ties at the bound's level (items at the user's code on the boundary level)."""
    rng = np.random.default_rng(17)
    m = 6000
    D = random_signs(m, 64, rng)
    u = random_signs(1, 64, rng)[0]
    levels = np.repeat(np.arange(12, 0, -1), m // 12).astype(np.uint8)  # runs of 500 items per level
    rng.shuffle(levels)
    for at in (np.flatnonzero(levels == 9)[:3], np.flatnonzero(levels == 8)[:3]):
        D[at] = u  # ties at the user's code one and two levels below the top
    for minimum, answers in ((4000, False), (600, True)):
        for weight in (1, 4, 16):
            ref = _reference_scores(u[None, :], D, levels, weight)[0]
            with _substring_sizes(_MIH_MIN=minimum, _MIH_GROUP_MIN=300, _MIH_ROUNDS=80, _MIH_FALLBACK=8.0):
                index = HammingIndex(pack_signs(D), 64, levels, weight)
                for k in (1, 3, 6, 10):
                    found = topk_substring._substring_one(index, pack_user(u), k)
                    if answers:
                        assert found is not None
                    elif weight == 4 and k <= 3:
                        # The best k are tied at v = 0 (level 9, q = 0): the scan stops after the 2000
                        # items of levels 12..9, fewer than _MIH_MIN.
                        assert found is None
                    ids, scores = index.search(pack_user(u), k, None)
                    want = _reference_ranking(ref, k, None)
                    assert np.array_equal(ids[0], want) and np.array_equal(scores[0], ref[want])


def _plane_user(rng: np.random.Generator, D: np.ndarray, P: int, shape: str) -> tuple[np.ndarray, np.ndarray]:
    """One plane user's odd integers q (64 of them, |q| <= 2^P − 1) and packed planes: random, or whose
    top plane is an item's code (near: many items close in W), or its opposite (far)."""
    from device_sdk import lightfr

    top = 2**P - 1
    q = 2 * rng.integers(0, top + 1, 64) - top
    if shape != "random":
        sign = D[-1].astype(np.int64) * (1 if shape == "near" else -1)
        q = np.abs(q) * sign
    q = q.astype(np.int16)[None, :]
    return q[0], pack_signs(lightfr.sign_planes(q, P)[:, 0, :]).T.copy()


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    m=st.integers(1, 2500),
    P=st.integers(1, 4),
    a=st.sampled_from([1, 3, 64]),
    s=st.sampled_from([0, 3, 8]),
    n_levels=st.sampled_from([0, 2, 16, 256]),
    weight=st.sampled_from([1, 2, 4]),
    k=st.integers(1, 40),
    n_excl=st.integers(0, 6),
    codes=st.sampled_from(["random", "clustered", "tight"]),
    shape=st.sampled_from(["random", "near", "far"]),
    margin=st.sampled_from([1e-4, 1.0, 4.0, 1e3]),
    rounds=st.sampled_from([2, 80, 80, 80]),
    fallback=st.sampled_from([0.3, 8.0, 8.0, 8.0]),
    group_min=st.sampled_from([1, 16, 400]),
)
def test_substring_plane_search_is_the_reference_ranking(
    seed: int,
    m: int,
    P: int,
    a: int,
    s: int,
    n_levels: int,
    weight: int,
    k: int,
    n_excl: int,
    codes: str,
    shape: str,
    margin: float,
    rounds: int,
    fallback: float,
    group_min: int,
) -> None:
    """One plane user's substring search (f = 64) with its sizes patched down: P = 1..4, the user's
    scale a and level shift s, random and clustered codes (ties, repeats across substrings, dense
    buckets that take the fallback), a user near or far from the items, levels (level groups scanned or
    probed), exclusions; a first threshold far too low (T grows) or high, and rounds and a fallback
    budget that end the search early.  Its candidates hold every item at or below the kk-th cost, and
    the ranking (rng=None) and scores (random ties) are the reference's."""
    rng = np.random.default_rng(seed)
    flip = 0.02 if codes == "tight" else 0.1
    D = random_signs(m, 64, rng) if codes == "random" else _clustered_codes(rng, m, 3, flip)
    q, planes = _plane_user(rng, D, P, shape)
    levels = None if n_levels == 0 else rng.integers(0, n_levels, m).astype(np.uint8)
    ref = _plane_reference(D, q, a, levels, s)
    excl = rng.choice(m, min(n_excl, m), replace=False)
    kk = min(k + excl.size, m)
    with _substring_sizes(
        _PLANE_MIH_MARGIN=margin, _MIH_ROUNDS=rounds, _MIH_FALLBACK=fallback, _MIH_GROUP_MIN=group_min
    ):
        index = HammingIndex(pack_signs(D), 64, levels, weight)
        found = topk_planes._substring_planes(index, planes, a, s, kk)
        if found is not None:
            ids, cost = found
            assert np.unique(ids).size == ids.size
            kth = np.sort(ref)[::-1][kk - 1]
            assert set(np.flatnonzero(ref >= kth)) <= set(ids.tolist())
            top = a * 64 * (2**P - 1) + (0 if levels is None else int(levels.max()) << s)
            assert np.array_equal(top - cost, ref[ids])
        ids, scores = index.search_planes(planes, a, k, None, level_shift=s, exclude=excl)
        want = _reference_ranking(ref, k, excl)
        assert np.array_equal(ids, want) and np.array_equal(scores, ref[want])
        ids, scores = index.search_planes(planes, a, k, rng, level_shift=s, exclude=excl)
        assert np.array_equal(scores, ref[want]) and np.array_equal(ref[ids], scores)
        assert np.unique(ids).size == ids.size and not np.isin(ids, excl).any()


def test_substring_plane_search_at_the_pigeonhole_edge() -> None:
    """Items whose W is exactly the kk-th value, their weight spread evenly or piled into one substring
    (each substring in turn), among far items: every probe order and a threshold grown from far below
    (one step at a time) must find them all; the search answers itself (no scan)."""
    from device_sdk import lightfr

    rng = np.random.default_rng(5)
    m = 3000
    for P in (1, 2, 3, 4):
        q = (2 * rng.integers(0, 2**P, 64) - (2**P - 1)).astype(np.int16)
        planes = pack_signs(lightfr.sign_planes(q[None, :], P)[:, 0, :]).T.copy()
        best = np.where(q > 0, 1, -1).astype(np.int8)  # W = Σ over bits of the planes disagreeing with it
        D = np.tile(-best, (m, 1))  # far items
        D[: m // 2] = np.where(rng.random((m // 2, 64)) < 0.45, -best, best)
        for j in range(5):
            tied = np.arange(m - 40, m)
            D[tied] = best
            # flip 3 bits: in substring j (j < 4), or one in each of 3 substrings (j = 4)
            cols = [16 * j + 1, 16 * j + 5, 16 * j + 9] if j < 4 else [2, 18, 34]
            D[np.ix_(tied, cols)] *= -1
            ref = _plane_reference(D, q, 7, None)
            for k in (5, 40, 41):
                with _substring_sizes(_PLANE_MIH_MARGIN=1e-6, _MIH_ROUNDS=400, _MIH_FALLBACK=8.0, _PLANE_MIH_STEP=0.0):
                    index = HammingIndex(pack_signs(D), 64)
                    found = topk_planes._substring_planes(index, planes, 7, 8, k)
                    assert found is not None
                    kth = np.sort(ref)[::-1][k - 1]
                    assert set(np.flatnonzero(ref >= kth)) <= set(found[0].tolist())
                    ids, scores = index.search_planes(planes, 7, k, None)
                    want = _reference_ranking(ref, k, None)
                    assert np.array_equal(ids, want) and np.array_equal(scores, ref[want])


def test_substring_plane_search_breaks_ties_uniformly_at_random() -> None:
    """Exact ties through the plane substring search: 30 items at the user's best code (each found in
    every substring) and the rest random; k = 3 of the 30.  Over 3000 draws each tied item is chosen
    about equally often and no other item ever is."""
    from device_sdk import lightfr

    rng = np.random.default_rng(3)
    m = 2000
    q = (2 * rng.integers(0, 8, 64) - 7).astype(np.int16)
    planes = pack_signs(lightfr.sign_planes(q[None, :], 3)[:, 0, :]).T.copy()
    D = random_signs(m, 64, rng)
    tied = rng.choice(m, 30, replace=False)
    D[tied] = np.where(q > 0, 1, -1)
    k = 3
    with _substring_sizes():
        index = HammingIndex(pack_signs(D), 64)
        assert topk_planes._substring_planes(index, planes, 2, 8, k) is not None
        counts = np.zeros(m)
        draw = np.random.default_rng(11)
        for _ in range(3000):
            ids, _ = index.search_planes(planes, 2, k, draw)
            counts[ids] += 1
    expect = 3000 * k / tied.size
    assert counts.sum() == 3000 * k and set(np.flatnonzero(counts)) == set(tied.tolist())
    sigma = np.sqrt(3000 * (k / tied.size) * (1 - k / tied.size))
    assert np.all(np.abs(counts[tied] - expect) < 4.5 * sigma)


def test_substring_plane_search_falls_back_on_dense_buckets() -> None:
    """A catalogue of one tight cluster: the probes would find most items, so the search gives up (None)
    and the scan answers exactly; with a level group of its own dense and the rest spread, the dense
    group is scanned and the rest probed, still exact."""
    from device_sdk import lightfr

    rng = np.random.default_rng(8)
    m = 4000
    D = _clustered_codes(rng, m, 1, 0.02)
    q = (2 * rng.integers(0, 8, 64) - 7).astype(np.int16)
    planes = pack_signs(lightfr.sign_planes(q[None, :], 3)[:, 0, :]).T.copy()
    ref = _plane_reference(D, q, 3, None)
    with _substring_sizes(_MIH_GROUP_MIN=64):
        index = HammingIndex(pack_signs(D), 64)
        assert topk_planes._substring_planes(index, planes, 3, 8, 10) is None
        ids, scores = index.search_planes(planes, 3, 10, None)
        want = _reference_ranking(ref, 10, None)
        assert np.array_equal(ids, want) and np.array_equal(scores, ref[want])
    D[: 2 * m // 3] = random_signs(2 * m // 3, 64, rng)
    best = np.where(q > 0, 1, -1).astype(np.int8)
    D[2 * m // 3 :] = np.where(rng.random((m - 2 * m // 3, 64)) < 0.05, -best, best)  # a cluster near the user
    levels = np.zeros(m, np.uint8)
    levels[2 * m // 3 :] = 1  # the tight cluster, a third of the catalogue: a level group of its own
    ref = _plane_reference(D, q, 3, levels, 0)
    with _substring_sizes(_MIH_GROUP_MIN=64, _MIH_FALLBACK=0.5, _MIH_ROUNDS=80):
        from unittest import mock

        index = HammingIndex(pack_signs(D), 64, levels)
        real, scans = topk_substring._scan_group, []

        def counted(tb: Any, g: int, *args: Any) -> Any:
            scans.append(tb.spans[g])
            return real(tb, g, *args)

        with mock.patch.object(topk_substring, "_scan_group", counted):
            found = topk_planes._substring_planes(index, planes, 3, 0, 10)
        assert found is not None and scans == [(0, m - 2 * m // 3)]  # the scan order puts the top level first
        assert set(np.flatnonzero(ref >= np.sort(ref)[::-1][9])) <= set(found[0].tolist())
        ids, scores = index.search_planes(planes, 3, 10, None, level_shift=0)
        want = _reference_ranking(ref, 10, None)
        assert np.array_equal(ids, want) and np.array_equal(scores, ref[want])


def test_substring_index_off_keeps_the_scan_and_no_tables() -> None:
    """``substring_index=False`` (the device setting `LightFRConfig.substring_index`) never builds the
    tables, whatever the catalogue's size, and ranks exactly as the index that builds them; copies
    keep the setting; a non-bool is refused."""
    import copy

    rng = np.random.default_rng(11)
    m = 3000
    D = random_signs(m, 64, rng)
    levels = rng.integers(0, 16, m).astype(np.uint8)
    with _substring_sizes(_MIH_FALLBACK=8.0, _MIH_ROUNDS=80):
        on = HammingIndex(pack_signs(D), 64, levels, 4)
        off = HammingIndex(pack_signs(D), 64, levels, 4, substring_index=False)
        for u in random_signs(4, 64, rng):
            a = on.search(pack_user(u), 10, np.random.default_rng(3))
            b = off.search(pack_user(u), 10, np.random.default_rng(3))
            ref = _reference_scores(u[None, :], D, levels, 4)[0]
            assert np.array_equal(np.sort(a[1][0]), np.sort(b[1][0]))
            assert np.array_equal(np.sort(b[1][0])[::-1], np.sort(ref)[::-1][:10])
        q, planes = _plane_user(rng, D, 3, "random")
        ref = _plane_reference(D, q, 5, levels)
        want = _reference_ranking(ref, 10, None)
        for index in (on, off):
            ids, scores = index.search_planes(planes, 5, 10, None)
            assert np.array_equal(ids, want) and np.array_equal(scores, ref[want])
        assert on._mih is not None and off._mih is None
        clone = copy.deepcopy(off)
        clone.search(pack_user(random_signs(1, 64, rng)[0]), 10, None)
        assert clone._mih is None
    with pytest.raises(ValueError, match="substring_index must be a bool"):
        HammingIndex(pack_signs(D), 64, substring_index="yes")  # type: ignore[arg-type]


def test_topk_hamming_builds_no_substring_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-shot `topk_hamming` builds an index for one search: building the substring tables there
    would cost ~100x the scan they save (0.13 s against ~1 ms at 10^6 items), so it never does."""
    from device_sdk.topk import index as topk_index

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("topk_hamming built substring tables")

    monkeypatch.setattr(topk_index, "_SubstringTables", refuse)
    rng = np.random.default_rng(12)
    D = random_signs(2000, 64, rng)
    u = random_signs(1, 64, rng)[0]
    with _substring_sizes():
        ids, dist = topk_hamming(pack_user(u), pack_signs(D), 64, 10, None)
    ref = hamming_distances_reference(u, D)
    assert np.array_equal(dist, np.sort(ref)[:10])


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    m=st.integers(1, 2500),
    n=st.integers(1, 20),
    P=st.integers(1, 4),
    n_levels=st.sampled_from([0, 16]),
    k=st.integers(1, 30),
    rounds=st.sampled_from([1, 80]),
)
def test_substring_plane_batch_is_the_per_user_search(
    seed: int, m: int, n: int, P: int, n_levels: int, k: int, rounds: int
) -> None:
    """search_planes_batch with the substring tables (sizes patched down): one substring search per
    user, the users it gives up on (``rounds`` 1 makes many give up) scanned together; every row is
    the reference's and exactly what search_planes gives for that user in turn with the same generator."""
    from device_sdk import lightfr

    rng = np.random.default_rng(seed)
    D = _clustered_codes(rng, m, 3, 0.1) if seed % 2 else random_signs(m, 64, rng)
    top = 2**P - 1
    q = (2 * rng.integers(0, top + 1, (n, 64)) - top).astype(np.int16)
    planes = np.ascontiguousarray(pack_signs(np.swapaxes(lightfr.sign_planes(q, P), 0, 1).reshape(-1, 64)).T)
    planes = planes.reshape(n, P, 1)
    a = rng.integers(1, 40, n)
    levels = None if n_levels == 0 else rng.integers(0, n_levels, m).astype(np.uint8)
    excl = [rng.choice(m, min(3, m), replace=False) if u % 2 else None for u in range(n)]
    with _substring_sizes(_MIH_ROUNDS=rounds, _MIH_FALLBACK=0.5):
        index = HammingIndex(pack_signs(D), 64, levels, 2)
        ids, scores = index.search_planes_batch(planes, a, k, np.random.default_rng(4), exclude=excl)
        draw = np.random.default_rng(4)
        for u in range(n):
            one_ids, one_scores = index.search_planes(planes[u], int(a[u]), k, draw, exclude=excl[u])
            assert np.array_equal(ids[u, : one_ids.size], one_ids) and np.all(ids[u, one_ids.size :] == -1)
            assert np.array_equal(scores[u, : one_ids.size], one_scores)
            ref = _plane_reference(D, q[u], int(a[u]), levels)
            want = _reference_ranking(ref, k, excl[u])
            assert np.array_equal(one_scores, ref[want])


def test_substring_plane_search_finds_the_farthest_items() -> None:
    """k = m with items at the largest W (every substring at its largest weight): T reaches its top and
    every radius its largest value, so a probe clamped one short of a whole table misses them."""
    from device_sdk import lightfr

    rng = np.random.default_rng(9)
    m = 300
    for P in (1, 2, 3, 4):
        q = (2 * rng.integers(0, 2**P, 64) - (2**P - 1)).astype(np.int16)
        planes = pack_signs(lightfr.sign_planes(q[None, :], P)[:, 0, :]).T.copy()
        worst = np.where(q > 0, -1, 1).astype(np.int8)
        D = np.where(rng.random((m, 64)) < 0.05, -worst, worst).astype(np.int8)
        D[:7] = worst
        ref = _plane_reference(D, q, 3, None)
        with _substring_sizes(_MIH_ROUNDS=400, _MIH_FALLBACK=8.0):
            index = HammingIndex(pack_signs(D), 64)
            for k in (m, m - 3):
                found = topk_planes._substring_planes(index, planes, 3, 8, k)
                assert found is not None
                kth = np.sort(ref)[::-1][k - 1]
                assert set(np.flatnonzero(ref >= kth)) <= set(found[0].tolist())
                ids, scores = index.search_planes(planes, 3, k, None)
                want = _reference_ranking(ref, k, None)
                assert np.array_equal(ids, want) and np.array_equal(scores, ref[want])


def test_substring_searches_scan_a_group_that_falls_back_in_a_later_round() -> None:
    """Three level groups of a third each and a first threshold far too low: T grows round by round
    until a group's finds pass its budget, in a later round, and that group is scanned from then on.
    Both substring searches (Hamming and planes) must then still return the reference ranking."""
    from unittest import mock

    from device_sdk import lightfr

    rng = np.random.default_rng(21)
    m = 3000
    u = random_signs(1, 64, rng)[0]
    D = random_signs(m, 64, rng)
    # The top level's third: a loose cluster around the user (35% of bits flipped), where the winners are:
    # its first probes find few, a later round's finds pass the budget.
    D[:1000] = np.where(rng.random((1000, 64)) < 0.35, -u, u)
    levels = np.repeat(np.array([2, 1, 0], np.uint8), 1000)
    q = (u * (2 * rng.integers(0, 4, 64) + 1)).astype(np.int16)  # the user's best code is u
    planes = pack_signs(lightfr.sign_planes(q[None, :], 3)[:, 0, :]).T.copy()
    real_scan, real_gather = topk_substring._scan_group, topk_substring._SubstringTables.gather
    turns: list[int] = []  # per group scanned, how many gathers came before it
    calls: list[int] = []

    def counted(*args: Any) -> Any:
        turns.append(len(calls))
        return real_scan(*args)

    def gathered(self: Any, *args: Any) -> Any:
        calls.append(1)
        return real_gather(self, *args)

    with (
        _substring_sizes(
            _MIH_MARGIN=0.01, _PLANE_MIH_MARGIN=1e-6, _MIH_ROUNDS=400, _MIH_FALLBACK=0.15, _MIH_GROUP_MIN=64
        ),
        mock.patch.object(topk_substring, "_scan_group", counted),
        mock.patch.object(topk_substring._SubstringTables, "gather", gathered),
    ):
        index = HammingIndex(pack_signs(D), 64, levels, 1)
        for k in (5, 30):
            turns.clear()
            calls.clear()
            ids, scores = index.search(pack_user(u), k, None)
            ref = _reference_scores(u[None, :], D, levels, 1)[0]
            want = _reference_ranking(ref, k, None)
            assert np.array_equal(ids[0], want) and np.array_equal(scores[0], ref[want])
            assert turns and max(turns) > 0  # a group fell back after probes had been gathered
            turns.clear()
            calls.clear()
            ids, scores = index.search_planes(planes, 2, k, None, level_shift=0)
            ref = _plane_reference(D, q, 2, levels, 0)
            want = _reference_ranking(ref, k, None)
            assert np.array_equal(ids, want) and np.array_equal(scores, ref[want])
            assert turns and max(turns) > 0
