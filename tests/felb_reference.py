"""Slow, literal FELB reference: plain Python loops over entries, written straight from the formulas
in `docs/design.md` §3.2 (exact soft-threshold ELB prox clamped to [0, 1], ½-convention
gradients, steps 1/(1.1 L) with L the spectral norm of the k × k Gram, or the multiplicative
steps X ⊘ (denominator + ε), iPALM extrapolation projected onto [0, 1], prox^p towards V̂).

Only for tests: it checks the vectorised kernels of `device_sdk.felb` on small inputs.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray


def prox_scalar(x: float, kappa: float, lam: float) -> float:
    """The ELB prox of one number: the elastic net at 0 for x ≤ ½, at 1 otherwise, then [0, 1]."""
    if x <= 0.5:
        mag = max(abs(x) - kappa, 0.0)
        y = math.copysign(mag, x) / (1.0 + lam) if mag > 0 else 0.0
    else:
        d = x - 1.0
        mag = max(abs(d) - kappa, 0.0)
        y = 1.0 + (math.copysign(mag, d) / (1.0 + lam) if mag > 0 else 0.0)
    return min(max(y, 0.0), 1.0)


def matmul(X: list[list[float]], Y: list[list[float]]) -> list[list[float]]:
    n, p, m = len(X), len(Y), len(Y[0])
    return [[sum(X[i][t] * Y[t][j] for t in range(p)) for j in range(m)] for i in range(n)]


def transpose(X: list[list[float]]) -> list[list[float]]:
    return [list(r) for r in zip(*X, strict=True)]


def spectral_norm(G: list[list[float]]) -> float:
    return float(np.linalg.norm(np.array(G), 2))


def _extrapolate(X: list[list[float]], Xp: list[list[float]], beta: float) -> list[list[float]]:
    if beta == 0.0:
        return [list(r) for r in X]
    return [
        [min(max(X[i][j] + beta * (X[i][j] - Xp[i][j]), 0.0), 1.0) for j in range(len(X[0]))] for i in range(len(X))
    ]


def _block(
    X: list[list[float]],
    P: list[list[float]],
    Q: list[list[float]],
    G: list[list[float]],
    kappa: float,
    lam: float,
    rule: str,
    eps: float,
) -> tuple[list[list[float]], list[list[float]]]:
    """One prox-gradient step of a block: gradient P − Q (P = X·G), step 1/(1.1 L) or X/(P + ε)."""
    L = max(spectral_norm(G), 1e-4)
    out, steps = [], []
    for i in range(len(X)):
        row, srow = [], []
        for j in range(len(X[0])):
            eta = X[i][j] / (P[i][j] + eps) if rule == "mu" else 1.0 / (1.1 * L)
            grad = P[i][j] - Q[i][j]
            row.append(prox_scalar(X[i][j] - eta * grad, eta * kappa, eta * lam))
            srow.append(eta)
        out.append(row)
        steps.append(srow)
    return out, steps


def iteration_reference(
    A: NDArray[np.float64],
    U: NDArray[np.float64],
    V: NDArray[np.float64],
    U_prev: NDArray[np.float64],
    V_prev: NDArray[np.float64],
    V_hat: NDArray[np.float64],
    *,
    kappa: float,
    lam: float,
    gamma: float,
    beta: float,
    rule: str,
    eps: float = 1e-12,
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """One local iteration: U block, V block with the new U, prox^p of V towards V̂."""
    a, vh = A.tolist(), V_hat.tolist()
    Ue = _extrapolate(U.tolist(), U_prev.tolist(), beta)
    Vl = V.tolist()
    G = matmul(Vl, transpose(Vl))
    U_new, _ = _block(Ue, matmul(Ue, G), matmul(a, transpose(Vl)), G, kappa, lam, rule, eps)
    Ve = _extrapolate(Vl, V_prev.tolist(), beta)
    # Work on the transposes so the V block is the same row-wise step: Vᵀ·(UᵀU) and (UᵀA)ᵀ = AᵀU.
    H = matmul(transpose(U_new), U_new)
    Vt = transpose(Ve)
    Vt_new, steps = _block(Vt, matmul(Vt, H), matmul(transpose(a), U_new), H, kappa, lam, rule, eps)
    V_new = transpose(Vt_new)
    st = transpose(steps)
    V_out = [
        [(V_new[i][j] + st[i][j] * gamma * vh[i][j]) / (1.0 + st[i][j] * gamma) for j in range(len(V_new[0]))]
        for i in range(len(V_new))
    ]
    return np.array(U_new), np.array(V_out)


def local_reference(
    A: NDArray[np.float64],
    U: NDArray[np.float64],
    V: NDArray[np.float64],
    V_hat: NDArray[np.float64],
    *,
    kappa: float,
    lam: float,
    gamma: float,
    beta: float,
    rule: str,
    iterations: int,
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """``iterations`` reference iterations, the iPALM history starting at the inputs."""
    Up, Vp = U, V
    for _ in range(iterations):
        Un, Vn = iteration_reference(A, U, V, Up, Vp, V_hat, kappa=kappa, lam=lam, gamma=gamma, beta=beta, rule=rule)
        Up, Vp, U, V = U, V, Un, Vn
    return U, V
