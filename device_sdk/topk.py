"""Top-k retrieval in Hamming space: XOR + popcount over packed, word-major codes, with an optional
per-item term, for one user or a batch of users in one scan.

Invariants:
- Item codes are (w, m) uint64 words (see `device_sdk.codes`); user codes are (w,) words, or (n, w)
  for a batch of n users.
- The ranking score of item i for user u is the integer
      score_ui = (f − dist(b_u, d_i)) · B + level_i,
  with B = ``weight`` >= 1 and level_i = ``levels[i]`` in 0..255 (0 when there are no levels);
  higher is better.  Internally the scan works on the cost c_ui = dist · B + (L − level_i), with L the
  highest level, so that score = f·B + L − c: costs are small integers in [0, f·B + L] and the k-th
  smallest is found by counting (a histogram per user), never by sorting or partitioning floats.
- The scan runs over blocks that stay in cache.  Each block is filtered against each user's running
  threshold τ (the k-th smallest cost seen so far is an upper bound on the final k-th, so every item
  with cost ≤ τ is kept, ties included).  With levels, the index stores the codes reordered by level,
  highest first: a block's items then all have level ≤ the level of its first item, so
  dist ≤ (τ − (L − level_first)) // B is a necessary condition checked on the raw distances, and the
  scan stops once no user can take any item of the remaining (lower-level) blocks.
- One user's search of a large f = 64 catalogue does not scan: it probes multi-index hashing tables
  (`_SubstringTables`, built on the first such search) for the buckets that must hold every item at
  or below a threshold, and falls back to the scan when the bucket counts say that would cost too
  much (dense buckets of clustered codes).  The candidates are the same set the scan would keep.
- Excluded items (already rated, filtered) are removed only at the end; the threshold counts
  k + |excluded| items per user, which is still an upper bound on the k-th eligible cost.
- Ties at the k-th score are broken uniformly at random with the caller's generator (or by the lower
  item id when no generator is given); results come best first, equal scores in random order.
"""

from __future__ import annotations

import bisect
import functools
import math
import statistics
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = ["PLANE_PAD", "HammingIndex", "hamming_distances", "plane_scores", "topk_hamming"]

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
# Plane scans of a batch: user-item pairs per block (the XOR buffer, 8 bytes a pair, stays in L2), and
# items per user row in a block, at least (numpy's inner loop runs once per row).
_PLANE_PAIRS = 1 << 17
# Items of a plane scan's head, whose exact costs set the first thresholds.
_PLANE_HEAD = 2048
# Catalogues from which one user's plane search takes the high-plane byte bound when it saves a popcount
# (below, the single-user scan's fewer fixed costs win: 10^5 items, P = 3, 0.34 vs 0.46 ms; 10^6, 4.5 vs 3.5).
_PLANE_BOUND_MIN = 1 << 19
# Users per scan of a batched plane search (see `search_planes_batch`).
_PLANE_GROUP = 16
# Items per block of a single-user plane scan (its per-block calls weigh more than the cache misses).
_PLANE_ITEMS = 1 << 18
_PLANE_ROW_ITEMS = 256
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
# One plane user's search takes the substring tables from 2^18 items: the plane scan costs about 2x the
# Hamming one, so they pay earlier (2^18 random items, k = 10, 60 users: 0.46-0.71 ms against 0.72-1.18 ms
# for the scan; 1.5x10^5: 0.66 against 0.69; 10^5: 0.42 against 0.30).  A batch of plane users takes
# them from _MIH_MIN, where it was measured.
_PLANE_MIH_MIN = 1 << 18
_PLANE_MIH_SAMPLE = 2048  # the plane substring search's even sample of the catalogue (its first T, a bound)
_PLANE_MIH_MARGIN = 1.0  # its first T: where the fit puts the catalogue's (margin·kk)-th value
_PLANE_MIH_STEP = 0.25  # T's first growth step, in the sample's standard deviations
_BYTE_VALUES = np.arange(256, dtype=np.uint64)
_MIH_REACH = 4  # how far above its last step T may jump in its last round (see `_substring_one`)
_SUB_BITS = 16  # 4 substrings of 16 bits
_SUB_N = 1 << _SUB_BITS
# Every 16-bit mask, by popcount; the masks of popcount < r are _MASKS[: _MASK_AT[r]].
_MASKS = np.argsort(np.bitwise_count(np.arange(_SUB_N, dtype=np.uint16)), kind="stable").astype(np.int32)
_MASK_AT = np.concatenate(([0], np.cumsum(np.bincount(np.bitwise_count(np.arange(_SUB_N, dtype=np.uint16)))))).tolist()
# The score of a padded slot of a batched plane search (no item there), and the largest cost.
PLANE_PAD = np.iinfo(np.int64).min
_COST_MAX = np.iinfo(np.int64).max


def hamming_distances(user_words: NDArray[np.uint64], item_words: NDArray[np.uint64]) -> NDArray[np.integer]:
    """Hamming distance from one packed user code (w,) to every packed item code (w, m)."""
    w, m = item_words.shape
    if user_words.shape != (w,):
        raise ValueError(f"user code has {user_words.shape} words, item codes have {w}")
    dist = np.bitwise_count(item_words[0] ^ user_words[0]).astype(np.uint16)
    for j in range(1, w):
        dist += np.bitwise_count(item_words[j] ^ user_words[j])
    return dist


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


