"""The exact multi-index hashing ("substring") search of one user's Hamming code, f = 64 only: tables of
the codes by each of their four 16-bit substrings (`_SubstringTables`, built once per index), probed
for the buckets that must hold every item at or below a threshold, round by round.

Invariants:
- Pigeonhole: an item within distance D of the query has, for any radii with Σ (r_j + 1) = D + 1, some
  substring j within r_j of the query's; probing every bucket out to r_j in each table j finds it.
- A search ends only when at least kk distinct items of value v <= T were found while the probes
  guarantee every item of v <= T was: exactness rests on that alone, never on the estimates or
  bounds, which only decide when to give up (None: the caller scans instead).
- The same rounds machinery (`_probe_group`, `_scan_group`, `_round_end`) serves the plane search of
  `device_sdk.topk.planes`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from device_sdk.topk.scan import _FIRST_BLOCK, _costs_one, _scan

if TYPE_CHECKING:
    from device_sdk.topk.index import HammingIndex
    from device_sdk.topk.planes import _PlaneLift

# One user's exact multi-index (substring) search, f = 64 only (see `_SubstringTables`): catalogues from
# _MIH_MIN items (below, the linear scan is as fast or faster; random codes, a new user each call, in one
# process: 2^19 items 0.39-0.44 vs 0.39 ms, with the item term 0.48 vs 0.42; 786432 items 0.52-0.55 vs
# 0.63 and 0.63 vs 0.70), at most 1 + 2·_MIH_GROUPS level groups with their own tables (groups under
# _MIH_GROUP_MIN items are scanned), a first probe at radius _MIH_FIRST_RADIUS in every substring, the
# first threshold tried is where the first probe's estimate reaches _MIH_MARGIN·kk items, a group is
# scanned once its finds (with repeats) would exceed _MIH_FALLBACK of its items, and the linear scan
# answers after _MIH_ROUNDS rounds without an answer.
_MIH_MIN = 3 << 18
_MIH_GROUPS = 3
_MIH_GROUP_MIN = 1 << 16
_MIH_FIRST_RADIUS = 1
_MIH_MARGIN = 1.0
_MIH_FALLBACK = 0.125
_MIH_ROUNDS = 4
_MIH_REACH = 4  # how far above its last step T may jump in its last round (see `_substring_one`)
_SUB_BITS = 16  # 4 substrings of 16 bits
_SUB_N = 1 << _SUB_BITS
# Every 16-bit mask, by popcount; the masks of popcount < r are _MASKS[: _MASK_AT[r]].
_MASKS = np.argsort(np.bitwise_count(np.arange(_SUB_N, dtype=np.uint16)), kind="stable").astype(np.int32)
_MASK_AT = np.concatenate(([0], np.cumsum(np.bincount(np.bitwise_count(np.arange(_SUB_N, dtype=np.uint16)))))).tolist()

# A search's state, shared by its rounds (see `_probe_group`): the radius per table, the finds spent and
# allowed per group, the groups still probed, the ranges scanned this round (start, values), where the
# scan would stop, the values of a range of scan positions, and the catalogue's size.
_ProbeState = tuple[list[int], list[int], list[int], list[int], list[Any], int, Callable[[int, int], NDArray[Any]], int]
# `_first_round`'s result.
_FirstRound = tuple[
    NDArray[np.float64],
    NDArray[np.int64],
    list[tuple[int, NDArray[Any]]],
    list[int],
    list[int],
    list[int],
    list[tuple[int, NDArray[np.int64], NDArray[Any]]],
]


def _substring_batch(
    ix: HammingIndex, users: NDArray[np.uint64], kk: NDArray[np.int64], block_pairs: int
) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
    """`_scan`'s candidates (row, item id, cost) by one substring search per user; the users it
    gives up on are scanned together.  (10^6 random items, 100 users: 50-56 ms against 78-85 ms for
    the batched scan.)"""
    rows_l, ids_l, cost_l, rest = [], [], [], []
    for i in range(users.shape[0]):
        found = _substring_one(ix, users[i], int(kk[i]))
        if found is None:
            rest.append(i)
            continue
        ids_l.append(found[0])
        cost_l.append(found[1].astype(np.int64))
        rows_l.append(np.full(found[0].size, i, np.int64))
    if rest:
        back = np.asarray(rest, dtype=np.int64)
        r_rows, r_ids, r_cost = _scan(ix, users[back], kk[back], block_pairs)
        rows_l.append(back[r_rows])
        ids_l.append(r_ids)
        cost_l.append(r_cost)
    return np.concatenate(rows_l), np.concatenate(ids_l), np.concatenate(cost_l)


def _substring_buffers(ix: HammingIndex, cap: int) -> tuple[NDArray[np.int64], NDArray[np.uint64], NDArray[np.uint8]]:
    """The substring search's buffers (entry indices, codes, distances of up to ``cap`` finds),
    kept per thread: fresh ones would cost their page faults on every search."""
    held = getattr(ix._local, "mih_buffers", None)
    if held is None or held[0].size < cap:
        held = (np.empty(cap, np.int64), np.empty(cap, np.uint64), np.empty(cap, np.uint8))
        ix._local.mih_buffers = held
    return held


def _substring_one(
    ix: HammingIndex, user: NDArray[np.uint64], kk: int
) -> tuple[NDArray[np.int64], NDArray[np.integer]] | None:
    """`_scan_one` by multi-index hashing (see `_SubstringTables`), or None when it gives up for the
    linear scan (the caller then scans).

    It looks for the smallest T such that at least kk distinct items of v = dist + q <= T were
    found while the buckets probed guarantee that every item with v <= T was: the kk-th smallest v
    of the catalogue is then <= T and every item at or below it is a candidate.  Round 1 probes
    every table at radius _MIH_FIRST_RADIUS; its finds, each weighted by the inverse of how often an
    item at its distance is found (`_found_weights`), estimate how many items the catalogue holds
    at each v, and the first T tried is where that estimate reaches _MIH_MARGIN·kk.  T then grows
    by one a round, for at most _MIH_ROUNDS rounds (then None); before the last one it jumps to the
    kk-th smallest value of the distinct items found so far, when there are kk of them (that value
    bounds the catalogue's kk-th, so the last round's check holds).  The items found with v above
    the last T it may reach (cap: at most the value of the (4·kk)-th find, an item being found at most
    4 times) are dropped as they are found.  Small level groups are scanned, and so is a group whose
    probes (their bucket counts say so before any gathering) would find more than _MIH_FALLBACK of
    its items; when that group holds half the catalogue or more, None.  With an item term, the kk-th
    value of the first 2048 items bounds everything: groups whose q exceeds it are not probed,
    scans stop where q exceeds it, and when that leaves fewer than _MIH_MIN items, None (the scan,
    which stops there too, is cheaper).  Exactness rests only on the probes' guarantee and the
    distinct count, never on the estimate or the bounds (they decide when to give up)."""
    tb = ix._substring_tables()
    ng = len(tb.group_q)
    if ng == 0:
        return None  # every level group is small: the scan is the search
    word, codes = user[0], ix._sorted[0]
    vmax, lift = ix._vmax, ix._lift

    def values(a: int, b: int) -> NDArray[Any]:
        return _range_values(codes, lift, word, a, b)

    top, stop = vmax, ix.m  # a bound on the kk-th value, and where the scan would stop at it
    if lift is not None:
        # The kk-th value of the scan's first items bounds the catalogue's; the codes are sorted by q,
        # so no item past `stop` (q > top) can be wanted.  When the scan would stop early there, it
        # is the cheaper search (a strong item term: the top-level items win).
        hv = values(0, min(ix.m, max(_FIRST_BLOCK, 4 * kk)))
        top = int(np.partition(hv, kk - 1)[kk - 1])
        stop = int(lift.searchsorted(lift.dtype.type(top), side="right"))
        if stop < _MIH_MIN:
            return None
    quarters = [(int(word) >> (_SUB_BITS * j)) & (_SUB_N - 1) for j in range(4)]
    limit = [int(_MIH_FALLBACK * (b - a)) for a, b in tb.spans]  # finds a group may gather
    buffers = _substring_buffers(ix, max(limit) + 1)
    first_round = _first_round(ix, tb, word, kk, top, stop, quarters, limit, buffers, values)
    if first_round is None:
        return None
    est, occ, scanned, radius, spent, live, first_finds = first_round
    # An item occurs at most 4 times among the finds, so at least kk distinct items have a value at or
    # below the (4·kk)-th occurrence's bound: it bounds the catalogue's kk-th value.
    bound = np.flatnonzero(np.cumsum(occ) >= 4 * kk)
    reach = np.flatnonzero(np.cumsum(est) >= _MIH_MARGIN * kk)
    T = min(vmax, int(reach[0]) if reach.size else vmax)
    # The largest T tried: no value above it is kept.
    cap = min(int(bound[0]) if bound.size else T + _MIH_ROUNDS + _MIH_REACH, top)
    T = min(T, cap)
    pos_l: list[NDArray[Any]] = []
    val_l: list[NDArray[Any]] = []
    for g, idx, dist in first_finds:
        if g in live:
            _substring_finds(tb, tb.group_q[g], lift, idx, dist, cap, pos_l, val_l)

    def fetch(first: NDArray[np.int64], count: NDArray[np.int64], n: int) -> tuple[NDArray[Any], NDArray[Any]]:
        return tb.expand(word, first, count, n, buffers)

    for turn in range(_MIH_ROUNDS):
        # The radii that find every item of v <= T: group g needs dist <= T − q_g, so radii r_j with
        # Σ (r_j + 1) = T − q_g + 1 (-1: that substring is not probed).
        for g in list(live):
            grow = [(4 * g + j, r) for j, r in enumerate(_radii(T - tb.group_q[g] + 1, _SUB_BITS))]
            grow = [(t, r) for t, r in grow if r > radius[t]]
            if not grow:
                continue
            found = tb.probe(quarters, [t for t, _ in grow], [radius[t] + 1 for t, _ in grow], [r + 1 for _, r in grow])
            state = (radius, spent, limit, live, scanned, stop, values, ix.m)  # `scanned` is new each round
            if not _probe_group(tb, g, grow, found, fetch, tb.group_q[g], lift, cap, state, pos_l, val_l):
                return None
        pos, val, hit = _round_end(pos_l, val_l, scanned, cap, T, kk)
        scanned = []
        pos_l, val_l = [pos], [val]
        if hit is not None:
            return _costs_one(*hit, kk, ix._rem, ix.weight, ix._order)
        T += 1
        if turn == _MIH_ROUNDS - 2:
            # The last round: T jumps to the kk-th smallest value of the distinct items found (all at
            # most cap), which bounds the catalogue's kk-th, so that round's check holds.
            ids, at = np.unique(pos, return_index=True)
            if ids.size >= kk:
                T = max(T, int(np.partition(val[at], kk - 1)[kk - 1]))
    return None


def _first_round(
    ix: HammingIndex,
    tb: _SubstringTables,
    word: np.uint64,
    kk: int,
    top: int,
    stop: int,
    quarters: list[int],
    limit: list[int],
    buffers: tuple[NDArray[np.int64], NDArray[np.uint64], NDArray[np.uint8]],
    values: Callable[[int, int], NDArray[Any]],
) -> _FirstRound | None:
    """`_substring_one`'s round 1, or None when it gives up: the linear ranges (up to ``stop``) scanned,
    and every group of smallest q at most ``top`` probed at radius _MIH_FIRST_RADIUS in each of its
    tables (a group whose bucket counts pass its budget ``limit`` is scanned instead).

    Returns the estimated items per value v (finds weighted by `_found_weights`, scanned values
    exact), the occurrences per bound on v (finds at v <= dist + the group's largest q), the ranges
    scanned, the radius per table, the finds spent per group, the groups still probed and the finds
    (group, entry indices, distances)."""
    vmax, r1, ng = ix._vmax, _MIH_FIRST_RADIUS, len(tb.group_q)
    est = np.zeros(vmax + 66)  # estimated items per value v (found ones weighted, scanned ones exact)
    scanned: list[tuple[int, NDArray[Any]]] = []
    occ = np.zeros(vmax + 66, np.int64)  # round 1's finds by a bound on v, each occurrence counted
    for a, b in tb.linear:
        if a >= stop:
            continue
        v = values(a, min(b, stop))
        c = np.bincount(v, minlength=vmax + 1)
        est[: vmax + 1] += c
        occ[: vmax + 1] += c
        scanned.append((a, v))
    radius = [-1] * (4 * ng)
    spent = [0] * ng
    live = list(range(ng))  # the groups still probed (the others are scanned)
    first_finds = []
    weights = _found_weights(r1)
    for g in range(ng):
        if tb.group_q[g] > top:
            live.remove(g)  # no item of it can be wanted
            continue
        tables = [4 * g + j for j in range(4)]
        first, count = tb.probe(quarters, tables, [0] * 4, [r1 + 1] * 4)
        n = int(count.sum())
        if n > limit[g]:
            if not _scan_group(tb, g, values, live, scanned, stop, ix.m):
                return None
            c = np.bincount(scanned[-1][1], minlength=vmax + 1)
            est[: vmax + 1] += c
            occ[: vmax + 1] += c
            continue
        spent[g] = n
        for t in tables:
            radius[t] = r1
        if n:
            idx, dist = tb.expand(word, first, count, n, buffers)
            q = tb.group_q[g]
            est[q : q + 65] += np.bincount(dist, weights=weights[dist], minlength=65)
            # v <= dist + (the group's largest q): a bound on each find's value without reading its q.
            occ[tb.group_top[g] : tb.group_top[g] + 65] += np.bincount(dist, minlength=65)
            first_finds.append((g, idx.copy(), dist.copy()))
    return est, occ, scanned, radius, spent, live, first_finds


def _probe_group(
    tb: _SubstringTables,
    g: int,
    grow: list[tuple[int, int]],
    found: tuple[NDArray[np.int64], NDArray[np.int64]],
    fetch: Callable[[NDArray[np.int64], NDArray[np.int64], int], tuple[NDArray[Any], NDArray[Any]]],
    q: int,
    lift: NDArray[Any] | _PlaneLift | None,
    cap: int,
    state: _ProbeState,
    pos_l: list[NDArray[Any]],
    val_l: list[NDArray[Any]],
) -> bool:
    """Group g's tables probed out to the radii ``grow`` ((table, radius) pairs), whose new buckets
    are ``found`` (first entries, entries): their finds (``fetch(first, count, n)``: entry indices
    and distances) of value <= ``cap`` go to the lists; past the group's budget the group is scanned
    instead (False: the whole search should give up).  ``state`` is the search's (radius per table,
    finds spent and allowed per group, live groups, scanned ranges, stop, range values, catalogue size)."""
    radius, spent, limit, live, scanned, stop, values, m = state
    first, count = found
    n = int(count.sum())
    if spent[g] + n > limit[g]:
        return _scan_group(tb, g, values, live, scanned, stop, m)
    spent[g] += n
    for t, r in grow:
        radius[t] = r
    if n:
        idx, dist = fetch(first, count, n)
        _substring_finds(tb, q, lift, idx, dist, cap, pos_l, val_l)
    return True


def _range_values(
    codes: NDArray[np.uint64], lift: NDArray[np.unsignedinteger[Any]] | None, word: np.uint64, a: int, b: int
) -> NDArray[Any]:
    """v = dist + q of the scan positions [a, b), ``codes`` the (m,) f = 64 codes in scan order and
    ``lift`` q along it (None: 0)."""
    v = np.bitwise_count(codes[a:b] ^ word)
    return v if lift is None else v + lift[a:b]


def _scan_group(
    tb: _SubstringTables,
    g: int,
    values: Callable[[int, int], NDArray[Any]],
    live: list[int],
    scanned: list[tuple[int, NDArray[Any]]],
    stop: int,
    m: int,
) -> bool:
    """Scan level group g (up to scan position ``stop``) instead of probing it (False: that is half
    the catalogue of ``m`` items or more, so the whole linear scan, with its cheaper selection, should
    answer)."""
    a, b = tb.spans[g]
    b = min(b, stop)
    if 2 * (b - a) >= m:
        return False
    live.remove(g)
    scanned.append((a, values(a, b)))
    return True


def _substring_finds(
    tb: _SubstringTables,
    q: int,
    lift: NDArray[Any] | _PlaneLift | None,
    idx: NDArray[np.int64],
    dist: NDArray[Any],
    cap: int,
    pos_l: list[NDArray[Any]],
    val_l: list[NDArray[Any]],
) -> None:
    """Append the scan positions and exact values v = dist + lift <= ``cap`` of a group's finds
    (table entries ``idx`` at distances ``dist``; q the group's smallest lift) to the lists."""
    if cap < q:
        return
    hit = np.flatnonzero(dist <= cap - q)  # v >= dist + q: a first cut
    if hit.size:
        pos = tb.pos.take(idx[hit])
        val = dist[hit]
        if lift is not None:
            val = val + lift[pos]
            ok = np.flatnonzero(val <= cap)
            pos, val = pos[ok], val[ok]
        pos_l.append(pos)
        val_l.append(val)


def _radii(e: int, rmax: int) -> list[int]:
    """Radii r_0..r_3 with Σ (r_j + 1) = e (pigeonhole: an item within e − 1 of the query, the distance
    a sum over the 4 substrings, is within r_j in some substring j), each at most rmax (the largest
    substring distance; -1: that substring need not be probed)."""
    e = max(e, 0)
    return [min(e // 4 - 1 + (j < e % 4), rmax) for j in range(4)]


def _round_end(
    pos_l: list[NDArray[Any]],
    val_l: list[NDArray[Any]],
    scanned: list[tuple[int, NDArray[Any]]],
    cap: int,
    T: int,
    kk: int,
    dtype: type[np.integer] | None = None,
) -> tuple[NDArray[Any], NDArray[Any], tuple[NDArray[np.int64], NDArray[Any]] | None]:
    """The end of a substring search's round: the finds so far (scan positions, values), with the
    values <= ``cap`` of the groups scanned this round added, and — when at least kk distinct items
    have a value <= T — those items and their values (an item found in several tables counts once)."""
    for a, v in scanned:
        keep = np.flatnonzero(v <= cap)
        pos_l.append(keep + a)
        val_l.append(v[keep])
    if not pos_l:
        pos_l, val_l = [np.empty(0, np.int64)], [np.empty(0, np.int64)]
    pos = np.concatenate(pos_l)
    val = np.concatenate(val_l)
    if dtype is not None:
        val = val.astype(dtype, copy=False)
    sel = np.flatnonzero(val <= T)
    if sel.size >= kk:
        ids, at = np.unique(pos[sel], return_index=True)
        if ids.size >= kk:
            return pos, val, (ids, val[sel[at]])
    return pos, val, None


@functools.lru_cache(maxsize=8)
def _found_weights(radius: int) -> NDArray[np.float64]:
    """Per distance d (0..64), 1 / E[number of the 4 substrings of an item at distance d that lie
    within ``radius`` of the query's]: the d differing bits fall on the 64 positions uniformly (the
    model of random codes), so each substring holds a hypergeometric share of them.  Weighting each
    probed occurrence by it estimates how many items of each distance the catalogue holds (0 where
    no such item can be found)."""
    out = np.zeros(65)
    for d in range(65):
        p = sum(math.comb(16, x) * math.comb(48, d - x) for x in range(0, min(radius, d) + 1) if d - x <= 48)
        mult = 4 * p / math.comb(64, d)
        out[d] = 1.0 / mult if mult > 0 else 0.0
    return out


class _SubstringTables:
    """Multi-index hashing tables of a HammingIndex's codes (f = 64, Norouzi et al.'s substring search).

    The 64-bit code is cut into 4 substrings of 16 bits.  By pigeonhole, an item within Hamming
    distance D of the query has, for any radii r_0..r_3 with Σ (r_j + 1) = D + 1, some substring j
    within r_j of the query's substring j.  So probing every bucket within r_j of the query in table j
    finds every item within D.

    The scan order (codes sorted by level) is cut into level groups at the start and the end of each of
    the _MIH_GROUPS largest runs of equal q = (L − level) // B (so those runs are groups of their own,
    probed with their exact q; at most 1 + 2·_MIH_GROUPS groups).  An item of group g has
    v = dist + q >= dist + q_g (q_g the q of the group's first item), so v <= T needs dist <= T − q_g:
    each group is probed with its own radii.  Groups under _MIH_GROUP_MIN items are scanned instead.

    For each table (group g, substring j) the group's items are held sorted by that substring's value
    (stable, so by scan position within a bucket): their codes (8 bytes) and scan positions (4), 12
    bytes an item and table, 48 an item in all, plus 4 × 65537 int32 offsets per group.
    Built once per index, on its first single-user search (the index is immutable)."""

    __slots__ = ("off", "codes", "pos", "group_q", "group_top", "spans", "linear", "nbytes")

    def __init__(
        self,
        words: NDArray[np.uint64],
        lift: NDArray[np.unsignedinteger[Any]] | None,
        runs: tuple[list[int], list[int]],
    ) -> None:
        m = words.size
        if lift is None:
            bounds = [0]
        else:
            run_at = runs[0]
            sizes = np.diff(np.asarray(run_at + [m], dtype=np.int64))
            big = np.argsort(-sizes, kind="stable")[:_MIH_GROUPS].tolist()
            # The largest runs are groups of their own: each of their items probed with its own q.
            bounds = sorted({0, *(run_at[i] for i in big), *(run_at[i] + int(sizes[i]) for i in big)} - {m})
        spans = list(zip(bounds, [*bounds[1:], m], strict=True))
        groups = [(a, b) for a, b in spans if b - a >= _MIH_GROUP_MIN]
        self.linear: list[tuple[int, int]] = []
        for a, b in spans:
            if b - a >= _MIH_GROUP_MIN:
                continue
            if self.linear and self.linear[-1][1] == a:
                a = self.linear.pop()[0]  # adjacent scanned groups: one range
            self.linear.append((a, b))
        self.group_q = [0 if lift is None else int(lift[a]) for a, _ in groups]
        self.group_top = [0 if lift is None else int(lift[b - 1]) for _, b in groups]
        self.spans = groups
        total = 4 * sum(b - a for a, b in groups)
        self.off = np.empty((4 * len(groups), _SUB_N + 1), np.int32)
        self.codes = np.empty(total, np.uint64)
        self.pos = np.empty(total, np.uint32)
        base = 0
        for g, (a, b) in enumerate(groups):
            seg = words[a:b]
            for j in range(4):
                key = ((seg >> np.uint64(_SUB_BITS * j)) & np.uint64(_SUB_N - 1)).astype(np.uint16)
                perm = np.argsort(key, kind="stable")  # 16-bit keys: numpy's radix sort
                row = self.off[4 * g + j]
                row[0] = 0
                np.cumsum(np.bincount(key, minlength=_SUB_N), out=row[1:])
                row += base
                n = b - a
                self.codes[base : base + n] = seg[perm]
                self.pos[base : base + n] = perm + a
                base += n
        self.nbytes = self.off.nbytes + self.codes.nbytes + self.pos.nbytes

    def probe(
        self, quarters: list[int], tables: list[int], lo: list[int], hi: list[int]
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """(first entry, entries) of every bucket of table t within popcount [lo, hi) of the query's
        substring, for each listed table t in turn."""
        return self.probe_buckets(
            tables,
            [_MASKS[_MASK_AT[a] : _MASK_AT[b]] ^ quarters[t % 4] for t, a, b in zip(tables, lo, hi, strict=True)],
        )

    def probe_buckets(
        self, tables: list[int], buckets: list[NDArray[Any]]
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """(first entry, entries) of the given buckets (substring values) of each listed table in turn."""
        flat = np.concatenate([b + t * (_SUB_N + 1) for t, b in zip(tables, buckets, strict=True)])
        off = self.off.ravel()
        first = off[flat].astype(np.int64)
        return first, off[flat + 1] - first

    def expand(
        self,
        word: np.uint64,
        first: NDArray[np.int64],
        count: NDArray[np.int64],
        total: int,
        buffers: tuple[NDArray[np.int64], NDArray[np.uint64], NDArray[np.uint8]],
    ) -> tuple[NDArray[np.int64], NDArray[np.uint8]]:
        """The entries of the given buckets (``total`` of them, repeats across tables included), in
        bucket order: their entry indices and their distances to the query, written into the first
        ``total`` slots of ``buffers`` (entry indices, codes, distances) and returned as views."""
        idx, codes = self.gather(first, count, total, buffers[0], buffers[1])
        np.bitwise_xor(codes, word, out=codes)
        dist = np.bitwise_count(codes, out=buffers[2][:total])
        return idx, dist

    def gather(
        self,
        first: NDArray[np.int64],
        count: NDArray[np.int64],
        total: int,
        ib: NDArray[np.int64],
        cb: NDArray[np.uint64],
    ) -> tuple[NDArray[np.int64], NDArray[np.uint64]]:
        """The entries of the given buckets (``total`` of them), in bucket order: their entry indices and
        codes, written into the first ``total`` slots of ``ib`` and ``cb`` and returned as views."""
        nz = count.nonzero()[0]
        if nz.size < count.size:
            first, count = first[nz], count[nz]
        idx, codes = ib[:total], cb[:total]
        # The entry indices as a running sum of steps: +1 within a bucket, a jump to each bucket's first.
        idx.fill(1)
        step = first.copy()
        step[1:] -= first[:-1] + count[:-1] - 1
        idx[np.cumsum(count) - count] = step
        np.cumsum(idx, out=idx)
        # Each bucket's lines read first by a gather of one entry a line (independent loads, which the
        # core overlaps), then the gather of every entry finds them in cache.
        self.codes.take(np.concatenate((first, first + np.minimum(count - 1, 8))), mode="clip")
        np.take(self.codes, idx, out=codes, mode="clip")  # in range by construction: no check
        return idx, codes
