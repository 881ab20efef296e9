"""The batched form of the per-device LightFR and MF kernels, for simulation: what many devices compute
in one round, each on its own ratings, written once for a whole cohort (the simulator's cohorts,
`fedsim.private.cohorts`, and `fedsim.federation.lightfr` call these; a real device runs the per-device path of
`device_sdk.models.LightFRModel.fit_local` / `device_sdk.mf.MFModel.local_update` and
`device_sdk.training.local_round`).

Invariants:
- A cohort is a CSR batch of devices (``indptr`` (n + 1,) int64, one row per device) or per-entry owner
  rows (``owner``, the row of each entry, non-decreasing); entries hold ``items`` (int64) and
  ``targets`` (float64, normalised as the device normalises them).
- Each device's result is its own: nothing mixes devices except a sum the caller asks for (the sum a
  secure aggregation would release), and a device's share of that sum is the upload it would make.
- Pure numpy kernels: arrays in, new arrays out (or added into an argument named ``out``); randomness
  only from the generator and `protocol.samplers.NoiseStream` passed in; no logging, no config.
- The rounding coins are read device by device in batch order (then part by part under the all-items
  objective); every function here that rounds says which words it reads.  Where a device rounds a
  dense vector, the batched form rounds its non-zero coordinates only: a zero rounds to 0 whatever its
  coin (`protocol.quantization.stochastic_round`), so the law of the sum is the devices' law.
- Random choices (θ ratings, negatives) follow the device's law, not its draws: the cohort reads one
  generator for all its devices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from device_sdk.lightfr import LEVEL_SHIFT, inner_products, quantize_planes, ridge_users, snap_scale
from protocol.quantization import QuantizationConfig, clip_l2, stochastic_round
from protocol.samplers import NoiseStream

__all__ = [
    "csr_indptr",
    "cap_examples",
    "unique_examples",
    "merge_negatives",
    "entry_gradients",
    "device_item_sums",
    "add_rounded_rows",
    "snapped_vectors",
    "refreshed_vectors",
    "plane_vectors",
    "full_entry_terms",
    "full_clip_factors",
    "add_rounded_full_parts",
    "mf_gradient_rows",
]


def csr_indptr(counts: NDArray[np.int64]) -> NDArray[np.int64]:
    """The CSR row pointer (n + 1,) of rows with ``counts`` entries."""
    return np.concatenate(([0], np.cumsum(counts))).astype(np.int64)


def cap_examples(
    indptr: NDArray[np.int64],
    items: NDArray[np.int64],
    targets: NDArray[np.float64],
    cap: int,
    rng: np.random.Generator,
) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.float64], NDArray[np.int64]]:
    """θ = ``cap`` of each device's ratings, uniformly without replacement, in their original order (the
    device's ``rng.choice(k, θ, replace=False)`` sorted, `LightFRModel.local_update`): one random key per
    rating from ``rng`` (``rng.random(items.size)``, drawn only when ``cap`` > 0), the θ smallest kept.

    Returns (indptr, items, targets, owner) of the kept ratings; ``cap == 0`` keeps every rating.
    """
    counts = np.diff(indptr)
    owner = np.repeat(np.arange(counts.size), counts)
    if not cap:
        return indptr, items, targets, owner
    order = np.lexsort((rng.random(items.size), owner))
    rank = np.arange(items.size) - np.repeat(indptr[:-1], counts)
    keep = np.sort(order[rank < cap])
    items, targets, owner = items[keep], targets[keep], owner[keep]
    return csr_indptr(np.bincount(owner, minlength=counts.size)), items, targets, owner


def unique_examples(
    items: NDArray[np.int64], targets: NDArray[np.float64], owner: NDArray[np.int64], n_devices: int, n_items: int
) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.float64], NDArray[np.int64]]:
    """Each device's items once, sorted, with the target of its first entry (the device's ``np.unique(items,
    return_index=True)`` of the all-items objective, `LightFRModel._fit_full`); (indptr, items, targets,
    owner)."""
    _, first = np.unique(owner * n_items + items, return_index=True)  # sorted by (device, item)
    items, targets, owner = items[first], targets[first], owner[first]
    return csr_indptr(np.bincount(owner, minlength=n_devices)), items, targets, owner


def merge_negatives(
    indptr: NDArray[np.int64],
    items: NDArray[np.int64],
    targets: NDArray[np.float64],
    neg_ptr: NDArray[np.int64],
    neg: NDArray[np.int64],
) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.float64]]:
    """Each device's ratings followed by its negatives (r = 0), the device's example order
    (`LightFRModel._user_csr`); (indptr, items, targets) of the merged CSR batch."""
    n = indptr.size - 1
    counts = np.diff(indptr) + np.diff(neg_ptr)
    out_ptr = csr_indptr(counts)
    pos_owner = np.repeat(np.arange(n), np.diff(indptr))
    neg_owner = np.repeat(np.arange(n), np.diff(neg_ptr))
    pos_slot = out_ptr[pos_owner] + (np.arange(items.size) - indptr[pos_owner])
    neg_slot = out_ptr[neg_owner] + np.diff(indptr)[neg_owner] + (np.arange(neg.size) - neg_ptr[neg_owner])
    all_items = np.empty(out_ptr[-1], dtype=np.int64)
    all_r = np.zeros(out_ptr[-1])
    all_items[pos_slot], all_items[neg_slot] = items, neg
    all_r[pos_slot] = targets
    return out_ptr, all_items, all_r


def entry_gradients(
    indptr: NDArray[np.int64],
    items: NDArray[np.int64],
    r: NDArray[np.float64],
    B: NDArray[np.int8],
    D: NDArray[np.int8],
) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.float64]]:
    """Per entry e of device u and item i, the eq. 12 row Δd^u_i = (r − 1/2 − s/(2f))·b_u + d_i/(2f) (the
    terms `device_sdk.lightfr.item_gradient_sum` adds up): (items, owner, rows (nnz, f))."""
    f = B.shape[1]
    s = inner_products(indptr, items, B, D)
    resid = r - 0.5 - s / (2.0 * f)
    owner = np.repeat(np.arange(indptr.size - 1), np.diff(indptr))
    rows = resid[:, None] * B[owner].astype(np.float64) + D[items].astype(np.float64) / (2.0 * f)
    return items, owner, rows


def device_item_sums(
    owner: NDArray[np.int64], items: NDArray[np.int64], rows: NDArray[np.float64], n_items: int, epochs: int = 1
) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.float64]]:
    """Each device's upload in sparse form: its gradient rows summed per item over its entries and divided
    by ``epochs`` (the device averages its epochs' gradients).  Returns (owner, item, values (k, f)),
    sorted by (owner, item): the non-zero rows of each device's dense (m, f) upload."""
    keys, inv = np.unique(owner * n_items + items, return_inverse=True)
    vals = np.zeros((keys.size, rows.shape[1]))
    np.add.at(vals, inv, rows)
    vals /= epochs
    return keys // n_items, keys % n_items, vals


def add_rounded_rows(
    out: NDArray[np.int64],
    owner: NDArray[np.int64],
    item: NDArray[np.int64],
    values: NDArray[np.float64],
    alive: NDArray[np.bool_],
    quantization: QuantizationConfig,
    coins: NoiseStream | None,
    *,
    streams: Sequence[NoiseStream] | None = None,
) -> None:
    """Add to ``out`` (m·f,) each ``alive`` device's sparse upload (``owner``/``item``/``values`` of
    `device_item_sums`, devices 0 … alive.size − 1) clipped to C with `clip_l2` and rounded at scale 2^s,
    as `protocol.quantization.quantize` treats the device's dense vector.

    Coins: from ``coins``, the alive devices' k·f non-zero values in device order, row-major (the words
    one `stochastic_round` per device would read, read at once).  With ``streams`` (one `NoiseStream` per
    device, ``coins`` unused) each device instead reads the m·f words of its own dense `quantize`, alive
    or not, and rounds coordinate x with word x: its upload's non-zero part bit for bit, up to the clip
    factor (its norm is summed over the non-zero values, which can differ from the dense sum by an ulp).
    """
    f = values.shape[1]
    bounds = np.searchsorted(owner, np.arange(alive.size + 1))
    cols = np.arange(f)
    scaled: list[NDArray[np.float64]] = []
    where: list[NDArray[np.int64]] = []
    for j in range(alive.size) if streams is not None else np.flatnonzero(alive).tolist():
        words = streams[j].uniform(out.size) if streams is not None else None
        a, b = bounds[j], bounds[j + 1]
        if a == b or not alive[j]:
            continue
        clipped, _ = clip_l2(values[a:b], quantization.clip_norm)
        v = (clipped * quantization.scale).ravel()
        idx = (item[a:b, None] * f + cols).ravel()
        if words is None:
            scaled.append(v)
            where.append(idx)
        else:  # one row per (device, item): the indices of one device are distinct, so fancy += is exact
            low = np.floor(v)
            out[idx] += low.astype(np.int64) + (words[idx] < v - low).astype(np.int64)
    if scaled:
        if coins is None:
            raise ValueError("rounding without device streams needs coins")
        np.add.at(out, np.concatenate(where), stochastic_round(np.concatenate(scaled), coins))


def snapped_vectors(U: NDArray[np.float64], planes: int, hamming_weight: int) -> NDArray[np.float64]:
    """Δ'·q: each device's vector u as ``planes`` odd-integer planes with its scale snapped to the integer
    score's grid (`quantize_planes`, `snap_scale`), what a device of asymmetric scoring trains and
    uploads with (`LightFRModel._solve_vector`)."""
    q, scale = quantize_planes(U, planes)
    return snap_scale(scale, hamming_weight)[1][:, None] * q


def refreshed_vectors(
    indptr: NDArray[np.int64],
    items: NDArray[np.int64],
    targets: NDArray[np.float64],
    D: NDArray[np.int8],
    beta: NDArray[np.float64],
    w0: float,
    alpha: float,
    reg: float,
    planes: int,
    hamming_weight: int,
) -> tuple[NDArray[np.int16], NDArray[np.int64], NDArray[np.float64]]:
    """What every device ranks with after a download: its exact vector against the item codes and biases
    (`device_sdk.lightfr.ridge_users`, ridge ``reg``), kept as ``planes`` planes with the scale snapped to
    the integer score's grid, as `device_sdk.models.LightFRModel` holds it: (odd integers q (n, f),
    integer weights a (n,), Δ'·q (n, f))."""
    U = ridge_users(indptr, items, targets, D, beta, w0, alpha, reg)
    q, scale = quantize_planes(U, planes)
    a, snapped = snap_scale(scale, hamming_weight)
    return q, a, snapped[:, None] * q.astype(np.float64)


def plane_vectors(q: NDArray[np.integer], weight: NDArray[np.integer], hamming_weight: int) -> NDArray[np.float64]:
    """Δ'·q of vectors held as odd integers q (n, f) and integer weights a (n,): Δ' = 2a / (2^s·B)."""
    delta = 2.0 * np.asarray(weight, dtype=np.float64) / (2**LEVEL_SHIFT * hamming_weight)
    return delta[:, None] * np.asarray(q, dtype=np.float64)


# -- the all-items objective: `device_sdk.lightfr.full_upload` one device at a time, clipped -----------


def full_entry_terms(
    items: NDArray[np.int64],
    owner: NDArray[np.int64],
    targets: NDArray[np.float64],
    Bf: NDArray[np.float64],
    Df: NDArray[np.float64],
    s_e: NDArray[np.float64],
    beta: NDArray[np.float64],
    w0: float,
    alpha: float,
    *,
    real: bool,
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Per kept entry (device u, item i, s = b_uᵀd_i): the gradient row (w_q s/f − w_l)·b − (w_q/f)·d_i and
    the bias term c·t − w_q s/f of `device_sdk.lightfr.full_upload` (c = 1 + α, w_q = c − w0,
    w_l = c·t − w_q β_i); ``real`` (asymmetric scoring, a vector u in place of b) makes the row's last
    term (w_q/f)·u∘u∘d_i.  Returns (rows (nnz, f), bias (nnz,))."""
    f = Bf.shape[1]
    c = 1.0 + alpha
    wq = c - w0
    coef = wq * s_e / f - (c * targets - wq * beta[items])
    if real:
        grad = coef[:, None] * Bf[owner] - (wq / f) * Bf[owner] ** 2 * Df[items]
    else:
        grad = coef[:, None] * Bf[owner] - (wq / f) * Df[items]
    return grad, c * targets - wq * s_e / f


def full_clip_factors(
    owner: NDArray[np.int64],
    grad: NDArray[np.float64],
    bias: NDArray[np.float64],
    Bf: NDArray[np.float64],
    clip_norm: float,
    share: float,
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Each device's clip factors (counts, rest) of `protocol.families.lightfr.clip_parts` and the
    quantizer's clip to C, from the norms in closed form: the counts part is k ones (k kept items), the
    rest its rows, bias terms, b bᵀ/f and b/f (‖b bᵀ/f‖ = ‖b‖²/f, ‖b/f‖ = ‖b‖/f).  With a counts share
    s > 0 the counts go to √s·C and the rest to √(1 − s)·C; else the whole to C.  Devices are the rows
    of ``Bf``."""
    n, f = Bf.shape
    k = np.bincount(owner, minlength=n).astype(np.float64)
    sq = np.einsum("ij,ij->i", grad, grad) + bias * bias
    n2 = np.einsum("ij,ij->i", Bf, Bf)  # ‖b‖² (= f for a ±1 code)
    rest2 = np.bincount(owner, weights=sq, minlength=n).astype(np.float64) + (n2 * n2 + n2) / f**2
    if share > 0:
        fc = np.minimum(1.0, math.sqrt(share) * clip_norm / np.sqrt(np.maximum(k, 1.0)))
        fr = np.minimum(1.0, math.sqrt(1.0 - share) * clip_norm / np.sqrt(rest2))
    else:
        fc = fr = np.minimum(1.0, clip_norm / np.sqrt(rest2 + k))
    return fc, fr


def add_rounded_full_parts(
    out: dict[str, NDArray[np.float64]],
    items: NDArray[np.int64],
    owner: NDArray[np.int64],
    grad: NDArray[np.float64],
    bias: NDArray[np.float64],
    Bf: NDArray[np.float64],
    factors: tuple[NDArray[np.float64], NDArray[np.float64]],
    alive: NDArray[np.bool_],
    scale: float,
    coins: NoiseStream,
) -> None:
    """Add to ``out`` (the parts of `protocol.families.lightfr.UploadLayout`: "gradient" (m·f,), "bias",
    "counts" (m,), "gram" (f, f), "code_sum" (f,)) every ``alive`` device's upload, each part scaled by
    its clip factor (``factors`` = (counts, rest) of `full_clip_factors`), times 2^s = ``scale``, and
    stochastically rounded.  Coins are read part by part over the alive devices: gradient rows, bias
    terms, counts, b bᵀ/f (512 devices at a time), b/f."""
    fc, fr = factors
    f = Bf.shape[1]
    m = out["counts"].size
    sel = alive[owner]
    e_items, e_own = items[sel], owner[sel]
    q = stochastic_round(grad[sel] * (fr[e_own] * scale)[:, None], coins)
    idx = (e_items[:, None] * f + np.arange(f)).ravel()
    out["gradient"] += np.bincount(idx, weights=q.ravel().astype(np.float64), minlength=m * f)
    out["bias"] += np.bincount(e_items, weights=stochastic_round(bias[sel] * fr[e_own] * scale, coins), minlength=m)
    out["counts"] += np.bincount(e_items, weights=stochastic_round(fc[e_own] * scale, coins), minlength=m)
    live = np.flatnonzero(alive)
    for g in range(0, live.size, 512):  # b bᵀ/f of 512 devices at a time (512·f² values)
        j = live[g : g + 512]
        outer = Bf[j, :, None] * Bf[j, None, :] * (fr[j] * scale / f)[:, None, None]
        out["gram"] += stochastic_round(outer, coins).sum(axis=0)
    out["code_sum"] += stochastic_round(Bf[live] * (fr[live] * scale / f)[:, None], coins).sum(axis=0)


# -- MF -------------------------------------------------------------------------------------------


def mf_gradient_rows(
    owner: NDArray[np.int64],
    items: NDArray[np.int64],
    r: NDArray[np.float64],
    U: NDArray[np.float64],
    V: NDArray[np.float64],
) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.float64]]:
    """Each device's V-gradient −2(r − u·v_i)·u of its examples (kept ratings, then negatives at r = 0),
    summed per (device, item) in example order (the rows of `device_sdk.mf`'s dense upload that are not
    zero); (owner, item, values (k, f)) sorted by (owner, item).  ``U`` holds the devices' user vectors,
    ``V`` the item factors the devices hold."""
    m, f = V.shape
    w = -2.0 * (r - np.einsum("ij,ij->i", U[owner], V[items]))
    keys, inv = np.unique(owner * m + items, return_inverse=True)
    inv = inv.ravel()
    vals = np.empty((keys.size, f))
    g_rows = w[:, None] * U[owner]
    for k in range(f):  # loop over the small rank only
        vals[:, k] = np.bincount(inv, weights=g_rows[:, k], minlength=keys.size)
    return keys // m, keys % m, vals
