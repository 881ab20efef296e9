"""Chaos on two `fedrec-server` instances sharing one PostgreSQL: while a fleet of devices (each given both
instances' URLs) runs rounds in two cohorts, the database is restarted and each instance is SIGKILLed and
restarted at random moments; then every committed sum is checked bit for bit against the devices'
recorded inputs, the versions, the ledger and the database's integrity, and what the devices saw is listed.

Starts a throw-away PostgreSQL (`tests.pg_helpers`) and the instances as the tests do
(`tests.multi_helpers`).  The events' order and moments come from ``--seed``.

Run: ``PYTHONPATH=. python benchmarks/chaos_multi_instance.py --rounds 10 --seed 1``.
Prints one JSON line per event as it happens and one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.multi_helpers import (  # noqa: E402
    Instance,
    check_sums,
    database_rounds,
    ledger_charges,
    recording,
    run_devices,
)
from tests.pg_helpers import PostgresServer, database_url, running_postgres  # noqa: E402
from tests.server_helpers import BITS, N_ITEMS, users  # noqa: E402


def _committed(url: str) -> int:
    return sum(1 for r in database_rounds(url) if r["status"] == "committed")


async def _chaos(
    pg: PostgresServer, url: str, instances: list[Instance], rng: random.Random, target: int, start: float
) -> list[dict[str, object]]:
    """Until ``target`` rounds committed: every 2-6 s one event, the database and each instance in turn
    (in a random order per pass), each down for 1-4 s."""
    events: list[dict[str, object]] = []
    kinds = ["database", *(i.name for i in instances)]
    while True:
        rng.shuffle(kinds)
        for kind in kinds:
            await asyncio.sleep(rng.uniform(2.0, 6.0))
            done = await asyncio.to_thread(_committed, url)
            if done >= target:
                return events
            at = round(time.perf_counter() - start, 1)
            if kind == "database":
                await asyncio.to_thread(pg.stop)
                down = rng.uniform(1.0, 4.0)
                await asyncio.sleep(down)
                await asyncio.to_thread(pg.start)
                event = {"at": at, "event": "database restarted", "down_seconds": round(down, 1)}
            else:
                (inst,) = [i for i in instances if i.name == kind]
                await asyncio.to_thread(inst.kill)
                down = rng.uniform(1.0, 4.0)
                await asyncio.sleep(down)
                await asyncio.to_thread(inst.start)
                event = {"at": at, "event": f"instance {kind} SIGKILLed and restarted", "down_seconds": round(down, 1)}
            event["committed_before"] = done
            print(json.dumps(event), file=sys.stderr, flush=True)
            events.append(event)


async def _run(args: argparse.Namespace, pg: PostgresServer, root: Path) -> dict[str, object]:
    url = database_url(pg, "chaos")
    privacy = {"enabled": True, "epsilon": 50.0, "planned_rounds": 4 * args.rounds}
    # A pause of 3 s between a cohort's rounds: the events land in every phase of some round.
    instances = [
        Instance(
            name,
            root / name,
            url,
            2,
            1,
            N_ITEMS,
            BITS,
            cohort_size=5,
            privacy=privacy,
            lease_seconds=6.0,
            rounds={"round_interval": 3.0},
        )
        for name in "ab"
    ]
    for inst in instances:
        inst.start()
    stop = asyncio.Event()
    start = time.perf_counter()
    try:
        with recording() as record:
            fleet = asyncio.create_task(
                run_devices(
                    [i.url for i in instances],
                    list(users(10, seed=args.seed).values()),
                    root / "devices",
                    n_items=N_ITEMS,
                    bits=BITS,
                    stop=stop,
                    cohorts=2,
                )
            )
            chaos = asyncio.create_task(_chaos(pg, url, instances, random.Random(args.seed), args.rounds, start))
            deadline = time.monotonic() + args.time_limit
            while time.monotonic() < deadline and not chaos.done():
                await asyncio.sleep(2.0)
            chaos.cancel()
            events = [] if chaos.cancelled() or not chaos.done() else chaos.result()
            for inst in instances:  # a restart may still be in flight when the chaos was cancelled
                if inst.proc is None or inst.proc.poll() is not None:
                    inst.start()
            stop.set()
            run = await fleet
            for inst in instances:
                inst.stop()
            rounds = database_rounds(url)
            compared = check_sums(rounds, record)
    finally:
        stop.set()
        for inst in instances:
            inst.kill()
    committed = [r for r in rounds if r["status"] == "committed"]
    versions = [r["version"] for r in committed]
    charged, _ = ledger_charges(url)
    released = sorted(r["round_id"] for r in rounds if r["status"] == "committed" or r["revealed"])
    from agg_server.storage import Storage

    with Storage(root / "check", url=url) as s:
        integrity = s.integrity_check()
    return {
        "wall_seconds": round(time.perf_counter() - start, 1),
        "events": events,
        "rounds": {
            st: sum(1 for r in rounds if r["status"] == st) for st in ("committed", "aborted", "abandoned", "open")
        },
        "abort_reasons": sorted({str(r["reason"])[:120] for r in rounds if r["status"] == "aborted"}),
        "sums_bit_exact": f"{compared} of {len(committed)}",
        "versions_committed_twice": len(versions) - len(set(versions)),
        "versions_contiguous": sorted(versions) == list(range(2, 2 + len(versions))),
        "ledger_equals_releases": sorted(charged) == released,
        "integrity": integrity,
        "device_outcomes": dict(run.outcomes),
        "device_errors": dict(run.errors),
        "device_error_examples": dict(run.examples),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=10, help="committed rounds to reach under chaos")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--time-limit", type=float, default=1200.0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="fedrec-chaos-") as tmp, running_postgres() as pg:
        assert isinstance(pg, PostgresServer)
        print(json.dumps(asyncio.run(_run(args, pg, Path(tmp)))))


if __name__ == "__main__":
    main()