class HammingIndex:
    """Packed item codes (and item levels) prepared for repeated top-k searches.

    Build it once per model version; `search` then allocates nothing proportional to the catalogue.

    Parameters
    ----------
    item_words : (w, m) uint64 packed item codes, word-major.
    f : code length in bits.
    levels : (m,) uint8 item levels (the item term), or None for none.
    weight : B >= 1, the weight of one bit of Hamming similarity against one level.
    substring_index : allow the exact multi-index (substring) search of one user (f = 64, catalogues
        of at least 786,432 items, 262,144 for a plane user; see `_SubstringTables`).  Its tables are
        built on the first such search and hold about 48 bytes an item (480 MB at 10^7 items) beside the
        8 of the codes; False keeps every search a linear scan and the index at the size of its codes.
        Results are the same either way.

    Raises
    ------
    ValueError
        If the shapes, the levels or the weight are invalid.
    """

    __slots__ = (
        "f",
        "m",
        "w",
        "weight",
        "_words",
        "_sorted",
        "_order",
        "_levels",
        "_bias",
        "_top",
        "_dt",
        "_local",
        "_score_table",
        "_lift",
        "_lift_runs",
        "_vmax",
        "_rem",
        "_mih",
        "_mih_lock",
        "_mih_allowed",
    )

    _score_table: NDArray[np.int32] | None  # score of every cost, when the costs are few
    _rem: NDArray[Any] | None  # cost − B·(dist + q) along the scan, in [0, B)
    _vmax: int  # the largest dist + q
    _lift: NDArray[np.unsignedinteger[Any]] | None  # the item term in whole bits, along the scan
    _lift_runs: tuple[list[int], list[int]]  # where each run of equal q starts along the scan, and its q
    _mih: _SubstringTables | None  # built on the first single-user search that takes it

    def __init__(
        self,
        item_words: NDArray[np.uint64],
        f: int,
        levels: ArrayLike | None = None,
        weight: int = 1,
        substring_index: bool = True,
    ) -> None:
        words = np.asarray(item_words)
        if words.dtype != np.uint64 or words.ndim != 2:
            raise ValueError(f"item codes must be (w, m) uint64 words, got {words.dtype} {words.shape}")
        if f < 1 or words.shape[0] != (f + 63) // 64:
            raise ValueError(f"{words.shape[0]} words per item do not hold codes of f = {f} bits")
        if int(weight) != weight or weight < 1:
            raise ValueError(f"hamming weight must be an integer >= 1, got {weight}")
        if not isinstance(substring_index, bool | np.bool_):
            raise ValueError(f"substring_index must be a bool, got {substring_index!r}")
        self._mih_allowed = bool(substring_index)
        self.f, self.w, self.m = int(f), words.shape[0], words.shape[1]
        self.weight = int(weight)
        self._words = words
        self._dt: type[np.unsignedinteger] = np.uint8 if f < 256 else np.uint16
        self._local = threading.local()
        self._mih, self._mih_lock = None, threading.Lock()
        lv = None if levels is None else _check_levels(levels, self.m)
        if lv is None or (lv.size and lv.min() == lv.max()):
            # A constant item term does not change the ranking: scan the codes as they are.
            self._levels = lv
            self._top = 0 if lv is None or lv.size == 0 else int(lv[0])
            self._sorted, self._order, self._bias, self._lift = words, None, None, None
            self._lift_runs = ([], [])
            self._score_table = self._score_of_cost(np.arange(self.f + 1, dtype=np.int64))
            self._vmax, self._rem = self.f, None
            return
        self._levels = lv
        self._top = int(lv.max())
        order = np.argsort(self._top - lv.astype(np.int16), kind="stable").astype(np.int64)
        self._order = order
        self._sorted = np.ascontiguousarray(words[:, order])
        # Costs fit int16 for any practical B (f·B + 255 < 2^15), where numpy sorts by counting.
        cdt = np.int16 if self.f * self.weight + self._top < 2**15 else np.int64
        self._bias = (self._top - lv[order]).astype(cdt)  # ascending along the scan
        # The item term in whole bits, q = (L − level) // B, so that cost = B·(dist + q) + r with 0 <= r < B:
        # dist + q <= t is exactly cost <= B·t + B − 1 (see `_scan_one`).
        qmax = self._top // self.weight
        ldt = np.uint8 if self.f + qmax < 1 << 8 else np.uint16 if self.f + qmax < 1 << 16 else np.uint32
        self._lift = (self._bias // self.weight).astype(ldt)
        run_at = np.flatnonzero(np.diff(self._lift, prepend=self._lift[:1] + 1) != 0)  # at most 256 runs
        self._lift_runs = (run_at.tolist(), self._lift[run_at].astype(np.int64).tolist())
        self._vmax = self.f + qmax  # the largest dist + q
        self._rem = self._bias % self.weight  # r = (L − level) − B·q, in [0, B)
        nb = self.f * self.weight + self._top + 1
        self._score_table = self._score_of_cost(np.arange(nb, dtype=np.int64)) if nb <= 1 << 16 else None

    def __reduce__(self) -> tuple[type[HammingIndex], tuple[Any, ...]]:
        # Copies (copy.deepcopy of a model, pickling) rebuild the index from its inputs; the
        # per-thread scan buffers are a cache and are never copied.
        return (HammingIndex, (self._words, self.f, self._levels, self.weight, self._mih_allowed))

    @property
    def _B(self) -> int:
        """The internal cost weight: 1 when there is no item term (the ranking is then by distance)."""
        return 1 if self._bias is None else self.weight

    def _score_of_cost(self, cost: NDArray[np.integer]) -> NDArray[np.int32]:
        if self._bias is None:
            return ((self.f - cost) * self.weight + self._top).astype(np.int32)
        return (self.f * self.weight + self._top - cost).astype(np.int32)

    def search(
        self,
        user_words: NDArray[np.uint64],
        k: int,
        rng: np.random.Generator | None,
        *,
        exclude: Sequence[NDArray[np.int64] | None] | None = None,
        candidates: NDArray[np.int64] | None = None,
        block_pairs: int | None = None,
    ) -> tuple[NDArray[np.int64], NDArray[np.int32]]:
        """The k best items of every user by score, ties broken at random.

        Parameters
        ----------
        user_words : (n, w) uint64 packed user codes (or (w,) for one user, treated as n = 1).
        k : items wanted per user (>= 0).
        rng : tie-breaking generator; None breaks ties by the lower item id.
        exclude : per user, item ids never returned (None: nothing excluded for that user).
        candidates : if given, only these item ids are ranked.
        block_pairs : user-item pairs per scan block (default: 2^17 for a batch, 2^20 for one user,
            whose scan is cheaper per item and pays its per-block calls more often).

        Returns
        -------
        (ids, scores), both (n, k): item ids best first (-1 where fewer than k items are eligible)
        and their integer scores (f − dist)·B + level (-1 where padded).
        """
        users = np.asarray(user_words)
        if users.ndim == 1:
            users = users[None, :]
        if users.dtype != np.uint64 or users.ndim != 2 or users.shape[1] != self.w:
            raise ValueError(f"user codes must be (n, {self.w}) uint64 words, got {users.dtype} {users.shape}")
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        n = users.shape[0]
        if exclude is not None and len(exclude) != n:
            raise ValueError(f"exclude has {len(exclude)} rows for {n} users")
        excl = _exclusion_keys(exclude, n, self.m)
        if k == 0 or n == 0 or self.m == 0:
            return np.full((n, k), -1, np.int64), np.full((n, k), -1, np.int32)
        if candidates is not None:
            rows, ids, cost = self._rank_subset(users, np.asarray(candidates, dtype=np.int64))
        else:
            extra = [0] * n if exclude is None else [0 if e is None else len(e) for e in exclude]
            if n == 1:
                seg = _SEGMENT if block_pairs is None else max(int(block_pairs), 1)
                kk1 = min(k + extra[0], self.m)
                found = self._substring_one(users[0], kk1) if self._substring_ok() else None
                one_ids, one_cost = found if found is not None else self._scan_one(users[0], kk1, seg)
                return self._select_one(one_ids, one_cost, k, excl, rng)
            kk = np.minimum(k + np.asarray(extra, dtype=np.int64), self.m)
            pairs = _BLOCK_PAIRS if block_pairs is None else max(int(block_pairs), 1)
            if self._substring_ok():
                rows, ids, cost = self._substring_batch(users, kk, pairs)
            else:
                rows, ids, cost = self._scan(users, kk, pairs)
        return self._select(rows, ids, cost, n, k, excl, rng)

    def _buffers(
        self, cap: int
    ) -> tuple[NDArray[np.uint64], NDArray[np.integer], NDArray[np.uint8], NDArray[np.bool_], NDArray[np.integer]]:
        """Scan buffers of at least ``cap`` pairs (XOR words, distances, per-word popcounts, hit
        mask, distances plus item term in bits), kept per thread and reused across searches: a fresh
        multi-megabyte buffer would cost its page faults on every call."""
        held = getattr(self._local, "buffers", None)
        if held is None or held[0].size < cap:
            t_size = cap if (self.w > 1 or self._dt != np.uint8) else 0
            held = (
                np.empty(cap, np.uint64),
                np.empty(cap, self._dt),
                np.empty(t_size, np.uint8),
                np.empty(cap, np.bool_),
                np.empty(0, np.uint8) if self._lift is None else np.empty(cap, self._lift.dtype),
            )
            self._local.buffers = held
        return held

    # -- the scan ---------------------------------------------------------------------------------
    def _distances(
        self,
        users: NDArray[np.uint64],
        start: int,
        stop: int,
        x: NDArray[np.uint64],
        d: NDArray[np.integer],
        t: NDArray[np.uint8],
    ) -> NDArray[np.integer]:
        """Distances (n, stop − start) of every user to the items of a block, written into the
        preallocated buffers ``x`` (XOR), ``d`` (distances) and ``t`` (per-word popcounts)."""
        size = stop - start
        n = users.shape[0]
        x = x[: n * size].reshape(n, size)
        d = d[: n * size].reshape(n, size)
        words = self._sorted
        if self.w == 1 and d.dtype == np.uint8:
            np.bitwise_xor(words[0, start:stop], users[:, :1], out=x)
            np.bitwise_count(x, out=d)
            return d
        t = t[: n * size].reshape(n, size)
        for j in range(self.w):
            np.bitwise_xor(words[j, start:stop], users[:, j : j + 1], out=x)
            np.bitwise_count(x, out=t)
            if j == 0:
                d[...] = t
            else:
                d += t
        return d

    def _scan(
        self, users: NDArray[np.uint64], kk: NDArray[np.int64], block_pairs: int
    ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
        """Candidates (row, item id, cost) holding, per user, every item whose cost is at most the
        kk-th smallest cost over the whole catalogue (ties included)."""
        n, m, B, f = users.shape[0], self.m, self._B, self.f
        nb = f * B + self._top + 1  # costs lie in [0, nb); nb itself means "no threshold yet"
        bias = self._bias
        step = max(block_pairs // n, min(_ROW_ITEMS, block_pairs))
        first = min(m, max(min(_FIRST_BLOCK // 2, step), int(kk.max()) * 4))
        x, d, t, mask, _ = self._buffers(n * max(first, step))
        # Bootstrap: each user's threshold from the costs of the first block, by counting.
        d0 = self._distances(users, 0, first, x, d, t)
        if bias is None or self._lift is None:
            tau = _tau(_row_hist(d0, nb), kk, nb)
            hits = np.flatnonzero(d0 <= np.minimum(tau, f).astype(d0.dtype)[:, None])
            cost0 = d0.ravel()[hits].astype(np.int64)
            r0, p0 = np.divmod(hits, first)
        else:
            # With the item term lifted into whole bits (see `_scan_one`): t_u the kk-th smallest
            # dist + q of the block, every item there of cost <= τ_u = B·t_u + B − 1 has dist + q <= t_u.
            lifted = d0 + self._lift[:first]
            nl = f + int(self._lift[first - 1]) + 1
            head = _tau(_row_hist(lifted, nl), kk, nl)
            tau = np.where(head >= nl, nb, B * head + B - 1)
            hits = np.flatnonzero(lifted <= np.minimum(head, nl - 1).astype(lifted.dtype)[:, None])
            r0, p0 = np.divmod(hits, first)
            cost0 = d0.ravel()[hits].astype(np.int64) * B + bias[p0].astype(np.int64)
        rows_l, pos_l, cost_l = [r0], [p0], [cost0]
        pending = hits.size
        budget = max(int(kk.sum()) * 2, 256)
        live = np.arange(n)
        users_live, lim, lim_max, uniform, lo, stale = users, np.zeros(n, np.int64), 0, True, 0, True
        lim_rows = np.zeros((n, 1), self._dt)
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
                lim_rows = np.minimum(lim, f).astype(self._dt)[:, None]
            dd = self._distances(users_live, start, stop, x, d, t)
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
        ids = pos if self._order is None else self._order[pos]
        return rows, ids, cost

    def _one_buffers(
        self, cap: int, chunk: int, vdt: type[np.unsignedinteger[Any]]
    ) -> tuple[
        NDArray[np.uint64], NDArray[np.uint8], NDArray[Any], NDArray[np.bool_], NDArray[np.uint64], NDArray[np.bool_]
    ]:
        """Single-user scan buffers, kept per thread and reused: XOR words and per-word popcounts of
        one chunk, the values v = dist + q of a segment of ``cap`` items, a hit mask over them, and
        the grouped compare's scratch (one uint64 and one flag per group column)."""
        held = getattr(self._local, "one_buffers", None)
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
            self._local.one_buffers = held
        return held

    def _fill(
        self,
        user: NDArray[np.uint64],
        start: int,
        stop: int,
        chunk: int,
        x: NDArray[np.uint64],
        tb: NDArray[np.uint8],
        out: NDArray[Any],
        lift: bool = True,
    ) -> None:
        """v_i = dist(b_u, d_i) + q_i for the items [start, stop) of the scan, into ``out``: one XOR and
        one popcount call per chunk and code word, then one add of the item term in whole bits (left
        out when ``lift`` is false: ``out`` then holds the distances)."""
        words, w = self._sorted, self.w
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
        if lift and self._lift is not None:
            np.add(out, self._lift[start:stop], out=out)

    def _scan_one(self, user: NDArray[np.uint64], kk: int, block: int) -> tuple[NDArray[np.int64], NDArray[np.integer]]:
        """`_scan` for a single user, with scalar thresholds and as few numpy calls as possible.

        The scan works on v_i = dist_i + q_i, q_i = (L − level_i) // B the item term in whole bits
        (q = 0 without one), so that cost_i = B·v_i + r_i with 0 <= r_i < B: with t the kk-th smallest
        v of some kk items, v_i <= t holds exactly when cost_i <= B·t + B − 1, which bounds the kk-th
        smallest cost.  So every item with v <= t is kept, t only falls, and the few candidates left
        are ranked by their exact costs.

        The first segment (up to _HEAD_SEGMENT items) is one XOR + popcount pass; its threshold is a
        low rank r of its 2048-item head, with r about 8·kk·2048 / (segment size), so that about 8·kk
        items pass rather than kk·(segment size)/2048 (when fewer than kk pass, the head's kk-th
        smallest is taken instead).  The kk-th smallest v of its candidates is the threshold of the
        rest of the catalogue, scanned in segments of ``block`` items, each compared through the
        minima of interleaved groups (see `_hits`); with an item term the values are not formed there:
        each run of equal q has its distances compared with t − q.  q only grows along the scan
        (codes sorted by level), so the scan stops at the first item whose q exceeds t."""
        m, f, lift = self.m, self.f, self._lift
        vdt: type[np.unsignedinteger[Any]] = np.uint8 if f < 256 else np.uint16
        if lift is not None:
            vdt = lift.dtype.type
        chunk = min(_CHUNK, max(block, 64))
        first = min(m, max(_FIRST_BLOCK, 4 * kk))  # >= kk, since kk <= m
        seg0 = min(m, max(first, min(block, _HEAD_SEGMENT)))
        x, tb, v, mask, wtmp, wflag = self._one_buffers(min(m, max(seg0, block)), chunk, vdt)
        # The head's rank-r and rank-kk values: the first bounds the hits, the second is always valid.
        r = min(kk, -(-8 * kk * first // seg0))
        vs = v[:seg0]
        self._fill(user, 0, seg0, chunk, x, tb, vs)
        head = np.sort(vs[:first], kind="stable")  # small ints: numpy's radix sort
        lo_t, t = int(head[r - 1]), int(head[kk - 1])
        pos = np.less_equal(vs, lo_t, out=mask[:seg0]).nonzero()[0]
        if pos.size < kk:
            pos = np.less_equal(vs, t, out=mask[:seg0]).nonzero()[0]
        val = vs[pos]
        start = seg0
        if start < m and (lift is None or int(lift[start]) <= t):
            # The kk-th smallest value of the candidates bounds the rest of the catalogue.
            t = int(np.partition(val, kk - 1)[kk - 1])
            if pos.size > 2 * kk:
                keep = (val <= t).nonzero()[0]
                pos, val = pos[keep], val[keep]
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
                self._fill(user, start, stop, chunk, x, tb, vs)
                hit = self._hits(vs, t, mask, wtmp, wflag)
                if hit.size:
                    val_l.append(vs[hit])
                    hit += start
                    pos_l.append(hit)
                    pending += hit.size
            else:
                # The distances alone, each run of equal q compared with t − q: no pass adding q.
                self._fill(user, start, stop, chunk, x, tb, vs, lift=False)
                run_at, run_q = self._lift_runs
                i = bisect.bisect_right(run_at, start) - 1
                a = start
                while a < stop:
                    b = stop if i + 1 >= len(run_at) else min(run_at[i + 1], stop)
                    q = run_q[i]
                    hit = self._hits(vs[a - start : b - start], t - q, mask, wtmp, wflag)
                    if hit.size:
                        hit += a - start
                        val = vs[hit]
                        val += vdt(q)
                        val_l.append(val)
                        hit += start
                        pos_l.append(hit)
                        pending += hit.size
                    a, i = b, i + 1
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
        return self._costs_one(pos, val, kk)

    def _costs_one(
        self, pos: NDArray[Any], val: NDArray[Any], kk: int
    ) -> tuple[NDArray[np.int64], NDArray[np.integer]]:
        """Item ids and costs of one user's candidates, given by scan position and value v = dist + q
        (distinct items, holding every item whose v is at most the kk-th smallest)."""
        if pos.size > 8 * kk + 256:
            # Only the candidates at or below the exact kk-th value go on to the costs and the selection.
            keep = (val <= np.partition(val, kk - 1)[kk - 1]).nonzero()[0]
            pos, val = pos[keep], val[keep]
        rem = self._rem
        if rem is None:
            cost: NDArray[np.integer] = val
        else:
            cost = val.astype(rem.dtype) * rem.dtype.type(self.weight) + rem[pos]  # B·v + r
        return (pos.astype(np.int64, copy=False) if self._order is None else self._order[pos]), cost

    def _substring_ok(self, minimum: int | None = None) -> bool:
        """Whether one user's search takes the substring tables: allowed, f = 64 and a catalogue of at
        least ``minimum`` items (default _MIH_MIN)."""
        least = _MIH_MIN if minimum is None else minimum
        return self._mih_allowed and self.f == 64 and self.m >= least and 4 * self.m < 1 << 31

    def _substring_tables(self) -> _SubstringTables:
        if self._mih is None:
            with self._mih_lock:
                if self._mih is None:
                    self._mih = _SubstringTables(self._sorted[0], self._lift, self._lift_runs)
        return self._mih

    def _substring_batch(
        self, users: NDArray[np.uint64], kk: NDArray[np.int64], block_pairs: int
    ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
        """`_scan`'s candidates (row, item id, cost) by one substring search per user; the users it
        gives up on are scanned together.  (10^6 random items, 100 users: 50-56 ms against 78-85 ms for
        the batched scan.)"""
        rows_l, ids_l, cost_l, rest = [], [], [], []
        for i in range(users.shape[0]):
            found = self._substring_one(users[i], int(kk[i]))
            if found is None:
                rest.append(i)
                continue
            ids_l.append(found[0])
            cost_l.append(found[1].astype(np.int64))
            rows_l.append(np.full(found[0].size, i, np.int64))
        if rest:
            back = np.asarray(rest, dtype=np.int64)
            r_rows, r_ids, r_cost = self._scan(users[back], kk[back], block_pairs)
            rows_l.append(back[r_rows])
            ids_l.append(r_ids)
            cost_l.append(r_cost)
        return np.concatenate(rows_l), np.concatenate(ids_l), np.concatenate(cost_l)

    def _substring_buffers(self, cap: int) -> tuple[NDArray[np.int64], NDArray[np.uint64], NDArray[np.uint8]]:
        """The substring search's buffers (entry indices, codes, distances of up to ``cap`` finds),
        kept per thread: fresh ones would cost their page faults on every search."""
        held = getattr(self._local, "mih_buffers", None)
        if held is None or held[0].size < cap:
            held = (np.empty(cap, np.int64), np.empty(cap, np.uint64), np.empty(cap, np.uint8))
            self._local.mih_buffers = held
        return held

    def _substring_one(self, user: NDArray[np.uint64], kk: int) -> tuple[NDArray[np.int64], NDArray[np.integer]] | None:
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
        tb = self._substring_tables()
        ng = len(tb.group_q)
        if ng == 0:
            return None  # every level group is small: the scan is the search
        word = user[0]
        vmax, r1, lift = self._vmax, _MIH_FIRST_RADIUS, self._lift

        def values(a: int, b: int) -> NDArray[Any]:
            return self._range_values(word, a, b)

        top, stop = vmax, self.m  # a bound on the kk-th value, and where the scan would stop at it
        if lift is not None:
            # The kk-th value of the scan's first items bounds the catalogue's; the codes are sorted by q,
            # so no item past `stop` (q > top) can be wanted.  When the scan would stop early there, it
            # is the cheaper search (a strong item term: the top-level items win).
            hv = self._range_values(word, 0, min(self.m, max(_FIRST_BLOCK, 4 * kk)))
            top = int(np.partition(hv, kk - 1)[kk - 1])
            stop = int(lift.searchsorted(lift.dtype.type(top), side="right"))
            if stop < _MIH_MIN:
                return None
        quarters = [(int(word) >> (_SUB_BITS * j)) & (_SUB_N - 1) for j in range(4)]
        limit = [int(_MIH_FALLBACK * (b - a)) for a, b in tb.spans]  # finds a group may gather
        buffers = self._substring_buffers(max(limit) + 1)
        est = np.zeros(vmax + 66)  # estimated items per value v (found ones weighted, scanned ones exact)
        scanned: list[tuple[int, NDArray[Any]]] = []
        occ = np.zeros(vmax + 66, np.int64)  # round 1's finds by a bound on v, each occurrence counted
        for a, b in tb.linear:
            if a >= stop:
                continue
            v = self._range_values(word, a, min(b, stop))
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
                if not self._scan_group(tb, g, values, live, scanned, stop):
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
                self._substring_finds(tb, tb.group_q[g], lift, idx, dist, cap, pos_l, val_l)

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
                found = tb.probe(
                    quarters, [t for t, _ in grow], [radius[t] + 1 for t, _ in grow], [r + 1 for _, r in grow]
                )
                state = (radius, spent, limit, live, scanned, stop, values)  # `scanned` is new each round
                if not self._probe_group(tb, g, grow, found, fetch, tb.group_q[g], lift, cap, state, pos_l, val_l):
                    return None
            pos, val, hit = _round_end(pos_l, val_l, scanned, cap, T, kk)
            scanned = []
            pos_l, val_l = [pos], [val]
            if hit is not None:
                return self._costs_one(*hit, kk)
            T += 1
            if turn == _MIH_ROUNDS - 2:
                # The last round: T jumps to the kk-th smallest value of the distinct items found (all at
                # most cap), which bounds the catalogue's kk-th, so that round's check holds.
                ids, at = np.unique(pos, return_index=True)
                if ids.size >= kk:
                    T = max(T, int(np.partition(val[at], kk - 1)[kk - 1]))
        return None

    def _probe_group(
        self,
        tb: _SubstringTables,
        g: int,
        grow: list[tuple[int, int]],
        found: tuple[NDArray[np.int64], NDArray[np.int64]],
        fetch: Callable[[NDArray[np.int64], NDArray[np.int64], int], tuple[NDArray[Any], NDArray[Any]]],
        q: int,
        lift: NDArray[Any] | _PlaneLift | None,
        cap: int,
        state: tuple[list[int], list[int], list[int], list[int], list[Any], int, Callable[[int, int], NDArray[Any]]],
        pos_l: list[NDArray[Any]],
        val_l: list[NDArray[Any]],
    ) -> bool:
        """Group g's tables probed out to the radii ``grow`` ((table, radius) pairs), whose new buckets
        are ``found`` (first entries, entries): their finds (``fetch(first, count, n)``: entry indices
        and distances) of value <= ``cap`` go to the lists; past the group's budget the group is scanned
        instead (False: the whole search should give up).  ``state`` is the search's (radius per table,
        finds spent and allowed per group, live groups, scanned ranges, stop, range values)."""
        radius, spent, limit, live, scanned, stop, values = state
        first, count = found
        n = int(count.sum())
        if spent[g] + n > limit[g]:
            return self._scan_group(tb, g, values, live, scanned, stop)
        spent[g] += n
        for t, r in grow:
            radius[t] = r
        if n:
            idx, dist = fetch(first, count, n)
            self._substring_finds(tb, q, lift, idx, dist, cap, pos_l, val_l)
        return True

    def _range_values(self, word: np.uint64, a: int, b: int) -> NDArray[Any]:
        """v = dist + q of the scan positions [a, b)."""
        v = np.bitwise_count(self._sorted[0, a:b] ^ word)
        return v if self._lift is None else v + self._lift[a:b]

    def _scan_group(
        self,
        tb: _SubstringTables,
        g: int,
        values: Callable[[int, int], NDArray[Any]],
        live: list[int],
        scanned: list[tuple[int, NDArray[Any]]],
        stop: int,
    ) -> bool:
        """Scan level group g (up to scan position ``stop``) instead of probing it (False: that is half
        the catalogue or more, so the whole linear scan, with its cheaper selection, should answer)."""
        a, b = tb.spans[g]
        b = min(b, stop)
        if 2 * (b - a) >= self.m:
            return False
        live.remove(g)
        scanned.append((a, values(a, b)))
        return True

    def _substring_finds(
        self,
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

    def _hits(
        self,
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

    # -- asymmetric (bit-plane) queries -----------------------------------------------------------
    def search_planes(
        self,
        plane_words: NDArray[np.uint64],
        user_weight: int,
        k: int,
        rng: np.random.Generator | None,
        *,
        level_shift: int = 8,
        exclude: ArrayLike | None = None,
        candidates: ArrayLike | None = None,
        block: int = _PLANE_ITEMS,
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """The k best items of one user held as P packed ±1 planes, by the integer plane score of
        `plane_scores` (S_i = a·Σ_p 2^p·(f − 2·H_p) + 2^s·level_i), ties broken at random.

        The selection counts on the weighted distance W_i = Σ_p 2^p·H_p (a small integer, at most
        f·(2^P − 1)): the cost 2a·W_i + 2^s·(L − level_i) (score = a·f·(2^P − 1) + 2^s·L − cost) is
        written 2a·(W_i + q_i) + r_i with q_i = 2^s·(L − level_i) // 2a and 0 <= r_i < 2a, so that a
        threshold t on W + q keeps exactly the items of cost <= 2a·t + 2a − 1; t starts as the kk-th
        smallest W + q of the head and only falls.  From 2^19 items on, when the planes but the lowest
        fit a byte (P = 3 at f = 64), the scan is instead `_scan_planes_batch`'s for one row (a byte
        bound from the high planes, one popcount fewer per item).  Either way the candidates go to
        `_plane_select`, so the result is a batch row's.

        Parameters
        ----------
        plane_words : (P, w) uint64, plane p weighing 2^p (`device_sdk.lightfr.sign_planes`, packed).
        user_weight : a >= 1 (`device_sdk.lightfr.snap_scale`).
        k : items wanted (>= 0).
        rng : tie-breaking generator; None breaks ties by the lower item id.
        level_shift : s, the weight 2^s of one item level.
        exclude : item ids never returned.
        candidates : if given, only these item ids are ranked.
        block : items per scan block (the single row's ``block_pairs``).

        Returns
        -------
        (ids, scores): up to k item ids best first (fewer when fewer are eligible) and their int64
        scores S, equal scores in uniformly random order.
        """
        planes = np.asarray(plane_words)
        if planes.dtype != np.uint64 or planes.ndim != 2 or planes.shape[1] != self.w or not 1 <= planes.shape[0] <= 8:
            raise ValueError(
                f"user planes must be (P, {self.w}) uint64 words with 1 <= P <= 8, got {planes.dtype} {planes.shape}"
            )
        if isinstance(user_weight, bool) or int(user_weight) != user_weight or user_weight < 1:
            raise ValueError(f"user weight must be an integer >= 1, got {user_weight!r}")
        s = _check_shift(level_shift)
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        a, P = int(user_weight), planes.shape[0]
        excl = None if exclude is None else _exclusion_keys([np.asarray(exclude, dtype=np.int64)], 1, self.m)
        if k == 0 or self.m == 0:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        if candidates is not None:
            ids = _check_candidates(candidates, self.m)
            wd = np.zeros(ids.size, np.int64)
            for p in range(P):
                for j in range(self.w):
                    wd += np.bitwise_count(self._words[j, ids] ^ planes[p, j]).astype(np.int64) << p
            cost = 2 * a * wd
            if self._bias is not None and self._levels is not None:
                cost += (self._top - self._levels[ids].astype(np.int64)) << s
        else:
            kk = min(k + (0 if excl is None else excl.size), self.m)
            found = self._substring_planes(planes, a, s, kk) if self._substring_ok(_PLANE_MIH_MIN) else None
            if found is not None:
                ids, cost = found
            elif self.m >= _PLANE_BOUND_MIN and self.f * (2**P - 1) >= 1 << 8 and self.f * (2 ** (P - 1) - 1) < 1 << 8:
                # The high planes' byte bound saves a popcount per item (P = 3 at f = 64): the batch's scan.
                one = np.array([kk], np.int64)
                _, ids, cost = self._scan_planes_batch(
                    planes[None], np.array([a], np.int64), s, one, max(int(block), 1)
                )
            else:
                ids, cost = self._scan_planes(planes, a, s, kk, min(max(int(block), 1), _BLOCK_PAIRS))
        top = np.array([a * self.f * (2**P - 1) + (self._top << s)], np.int64)
        out_ids, out_scores = _plane_select(
            np.zeros(ids.size, np.int64), ids, cost.astype(np.int64, copy=False), top, 1, k, self.m, excl, rng
        )
        ok = out_ids[0] >= 0
        return out_ids[0, ok], out_scores[0, ok]

    def _lift_planes(self, a: int, s: int) -> NDArray[np.unsignedinteger[Any]] | None:
        """q_i = 2^s·(L − level_i) // 2a along the scan (None without an item term), kept per thread
        for the last (a, s): a device ranks for one user at a time."""
        bias = self._bias
        if bias is None:
            return None
        held = getattr(self._local, "plane_lift", None)
        if held is not None and held[0] == (a, s):
            return held[1]
        segs = getattr(self._local, "level_runs", None)
        if segs is None:
            # Runs of equal cost term along the (level-sorted) scan: at most 256 of them.
            starts = np.flatnonzero(np.diff(bias, prepend=-1) != 0)
            segs = (bias[starts].astype(np.int64), np.diff(starts, append=bias.size))
            self._local.level_runs = segs
        qv = (segs[0] << s) // (2 * a)
        top = int(qv[-1]) + self.f * 255
        ldt = np.uint16 if top < 1 << 16 else np.uint32 if top < 1 << 32 else np.uint64
        lift = np.repeat(qv.astype(ldt), segs[1])
        self._local.plane_lift = ((a, s), lift)
        return lift

    def _plane_distances(
        self,
        planes: NDArray[np.uint64],
        start: int,
        stop: int,
        x: NDArray[np.uint64],
        t: NDArray[np.uint8],
        out: NDArray[Any],
    ) -> NDArray[Any]:
        """W = Σ_p 2^p·Hamming(c_p, d_i) for the items of a block, by Horner's rule from the top plane,
        into ``out`` (preallocated, wide enough for f·(2^P − 1))."""
        size = stop - start
        xs, ts, acc = x[:size], t[:size], out[:size]
        words = self._sorted
        for p in range(planes.shape[0] - 1, -1, -1):
            if p < planes.shape[0] - 1:
                np.left_shift(acc, 1, out=acc)
            for j in range(self.w):
                np.bitwise_xor(words[j, start:stop], planes[p, j], out=xs)
                if p == planes.shape[0] - 1 and j == 0:
                    np.bitwise_count(xs, out=acc)
                else:
                    np.add(acc, np.bitwise_count(xs, out=ts), out=acc)
        return acc

    def _scan_planes(
        self, planes: NDArray[np.uint64], a: int, s: int, kk: int, block: int
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """Candidates (item id, exact cost 2a·W + 2^s·(L − level)) holding every item whose cost is at
        most the kk-th smallest over the catalogue (ties included); see `search_planes`."""
        m, P, f = self.m, planes.shape[0], self.f
        block = max(int(block), 1)
        size = min(m, max(block, 4 * kk))
        first = min(size, max(_FIRST_BLOCK, 4 * kk))  # >= kk, since kk <= m
        lift = self._lift_planes(a, s)
        wmax = f * (2**P - 1) + (0 if lift is None else int(lift[-1]))
        wdt = np.uint8 if wmax < 1 << 8 else np.uint16 if wmax < 1 << 16 else np.uint32 if wmax < 1 << 32 else np.uint64
        cap = max(size, block)
        held = getattr(self._local, "plane_buffers", None)
        if held is None or held[0].size < cap or held[2].dtype != wdt:
            held = (np.empty(cap, np.uint64), np.empty(cap, np.uint8), np.empty(cap, wdt), np.empty(cap, np.bool_))
            self._local.plane_buffers = held
        x, t, wbuf, mask = held
        pos_l: list[NDArray[np.int64]] = []
        val_l: list[NDArray[Any]] = []
        pending, budget, thr = 0, max(8 * kk, 256), -1
        start = 0
        while start < m:
            stop = size if start == 0 else min(start + block, m)
            if lift is not None and start and int(lift[start]) > thr:
                break  # q only grows along the scan and W >= 0: no later item is under the threshold
            wd = self._plane_distances(planes, start, stop, x, t, wbuf)
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
        return self._plane_costs(pos, val, a, s, kk, lift)

    def _plane_costs(
        self, pos: NDArray[Any], val: NDArray[np.int64], a: int, s: int, kk: int, lift: NDArray[Any] | _PlaneLift | None
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """Item ids and exact costs of one plane user's candidates, given by scan position and value
        v = W + q (distinct items, holding every item whose v is at most the kk-th smallest)."""
        if val.size > 4 * kk + 64:
            keep = (val <= np.partition(val, kk - 1)[kk - 1]).nonzero()[0]
            pos, val = pos[keep], val[keep]
        bias = self._bias
        if lift is None or bias is None:
            cost = 2 * a * val
        else:
            cost = 2 * a * (val - lift[pos]) + (bias[pos].astype(np.int64) << s)
            if cost.size > 4 * kk + 64:
                keep = (cost <= np.partition(cost, kk - 1)[kk - 1]).nonzero()[0]
                pos, cost = pos[keep], cost[keep]
        return (pos.astype(np.int64, copy=False) if self._order is None else self._order[pos]), cost

    def _substring_planes(
        self, planes: NDArray[np.uint64], a: int, s: int, kk: int
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
        tb = self._substring_tables()
        ng = len(tb.group_q)
        if ng == 0:
            return None
        P, m = planes.shape[0], self.m
        pw = planes[:, 0]
        words = self._sorted[0]
        bias = self._bias
        # q = 2^s·(L − level) // 2a of just the positions read (`_lift_planes` would build it for every
        # item, 0.06 ms at 10^6, whenever a changes, as it does from user to user).
        lift = None if bias is None else _PlaneLift(bias, a, s)
        rmax = _SUB_BITS * (2**P - 1)  # the largest W_j

        def weigh(codes: NDArray[np.uint64]) -> NDArray[np.uint16]:
            acc = np.bitwise_count(codes ^ pw[P - 1]).astype(np.uint16)
            for p in range(P - 2, -1, -1):
                np.add(acc, acc, out=acc)
                np.add(acc, np.bitwise_count(codes ^ pw[p]), out=acc)
            return acc

        def values(lo: int, hi: int) -> NDArray[Any]:
            w = weigh(words[lo:hi])
            return w if lift is None else w + lift[lo:hi]

        head = min(m, max(_FIRST_BLOCK, 4 * kk))
        top = int(np.partition(values(0, head), kk - 1)[kk - 1])
        sample = np.arange(0, m, max(m // _PLANE_MIH_SAMPLE, 1))
        sv = weigh(words[sample]).astype(np.int64) + (0 if lift is None else lift[sample])
        if sv.size >= kk:
            top = min(top, int(np.partition(sv, kk - 1)[kk - 1]))
        stop = m if lift is None else lift.stop(top)
        if stop < _PLANE_MIH_MIN:
            return None
        gq = [0 if lift is None else int(lift[g0 : g0 + 1][0]) for g0, _ in tb.spans]
        sv = sv[sample < stop]
        mu, sd = float(sv.mean()), float(sv.std())
        z = statistics.NormalDist().inv_cdf(min(_PLANE_MIH_MARGIN * kk / stop, 0.5))
        T = min(max(int(mu + sd * z), 0), top)
        step = max(int(sd * _PLANE_MIH_STEP), 1)
        bands = _ByteBands(pw)
        limit = [int(_MIH_FALLBACK * (b - a0)) for a0, b in tb.spans]
        ib, cb, _ = self._substring_buffers(max(limit) + 1)
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
            return idx, weigh(codes)

        for _turn in range(_MIH_ROUNDS):
            for g in list(live):
                radii = bands.radii(T - gq[g] + 1, rmax)
                grow = [(4 * g + j, r) for j, r in enumerate(radii) if r > radius[4 * g + j]]
                if not grow:
                    continue
                found = tb.probe_buckets([t for t, _ in grow], [bands.band(t % 4, radius[t], r) for t, r in grow])
                state = (radius, spent, limit, live, scanned, stop, values)
                if not self._probe_group(tb, g, grow, found, fetch, gq[g], lift, top, state, pos_l, val_l):
                    return None
            pos, val, hit = _round_end(pos_l, val_l, scanned, top, T, kk, np.int64)
            scanned = []
            pos_l, val_l = [pos], [val]
            if hit is not None:
                return self._plane_costs(*hit, a, s, kk, lift)
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

    def search_planes_batch(
        self,
        plane_words: NDArray[np.uint64],
        user_weights: ArrayLike,
        k: int,
        rng: np.random.Generator | None,
        *,
        level_shift: int = 8,
        exclude: Sequence[ArrayLike | None] | None = None,
        candidates: ArrayLike | None = None,
        block_pairs: int = _PLANE_PAIRS,
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """`search_planes` for n users at once: each block of items is XORed and popcounted against
        the P planes of a group of up to 16 users in one call per plane and word ((users, items)
        buffers of about ``block_pairs`` pairs, in cache), each row held to its own threshold.  Row u
        gives exactly what ``search_planes(plane_words[u], user_weights[u], k, rng, ...)`` gives when
        called for u = 0, 1, ... in turn with the same generator (same candidates, same tie keys drawn
        in the same order).

        Parameters
        ----------
        plane_words : (n, P, w) uint64, every user's P planes (one P for the batch).
        user_weights : (n,) integers a_u >= 1.
        k, rng, level_shift, candidates : as in `search_planes`.
        exclude : per user, item ids never returned (None: nothing excluded for that user).
        block_pairs : user-item pairs per scan block.

        Returns
        -------
        (ids, scores), both (n, k): item ids best first (-1 where fewer than k items are eligible) and
        their int64 scores S (``PLANE_PAD`` where padded).
        """
        planes = np.asarray(plane_words)
        if planes.dtype != np.uint64 or planes.ndim != 3 or planes.shape[2] != self.w or not 1 <= planes.shape[1] <= 8:
            raise ValueError(
                f"user planes must be (n, P, {self.w}) uint64 words with 1 <= P <= 8, got {planes.dtype} {planes.shape}"
            )
        n, P = planes.shape[0], planes.shape[1]
        wa = np.asarray(user_weights)
        if wa.shape != (n,) or not np.issubdtype(wa.dtype, np.integer) or wa.dtype == np.bool_ or (n and wa.min() < 1):
            raise ValueError(f"user weights must be ({n},) integers >= 1, got {wa.dtype} {wa.shape}")
        a = wa.astype(np.int64)
        s = _check_shift(level_shift)
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        if exclude is not None and len(exclude) != n:
            raise ValueError(f"exclude has {len(exclude)} rows for {n} users")
        excl = _exclusion_keys(
            None if exclude is None else [None if e is None else np.asarray(e, dtype=np.int64) for e in exclude],
            n,
            self.m,
        )
        if k == 0 or n == 0 or self.m == 0:
            return np.full((n, k), -1, np.int64), np.full((n, k), PLANE_PAD, np.int64)
        if candidates is not None:
            ids = _check_candidates(candidates, self.m)
            wd = np.zeros((n, ids.size), np.int64)
            for p in range(P):
                for j in range(self.w):
                    wd += np.bitwise_count(self._words[j, ids][None, :] ^ planes[:, p, j : j + 1]).astype(np.int64) << p
            cost = 2 * a[:, None] * wd
            if self._bias is not None and self._levels is not None:
                cost += (self._top - self._levels[ids].astype(np.int64)) << s
            rows = np.repeat(np.arange(n, dtype=np.int64), ids.size)
            ids, cost = np.tile(ids, n), cost.ravel()
        else:
            extra = np.zeros(n, np.int64)
            if exclude is not None:
                extra[:] = [0 if e is None else np.asarray(e).size for e in exclude]
            kk = np.minimum(k + extra, self.m)
            # Groups of users, each one scan: long rows keep numpy's per-row call cost small (a
            # broadcast XOR over 16 rows of 8192 items runs ~3x faster per pair than over 100 of 1300).
            parts = []
            rest = np.arange(n, dtype=np.int64)
            if self._substring_ok():
                # One substring search per user (10^6 items, 100 users: 52 ms against 149 ms for the batched
                # scan); the users it gives up on are scanned together.
                left = []
                for u in range(n):
                    found = self._substring_planes(planes[u], int(a[u]), s, int(kk[u]))
                    if found is None:
                        left.append(u)
                    else:
                        parts.append((np.full(found[0].size, u, np.int64), found[0], found[1]))
                rest = np.asarray(left, dtype=np.int64)
            for g in range(0, rest.size, _PLANE_GROUP):
                sl = rest[g : g + _PLANE_GROUP]
                r, i, c = self._scan_planes_batch(planes[sl], a[sl], s, kk[sl], max(int(block_pairs), 1))
                parts.append((sl[r], i, c))
            rows, ids, cost = (np.concatenate(v) for v in zip(*parts, strict=True))
        top = a * (self.f * (2**P - 1)) + (self._top << s)
        return _plane_select(rows, ids, cost, top, n, k, self.m, excl, rng)

    def _plane_words(
        self,
        planes: NDArray[np.uint64],
        low: int,
        start: int,
        stop: int,
        x: NDArray[np.uint64],
        t: NDArray[Any],
        out: NDArray[Any],
    ) -> NDArray[Any]:
        """Σ_{p >= low} 2^(p − low)·Hamming(c_up, d_i), (n, stop − start), for every user u of ``planes``
        (n, P, w) and the items of a block, by Horner's rule from the top plane, into the flat buffers
        ``x`` (XOR), ``t`` (popcounts) and ``out`` (wide enough for the sum)."""
        n, P = planes.shape[0], planes.shape[1]
        size = stop - start
        xs, ts, acc = (b[: n * size].reshape(n, size) for b in (x, t, out))
        words = self._sorted
        for p in range(P - 1, low - 1, -1):
            if p < P - 1:
                np.add(acc, acc, out=acc)  # doubling: a shift by a scalar is several times slower in numpy
            for j in range(self.w):
                np.bitwise_xor(words[j, start:stop], planes[:, p, j : j + 1], out=xs)
                if p == P - 1 and j == 0:
                    np.bitwise_count(xs, out=acc)
                else:
                    np.add(acc, np.bitwise_count(xs, out=ts), out=acc)
        return acc

    def _plane_low(
        self, planes: NDArray[np.uint64], low: int, rows: NDArray[np.intp], pos: NDArray[np.intp]
    ) -> NDArray[np.int64]:
        """Σ_{p < low} 2^p·Hamming(c_up, d_i) for the (row, position) pairs of a few hits."""
        acc = np.zeros(pos.size, np.int64)
        for p in range(low):
            for j in range(self.w):
                h = np.bitwise_count(self._sorted[j, pos] ^ planes[rows, p, j])
                acc += h.astype(np.int64) << p
        return acc

    def _scan_planes_batch(
        self, planes: NDArray[np.uint64], a: NDArray[np.int64], s: int, kk: NDArray[np.int64], block_pairs: int
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
        n, P, m, f = planes.shape[0], planes.shape[1], self.m, self.f
        bias = self._bias  # the cost term is bias << s: only its values at block starts and hits are widened
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
        cap = n * max(first, step)
        held = getattr(self._local, "plane_batch_buffers", None)
        if held is None or held[0].size < cap or held[2].dtype != wdt or held[3].dtype != hdt:
            held = (
                np.empty(cap, np.uint64),
                np.empty(cap, np.uint8),
                np.empty(n * first, wdt),
                np.empty(cap, hdt),
                np.empty(cap, np.bool_),
            )
            self._local.plane_batch_buffers = held
        x, t, wbuf, hbuf, mask = held
        if wbuf.size < n * first:
            wbuf = np.empty(n * first, wdt)
        a2 = 2 * a
        # Head: every user's threshold, the kk-th smallest exact cost of the first items.
        w0 = self._plane_words(planes, 0, 0, first, x, t, wbuf)
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
            wh = self._plane_words(sub, low, start, stop, x, t, hbuf)
            mk = mask[: wh.size].reshape(wh.shape)
            np.less_equal(wh, lim, out=mk)
            hits = mk.ravel().nonzero()[0]
            if hits.size:
                r, c = np.divmod(hits, stop - start)
                rr = live[r]
                pos = c + start
                wd = wh.ravel()[hits].astype(np.int64)
                if low:
                    wd = (wd << low) + self._plane_low(planes, low, rr, pos)
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
        return rows, (pos if self._order is None else self._order[pos]), cost

    def _rank_subset(
        self, users: NDArray[np.uint64], cand: NDArray[np.int64]
    ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
        """Every (user, candidate item) pair with its cost: the ``items=`` restriction."""
        if cand.ndim != 1:
            raise ValueError("candidates must be a 1-D array of item ids")
        if cand.size and (cand.min() < 0 or cand.max() >= self.m):
            raise ValueError(f"candidate item index out of range [0, {self.m})")
        cand = np.unique(cand)
        n = users.shape[0]
        dist = np.zeros((n, cand.size), np.int64)
        for j in range(self.w):
            dist += np.bitwise_count(self._words[j, cand][None, :] ^ users[:, j : j + 1])
        cost = dist * self._B
        if self._bias is not None and self._levels is not None:
            cost += self._top - self._levels[cand].astype(np.int64)
        rows = np.repeat(np.arange(n, dtype=np.int64), cand.size)
        return rows, np.tile(cand, n), cost.ravel()

    # -- the final selection ----------------------------------------------------------------------
    def _select_one(
        self,
        ids: NDArray[np.int64],
        cost: NDArray[np.integer],
        k: int,
        excl: NDArray[np.int64] | None,
        rng: np.random.Generator | None,
    ) -> tuple[NDArray[np.int64], NDArray[np.int32]]:
        """`_select` for a single user: a random order, then a stable counting sort by cost."""
        ids, cost, order = _order_one(ids, cost, k, excl, rng)
        best = cost[order]
        table = self._score_table
        scores = table[best] if table is not None else self._score_of_cost(best.astype(np.int64))
        if order.size == k:
            return ids[order][None, :], scores[None, :]
        out_ids = np.full((1, k), -1, np.int64)
        out_scores = np.full((1, k), -1, np.int32)
        out_ids[0, : order.size] = ids[order]
        out_scores[0, : order.size] = scores
        return out_ids, out_scores

    def _select(
        self,
        rows: NDArray[np.int64],
        ids: NDArray[np.int64],
        cost: NDArray[np.int64],
        n: int,
        k: int,
        excl: NDArray[np.int64] | None,
        rng: np.random.Generator | None,
    ) -> tuple[NDArray[np.int64], NDArray[np.int32]]:
        """The k best candidates of every user, ties in uniformly random order (the candidates
        already hold every item at or below each user's k-th cost, so this is exact)."""
        out_ids = np.full((n, k), -1, np.int64)
        out_scores = np.full((n, k), -1, np.int32)
        if excl is not None and rows.size:
            keys = rows * self.m + ids
            at = np.searchsorted(excl, keys)
            ok = excl[np.minimum(at, excl.size - 1)] != keys
            rows, ids, cost = rows[ok], ids[ok], cost[ok]
        if rows.size == 0:
            return out_ids, out_scores
        # Order by (user, cost, random key): a uniformly random order among equal costs, so the
        # first k of a user take its ties at the threshold uniformly at random.
        key = ids if rng is None else rng.permutation(ids.size)
        if n == 1:
            order = np.lexsort((key, cost))[:k]
            out_ids[0, : order.size] = ids[order]
            out_scores[0, : order.size] = self._score_of_cost(cost[order])
            return out_ids, out_scores
        span, kspan = int(cost.max()) + 1, (self.m if rng is None else ids.size)
        if n * span * kspan < 1 << 62:
            # The same order as lexsort((key, cost, rows)), from one int64 key: one sort instead of three.
            order = np.argsort((rows * span + cost) * kspan + key)
        else:
            order = np.lexsort((key, cost, rows))
        rows, ids, cost = rows[order], ids[order], cost[order]
        rank = np.arange(rows.size) - np.searchsorted(rows, np.arange(n))[rows]
        sel = rank < k
        out_ids[rows[sel], rank[sel]] = ids[sel]
        out_scores[rows[sel], rank[sel]] = self._score_of_cost(cost[sel])
        return out_ids, out_scores


def _check_shift(level_shift: int) -> int:
    if isinstance(level_shift, bool) or int(level_shift) != level_shift or not 0 <= level_shift <= 16:
        raise ValueError(f"level shift must be an integer in [0, 16], got {level_shift!r}")
    return int(level_shift)


def _check_candidates(candidates: ArrayLike, m: int) -> NDArray[np.int64]:
    """The sorted unique ids of an ``items=`` restriction, validated."""
    cand = np.asarray(candidates, dtype=np.int64)
    if cand.ndim != 1:
        raise ValueError("candidates must be a 1-D array of item ids")
    if cand.size and (cand.min() < 0 or cand.max() >= m):
        raise ValueError(f"candidate item index out of range [0, {m})")
    return np.unique(cand)


def _row_kth(rows: NDArray[np.int64], cost: NDArray[np.int64], kk: NDArray[np.int64], n: int) -> NDArray[np.int64]:
    """Per row, the kk-th smallest cost of its (row, cost) pairs (int64 max when it has fewer)."""
    order = np.lexsort((cost, rows))
    srow, scost = rows[order], cost[order]
    starts = np.searchsorted(srow, np.arange(n))
    counts = np.diff(starts, append=srow.size)
    ok = counts >= kk
    at = np.minimum(starts + kk - 1, max(srow.size - 1, 0))
    return np.where(ok, scost[at] if scost.size else 0, _COST_MAX)


def _plane_select(
    rows: NDArray[np.int64],
    ids: NDArray[np.int64],
    cost: NDArray[np.int64],
    top: NDArray[np.int64],
    n: int,
    k: int,
    m: int,
    excl: NDArray[np.int64] | None,
    rng: np.random.Generator | None,
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """The k best candidates of every row, (n, k) ids (-1 padded) and scores top_u − cost (PLANE_PAD
    padded), for the plane searches, single or batched alike.

    The candidates of a row may be any superset of its eligible items at or below its k-th eligible
    cost; they are first cut to exactly that set (its canonical form, whatever scan found it), in
    (row, id) order, and the tie keys are then drawn from ``rng`` in that order, one uniform double
    per candidate: ordering by (cost, key) puts equal costs in uniformly random order, and a batch
    draws the very keys its rows would draw one call at a time.  Without a generator the lower id
    wins ties."""
    out_ids = np.full((n, k), -1, np.int64)
    out_scores = np.full((n, k), PLANE_PAD, np.int64)
    if excl is not None and rows.size:
        keys = rows * m + ids
        at = np.searchsorted(excl, keys)
        ok = excl[np.minimum(at, excl.size - 1)] != keys
        rows, ids, cost = rows[ok], ids[ok], cost[ok]
    if rows.size == 0:
        return out_ids, out_scores
    keep = cost <= _row_kth(rows, cost, np.full(n, k, np.int64), n)[rows]
    rows, ids, cost = rows[keep], ids[keep], cost[keep]
    order = np.lexsort((ids, rows))
    rows, ids, cost = rows[order], ids[order], cost[order]
    key = ids if rng is None else rng.random(ids.size)
    order = np.lexsort((key, cost, rows))
    rows, ids, cost = rows[order], ids[order], cost[order]
    rank = np.arange(rows.size) - np.searchsorted(rows, np.arange(n))[rows]
    sel = rank < k
    out_ids[rows[sel], rank[sel]] = ids[sel]
    out_scores[rows[sel], rank[sel]] = top[rows[sel]] - cost[sel]
    return out_ids, out_scores


def _check_levels(levels: ArrayLike, m: int) -> NDArray[np.uint8]:
    lv = np.asarray(levels)
    if lv.shape != (m,):
        raise ValueError(f"item levels must have shape ({m},), got {lv.shape}")
    if lv.dtype != np.uint8:
        if not np.issubdtype(lv.dtype, np.integer) or (lv.size and (lv.min() < 0 or lv.max() > 255)):
            raise ValueError("item levels must be integers in [0, 255]")
        lv = lv.astype(np.uint8)
    return lv


def _exclusion_keys(exclude: Sequence[NDArray[np.int64] | None] | None, n: int, m: int) -> NDArray[np.int64] | None:
    """Sorted unique keys row·m + item of every excluded (user, item) pair, or None."""
    if exclude is None:
        return None
    parts = []
    for row, e in enumerate(exclude):
        if e is None or len(e) == 0:
            continue
        items = np.asarray(e, dtype=np.int64).ravel()
        if items.min() < 0 or items.max() >= m:
            raise ValueError(f"excluded item id out of range [0, {m})")
        parts.append(items + row * m)
    return np.unique(np.concatenate(parts)) if parts else None


_Cost = TypeVar("_Cost", bound=np.integer)


def _order_one(
    ids: NDArray[np.int64],
    cost: NDArray[_Cost],
    k: int,
    excl: NDArray[np.int64] | None,
    rng: np.random.Generator | None,
) -> tuple[NDArray[np.int64], NDArray[_Cost], NDArray[np.intp]]:
    """One user's candidates without the excluded ids (sorted ``excl``), and the positions of its best
    ``k`` by cost: ties in a random order from ``rng``, or by lower id when ``rng`` is None."""
    if excl is not None and ids.size:
        at = np.searchsorted(excl, ids)
        ok = excl[np.minimum(at, excl.size - 1)] != ids
        ids, cost = ids[ok], cost[ok]
    if rng is None:
        order = np.lexsort((ids, cost))[:k]
    else:
        perm = rng.permutation(ids.size)
        order = perm[np.argsort(cost[perm], kind="stable")[:k]]
    return ids, cost, order


def _row_hist(cost: NDArray[np.integer], nb: int) -> NDArray[np.int64]:
    """(n, nb) histogram of each row of an (n, size) cost matrix."""
    n = cost.shape[0]
    if n == 1:
        return np.bincount(cost[0], minlength=nb)[None, :]
    offs = (np.arange(n, dtype=np.int64) * nb)[:, None]
    return np.bincount((cost + offs).ravel(), minlength=n * nb).reshape(n, nb)


def _pair_hist(rows: NDArray[np.int64], cost: NDArray[np.int64], n: int, nb: int) -> NDArray[np.int64]:
    """(n, nb) histogram of the costs of (row, cost) pairs."""
    if n == 1:
        return np.bincount(cost, minlength=nb)[None, :]
    return np.bincount(rows * nb + cost, minlength=n * nb).reshape(n, nb)


def _tau(hist: NDArray[np.int64], kk: NDArray[np.int64], nb: int) -> NDArray[np.int64]:
    """Per row, the smallest τ with at least kk of the row's costs ≤ τ (nb when it has fewer)."""
    cum = np.cumsum(hist, axis=1)
    tau = np.argmax(cum >= kk[:, None], axis=1)
    return np.where(cum[:, -1] >= kk, tau, nb)


def topk_hamming(
    user_words: NDArray[np.uint64],
    item_words: NDArray[np.uint64],
    f: int,
    k: int,
    rng: np.random.Generator | None,
    *,
    exclude: NDArray[np.int64] | None = None,
    candidates: NDArray[np.int64] | None = None,
    block: int | None = None,
) -> tuple[NDArray[np.int64], NDArray[np.int32]]:
    """The k items closest in Hamming distance to one user, ties broken uniformly at random.

    Parameters
    ----------
    user_words : (w,) uint64 packed user code.
    item_words : (w, m) uint64 packed item codes, word-major.
    f : code length in bits.
    k : number of items wanted (fewer are returned if fewer are eligible).
    rng : generator used for tie-breaking only (None: the lower item id wins).
    exclude : item indices never returned (already rated, filtered).
    candidates : if given, only these item indices are ranked.
    block : items per scan block (default: the index's own).

    Returns
    -------
    (item indices, distances), both sorted by distance; equal distances in random order.
    """
    w = item_words.shape[0]
    if np.shape(user_words) != (w,):
        raise ValueError(f"user code has {np.shape(user_words)} words, item codes have {w}")
    # One search of an index built for it: the substring tables would cost more than the scan they save.
    index = HammingIndex(item_words, f, substring_index=False)
    ids, scores = index.search(
        np.asarray(user_words)[None, :],
        k,
        rng,
        exclude=None if exclude is None else [np.asarray(exclude, dtype=np.int64)],
        candidates=candidates,
        block_pairs=block,
    )
    ok = ids[0] >= 0
    return ids[0, ok], (f - scores[0, ok]).astype(np.int32)


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
