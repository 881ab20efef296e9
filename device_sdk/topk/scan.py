"""The exhaustive Hamming scans of a `HammingIndex`: a batch of users over cache-sized blocks, and one
user with scalar thresholds; plus the ``candidates=`` restriction.

Invariants:
- The scan order is the index's (codes sorted by level, highest first, when there is an item term), so
  the cost term only grows along the scan and a scan stops once no user can take a later item.
- A user's running threshold τ (the kk-th smallest cost, or value v = dist + q, seen so far) bounds
  the final kk-th from above and only falls; every item at or below it is kept, ties included, so the
  candidates returned hold every item at or below the kk-th smallest over the whole catalogue.
- Buffers are the index's, per thread (``ix._local``), reused across searches.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from device_sdk.topk.select import _pair_hist, _row_hist, _tau

if TYPE_CHECKING:
    from device_sdk.topk.index import HammingIndex

# User-item pairs per scan block: the XOR buffer (8 bytes a pair, 1 MiB) stays within L2.
_BLOCK_PAIRS = 1 << 17
# Items per user in a block of a batched scan, at least: numpy runs its inner loop once per user row,
# so short rows would pay that call overhead on every few items.
_ROW_ITEMS = 4096
# Items in the first block of a scan, from which the running threshold is bootstrapped.
_FIRST_BLOCK = 2048
# Single-user scan: items in the first segment (whose candidates set the threshold of the rest), items
# per later segment (one compare per segment), items per XOR + popcount call.
_HEAD_SEGMENT = 1 << 17
_SEGMENT = 1 << 20
_CHUNK = 1 << 17
# Values compared through the minima of _GROUPS interleaved groups from this many on (below it the one
# compare call is cheaper).
_GROUPED_COMPARE_MIN = 1 << 13
_GROUPS = 32


def hamming_distances(user_words: NDArray[np.uint64], item_words: NDArray[np.uint64]) -> NDArray[np.integer]:
    """Hamming distance from one packed user code (w,) to every packed item code (w, m)."""
    w, m = item_words.shape
    if user_words.shape != (w,):
        raise ValueError(f"user code has {user_words.shape} words, item codes have {w}")
    dist = np.bitwise_count(item_words[0] ^ user_words[0]).astype(np.uint16)
    for j in range(1, w):
        dist += np.bitwise_count(item_words[j] ^ user_words[j])
    return dist


def _buffers(
    ix: HammingIndex, cap: int
) -> tuple[NDArray[np.uint64], NDArray[np.integer], NDArray[np.uint8], NDArray[np.bool_], NDArray[np.integer]]:
    """Scan buffers of at least ``cap`` pairs (XOR words, distances, per-word popcounts, hit
    mask, distances plus item term in bits), kept per thread and reused across searches: a fresh
    multi-megabyte buffer would cost its page faults on every call."""
    held = getattr(ix._local, "buffers", None)
    if held is None or held[0].size < cap:
        t_size = cap if (ix.w > 1 or ix._dt != np.uint8) else 0
        held = (
            np.empty(cap, np.uint64),
            np.empty(cap, ix._dt),
            np.empty(t_size, np.uint8),
            np.empty(cap, np.bool_),
            np.empty(0, np.uint8) if ix._lift is None else np.empty(cap, ix._lift.dtype),
        )
        ix._local.buffers = held
    return held


def _distances(
    words: NDArray[np.uint64],
    users: NDArray[np.uint64],
    start: int,
    stop: int,
    x: NDArray[np.uint64],
    d: NDArray[np.integer],
    t: NDArray[np.uint8],
) -> NDArray[np.integer]:
    """Distances (n, stop − start) of every user to the items [start, stop) of ``words`` (the (w, m) codes
    in scan order), written into the preallocated buffers ``x`` (XOR), ``d`` (distances) and ``t``
    (per-word popcounts)."""
    size = stop - start
    n, w = users.shape[0], words.shape[0]
    x = x[: n * size].reshape(n, size)
    d = d[: n * size].reshape(n, size)
    if w == 1 and d.dtype == np.uint8:
        np.bitwise_xor(words[0, start:stop], users[:, :1], out=x)
        np.bitwise_count(x, out=d)
        return d
    t = t[: n * size].reshape(n, size)
    for j in range(w):
        np.bitwise_xor(words[j, start:stop], users[:, j : j + 1], out=x)
        np.bitwise_count(x, out=t)
        if j == 0:
            d[...] = t
        else:
            d += t
    return d


def _scan_head(
    ix: HammingIndex,
    users: NDArray[np.uint64],
    kk: NDArray[np.int64],
    first: int,
    nb: int,
    buffers: tuple[NDArray[np.uint64], NDArray[np.integer], NDArray[np.uint8]],
) -> tuple[NDArray[np.int64], NDArray[np.intp], NDArray[np.intp], NDArray[np.int64]]:
    """`_scan`'s bootstrap: each user's threshold τ from the costs of the first ``first`` items, by
    counting (nb: no threshold yet), and the (row, position, cost) of the items there at or below it."""
    B, f, bias, lift = ix._B, ix.f, ix._bias, ix._lift
    d0 = _distances(ix._sorted, users, 0, first, *buffers)
    if bias is None or lift is None:
        tau = _tau(_row_hist(d0, nb), kk, nb)
        hits = np.flatnonzero(d0 <= np.minimum(tau, f).astype(d0.dtype)[:, None])
        cost0 = d0.ravel()[hits].astype(np.int64)
        r0, p0 = np.divmod(hits, first)
    else:
        # With the item term lifted into whole bits (see `_scan_one`): t_u the kk-th smallest
        # dist + q of the block, every item there of cost <= τ_u = B·t_u + B − 1 has dist + q <= t_u.
        lifted = d0 + lift[:first]
        nl = f + int(lift[first - 1]) + 1
        head = _tau(_row_hist(lifted, nl), kk, nl)
        tau = np.where(head >= nl, nb, B * head + B - 1)
        hits = np.flatnonzero(lifted <= np.minimum(head, nl - 1).astype(lifted.dtype)[:, None])
        r0, p0 = np.divmod(hits, first)
        cost0 = d0.ravel()[hits].astype(np.int64) * B + bias[p0].astype(np.int64)
    return tau, r0, p0, cost0


def _scan(
    ix: HammingIndex, users: NDArray[np.uint64], kk: NDArray[np.int64], block_pairs: int
) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
    """Candidates (row, item id, cost) holding, per user, every item whose cost is at most the
    kk-th smallest cost over the whole catalogue (ties included)."""
    n, m, B, f = users.shape[0], ix.m, ix._B, ix.f
    nb = f * B + ix._top + 1  # costs lie in [0, nb); nb itself means "no threshold yet"
    bias, words = ix._bias, ix._sorted
    step = max(block_pairs // n, min(_ROW_ITEMS, block_pairs))
    first = min(m, max(min(_FIRST_BLOCK // 2, step), int(kk.max()) * 4))
    x, d, t, mask, _ = _buffers(ix, n * max(first, step))
    tau, r0, p0, cost0 = _scan_head(ix, users, kk, first, nb, (x, d, t))
    rows_l, pos_l, cost_l = [r0], [p0], [cost0]
    pending = r0.size
    budget = max(int(kk.sum()) * 2, 256)
    live = np.arange(n)
    users_live, lim, lim_max, uniform, lo, stale = users, np.zeros(n, np.int64), 0, True, 0, True
    lim_rows = np.zeros((n, 1), ix._dt)
    start = first
    while start < m:
        stop = min(start + step, m)
        if bias is not None and int(bias[start]) != lo:
            stale = True  # the smallest cost term of the block changed
        if stale:
            stale = False
            lo = 0 if bias is None else int(bias[start])
            # dist ≤ (τ − lo) // B is necessary for a cost ≤ τ (every cost term here is ≥ lo);
            # a user without a threshold yet (τ = nb) takes everything.
            lim_all = np.where(tau >= nb, f, (tau - lo) // B)
            live = np.flatnonzero(lim_all >= 0)
            if live.size == 0:
                break  # levels only fall from here on: no user can take any later item
            users_live = users if live.size == n else users[live]
            lim = lim_all[live]
            # Rows of at least _ROW_ITEMS // 4 items are compared with their own user's limit
            # (numpy runs its inner loop once per row); shorter ones with the loosest user's
            # in one flat comparison, the few hits then held to their own row's.
            lim_max = int(lim.max())
            uniform = bool(lim.min() == lim_max)
            lim_rows = np.minimum(lim, f).astype(ix._dt)[:, None]
        dd = _distances(words, users_live, start, stop, x, d, t)
        flat = dd.ravel()
        mk = mask[: flat.size]
        rowwise = not uniform and stop - start >= _ROW_ITEMS // 4
        if rowwise:
            np.less_equal(dd, lim_rows, out=mk.reshape(dd.shape))
        else:
            np.less_equal(flat, lim_max, out=mk)
        hits = mk.nonzero()[0]
        if hits.size:
            r_local, c = np.divmod(hits, stop - start)
            dist = flat[hits]
            if not (uniform or rowwise):
                ok = dist <= lim[r_local]
                r_local, c, dist = r_local[ok], c[ok], dist[ok]
            pos = c + start
            cost = dist.astype(np.int64) * B
            rows_l.append(live[r_local])
            pos_l.append(pos)
            cost_l.append(cost if bias is None else cost + bias[pos])
            pending += c.size
            if pending > budget:
                rows, pos_a, cost_a = (np.concatenate(a) for a in (rows_l, pos_l, cost_l))
                tau = np.minimum(tau, _tau(_pair_hist(rows, cost_a, n, nb), kk, nb))
                keep = cost_a <= tau[rows]
                rows_l, pos_l, cost_l = [rows[keep]], [pos_a[keep]], [cost_a[keep]]
                pending = int(keep.sum())
                budget = max(budget, 2 * pending)
                stale = True  # new thresholds, new limits
        start = stop
    if len(rows_l) == 1:
        rows, pos, cost = rows_l[0], pos_l[0], cost_l[0]
    else:
        rows, pos, cost = (np.concatenate(a) for a in (rows_l, pos_l, cost_l))
    if pending > 4 * int(kk.sum()) + 64:
        keep = cost <= _tau(_pair_hist(rows, cost, n, nb), kk, nb)[rows]
        rows, pos, cost = rows[keep], pos[keep], cost[keep]
    ids = pos if ix._order is None else ix._order[pos]
    return rows, ids, cost


def _one_buffers(
    ix: HammingIndex, cap: int, chunk: int, vdt: type[np.unsignedinteger[Any]]
) -> tuple[
    NDArray[np.uint64], NDArray[np.uint8], NDArray[Any], NDArray[np.bool_], NDArray[np.uint64], NDArray[np.bool_]
]:
    """Single-user scan buffers, kept per thread and reused: XOR words and per-word popcounts of
    one chunk, the values v = dist + q of a segment of ``cap`` items, a hit mask over them, and
    the grouped compare's scratch (one uint64 and one flag per group column)."""
    held = getattr(ix._local, "one_buffers", None)
    groups = cap // _GROUPS + 1
    if held is None or held[2].size < cap or held[0].size < chunk or held[2].dtype != vdt or held[5].size < groups:
        held = (
            np.empty(chunk, np.uint64),
            np.empty(chunk, np.uint8),
            np.empty(cap, vdt),
            np.empty(cap, np.bool_),
            np.empty(groups, np.uint64),
            np.empty(groups, np.bool_),
        )
        ix._local.one_buffers = held
    return held


