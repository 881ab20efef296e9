"""Stage 1 of the two-stage ranking: the kk items of lowest Hamming cost of each user, with the item term
weighed per user, as the candidates a second stage re-scores (the user's bit-planes, or real-valued
embeddings: `device_sdk.realvalued`).

Invariants:
- The cost of item i for a user is the small integer v_i = dist(b, d_i) + q_i with q_i =
  ⌊(L − level_i)·λ⌋ (the item term in whole bits of distance, L the highest level), capped so that v
  fits its byte (f < 192; two bytes above): the catalogue's lowest levels then tie at the cap.  λ >= 0 is
  the user's own weight of one level against one bit (0: distance only).  The codes are read in the
  index's scan order (by level, highest first), so q is constant over each run of equal levels.
- The candidates of a user are every item of v at or below its kk-th smallest v, ties included, so the set
  does not depend on the generator (a batch row equals a one-user call); only when the ties would take
  it past 2·kk + 256 items are the tied ones drawn uniformly at random (the caller's generator, the lowest
  scan positions without one) to fill that cap.  Excluded items are not removed here: the caller asks
  for kk = C + |excluded| and drops them.
- One user's scan is XOR + popcount once per item (`device_sdk.topk.scan._fill`), the item term added
  once per stretch of equal q, a threshold read from an even sample of the catalogue (every s-th scan
  position, `Stage1Layout`: below 2^18 items the values just written, still in cache, read in place;
  from there the sample's codes held contiguously, so the threshold never reads the scan's buffer out of
  order), then a compare, raised one value at a time until kk pass (`_compare`): no histogram, sort or
  partition over the catalogue.  A batch runs the users' scans one after the other on the same buffers.
- With one-word codes (f <= 64) the scan XORs a per-thread copy of the codes in place (`_xored`, 8 bytes
  an item per thread that ranks; the same values as an XOR into a buffer, with less memory traffic: 0.75×
  the time of the chunked XOR into a buffer at 10^6 items).
- `without` drops a caller's excluded ids through a flag per item kept per thread, all False between
  calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from device_sdk.topk.scan import _CHUNK, _GROUPS, _fill, _one_buffers

if TYPE_CHECKING:
    from device_sdk.topk.index import HammingIndex

# Items of the even sample a threshold is read from, and how many items more than kk it aims to pass (a
# second compare at a higher threshold runs when fewer than kk pass).  A quantile of 250 in 10^6 read from
# 2048 items is rank 0.5: 8192 cut the hits of the first compare from ~1500 to ~600 there.
_SAMPLE = 8192
_SAMPLE_MIN = 2048  # a sample of m / 64 items between these two sizes
_MARGIN = 1.5
# Catalogues from which the pass over the values is the grouped compare (see `_compare`).
_GROUPED_MIN = 1 << 18


class Stage1Layout:
    """What stage 1 keeps of an index, built once: the runs of equal level along the scan (where each
    starts, and L − its level) and an even sample of the items, every ``stride``-th scan position (their
    packed codes contiguous, (w, s), and L − their level)."""

    __slots__ = ("starts", "gaps", "sample_words", "sample_gaps", "size", "stride", "vdt", "cap")

    def __init__(self, ix: HammingIndex) -> None:
        m = ix.m
        if ix._order is None or ix._levels is None:
            self.starts = np.zeros(0, np.int64)
            self.gaps = np.zeros(0, np.int64)
            gap_of_pos = None
        else:
            lv = ix._levels[ix._order].astype(np.int64)
            self.starts = np.flatnonzero(np.diff(lv, prepend=lv[0] + 1))
            self.gaps = ix._top - lv[self.starts]
            gap_of_pos = ix._top - lv
        self.stride = max(m // min(_SAMPLE, max(_SAMPLE_MIN, m // 64)), 1)
        at = np.arange(0, m, self.stride)
        self.size = at.size
        self.sample_words = np.ascontiguousarray(ix._sorted[:, at])
        self.sample_gaps = None if gap_of_pos is None else gap_of_pos[at].astype(np.float64)
        self.vdt: type[np.unsignedinteger[Any]] = np.uint8 if ix.f < 192 else np.uint16
        self.cap = int(np.iinfo(self.vdt).max) - ix.f  # the largest q a value can hold

    def lifts(self, lam: float, m: int) -> tuple[list[int], list[int], list[int]]:
        """(start, stop, q) of each stretch of the scan with one q = ⌊gap·λ⌋ > 0 (capped)."""
        if self.starts.size == 0 or lam <= 0:
            return [], [], []
        q = np.minimum(np.floor(self.gaps * lam).astype(np.int64), self.cap)
        change = np.flatnonzero(np.diff(q, prepend=-1))
        at, qs = self.starts[change], q[change]
        stops = np.append(at[1:], m)
        keep = qs > 0
        return at[keep].tolist(), stops[keep].tolist(), qs[keep].tolist()

    def sample_counts(self, user: NDArray[np.uint64], lam: float) -> NDArray[np.int64]:
        """c[t] = how many of the sample's items have v <= t, for t = 0 .. the sample's largest v."""
        d = np.bitwise_count(self.sample_words[0] ^ user[0])
        if self.sample_words.shape[0] > 1 or (self.sample_gaps is not None and lam > 0):
            d = d.astype(np.int64)
            for j in range(1, self.sample_words.shape[0]):
                d += np.bitwise_count(self.sample_words[j] ^ user[j])
            if self.sample_gaps is not None and lam > 0:
                d += np.minimum(np.floor(self.sample_gaps * lam), self.cap).astype(np.int64)
        return np.cumsum(np.bincount(d))


def _pick(pos: NDArray[np.intp], val: NDArray[Any], kk: int, rng: np.random.Generator | None) -> NDArray[np.intp]:
    """Among ``pos`` (>= kk of them), every position at or below the kk-th smallest value, ties included;
    when the ties would make more than `_tie_cap` (kk), the tied ones are drawn at random to fill it (the
    lowest positions without a generator)."""
    if pos.size <= kk:
        return pos
    t = np.partition(val, kk - 1)[kk - 1]
    keep = val <= t
    if int(np.count_nonzero(keep)) <= _tie_cap(kk):
        return pos[keep]
    below = pos[val < t]
    tied = pos[val == t]
    need = _tie_cap(kk) - below.size
    tied = tied[:need] if rng is None else tied[rng.choice(tied.size, need, replace=False)]
    return np.concatenate((below, tied))


def _tie_cap(kk: int) -> int:
    """The most candidates stage 1 keeps for kk wanted: ties at the kk-th value beyond it are drawn."""
    return 2 * kk + 256


def _compare(
    vs: NDArray[Any],
    t: int,
    kk: int,
    buffers: tuple[NDArray[np.bool_], NDArray[np.uint64], NDArray[np.bool_]],
) -> NDArray[np.intp]:
    """Positions of the values <= t (ascending), t raised by one until at least kk pass.

    Below _GROUPED_MIN values each try is one compare and one nonzero.  From there the values are read as
    _GROUPS rows of c = n // _GROUPS and reduced once to the minimum of each column (see
    `device_sdk.topk.scan._hits`); each try then compares the c minima and looks only at the columns whose
    minimum passes, so a second try costs a few microseconds, not a pass over the catalogue (10^6 values,
    ~400 hits: 53 µs against 114 µs for one compare and nonzero; 10^5: 20 against 13 µs)."""
    mask, wtmp, wflag = buffers
    n, top = vs.size, int(np.iinfo(vs.dtype).max)
    if n < _GROUPED_MIN:
        while True:
            pos = np.less_equal(vs, t, out=mask[:n]).nonzero()[0]
            if pos.size >= kk or t >= top:
                return pos
            t += 1
    R = _GROUPS
    c = n // R
    mins = np.minimum.reduce(vs[: c * R].reshape(R, c), axis=0, out=wtmp.view(vs.dtype)[:c])
    rows = np.arange(0, c * R, c)[:, None]
    tail = vs[c * R :]
    while True:
        cols = np.less_equal(mins, t, out=wflag[:c]).nonzero()[0]
        if cols.size * R > n // 4:  # hits everywhere: compare them all
            pos = np.less_equal(vs, t, out=mask[:n]).nonzero()[0]
        else:
            cand = (cols + rows).ravel()  # row by row, each ascending: ascending
            pos = cand[vs[cand] <= t]
            if tail.size:
                pos = np.concatenate((pos, np.flatnonzero(tail <= t) + c * R))
        if pos.size >= kk or t >= top:
            return pos
        t += 1


def _xored(ix: HammingIndex, word: np.uint64) -> NDArray[np.uint64]:
    """The one-word codes in scan order XOR ``word``: a copy kept per thread XOR the last user's word, moved
    to this one's by one XOR in place (no separate XOR buffer written and read back).  The copy is held
    away while it changes, so an interruption leaves none that is stale."""
    held = getattr(ix._local, "xored", None)
    ix._local.xored = None
    if held is None:
        held = (ix._sorted[0].copy(), np.zeros(1, np.uint64))
    codes, key = held
    np.bitwise_xor(codes, np.bitwise_xor(key[0], word), out=codes)
    key[0] = word
    ix._local.xored = held
    return codes


def candidates_one(
    ix: HammingIndex,
    layout: Stage1Layout,
    user: NDArray[np.uint64],
    kk: int,
    lam: float,
    rng: np.random.Generator | None,
) -> NDArray[np.int64]:
    """One user's candidates (item ids, at least min(kk, m), in no particular order); see the module
    docstring."""
    m = ix.m
    kk = min(kk, m)
    if kk <= 0:
        return np.zeros(0, np.int64)
    vdt = layout.vdt
    chunk = min(_CHUNK, m)
    one_word = ix.w == 1 and vdt == np.uint8
    x, tb, v, mask, wtmp, wflag = _one_buffers(ix, m, 1 if one_word else chunk, vdt)
    vs = v[:m]
    if one_word:  # one XOR in place and one popcount call
        np.bitwise_count(_xored(ix, user[0]), out=vs)
    else:
        _fill(ix._sorted, None, user, 0, m, chunk, x, tb, vs)
    for a, b, q in zip(*layout.lifts(lam, m), strict=True):
        np.add(vs[a:b], vdt(q), out=vs[a:b])
    if 4 * kk >= m:
        pos: NDArray[np.intp] = np.arange(m)
    else:
        if m < _GROUPED_MIN:  # the values just written are in cache: sample them in place
            counts = np.cumsum(np.bincount(vs[:: layout.stride]))
        else:
            counts = layout.sample_counts(user, lam)
        # The first threshold: where the sample puts about _MARGIN·kk items of the catalogue (a grouped
        # compare tries again cheaply, so it aims at kk there).
        margin = _MARGIN if m < _GROUPED_MIN else 1.0
        t = int(np.searchsorted(counts, margin * kk * layout.size / m))
        pos = _compare(vs, t, kk, (mask, wtmp, wflag))
    chosen = _pick(pos, vs[pos], kk, rng)
    return chosen.astype(np.int64) if ix._order is None else ix._order[chosen]


def without(ix: HammingIndex, ids: NDArray[np.int64], exclude: NDArray[np.int64]) -> NDArray[np.int64]:
    """``ids`` less the item ids in ``exclude`` (both within the catalogue), in their order: through a flag
    per item, kept per thread and all False between calls (four small calls, no sort)."""
    flags = getattr(ix._local, "flags", None)
    if flags is None:
        flags = ix._local.flags = np.zeros(ix.m, np.bool_)
    flags[exclude] = True
    try:
        out = ids[~flags.take(ids)]
    finally:
        flags[exclude] = False
    return out


def values_of(ix: HammingIndex, user: NDArray[np.uint64], lam: float, ids: NDArray[np.int64]) -> NDArray[np.int64]:
    """v = dist + ⌊(L − level)·λ⌋ (capped as the scan caps it) of the items ``ids``, (k,) int64: what the
    scan ranks them by."""
    v = np.zeros(ids.size, np.int64)
    for j in range(ix.w):
        v += np.bitwise_count(ix._words[j, ids] ^ user[j])
    if ix._levels is not None and lam > 0:
        cap = int(np.iinfo(np.uint8 if ix.f < 192 else np.uint16).max) - ix.f
        v += np.minimum(np.floor((ix._top - ix._levels[ids].astype(np.int64)) * lam), cap).astype(np.int64)
    return v


def candidates_subset(
    ix: HammingIndex,
    user: NDArray[np.uint64],
    kk: int,
    lam: float,
    rng: np.random.Generator | None,
    items: NDArray[np.int64],
) -> NDArray[np.int64]:
    """`candidates_one` over the items ``items`` only (sorted unique ids: the ``items=`` restriction)."""
    if items.size == 0 or kk <= 0:
        return np.zeros(0, np.int64)
    v = values_of(ix, user, lam, items)
    return items[_pick(np.arange(items.size), v, min(kk, items.size), rng)]
