"""Synthetic matrices with planted low-rank structure, for the FELB and FNMF test recipes
(`docs/design.md` §3.4): rows use a few "tiles" (components), each a random set of
columns; Boolean data are OR-products of the memberships with ~90%-dense tiles and XOR noise,
real data are products plus positively truncated Gaussian noise.

Invariants:
- Everything is drawn from the one generator passed in, in a fixed order: the same seed gives the
  same matrices, factors and client split.
- Rows are split evenly (in order) over the clients; ``clients`` must divide the row count.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

__all__ = ["Planted", "planted_binary", "planted_nonnegative"]


@dataclass(frozen=True)
class Planted:
    """A planted matrix and its ground truth.

    Attributes
    ----------
    data : (n, m) array
        What the clients hold (noisy): uint8 in {0, 1} for `planted_binary`, float64 ≥ 0 otherwise.
    signal : (n, m) array
        The noise-free matrix (dense tiles without XOR noise; or U*·V* for the real variant).
    u, v : (n, k), (k, m) arrays
        The planted factors (uint8 memberships and column sets; float64 for the real variant).
    clients : tuple of (n_i, m) arrays
        ``data`` split by rows over the clients.
    """

    data: NDArray[np.generic]
    signal: NDArray[np.generic]
    u: NDArray[np.generic]
    v: NDArray[np.generic]
    clients: tuple[NDArray[np.generic], ...]


def _factors(
    n: int, m: int, k: int, rng: np.random.Generator, membership: float, cols: tuple[int, int]
) -> tuple[NDArray[np.uint8], NDArray[np.uint8]]:
    if min(n, m, k) < 1:
        raise ValueError(f"n, m and k must be positive, got {n}, {m}, {k}")
    lo, hi = cols
    if not 1 <= lo <= hi <= m:
        raise ValueError(f"tile widths must satisfy 1 <= {lo} <= {hi} <= m={m}")
    u = (rng.random((n, k)) < membership).astype(np.uint8)
    v = np.zeros((k, m), dtype=np.uint8)
    for comp in range(k):  # k is small (the rank); columns are drawn without a Python loop
        width = int(rng.integers(lo, hi + 1))
        v[comp, rng.choice(m, size=width, replace=False)] = 1
    return u, v


def _split(data: NDArray[np.generic], clients: int) -> tuple[NDArray[np.generic], ...]:
    n = data.shape[0]
    if clients < 1 or n % clients:
        raise ValueError(f"clients={clients} must be positive and divide the {n} rows")
    return tuple(np.split(data, clients))


def planted_binary(
    clients: int = 10,
    rows_per_client: int = 100,
    m: int = 100,
    k: int = 5,
    *,
    density: float = 0.9,
    xor_noise: float = 0.1,
    membership: float = 0.2,
    tile_columns: tuple[int, int] = (10, 25),
    rng: np.random.Generator,
) -> Planted:
    """Boolean data: S = [U*V* ≥ 1] ⊙ Bernoulli(density), A = S XOR Bernoulli(xor_noise).

    ``signal`` is the full OR-product [U*V* ≥ 1] (the tiles before thinning), against which F1* is
    measured, as in the FELB paper's noise-free comparison.
    """
    if not 0.0 <= xor_noise <= 0.5 or not 0.0 < density <= 1.0:
        raise ValueError(f"need xor_noise in [0, 0.5] and density in (0, 1], got {xor_noise}, {density}")
    n = clients * rows_per_client
    u, v = _factors(n, m, k, rng, membership, tile_columns)
    tiles = ((u.astype(np.int64) @ v.astype(np.int64)) >= 1).astype(np.uint8)
    thinned = tiles & (rng.random((n, m)) < density).astype(np.uint8)
    data = thinned ^ (rng.random((n, m)) < xor_noise).astype(np.uint8)
    return Planted(data=data, signal=tiles, u=u, v=v, clients=_split(data, clients))


def planted_nonnegative(
    clients: int = 10,
    rows_per_client: int = 100,
    m: int = 100,
    k: int = 5,
    *,
    noise: float = 0.1,
    membership: float = 0.2,
    tile_columns: tuple[int, int] = (10, 25),
    rng: np.random.Generator,
) -> Planted:
    """Real data: S = U*·V* with U* ~ membership · Uniform(0.5, 1.5), X = S + max(0, N(0, noise²))."""
    if noise < 0.0:
        raise ValueError(f"noise must be >= 0, got {noise}")
    n = clients * rows_per_client
    ub, vb = _factors(n, m, k, rng, membership, tile_columns)
    u = ub * rng.uniform(0.5, 1.5, size=(n, k))
    v = vb.astype(np.float64)
    signal = u @ v
    data = signal + np.maximum(0.0, rng.normal(0.0, noise, size=(n, m))) if noise else signal.copy()
    return Planted(data=data, signal=signal, u=u, v=v, clients=_split(data, clients))
