"""The single-user substring (multi-index) search on trained LightFR codes and real users, against the
linear scan: how often it gives up, how many table entries it reads, and its CPU time.

LightFR is trained on amazon-book's train split (symmetric ±1 codes, the library's mean-field recipe,
`quality_amazon_lightfr.GRID[10]`, model seed 0, few rounds), then a seeded sample of users ranks the
24,915 items with their own ±1 codes, once with no item term and once with the trained levels, for
k = 10 and for k = 20 with the user's train items excluded.  The catalogue is below the size from which
`HammingIndex` takes the substring search, so the search is forced onto it (its size thresholds patched
down); both paths must give the same scores.

    python benchmarks/bench_topk_trained.py                  # 10 rounds, 1,500 users
    python benchmarks/bench_topk_trained.py --rounds 20 --users 3000

Times are `time.thread_time` per call, the two paths one after the other for each user.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402
from unittest import mock  # noqa: E402

import numpy as np  # noqa: E402

from device_sdk.codes import pack_signs  # noqa: E402
from device_sdk.topk import HammingIndex, scan, select, substring  # noqa: E402
from device_sdk.topk import index as topk_index  # noqa: E402
from fedsim.data.datasets import load_amazon_book  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from own_settings import own_settings  # noqa: E402
from quality_amazon_lightfr import GRID, train_lightfr  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--users", type=int, default=1500, help="seeded sample of users who rank")
    p.add_argument("--seed", type=int, default=0, help="user sample and tie-breaking seed")
    p.add_argument("--group-min", type=int, default=1 << 12, help="smallest level group given tables")
    args = p.parse_args()
    own_settings(
        "LightFR trained on amazon-book with the mean-field recipe and --rounds as given, for the search's "
        "timings"
    )
    train = load_amazon_book().train
    t = time.perf_counter()
    state = train_lightfr(train, GRID[10], args.rounds, 0)
    print(f"trained {args.rounds} rounds in {time.perf_counter() - t:.0f} s; load average {os.getloadavg()}")
    m = train.n_items
    words = pack_signs(state.item_codes)
    users = np.ascontiguousarray(pack_signs(state.user_codes).T)
    order = np.argsort(train.users, kind="stable")
    indptr = np.concatenate(([0], np.cumsum(np.bincount(train.users, minlength=train.n_users))))
    rated = train.items[order]
    rng = np.random.default_rng(args.seed)
    sample = rng.choice(users.shape[0], min(args.users, users.shape[0]), replace=False)
    lv = state.item_levels
    span = None if lv is None else (int(lv.min()), int(lv.max()))
    print(f"{m} items, f = 64, levels {span}, B = {state.hamming_weight}")
    real = substring._SubstringTables.expand
    read: list[int] = []  # entries each gather of a search read

    def counted(self: Any, *a: Any) -> Any:
        read.append(a[3])
        return real(self, *a)

    for name, levels in (("no item term", None), ("item term", lv)):
        for excluded, k in ((False, 10), (True, 20)):
            with (
                mock.patch.object(topk_index, "_MIH_MIN", 1),
                mock.patch.object(substring, "_MIH_MIN", 1),
                mock.patch.object(substring, "_MIH_GROUP_MIN", args.group_min),
            ):
                index = HammingIndex(words, 64, levels, state.hamming_weight)
                fraction, gave_up, t_sub, t_scan = [], 0, [], []
                for u in sample:
                    excl = rated[indptr[u] : indptr[u + 1]] if excluded else None
                    kk = min(k + (0 if excl is None else excl.size), m)
                    read.clear()
                    with mock.patch.object(substring._SubstringTables, "expand", counted):
                        gave_up += substring._substring_one(index, users[u], kk) is None
                    fraction.append(sum(read) / m)
                    ex = None if excl is None else [excl]
                    t0 = time.thread_time()
                    _, got = index.search(users[u], k, rng, exclude=ex)
                    t1 = time.thread_time()
                    ids, cost = scan._scan_one(index, users[u], kk, scan._SEGMENT)
                    keys = None if excl is None else np.unique(excl)
                    _, want = select._select_one(ids, cost, k, keys, rng, index._score_table, index._score_of_cost)
                    t2 = time.thread_time()
                    if not np.array_equal(got, want):
                        raise SystemExit("substring search and linear scan disagree on the scores")
                    t_sub.append(t1 - t0)
                    t_scan.append(t2 - t1)
                f = np.asarray(fraction)
                label = f"{name}, k = {k}" + (", train items excluded" if excluded else "")
                print(
                    f"{label}: gave up {gave_up}/{sample.size}; entries read / m median {np.median(f):.3f}, "
                    f"90th pct {np.quantile(f, 0.9):.3f}; substring {np.median(t_sub) * 1e6:.0f} us, "
                    f"scan {np.median(t_scan) * 1e6:.0f} us (medians)",
                    flush=True,
                )


if __name__ == "__main__":
    main()
