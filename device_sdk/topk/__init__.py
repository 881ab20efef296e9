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

Layout (one module per search method behind the one `HammingIndex`, as faiss keeps a flat and a
multi-hash index over the same storage): `index` holds the state and the entry points, `scan` the
exhaustive Hamming scans, `substring` the substring tables and their search, `planes` the bit-plane
searches, `select` the final selection and the input checks.
"""

from __future__ import annotations

from device_sdk.topk.index import HammingIndex, topk_hamming
from device_sdk.topk.planes import plane_scores
from device_sdk.topk.scan import hamming_distances
from device_sdk.topk.select import PLANE_PAD

__all__ = ["PLANE_PAD", "HammingIndex", "hamming_distances", "plane_scores", "topk_hamming"]
