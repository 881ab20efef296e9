"""`LightFRModel`'s two-stage ranking: stage 1 keeps each user's C best items by a Hamming cost over the
packed codes (`device_sdk.topk.HammingIndex.candidates`), stage 2 re-scores only those, with the
real-valued item embeddings against the user's real-valued vector (`device_sdk.realvalued`) when the model
holds them, else with the user's bit-planes.

Invariants:
- Stage 1 is the device's binary ranking, whatever stage 2 is: its query is the top plane of the user's
  ranking vector (the sign of the vector solved against the item codes), or its ±1 code, and its item
  term weighs one level as the user's full score does against one bit of that plane: λ = 2^s /
  (2a·(2^P − 1)) for a plane user (its score is a·Σ_p 2^p·(f − 2·H_p) + 2^s·level), 1/B for a ±1 code.
  (The sign of M·u, M = (DᵀD)⁻¹DᵀE mapping the real-valued user vector into code space, recalled less
  of E·u's top 10 on synthetic data: 0.35 against 0.42 at C = 200, 10^5 items.)
- Stage 1 asks for C + |excluded| items, so at least C eligible ones reach stage 2 (all of them when the
  catalogue is smaller); the excluded are dropped before stage 2.
- Stage 2 is exact among the candidates: its scores are the ones the single-stage ranking would give
  (the plane score Δ'·qᵀd/f + β, or E·u), and the top N among the candidates equals the full ranking's
  whenever that top N lies among them.  Ties are broken uniformly at random (`realvalued.top_rows`).
- One user over the whole catalogue (`top_one`, what `recommend` runs for one userid) and a batch with
  no row re-ranked by E·u (`top_n`) take the same calls row by row: stage 1 (`candidates_one`), the
  excluded dropped, then the top N by the integer plane score (W alone without levels), scaled for the
  N kept; the same candidates, scores and tie draws as the padded batch path (`stage1`,
  `realvalued.top_rows`).
- ``rerank=False`` switches stage 2 off: such a user gets stage 1's own N best (by v, scored 1 − v/f).
  It is the cheapest ranking and better than the ±1 code it trains with (amazon-book validation,
  benchmarks/two_stage_amazon.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import ArrayLike, NDArray

from device_sdk import lightfr, realvalued
from device_sdk.topk.candidates import values_of, without
from protocol.codes import pack_signs
from protocol.families.lightfr import LEVEL_CENTER

if TYPE_CHECKING:
    from device_sdk.models import LightFRModel

__all__ = [
    "adopt_embeddings",
    "one_in_two_stages",
    "plane_counts",
    "plane_words",
    "stage1",
    "stage1_of",
    "stage1_queries",
    "top_n",
    "top_one",
    "top_n_planes",
    "top_n_real",
    "two_stage_rows",
]


def two_stage_rows(model: LightFRModel, users: NDArray[np.int64]) -> NDArray[np.bool_]:
    """Which of ``users`` go through stage 1 (`top_n`): those holding a real-valued vector for the model's
    embeddings or bit-planes, unless ``candidates`` is 0 with ``rerank`` on (every item scored then)."""
    cfg = model.config
    if cfg.rerank and cfg.candidates == 0:
        return np.zeros(users.size, bool)
    if users.size == 1:  # one user: scalar reads
        return np.array([one_in_two_stages(model, int(users[0]))])
    ok = model.user_weight[users] > 0
    if model.item_embeddings is not None:
        ok |= model.user_vector_ok[users]
    return ok


def one_in_two_stages(model: LightFRModel, u: int) -> bool:
    """`two_stage_rows` of one user, from scalars."""
    cfg = model.config
    if cfg.rerank and cfg.candidates == 0:
        return False
    return bool(model.user_weight[u] > 0) or (model.item_embeddings is not None and bool(model.user_vector_ok[u]))


def plane_counts(model: LightFRModel, users: NDArray[np.int64]) -> NDArray[np.int64]:
    """P of each plane user's vector: the bit length of its largest |q| (0 for a ±1 code)."""
    top = np.abs(model.user_q[users].astype(np.int64)).max(axis=1)
    P = (top[:, None] >= 1 << np.arange(9)).sum(axis=1)
    return np.where(model.user_weight[users] > 0, np.maximum(P, 1), 0)


