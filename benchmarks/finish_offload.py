"""Does a worker thread keep the server's event loop responsive while a round finishes, or does it
need a process?  Measures the lateness of a 10 ms asyncio timer (what a /v1/health request waits for
the loop) while the CPU work of an unmask runs (a) on the loop, (b) in a thread, (c) in a process.

The work is the real kernels at the load test's scale: n = 1,000 survivors with 24-of-72 Shamir
reconstruction (`protocol.shamir.reconstruct`) and one self-mask expansion each, plus the pair masks of
--dropped devices with 72 neighbours each (`MaskedSumAccumulator`, AES-CTR over L = 3,706 x 64).

Run: ``python benchmarks/finish_offload.py [--survivors 1000] [--dropped 40]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import numpy as np

from protocol.masking import MaskedSumAccumulator
from protocol.shamir import reconstruct, split

L = 3706 * 64
T, K = 24, 72


def work(survivors: int, dropped: int) -> float:
    t0 = time.perf_counter()
    acc = MaskedSumAccumulator(L)
    session = os.urandom(32)
    shares = split(os.urandom(32), T, K)
    for u in range(survivors):
        acc.remove_self_mask(reconstruct(shares, T), session, u)
    for d in range(dropped):
        reconstruct(shares, T)
        for v in range(K):
            acc.remove_pair_mask(v, survivors + d, os.urandom(32))
    return time.perf_counter() - t0


async def lateness(run: object) -> dict[str, float]:
    late: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            await asyncio.sleep(0.01)
            late.append(time.perf_counter() - t0 - 0.01)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.2)
    seconds = await run()  # type: ignore[operator]
    stop.set()
    await task
    arr = np.array(late) * 1e3
    return {
        "work_s": round(seconds, 2),
        "ticks": int(arr.size),
        "late_p50_ms": round(float(np.percentile(arr, 50)), 2),
        "late_p99_ms": round(float(np.percentile(arr, 99)), 2),
        "late_max_ms": round(float(arr.max()), 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--survivors", type=int, default=1000)
    p.add_argument("--dropped", type=int, default=40)
    a = p.parse_args()
    threads = ThreadPoolExecutor(1)
    procs = ProcessPoolExecutor(1)
    procs.submit(int, 0).result()  # start the worker outside the measurement

    async def on_loop() -> float:
        return work(a.survivors, a.dropped)

    async def in_thread() -> float:
        return await asyncio.get_running_loop().run_in_executor(threads, work, a.survivors, a.dropped)

    async def in_process() -> float:
        return await asyncio.get_running_loop().run_in_executor(procs, work, a.survivors, a.dropped)

    out = {
        name: asyncio.run(lateness(fn))
        for name, fn in (("loop", on_loop), ("thread", in_thread), ("process", in_process))
    }
    print(json.dumps({"survivors": a.survivors, "dropped": a.dropped, "load": os.getloadavg()[0], **out}))
    threads.shutdown()
    procs.shutdown()


if __name__ == "__main__":
    main()
