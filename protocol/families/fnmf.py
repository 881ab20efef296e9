"""Coherent federated NMF (Dalleiger & Gionis; `docs/design.md` §3.3): the alignments of a
local component matrix V to the broadcast V̄ and the layout of an upload.  The device aligns and
uploads (`device_sdk.fnmf`); the server splits the cohort's sum by the same layout and its trusted
barycenter aligns with the same LAP (`agg_server.strategy.fnmf`).

An alignment is a (k, k) matrix P with rows in the global order and columns in the client's order, so
``P @ V`` is compared row by row with V̄:
- "none": P = I (FedAvg / FedProx);
- "lap" (D1): a permutation matrix minimising ‖V̄ − PV‖²_F (linear assignment);
- "lap_rho" (D2): a partial permutation; a pair may match only if its Pearson correlation is
  significantly positive (Fisher z, one-sided, level α); global rows with no match are zero rows of
  P and local rows with no match are *personal* (never pulled towards V̄);
- "sinkhorn" (D3): a row-stochastic entropic transport plan (each global row is a convex
  combination of local rows).

The upload is Δ = PV − diag(P𝟙)V̄ flattened in C order (k·m), followed for "lap_rho" by the k match
counts P𝟙 (`upload_length`, `upload_vector`, `split_upload`).

Python loops run over the rank k (assignment, Sinkhorn iterations), never over items.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
from numpy.typing import NDArray

from protocol.spec import Alignment

__all__ = [
    "align",
    "lap_align",
    "lap_rho_align",
    "linear_assignment",
    "rho_distances",
    "sinkhorn_align",
    "split_upload",
    "upload_length",
    "upload_vector",
]

# Big-M for forbidden pairs in the partial assignment: any finite cost is at most 2 (1 − r, r ≥ −1).
_FORBIDDEN = 1e6

Array = NDArray[np.float64]


def linear_assignment(cost: NDArray[np.floating]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Minimum-cost assignment of the rows of ``cost`` to distinct columns (or columns to rows when
    there are more rows than columns): the Hungarian method with potentials and shortest augmenting
    paths (Kuhn–Munkres; Jonker–Volgenant's row-by-row form), O(n²·m).

    Each of the n augmentations is a Dijkstra-like search over the columns, vectorized over them; the
    Python loop runs over rows and search steps (≤ n·(n+1)/2 of them), never over entries.

    Parameters
    ----------
    cost : (n, m) finite float matrix.

    Returns
    -------
    (rows, cols): ``min(n, m)`` pairs, ``rows`` increasing, minimising ``cost[rows, cols].sum()``.

    Raises
    ------
    ValueError
        If ``cost`` is not 2-D or holds NaN or infinity.
    """
    C = np.asarray(cost, dtype=np.float64)
    if C.ndim != 2:
        raise ValueError(f"cost must be a 2-D matrix, got shape {C.shape}")
    if not np.all(np.isfinite(C)):
        raise ValueError("cost contains NaN or infinity")
    transposed = C.shape[0] > C.shape[1]
    if transposed:
        C = C.T
    n, m = C.shape
    # 1-based rows and columns; column 0 is the search's virtual start. p[j]: row on column j (0: free).
    u = np.zeros(n + 1)
    v = np.zeros(m + 1)
    p = np.zeros(m + 1, dtype=np.int64)
    way = np.zeros(m + 1, dtype=np.int64)
    for i in range(1, n + 1):  # loop over rows: one augmenting path each
        p[0] = i
        j0 = 0
        minv = np.full(m + 1, np.inf)
        used = np.zeros(m + 1, dtype=bool)
        while True:  # loop over search steps: each settles one column
            used[j0] = True
            i0 = p[j0]
            free = ~used
            reduced = C[i0 - 1] - u[i0] - v[1:]
            better = free[1:] & (reduced < minv[1:])
            minv[1:][better] = reduced[better]
            way[1:][better] = j0
            cand = np.where(free, minv, np.inf)
            cand[0] = np.inf
            j1 = int(np.argmin(cand))
            delta = cand[j1]
            settled = np.flatnonzero(used)
            u[p[settled]] += delta
            v[settled] -= delta
            minv[free] -= delta
            j0 = j1
            if p[j0] == 0:
                break
        while j0:  # flip the path
            j1 = int(way[j0])
            p[j0] = p[j1]
            j0 = j1
    cols = np.flatnonzero(p[1:])
    rows = p[1:][cols] - 1
    if transposed:
        rows, cols = cols, rows
    order = np.argsort(rows, kind="stable")
    return rows[order].astype(np.int64), cols[order].astype(np.int64)


