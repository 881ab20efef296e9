"""Cold start on the device: time and peak extra memory of `LightFRModel.fold_in` for a new user with
50 rated items, as the catalogue grows (f = 64, one core).

Fold-in solves DCD (LightFR eq. 18–19) on the codes of the items the user touched (its ratings and
the sampled negatives) only, so its cost is O(|Ω_u|·f) whatever the catalogue size; times are CPU
seconds of the calling thread (the machine may be shared); the peak is what numpy allocates during the
call (tracemalloc), on top of the model already in memory.

    python benchmarks/bench_fold_in.py                    # 10^5, 10^6, 10^7 items
    python benchmarks/bench_fold_in.py --sizes 1000000 --rated 200
    python benchmarks/bench_fold_in.py --unobserved-weight 0.1   # the all-items objective (item Gram)
    python benchmarks/bench_fold_in.py --unobserved-weight 0.1 --query-planes 2   # asymmetric: ridge solve, 2 planes
    python benchmarks/bench_fold_in.py --unobserved-weight 0.1 --rank-planes 0    # ±1 code only (no ranking vector)

Under the all-items objective the SDK's default (``rank_planes`` = 3) also solves the ranking vector
(one f × f ridge solve through the cached Gram) after the DCD fold-in.
"""

from __future__ import annotations

import argparse
import os
import time
import tracemalloc

import numpy as np

from device_sdk.models import LightFRConfig, LightFRModel


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[10**5, 10**6, 10**7])
    p.add_argument("--bits", type=int, default=64)
    p.add_argument("--rated", type=int, default=50)
    p.add_argument("--repeat", type=int, default=21)
    p.add_argument(
        "--unobserved-weight",
        type=float,
        default=0.0,
        help="w0 > 0: the all-items objective (fold-in through the item Gram, built once per model version)",
    )
    p.add_argument(
        "--query-planes",
        type=int,
        default=0,
        help="P >= 1 (with --unobserved-weight > 0): asymmetric scoring, the user's exact vector kept as P planes",
    )
    p.add_argument(
        "--rank-planes",
        type=int,
        default=LightFRConfig().rank_planes,
        help="planes of the ranking vector solved after a ±1 fold-in (all-items objective; 0 = rank with the code)",
    )
    args = p.parse_args()
    if args.query_planes and args.unobserved_weight <= 0:
        p.error("--query-planes needs --unobserved-weight > 0 (the all-items objective)")
    rng = np.random.default_rng(0)
    kind = f", {args.query_planes} query planes" if args.query_planes else f", rank planes {args.rank_planes}"
    print(
        f"fold_in of a user with {args.rated} rated items, f = {args.bits}, w0 = {args.unobserved_weight}{kind}; "
        f"load average {os.getloadavg()}"
    )
    print(f"{'items':>10} {'median CPU ms':>13} {'min ms':>8} {'peak MiB':>9}")
    for m in args.sizes:
        cfg = LightFRConfig(
            bits=args.bits,
            unobserved_weight=args.unobserved_weight,
            query_planes=args.query_planes,
            rank_planes=args.rank_planes,
        )
        model = LightFRModel(m, cfg, rng=np.random.default_rng(1))
        if args.unobserved_weight > 0:
            t = time.perf_counter()
            model.item_gram()
            print(f"{m:>10} item Gram, once per model version: {(time.perf_counter() - t) * 1e3:.0f} ms")
        times = []
        for _ in range(args.repeat):
            items = rng.choice(m, args.rated, replace=False)
            ratings = rng.integers(1, 6, args.rated).astype(float)
            t = time.thread_time()
            model.fold_in(items, ratings)
            times.append(time.thread_time() - t)
        tracemalloc.start()
        model.fold_in(rng.choice(m, args.rated, replace=False), rng.integers(1, 6, args.rated).astype(float))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        print(f"{m:>10} {np.median(times) * 1e3:>13.2f} {np.min(times) * 1e3:>8.2f} {peak / 2**20:>9.2f}", flush=True)
        del model


if __name__ == "__main__":
    main()
