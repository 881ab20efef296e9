"""FELB (federated Boolean MF with the ELB proximal operator; Dalleiger, Vreeken, Kamp): the ELB
proximal map and the increasing regularization schedule λ_r, which the device applies in its local
iterations and the server in its aggregation (paper eq. 6 and Alg. 1 line 14)."""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = ["LAMBDA_CAP", "prox_elb", "prox_elb_unchecked", "schedule"]

LAMBDA_CAP = 1e12
"""λ_r beyond this binarizes exactly as well, and keeps η·λ finite on a long-running server."""

FloatArray = NDArray[np.float64]


def schedule(reg: float, growth: float, index: int) -> float:
    """λ_index = reg · growth**index (the paper's increasing regularization), capped at `LAMBDA_CAP`."""
    try:
        lam = reg * growth**index
    except OverflowError:
        return LAMBDA_CAP if reg > 0 else 0.0
    return float(min(lam, LAMBDA_CAP))


def prox_elb(x: ArrayLike, kappa: ArrayLike, lam: ArrayLike) -> FloatArray:
    """Proximal map of the ELB regularizer, elementwise (paper eq. 6 with the soft-threshold made
    exact), clamped to [0, 1].

    y₀ = sign(x)·max(|x| − κ, 0)/(1 + λ) (the elastic net at 0) where x ≤ ½, else
    y₁ = 1 + sign(x − 1)·max(|x − 1| − κ, 0)/(1 + λ) (the elastic net at 1).

    Parameters
    ----------
    x : array of points.
    kappa, lam : L1 weight κ ≥ 0 and L2 weight λ ≥ 0, scalars or arrays broadcasting against ``x``
        (the multiplicative-update steps scale them elementwise).

    Returns
    -------
    float64 array of ``x``'s shape with entries in [0, 1]; 0 and 1 are fixed points, the map is
    monotone in x, and as λ → ∞ it tends to [x > ½].

    Raises
    ------
    ValueError
        If a weight is negative or not finite.
    """
    k = np.asarray(kappa, dtype=np.float64)
    lm = np.asarray(lam, dtype=np.float64)
    if np.any(k < 0) or np.any(lm < 0) or not (np.all(np.isfinite(k)) and np.all(np.isfinite(lm))):
        raise ValueError("kappa and lam must be finite and >= 0")
    return prox_elb_unchecked(np.asarray(x, dtype=np.float64), k, lm)


def prox_elb_unchecked(x: FloatArray, kappa: FloatArray | float, lam: FloatArray | float) -> FloatArray:
    """`prox_elb` without the weight checks, for loops that validate their weights once."""
    d = x - 1.0
    y0 = np.sign(x) * np.maximum(np.abs(x) - kappa, 0.0) / (1.0 + lam)
    y1 = 1.0 + np.sign(d) * np.maximum(np.abs(d) - kappa, 0.0) / (1.0 + lam)
    return np.clip(np.where(x <= 0.5, y0, y1), 0.0, 1.0)