def _row_sq_dist(V_bar: Array, V: Array) -> Array:
    """C[a, b] = ‖V̄_a − V_b‖² for global row a and local row b."""
    d = (V_bar * V_bar).sum(axis=1)[:, None] + (V * V).sum(axis=1)[None, :] - 2.0 * (V_bar @ V.T)
    return np.maximum(d, 0.0)


def _check_pair(V: Array, V_bar: Array) -> None:
    if V.ndim != 2 or V.shape != V_bar.shape:
        raise ValueError(f"local and global component matrices differ in shape: {V.shape} vs {V_bar.shape}")


def lap_align(V: Array, V_bar: Array) -> Array:
    """D1: the permutation P minimising ‖V̄ − PV‖²_F (linear assignment on squared row distances).

    Returns
    -------
    (k, k) float64 permutation matrix; ``(P @ V)[a]`` is the local row matched to global row a.
    """
    _check_pair(V, V_bar)
    rows, cols = linear_assignment(_row_sq_dist(V_bar, V))
    P = np.zeros((V.shape[0], V.shape[0]))
    P[rows, cols] = 1.0
    return P


def _pearson(A: Array, B: Array) -> Array:
    """r[a, b] = Pearson correlation of rows A_a and B_b over the m columns (0 for a constant row)."""
    Ac = A - A.mean(axis=1, keepdims=True)
    Bc = B - B.mean(axis=1, keepdims=True)
    na = np.sqrt((Ac * Ac).sum(axis=1))
    nb = np.sqrt((Bc * Bc).sum(axis=1))
    denom = na[:, None] * nb[None, :]
    safe = np.where(denom > 0.0, denom, 1.0)
    return np.where(denom > 0.0, np.clip((Ac @ Bc.T) / safe, -1.0, 1.0), 0.0)


def rho_distances(V: Array, V_bar: Array, alpha: float = 0.05) -> tuple[Array, NDArray[np.bool_]]:
    """D2 costs: d[a, b] = 1 − corr(V̄_a, V_b) and whether the pair may match at all.

    A pair is allowed when the correlation is significantly positive: Fisher's z = atanh(r)·√(m − 3)
    exceeds the one-sided N(0, 1) quantile at level α (the paper's z-test; its α is not in the
    available text, 0.05 is our default).  With m ≤ 3 nothing is significant.
    """
    _check_pair(V, V_bar)
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    m = V.shape[1]
    r = _pearson(V_bar, V)
    if m <= 3:
        return 1.0 - r, np.zeros(r.shape, dtype=bool)
    z = np.arctanh(np.clip(r, -1.0 + 1e-15, 1.0 - 1e-15)) * math.sqrt(m - 3)
    return 1.0 - r, z > NormalDist().inv_cdf(1.0 - alpha)


def lap_rho_align(V: Array, V_bar: Array, alpha: float = 0.05) -> Array:
    """D2: partial assignment on correlation distances; insignificant pairs may not match.

    Solved as one linear assignment over k global rows and 2k columns (the k local rows, then k
    "unaligned" dummies), with a big-M on forbidden pairs, so a global row is matched to a local row
    only through a significant correlation.  The paper prices the dummy at the largest finite cost;
    we add 1e-9 so that a tie between "match" and "leave unaligned" resolves to the match.

    Returns
    -------
    (k, k) 0/1 matrix with at most one 1 per row and per column; zero rows are unmatched global
    components, zero columns are personal local components.
    """
    d, ok = rho_distances(V, V_bar, alpha)
    k = V.shape[0]
    dummy = float(d[ok].max()) + 1e-9 if ok.any() else 1.0
    cost = np.concatenate([np.where(ok, d, _FORBIDDEN), np.full((k, k), dummy)], axis=1)
    rows, cols = linear_assignment(cost)
    hit = (cols < k) & ok[rows, np.minimum(cols, k - 1)]
    P = np.zeros((k, k))
    P[rows[hit], cols[hit]] = 1.0
    return P