def plane_words(q: NDArray[np.integer], P: int, w: int) -> NDArray[np.uint64]:
    """The P ±1 planes of odd integers q (r, f) (`device_sdk.lightfr.sign_planes`), packed: (r, P, w)
    uint64, plane p weighing 2^p, bit k of a plane code k (the bit order of `protocol.codes`)."""
    r, f = q.shape
    v = (q.astype(np.int16) + (2**P - 1)) >> 1  # in [0, 2^P − 1]: bit p of v is plane p's bit
    bits = ((v[:, None, :] >> np.arange(P, dtype=np.int16)[None, :, None]) & 1).astype(np.uint8)
    if f != 64 * w:
        bits = np.concatenate((bits, np.zeros((r, P, 64 * w - f), np.uint8)), axis=2)
    packed = np.packbits(bits, axis=2, bitorder="little")
    return np.ascontiguousarray(packed).view("<u8").astype(np.uint64, copy=False)


class _Query:
    """One user's ranking query, derived from its vector (q, a) and cached while they stay the same: its
    plane count P (0: a ±1 code), packed planes (P, w), stage-1 sign code (w,) and λ."""

    __slots__ = ("key", "P", "planes", "sign", "lam", "plane_col", "pow2")

    def __init__(self, key: tuple[bytes, int, int], P: int, planes: NDArray[np.uint64], lam: float) -> None:
        self.key, self.P, self.planes, self.lam = key, P, planes, lam
        self.sign = planes[P - 1] if P else planes[0]
        self.plane_col = np.ascontiguousarray(planes[:, :1])  # (P, 1): the first word of each plane
        self.pow2 = 1 << np.arange(P, dtype=np.int64)  # plane p weighs 2^p


def _query(model: LightFRModel, u: int) -> _Query:
    """User u's `_Query`, from the model's cache when its vector, code and weights did not change."""
    q, a = model.user_q[u], int(model.user_weight[u])
    code = model._user_words[:, u]
    key = (q.tobytes() + code.tobytes(), a, model.hamming_weight)
    held = model._queries.get(u)
    if held is not None and held.key == key:
        return held
    if a > 0:
        P = int(plane_counts(model, np.array([u]))[0])
        planes = plane_words(q[None, :], P, code.size)[0]
        lam = 2.0**lightfr.LEVEL_SHIFT / (2.0 * a * (2.0**P - 1))
        made = _Query(key, P, planes, lam)
    else:
        made = _Query(key, 0, code[None, :].copy(), 1.0 / model.hamming_weight)
    model._queries[u] = made
    return made


def stage1_queries(model: LightFRModel, users: NDArray[np.int64]) -> list[_Query]:
    """Every user's query (stage 1: its sign code and λ, see the module docstring; stage 2: its planes)."""
    return [_query(model, int(u)) for u in users]


def _plane_scores(model: LightFRModel, cand: NDArray[np.int64], query: _Query, a: int) -> NDArray[np.float64]:
    """The real plane score Δ'·qᵀd/f + β of one plane user's candidates (K,) (-1 slots: any value)."""
    f, s, B, P = model.config.bits, lightfr.LEVEL_SHIFT, model.hamming_weight, query.P
    safe = np.maximum(cand, 0)
    iw = model._item_words[:, safe]  # (w, K)
    # W = Σ_p 2^p·H_p: every plane against every candidate in one XOR and one popcount.
    H = np.bitwise_count(iw[None, :, :] ^ query.planes[:, :, None]).sum(axis=1, dtype=np.int64)  # (P, K)
    W = (1 << np.arange(P, dtype=np.int64)) @ H
    levels = model.item_levels
    lv = LEVEL_CENTER if levels is None else levels[safe].astype(np.int64)
    S = a * (f * (2**P - 1) - 2 * W) + (lv << s) - (LEVEL_CENTER << s)
    return S * (2.0 / (2**s * B * f))


