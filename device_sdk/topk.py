"""Top-k retrieval in Hamming space: XOR + popcount over packed, word-major codes.

Invariants:
- Item codes are (w, m) uint64 words (see `device_sdk.codes`); a user code is (w,) words.
- Distances are small integers (0..f), so the k-th smallest is found by counting, not by sorting:
  a histogram gives the threshold distance τ, every item closer than τ is taken, and the remaining
  slots are filled from the items at exactly τ chosen uniformly at random with the caller's generator.
- The scan runs in blocks that stay in cache; each block is filtered against the running threshold
  while it is hot, so only a few candidates per block survive to the final selection.
- Scores are Hamming similarities 1 − dist/f (= sim(b, d) of LightFR eq. 4); higher is better.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

__all__ = ["hamming_distances", "topk_hamming"]

_BLOCK = 1 << 16


def _dist_dtype(f: int) -> type[np.unsignedinteger]:
    return np.uint8 if f < 255 else np.uint16


def hamming_distances(user_words: NDArray[np.uint64], item_words: NDArray[np.uint64]) -> NDArray[np.integer]:
    """Hamming distance from one packed user code (w,) to every packed item code (w, m)."""
    w, m = item_words.shape
    if user_words.shape != (w,):
        raise ValueError(f"user code has {user_words.shape} words, item codes have {w}")
    dist = np.bitwise_count(item_words[0] ^ user_words[0]).astype(np.uint16)
    for j in range(1, w):
        dist += np.bitwise_count(item_words[j] ^ user_words[j])
    return dist


def _kth_threshold(dist: NDArray[np.integer], k: int, nbins: int) -> int:
    """Smallest τ such that at least k of ``dist`` are ≤ τ (nbins − 1 if there are fewer)."""
    hist = np.bincount(dist, minlength=nbins)
    return int(np.searchsorted(np.cumsum(hist), k))


def topk_hamming(
    user_words: NDArray[np.uint64],
    item_words: NDArray[np.uint64],
    f: int,
    k: int,
    rng: np.random.Generator,
    *,
    exclude: NDArray[np.int64] | None = None,
    candidates: NDArray[np.int64] | None = None,
    block: int = _BLOCK,
) -> tuple[NDArray[np.int64], NDArray[np.int32]]:
    """The k items closest in Hamming distance, ties broken uniformly at random.

    Parameters
    ----------
    user_words : (w,) uint64 packed user code.
    item_words : (w, m) uint64 packed item codes, word-major.
    f : code length in bits.
    k : number of items wanted (fewer are returned if fewer are eligible).
    rng : generator used for tie-breaking only.
    exclude : item indices never returned (already rated, filtered).
    candidates : if given, only these item indices are ranked.
    block : items per scan block.

    Returns
    -------
    (item indices, distances), both sorted by distance; equal distances in random order.
    """
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    w, m = item_words.shape
    if user_words.shape != (w,):
        raise ValueError(f"user code has {user_words.shape} words, item codes have {w}")
    nbins = f + 1
    excl = np.unique(np.asarray(exclude, dtype=np.int64)) if exclude is not None else np.empty(0, np.int64)
    if candidates is not None:
        cand = np.asarray(candidates, dtype=np.int64)
        if cand.size and (cand.min() < 0 or cand.max() >= m):
            raise ValueError(f"candidate item index out of range [0, {m})")
        if excl.size:
            cand = cand[~np.isin(cand, excl)]
        dist = np.zeros(cand.size, dtype=np.uint16)
        for j in range(w):
            dist += np.bitwise_count(item_words[j, cand] ^ user_words[j])
        return _select(cand, dist, k, nbins, rng)
    if k == 0 or m == 0:
        return np.empty(0, np.int64), np.empty(0, np.int32)
    # Over-fetch by the number of excluded items: the best k eligible items are always among the
    # best k + |exclude| items overall once every tie at the threshold is kept.
    kk = min(k + excl.size, m)
    dt = _dist_dtype(f)
    found_idx: list[NDArray[np.int64]] = []
    found_dist: list[NDArray[np.integer]] = []
    n_found = 0
    tau = nbins  # running threshold: items farther than tau can never make the top kk
    buf = np.empty(min(block, m), dtype=np.uint64)
    dist = np.empty(min(block, m), dtype=dt)
    tmp = np.empty(min(block, m), dtype=np.uint8)
    for start in range(0, m, block):
        stop = min(start + block, m)
        size = stop - start
        b, d, t = buf[:size], dist[:size], tmp[:size]
        np.bitwise_xor(item_words[0, start:stop], user_words[0], out=b)
        np.bitwise_count(b, out=t)
        d[...] = t
        for j in range(1, w):
            np.bitwise_xor(item_words[j, start:stop], user_words[j], out=b)
            np.bitwise_count(b, out=t)
            d += t
        if tau >= nbins:
            # First block(s): derive the threshold from the block itself once it holds kk items.
            if n_found + size >= kk:
                tau = _kth_threshold(np.concatenate([*found_dist, d]).astype(np.intp), kk, nbins)
            keep = np.flatnonzero(d <= tau) if tau < nbins else np.arange(size)
        else:
            keep = np.flatnonzero(d <= tau)
        if keep.size:
            found_idx.append(keep + start)
            found_dist.append(d[keep].copy())
            n_found += keep.size
            if n_found > 4 * kk + 1024:
                # Tighten the threshold and drop what can no longer qualify.
                all_d = np.concatenate(found_dist)
                all_i = np.concatenate(found_idx)
                tau = _kth_threshold(all_d.astype(np.intp), kk, nbins)
                sel = all_d <= tau
                found_idx, found_dist = [all_i[sel]], [all_d[sel]]
                n_found = int(sel.sum())
    idx = np.concatenate(found_idx) if found_idx else np.empty(0, np.int64)
    dd = np.concatenate(found_dist).astype(np.uint16) if found_dist else np.empty(0, np.uint16)
    if excl.size:
        ok = ~np.isin(idx, excl)
        idx, dd = idx[ok], dd[ok]
    return _select(idx, dd, k, nbins, rng)


def _select(
    idx: NDArray[np.int64], dist: NDArray[np.integer], k: int, nbins: int, rng: np.random.Generator
) -> tuple[NDArray[np.int64], NDArray[np.int32]]:
    """Best k of (idx, dist) by distance, uniformly random among equal distances, sorted."""
    if idx.size == 0 or k == 0:
        return np.empty(0, np.int64), np.empty(0, np.int32)
    k = min(k, idx.size)
    tau = _kth_threshold(dist.astype(np.intp), k, nbins)
    below = np.flatnonzero(dist < tau)
    at = np.flatnonzero(dist == tau)
    need = k - below.size
    chosen = np.concatenate([below, rng.choice(at, size=need, replace=False)]) if need > 0 else below
    # Random order first, then a stable sort by distance: equal distances end up in random order.
    chosen = chosen[rng.permutation(chosen.size)]
    chosen = chosen[np.argsort(dist[chosen], kind="stable")]
    return idx[chosen].astype(np.int64), dist[chosen].astype(np.int32)
