"""Centralised implicit-feedback ALS (Hu, Koren, Volinsky, ICDM 2008): the real-valued reference
that binary codes are compared against.  Not federated and not private — a baseline only.

Confidence c_ui = 1 + α·[u rated i], preference p_ui = [u rated i]; each half-step solves, for every
user (item), (YᵀY + Yᵀ(C_u − I)Y + λI) x_u = YᵀC_u p_u.  The per-row Gram corrections are built in
chunks of rows of similar length with one batched matmul per chunk, so memory stays bounded and no
Python loop runs over ratings.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from numpy.typing import NDArray

from fedsim.data.ratings import Ratings

__all__ = ["implicit_als"]


def _half_step(
    R: sp.csr_matrix, Y: NDArray[np.float64], alpha: float, reg: float, budget: int = 1 << 22
) -> NDArray[np.float64]:
    """Solve every row's normal equations.  Rows are taken in order of their rating count and padded
    to the longest row of their chunk, so each chunk's Gram corrections Yᵤᵀ Yᵤ are one batched
    matmul (B, f, L) @ (B, L, f) over ``budget`` floats at most; no Python loop runs over ratings."""
    n, f = R.shape[0], Y.shape[1]
    base = Y.T @ Y + reg * np.eye(f)
    X = np.zeros((n, f))
    deg = np.diff(R.indptr)
    order = np.argsort(deg, kind="stable")
    deg_sorted = deg[order]
    start = 0
    while start < n:  # loop over chunks of rows of similar length
        # largest chunk whose padded block (rows x longest row x f) fits the budget
        ahead = deg_sorted[start : start + 2048]  # A and b of 2048 rows: 64 MiB at f = 64
        padded = np.maximum(ahead, 1) * np.arange(1, ahead.shape[0] + 1) * f
        size = max(1, int(np.searchsorted(padded, budget, side="right")))
        rows = order[start : start + size]
        L = int(deg_sorted[start + rows.shape[0] - 1])
        A = np.broadcast_to(base, (rows.shape[0], f, f)).copy()
        b = np.zeros((rows.shape[0], f))
        if L:
            pos = R.indptr[rows][:, None] + np.arange(L)[None, :]
            live = np.arange(L)[None, :] < deg[rows][:, None]
            P = Y[R.indices[np.where(live, pos, 0)]] * live[..., None]  # (B, L, f), zero padding
            A += alpha * np.matmul(P.transpose(0, 2, 1), P)
            b = (1.0 + alpha) * P.sum(axis=1)
        X[rows] = np.linalg.solve(A, b[..., None])[..., 0]
        start += rows.shape[0]
    return X


def implicit_als(
    train: Ratings,
    *,
    factors: int = 32,
    reg: float = 0.1,
    alpha: float = 20.0,
    iterations: int = 15,
    seed: int = 0,
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Fit implicit ALS on the set of (user, item) pairs of ``train``; returns (user, item) factors.

    Scores are ``X[u] @ Y[i]``.  Every rated item counts once, whatever its rating.
    """
    if factors < 1 or iterations < 1 or reg < 0 or alpha < 0:
        raise ValueError("factors and iterations must be >= 1; reg and alpha >= 0")
    keys = np.unique(train.users * train.n_items + train.items)
    users, items = keys // train.n_items, keys % train.n_items
    R = sp.csr_matrix((np.ones(keys.size), (users, items)), shape=(train.n_users, train.n_items))
    Rt = R.T.tocsr()
    rng = np.random.default_rng(seed)
    Y = rng.normal(0, 0.01, (train.n_items, factors))
    X = np.zeros((train.n_users, factors))
    for _ in range(iterations):
        X = _half_step(R, Y, alpha, reg)
        Y = _half_step(Rt, X, alpha, reg)
    return X, Y
