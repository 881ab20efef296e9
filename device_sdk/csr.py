"""Products of a CSR matrix (``indptr``, ``cols``, ``vals``) with a dense matrix, in numpy alone, so
the device path needs no scipy.

Invariants: each output entry is summed in the order of the CSR entries (by row, then by position),
the order scipy's sparse products use, so results are bit-identical to ``csr_matrix(...) @ dense``.
Memory stays O(nnz + output): one column of the dense matrix is gathered at a time.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

__all__ = ["csr_matmul", "csr_rmatmul"]


def _rows(indptr: NDArray[np.int64]) -> NDArray[np.int64]:
    return np.repeat(np.arange(indptr.size - 1, dtype=np.int64), np.diff(indptr))


def csr_matmul(
    indptr: NDArray[np.int64], cols: NDArray[np.int64], vals: NDArray[np.float64], dense: NDArray[np.number]
) -> NDArray[np.float64]:
    """R @ dense for the (n × m) CSR matrix R and a dense (m, f) matrix: an (n, f) float64 array."""
    rows = _rows(indptr)
    n = indptr.size - 1
    Dt = np.ascontiguousarray(np.asarray(dense, dtype=np.float64).T)
    out = np.empty((n, Dt.shape[0]), dtype=np.float64)
    for k in range(Dt.shape[0]):  # loop over the f columns; each pass is vectorized over the entries
        out[:, k] = np.bincount(rows, weights=vals * Dt[k][cols], minlength=n)
    return out


def csr_rmatmul(
    indptr: NDArray[np.int64],
    cols: NDArray[np.int64],
    vals: NDArray[np.float64],
    dense: NDArray[np.number],
    n_cols: int,
) -> NDArray[np.float64]:
    """Rᵀ @ dense for the (n × n_cols) CSR matrix R and a dense (n, f) matrix: an (n_cols, f) array."""
    rows = _rows(indptr)
    Dt = np.ascontiguousarray(np.asarray(dense, dtype=np.float64).T)
    out = np.empty((n_cols, Dt.shape[0]), dtype=np.float64)
    for k in range(Dt.shape[0]):  # loop over the f columns; each pass is vectorized over the entries
        out[:, k] = np.bincount(cols, weights=vals * Dt[k][rows], minlength=n_cols)
    return out
