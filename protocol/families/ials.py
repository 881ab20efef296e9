"""Implicit ALS's upload layout, shared by devices, the server and the simulator.

Invariants:
- One place defines where each part of an iALS device upload sits in the flat vector that secure
  aggregation sums; the device (`device_sdk.ials.IALSModel`), the server strategy
  (`agg_server.strategy.ials.IALSStrategy`) and the simulator all slice it here.
- For a device holding users with item sets I_u and user vectors u, the upload is, in order:
  B (m, d), row j = Σ_{u: j ∈ I_u} u;  c (m,), c_j = #{u: j ∈ I_u};  G (d, d) = Σ_u u uᵀ;
  H (d, d) = Σ_u |I_u| u uᵀ;  n (1,) = Σ_u |I_u|.  Every part is a sum over users, so the sum over
  devices is the same vector as one device holding every user: the server needs nothing but the secure sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

__all__ = ["DEFAULT_FACTORS", "INIT_SCALE", "LEVEL_TOP", "IALSLayout", "initial_item_factors", "item_levels"]

#: The factor count d a device model, the server's [ials] table and the strategy default to.
DEFAULT_FACTORS = 64

#: The version-1 item factors are N(0, INIT_SCALE²), as centralised implicit ALS starts.
INIT_SCALE = 0.01


#: The highest item level (protocol 1.10): levels are uint8, and a device scores u·v + w·level / LEVEL_TOP.
LEVEL_TOP = 255


def item_levels(counts: NDArray[np.floating]) -> NDArray[np.uint8]:
    """The uint8 item levels of holder counts: round(LEVEL_TOP · log(1 + c_j) / log(1 + max c)), negative counts
    (DP noise) taken as 0; all 0 when no item has a positive count."""
    lv = np.log1p(np.maximum(np.asarray(counts, dtype=np.float64), 0.0))
    top = float(lv.max()) if lv.size else 0.0
    if not top > 0:
        return np.zeros(lv.shape, dtype=np.uint8)
    return np.rint(lv * (LEVEL_TOP / top)).astype(np.uint8)


def initial_item_factors(n_items: int, rank: int, rng: np.random.Generator) -> NDArray[np.float64]:
    """(n_items, rank) entries drawn from N(0, INIT_SCALE²) with ``rng``."""
    if n_items < 1 or rank < 1:
        raise ValueError(f"need n_items >= 1 and rank >= 1, got {n_items}, {rank}")
    return rng.normal(0.0, INIT_SCALE, (n_items, rank))


@dataclass(frozen=True, slots=True)
class IALSLayout:
    """Where each part of an iALS upload sits.

    Attributes
    ----------
    n_items, rank : catalogue size m and factor count d.
    """

    n_items: int
    rank: int

    def __post_init__(self) -> None:
        if self.n_items < 1 or self.rank < 1:
            raise ValueError(f"n_items and rank must be >= 1, got {self.n_items}, {self.rank}")

    @property
    def length(self) -> int:
        """Elements of one upload: m·d + m + 2·d² + 1."""
        m, d = self.n_items, self.rank
        return m * d + m + 2 * d * d + 1

    def _slices(self) -> dict[str, slice]:
        m, d = self.n_items, self.rank
        sizes = {"factors": m * d, "counts": m, "gram": d * d, "weighted_gram": d * d, "positives": 1}
        out, start = {}, 0
        for name, size in sizes.items():
            out[name] = slice(start, start + size)
            start += size
        return out

    def split(self, vector: NDArray[np.float64]) -> dict[str, NDArray[np.float64]]:
        """Views of ``vector`` by part: "factors" B (m, d), "counts" c (m,), "gram" G (d, d),
        "weighted_gram" H (d, d) and "positives" n (a 0-d array).

        Raises
        ------
        ValueError
            If ``vector`` does not have `length` entries.
        """
        v = np.asarray(vector, dtype=np.float64)
        if v.shape != (self.length,):
            raise ValueError(f"an iALS upload has {self.length} elements, got shape {v.shape}")
        m, d = self.n_items, self.rank
        sl = self._slices()
        return {
            "factors": v[sl["factors"]].reshape(m, d),
            "counts": v[sl["counts"]],
            "gram": v[sl["gram"]].reshape(d, d),
            "weighted_gram": v[sl["weighted_gram"]].reshape(d, d),
            "positives": v[sl["positives"]].reshape(()),
        }

    def join(
        self,
        factors: NDArray[np.float64],
        counts: NDArray[np.float64],
        gram: NDArray[np.float64],
        weighted_gram: NDArray[np.float64],
        positives: float,
    ) -> NDArray[np.float64]:
        """The flat upload from its parts (the inverse of `split`).

        Raises
        ------
        ValueError
            A part has the wrong shape.
        """
        m, d = self.n_items, self.rank
        parts = {
            "factors": (factors, (m, d)),
            "counts": (counts, (m,)),
            "gram": (gram, (d, d)),
            "weighted_gram": (weighted_gram, (d, d)),
        }
        flat = []
        for name, (arr, shape) in parts.items():
            if np.shape(arr) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {np.shape(arr)}")
            flat.append(np.asarray(arr, dtype=np.float64).ravel())
        flat.append(np.array([float(positives)]))
        return np.concatenate(flat)