def _stage1_scores(model: LightFRModel, cand: NDArray[np.int64], query: _Query) -> NDArray[np.float64]:
    """Stage 1's own score of candidates (-1 slots: any value), 1 − v/f, higher is better."""
    v = values_of(model._hamming_index(), query.sign, query.lam, np.maximum(cand, 0))
    return 1.0 - v / model.config.bits


def _drop(cand: NDArray[np.int64], exclude: list[NDArray[np.int64] | None]) -> None:
    """Set to -1, in place, every candidate of row u that is in ``exclude[u]``."""
    for u, e in enumerate(exclude):
        if e is not None and e.size:
            es = np.sort(e)
            row = cand[u]
            at = np.minimum(np.searchsorted(es, row), es.size - 1)
            row[es[at] == row] = -1


def stage1(
    model: LightFRModel,
    users: NDArray[np.int64],
    exclude: list[NDArray[np.int64] | None],
    items: NDArray[np.int64] | None,
    rng: np.random.Generator | None,
    want: int | None = None,
) -> tuple[list[_Query], NDArray[np.int64]]:
    """Every user's query and stage-1 candidates ((n, K) ids, -1 where excluded or padded): its ``want`` best
    (default the config's C) plus |excluded|."""
    queries = stage1_queries(model, users)
    words = np.array([qy.sign for qy in queries], dtype=np.uint64).reshape(users.size, -1)
    lam = np.array([qy.lam for qy in queries])
    extra = np.array([0 if e is None else e.size for e in exclude], np.int64)
    C = model.config.candidates if want is None else want
    cand = model._hamming_index().candidates(words, C + extra, lam, rng, items=items)
    _drop(cand, exclude)
    return queries, cand


def top_n(
    model: LightFRModel,
    users: NDArray[np.int64],
    N: int,
    exclude: list[NDArray[np.int64] | None],
    items: NDArray[np.int64] | None,
    rng: np.random.Generator,
) -> tuple[NDArray[np.int64], NDArray[np.float32]]:
    """Two-stage top N of ``users`` (all of them `two_stage_rows`): (n, N) ids padded -1 and float32 scores
    padded -inf.  With ``rerank`` off, stage 1 alone: its N best, scored 1 − v/f.

    Over the whole catalogue, unless some user is re-ranked by E·u (one batched product for those rows),
    every user's stage 1 runs first, in turn, then every user's stage 2 in turn (`top_one`'s calls, row by
    row): the same draws as `stage1` then `realvalued.top_rows`."""
    if users.size == 1 and items is None:
        ids, best = top_one(model, int(users[0]), N, exclude[0], rng)
        out_ids = np.full((1, N), -1, np.int64)
        out_scores = np.full((1, N), -np.inf, np.float32)
        out_ids[0, : ids.size], out_scores[0, : ids.size] = ids, best
        return out_ids, out_scores
    E = model.item_embeddings
    if items is None and (E is None or not model.config.rerank or not model.user_vector_ok[users].any()):
        return _top_n_rows(model, users, N, exclude, rng)
    if not model.config.rerank:
        queries, cand = stage1(model, users, exclude, items, rng, want=N)
        scores = np.empty(cand.shape)
        for r in range(users.size):
            scores[r] = _stage1_scores(model, cand[r], queries[r])
        return realvalued.top_rows(cand, scores, N, rng)
    queries, cand = stage1(model, users, exclude, items, rng)
    real = model.user_vector_ok[users] if E is not None else np.zeros(users.size, bool)
    scores = np.empty(cand.shape)
    if real.any():
        assert E is not None
        rows = np.flatnonzero(real)
        scores[rows] = realvalued.dot_rows(E, cand[rows], model.user_vectors[users[rows]])
    for r in np.flatnonzero(~real).tolist():  # plane users, each a few calls over its candidates
        scores[r] = _plane_scores(model, cand[r], queries[r], int(model.user_weight[users[r]]))
    return realvalued.top_rows(cand, scores, N, rng)


