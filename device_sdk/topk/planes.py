"""Asymmetric (bit-plane) top-k: a user vector held as P packed ±1 planes against the Hamming item codes,
scored a·Σ_p 2^p·(f − 2·Hamming(c_p, d_i)) + 2^s·level_i (`plane_scores`).  One user's scan, the batch's
scan on the high planes' byte bound, and the plane substring search over the Hamming substring tables.

Invariants:
- The searches count on the weighted distance W = Σ_p 2^p·H_p (a small integer): with the item term
  written q = 2^s·(L − level) // 2a in whole units of 2a, a threshold t on v = W + q keeps exactly
  the items of cost 2a·W + 2^s·(L − level) <= 2a·t + 2a − 1, and t only falls.
- Candidates hold every item at or below the kk-th smallest cost (ties included); `_plane_select`
  then cuts them to the same canonical set whichever path found them, so a batch row equals the
  single-user search.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from device_sdk.topk.scan import _FIRST_BLOCK, hamming_distances
from device_sdk.topk.select import _check_levels, _row_kth
from device_sdk.topk.substring import (
    _MIH_FALLBACK,
    _MIH_ROUNDS,
    _SUB_BITS,
    _probe_group,
    _radii,
    _round_end,
    _substring_buffers,
)

if TYPE_CHECKING:
    from device_sdk.topk.index import HammingIndex

# Plane scans of a batch: user-item pairs per block (the XOR buffer, 8 bytes a pair, stays in L2), and
# items per user row in a block, at least (numpy's inner loop runs once per row).
_PLANE_PAIRS = 1 << 17
# Items of a plane scan's head, whose exact costs set the first thresholds.
_PLANE_HEAD = 2048
# Catalogues from which one user's plane search takes the high-plane byte bound when it saves a popcount
# (below, the single-user scan's fewer fixed costs win: 10^5 items, P = 3, 0.34 vs 0.46 ms; 10^6, 4.5 vs 3.5).
_PLANE_BOUND_MIN = 1 << 19
# Users per scan of a batched plane search (see `HammingIndex.search_planes_batch`).
_PLANE_GROUP = 16
# Items per block of a single-user plane scan (its per-block calls weigh more than the cache misses).
_PLANE_ITEMS = 1 << 18
_PLANE_ROW_ITEMS = 256
# One plane user's search takes the substring tables from 2^18 items: the plane scan costs about 2x the
# Hamming one, so they pay earlier (2^18 random items, k = 10, 60 users: 0.46-0.71 ms against 0.72-1.18 ms
# for the scan; 1.5x10^5: 0.66 against 0.69; 10^5: 0.42 against 0.30).  A batch of plane users takes
# them from _MIH_MIN, where it was measured.
_PLANE_MIH_MIN = 1 << 18
_PLANE_MIH_SAMPLE = 2048  # the plane substring search's even sample of the catalogue (its first T, a bound)
_PLANE_MIH_MARGIN = 1.0  # its first T: where the fit puts the catalogue's (margin·kk)-th value
_PLANE_MIH_STEP = 0.25  # T's first growth step, in the sample's standard deviations
_BYTE_VALUES = np.arange(256, dtype=np.uint64)


def plane_scores(
    plane_words: NDArray[np.uint64],
    item_words: NDArray[np.uint64],
    bits: int,
    user_weight: int,
    levels: NDArray[np.uint8] | None = None,
    level_shift: int = 8,
) -> NDArray[np.int64]:
    """The asymmetric integer score of one user against every item: with the user's vector held as P
    packed ±1 planes c_p (``plane_words`` (P, w), plane p weighing 2^p; see
    `device_sdk.lightfr.sign_planes`),
        S_i = a·Σ_p 2^p·(f − 2·Hamming(c_p, d_i)) + 2^s·level_i,
    a = ``user_weight`` (`device_sdk.lightfr.snap_scale`), s = ``level_shift``; XOR + popcount per plane
    and word, (m,) int64.  Higher is better."""
    P, w = plane_words.shape
    if item_words.shape[0] != w:
        raise ValueError(f"user planes have {w} words, item codes have {item_words.shape[0]}")
    if user_weight < 1:
        raise ValueError(f"user weight must be >= 1, got {user_weight}")
    # Σ_p 2^p (f − 2 H_p) = f (2^P − 1) − 2 Σ_p 2^p H_p; the weighted distance fits the uint16 scan buffer
    # while f (2^P − 1) < 2^16, so the only wide pass is the final one.
    wide: type[np.integer[Any]] = np.uint16 if bits * (2**P - 1) < 1 << 16 else np.int64
    dist: NDArray[np.integer[Any]] = hamming_distances(plane_words[0], item_words).astype(wide, copy=False)
    for p in range(1, P):
        dist += np.left_shift(hamming_distances(plane_words[p], item_words).astype(wide, copy=False), wide(p))
    top = user_weight * bits * (2**P - 1) + (255 << level_shift)
    out_t: type[np.integer[Any]] = np.int32 if top < 1 << 31 else np.int64
    acc: NDArray[np.integer[Any]] = dist.astype(out_t)
    acc *= -2 * user_weight
    acc += user_weight * bits * (2**P - 1)
    if levels is not None:
        lv = _check_levels(levels, item_words.shape[1])
        acc += np.left_shift(lv.astype(out_t), level_shift)
    return acc.astype(np.int64, copy=False)


def _lift_planes(ix: HammingIndex, a: int, s: int) -> NDArray[np.unsignedinteger[Any]] | None:
    """q_i = 2^s·(L − level_i) // 2a along the scan (None without an item term), kept per thread
    for the last (a, s): a device ranks for one user at a time."""
    bias = ix._bias
    if bias is None:
        return None
    held = getattr(ix._local, "plane_lift", None)
    if held is not None and held[0] == (a, s):
        return held[1]
    segs = getattr(ix._local, "level_runs", None)
    if segs is None:
        # Runs of equal cost term along the (level-sorted) scan: at most 256 of them.
        starts = np.flatnonzero(np.diff(bias, prepend=-1) != 0)
        segs = (bias[starts].astype(np.int64), np.diff(starts, append=bias.size))
        ix._local.level_runs = segs
    qv = (segs[0] << s) // (2 * a)
    top = int(qv[-1]) + ix.f * 255
    ldt = np.uint16 if top < 1 << 16 else np.uint32 if top < 1 << 32 else np.uint64
    lift = np.repeat(qv.astype(ldt), segs[1])
    ix._local.plane_lift = ((a, s), lift)
    return lift


def _plane_distances(
    words: NDArray[np.uint64],
    planes: NDArray[np.uint64],
    start: int,
    stop: int,
    x: NDArray[np.uint64],
    t: NDArray[np.uint8],
    out: NDArray[Any],
) -> NDArray[Any]:
    """W = Σ_p 2^p·Hamming(c_p, d_i) for the items [start, stop) of ``words`` (the (w, m) codes in scan
    order), by Horner's rule from the top plane, into ``out`` (preallocated, wide enough for
    f·(2^P − 1))."""
    size = stop - start
    xs, ts, acc = x[:size], t[:size], out[:size]
    for p in range(planes.shape[0] - 1, -1, -1):
        if p < planes.shape[0] - 1:
            np.left_shift(acc, 1, out=acc)
        for j in range(words.shape[0]):
            np.bitwise_xor(words[j, start:stop], planes[p, j], out=xs)
            if p == planes.shape[0] - 1 and j == 0:
                np.bitwise_count(xs, out=acc)
            else:
                np.add(acc, np.bitwise_count(xs, out=ts), out=acc)
    return acc


def _scan_planes(
    ix: HammingIndex, planes: NDArray[np.uint64], a: int, s: int, kk: int, block: int
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Candidates (item id, exact cost 2a·W + 2^s·(L − level)) holding every item whose cost is at
    most the kk-th smallest over the catalogue (ties included); see `HammingIndex.search_planes`."""
    m, P, f = ix.m, planes.shape[0], ix.f
    block = max(int(block), 1)
    size = min(m, max(block, 4 * kk))
    first = min(size, max(_FIRST_BLOCK, 4 * kk))  # >= kk, since kk <= m
    lift = _lift_planes(ix, a, s)
    wmax = f * (2**P - 1) + (0 if lift is None else int(lift[-1]))
    wdt = np.uint8 if wmax < 1 << 8 else np.uint16 if wmax < 1 << 16 else np.uint32 if wmax < 1 << 32 else np.uint64
    cap = max(size, block)
    held = getattr(ix._local, "plane_buffers", None)
    if held is None or held[0].size < cap or held[2].dtype != wdt:
        held = (np.empty(cap, np.uint64), np.empty(cap, np.uint8), np.empty(cap, wdt), np.empty(cap, np.bool_))
        ix._local.plane_buffers = held
    x, t, wbuf, mask = held
    pos_l: list[NDArray[np.int64]] = []
    val_l: list[NDArray[Any]] = []
    pending, budget, thr = 0, max(8 * kk, 256), -1
    start = 0
    while start < m:
        stop = size if start == 0 else min(start + block, m)
        if lift is not None and start and int(lift[start]) > thr:
            break  # q only grows along the scan and W >= 0: no later item is under the threshold
        wd = _plane_distances(ix._sorted, planes, start, stop, x, t, wbuf)
        if lift is not None:
            np.add(wd, lift[start:stop], out=wd)  # W + q
        if start == 0:
            # The kk-th smallest W + q of the head, by counting (numpy's radix sort of small ints).
            thr = int(np.sort(wd[:first], kind="stable")[kk - 1])
        hit = np.less_equal(wd, thr, out=mask[: stop - start]).nonzero()[0]
        if hit.size:
            val_l.append(wd[hit])
            pos_l.append(hit + start if start else hit)
            pending += hit.size
            if pending > budget:
                pos, val = np.concatenate(pos_l), np.concatenate(val_l)
                thr = min(thr, int(np.partition(val, kk - 1)[kk - 1]))
                keep = (val <= thr).nonzero()[0]
                pos_l, val_l = [pos[keep]], [val[keep]]
                pending = keep.size
                budget = max(budget, 2 * pending)
        start = stop
    pos = pos_l[0] if len(pos_l) == 1 else np.concatenate(pos_l)
    val = (val_l[0] if len(val_l) == 1 else np.concatenate(val_l)).astype(np.int64)
    return _plane_costs(pos, val, a, s, kk, lift, ix._bias, ix._order)


