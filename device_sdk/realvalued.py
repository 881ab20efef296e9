"""Real-valued item embeddings beside the binary codes: the implicit-ALS user step (fold-in), stage 2 of the
two-stage ranking (re-scoring stage 1's Hamming candidates by E·u) and stage 1's recall against the
real-valued ranking.  Used by `LightFRModel` (one user or a few) and by the simulator (every user).

Invariants:
- Item embeddings E are (m, d) and finite; a device keeps them as float16 (2·d bytes an item beside the
  f/8 of the codes).  The user step is solved in float64 and returned as float32; stage 2's products
  E_i·u are float32 (`dot_rows`, one kernel for one row and for many, so a batch row's scores are a
  one-user call's, bit for bit).
- The user step is implicit ALS's (Hu, Koren & Volinsky 2008, eq. 4, binary preferences, confidence
  1 + α on the user's items and 1 elsewhere):
      u = (G + α·E_Iᵀ E_I + reg·I)⁻¹ (1 + α)·E_Iᵀ 1,      G = EᵀE over the whole catalogue,
  E_I the rows of the user's items (each item once).  G is computed once per model (`embedding_gram`), so
  a user costs O(|I|·d² + d³) whatever m is.  The solve is the federated iALS family's own kernel
  (`device_sdk.ials.solve_users`: users in chunks of similar item counts, one batched ``np.linalg.solve``
  per chunk over at most ``budget`` padded floats), so a device ranking with embeddings and a device
  training iALS solve the same step the same way.
- Stage 2 scores only the candidates: s_ui = E_i·u for the C items stage 1 kept, the top N by score with
  ties in uniformly random order (`top_rows`).  The result is exact among the candidates; it equals the
  full real-valued ranking whenever the real-valued top N lie among them, which `stage1_recall` measures.
- Every outside input is validated first: a wrong shape, a non-float or non-finite array, an id out of
  range is a `ValueError` with one line saying which.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from device_sdk.ials import solve_users
from device_sdk.topk import HammingIndex

__all__ = [
    "all_finite",
    "check_embeddings",
    "check_gram",
    "check_ials_params",
    "dot_rows",
    "embedding_gram",
    "ials_user_vectors",
    "rerank",
    "rerank_checked",
    "stage1_recall",
    "top_row",
    "top_rows",
    "two_stage_topk",
]

# Padded floats per batched solve of `ials_user_vectors` (`device_sdk.ials.solve_users`'s chunks), and
# candidate floats per chunk of `rerank`.
_SOLVE_BUDGET = 1 << 22
_RERANK_BUDGET = 1 << 22


def check_embeddings(embeddings: ArrayLike, n_items: int | None = None) -> NDArray[np.floating]:
    """``embeddings`` as an (m, d) float array after checking it: 2-D, a float dtype, finite, m =
    ``n_items`` when given.  Raises ValueError naming what is wrong."""
    E = np.asarray(embeddings)
    if E.ndim != 2 or E.shape[1] < 1:
        raise ValueError(f"item embeddings must be a 2-D (items, d) array with d >= 1, got shape {E.shape}")
    if not np.issubdtype(E.dtype, np.floating):
        raise ValueError(f"item embeddings must be float16, float32 or float64, got {E.dtype}")
    if n_items is not None and E.shape[0] != n_items:
        raise ValueError(f"item embeddings have {E.shape[0]} rows for {n_items} items")
    if not all_finite(E):
        raise ValueError("item embeddings must be finite (no NaN or inf)")
    return E


def all_finite(x: NDArray[np.floating]) -> bool:
    """Whether every value of ``x`` is finite, checked 2^16 rows at a time (no mask the size of ``x``).
    float16 by its bits (exponent all ones: inf or NaN), a seventh of np.isfinite's time on 10^6 × 64."""
    step = 1 << 16
    if x.dtype == np.float16:
        bits = x.view(np.uint16)
        return all(
            int(np.bitwise_and(bits[s : s + step], 0x7FFF).max(initial=0)) < 0x7C00
            for s in range(0, max(x.shape[0], 1), step)
        )
    return all(bool(np.isfinite(x[s : s + step]).all()) for s in range(0, max(x.shape[0], 1), step))


