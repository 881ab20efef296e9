"""Slow, obvious reference implementations of the FNMF kernels, written straight from the equations
with Python loops (and brute force over all assignments), used only to check the vectorised kernels
in `device_sdk.fnmf` and `agg_server.strategy.fnmf`."""

from __future__ import annotations

import itertools
import math
from statistics import NormalDist

import numpy as np


def matmul(A, B):
    n, p = len(A), len(B[0])
    out = np.zeros((n, p))
    for i in range(n):
        for j in range(p):
            s = 0.0
            for t in range(len(B)):
                s += A[i][t] * B[t][j]
            out[i, j] = s
    return out


def transpose(A):
    return np.array([[A[i][j] for i in range(len(A))] for j in range(len(A[0]))])


def spectral_norm(G):
    # The largest singular value, by a different algorithm (SVD) than the kernel's eigvalsh.
    return float(np.linalg.svd(np.array(G), compute_uv=False)[0])


def pgd_u(X, U, V):
    """U ← [U − (UVVᵀ − XVᵀ)/‖VVᵀ‖₂]_+, entry by entry."""
    G = matmul(V, transpose(V))
    L = spectral_norm(G)
    UG, XV = matmul(U, G), matmul(X, transpose(V))
    out = np.zeros_like(U)
    for i in range(U.shape[0]):
        for j in range(U.shape[1]):
            out[i, j] = max(0.0, U[i, j] - (UG[i, j] - XV[i, j]) / L)
    return out


def pgd_v(X, U, V):
    """V ← [V − (UᵀUV − UᵀX)/‖UᵀU‖₂]_+, entry by entry."""
    G = matmul(transpose(U), U)
    L = spectral_norm(G)
    GV, UX = matmul(G, V), matmul(transpose(U), X)
    out = np.zeros_like(V)
    for i in range(V.shape[0]):
        for j in range(V.shape[1]):
            out[i, j] = max(0.0, V[i, j] - (GV[i, j] - UX[i, j]) / L)
    return out


def row_sq_dist(A, B):
    k = len(A)
    C = np.zeros((k, k))
    for a in range(k):
        for b in range(k):
            C[a, b] = sum((A[a][j] - B[b][j]) ** 2 for j in range(len(A[0])))
    return C


def lap(V, V_bar):
    """Brute force over all k! permutations: P minimising ‖V̄ − PV‖²."""
    k = len(V)
    C = row_sq_dist(V_bar, V)
    best, best_perm = math.inf, None
    for perm in itertools.permutations(range(k)):
        cost = sum(C[a, perm[a]] for a in range(k))
        if cost < best:
            best, best_perm = cost, perm
    P = np.zeros((k, k))
    for a in range(k):
        P[a, best_perm[a]] = 1.0
    return P


def pearson(x, y):
    m = len(x)
    mx, my = sum(x) / m, sum(y) / m
    sxy = sum((x[j] - mx) * (y[j] - my) for j in range(m))
    sxx = sum((x[j] - mx) ** 2 for j in range(m))
    syy = sum((y[j] - my) ** 2 for j in range(m))
    return sxy / math.sqrt(sxx * syy)


def lap_rho(V, V_bar, alpha):
    """Brute force over every partial one-to-one matching of global rows to local rows: significant
    pairs only (Fisher z, one-sided), a matched pair costs 1 − r, an unmatched global row costs the
    largest allowed cost (+1e-9)."""
    k, m = len(V), len(V[0])
    crit = NormalDist().inv_cdf(1.0 - alpha)
    d = np.zeros((k, k))
    ok = np.zeros((k, k), dtype=bool)
    for a in range(k):
        for b in range(k):
            r = pearson(V_bar[a], V[b])
            d[a, b] = 1.0 - r
            ok[a, b] = math.atanh(r) * math.sqrt(m - 3) > crit
    dummy = max(d[ok]) + 1e-9 if ok.any() else 1.0
    best, best_match = math.inf, None
    for choice in itertools.product(range(-1, k), repeat=k):  # -1: unmatched
        used = [b for b in choice if b >= 0]
        if len(used) != len(set(used)) or any(b >= 0 and not ok[a, b] for a, b in enumerate(choice)):
            continue
        cost = sum(d[a, b] if b >= 0 else dummy for a, b in enumerate(choice))
        if cost < best:
            best, best_match = cost, choice
    P = np.zeros((k, k))
    for a, b in enumerate(best_match):
        if b >= 0:
            P[a, b] = 1.0
    return P


def sinkhorn(V, V_bar, eps, iterations):
    """Sinkhorn–Knopp with uniform (unit) marginals for exactly ``iterations`` passes, rows renormalised."""
    C = row_sq_dist(V_bar, V)
    k = len(V)
    top = max(C[a, b] for a in range(k) for b in range(k))
    K = [[math.exp(-C[a, b] / top / eps) for b in range(k)] for a in range(k)]
    u, v = [1.0] * k, [1.0] * k
    for _ in range(iterations):
        u = [1.0 / sum(K[a][b] * v[b] for b in range(k)) for a in range(k)]
        v = [1.0 / sum(K[a][b] * u[a] for a in range(k)) for b in range(k)]
    P = np.array([[u[a] * K[a][b] * v[b] for b in range(k)] for a in range(k)])
    for a in range(k):
        P[a] /= sum(P[a])
    return P


def barycenter(matrices, iterations):
    """FNMF Alg. 1 with brute-force LAP: V̄ ← mean; repeat P_j ← LAP(V̄, V_j), V̄ ← mean P_jV_j."""
    c = len(matrices)
    k, m = matrices[0].shape
    v_bar = np.zeros((k, m))
    for V in matrices:
        v_bar += V / c
    for _ in range(iterations):
        new = np.zeros((k, m))
        for V in matrices:
            new += matmul(lap(V, v_bar), V) / c
        if np.array_equal(new, v_bar):
            break
        v_bar = new
    return v_bar
