"""Two `fedrec-server` instances on one PostgreSQL, four device cohorts in parallel:
round times, every committed sum against the in-process reference, model versions, the privacy ledger,
server CPU and peak RSS per instance.

Starts a throw-away PostgreSQL (`tests.pg_helpers`, as the tests do; or ``--database URL``), two
``python -m agg_server`` processes on loopback sharing it (``storage.cohorts = 4``,
``cohorts_per_instance = 2``), and one `DeviceClient` per device in this process over HTTP, each device
talking first to one instance (half of every cohort's requests are forwarded to its leader).  Devices
carry ML-100K users (user i mod 943 of ``ml-100k/u.data``; 1,682 items x 64 bits).  Every device records
its quantized update and kept noise (`tests.multi_helpers.RecordingSession`), so each committed sum is
compared bit for bit with Σ q(x_u) + noise_u over the round's survivors.

Run: ``PYTHONPATH=. python benchmarks/multi_instance.py --devices-per-cohort 500 --rounds 3``.
Prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedsim.data.loaders import load_movielens  # noqa: E402
from tests.multi_helpers import (  # noqa: E402
    Instance,
    check_sums,
    database_rounds,
    ledger_charges,
    recording,
    run_devices,
)
from tests.pg_helpers import database_url, running_postgres  # noqa: E402


def _users(path: Path, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    data = load_movielens(path)
    order = np.argsort(data.users, kind="stable")
    users, items, ratings = data.users[order], data.items[order], data.ratings[order]
    starts = np.searchsorted(users, np.arange(data.n_users + 1))
    per_user = [(items[starts[u] : starts[u + 1]], ratings[starts[u] : starts[u + 1]]) for u in range(data.n_users)]
    return [per_user[i % data.n_users] for i in range(n)]


async def _run(args: argparse.Namespace, url: str, root: Path) -> dict[str, object]:
    cohorts, per_cohort = 4, args.devices_per_cohort
    users = _users(Path(args.data) / "ml-100k" / "u.data", cohorts * per_cohort)
    privacy = {"enabled": True, "epsilon": args.epsilon, "planned_rounds": cohorts * args.rounds}
    instances = [
        Instance(
            name,
            root / name,
            url,
            cohorts,
            2,
            1682,
            64,
            cohort_size=per_cohort,
            min_cohort=max(3, int(0.9 * per_cohort)),  # a few devices still busy elsewhere do not hold a round
            timeout=args.phase_timeout,
            lease_seconds=15.0,
            privacy=privacy,
            rounds={"max_rounds": args.rounds},
            model={"unobserved_weight": 0.0},
        )
        for name in "ab"
    ]
    for inst in instances:
        inst.start()
    stop = asyncio.Event()
    start = time.perf_counter()
    statuses: list[dict[str, object]] = []
    try:
        with recording() as record:
            task = asyncio.create_task(
                run_devices(
                    [i.url for i in instances],
                    users,
                    root / "devices",
                    n_items=1682,
                    bits=64,
                    stop=stop,
                    cohorts=cohorts,
                    long_poll_timeout=2 * args.phase_timeout + 60.0,
                    request_timeout=args.request_timeout,
                )
            )
            deadline = time.monotonic() + args.time_limit
            shown = ""
            while time.monotonic() < deadline and not task.done():
                rounds = database_rounds(url)
                done = [r for r in rounds if r["status"] in ("committed", "aborted", "abandoned")]
                line = " ".join(f"{r['round_id']}:c{r['cohort']}:{r['status']}" for r in rounds)
                if line != shown:  # progress, so that a run cut short still says how far it got
                    shown = line
                    print(f"[{time.perf_counter() - start:7.1f} s] {line}", file=sys.stderr, flush=True)
                if all(sum(1 for r in done if r["cohort"] == c) >= args.rounds for c in range(cohorts)):
                    break
                await asyncio.sleep(2.0)
            wall = time.perf_counter() - start
            statuses = [inst.status() for inst in instances]
            stop.set()
            run = await task
            rounds = database_rounds(url)
            compared = check_sums(rounds, record)
    finally:
        stop.set()
        for inst in instances:
            inst.stop()
    import psycopg

    with psycopg.connect(url) as conn:
        times = conn.execute(
            "SELECT round_id, cohort, status, started_at, finished_at FROM rounds ORDER BY round_id"
        ).fetchall()
        phases: dict[int, dict[str, float]] = {}
        for rid, phase, seconds in conn.execute("SELECT round_id, phase, seconds FROM phase_timings"):
            phases.setdefault(int(rid), {})[str(phase)] = round(float(seconds), 1)
    committed = [r for r in rounds if r["status"] == "committed"]
    versions = [r["version"] for r in committed]
    charged, ledger = ledger_charges(url)
    released = sorted(r["round_id"] for r in rounds if r["status"] == "committed" or r["revealed"])
    from agg_server.storage import Storage
    from protocol.accounting import PrivacyLedger

    with Storage(root / "check", url=url) as s:
        integrity = s.integrity_check()
    return {
        "devices": cohorts * per_cohort,
        "cohorts": cohorts,
        "instances": 2,
        "wall_seconds": round(wall, 1),
        "rounds": [
            {
                "round_id": r,
                "cohort": c,
                "status": st,
                "seconds": None if f is None else round(f - t0, 1),
                "phases": phases.get(int(r), {}),
            }
            for r, c, st, t0, f in times
        ],
        "rounds_committed": len(committed),
        "sums_bit_exact": compared,
        "versions_committed_twice": len(versions) - len(set(versions)),
        "versions_contiguous": sorted(versions) == list(range(2, 2 + len(versions))),
        "ledger_rounds": sorted(charged),
        "released_rounds": released,
        "ledger_equals_releases": sorted(charged) == released,
        "epsilon_spent": PrivacyLedger.from_dict(ledger).spent(),
        "integrity": integrity,
        "server": [
            {
                "instance": inst.name,
                "cpu_seconds": (st.get("process") or {}).get("cpu_seconds"),  # type: ignore[union-attr]
                "max_rss_mb": (st.get("process") or {}).get("max_rss_mb"),  # type: ignore[union-attr]
                "cohorts_led": [s["cohort"] for s in st["cluster"]["slots"]],  # type: ignore[index]
            }
            for inst, st in zip(instances, statuses, strict=True)
        ],
        "device_outcomes": dict(run.outcomes),
        "device_errors": dict(run.errors),
        "device_error_examples": dict(run.examples),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices-per-cohort", type=int, default=500)
    p.add_argument("--rounds", type=int, default=3, help="rounds per cohort")
    p.add_argument("--epsilon", type=float, default=8.0)
    p.add_argument("--phase-timeout", type=float, default=600.0)
    p.add_argument("--time-limit", type=float, default=3600.0)
    p.add_argument(
        "--request-timeout",
        type=float,
        default=300.0,
        help="devices' request timeout: one fleet process starves its own event loop at 2,000 devices",
    )
    p.add_argument("--data", default=os.environ.get("FEDREC_DATA", "/work/shared/data"))
    p.add_argument("--database", help="a PostgreSQL URL (default: start a throw-away server)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="fedrec-multi-") as tmp:
        root = Path(tmp)
        with contextlib.ExitStack() as stack:
            if args.database:
                url = args.database
            else:
                url = database_url(stack.enter_context(running_postgres()), "bench")
            result = asyncio.run(_run(args, url, root))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
