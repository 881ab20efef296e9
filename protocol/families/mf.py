"""Real-valued MF with embedding clipping (FMF paper eq. 6, Lemma 3): the projection Π that the device
applies to its user and item rows and the server to the item matrix after every step."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

__all__ = ["project_rows"]


def project_rows(X: NDArray[np.floating], R: float) -> NDArray[np.float64]:
    """Embedding clipping Π (FMF paper eq. 6 and Lemma 3): negatives to 0, then every row whose
    squared norm exceeds ``R`` scaled to norm √R.  This is the Euclidean projection onto the set.

    Parameters
    ----------
    X : (n, f) float rows.
    R : squared-norm bound (> 0).

    Returns
    -------
    A new (n, f) float64 array.

    Raises
    ------
    ValueError
        If R is not finite and > 0, X is not 2-D, or X holds NaN or infinity.
    """
    if not (R > 0 and np.isfinite(R)):
        raise ValueError(f"R must be finite and > 0, got {R}")
    Y = np.maximum(np.asarray(X, dtype=np.float64), 0.0)
    if Y.ndim != 2:
        raise ValueError(f"expected a 2-D matrix of rows, got shape {Y.shape}")
    if not np.all(np.isfinite(Y)):
        raise ValueError("rows contain NaN or infinity")
    n2 = np.einsum("ij,ij->i", Y, Y)
    over = n2 > R
    scale = np.ones_like(n2)
    scale[over] = np.sqrt(R / n2[over])  # u / max{1, ‖u‖/√R}
    return Y * scale[:, None]
