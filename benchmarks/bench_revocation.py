"""What enforcing the enrollment authority's revocation list costs (protocol 1.5), per list size n.

For each n: the device's check of a new list (signature, layout, keys), writing it to the store and
reading it back (`device_sdk.persistence`), the server adopting it (`Enrollment` looks up which
registered devices it revokes, here among 1,000 certified devices on SQLite), and the device's fetch over
loopback HTTP from a real server: the first download (200, the whole list) and the per-round conditional
request with the ETag (304).  Best of ``--repeat`` runs.

    PYTHONPATH=. python benchmarks/bench_revocation.py --sizes 1000 100000 1000000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

from aiohttp import web

from agg_server.app import create_app
from agg_server.config import config_from_dict
from agg_server.enrollment import Enrollment
from agg_server.storage import Storage
from device_sdk.http import HttpTransport
from device_sdk.persistence import StoredRevocations, load_revocations, save_revocations
from protocol.enrollment import EnrollmentAuthority, write_revocation_list
from protocol.identity import verify_revocation_list

ROUTE = "/v1/enrollment/revocations"


def _best(repeat: int, run: object) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        run()  # type: ignore[operator]
        best = min(best, time.perf_counter() - start)
    return best


async def _http(root: Path, config: dict[str, object], repeat: int) -> tuple[float, float, int]:
    app = create_app(config_from_dict(config, base_dir=root))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    first = cond = float("inf")
    size = 0
    async with HttpTransport(f"http://127.0.0.1:{port}", retries=0) as transport:
        for _ in range(repeat):
            start = time.perf_counter()
            full = await transport.request("GET", ROUTE)
            first = min(first, time.perf_counter() - start)
            size = full.bytes_down
            start = time.perf_counter()
            again = await transport.request("GET", ROUTE, if_none_match=full.etag)
            cond = min(cond, time.perf_counter() - start)
            assert again.status == 304
    await runner.cleanup()
    return first, cond, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 100_000, 1_000_000])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--devices", type=int, default=1_000, help="registered certified devices on the server")
    args = parser.parse_args()
    ca = EnrollmentAuthority.generate()
    print(
        f"{'n':>9} {'bytes':>11} {'device check':>13} {'store':>8} {'load':>8} "
        f"{'server adopt':>13} {'GET 200':>9} {'GET 304':>8}"
    )
    for n in args.sizes:
        print(_one(ca, n, args.repeat, args.devices))


def _one(ca: EnrollmentAuthority, n: int, repeat: int, devices: int) -> str:
    keys = [os.urandom(32) for _ in range(n)]
    data = ca.revoke(None, keys)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        check = _best(repeat, lambda: verify_revocation_list(data, ca.public_key))
        crl = verify_revocation_list(data, ca.public_key)
        stored = StoredRevocations(data=data, revocation_list=crl, etag='"e"')
        (root / "dev").mkdir()
        store = _best(repeat, lambda: save_revocations(root / "dev", stored))
        load = _best(repeat, lambda: load_revocations(root / "dev", ca.public_key))
        crl_path = root / "ca.crl"
        write_revocation_list(crl_path, data)
        config: dict[str, object] = {
            "server": {"data_dir": str(root / "srv"), "port": 0},
            "model": {"n_items": 100, "bits": 16},
            "enrollment": {"authority_key": ca.public_key.hex(), "revocation_list": str(crl_path)},
        }
        storage = Storage(root / "srv")
        for i in range(devices):  # every other one revoked (while the list has keys)
            identity = keys[i] if i % 2 == 0 and i < n else os.urandom(32)
            storage.add_device(os.urandom(32), "p", 1.0, source="cert:00", identity_key=identity)
        server_cfg = config_from_dict(config, base_dir=root)
        adopt = _best(repeat, lambda: Enrollment(server_cfg, storage))
        storage.close()
        first, cond, size = asyncio.run(_http(root, config, repeat))
    return (
        f"{n:>9,} {len(data):>11,} {check * 1e3:>10.1f} ms {store * 1e3:>5.1f} ms {load * 1e3:>5.1f} ms "
        f"{adopt * 1e3:>10.1f} ms {first * 1e3:>6.1f} ms {cond * 1e3:>5.1f} ms  (200 body {size:,} B)"
    )


if __name__ == "__main__":
    main()
