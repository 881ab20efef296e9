"""Slow, literal implementations of the MF kernels (FMF paper eq. 6 and section 4.1.1), one rating and
one coordinate at a time with Python loops, used only to check the vectorised `device_sdk.mf`."""

from __future__ import annotations

import math

import numpy as np


def project_reference(X, R):
    """Π: every negative entry to 0, then u / max{1, ‖u‖/√R}, row by row."""
    out = np.zeros((len(X), len(X[0]) if len(X) else 0))
    for i, row in enumerate(X):
        clipped = [max(0.0, float(x)) for x in row]
        norm = math.sqrt(sum(x * x for x in clipped))
        div = max(1.0, norm / math.sqrt(R))
        for k, x in enumerate(clipped):
            out[i, k] = x / div
    return out


def dot(a, b):
    return sum(float(x) * float(y) for x, y in zip(a, b, strict=True))


def user_step_reference(U, V, users, items, r, lr, reg, R):
    """u_i ← Π(u_i − η·[(1/n_i) Σ_j −2(r_ij − u_i·v_j) v_j + 2λ u_i]) for every user with examples."""
    n, f = U.shape
    grads = {}
    counts = {}
    for u in users:
        counts[int(u)] = counts.get(int(u), 0) + 1
    for u, j, rating in zip(users, items, r, strict=True):
        u, j = int(u), int(j)
        res = float(rating) - dot(U[u], V[j])
        g = grads.setdefault(u, [0.0] * f)
        for k in range(f):
            g[k] += -2.0 * res * float(V[j][k]) / counts[u]
    out = np.array(U, dtype=np.float64, copy=True)
    for u, g in grads.items():
        row = [float(U[u][k]) - lr * (g[k] + 2.0 * reg * float(U[u][k])) for k in range(f)]
        out[u] = project_reference([row], R)[0]
    return out


def item_gradient_reference(U, V, users, items, r):
    """Σ over examples of −2(r_ij − u_i·v_j)·u_i added to row j, dense (m, f)."""
    m, f = V.shape
    G = np.zeros((m, f))
    for u, j, rating in zip(users, items, r, strict=True):
        res = float(rating) - dot(U[int(u)], V[int(j)])
        for k in range(f):
            G[int(j), k] += -2.0 * res * float(U[int(u)][k])
    return G


def aggregate_reference(V, total, survivors, lr, R):
    """V ← Π(V − γ/|survivors| · Σ), entry by entry."""
    m, f = V.shape
    stepped = [[float(V[j][k]) - lr / survivors * float(total[j * f + k]) for k in range(f)] for j in range(m)]
    return project_reference(stepped, R)