def _top_n_rows(
    model: LightFRModel,
    users: NDArray[np.int64],
    N: int,
    exclude: list[NDArray[np.int64] | None],
    rng: np.random.Generator,
) -> tuple[NDArray[np.int64], NDArray[np.float32]]:
    """`top_n` over the whole catalogue: each user's candidates (`_stage1_one`), then each user's stage 2
    (`_stage2_one`), (n, N) padded."""
    queries = stage1_queries(model, users)
    found = [_stage1_one(model, q, N, e, rng) for q, e in zip(queries, exclude, strict=True)]
    out_ids = np.full((users.size, N), -1, np.int64)
    out_scores = np.full((users.size, N), -np.inf, np.float32)
    for r, (q, cand) in enumerate(zip(queries, found, strict=True)):
        ids, best = _stage2_one(model, int(users[r]), q, cand, N, rng)
        out_ids[r, : ids.size], out_scores[r, : ids.size] = ids, best
    return out_ids, out_scores


def top_one(
    model: LightFRModel, u: int, N: int, exclude: NDArray[np.int64] | None, rng: np.random.Generator
) -> tuple[NDArray[np.int64], NDArray[np.float32]]:
    """One two-stage user's top N over the whole catalogue, as 1-D ids and float32 scores (at most N), in as
    few numpy calls as it takes (each costs about a microsecond, the scan of 10^5 items about forty): the
    same candidates, scores and tie draws as a batch row (`stage1`, `realvalued.top_rows`)."""
    query = _query(model, u)
    return _stage2_one(model, u, query, _stage1_one(model, query, N, exclude, rng), N, rng)


def _stage1_one(
    model: LightFRModel, query: _Query, N: int, exclude: NDArray[np.int64] | None, rng: np.random.Generator
) -> NDArray[np.int64]:
    """One user's stage-1 candidates over the whole catalogue, its excluded items left out: C (N with
    ``rerank`` off) plus |excluded| asked for."""
    cfg = model.config
    kk = (cfg.candidates if cfg.rerank else N) + (0 if exclude is None else exclude.size)
    cand = model._hamming_index()._candidates_one(query.sign, kk, query.lam, rng)
    if exclude is not None and exclude.size:
        cand = without(model._hamming_index(), cand, exclude)
    return cand


def _stage2_one(
    model: LightFRModel, u: int, query: _Query, cand: NDArray[np.int64], N: int, rng: np.random.Generator
) -> tuple[NDArray[np.int64], NDArray[np.float32]]:
    """User u's top N of its candidates ``cand`` by stage 2 (stage 1's own value with ``rerank`` off)."""
    E = model.item_embeddings
    if not model.config.rerank:
        ids, best = realvalued.top_row(cand, _stage1_scores(model, cand, query), N, rng)
    elif E is not None and model.user_vector_ok[u]:
        scores = realvalued.dot_rows(E, cand[None, :], model.user_vectors[u : u + 1])[0]
        ids, best = realvalued.top_row(cand, scores, N, rng)
    else:
        return _plane_top(model, cand, query, int(model.user_weight[u]), N, rng)
    return ids, best.astype(np.float32, copy=False)


