"""LightFR's upload layout and item-level quantizer, shared by devices, the server and simulators.

Invariants:
- One place defines where each part of a LightFR device upload sits in the flat vector that secure
  aggregation sums; the device (`device_sdk.models.LightFRModel`), the server strategy
  (`agg_server.strategy.lightfr`), the in-process simulator and the DP simulator all slice it here.
- The sampled-negatives objective (``unobserved_weight == 0``, the paper's setting) uploads only the
  (m, f) item gradients.  The all-items objective (``unobserved_weight > 0``) appends, in order:
  the per-item bias numerator (m), the per-item positive counts (m), the user code's outer product
  b bᵀ / f (f × f) and the user code b / f (f).  Every part is a sum over devices, so the server
  needs nothing but the secure sum.
- With a counts share s > 0 (`clip_parts`) a device clips the counts part of its upload to norm √s·C
  and everything else to √(1 − s)·C, so the whole stays within C (the sensitivity the accountant
  charges is unchanged) while s of the clip norm buys the private popularity channel.
- Item levels are uint8: level = clip(round(β·f·B/2) + 128, 0, 255) for an item bias β (in units of
  bᵀd / f) and hamming weight B >= 1, so that (f − Hamming)·B + level ranks items exactly as
  bᵀd / f + β does, up to the quantization step 2 / (f·B).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from protocol.quantization import clip_l2

__all__ = [
    "UploadLayout",
    "LEVEL_CENTER",
    "DENSITY_SCALE",
    "DENSITY_POWER",
    "levels_from_bias",
    "bias_from_levels",
    "density_weight",
    "clip_parts",
]

#: The level that stands for item bias 0.
LEVEL_CENTER = 128

#: κ and γ of the density rule w0 = κ · density^γ (`density_weight`), chosen on the validation
#: splits of ML-100K, FilmTrust and amazon-book together (docs/results/2026-11-quality.md).
DENSITY_SCALE = 0.6
DENSITY_POWER = 2.0 / 3.0


@dataclass(frozen=True, slots=True)
class UploadLayout:
    """Where each part of a LightFR upload sits.

    Attributes
    ----------
    n_items, bits : catalogue size m and code length f.
    full : True for the all-items objective (item gradients plus bias, counts, Gram and code sum).
    """

    n_items: int
    bits: int
    full: bool

    def __post_init__(self) -> None:
        if self.n_items < 1 or self.bits < 1:
            raise ValueError(f"n_items and bits must be >= 1, got {self.n_items}, {self.bits}")

    @property
    def length(self) -> int:
        """Elements of one upload."""
        m, f = self.n_items, self.bits
        return m * f + (2 * m + f * f + f if self.full else 0)

    @property
    def gradient(self) -> slice:
        """(m, f) item gradients, row-major."""
        return slice(0, self.n_items * self.bits)

    @property
    def bias(self) -> slice:
        """(m,) per-item bias numerators (all-items objective only)."""
        return self._after(self.gradient, self.n_items)

    @property
    def counts(self) -> slice:
        """(m,) per-item counts of the device's positives (each item at most once)."""
        return self._after(self.bias, self.n_items)

    @property
    def gram(self) -> slice:
        """(f, f) b bᵀ / f, row-major."""
        return self._after(self.counts, self.bits * self.bits)

    @property
    def code_sum(self) -> slice:
        """(f,) b / f."""
        return self._after(self.gram, self.bits)

    def _after(self, prev: slice, size: int) -> slice:
        if not self.full:
            raise ValueError("the sampled-negatives upload has only the item gradients")
        return slice(prev.stop, prev.stop + size)

    def split(self, vector: NDArray[np.float64]) -> dict[str, NDArray[np.float64]]:
        """Views of ``vector`` by part: "gradient" (m, f) and, for the full layout, "bias" (m,),
        "counts" (m,), "gram" (f, f) (rescaled to Σ b bᵀ) and "code_sum" (f,) (rescaled to Σ b)."""
        v = np.asarray(vector, dtype=np.float64)
        if v.shape != (self.length,):
            raise ValueError(f"a LightFR upload has {self.length} elements, got shape {v.shape}")
        f = self.bits
        out = {"gradient": v[self.gradient].reshape(self.n_items, f)}
        if self.full:
            out["bias"] = v[self.bias]
            out["counts"] = v[self.counts]
            out["gram"] = v[self.gram].reshape(f, f) * f
            out["code_sum"] = v[self.code_sum] * f
        return out

    def join(
        self,
        gradient: NDArray[np.float64],
        bias: NDArray[np.float64] | None = None,
        counts: NDArray[np.float64] | None = None,
        gram: NDArray[np.float64] | None = None,
        code_sum: NDArray[np.float64] | None = None,
    ) -> NDArray[np.float64]:
        """The flat upload from its parts (``gram`` as Σ b bᵀ and ``code_sum`` as Σ b; scaled by 1/f here)."""
        m, f = self.n_items, self.bits
        g = np.asarray(gradient, dtype=np.float64)
        if g.shape != (m, f):
            raise ValueError(f"gradient must be ({m}, {f}), got {g.shape}")
        if not self.full:
            return g.ravel().copy()
        parts = {"bias": (bias, (m,)), "counts": (counts, (m,)), "gram": (gram, (f, f)), "code_sum": (code_sum, (f,))}
        flat = [g.ravel()]
        for name, (arr, shape) in parts.items():
            if arr is None or np.shape(arr) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {None if arr is None else np.shape(arr)}")
            a = np.asarray(arr, dtype=np.float64).ravel()
            flat.append(a / f if name in ("gram", "code_sum") else a)
        return np.concatenate(flat)


