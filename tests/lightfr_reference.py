"""Slow, obvious reference implementations of the LightFR kernels, written straight from the paper's
equations with Python loops and exact rational arithmetic (`fractions.Fraction`), used only to check
the vectorised kernels.  Exact arithmetic makes b* = 0 ("keep the bit", eq. 10) unambiguous."""

from __future__ import annotations

from fractions import Fraction

import numpy as np


def dcd_user_reference(items, r, b, D, lam, max_sweeps, *, margins=None):
    """Eq. 9–10 for one user, literally: recompute d_{i,¬k}ᵀ b_{¬k} for every bit and item.

    ``margins``, if a list, receives |b*| of every bit visited (to spot real-number ties that a
    float λ such as 0.01 moves by 1e-19 in exact arithmetic)."""
    b = [int(x) for x in b]
    f = len(b)
    lam = Fraction(lam)
    r = [Fraction(float(x)) for x in r]
    for _ in range(max_sweeps):
        flips = 0
        for k in range(f):
            acc = Fraction(0)
            for i, rui in zip(items, r, strict=True):
                rest = sum(int(D[i][j]) * b[j] for j in range(f) if j != k)
                acc += Fraction(1, f) * (rui - Fraction(1, 2) - Fraction(rest, 2 * f)) * int(D[i][k])
            bal = sum(b[j] for j in range(f) if j != k)
            bstar = acc - 2 * lam * bal
            if margins is not None:
                margins.append(abs(bstar))
            if bstar != 0:
                new = 1 if bstar > 0 else -1
                flips += new != b[k]
                b[k] = new
        if flips == 0:
            break
    return np.array(b, dtype=np.int8)


def item_gradient_reference(items, r, b, D, m):
    """Eq. 12 for one user: Δd_ik = (r_ui − 1/2 − d_{i,¬k}ᵀ b_{¬k} / (2f)) b_k, dense (m, f)."""
    f = len(b)
    G = np.zeros((m, f))
    for i, rui in zip(items, r, strict=True):
        for k in range(f):
            rest = sum(int(D[i][j]) * int(b[j]) for j in range(f) if j != k)
            G[i, k] += (rui - 0.5 - rest / (2.0 * f)) * int(b[k])
    return G


def agg_grad_reference(D, grad_sum, lam):
    """Eq. 14–15 on the server, bit by bit for every item, in exact arithmetic."""
    D = D.astype(int).copy()
    m, f = D.shape
    lam = Fraction(lam)
    for i in range(m):
        for k in range(f):
            bal = sum(int(D[i][j]) for j in range(f) if j != k)
            dstar = Fraction(float(grad_sum[i][k])) / f - 2 * lam * bal
            if dstar != 0:
                D[i][k] = 1 if dstar > 0 else -1
    return D.astype(np.int8)


def hamming_distances_reference(u, D):
    """Hamming distance of a ±1 user code to every ±1 item code, by counting unequal signs."""
    return np.array([int(np.sum(D[i] != u)) for i in range(D.shape[0])])
