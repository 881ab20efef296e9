"""A BLAS dot product of one LightFR update (3,706 items x 64 bits = 237,184 values, the size a device
clips before quantizing) alone and with 6 Python threads calling it at once, as a fleet's devices training
in worker threads do; with the process's default BLAS threads and with one (`fedsim.threads.one_blas_thread`).

Run: ``python benchmarks/bench_blas_threads.py``.  Prints milliseconds per call.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import time

import numpy as np

from fedsim.threads import one_blas_thread

CALLS = 50


def _norms(x: np.ndarray) -> None:
    for _ in range(CALLS):
        math.sqrt(float(np.dot(x, x)))


def _measure(x: np.ndarray) -> tuple[float, float]:
    _norms(x)  # warm up
    t0 = time.perf_counter()
    _norms(x)
    alone = (time.perf_counter() - t0) / CALLS * 1e3
    with cf.ThreadPoolExecutor(6) as pool:
        t0 = time.perf_counter()
        list(pool.map(lambda _: _norms(x), range(6)))
        threaded = (time.perf_counter() - t0) / (6 * CALLS) * 1e3
    return alone, threaded


def main() -> int:
    x = np.random.default_rng(0).standard_normal(3706 * 64)
    alone, threaded = _measure(x)
    print(f"default BLAS threads: {alone:.3f} ms alone, {threaded:.3f} ms per call with 6 threads")
    with one_blas_thread():
        alone, threaded = _measure(x)
    print(f"one BLAS thread:      {alone:.3f} ms alone, {threaded:.3f} ms per call with 6 threads")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