def density_weight(
    positives: float,
    devices: int,
    n_items: int,
    *,
    scale: float = DENSITY_SCALE,
    power: float = DENSITY_POWER,
    cap: float = 1.0,
) -> float:
    """The unobserved weight w0 = κ · density^γ of a catalogue, from what a secure sum reveals.

    ``positives`` is the sum of the counts slice over ``devices`` uploads (Σ_u |Ω_u|), so the
    density is Σ_u |Ω_u| / (devices · m).  It is clipped to [1/m, 1] (DP noise may push the sum
    below one positive per device, or above m), and w0 to at most ``cap`` (1 + α bounds it).
    """
    if devices < 1 or n_items < 1:
        raise ValueError(f"devices and n_items must be >= 1, got {devices}, {n_items}")
    if not (np.isfinite(scale) and scale > 0 and np.isfinite(power) and power > 0):
        raise ValueError(f"density scale and power must be finite and > 0, got {scale}, {power}")
    if not (np.isfinite(cap) and cap > 0):
        raise ValueError(f"cap must be finite and > 0, got {cap}")
    p = float(positives) if np.isfinite(positives) else 0.0
    density = min(max(p / (devices * n_items), 1.0 / n_items), 1.0)
    return float(min(scale * density**power, cap))


def levels_from_bias(beta: NDArray[np.float64], bits: int, weight: int) -> NDArray[np.uint8]:
    """Quantize item biases β to uint8 levels (see the module docstring)."""
    if weight < 1:
        raise ValueError(f"hamming weight must be >= 1, got {weight}")
    b = np.asarray(beta, dtype=np.float64)
    if not np.all(np.isfinite(b)):
        raise ValueError("item biases must be finite")
    return np.clip(np.rint(b * bits * weight / 2.0) + LEVEL_CENTER, 0, 255).astype(np.uint8)


def bias_from_levels(levels: NDArray[np.uint8] | None, n_items: int, bits: int, weight: int) -> NDArray[np.float64]:
    """The item biases β that ``levels`` stand for (zeros when there are no levels)."""
    if levels is None:
        return np.zeros(n_items)
    lv = np.asarray(levels)
    if lv.shape != (n_items,) or lv.dtype != np.uint8:
        raise ValueError(f"item levels must be ({n_items},) uint8, got {lv.shape} {lv.dtype}")
    if weight < 1:
        raise ValueError(f"hamming weight must be >= 1, got {weight}")
    return (lv.astype(np.float64) - LEVEL_CENTER) * 2.0 / (bits * weight)


def clip_parts(
    vector: NDArray[np.float64], layout: UploadLayout, clip_norm: float, share: float
) -> NDArray[np.float64]:
    """Clip the counts part of an all-items upload to norm √share·C and the rest to √(1 − share)·C.

    The result has norm at most C (up to rounding, which the quantizer's own clip to C removes), so
    a round's sensitivity is the one the accountant charges; ``share`` is the fraction of the clip
    norm's square given to the private popularity channel.  ``share == 0`` returns a copy.
    """
    if not 0.0 <= share < 1.0:
        raise ValueError(f"counts share must be in [0, 1), got {share}")
    v = np.array(vector, dtype=np.float64)
    if share == 0.0:
        return v
    if not layout.full:
        raise ValueError("a counts share needs the all-items upload, which has a counts part")
    if v.shape != (layout.length,):
        raise ValueError(f"a LightFR upload has {layout.length} elements, got shape {v.shape}")
    sl = layout.counts
    counts, _ = clip_l2(v[sl], clip_norm * np.sqrt(share))
    rest_idx = np.r_[0 : sl.start, sl.stop : layout.length]
    rest, _ = clip_l2(v[rest_idx], clip_norm * np.sqrt(1.0 - share))
    v[sl] = counts
    v[rest_idx] = rest
    return v
