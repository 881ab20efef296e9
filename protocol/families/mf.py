"""Real-valued MF with embedding clipping (FMF paper eq. 6, Lemma 3): the projection Π that the device
applies to its user and item rows and the server to the item matrix after every step."""

from __future__ import annotations

from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from protocol.spec import MAX_LOCAL_STEPS

__all__ = ["TrainingParameters", "check_training", "project_rows"]


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


class TrainingParameters(Protocol):
    """What a device's MF config and the server's MF strategy both carry (the plan's MF fields)."""

    @property
    def max_norm2(self) -> float: ...
    @property
    def learning_rate(self) -> float: ...
    @property
    def reg(self) -> float: ...
    @property
    def pretrain_epochs(self) -> int: ...
    @property
    def local_epochs(self) -> int: ...
    @property
    def negatives(self) -> int: ...


def check_training(p: TrainingParameters) -> None:
    """The one check of MF's training parameters, for the device's config and the server's strategy alike
    (the bounds a `RoundInvite` can carry).

    Raises
    ------
    ValueError
        Naming the first parameter out of range: R must be finite and > 0; the step and the L2 weight
        finite and >= 0; pre-training epochs in [0, MAX_LOCAL_STEPS]; local epochs in
        [1, MAX_LOCAL_STEPS]; negatives >= 0.
    """
    if not (np.isfinite(p.max_norm2) and p.max_norm2 > 0):
        raise ValueError(f"max_norm2 must be finite and > 0, got {p.max_norm2}")
    for name, v in (("learning_rate", p.learning_rate), ("reg", p.reg)):
        if not (np.isfinite(v) and v >= 0):
            raise ValueError(f"{name} must be finite and >= 0, got {v}")
    if not 0 <= p.pretrain_epochs <= MAX_LOCAL_STEPS:
        raise ValueError(f"pretrain_epochs must be in [0, {MAX_LOCAL_STEPS}], got {p.pretrain_epochs}")
    if not 1 <= p.local_epochs <= MAX_LOCAL_STEPS:
        raise ValueError(f"local_epochs must be in [1, {MAX_LOCAL_STEPS}], got {p.local_epochs}")
    if p.negatives < 0:
        raise ValueError(f"negatives must be >= 0, got {p.negatives}")