def embedding_gram(embeddings: ArrayLike) -> NDArray[np.float32]:
    """G = EᵀE (d, d) float32, summed in float64 over chunks of the catalogue."""
    E = check_embeddings(embeddings)
    d = E.shape[1]
    G = np.zeros((d, d))
    step = 1 << 15
    for s in range(0, E.shape[0], step):  # a few MiB of float64 at a time
        c = E[s : s + step].astype(np.float64)
        G += c.T @ c
    return G.astype(np.float32)


def check_gram(gram: ArrayLike, d: int) -> NDArray[np.float64]:
    """``gram`` as a (d, d) float64 array after checking its shape and that it is finite and float."""
    G = np.asarray(gram)
    if G.shape != (d, d):
        raise ValueError(f"the Gram matrix must be ({d}, {d}) for embeddings of d = {d}, got {G.shape}")
    if not np.issubdtype(G.dtype, np.floating) or not np.all(np.isfinite(G)):
        raise ValueError("the Gram matrix must be a finite float array")
    return G.astype(np.float64)


def check_ials_params(alpha: float, reg: float) -> tuple[float, float]:
    """(α, reg) as floats after checking them: α a finite number >= 0, reg a finite number > 0."""
    for name, value in (("alpha", alpha), ("reg", reg)):
        if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
            raise ValueError(f"{name} must be a number, got {value!r}")
    if not (np.isfinite(alpha) and alpha >= 0):
        raise ValueError(f"alpha must be a finite number >= 0, got {alpha!r}")
    if not (np.isfinite(reg) and reg > 0):
        raise ValueError(f"reg must be a finite number > 0, got {reg!r}")
    return float(alpha), float(reg)