def _fill(
    words: NDArray[np.uint64],
    lift: NDArray[np.unsignedinteger[Any]] | None,
    user: NDArray[np.uint64],
    start: int,
    stop: int,
    chunk: int,
    x: NDArray[np.uint64],
    tb: NDArray[np.uint8],
    out: NDArray[Any],
) -> None:
    """v_i = dist(b_u, d_i) + q_i for the items [start, stop) of the scan (``words``, the (w, m) codes in
    scan order), into ``out``: one XOR and one popcount call per chunk and code word, then one add of
    the item term in whole bits ``lift`` (left out when it is None: ``out`` then holds the distances)."""
    w = words.shape[0]
    direct = out.dtype == np.uint8  # popcounts of the first word straight into the values
    for c in range(start, stop, chunk):
        e = min(c + chunk, stop)
        xs, o = x[: e - c], out[c - start : e - start]
        for j in range(w):
            np.bitwise_xor(words[j, c:e], user[j], out=xs)
            if j == 0 and direct:
                np.bitwise_count(xs, out=o)
            elif j == 0:
                np.copyto(o, np.bitwise_count(xs, out=tb[: e - c]))
            else:
                np.add(o, np.bitwise_count(xs, out=tb[: e - c]), out=o)
    if lift is not None:
        np.add(out, lift[start:stop], out=out)


