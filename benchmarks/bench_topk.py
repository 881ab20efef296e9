"""Top-10 retrieval: XOR + popcount over packed binary codes vs float32 inner products.

Measures items/s of `device_sdk.topk.topk_hamming` at f = 64 and 128 against a float32 d = 32
inner-product top-10 (matrix-vector product + argpartition + sort of the 10) in the same run, for one
user, on one core.  Codes and embeddings are random (random codes give the usual spread of
distances; ties are still broken at random).

    python benchmarks/bench_topk.py                 # 10^5, 10^6, 10^7 items
    python benchmarks/bench_topk.py --sizes 1000000 --repeat 20
"""

from __future__ import annotations

import argparse
import os
import time
from functools import partial

import numpy as np

from device_sdk.topk import topk_hamming


def _best_of(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def float_topk(V: np.ndarray, u: np.ndarray, k: int) -> np.ndarray:
    scores = V @ u
    top = np.argpartition(scores, -k)[-k:]
    return top[np.argsort(-scores[top])]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[10**5, 10**6, 10**7])
    p.add_argument("--bits", type=int, nargs="+", default=[64, 128])
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument("--k", type=int, default=10)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    print(
        f"top-{args.k}, one user, median of {args.repeat} runs; OMP/BLAS threads: "
        f"{os.environ.get('OMP_NUM_THREADS', 'default')}"
    )
    print(f"{'items':>10} {'method':<24} {'ms':>9} {'M items/s':>10} {'vs float32':>10}")
    for m in args.sizes:
        V = rng.standard_normal((m, 32), dtype=np.float32)
        u = rng.standard_normal(32, dtype=np.float32)
        t_float = _best_of(partial(float_topk, V, u, args.k), args.repeat)
        print(f"{m:>10} {'float32 d=32 inner prod':<24} {t_float * 1e3:>9.2f} {m / t_float / 1e6:>10.0f} {'1.0x':>10}")
        for f in args.bits:
            w = (f + 63) // 64
            words = rng.integers(0, 2**63, size=(w, m), dtype=np.uint64) ^ rng.integers(
                0, 2, size=(w, m), dtype=np.uint64
            ) << np.uint64(63)
            user = rng.integers(0, 2**63, size=w, dtype=np.uint64)
            t_bin = _best_of(partial(topk_hamming, user, words, f, args.k, rng), args.repeat)
            print(
                f"{m:>10} {f'hamming f={f}':<24} {t_bin * 1e3:>9.2f} {m / t_bin / 1e6:>10.0f} {t_float / t_bin:>9.1f}x"
            )


if __name__ == "__main__":
    main()