def _csr_lists(item_lists: Any, m: int) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """(indptr, items) of one list of item ids per user (a sequence of 1-D integer arrays, or an (n, m)
    sparse matrix), each user's items unique and sorted; ids checked against [0, m)."""
    if hasattr(item_lists, "tocsr") and hasattr(item_lists, "shape"):
        mat = item_lists.tocsr()
        if mat.shape[1] != m:
            raise ValueError(f"the item lists have {mat.shape[1]} columns for {m} items")
        indptr = np.asarray(mat.indptr, dtype=np.int64)
        items = np.asarray(mat.indices, dtype=np.int64)
    else:
        rows = [np.asarray(r) for r in item_lists]
        for r in rows:
            if r.ndim != 1 or (r.size and not np.issubdtype(r.dtype, np.integer)):
                raise ValueError(f"each user's items must be a 1-D array of integer ids, got {r.dtype} {r.shape}")
        counts = np.fromiter((r.size for r in rows), dtype=np.int64, count=len(rows))
        indptr = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        items = np.concatenate(rows).astype(np.int64) if rows else np.zeros(0, np.int64)
    if items.size and (items.min() < 0 or items.max() >= m):
        raise ValueError(f"item id out of range [0, {m})")
    n = indptr.size - 1
    row = np.repeat(np.arange(n, dtype=np.int64), np.diff(indptr))
    keys = np.unique(row * m + items)  # each (user, item) once, sorted by user then item
    counts = np.bincount(keys // max(m, 1), minlength=n) if n else np.zeros(0, np.int64)
    return np.concatenate(([0], np.cumsum(counts))).astype(np.int64), keys % max(m, 1)


def ials_user_vectors(
    embeddings: ArrayLike,
    gram: ArrayLike,
    item_lists: Sequence[ArrayLike] | Any,
    alpha: float,
    reg: float,
    *,
    budget: int = _SOLVE_BUDGET,
) -> NDArray[np.float32]:
    """Every user's real-valued vector by the implicit-ALS user step (see the module docstring).

    Parameters
    ----------
    embeddings : (m, d) float item embeddings E (float16 as a device holds them, or wider).
    gram : (d, d) G = EᵀE of the whole catalogue (`embedding_gram`).
    item_lists : one array of item ids per user, or an (n, m) sparse matrix (its nonzeros are the items);
        repeated ids count once.
    alpha : confidence α >= 0 of a user's items.
    reg : ridge weight > 0.
    budget : padded floats per batched solve (`device_sdk.ials.solve_users`).

    Returns
    -------
    (n, d) float32; a user without items gets 0.

    Raises
    ------
    ValueError
        For a wrong shape or dtype, a non-finite value, an item id out of range, α < 0 or reg <= 0.
    """
    E = check_embeddings(embeddings)
    m, d = E.shape
    G = check_gram(gram, d)
    a, r = check_ials_params(alpha, reg)
    indptr, items = _csr_lists(item_lists, m)
    return solve_users(E, indptr, items, a, r, budget, gram=G).astype(np.float32)


def top_rows(
    ids: NDArray[np.int64], scores: NDArray[np.floating], N: int, rng: np.random.Generator | None
) -> tuple[NDArray[np.int64], NDArray[np.float32]]:
    """The N best of every row of (n, K) candidates (``ids`` -1 where there is none), best first, equal
    scores in uniformly random order (the lower id first without a generator); (n, N) int64 ids padded
    with -1 and float32 scores padded with -inf.

    Row by row: the candidates at or above the row's N-th best score (ties included) get one uniform key
    each from ``rng``, in row order, so a batch draws what one call per row would draw in turn."""
    n, K = ids.shape
    out_ids = np.full((n, N), -1, np.int64)
    out_scores = np.full((n, N), -np.inf, np.float32)
    if n == 0 or K == 0 or N == 0:
        return out_ids, out_scores
    real = ids >= 0
    for u in range(n):  # each row a handful of calls over its K candidates
        i, v = top_row(ids[u][real[u]], scores[u][real[u]], N, rng)
        out_ids[u, : i.size] = i
        out_scores[u, : i.size] = v
    return out_ids, out_scores


def top_row(
    ids: NDArray[np.int64], scores: NDArray[np.floating], N: int, rng: np.random.Generator | None
) -> tuple[NDArray[np.int64], NDArray[np.floating]]:
    """`top_rows` of one row of real candidates (no -1): at most N ids best first and their scores."""
    if N <= 0:
        return ids[:0], scores[:0]
    if ids.size > N:
        top = scores >= np.partition(scores, ids.size - N)[ids.size - N]  # the N-th best and all above it
        ids, scores = ids[top], scores[top]
    key = ids if rng is None else rng.random(ids.size)
    order = np.lexsort((key, -scores))[:N]
    return ids[order], scores[order]


def _drop_excluded(cand: NDArray[np.int64], exclude: Sequence[NDArray[np.int64] | None] | None) -> None:
    """Set to -1, in place, every candidate of row u that is in ``exclude[u]``."""
    if exclude is None:
        return
    for u, e in enumerate(exclude):
        if e is not None and len(e):
            row = cand[u]
            row[np.isin(row, e)] = -1


def rerank(
    candidate_ids: ArrayLike,
    embeddings: ArrayLike,
    user_vectors: ArrayLike,
    N: int,
    *,
    exclude: Sequence[ArrayLike | None] | None = None,
    rng: np.random.Generator | None = None,
    budget: int = _RERANK_BUDGET,
) -> tuple[NDArray[np.int64], NDArray[np.float32]]:
    """Stage 2: the top N of each user's candidates by E_i·u, ties in uniformly random order.

    Parameters
    ----------
    candidate_ids : (n, K) item ids, -1 where a row has fewer.
    embeddings : (m, d) float item embeddings.
    user_vectors : (n, d) float user vectors (`ials_user_vectors`).
    N : items per user (>= 0).
    exclude : per user, item ids never returned (None: none).
    rng : tie-breaking generator (None: the lower id wins).
    budget : candidate floats (n_chunk·K·d) scored at once.

    Returns
    -------
    (ids, scores): (n, N) int64 best first padded with -1, float32 padded with -inf.
    """
    E = check_embeddings(embeddings)
    m, d = E.shape
    cand = np.array(candidate_ids, dtype=np.int64, copy=True)
    U = np.asarray(user_vectors)
    if cand.ndim != 2:
        raise ValueError(f"candidate ids must be (n, K), got shape {cand.shape}")
    n, K = cand.shape
    if U.shape != (n, d) or not np.issubdtype(U.dtype, np.floating) or not np.all(np.isfinite(U)):
        raise ValueError(f"user vectors must be a finite ({n}, {d}) float array, got {U.dtype} {U.shape}")
    if cand.size and (cand.max() >= m or cand.min() < -1):
        raise ValueError(f"candidate id out of range [0, {m}) (-1 marks no candidate)")
    if isinstance(N, bool) or int(N) != N or N < 0:
        raise ValueError(f"N must be an integer >= 0, got {N!r}")
    if exclude is not None and len(exclude) != n:
        raise ValueError(f"exclude has {len(exclude)} rows for {n} users")
    _drop_excluded(cand, None if exclude is None else [None if e is None else np.asarray(e) for e in exclude])
    return rerank_checked(cand, E, U, int(N), rng, budget)


def dot_rows(E: NDArray[np.floating], cand: NDArray[np.int64], U: NDArray[np.floating]) -> NDArray[np.float32]:
    """s[r, k] = E[cand[r, k]]·U[r] in float32 ((r, K) candidates, -1 slots: any value): one gather and one
    batched product, the same kernel for one row as for many."""
    rows = E[np.maximum(cand, 0)].astype(np.float32)  # (r, K, d)
    return np.matmul(rows, U.astype(np.float32, copy=False)[..., None])[..., 0]


def rerank_checked(
    cand: NDArray[np.int64],
    E: NDArray[np.floating],
    U: NDArray[np.floating],
    N: int,
    rng: np.random.Generator | None,
    budget: int = _RERANK_BUDGET,
) -> tuple[NDArray[np.int64], NDArray[np.float32]]:
    """`rerank` of arguments the caller has checked (a model's own arrays), the excluded already set to -1:
    no pass over E to check it again."""
    n, K = cand.shape
    d = E.shape[1]
    out_ids = np.full((n, int(N)), -1, np.int64)
    out_scores = np.full((n, int(N)), -np.inf, np.float32)
    step = max(1, int(budget) // max(K * d, 1))
    for s in range(0, n, step):  # chunks of users, each one gather and one batched product per block
        c = cand[s : s + step]
        u = U[s : s + step]
        sc = np.empty(c.shape, np.float32)
        width = max(1, int(budget) // max(c.shape[0] * d, 1))
        for b in range(0, K, width):  # blocks of candidates: at most ``budget`` gathered floats
            sc[:, b : b + width] = dot_rows(E, c[:, b : b + width], u)
        out_ids[s : s + step], out_scores[s : s + step] = top_rows(c, sc, int(N), rng)
    return out_ids, out_scores


def two_stage_topk(
    item_words: NDArray[np.uint64],
    bits: int,
    user_words: NDArray[np.uint64],
    embeddings: ArrayLike,
    user_vectors: ArrayLike,
    N: int,
    *,
    candidates: int = 200,
    levels: ArrayLike | None = None,
    lift: ArrayLike | float = 0.0,
    exclude: Sequence[ArrayLike | None] | None = None,
    rng: np.random.Generator | None = None,
    users_per_chunk: int = 1024,
) -> tuple[NDArray[np.int64], NDArray[np.float32]]:
    """The two-stage top N of many users, what `LightFRModel.recommend` does per user: stage 1 keeps each
    user's ``candidates`` + |excluded| items of lowest v = Hamming(b_u, d_i) + ⌊(L − level_i)·λ_u⌋ (ties at
    random; `device_sdk.topk.HammingIndex.candidates`), the excluded ones are dropped, and stage 2 ranks
    the rest by E_i·u (`rerank`).  Users are taken ``users_per_chunk`` at a time, so memory stays
    O(chunk · (candidates + |excluded|) · d) beside the model.

    Parameters
    ----------
    item_words : (w, m) uint64 packed item codes (`device_sdk.codes.pack_signs`).
    bits : code length f.
    user_words : (n, w) uint64 packed stage-1 queries (a ±1 code, or a vector's sign plane).
    embeddings : (m, d) float item embeddings.
    user_vectors : (n, d) float user vectors (`ials_user_vectors`).
    N : items per user (>= 0).
    candidates : C >= 1, stage 1's candidates per user.
    levels : (m,) uint8 item levels, or None.
    lift : λ >= 0 (one for all, or (n,)), the weight of one level in bits of distance.
    exclude : per user, item ids never returned (a user's training items, say).
    rng : tie-breaking generator for both stages (None: lower positions and ids win).
    users_per_chunk : users ranked together in stage 2.

    Returns
    -------
    (ids, scores): (n, N) int64 best first padded with -1, float32 E·u padded with -inf.
    """
    if isinstance(candidates, bool) or int(candidates) != candidates or candidates < 1:
        raise ValueError(f"candidates must be an integer >= 1, got {candidates!r}")
    index = HammingIndex(np.asarray(item_words), int(bits), levels, 1, substring_index=False)
    users = np.asarray(user_words)
    if users.dtype != np.uint64 or users.ndim != 2 or users.shape[1] != index.w:
        raise ValueError(f"user codes must be (n, {index.w}) uint64 words, got {users.dtype} {users.shape}")
    n = users.shape[0]
    lam = np.broadcast_to(np.asarray(lift, dtype=np.float64), (n,))
    if exclude is not None and len(exclude) != n:
        raise ValueError(f"exclude has {len(exclude)} rows for {n} users")
    E = check_embeddings(embeddings, index.m)
    U = np.asarray(user_vectors)
    if U.shape != (n, E.shape[1]) or not np.issubdtype(U.dtype, np.floating) or not all_finite(U):
        raise ValueError(f"user vectors must be a finite ({n}, {E.shape[1]}) float array, got {U.dtype} {U.shape}")
    if isinstance(N, bool) or int(N) != N or N < 0:
        raise ValueError(f"N must be an integer >= 0, got {N!r}")
    excl = [None if e is None else np.asarray(e, dtype=np.int64) for e in exclude] if exclude is not None else None
    extra = np.zeros(n, np.int64) if excl is None else np.array([0 if e is None else e.size for e in excl], np.int64)
    out_ids = np.full((n, int(N)), -1, np.int64)
    out_scores = np.full((n, int(N)), -np.inf, np.float32)
    step = max(1, int(users_per_chunk))
    for s in range(0, n, step):
        sl = slice(s, s + step)
        cand = index.candidates(users[sl], int(candidates) + extra[sl], lam[sl], rng)
        _drop_excluded(cand, None if excl is None else excl[sl])
        out_ids[sl], out_scores[sl] = rerank_checked(cand, E, U[sl], int(N), rng)
    return out_ids, out_scores


def stage1_recall(
    candidate_ids: ArrayLike,
    embeddings: ArrayLike,
    user_vectors: ArrayLike,
    N: int,
    *,
    exclude: Sequence[ArrayLike | None] | None = None,
) -> NDArray[np.float64]:
    """Per user, the share of the real-valued top N over the whole catalogue (by E·u, the excluded items
    left out) found among its stage-1 candidates ``candidate_ids`` ((n, K), -1 padded): 1.0 means stage 2
    returns what a full real-valued ranking would (up to the order of exact ties).  (n,) float64; the
    scores are formed in float32 over blocks of the catalogue, so memory stays O(n·m) floats."""
    E = check_embeddings(embeddings)
    m, d = E.shape
    cand = np.asarray(candidate_ids, dtype=np.int64)
    if cand.ndim != 2:
        raise ValueError(f"candidate ids must be (n, K), got shape {cand.shape}")
    n = cand.shape[0]
    U = np.asarray(user_vectors)
    if U.shape != (n, d) or not np.issubdtype(U.dtype, np.floating) or not np.all(np.isfinite(U)):
        raise ValueError(f"user vectors must be a finite ({n}, {d}) float array, got {U.dtype} {U.shape}")
    if exclude is not None and len(exclude) != n:
        raise ValueError(f"exclude has {len(exclude)} rows for {n} users")
    if isinstance(N, bool) or int(N) != N or N < 1:
        raise ValueError(f"N must be an integer >= 1, got {N!r}")
    out = np.ones(n)
    Uf = U.astype(np.float32)
    for s in range(0, n, 64):  # 64 users at a time: a (64, m) float32 score block
        who = range(s, min(s + 64, n))
        S = np.empty((len(who), m), np.float32)
        for b in range(0, m, 1 << 16):
            S[:, b : b + (1 << 16)] = (E[b : b + (1 << 16)].astype(np.float32) @ Uf[s : s + 64].T).T
        for r, u in enumerate(who):
            row = S[r]
            if exclude is not None and exclude[u] is not None:
                row[np.asarray(exclude[u], dtype=np.int64)] = -np.inf
            k = min(int(N), int(np.isfinite(row).sum()))
            if k == 0:
                continue
            want = np.argpartition(-row, k - 1)[:k]
            out[u] = float(np.isin(want, cand[u]).mean())
    return out
