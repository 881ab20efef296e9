"""Centralised implicit-feedback ALS (Hu, Koren, Volinsky, ICDM 2008): the real-valued reference
that binary codes are compared against.  Not federated and not private — a baseline only.

Confidence c_ui = 1 + α·[u rated i], preference p_ui = [u rated i]; each half-step solves, for every
user (item), (YᵀY + Yᵀ(C_u − I)Y + λI) x_u = YᵀC_u p_u.  The per-row Gram corrections are built in
chunks of rows with one einsum per chunk, so memory stays bounded and no Python loop runs over ratings.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from numpy.typing import NDArray

from fedsim.datasets import Ratings

__all__ = ["implicit_als"]


def _half_step(
    R: sp.csr_matrix, Y: NDArray[np.float64], alpha: float, reg: float, chunk: int = 256
) -> NDArray[np.float64]:
    n, f = R.shape[0], Y.shape[1]
    YtY = Y.T @ Y
    X = np.zeros((n, f))
    eye = reg * np.eye(f)
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        sub = R[start:stop]
        rows = np.repeat(np.arange(stop - start), np.diff(sub.indptr))
        Yi = Y[sub.indices]  # (nnz_chunk, f)
        A = np.broadcast_to(YtY + eye, (stop - start, f, f)).copy()
        np.add.at(A, rows, alpha * np.einsum("ef,eg->efg", Yi, Yi))
        b = np.zeros((stop - start, f))
        np.add.at(b, rows, (1.0 + alpha) * Yi)
        X[start:stop] = np.linalg.solve(A, b[..., None])[..., 0]
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