def _plane_top(
    model: LightFRModel, cand: NDArray[np.int64], query: _Query, a: int, N: int, rng: np.random.Generator
) -> tuple[NDArray[np.int64], NDArray[np.float32]]:
    """`realvalued.top_row` of one plane user's candidates by their plane score (`_plane_scores`), selected on
    an integer (the real score is a positive multiple of S = a·(f·(2^P − 1) − 2·W) + 2^s·(level − 128), W =
    Σ_p 2^p·H_p: the same order and the same tie draws) and scaled for the N kept only.  Without levels the
    selection is on W alone, lowest first."""
    f, s, B, P = model.config.bits, lightfr.LEVEL_SHIFT, model.hamming_weight, query.P
    words = model._item_words
    if words.shape[0] == 1:  # every plane against every candidate: one XOR and one popcount
        H = np.bitwise_count(np.bitwise_xor(words[0].take(cand), query.plane_col))
    else:
        H = np.bitwise_count(words[:, cand][None, :, :] ^ query.planes[:, :, None]).sum(axis=1, dtype=np.int64)
    W = query.pow2 @ H
    levels = model.item_levels
    if levels is None:
        ids, W = _lowest(cand, W, N, rng)
        S = a * (f * (2**P - 1) - 2 * W)
    else:
        S = a * (f * (2**P - 1) - 2 * W) + (levels.take(cand).astype(np.int64) << s) - (LEVEL_CENTER << s)
        ids, S = realvalued.top_row(cand, S, N, rng)
    return ids, (S * (2.0 / (2**s * B * f))).astype(np.float32)