def _plane_costs(
    pos: NDArray[Any],
    val: NDArray[np.int64],
    a: int,
    s: int,
    kk: int,
    lift: NDArray[Any] | _PlaneLift | None,
    bias: NDArray[Any] | None,
    order: NDArray[np.int64] | None,
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Item ids and exact costs of one plane user's candidates, given by scan position and value
    v = W + q (distinct items, holding every item whose v is at most the kk-th smallest); ``bias`` is
    the index's L − level along the scan (None: no item term), ``order`` its scan order (None: the
    identity)."""
    if val.size > 4 * kk + 64:
        keep = (val <= np.partition(val, kk - 1)[kk - 1]).nonzero()[0]
        pos, val = pos[keep], val[keep]
    if lift is None or bias is None:
        cost = 2 * a * val
    else:
        cost = 2 * a * (val - lift[pos]) + (bias[pos].astype(np.int64) << s)
        if cost.size > 4 * kk + 64:
            keep = (cost <= np.partition(cost, kk - 1)[kk - 1]).nonzero()[0]
            pos, cost = pos[keep], cost[keep]
    return (pos.astype(np.int64, copy=False) if order is None else order[pos]), cost


def _substring_planes(
    ix: HammingIndex, planes: NDArray[np.uint64], a: int, s: int, kk: int
) -> tuple[NDArray[np.int64], NDArray[np.int64]] | None:
    """`_scan_planes` by the substring tables (f = 64; see `_SubstringTables`), or None when it gives
    up for the scan.

    W = Σ_p 2^p·Hamming(c, d_p) is the sum over the 4 substrings of W_j(x) = Σ_p 2^p·popcount(x XOR
    d_pj), x the item's substring j, so an item of v = W + q <= T in a group of smallest q q_g has,
    for radii with Σ (r_j + 1) = T − q_g + 1, some substring j with W_j(x) <= r_j: the pigeonhole of
    `_substring_one`, Hamming being P = 1.  Per query, W_j of all 2^16 values x comes from two
    256-entry byte tables; the values up to the largest radius that can be needed are sorted by it,
    so a band r_old < W_j <= r_new of buckets is a slice.  The kk-th value of the scan's first items
    and of an even sample of the catalogue bounds everything (cap); the first T is where a normal fit
    to the sample puts the catalogue's _PLANE_MIH_MARGIN·kk-th value.  Each round probes every live
    group up to T and stops once >= kk distinct items of v <= T are found; otherwise T jumps to the
    kk-th value of the distinct items found (when there are kk; at most cap), or else grows by a
    step that doubles.  Dense groups are scanned, as in `_substring_one`, and the search gives up
    after _MIH_ROUNDS rounds.  Exactness rests only on the probes' guarantee and the distinct count."""
    tb = ix._substring_tables()
    ng = len(tb.group_q)
    if ng == 0:
        return None
    P = planes.shape[0]
    pw = planes[:, 0]
    words = ix._sorted[0]
    bias = ix._bias
    # q = 2^s·(L − level) // 2a of just the positions read (`_lift_planes` would build it for every
    # item, 0.06 ms at 10^6, whenever a changes, as it does from user to user).
    lift = None if bias is None else _PlaneLift(bias, a, s)
    rmax = _SUB_BITS * (2**P - 1)  # the largest W_j

    def values(lo: int, hi: int) -> NDArray[Any]:
        w = _weigh(pw, words[lo:hi])
        return w if lift is None else w + lift[lo:hi]

    first = _first_threshold(pw, words, lift, values, kk)
    if first is None:
        return None
    top, stop, T, step = first
    gq = [0 if lift is None else int(lift[g0 : g0 + 1][0]) for g0, _ in tb.spans]
    bands = _ByteBands(pw)
    limit = [int(_MIH_FALLBACK * (b - a0)) for a0, b in tb.spans]
    ib, cb, _ = _substring_buffers(ix, max(limit) + 1)
    scanned: list[tuple[int, NDArray[Any]]] = []
    for a0, b in tb.linear:
        if a0 < stop:
            scanned.append((a0, values(a0, min(b, stop))))
    radius = [-1] * (4 * ng)
    spent = [0] * ng
    live = [g for g in range(ng) if gq[g] <= top]  # no item of the others can be wanted
    pos_l: list[NDArray[Any]] = []
    val_l: list[NDArray[Any]] = []

    def fetch(first: NDArray[np.int64], count: NDArray[np.int64], n: int) -> tuple[NDArray[Any], NDArray[Any]]:
        idx, codes = tb.gather(first, count, n, ib, cb)
        return idx, _weigh(pw, codes)

    for _turn in range(_MIH_ROUNDS):
        for g in list(live):
            radii = bands.radii(T - gq[g] + 1, rmax)
            grow = [(4 * g + j, r) for j, r in enumerate(radii) if r > radius[4 * g + j]]
            if not grow:
                continue
            found = tb.probe_buckets([t for t, _ in grow], [bands.band(t % 4, radius[t], r) for t, r in grow])
            state = (radius, spent, limit, live, scanned, stop, values, ix.m)
            if not _probe_group(tb, g, grow, found, fetch, gq[g], lift, top, state, pos_l, val_l):
                return None
        pos, val, hit = _round_end(pos_l, val_l, scanned, top, T, kk, np.int64)
        scanned = []
        pos_l, val_l = [pos], [val]
        if hit is not None:
            return _plane_costs(*hit, a, s, kk, lift, bias, ix._order)
        ids = np.empty(0, np.int64)
        if val.size >= 4 * kk:
            # An item is probed at most 4 times (once more if its group was then scanned), so the 4kk
            # smallest finds mostly hold >= kk distinct items: the kk-th value among them bounds the
            # catalogue's kk-th, and the next round ends there.
            low = np.flatnonzero(val <= np.partition(val, 4 * kk - 1)[4 * kk - 1])
            ids, at = np.unique(pos[low], return_index=True)
        if ids.size >= kk:
            top = int(np.partition(val[low[at]], kk - 1)[kk - 1])  # finds above it are never needed
            keep = np.flatnonzero(val <= top)
            pos_l, val_l = [pos[keep]], [val[keep]]
            T = max(T + 1, top)
        else:
            T, step = T + step, 2 * step
        T = min(T, top)
    return None


