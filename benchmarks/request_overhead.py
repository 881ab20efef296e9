"""Server CPU per device request: one `fedrec-server` (SQLite, shipped defaults but for ``model.n_items``,
the cohort size and the registration burst)
answering authenticated ``GET /v1/model`` and ``POST /v1/checkin`` from many registered devices at once.

Every device request is authenticated against the database and read from the round coordinator, which run
on the server's state thread (off the event loop); this measures what that costs per request, as the
server process's CPU time (user + system, from /proc) over the requests, and the requests' wall-clock
latencies.  Run it against another checkout with ``PYTHONPATH=<checkout>`` to compare.

Run: ``PYTHONPATH=. python benchmarks/request_overhead.py --devices 200 --requests 4000``.
Prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedsim.fleets.server_process import ServerProcess, write_server_config  # noqa: E402
from protocol.codec import decode, encode  # noqa: E402
from protocol.messages import CheckIn, RegisterRequest  # noqa: E402

_MSGPACK = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _drive(url: str, devices: int, requests: int, concurrency: int, pid: int) -> dict[str, object]:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        tokens = []
        for _ in range(devices):
            body = encode(RegisterRequest(platform="bench"))
            async with session.post(f"{url}/v1/devices", data=body, headers=_MSGPACK) as r:
                reply = decode(await r.read())
                tokens.append((reply.device_id, reply.token))
        latencies: list[float] = []
        queue = list(range(requests))

        async def worker() -> None:
            while queue:
                i = queue.pop()
                device, token = tokens[i % devices]
                headers = {**_MSGPACK, "Authorization": f"Bearer {token}"}
                t0 = time.perf_counter()
                if i % 2:
                    async with session.get(f"{url}/v1/model", headers=headers) as r:
                        await r.read()
                        assert r.status == 200, r.status
                else:
                    body = encode(CheckIn(device_id=device))
                    async with session.post(f"{url}/v1/checkin", data=body, headers=headers) as r:
                        await r.read()
                        assert r.status == 200, r.status
                latencies.append(time.perf_counter() - t0)

        cpu0, t0 = _cpu_seconds(pid), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        cpu, wall = _cpu_seconds(pid) - cpu0, time.perf_counter() - t0
    latencies.sort()
    n = len(latencies)
    return {
        "requests": n,
        "server_cpu_s": round(cpu, 3),
        "server_cpu_ms_per_request": round(1000 * cpu / n, 3),
        "wall_s": round(wall, 2),
        "latency_p50_ms": round(1000 * latencies[n // 2], 2),
        "latency_p99_ms": round(1000 * latencies[int(0.99 * (n - 1))], 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=200)
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--concurrency", type=int, default=50)
    p.add_argument("--n-items", type=int, default=1682)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="fedrec-overhead-") as tmp:
        root = Path(tmp)
        config = root / "server.toml"
        # cohort_size above the fleet: no round opens, every check-in is answered "wait" at once.
        write_server_config(
            config,
            {
                "server": {"data_dir": str(root / "data"), "host": "127.0.0.1"},
                "model": {"n_items": args.n_items, "bits": 64},
                "rounds": {"cohort_size": args.devices + 100, "min_cohort": args.devices + 100},
                "enrollment": {"registration_burst": args.devices},  # the fleet registers at once
                "log": {"level": "warning"},
            },
        )
        with ServerProcess(config, root / "server.log") as server:
            assert server.proc is not None
            result = asyncio.run(_drive(server.url, args.devices, args.requests, args.concurrency, server.proc.pid))
    result["pythonpath"] = os.environ.get("PYTHONPATH", "")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
