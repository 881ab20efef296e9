"""LightFR numeric kernels (Zhang et al., LightFR, section 3): discrete coordinate descent (DCD) for
user codes, the item gradient a device uploads, and cold-start fold-in.

Invariants:
- Codes are int8 matrices of ±1: user codes ``B`` (n, f), item codes ``D`` (m, f).
- A batch of users is given in CSR form: ``indptr`` (n + 1,) int64 and, per entry, ``items`` (int64)
  and target ratings ``r`` (float64, normalised to [0, 1]; sampled negatives carry r = 0).  A single
  device is the batch with n = 1, so the device and the simulator run the very same code.
- The kernels are pure: arrays in, new arrays out; no logging, no config, no global randomness.

The local objective that DCD minimises exactly, one bit at a time, is
    L_u(b) = Σ_{i∈Ω_u} (r_ui − sim(b, d_i))² + λ (Σ_k b_k)²,   sim(b, d) = 1/2 + bᵀd / (2f).
Its coordinate minimiser is the paper's eq. 9–10 (b*_uk, sign, keep the bit when b* = 0).  The
paper's eq. 6 writes the quadratic term as (Σ_i d_iᵀb)² and the balance term as λ‖b‖²; the first is a
typo for Σ_i (d_iᵀb)² and the second is constant for binary codes — the form above is the one whose
derivative gives eq. 9, and it is what `local_objective` evaluates.

Cost: with the inner products s_i = d_iᵀb kept up to date on every flip, one bit costs O(|Ω_u|) and a
sweep O(f·|Ω_u|); the float part Σ_i (r_ui − 1/2) d_ik does not change during the sweeps and is
computed once.  Users are processed together, bit by bit, so Python loops run over bits and sweeps
only, never over users or ratings.  Every user's result is exactly what a per-user sweep would give:
a user whose sweep flipped nothing keeps an unchanged state and so flips nothing later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from protocol.codes import pack_signs, unpack_signs
from protocol.families.lightfr import LEVEL_CENTER

__all__ = [
    "inner_products",
    "dcd_update",
    "fold_in_codes",
    "item_gradient_sum",
    "item_codes_sum",
    "local_objective",
    "sample_negatives",
    "DCDStats",
    "dcd_full",
    "full_upload",
    "gram_sums",
    "held_for",
]


@dataclass(frozen=True, slots=True)
class DCDStats:
    """What a DCD call did: sweeps run, total bit flips, and whether every user converged."""

    sweeps: int
    flips: int
    converged: bool


def _check_csr(indptr: NDArray[np.int64], items: NDArray[np.int64], r: NDArray[np.float64], m: int) -> None:
    if indptr.ndim != 1 or indptr.size < 1 or indptr[0] != 0 or indptr[-1] != items.size:
        raise ValueError("indptr must start at 0 and end at len(items)")
    if np.any(np.diff(indptr) < 0):
        raise ValueError("indptr must be non-decreasing")
    if items.shape != r.shape:
        raise ValueError(f"items and r differ in shape: {items.shape} vs {r.shape}")
    if items.size and (items.min() < 0 or items.max() >= m):
        raise ValueError(f"item index out of range [0, {m})")
    if not np.all(np.isfinite(r)):
        raise ValueError("ratings must be finite")


def _row_of(indptr: NDArray[np.int64]) -> NDArray[np.int64]:
    counts = np.diff(indptr)
    return np.repeat(np.arange(counts.size, dtype=np.int64), counts)


def _scatter_rows(
    index: NDArray[np.int64], weights: NDArray[np.float64], cols: NDArray[Any], size: int
) -> NDArray[np.float64]:
    """out[j, k] = Σ_{e : index[e] = j} weights[e] · cols[k, e], shape (size, f); one bincount per
    column (a loop over bits, not over entries)."""
    out = np.empty((size, cols.shape[0]))
    for k in range(cols.shape[0]):
        out[:, k] = np.bincount(index, weights=weights * cols[k], minlength=size)
    return out


def inner_products(
    indptr: NDArray[np.int64], items: NDArray[np.int64], B: NDArray[np.int8], D: NDArray[np.int8]
) -> NDArray[np.int32]:
    """s_e = d_{items[e]}ᵀ b_{user(e)} for every CSR entry e, as exact integers."""
    rows = _row_of(indptr)
    f = B.shape[1]
    Dp = pack_signs(D)
    Bp = pack_signs(B)
    # d·b = f − 2·Hamming(d, b): XOR + popcount over the packed words, exact.
    ham = np.zeros(items.size, dtype=np.int32)
    for w in range(Dp.shape[0]):
        ham += np.bitwise_count(Dp[w, items] ^ Bp[w, rows])
    return (f - 2 * ham).astype(np.int32)


def _codes_of_batch(
    indptr: NDArray[np.int64], B: NDArray[np.int8], D: NDArray[np.int8]
) -> tuple[NDArray[np.int8], NDArray[np.int8], int, int, int]:
    """``B`` (n, f) and ``D`` (m, f) as arrays, checked against each other and the batch's ``indptr``;
    returns them with n, f and m."""
    B = np.asarray(B)
    D = np.asarray(D)
    n, f = B.shape
    m, f2 = D.shape
    if f != f2:
        raise ValueError(f"user codes have {f} bits but item codes have {f2}")
    if indptr.size != n + 1:
        raise ValueError(f"indptr has {indptr.size} entries for {n} users")
    return B, D, n, f, m


def dcd_update(
    indptr: NDArray[np.int64],
    items: NDArray[np.int64],
    r: NDArray[np.float64],
    B: NDArray[np.int8],
    D: NDArray[np.int8],
    lam: float,
    *,
    max_sweeps: int = 20,
) -> tuple[NDArray[np.int8], DCDStats]:
    """DCD update of user codes with item codes fixed (LightFR eq. 9–10); eq. 19 when ``lam == 0``.

    Parameters
    ----------
    indptr, items, r : CSR batch of users (see module docstring); r normalised to [0, 1].
    B : (n, f) int8 ±1 current user codes (not modified).
    D : (m, f) int8 ±1 item codes.
    lam : balance weight λ ≥ 0.
    max_sweeps : cap on full sweeps over the f bits; sweeping stops earlier once no bit flips.

    Returns
    -------
    (new B, DCDStats)
    """
    B, D, n, f, m = _codes_of_batch(indptr, B, D)
    if lam < 0 or not np.isfinite(lam):
        raise ValueError(f"lam must be a finite value >= 0, got {lam}")
    if max_sweeps < 1:
        raise ValueError("max_sweeps must be >= 1")
    _check_csr(indptr, items, r, m)
    B = B.astype(np.int8, copy=True)
    counts = np.diff(indptr)
    nonempty = np.flatnonzero(counts)
    starts = indptr[:-1][nonempty]
    # (f, nnz) int8: bit k of every entry's item, one contiguous row per bit.
    Dt = np.ascontiguousarray(D.T)[:, items]
    # s_e = d_iᵀ b_u, kept exact on each flip; |s| ≤ f so int16 holds it for f < 2^15.
    s: NDArray[np.signedinteger[Any]] = inner_products(indptr, items, B, D).astype(np.int16 if f < 2**15 else np.int32)
    # A[u, k] = Σ_i (r_ui − 1/2) d_ik is constant while D is fixed (eq. 9's rating term).
    # Work with z = 2f²·b*_uk = 2f·A_uk − Σ_i (s_i − d_ik b_uk) d_ik − 4λf²·Σ_{k'≠k} b_uk', which has
    # the sign of b* but no divisions: exact whenever ratings and λ are short binary fractions, so
    # b* = 0 (keep the bit) is detected exactly rather than lost to rounding.
    X = 2.0 * f * _scatter_rows(_row_of(indptr), r - 0.5, Dt, n)  # (n, f)
    S = B.sum(axis=1, dtype=np.int64)  # Σ_k b_uk, for the balance term
    bal = 4.0 * lam * f * f
    sd = np.zeros(n, dtype=np.int64)
    total_flips = 0
    sweeps = 0
    converged = False
    while sweeps < max_sweeps:
        sweeps += 1
        sweep_flips = 0
        for k in range(f):
            dk = Dt[k]
            bk = B[:, k].astype(np.int64)
            # Σ_i (s_i − d_ik b_uk) d_ik = Σ_i s_i d_ik − |Ω_u| b_uk  (d_ik² = 1), exact integers.
            if starts.size:
                sd[nonempty] = np.add.reduceat(s * dk, starts, dtype=np.int64)
            z = X[:, k] - (sd - counts * bk) - bal * (S - bk)
            new = np.where(z > 0, 1, np.where(z < 0, -1, bk))
            delta = new - bk  # in {-2, 0, 2}
            flipped = np.flatnonzero(delta)
            if flipped.size:
                sweep_flips += int(flipped.size)
                B[flipped, k] = new[flipped].astype(np.int8)
                S += delta
                s = s + np.repeat(delta.astype(np.int8), counts) * dk
        total_flips += sweep_flips
        if sweep_flips == 0:
            converged = True
            break
    return B, DCDStats(sweeps=sweeps, flips=total_flips, converged=converged)


def fold_in_codes(
    indptr: NDArray[np.int64],
    items: NDArray[np.int64],
    r: NDArray[np.float64],
    D: NDArray[np.int8],
    *,
    max_sweeps: int = 20,
) -> tuple[NDArray[np.int8], DCDStats]:
    """Cold-start codes for new users against fixed item codes (eq. 18–19: DCD without balance).

    Starts from b = sign(Σ_i (r_ui − 1/2) d_i) (the linear part of the loss; +1 where it is 0), so the
    result is deterministic and needs no randomness.

    Cost: O(nnz · f).  Only the codes of the items the users have entries for enter the loss, so the
    problem is solved on that sub-catalogue; the rest of ``D`` is never read or copied.
    """
    n = indptr.size - 1
    m, f = D.shape
    _check_csr(indptr, items, r, m)
    touched, local = np.unique(items, return_inverse=True)
    local = local.astype(np.int64).ravel()
    D_sub = np.asarray(D[touched], dtype=np.int8)
    A = _scatter_rows(_row_of(indptr), r - 0.5, D_sub[local].T, n)
    B0 = np.where(A < 0, -1, 1).astype(np.int8)
    return dcd_update(indptr, local, r, B0, D_sub, 0.0, max_sweeps=max_sweeps)


def item_gradient_sum(
    indptr: NDArray[np.int64],
    items: NDArray[np.int64],
    r: NDArray[np.float64],
    B: NDArray[np.int8],
    D: NDArray[np.int8],
) -> NDArray[np.float64]:
    """Σ over the batch's users of the item gradients ΔD^u (LightFR eq. 12), dense (m, f).

    Δd^u_ik = (r_ui − 1/2 − (s_i − d_ik b_uk)/(2f)) b_uk = (r_ui − 1/2 − s_i/(2f)) b_uk + d_ik/(2f)
    for every entry (rated item or sampled negative) of user u, and 0 for items u has no entry for.
    For one device (n = 1) this is exactly its upload; for a cohort it is the plain (non-secure) sum.
    """
    n, f = B.shape
    m = D.shape[0]
    _check_csr(indptr, items, r, m)
    s = inner_products(indptr, items, B, D)
    resid = r - 0.5 - s / (2.0 * f)
    # Σ_u resid_ui b_u per item; then + (entries of i) · d_i / (2f).
    G = _scatter_rows(items, resid, np.ascontiguousarray(B.T)[:, _row_of(indptr)], m)
    n_entries = np.bincount(items, minlength=m).astype(np.float64)
    G += (n_entries / (2.0 * f))[:, None] * D
    return G


def local_objective(
    items: NDArray[np.int64], r: NDArray[np.float64], b: NDArray[np.int8], D: NDArray[np.int8], lam: float
) -> float:
    """L_u(b) = Σ_i (r_i − sim(b, d_i))² + λ (Σ_k b_k)² for one user (see module docstring)."""
    f = b.size
    sim = 0.5 + (D[items].astype(np.int64) @ b.astype(np.int64)) / (2.0 * f)
    return float(np.sum((r - sim) ** 2) + lam * float(np.sum(b, dtype=np.int64)) ** 2)


def sample_negatives(
    indptr: NDArray[np.int64],
    items: NDArray[np.int64],
    n_items: int,
    per_positive: int,
    rng: np.random.Generator,
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Sample ``per_positive`` unobserved items per observed entry of each user (uniform, with
    replacement, never an item the user has an entry for).

    Returns the negatives in CSR form ``(neg_indptr, neg_items)``.  Users whose entries cover every
    item get no negatives.
    """
    if per_positive < 0:
        raise ValueError("per_positive must be >= 0")
    n = indptr.size - 1
    counts = np.diff(indptr)
    rows = _row_of(indptr)
    seen_keys = np.unique(rows * n_items + items)
    covered = np.bincount(seen_keys // n_items, minlength=n) >= n_items if n_items else np.ones(n, bool)
    want = counts * per_positive
    want[covered] = 0
    neg_indptr = np.concatenate(([0], np.cumsum(want))).astype(np.int64)
    neg_rows = np.repeat(np.arange(n, dtype=np.int64), want)
    neg = rng.integers(0, max(n_items, 1), size=neg_rows.size, dtype=np.int64)
    todo = np.arange(neg.size)
    for _ in range(1000):
        keys = neg_rows[todo] * n_items + neg[todo]
        pos = np.searchsorted(seen_keys, keys)
        pos[pos == seen_keys.size] = 0
        clash = seen_keys[pos] == keys if seen_keys.size else np.zeros(todo.size, bool)
        todo = todo[clash]
        if todo.size == 0:
            break
        neg[todo] = rng.integers(0, n_items, size=todo.size, dtype=np.int64)
    else:  # pragma: no cover - only for users with nearly every item rated
        raise ValueError("could not sample negatives: users have rated almost every item")
    return neg_indptr, neg


def item_codes_sum(
    indptr: NDArray[np.int64],
    items: NDArray[np.int64],
    r: NDArray[np.float64],
    B: NDArray[np.int8],
    D: NDArray[np.int8],
    lam: float,
) -> NDArray[np.int64]:
    """Σ over the batch's users of their locally updated item codes D^u (LightFR eq. 11–12, the
    upload of the Agg_para ablation, eq. 17), as an (m, f) int64 matrix.

    Each user updates, bit by bit, the codes of the items it has entries for:
    d*_ik = (1/f)·Δd^u_ik − 2λ Σ_{k'≠k} d_ik', d_ik ← sign(d*) unless 0, with Δd^u_ik from eq. 12
    recomputed as the item's own bits change; other items keep the global code.  Repeated entries of
    one (user, item) pair count once.  For one device (n = 1) the result is its upload D^u.
    """
    n, f = B.shape
    m = D.shape[0]
    _check_csr(indptr, items, r, m)
    rows = _row_of(indptr)
    # One entry per (user, item): the first occurrence wins (repeats are sampled negatives, r = 0).
    _, first = np.unique(rows * m + items, return_index=True)
    first.sort()
    rows, items, r = rows[first], items[first], r[first]
    E = D[items].astype(np.int64)  # (nnz, f): each entry's private copy of its item's code
    Bu = B[rows].astype(np.int64)
    s = np.einsum("ij,ij->i", E, Bu)
    S = E.sum(axis=1)
    w = 2.0 * f * (r - 0.5)
    bal = 4.0 * lam * f * f
    for k in range(f):
        ek, bk = E[:, k], Bu[:, k]
        # z = 2f²·d*_ik = (2f(r − 1/2) − (s − d_ik b_k)) b_k − 4λf²·Σ_{k'≠k} d_ik'
        z = (w - (s - ek * bk)) * bk - bal * (S - ek)
        new = np.where(z > 0, 1, np.where(z < 0, -1, ek))
        delta = new - ek
        s += delta * bk
        S += delta
        E[:, k] = new
    total = n * D.astype(np.int64)
    change = E - D[items].astype(np.int64)
    ones = np.ones(items.size)
    total += np.rint(_scatter_rows(items, ones, np.ascontiguousarray(change.T), m)).astype(np.int64)
    return total


# -- the all-items objective ---------------------------------------------------------------------
#
# With unobserved weight w0 > 0 and confidence α ≥ 0, a user's loss covers every item, not sampled
# negatives (the implicit-ALS objective, for codes):
#     L_u(b) = Σ_{i∈Ω_u} c (t_ui − x_ui)² + w0 Σ_{i∉Ω_u} (0 − x_ui)²,  x_ui = bᵀd_i / f + β_i,  c = 1 + α,
# with t the (normalised) ratings of the observed items and β_i an item bias the server learns.  The
# sum over all m items needs only the f × f item Gram G_D = Dᵀ D and Dᵀβ, computed once per model
# version, so a sweep costs O(f·|Ω_u| + f²) per user whatever m is.  The coordinate minimiser of
# bit k is b_k = −sign(C_k) with
#     C_k / f = Σ_{i∈Ω} [(c − w0)(s_i d_ik − b_k)/f − (c t_i − (c − w0) β_i) d_ik]
#               + w0 (Σ_{k'≠k} (G_D)_{kk'} b_k') / f + w0 (Dᵀβ)_k,       s_i = d_iᵀ b,
# (b_k kept when C_k = 0).  The item side has the same form with the roles swapped, so the server
# needs only Σ_u of: each device's per-item terms, b bᵀ (giving G_U) and b (see `full_upload`).


def _check_full(w0: float, alpha: float) -> None:
    if not (w0 > 0 and np.isfinite(w0)):
        raise ValueError(f"unobserved weight must be a finite value > 0, got {w0}")
    if not (alpha >= 0 and np.isfinite(alpha)):
        raise ValueError(f"confidence must be a finite value >= 0, got {alpha}")


def dcd_full(
    indptr: NDArray[np.int64],
    items: NDArray[np.int64],
    r: NDArray[np.float64],
    B: NDArray[np.int8],
    D: NDArray[np.int8],
    beta: NDArray[np.float64],
    w0: float,
    alpha: float,
    *,
    max_sweeps: int = 10,
    gram: tuple[NDArray[np.float64], NDArray[np.float64]] | None = None,
) -> tuple[NDArray[np.int8], DCDStats]:
    """DCD of user codes against the all-items objective (see the comment above), item codes and
    biases fixed.  ``r`` holds the observed items' targets only (no sampled negatives).

    ``gram``, if given, is (G_D, Dᵀβ) of the whole catalogue, computed once per model version; ``D``
    and ``beta`` may then hold only the rows of the items in ``items`` (indexed by ``items``), so a
    call costs O(f·|Ω_u| + f²) and never reads the rest of the catalogue (cold-start fold-in).
    """
    B, D, n, f, m = _codes_of_batch(indptr, B, D)
    if beta.shape != (m,):
        raise ValueError(f"item biases must have shape ({m},), got {beta.shape}")
    if max_sweeps < 1:
        raise ValueError("max_sweeps must be >= 1")
    _check_full(w0, alpha)
    _check_csr(indptr, items, r, m)
    c = 1.0 + alpha
    wq = c - w0
    if gram is None:
        Df = D.astype(np.float64)
        G, Dbeta = Df.T @ Df, Df.T @ beta
    else:
        G, Dbeta = gram
        if G.shape != (f, f) or Dbeta.shape != (f,):
            raise ValueError(f"gram must be ((f, f), (f,)) for f = {f}, got {G.shape}, {Dbeta.shape}")
    counts = np.diff(indptr)
    rows = _row_of(indptr)
    nonempty = np.flatnonzero(counts)
    starts = indptr[:-1][nonempty]
    Dt = np.ascontiguousarray(D.T)[:, items]
    s = inner_products(indptr, items, B, D).astype(np.float64)
    wl = c * r - wq * beta[items]
    # Constant part of C_k / f: − Σ_Ω wl d_ik + w0 (Dᵀβ)_k.
    lin = -_scatter_rows(rows, wl, Dt, n) + w0 * Dbeta[None, :]
    Bf = B.astype(np.float64)
    Q = Bf @ G
    diag = np.diag(G)
    nobs = counts.astype(np.float64)
    sd = np.zeros(n)
    total_flips = 0
    sweeps = 0
    converged = False
    while sweeps < max_sweeps:
        sweeps += 1
        sweep_flips = 0
        for k in range(f):
            dk = Dt[k]
            bk = Bf[:, k]
            if starts.size:
                sd[nonempty] = np.add.reduceat(s * dk, starts)
            C = (wq * (sd - nobs * bk) + w0 * (Q[:, k] - diag[k] * bk)) / f + lin[:, k]
            new = np.where(C < 0, 1.0, np.where(C > 0, -1.0, bk))
            delta = new - bk
            flipped = np.flatnonzero(delta)
            if flipped.size:
                sweep_flips += int(flipped.size)
                Bf[flipped, k] = new[flipped]
                Q[flipped] += delta[flipped, None] * G[k][None, :]
                s += delta[rows] * dk
        total_flips += sweep_flips
        if sweep_flips == 0:
            converged = True
            break
    return Bf.astype(np.int8), DCDStats(sweeps=sweeps, flips=total_flips, converged=converged)


def full_upload(
    indptr: NDArray[np.int64],
    items: NDArray[np.int64],
    r: NDArray[np.float64],
    B: NDArray[np.int8] | NDArray[np.float64],
    D: NDArray[np.int8],
    beta: NDArray[np.float64],
    w0: float,
    alpha: float,
) -> dict[str, NDArray[np.float64]]:
    """Σ over the batch's users of what each uploads under the all-items objective.

    Returns the parts of `protocol.families.lightfr.UploadLayout`: "gradient" (m, f) with
    Σ_u (c − w0)(s_ui b_uk − d_ik)/f − (c t_ui − (c − w0) β_i) b_uk over each user's observed items;
    "bias" (m,) Σ_u (c t_ui − (c − w0) s_ui / f); "counts" (m,) how many users have the item (each
    user counts an item once); "gram" (f, f) Σ_u b_u b_uᵀ; "code_sum" (f,) Σ_u b_u.  For one device
    (n = 1) these are its upload.
    """
    n, f = B.shape
    m = D.shape[0]
    _check_full(w0, alpha)
    _check_csr(indptr, items, r, m)
    if beta.shape != (m,):
        raise ValueError(f"item biases must have shape ({m},), got {beta.shape}")
    c = 1.0 + alpha
    wq = c - w0
    rows = _row_of(indptr)
    real = np.issubdtype(np.asarray(B).dtype, np.floating)
    if real:  # real-valued user vectors (asymmetric scoring): s = uᵀd_i in floating point
        s = np.einsum("ef,ef->e", D[items].astype(np.float64), np.asarray(B, dtype=np.float64)[rows])
    else:
        s = inner_products(indptr, items, np.asarray(B, dtype=np.int8), D).astype(np.float64)
    Bt: NDArray[Any] = np.ascontiguousarray(B.T)[:, rows]  # (f, nnz) b_uk of every entry
    wl = c * r - wq * beta[items]
    # Σ wq (s b_k − b_k² d_ik)/f − wl b_k  =  Σ (wq s/f − wl) b_k  −  (wq/f) · (Σ b_k² over entries of i) · d_ik
    grad = _scatter_rows(items, wq * s / f - wl, Bt, m)
    if real:
        grad -= (wq / f) * _scatter_rows(items, np.ones(items.size), Bt * Bt, m) * D
    else:
        grad -= (wq / f) * np.bincount(items, minlength=m)[:, None] * D
    keys = np.unique(rows * m + items)
    Bf = B.astype(np.float64)
    return {
        "gradient": grad,
        "bias": np.bincount(items, weights=c * r - wq * s / f, minlength=m),
        "counts": np.bincount(keys % m, minlength=m).astype(np.float64),
        "gram": Bf.T @ Bf,
        "code_sum": Bf.sum(axis=0),
    }


# -- real-valued user vectors against binary item codes (asymmetric scoring) --------------------
#
# With ``query_planes`` P >= 1 the all-items objective keeps the item codes binary but solves the
# user side exactly: u minimises L_u above with x_ui = uᵀd_i / f + β_i over real u, plus a ridge term
# reg·‖u‖² / f², i.e. (in units of f²)
#     (w0 G_D + (c − w0) D_Ωᵀ D_Ω + reg I) u = f (Σ_{i∈Ω} (c t_i − (c − w0) β_i) d_i − w0 Dᵀβ),
# and is then quantized to u ≈ Δ·q with q odd integers in [−(2^P − 1), 2^P − 1], which is a sum of P
# ±1 planes q = Σ_p 2^p c_p: qᵀd = Σ_p 2^p (f − 2·Hamming(c_p, d)), XOR + popcount per plane.  The
# item side keeps the form of `full_upload` with b replaced by the quantized u (b_k² = 1 becomes
# u_k²), so the server's step (`agg_server.strategy.lightfr.agg_full`) is unchanged.


def ridge_users(
    indptr: NDArray[np.int64],
    items: NDArray[np.int64],
    r: NDArray[np.float64],
    D: NDArray[np.int8],
    beta: NDArray[np.float64],
    w0: float,
    alpha: float,
    reg: float,
    *,
    gram: tuple[NDArray[np.float64], NDArray[np.float64]] | None = None,
    budget: int = 1 << 22,
) -> NDArray[np.float64]:
    """The exact real-valued user vectors of the all-items objective with a ridge term (see the comment
    above), item codes and biases fixed; (n, f) float64.

    ``gram`` is (G_D, Dᵀβ) of the whole catalogue when ``D``/``beta`` hold only the touched rows (as in
    `dcd_full`).  Users are solved in chunks of similar rating counts, each chunk one batched
    ``np.linalg.solve`` over at most ``budget`` padded floats; no Python loop over users or ratings.
    """
    D = np.asarray(D)
    m, f = D.shape
    n = indptr.size - 1
    if beta.shape != (m,):
        raise ValueError(f"item biases must have shape ({m},), got {beta.shape}")
    if not (reg > 0 and np.isfinite(reg)):
        raise ValueError(f"user ridge weight must be a finite value > 0, got {reg}")
    _check_full(w0, alpha)
    _check_csr(indptr, items, r, m)
    c = 1.0 + alpha
    wq = c - w0
    Df = D.astype(np.float64)
    if gram is None:
        G, Dbeta = Df.T @ Df, Df.T @ beta
    else:
        G, Dbeta = gram
        if G.shape != (f, f) or Dbeta.shape != (f,):
            raise ValueError(f"gram must be ((f, f), (f,)) for f = {f}, got {G.shape}, {Dbeta.shape}")
    rows = _row_of(indptr)
    wl = c * r - wq * beta[items]
    rhs = f * (_scatter_rows(rows, wl, np.ascontiguousarray(Df.T)[:, items], n) - w0 * Dbeta[None, :])
    base = w0 * G + reg * np.eye(f)
    deg = np.diff(indptr)
    order = np.argsort(deg, kind="stable")
    U = np.zeros((n, f))
    start = 0
    while start < n:  # chunks of users of similar length
        ahead = deg[order[start : start + 4096]]
        padded = np.maximum(ahead, 1) * np.arange(1, ahead.size + 1) * f
        size = max(1, int(np.searchsorted(padded, budget, side="right")))
        who = order[start : start + size]
        L = int(deg[who].max())
        A = np.broadcast_to(base, (who.size, f, f)).copy()
        if L:
            pos = indptr[who][:, None] + np.arange(L)[None, :]
            live = np.arange(L)[None, :] < deg[who][:, None]
            P = Df[items[np.where(live, pos, 0)]] * live[..., None]  # (B, L, f), zero padding
            A += wq * np.matmul(P.transpose(0, 2, 1), P)
        U[who] = np.linalg.solve(A, rhs[who][..., None])[..., 0]
        start += who.size
    return U


def quantize_planes(U: NDArray[np.float64], planes: int) -> tuple[NDArray[np.int16], NDArray[np.float64]]:
    """Each row u of ``U`` as Δ·q with q odd integers in [−(2^P − 1), 2^P − 1] (P = ``planes``) and a
    per-row scale Δ > 0: q is the nearest odd multiple of a step for the best of a few candidate steps
    (least squared error), and Δ the least-squares scale for that q.  Returns (q (n, f) int16, Δ (n,)).
    `snap_scale` then rounds Δ to what the device's integer score can hold."""
    if not 1 <= planes <= 8:
        raise ValueError(f"planes must be in [1, 8], got {planes}")
    U = np.asarray(U, dtype=np.float64)
    top = 2**planes - 1
    rms = np.sqrt(np.mean(U * U, axis=1, keepdims=True))
    rms = np.where(rms > 0, rms, 1.0)
    best_q = np.ones(U.shape, dtype=np.int16)
    best_err = np.full(U.shape[0], np.inf)
    for factor in (1.0,) if planes == 1 else (0.5, 0.75, 1.0, 1.5, 2.0, 3.0):
        step = rms * (factor / max(top / 2.0, 1.0))
        q = np.clip(2.0 * np.floor(U / step / 2.0) + 1.0, -top, top)
        a = np.sum(U * q, axis=1) / np.sum(q * q, axis=1)
        err = np.sum((U - a[:, None] * q) ** 2, axis=1)
        better = err < best_err
        best_q[better] = q[better].astype(np.int16)
        best_err[better] = err[better]
    qf = best_q.astype(np.float64)
    scale = np.sum(U * qf, axis=1) / np.sum(qf * qf, axis=1)
    flip = scale < 0  # cannot happen for the nearest odd multiple, kept for safety
    best_q[flip] = -best_q[flip]
    return best_q, np.where(np.abs(scale) > 0, np.abs(scale), 1e-300)


#: s of the asymmetric integer score S = a_u·qᵀd + 2^s·level (see `snap_scale`).
LEVEL_SHIFT = 8


def snap_scale(scale: NDArray[np.float64], hamming_weight: int) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
    """The integer user weights a = max(1, round(2^s·B·Δ/2)) and the scales Δ' = 2a/(2^s·B) they stand
    for (B = ``hamming_weight``, s = `LEVEL_SHIFT`).

    Items are ranked by Δ'·qᵀd/f + β_i with β_i = (level_i − 128)·2/(f·B)
    (`protocol.families.lightfr.bias_from_levels`); multiplied by 2^(s−1)·f·B that is
    a·qᵀd + 2^s·level_i − 2^(s+7), so the integer S = a·qᵀd + 2^s·level ranks exactly like the real
    score of the snapped vector Δ'·q, which is what the device trains and uploads with.
    """
    if hamming_weight < 1:
        raise ValueError(f"hamming weight must be >= 1, got {hamming_weight}")
    sc = np.asarray(scale, dtype=np.float64)
    if not np.all(np.isfinite(sc) & (sc > 0)):
        raise ValueError("user scales must be finite and > 0")
    a = np.maximum(1, np.rint(sc * (2**LEVEL_SHIFT) * hamming_weight / 2.0)).astype(np.int64)
    return a, 2.0 * a / (2**LEVEL_SHIFT * hamming_weight)


def sign_planes(q: NDArray[np.integer], planes: int) -> NDArray[np.int8]:
    """The P ±1 planes c_p of odd integers q in [−(2^P − 1), 2^P − 1]: q = Σ_p 2^p c_p; (P, n, f) int8.

    With v = (q + 2^P − 1)/2 in [0, 2^P − 1], c_p = 2·(bit p of v) − 1.
    """
    top = 2**planes - 1
    qi = np.asarray(q, dtype=np.int64)
    if not 1 <= planes <= 8:
        raise ValueError(f"planes must be in [1, 8], got {planes}")
    if np.any(np.abs(qi) > top) or np.any(qi % 2 == 0):
        raise ValueError(f"q must hold odd integers in [-{top}, {top}]")
    v = (qi + top) // 2
    return np.stack([(((v >> p) & 1) * 2 - 1).astype(np.int8) for p in range(planes)])


#: Codes per chunk of `gram_sums`: each sum a chunk's float32 product forms stays an integer below 2^24.
_GRAM_ROWS = 1 << 14


def gram_sums(
    words: NDArray[np.uint64], f: int, levels: NDArray[np.uint8] | None
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """(DᵀD (f, f), Dᵀ(level − 128) (f,)) of the item codes D packed in ``words`` (w, m): what the item Gram
    of the all-items objective is made of (zeros for the second without levels).

    One pass over the packed codes, `_GRAM_ROWS` items at a time unpacked to float32 (the ±1 matrix is never
    held whole).  Each chunk's BLAS products form integers below 2^24 in magnitude (at most 2^14 rows of ±1,
    or of ±1 times at most 128), hence exact, and their float64 sums are exact too: the result does not
    depend on the chunking."""
    m = words.shape[1]
    G = np.zeros((f, f))
    Dl = np.zeros(f)
    buf = np.empty((min(m, _GRAM_ROWS), f), np.float32)
    for s in range(0, m, _GRAM_ROWS):
        c = buf[: min(_GRAM_ROWS, m - s)]
        c[...] = unpack_signs(words[:, s : s + _GRAM_ROWS], f)
        G += c.T @ c
        if levels is not None:
            Dl += np.subtract(levels[s : s + _GRAM_ROWS], LEVEL_CENTER, dtype=np.float32) @ c
    return G, Dl


def held_for(cache: tuple[Any, ...] | None, *keys: object) -> tuple[Any, ...] | None:
    """What ``cache`` holds after its keys if they are ``keys`` (the same objects), else None: a cache kept
    beside the codes (and levels) it was made from is never used for others, with no lock."""
    n = len(keys)
    return cache[n:] if cache is not None and all(a is b for a, b in zip(cache[:n], keys, strict=True)) else None