def _lowest(
    ids: NDArray[np.int64], cost: NDArray[np.int64], N: int, rng: np.random.Generator | None
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """`realvalued.top_row` by lowest ``cost``: the same selection and draws as top_row on any score that
    falls strictly as the cost rises."""
    if N <= 0:
        return ids[:0], cost[:0]
    if ids.size > N:
        top = cost <= np.partition(cost, N - 1)[N - 1]  # the N-th lowest and all below it
        ids, cost = ids[top], cost[top]
    key = ids if rng is None else rng.random(ids.size)
    order = np.lexsort((key, cost))[:N]
    return ids[order], cost[order]


def top_n_real(
    model: LightFRModel,
    users: NDArray[np.int64],
    N: int,
    exclude: list[NDArray[np.int64] | None],
    items: NDArray[np.int64] | None,
    rng: np.random.Generator,
) -> tuple[NDArray[np.int64], NDArray[np.float32]]:
    """Without stage 1 (``candidates`` 0): every item (or every one of ``items``) of each user by E·u,
    exact, in the re-rank's memory-bounded blocks."""
    E = model.item_embeddings
    assert E is not None
    ranked = np.arange(model.n_items, dtype=np.int64) if items is None else items
    cand = np.tile(ranked, (users.size, 1))
    _drop(cand, exclude)
    return realvalued.rerank_checked(cand, E, model.user_vectors[users], N, rng)


def adopt_embeddings(
    model: LightFRModel,
    embeddings: ArrayLike | None,
    alpha: float,
    reg: float,
    gram: ArrayLike | None,
    *,
    immutable: bool = False,
) -> None:
    """`LightFRModel.set_embeddings`: check everything, then install E as float16, its Gram and (α, reg), and
    mark every user's real-valued vector stale.  ``immutable``: float16 rows nothing can write (a view of
    bytes read from a store file) are installed as they are instead of copied."""
    if embeddings is None:
        model._embeddings, model._embedding_gram = None, None
        model._derived_clear()
        model.user_vectors = np.zeros((model.n_users, 0), dtype=np.float32)
        model.user_vector_ok[:] = False
        return
    E = realvalued.check_embeddings(embeddings, model.n_items)
    a, r = realvalued.check_ials_params(alpha, reg)
    if immutable and E.dtype == np.float16 and not E.flags.writeable:
        half = E
    else:
        with np.errstate(over="ignore"):
            half = E.astype(np.float16)  # a copy the model owns, even of float16 rows
        half.flags.writeable = False  # read-only however installed, as after a load
    if E.dtype != np.float16 and not realvalued.all_finite(half):  # float16 rows were checked finite above
        raise ValueError("item embeddings must fit float16 (|value| < 65504)")
    d = half.shape[1]
    G = realvalued.embedding_gram(half) if gram is None else realvalued.check_gram(gram, d).astype(np.float32)
    model._embeddings, model._embedding_gram = half, G
    model._derived_clear()
    model.ials_alpha, model.ials_reg = a, r
    model.user_vectors = np.zeros((model.n_users, d), dtype=np.float32)
    model.user_vector_ok[:] = False


def stage1_of(
    model: LightFRModel, userid: int, liked: NDArray[np.int64] | None, candidates: int | None, rng: np.random.Generator
) -> NDArray[np.int64]:
    """`LightFRModel.stage1_candidates` for a checked user: its stage-1 ids with ``liked`` left out."""
    C = model.config.candidates if candidates is None else candidates
    if isinstance(C, bool) or int(C) != C or C < 1:
        raise ValueError(f"candidates must be an integer >= 1, got {C!r}")
    saved = model.config
    model.config = replace(saved, candidates=int(C))
    try:
        _, cand = stage1(model, np.array([userid], dtype=np.int64), [liked], None, rng)
    finally:
        model.config = saved
    return cand[0][cand[0] >= 0]


def top_n_planes(
    model: LightFRModel,
    users: NDArray[np.int64],
    planes: NDArray[np.int64],
    N: int,
    exclude: list[NDArray[np.int64] | None],
    items: NDArray[np.int64] | None,
    rng: np.random.Generator,
) -> tuple[NDArray[np.int64], NDArray[np.float32]]:
    """Without stage 1 (``candidates`` 0), the exact top-N of a batch where some users hold bit-plane
    vectors: their integer plane scores (`device_sdk.topk.plane_scores`) selected by counting
    (`HammingIndex.search_planes_batch`, one scan for all such users of one plane count) with random ties,
    reported as the real score Δ'·qᵀd/f + β; the others by the model's own `_top_n`."""
    f, B, s = model.config.bits, model.hamming_weight, lightfr.LEVEL_SHIFT
    out_ids = np.full((users.size, N), -1, dtype=np.int64)
    out_scores = np.full((users.size, N), -np.inf, dtype=np.float32)
    rest = np.setdiff1d(np.arange(users.size), planes)
    if rest.size:
        ids, sc = model._top_n(users[rest], N, [exclude[i] for i in rest], items, rng)
        out_ids[rest], out_scores[rest] = ids, sc
    # The planes each user's vector was quantized to (a later plan may have changed the setting);
    # users sharing a P are ranked in one batched scan over the packed item codes.
    top = np.abs(model.user_q[users[planes]].astype(np.int64)).max(axis=1)
    P_of = np.maximum(1, (top[:, None] >= 1 << np.arange(9)).sum(axis=1))  # the bit length of the top
    for P in np.unique(P_of).tolist():
        grp = planes[P_of == P]
        signs = np.swapaxes(lightfr.sign_planes(model.user_q[users[grp]], P), 0, 1).reshape(-1, f)
        words = np.ascontiguousarray(pack_signs(signs).T).reshape(grp.size, P, -1)
        ids, S = model._hamming_index().search_planes_batch(
            words,
            model.user_weight[users[grp]],
            N,
            rng,
            level_shift=s,
            exclude=[exclude[i] for i in grp],
            candidates=items,
        )
        S = np.where(ids >= 0, S, LEVEL_CENTER << s)  # padded slots: -inf below
        if model.item_levels is None:
            S = S + (LEVEL_CENTER << s)  # no levels: every item at the centre (β = 0)
        real = np.where(ids >= 0, (S - (LEVEL_CENTER << s)) * 2.0 / (2**s * B * f), -np.inf)
        out_ids[grp], out_scores[grp] = ids, real.astype(np.float32)
    return out_ids, out_scores