def _scan_one(
    ix: HammingIndex, user: NDArray[np.uint64], kk: int, block: int
) -> tuple[NDArray[np.int64], NDArray[np.integer]]:
    """`_scan` for a single user, with scalar thresholds and as few numpy calls as possible.

    The scan works on v_i = dist_i + q_i, q_i = (L − level_i) // B the item term in whole bits
    (q = 0 without one), so that cost_i = B·v_i + r_i with 0 <= r_i < B: with t the kk-th smallest
    v of some kk items, v_i <= t holds exactly when cost_i <= B·t + B − 1, which bounds the kk-th
    smallest cost.  So every item with v <= t is kept, t only falls, and the few candidates left
    are ranked by their exact costs.

    The first segment (`_scan_one_head`) sets the threshold of the rest of the catalogue, scanned in
    segments of ``block`` items, each compared through the minima of interleaved groups (see
    `_hits`); with an item term the values are not formed there: each run of equal q has its
    distances compared with t − q (`_run_hits`).  q only grows along the scan (codes sorted by
    level), so the scan stops at the first item whose q exceeds t."""
    m, f, lift, words = ix.m, ix.f, ix._lift, ix._sorted
    vdt: type[np.unsignedinteger[Any]] = np.uint8 if f < 256 else np.uint16
    if lift is not None:
        vdt = lift.dtype.type
    chunk = min(_CHUNK, max(block, 64))
    first = min(m, max(_FIRST_BLOCK, 4 * kk))  # >= kk, since kk <= m
    seg0 = min(m, max(first, min(block, _HEAD_SEGMENT)))
    buffers = _one_buffers(ix, min(m, max(seg0, block)), chunk, vdt)
    x, tb, v, mask, wtmp, wflag = buffers
    pos, val, t = _scan_one_head(ix, user, kk, first, seg0, chunk, buffers)
    start = seg0
    pos_l, val_l = [pos], [val]
    pending, budget = pos.size, max(8 * kk, 256)
    while start < m:
        stop = min(start + block, m)
        if lift is not None:
            if int(lift[start]) > t:
                break  # levels only fall from here on: no later item can be kept
            stop = start + int(lift[start:stop].searchsorted(lift.dtype.type(t), side="right"))
        vs = v[: stop - start]
        if lift is None:
            _fill(words, lift, user, start, stop, chunk, x, tb, vs)
            hit = _hits(vs, t, mask, wtmp, wflag)
            if hit.size:
                val_l.append(vs[hit])
                hit += start
                pos_l.append(hit)
                pending += hit.size
        else:
            # The distances alone, each run of equal q compared with t − q: no pass adding q.
            _fill(words, None, user, start, stop, chunk, x, tb, vs)
            pending += _run_hits(vs, start, stop, t, ix._lift_runs, vdt, (mask, wtmp, wflag), pos_l, val_l)
        if pending > budget:
            pos, val = np.concatenate(pos_l), np.concatenate(val_l)
            t = int(np.partition(val, kk - 1)[kk - 1])
            keep = (val <= t).nonzero()[0]
            pos_l, val_l = [pos[keep]], [val[keep]]
            pending = keep.size
            budget = max(budget, 2 * pending)
        start = stop
    pos = pos_l[0] if len(pos_l) == 1 else np.concatenate(pos_l)
    val = val_l[0] if len(val_l) == 1 else np.concatenate(val_l)
    return _costs_one(pos, val, kk, ix._rem, ix.weight, ix._order)


