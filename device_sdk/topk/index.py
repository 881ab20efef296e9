"""`HammingIndex`: packed item codes (and item levels) held in scan order for repeated top-k searches, and
the entry points that pick a search method for each call.

Invariants:
- The index is immutable once built: the codes sorted by level (highest first) when there is an item
  term, the cost terms and their split into whole bits (`_lift`) and remainders (`_rem`) along that
  order.  Pickling and copies rebuild it from its inputs (`__reduce__`); the per-thread buffers and the
  substring tables are caches, never copied.
- Each entry point validates its arguments, chooses the method (the exhaustive scans of
  `device_sdk.topk.scan`, the substring search of `device_sdk.topk.substring`, the plane searches of
  `device_sdk.topk.planes`) and selects with `device_sdk.topk.select`; every method returns a superset
  of the same canonical candidates, so the choice never changes a result.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from device_sdk.topk.candidates import Stage1Layout, candidates_one, candidates_subset
from device_sdk.topk.planes import (
    _PLANE_BOUND_MIN,
    _PLANE_ITEMS,
    _PLANE_MIH_MIN,
    _PLANE_PAIRS,
    _plane_candidates,
    _plane_subset,
    _plane_subset_batch,
    _scan_planes,
    _scan_planes_batch,
    _substring_planes,
)
from device_sdk.topk.scan import _BLOCK_PAIRS, _SEGMENT, _rank_subset, _scan, _scan_one
from device_sdk.topk.select import (
    PLANE_PAD,
    _check_candidates,
    _check_levels,
    _check_shift,
    _exclusion_keys,
    _plane_select,
    _select,
    _select_one,
)
from device_sdk.topk.substring import _MIH_MIN, _substring_batch, _substring_one, _SubstringTables


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
        "_stage1",
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
        self._stage1: Stage1Layout | None = None
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
            rows, ids, cost = _rank_subset(self, users, np.asarray(candidates, dtype=np.int64))
        else:
            extra = [0] * n if exclude is None else [0 if e is None else len(e) for e in exclude]
            if n == 1:
                seg = _SEGMENT if block_pairs is None else max(int(block_pairs), 1)
                kk1 = min(k + extra[0], self.m)
                found = _substring_one(self, users[0], kk1) if self._substring_ok() else None
                one_ids, one_cost = found if found is not None else _scan_one(self, users[0], kk1, seg)
                return _select_one(one_ids, one_cost, k, excl, rng, self._score_table, self._score_of_cost)
            kk = np.minimum(k + np.asarray(extra, dtype=np.int64), self.m)
            pairs = _BLOCK_PAIRS if block_pairs is None else max(int(block_pairs), 1)
            if self._substring_ok():
                rows, ids, cost = _substring_batch(self, users, kk, pairs)
            else:
                rows, ids, cost = _scan(self, users, kk, pairs)
        return _select(rows, ids, cost, n, k, self.m, excl, rng, self._score_of_cost)

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

    def candidates(
        self,
        user_words: NDArray[np.uint64],
        kk: ArrayLike,
        lift: ArrayLike,
        rng: np.random.Generator | None,
        *,
        items: NDArray[np.int64] | None = None,
    ) -> NDArray[np.int64]:
        """Stage 1 of a two-stage ranking (`device_sdk.topk.candidates`): every user's items at or below its
        kk-th smallest v = dist + ⌊(L − level)·λ⌋, ties included up to 2·kk + 256 items (drawn beyond).

        Parameters
        ----------
        user_words : (n, w) uint64 packed user codes.
        kk : (n,) candidates wanted per user (>= 0).
        lift : (n,) λ >= 0 per user, the weight of one item level in bits of distance.
        rng : tie-breaking generator (None: the lowest scan positions win ties).
        items : if given, only these item ids are candidates.

        Returns
        -------
        (n, K) int64 item ids, row u holding its candidates (at least min(kk_u, m), in no particular order),
        then -1.
        """
        users = np.asarray(user_words)
        if users.dtype != np.uint64 or users.ndim != 2 or users.shape[1] != self.w:
            raise ValueError(f"user codes must be (n, {self.w}) uint64 words, got {users.dtype} {users.shape}")
        n = users.shape[0]
        want = np.asarray(kk, dtype=np.int64).reshape(-1)
        lam = np.asarray(lift, dtype=np.float64).reshape(-1)
        if want.shape != (n,) or lam.shape != (n,):
            raise ValueError(f"kk and lift must hold one value per user ({n}), got {want.shape} and {lam.shape}")
        if n and (want.min() < 0 or not np.all(np.isfinite(lam)) or lam.min() < 0):
            raise ValueError("kk must be >= 0 and lift a finite value >= 0 for every user")
        if items is not None:
            items = _check_candidates(items, self.m)  # sorted, unique, in range
        found = []
        for u in range(n):  # each user one vectorised scan over the index's buffers
            if items is None:
                found.append(self._candidates_one(users[u], int(want[u]), float(lam[u]), rng))
            else:
                found.append(candidates_subset(self, users[u], int(want[u]), float(lam[u]), rng, items))
        out = np.full((n, max((ids.size for ids in found), default=0)), -1, np.int64)
        for u, ids in enumerate(found):
            out[u, : ids.size] = ids
        return out

    def _candidates_one(
        self, user: NDArray[np.uint64], kk: int, lam: float, rng: np.random.Generator | None
    ) -> NDArray[np.int64]:
        """`candidates` of one user, (w,) words, over the whole catalogue, arguments unchecked: its ids."""
        if self._stage1 is None:
            self._stage1 = Stage1Layout(self)
        return candidates_one(self, self._stage1, user, kk, lam, rng)

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
        fit a byte (P = 3 at f = 64), the scan is instead `planes._scan_planes_batch`'s for one row (a byte
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
            cost = _plane_subset(self, planes, a, s, ids)
        else:
            kk = min(k + (0 if excl is None else excl.size), self.m)
            found = _substring_planes(self, planes, a, s, kk) if self._substring_ok(_PLANE_MIH_MIN) else None
            if found is not None:
                ids, cost = found
            elif self.m >= _PLANE_BOUND_MIN and self.f * (2**P - 1) >= 1 << 8 and self.f * (2 ** (P - 1) - 1) < 1 << 8:
                # The high planes' byte bound saves a popcount per item (P = 3 at f = 64): the batch's scan.
                one = np.array([kk], np.int64)
                _, ids, cost = _scan_planes_batch(
                    self, planes[None], np.array([a], np.int64), s, one, max(int(block), 1)
                )
            else:
                ids, cost = _scan_planes(self, planes, a, s, kk, min(max(int(block), 1), _BLOCK_PAIRS))
        top = np.array([a * self.f * (2**P - 1) + (self._top << s)], np.int64)
        out_ids, out_scores = _plane_select(
            np.zeros(ids.size, np.int64), ids, cost.astype(np.int64, copy=False), top, 1, k, self.m, excl, rng
        )
        ok = out_ids[0] >= 0
        return out_ids[0, ok], out_scores[0, ok]

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
            rows, ids, cost = _plane_subset_batch(self, planes, a, s, _check_candidates(candidates, self.m))
        else:
            extra = np.zeros(n, np.int64)
            if exclude is not None:
                extra[:] = [0 if e is None else np.asarray(e).size for e in exclude]
            kk = np.minimum(k + extra, self.m)
            rows, ids, cost = _plane_candidates(self, planes, a, s, kk, block_pairs, self._substring_ok())
        top = a * (self.f * (2**P - 1)) + (self._top << s)
        return _plane_select(rows, ids, cost, top, n, k, self.m, excl, rng)


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
