"""How long a server's event loop stalls while it adopts a new revocation list of n keys (protocol 1.5).

A real server runs in a child process (loopback HTTP, 1,000 certified devices on SQLite, the list in
``enrollment.revocation_list``).  The parent keeps one ``GET /v1/health`` in flight at a time and records
each answer's latency.  It replaces the list file by list #k+1 of n other keys and asks
``GET /v1/enrollment/revocations`` with ``If-None-Match`` every 20 ms until the served ETag shows the new
list.  Printed per swap: the time from the file write to the new list being served ("adopted after"), and the slowest
health answer in that window against the slowest in an equally long quiet window before it ("stall").
Best of ``--repeat`` swaps for the adoption time, worst for the stall.

    PYTHONPATH=. python benchmarks/bench_revocation_loop.py --sizes 100000 1000000
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import socket
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from agg_server.app import create_app
from agg_server.config import config_from_dict
from agg_server.storage import Storage
from protocol.enrollment import EnrollmentAuthority, write_revocation_list
from protocol.identity import issue_revocation_list, verify_revocation_list


def _serve(config: dict[str, object], root: str, port: int) -> None:
    web.run_app(create_app(config_from_dict(config, base_dir=Path(root))), host="127.0.0.1", port=port, print=None)


async def _probe(url: str, stop: asyncio.Event, out: list[tuple[float, float]]) -> None:
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            start = time.perf_counter()
            async with session.get(url + "/v1/health") as r:
                await r.read()
            out.append((start, time.perf_counter() - start))
            await asyncio.sleep(0.002)


async def _swap(url: str, ca: EnrollmentAuthority, path: Path, n: int) -> tuple[float, float, float]:
    async with aiohttp.ClientSession() as session:

        async def etag(known: str = "") -> str:
            headers = {"If-None-Match": known} if known else {}
            async with session.get(url + "/v1/enrollment/revocations", headers=headers) as r:
                await r.read()
                return r.headers.get("ETag", "")

        before = await etag()
        number = verify_revocation_list(path.read_bytes(), ca.public_key).number + 1
        data = issue_revocation_list(ca.key, number, int(time.time()), sorted(os.urandom(32) for _ in range(n)))
        stop, samples = asyncio.Event(), list[tuple[float, float]]()
        probe = asyncio.create_task(_probe(url, stop, samples))
        await asyncio.sleep(1.0)  # the quiet window
        quiet_end = time.perf_counter()
        write_revocation_list(path, data)
        written = time.perf_counter()
        while await etag(before) == before:
            if time.perf_counter() - written > 60:
                raise SystemExit("the new list was not adopted within 60 s")
            await asyncio.sleep(0.02)
        adopted = time.perf_counter() - written
        await asyncio.sleep(0.1)
        stop.set()
        await probe
    quiet = max(lat for s, lat in samples if quiet_end - 1.0 <= s < quiet_end)
    busy = max(lat for s, lat in samples if s >= written - 0.01)
    return adopted, busy, quiet


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--devices", type=int, default=1_000)
    args = parser.parse_args()
    ca = EnrollmentAuthority.generate()
    print(f"{'n':>9} {'adopted after':>14} {'stall (max health)':>19} {'quiet max health':>17}")
    for n in args.sizes:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            crl_path = root / "ca.crl"
            write_revocation_list(crl_path, ca.revoke(None, [os.urandom(32) for _ in range(n)]))
            storage = Storage(root / "srv")
            for _ in range(args.devices):
                storage.add_device(os.urandom(32), "p", 1.0, source="cert:00", identity_key=os.urandom(32))
            storage.close()
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            config: dict[str, object] = {
                "server": {"data_dir": str(root / "srv"), "port": port},
                "model": {"n_items": 100, "bits": 16},
                "enrollment": {"authority_key": ca.public_key.hex(), "revocation_list": str(crl_path)},
            }
            server = multiprocessing.get_context("fork").Process(target=_serve, args=(config, tmp, port))
            server.start()
            try:
                url = f"http://127.0.0.1:{port}"
                runs = [asyncio.run(_run(url, ca, crl_path, n)) for _ in range(args.repeat)]
            finally:
                server.terminate()
                server.join()
        adopted = min(r[0] for r in runs)
        busy, quiet = max(r[1] for r in runs), max(r[2] for r in runs)
        print(f"{n:>9,} {adopted * 1e3:>11.0f} ms {busy * 1e3:>16.1f} ms {quiet * 1e3:>14.1f} ms")


async def _run(url: str, ca: EnrollmentAuthority, path: Path, n: int) -> tuple[float, float, float]:
    for _ in range(200):  # the child process starts the server
        try:
            async with aiohttp.ClientSession() as session, session.get(url + "/v1/health") as r:
                await r.read()
            break
        except aiohttp.ClientConnectionError:
            await asyncio.sleep(0.05)
    return await _swap(url, ca, path, n)


if __name__ == "__main__":
    main()