def sinkhorn_align(V: Array, V_bar: Array, eps: float = 0.05, *, iterations: int = 100, tol: float = 1e-4) -> Array:
    """D3: a row-stochastic soft alignment from entropic optimal transport (Sinkhorn–Knopp).

    The cost C[a, b] = ‖V̄_a − V_b‖² is divided by its largest entry, so ``eps`` is relative to the
    cost scale (at ε = 0.05 a pair costing 5 % of the worst pair more is e times less likely).
    Marginals are uniform.  The plan π = diag(u) K diag(v), K = exp(−C/ε), is scaled by k and its
    rows renormalised, so P𝟙 = 𝟙 exactly and P is close to doubly stochastic.  The loop stops after
    ``iterations`` or when the row sums of k·π are within ``tol`` of 1 (the columns are exact after
    each v update).  ε ≥ 0.002 keeps every entry of K above exp(−500), so no log domain is needed.

    Returns
    -------
    (k, k) non-negative matrix with unit row sums.
    """
    _check_pair(V, V_bar)
    if not (eps >= 0.002 and math.isfinite(eps)):
        raise ValueError(f"eps must be a finite value >= 0.002, got {eps}")
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    C = _row_sq_dist(V_bar, V)
    top = float(C.max())
    K = np.exp(-(C / top if top > 0.0 else C) / eps)
    k = C.shape[0]
    u = np.ones(k)
    v = np.ones(k)
    for _ in range(iterations):  # loop over Sinkhorn iterations on a k × k plan
        u = 1.0 / (K @ v)
        v = 1.0 / (K.T @ u)
        if float(np.abs(u * (K @ v) - 1.0).max()) <= tol:
            break
    P = u[:, None] * K * v[None, :]
    return P / P.sum(axis=1, keepdims=True)


def align(V: Array, V_bar: Array, method: str, *, eps: float = 0.05, alpha: float = 0.05) -> Array:
    """The alignment P (global rows × local rows) of ``method`` (an `Alignment` value)."""
    if method == Alignment.NONE:
        _check_pair(V, V_bar)
        return np.eye(V.shape[0])
    if method == Alignment.LAP:
        return lap_align(V, V_bar)
    if method == Alignment.LAP_RHO:
        return lap_rho_align(V, V_bar, alpha)
    if method == Alignment.SINKHORN:
        return sinkhorn_align(V, V_bar, eps)
    raise ValueError(f"alignment must be one of {[a.value for a in Alignment]}, got {method!r}")


def upload_length(k: int, m: int, alignment: str) -> int:
    """Length of an FNMF upload: k·m, plus k match counts for "lap_rho"."""
    return k * m + (k if alignment == Alignment.LAP_RHO else 0)


def upload_vector(V: Array, V_bar: Array, P: Array, alignment: str) -> Array:
    """Δ = PV − diag(P𝟙)V̄, flattened in C order; "lap_rho" appends the match counts P𝟙.

    Summed over the cohort and divided by the (per-component) count this is one step of the
    barycenter fixed point warm-started at V̄ (notes C, "anchored" variant).
    """
    matched = P.sum(axis=1)
    delta = P @ V - matched[:, None] * V_bar
    if alignment == Alignment.LAP_RHO:
        return np.concatenate([delta.ravel(), matched])
    return delta.ravel()


def split_upload(total: Array, k: int, m: int, alignment: str) -> tuple[Array, Array | None]:
    """The inverse layout of `upload_vector` (for one upload or the cohort's sum of them).

    Returns
    -------
    (Δ as a (k, m) view, the k match counts for "lap_rho" else None).

    Raises
    ------
    ValueError
        If ``total`` does not have `upload_length` entries.
    """
    t = np.asarray(total, dtype=np.float64)
    if t.shape != (upload_length(k, m, alignment),):
        raise ValueError(f"an FNMF upload has {upload_length(k, m, alignment)} entries, got shape {t.shape}")
    delta = t[: k * m].reshape(k, m)
    return delta, (t[k * m :] if alignment == Alignment.LAP_RHO else None)