def _weigh(pw: NDArray[np.uint64], codes: NDArray[np.uint64]) -> NDArray[np.uint16]:
    """W = Σ_p 2^p·Hamming(c_p, d_i) of f = 64 ``codes`` for the planes' words ``pw`` (P,), by Horner's
    rule from the top plane."""
    P = pw.shape[0]
    acc = np.bitwise_count(codes ^ pw[P - 1]).astype(np.uint16)
    for p in range(P - 2, -1, -1):
        np.add(acc, acc, out=acc)
        np.add(acc, np.bitwise_count(codes ^ pw[p]), out=acc)
    return acc


def _first_threshold(
    pw: NDArray[np.uint64],
    words: NDArray[np.uint64],
    lift: _PlaneLift | None,
    values: Callable[[int, int], NDArray[Any]],
    kk: int,
) -> tuple[int, int, int, int] | None:
    """`_substring_planes`' start: a bound ``top`` on the catalogue's kk-th value v (the kk-th of the
    scan's first items and of an even sample of the catalogue), where the scan would stop at it, the
    first T (where a normal fit to the sample puts the _PLANE_MIH_MARGIN·kk-th value) and T's first
    step; None when the scan would stop before _PLANE_MIH_MIN items (it is then the cheaper search)."""
    m = words.size
    head = min(m, max(_FIRST_BLOCK, 4 * kk))
    top = int(np.partition(values(0, head), kk - 1)[kk - 1])
    sample = np.arange(0, m, max(m // _PLANE_MIH_SAMPLE, 1))
    sv = _weigh(pw, words[sample]).astype(np.int64) + (0 if lift is None else lift[sample])
    if sv.size >= kk:
        top = min(top, int(np.partition(sv, kk - 1)[kk - 1]))
    stop = m if lift is None else lift.stop(top)
    if stop < _PLANE_MIH_MIN:
        return None
    sv = sv[sample < stop]
    mu, sd = float(sv.mean()), float(sv.std())
    z = statistics.NormalDist().inv_cdf(min(_PLANE_MIH_MARGIN * kk / stop, 0.5))
    T = min(max(int(mu + sd * z), 0), top)
    step = max(int(sd * _PLANE_MIH_STEP), 1)
    return top, stop, T, step


def _plane_words(
    words: NDArray[np.uint64],
    planes: NDArray[np.uint64],
    low: int,
    start: int,
    stop: int,
    x: NDArray[np.uint64],
    t: NDArray[Any],
    out: NDArray[Any],
) -> NDArray[Any]:
    """Σ_{p >= low} 2^(p − low)·Hamming(c_up, d_i), (n, stop − start), for every user u of ``planes``
    (n, P, w) and the items [start, stop) of ``words`` (the (w, m) codes in scan order), by Horner's
    rule from the top plane, into the flat buffers ``x`` (XOR), ``t`` (popcounts) and ``out`` (wide
    enough for the sum)."""
    n, P = planes.shape[0], planes.shape[1]
    size = stop - start
    xs, ts, acc = (b[: n * size].reshape(n, size) for b in (x, t, out))
    for p in range(P - 1, low - 1, -1):
        if p < P - 1:
            np.add(acc, acc, out=acc)  # doubling: a shift by a scalar is several times slower in numpy
        for j in range(words.shape[0]):
            np.bitwise_xor(words[j, start:stop], planes[:, p, j : j + 1], out=xs)
            if p == P - 1 and j == 0:
                np.bitwise_count(xs, out=acc)
            else:
                np.add(acc, np.bitwise_count(xs, out=ts), out=acc)
    return acc


def _plane_low(
    words: NDArray[np.uint64], planes: NDArray[np.uint64], low: int, rows: NDArray[np.intp], pos: NDArray[np.intp]
) -> NDArray[np.int64]:
    """Σ_{p < low} 2^p·Hamming(c_up, d_i) for the (row, position) pairs of a few hits (``words`` the
    (w, m) codes in scan order)."""
    acc = np.zeros(pos.size, np.int64)
    for p in range(low):
        for j in range(words.shape[0]):
            h = np.bitwise_count(words[j, pos] ^ planes[rows, p, j])
            acc += h.astype(np.int64) << p
    return acc


def _scan_planes_batch(
    ix: HammingIndex, planes: NDArray[np.uint64], a: NDArray[np.int64], s: int, kk: NDArray[np.int64], block_pairs: int
) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
    """Candidates (row, item id, exact cost 2a_u·W + 2^s·(L − level)) holding, per user, every item
    whose cost is at most its kk-th smallest over the catalogue (ties included).

    Each row's threshold τ_u starts as the kk-th smallest exact cost of the head block and only
    falls (recomputed from the candidates when they pile up).  The rest is scanned in blocks on
    the high planes only: W = 2^l·Wh + Wl with Wh = Σ_{p >= l} 2^(p − l)·H_p and Wl >= 0, l the
    fewest low planes (0 or 1) for Wh to fit one byte (f·(2^(P − l) − 1) < 256; l = 0 and wider
    when not even that fits).  With an item term the codes are scanned by level, highest first, so
    every item of a block starting at cost term lo costs at least 2a_u·2^l·Wh + lo: Wh <=
    ((τ_u − lo) // 2a_u) >> l is necessary, one byte compare per pair; the few hits get their low
    planes (a gather) and their exact costs.  The scan stops once no user can take a later item."""
    n, P, m, f = planes.shape[0], planes.shape[1], ix.m, ix.f
    bias = ix._bias  # the cost term is bias << s: only its values at block starts and hits are widened
    wmax = f * (2**P - 1)
    hdt: type[np.unsignedinteger[Any]]
    if wmax < 1 << 8:
        low, hdt = 0, np.uint8
    elif f * (2 ** (P - 1) - 1) < 1 << 8:
        low, hdt = 1, np.uint8
    else:
        low, hdt = 0, (np.uint16 if wmax < 1 << 16 else np.uint32)
    hmax = f * (2 ** (P - low) - 1)
    wdt: type[np.unsignedinteger[Any]] = np.uint16 if wmax < 1 << 16 else np.uint32
    step = min(m, max(block_pairs // n, _PLANE_ROW_ITEMS))
    first = min(m, max(_PLANE_HEAD, 4 * int(kk.max())))
    x, t, wbuf, hbuf, mask = _plane_batch_buffers(ix, n, first, step, wdt, hdt)
    words = ix._sorted
    a2 = 2 * a
    # Head: every user's threshold, the kk-th smallest exact cost of the first items.
    w0 = _plane_words(words, planes, 0, 0, first, x, t, wbuf)
    c0 = a2[:, None] * w0
    if bias is not None:
        c0 += bias[:first].astype(np.int64) << s
    kmax = int(kk.max())
    head = np.partition(c0, kmax - 1, axis=1)[:, :kmax] if kmax < first else c0
    tau = np.sort(head, axis=1)[np.arange(n), kk - 1]
    r0, p0 = np.nonzero(c0 <= tau[:, None])
    rows_l, pos_l, cost_l = [r0], [p0], [c0[r0, p0]]
    pending, budget = r0.size, max(8 * int(kk.sum()), 256)
    lo, stale, live = -1, True, np.arange(n)
    lim = np.zeros((n, 1), hdt)
    sub = planes
    start = first
    while start < m:
        stop = min(start + step, m)
        if bias is not None and int(bias[start]) << s != lo:
            stale = True
        if stale:
            stale = False
            lo = 0 if bias is None else int(bias[start]) << s
            lim_all = ((tau - lo) // a2) >> low  # floor: negative when even W = 0 costs more than τ
            live = np.flatnonzero(lim_all >= 0)
            if live.size == 0:
                break  # the cost term only grows from here on: no user can take a later item
            sub = planes if live.size == n else planes[live]
            lim = np.minimum(lim_all[live], hmax).astype(hdt)[:, None]
        wh = _plane_words(words, sub, low, start, stop, x, t, hbuf)
        mk = mask[: wh.size].reshape(wh.shape)
        np.less_equal(wh, lim, out=mk)
        hits = mk.ravel().nonzero()[0]
        if hits.size:
            r, c = np.divmod(hits, stop - start)
            rr = live[r]
            pos = c + start
            wd = wh.ravel()[hits].astype(np.int64)
            if low:
                wd = (wd << low) + _plane_low(words, planes, low, rr, pos)
            cost = a2[rr] * wd
            if bias is not None:
                cost += bias[pos].astype(np.int64) << s
            ok = cost <= tau[rr]
            rows_l.append(rr[ok])
            pos_l.append(pos[ok])
            cost_l.append(cost[ok])
            pending += int(ok.sum())
            if pending > budget:
                rows, pos_a, cost_a = (np.concatenate(v) for v in (rows_l, pos_l, cost_l))
                tau = np.minimum(tau, _row_kth(rows, cost_a, kk, n))
                keep = cost_a <= tau[rows]
                rows_l, pos_l, cost_l = [rows[keep]], [pos_a[keep]], [cost_a[keep]]
                pending = int(keep.sum())
                budget = max(budget, 2 * pending)
                stale = True
        start = stop
    rows, pos, cost = (np.concatenate(v) for v in (rows_l, pos_l, cost_l))
    return rows, (pos if ix._order is None else ix._order[pos]), cost


def _plane_batch_buffers(
    ix: HammingIndex,
    n: int,
    first: int,
    step: int,
    wdt: type[np.unsignedinteger[Any]],
    hdt: type[np.unsignedinteger[Any]],
) -> tuple[NDArray[np.uint64], NDArray[np.uint8], NDArray[Any], NDArray[Any], NDArray[np.bool_]]:
    """`_scan_planes_batch`'s buffers for n users, kept per thread and reused: XOR words, popcounts, the
    head's weighted distances W (``wdt``, n·first), the blocks' high-plane sums (``hdt``) and a hit mask,
    of n·max(first, step) pairs."""
    cap = n * max(first, step)
    held = getattr(ix._local, "plane_batch_buffers", None)
    if held is None or held[0].size < cap or held[2].dtype != wdt or held[3].dtype != hdt:
        held = (
            np.empty(cap, np.uint64),
            np.empty(cap, np.uint8),
            np.empty(n * first, wdt),
            np.empty(cap, hdt),
            np.empty(cap, np.bool_),
        )
        ix._local.plane_batch_buffers = held
    x, t, wbuf, hbuf, mask = held
    if wbuf.size < n * first:
        wbuf = np.empty(n * first, wdt)
    return x, t, wbuf, hbuf, mask


class _PlaneLift:
    """q = 2^s·(L − level) // 2a along the scan, computed for the positions asked (``lift[key]``, int64)."""

    __slots__ = ("bias", "a2", "s")

    def __init__(self, bias: NDArray[Any], a: int, s: int) -> None:
        self.bias, self.a2, self.s = bias, 2 * a, s

    def __getitem__(self, key: Any) -> NDArray[np.int64]:
        return (self.bias[key].astype(np.int64) << self.s) // self.a2

    def stop(self, top: int) -> int:
        """The first scan position whose q exceeds ``top`` (q <= top is bias·2^s < 2a·(top + 1))."""
        bound = -(-self.a2 * (top + 1) // (1 << self.s))  # the smallest bias with q > top
        if bound > np.iinfo(self.bias.dtype).max:
            return int(self.bias.size)
        return int(self.bias.searchsorted(self.bias.dtype.type(bound), side="left"))


class _ByteBands:
    """One plane user's substring weights W_j(x) = Σ_p 2^p·popcount(x XOR d_pj) over the 2^16 values x
    of each substring j, held as two 256-entry byte tables (W_j(x) = lo_j[x & 255] + hi_j[x >> 8]) with
    lo_j sorted: the values x of a band r0 < W_j(x) <= r1 are, per high byte, one slice of the sorted
    low bytes."""

    __slots__ = ("lx", "lv", "hi", "spread")

    def __init__(self, pw: NDArray[np.uint64]) -> None:
        pbytes = (pw[:, None] >> np.arange(0, 64, 8, dtype=np.uint64)) & np.uint64(255)  # (P, 8)
        bt = np.zeros((8, 256), np.int64)
        for p in range(pw.size):
            bt += np.bitwise_count(_BYTE_VALUES[None, :] ^ pbytes[p][:, None]).astype(np.int64) << p
        lo = bt[0::2]
        self.hi = bt[1::2]
        # W_j's standard deviation over uniform x (its mean is rmax / 2 for every j).
        self.spread = np.sqrt(lo.var(axis=1) + self.hi.var(axis=1)).tolist()
        self.lx = np.argsort(lo, axis=1, kind="stable")
        self.lv = np.take_along_axis(lo, self.lx, axis=1)

    def radii(self, e: int, rmax: int) -> list[int]:
        """Radii with Σ (r_j + 1) = e before clamping to [-1, rmax] (the pigeonhole holds for any such
        split; clamping only widens a probe or makes it find everything), each table's radius the same
        number of its standard deviations below the mean, so that each finds about the same share of
        random items."""
        spread = self.spread
        total = sum(spread)
        if e <= 0:
            return [-1] * 4
        if total == 0:
            return _radii(e, rmax)
        mu = rmax / 2
        z = (4 * (mu + 1) - e) / total
        real = [mu - z * sd for sd in spread]
        base = [math.floor(x) for x in real]
        left = e - sum(b + 1 for b in base)  # 0..3: Σ (real_j + 1) = e
        if not 0 <= left <= 4:
            return _radii(e, rmax)  # a rounding slip: the even split
        for j in sorted(range(4), key=lambda j: base[j] - real[j])[:left]:
            base[j] += 1
        return [min(max(b, -1), rmax) for b in base]

    def band(self, j: int, r0: int, r1: int) -> NDArray[np.int64]:
        """The values x of substring j with r0 < W_j(x) <= r1 (in no particular order)."""
        lv = self.lv[j]
        s = np.searchsorted(lv, r0 - self.hi[j], side="right")
        c = np.searchsorted(lv, r1 - self.hi[j], side="right") - s
        nz = c.nonzero()[0]
        if nz.size == 0:
            return np.empty(0, np.int64)
        s, c = s[nz], c[nz]
        # The sorted low bytes' indices as a running sum of steps, as in `_SubstringTables.gather`.
        idx = np.ones(int(c.sum()), np.int64)
        step = s.copy()
        step[1:] -= s[:-1] + c[:-1] - 1
        idx[np.cumsum(c) - c] = step
        np.cumsum(idx, out=idx)
        return np.repeat(nz << 8, c) + self.lx[j][idx]


def _plane_subset(
    ix: HammingIndex, planes: NDArray[np.uint64], a: int, s: int, ids: NDArray[np.int64]
) -> NDArray[np.int64]:
    """One plane user's exact costs 2a·W + 2^s·(L − level) of the items ``ids`` (the ``candidates=``
    restriction of `HammingIndex.search_planes`)."""
    wd = np.zeros(ids.size, np.int64)
    for p in range(planes.shape[0]):
        for j in range(ix.w):
            wd += np.bitwise_count(ix._words[j, ids] ^ planes[p, j]).astype(np.int64) << p
    cost = 2 * a * wd
    if ix._bias is not None and ix._levels is not None:
        cost += (ix._top - ix._levels[ids].astype(np.int64)) << s
    return cost


def _plane_subset_batch(
    ix: HammingIndex, planes: NDArray[np.uint64], a: NDArray[np.int64], s: int, ids: NDArray[np.int64]
) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
    """`_plane_subset` for n users (``planes`` (n, P, w), ``a`` (n,)): every (row, item id, cost)."""
    n = planes.shape[0]
    wd = np.zeros((n, ids.size), np.int64)
    for p in range(planes.shape[1]):
        for j in range(ix.w):
            wd += np.bitwise_count(ix._words[j, ids][None, :] ^ planes[:, p, j : j + 1]).astype(np.int64) << p
    cost = 2 * a[:, None] * wd
    if ix._bias is not None and ix._levels is not None:
        cost += (ix._top - ix._levels[ids].astype(np.int64)) << s
    rows = np.repeat(np.arange(n, dtype=np.int64), ids.size)
    return rows, np.tile(ids, n), cost.ravel()


def _plane_candidates(
    ix: HammingIndex,
    planes: NDArray[np.uint64],
    a: NDArray[np.int64],
    s: int,
    kk: NDArray[np.int64],
    block_pairs: int,
    substring: bool,
) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
    """`_scan_planes_batch`'s candidates (row, item id, cost) for n users, in groups of _PLANE_GROUP
    users, each one scan: long rows keep numpy's per-row call cost small (a broadcast XOR over 16 rows
    of 8192 items runs ~3x faster per pair than over 100 of 1300).  With ``substring``, one substring
    search per user first (10^6 items, 100 users: 52 ms against 149 ms for the batched scan); the
    users it gives up on are scanned together."""
    n = planes.shape[0]
    parts = []
    rest = np.arange(n, dtype=np.int64)
    if substring:
        left = []
        for u in range(n):
            found = _substring_planes(ix, planes[u], int(a[u]), s, int(kk[u]))
            if found is None:
                left.append(u)
            else:
                parts.append((np.full(found[0].size, u, np.int64), found[0], found[1]))
        rest = np.asarray(left, dtype=np.int64)
    for g in range(0, rest.size, _PLANE_GROUP):
        sl = rest[g : g + _PLANE_GROUP]
        r, i, c = _scan_planes_batch(ix, planes[sl], a[sl], s, kk[sl], max(int(block_pairs), 1))
        parts.append((sl[r], i, c))
    rows, ids, cost = (np.concatenate(v) for v in zip(*parts, strict=True))
    return rows, ids, cost
