"""How long decoding a request body holds the server's event loop (the aim: at most 50 ms).

Runs the server's own body decoder (`agg_server.app._decode`: in a worker thread above 4 KiB) on masked
inputs of several lengths and on a hostile body of 65,536 empty arrays, while a 1 ms ticker runs on the
loop; reports the ticker's longest gap (the stall) and the decode's duration, over ``--repeat`` runs, and
the most memory the decode allocated at once beyond the body itself (`tracemalloc`, one separate run).
Bodies are bytearrays, as the server reads them.

Run: ``PYTHONPATH=. python benchmarks/bench_decode_stall.py``.  Prints one JSON object per body.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import tracemalloc
from collections.abc import Awaitable, Callable

import msgpack
import numpy as np

from agg_server.app import SMALL_ROUTE_OBJECTS, _decode, _decode_and_hash
from protocol.codec import MAX_OBJECTS, encode
from protocol.messages import MaskedInput


async def _stall(work: Callable[[], Awaitable[object]]) -> tuple[float, float]:
    gaps: list[float] = []
    done = False

    async def ticker() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    start = time.perf_counter()
    try:
        await work()
    except Exception:  # noqa: BLE001, S110 - hostile bodies are refused; only the time matters here
        pass
    took = time.perf_counter() - start
    done = True
    await task
    return max(gaps), took


async def main(repeat: int) -> None:
    cases = []
    for length in (10**5, 10**6, 4 * 10**6, 16 * 2**20 - 64):
        body = encode(MaskedInput(round_id=1, device_id=1, session_id=b"\x01" * 32, masked=np.zeros(length, np.uint32)))
        cases.append((f"masked input L={length}", bytearray(body), 64))
    hostile = bytearray(msgpack.packb({"v": [1, 3], "t": 6, "b": {"p": [[]] * (MAX_OBJECTS - 20)}}))
    cases.append(("65,536 empty arrays, uncapped", hostile, MAX_OBJECTS))
    cases.append(("65,536 empty arrays, small-route cap", hostile, SMALL_ROUTE_OBJECTS))
    runs = [await _stall(lambda: asyncio.sleep(0.05)) for _ in range(repeat)]
    base = sorted(r[0] * 1e3 for r in runs)
    print(
        json.dumps(
            {
                "body": "none (baseline: the loop idles 50 ms)",
                "stall_ms_median": round(base[len(base) // 2], 1),
                "stall_ms_max": round(base[-1], 1),
            }
        ),
        flush=True,
    )
    for name, body, objects in cases:
        runs = [await _stall(lambda b=body, o=objects: _decode(b, len(b), o)) for _ in range(repeat)]
        stalls = sorted(r[0] * 1e3 for r in runs)
        took = sorted(r[1] * 1e3 for r in runs)
        tracemalloc.start()
        try:
            _decode_and_hash(body, len(body), objects)
        except Exception:  # noqa: BLE001, S110 - as above
            pass
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        print(
            json.dumps(
                {
                    "body": name,
                    "bytes": len(body),
                    "stall_ms_median": round(stalls[len(stalls) // 2], 1),
                    "stall_ms_max": round(stalls[-1], 1),
                    "decode_ms_median": round(took[len(took) // 2], 1),
                    "peak_alloc_mib": round(peak / 2**20, 1),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    asyncio.run(main(parser.parse_args().repeat))