def _scan_one_head(
    ix: HammingIndex,
    user: NDArray[np.uint64],
    kk: int,
    first: int,
    seg0: int,
    chunk: int,
    buffers: tuple[NDArray[np.uint64], NDArray[np.uint8], NDArray[Any], NDArray[np.bool_], Any, Any],
) -> tuple[NDArray[np.intp], NDArray[Any], int]:
    """`_scan_one`'s first segment (``seg0`` items, one XOR + popcount pass): its candidates (positions,
    values v) and the threshold t of the rest of the catalogue.

    Its threshold is a low rank r of its ``first``-item head, with r about 8·kk·first / seg0, so that
    about 8·kk items pass rather than kk·seg0/first (when fewer than kk pass, the head's kk-th
    smallest is taken instead); the kk-th smallest v of its candidates is then the threshold of the
    rest (unless the scan ends here)."""
    m, lift = ix.m, ix._lift
    x, tb, v, mask = buffers[:4]
    # The head's rank-r and rank-kk values: the first bounds the hits, the second is always valid.
    r = min(kk, -(-8 * kk * first // seg0))
    vs = v[:seg0]
    _fill(ix._sorted, lift, user, 0, seg0, chunk, x, tb, vs)
    head = np.sort(vs[:first], kind="stable")  # small ints: numpy's radix sort
    lo_t, t = int(head[r - 1]), int(head[kk - 1])
    pos = np.less_equal(vs, lo_t, out=mask[:seg0]).nonzero()[0]
    if pos.size < kk:
        pos = np.less_equal(vs, t, out=mask[:seg0]).nonzero()[0]
    val = vs[pos]
    if seg0 < m and (lift is None or int(lift[seg0]) <= t):
        # The kk-th smallest value of the candidates bounds the rest of the catalogue.
        t = int(np.partition(val, kk - 1)[kk - 1])
        if pos.size > 2 * kk:
            keep = (val <= t).nonzero()[0]
            pos, val = pos[keep], val[keep]
    return pos, val, t


def _run_hits(
    vs: NDArray[Any],
    start: int,
    stop: int,
    t: int,
    runs: tuple[list[int], list[int]],
    vdt: type[np.unsignedinteger[Any]],
    scratch: tuple[NDArray[np.bool_], NDArray[np.uint64], NDArray[np.bool_]],
    pos_l: list[NDArray[Any]],
    val_l: list[NDArray[Any]],
) -> int:
    """The items of v = dist + q <= t among the scan positions [start, stop), given their distances
    ``vs``: each run of equal q (``runs``: where each starts along the scan, and its q) has its
    distances compared with t − q (see `_hits`, ``scratch`` its buffers).  Their positions and values
    go to the lists; returns how many."""
    mask, wtmp, wflag = scratch
    run_at, run_q = runs
    i = bisect.bisect_right(run_at, start) - 1
    a, found = start, 0
    while a < stop:
        b = stop if i + 1 >= len(run_at) else min(run_at[i + 1], stop)
        q = run_q[i]
        hit = _hits(vs[a - start : b - start], t - q, mask, wtmp, wflag)
        if hit.size:
            hit += a - start
            val = vs[hit]
            val += vdt(q)
            val_l.append(val)
            hit += start
            pos_l.append(hit)
            found += hit.size
        a, i = b, i + 1
    return found


def _costs_one(
    pos: NDArray[Any],
    val: NDArray[Any],
    kk: int,
    rem: NDArray[Any] | None,
    weight: int,
    order: NDArray[np.int64] | None,
) -> tuple[NDArray[np.int64], NDArray[np.integer]]:
    """Item ids and costs of one user's candidates, given by scan position and value v = dist + q
    (distinct items, holding every item whose v is at most the kk-th smallest); ``rem`` is the index's
    cost − B·v along the scan (None: the cost is v), ``weight`` B, ``order`` its scan order (None: the
    identity)."""
    if pos.size > 8 * kk + 256:
        # Only the candidates at or below the exact kk-th value go on to the costs and the selection.
        keep = (val <= np.partition(val, kk - 1)[kk - 1]).nonzero()[0]
        pos, val = pos[keep], val[keep]
    if rem is None:
        cost: NDArray[np.integer] = val
    else:
        cost = val.astype(rem.dtype) * rem.dtype.type(weight) + rem[pos]  # B·v + r
    return (pos.astype(np.int64, copy=False) if order is None else order[pos]), cost


def _hits(
    vs: NDArray[Any],
    t: int,
    mask: NDArray[np.bool_],
    wtmp: NDArray[np.uint64],
    wflag: NDArray[np.bool_],
) -> NDArray[np.intp]:
    """Positions of the values <= t, ascending.  From _GROUPED_COMPARE_MIN values on, the segment is
    read as _GROUPS rows of c = n // _GROUPS values and reduced to the minimum of each column (one
    vectorised pass, c values out); only the few columns whose minimum is <= t are then looked at,
    value by value in each row.  That is one pass over the values and a compare and a nonzero over
    n / _GROUPS minima, instead of a compare and a nonzero over n values.  ``wtmp`` holds the
    minima (at least n / _GROUPS values), ``wflag`` their flags."""
    n, R = vs.size, _GROUPS
    c = n // R
    if n < _GROUPED_COMPARE_MIN or c == 0:
        return np.less_equal(vs, t, out=mask[:n]).nonzero()[0]
    mins = np.minimum.reduce(vs[: c * R].reshape(R, c), axis=0, out=wtmp.view(vs.dtype)[:c])
    cols = np.less_equal(mins, t, out=wflag[:c]).nonzero()[0]
    if cols.size * R > n // 4:
        return np.less_equal(vs, t, out=mask[:n]).nonzero()[0]  # hits everywhere: compare them all
    hit = cols
    if cols.size:
        # Row j holds items j·c .. j·c + c − 1: row by row, then column by column, that is ascending.
        cand = (cols + np.arange(0, c * R, c)[:, None]).ravel()
        hit = cand[vs[cand] <= t]
    if c * R < n:
        tail = np.less_equal(vs[c * R :], t, out=mask[: n - c * R]).nonzero()[0]
        if tail.size:
            hit = np.concatenate((hit, tail + c * R))
    return hit


def _rank_subset(
    ix: HammingIndex, users: NDArray[np.uint64], cand: NDArray[np.int64]
) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
    """Every (user, candidate item) pair with its cost: the ``items=`` restriction."""
    if cand.ndim != 1:
        raise ValueError("candidates must be a 1-D array of item ids")
    if cand.size and (cand.min() < 0 or cand.max() >= ix.m):
        raise ValueError(f"candidate item index out of range [0, {ix.m})")
    cand = np.unique(cand)
    n = users.shape[0]
    dist = np.zeros((n, cand.size), np.int64)
    for j in range(ix.w):
        dist += np.bitwise_count(ix._words[j, cand][None, :] ^ users[:, j : j + 1])
    cost = dist * ix._B
    if ix._bias is not None and ix._levels is not None:
        cost += ix._top - ix._levels[cand].astype(np.int64)
    rows = np.repeat(np.arange(n, dtype=np.int64), cand.size)
    return rows, np.tile(cand, n), cost.ravel()
