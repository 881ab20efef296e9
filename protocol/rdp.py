# Invariants: numpy and the standard library only, so a device can import it (the server's accountant,
# `protocol.accounting`, adds dp-accounting on top).  One home for the per-round Skellam RDP bound: the
# server's ledger and the device's own ledger (`protocol.policy`) both call `skellam_rdp`.
"""The Skellam mechanism's RDP bound and a dependency-free RDP-to-(ε, δ) conversion.

The bound and its source are documented in `protocol.accounting`.  `rdp_to_epsilon` is the improved
conversion (Canonne, Kamath, Steinke 2020, Prop. 12): ε = min over α of
RDP(α) + log((α - 1) / α) - (log δ + log α) / (α - 1), which is what the server's accountant computes with
dp-accounting (a test checks both agree).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from protocol.errors import ConfigError

__all__ = ["ORDERS", "ORDERS_ARRAY", "check_positive", "check_delta", "skellam_rdp", "rdp_to_epsilon"]

ORDERS: tuple[int, ...] = (*range(2, 65), 80, 96, 128, 160, 192, 256)
"""Integer Renyi orders at which privacy is tracked (the bound was verified at each of these)."""

ORDERS_ARRAY = np.asarray(ORDERS, dtype=np.float64)


def check_positive(name: str, value: float, *, allow_zero: bool = False) -> float:
    v = float(value)
    ok = math.isfinite(v) and (v >= 0.0 if allow_zero else v > 0.0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{name} must be finite and {bound}, got {value!r}")
    return v


def check_delta(delta: float) -> float:
    d = float(delta)
    if not (math.isfinite(d) and 0.0 < d < 1.0):
        raise ConfigError(f"delta must be in (0, 1), got {delta!r}")
    return d


def skellam_rdp(
    mu: float, l1: float, l2: float, orders: Sequence[float] | NDArray[np.float64] = ORDERS
) -> NDArray[np.float64]:
    """Return the per-round RDP bound of the Skellam mechanism at each order.

    Parameters
    ----------
    mu : float
        Aggregate per-coordinate noise variance (quantized units), > 0.
    l1, l2 : float
        L1 and L2 sensitivity of one device's contribution (quantized units), >= 0.
    orders : sequence of float
        Renyi orders alpha > 1 (default `ORDERS`).

    Returns
    -------
    NDArray[np.float64]
        eps(alpha) for each order (Agarwal, Kairouz, Liu 2021; formula in the module docstring).

    Raises
    ------
    ConfigError
        If mu <= 0, a sensitivity is negative, or an order is <= 1.
    """
    m = check_positive("mu", mu)
    d1 = check_positive("l1 sensitivity", l1, allow_zero=True)
    d2 = check_positive("l2 sensitivity", l2, allow_zero=True)
    a = np.asarray(orders, dtype=np.float64)
    if a.size == 0 or np.any(~np.isfinite(a)) or np.any(a <= 1.0):
        raise ConfigError("Renyi orders must be finite and > 1")
    gaussian = a * d2**2 / (2.0 * m)
    correction = np.minimum(((2.0 * a - 1.0) * d2**2 + 6.0 * d1) / (16.0 * m**2), 3.0 * d1 / (4.0 * m))
    return gaussian + correction


def rdp_to_epsilon(rdp: NDArray[np.float64], delta: float) -> float:
    """ε at ``delta`` of an RDP curve given at `ORDERS` (0.0 for an all-zero curve).

    Raises
    ------
    ConfigError
        ``delta`` outside (0, 1) or a curve of the wrong length.
    """
    d = check_delta(delta)
    curve = np.asarray(rdp, dtype=np.float64)
    if curve.shape != ORDERS_ARRAY.shape:
        raise ConfigError(f"an RDP curve needs {len(ORDERS)} values (one per order), got {curve.shape}")
    if not np.any(curve > 0):
        return 0.0
    a = ORDERS_ARRAY
    eps = curve + np.log1p(-1.0 / a) - (math.log(d) + np.log(a)) / (a - 1.0)
    return float(max(0.0, np.min(eps)))
