"""What a database outage does to running `fedrec-server` instances on one real PostgreSQL: a restart of
the database (the instances reconnect by themselves, are ready again and go on committing, nothing
committed is lost) and a table lock held for 10 s (the event loop keeps answering `/v1/health` while
`/v1/ready` says 503).

These start real PostgreSQL servers and real server processes: the ``postgres`` marker (.ci/run runs them
as their own step).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pg_helpers import PostgresServer, database_url, running_postgres

pytestmark = [pytest.mark.postgres]

_names = itertools.count()


@pytest.fixture(scope="module")
def pg_server() -> Iterator[PostgresServer]:  # one server for the module: the restart test starts it again
    with running_postgres() as url:
        assert isinstance(url, PostgresServer)
        yield url


def _get(url: str, timeout: float = 10.0) -> tuple[int, dict]:  # type: ignore[type-arg]
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - loopback
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def _until(predicate, timeout: float, what: str) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    while not await asyncio.to_thread(predicate):
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.25)
    return time.monotonic() - start


def _committed(rounds: list[dict], cohort: int | None = None) -> list[dict]:  # type: ignore[type-arg]
    return [r for r in rounds if r["status"] == "committed" and (cohort is None or r["cohort"] == cohort)]


@pytest.mark.asyncio
async def test_instances_survive_a_database_restart_and_lose_nothing_committed(
    pg_server: PostgresServer, tmp_path: Path
) -> None:
    from tests.multi_helpers import Instance, database_rounds, recording, run_devices
    from tests.server_helpers import BITS, N_ITEMS, users
    from tests.test_server_multi import _assert_consistent

    url = database_url(pg_server, f"o{next(_names)}")
    privacy = {"enabled": True, "epsilon": 50.0, "planned_rounds": 40}
    instances = [
        Instance(name, tmp_path / name, url, 2, 1, N_ITEMS, BITS, cohort_size=5, privacy=privacy, lease_seconds=6.0)
        for name in "ab"
    ]
    for inst in instances:
        inst.start()
    stop = asyncio.Event()
    try:
        with recording() as record:
            task = asyncio.create_task(
                run_devices(
                    [i.url for i in instances],
                    list(users(10, seed=7).values()),
                    tmp_path / "devices",
                    n_items=N_ITEMS,
                    bits=BITS,
                    stop=stop,
                    cohorts=2,
                )
            )
            await _until(
                lambda: all(len(_committed(database_rounds(url), c)) >= 1 for c in range(2)),
                180,
                "a committed round in each cohort",
            )
            before = {r["version"]: r["sum_sha256"] for r in _committed(database_rounds(url))}
            await asyncio.to_thread(pg_server.stop)  # "fast": every session is cut at once
            try:
                # Down: liveness stays 200 (an orchestrator must not restart them), readiness says 503.
                for inst in instances:
                    await _until(lambda i=inst: _get(i.url + "/v1/ready")[0] == 503, 30, f"{inst.name} not ready")
                    assert _get(inst.url + "/v1/health")[0] == 200
                    status, body = _get(inst.url + "/v1/ready")
                    assert status == 503 and any("database" in reason for reason in body["reasons"]), body
                await asyncio.sleep(2.0)
            finally:
                await asyncio.to_thread(pg_server.start)
            for inst in instances:
                took = await _until(lambda i=inst: _get(i.url + "/v1/ready")[0] == 200, 30, f"{inst.name} ready")
                print(f"instance {inst.name} ready {took:.1f} s after the database came back")
                assert took <= 30.0
            counts = [len(_committed(database_rounds(url), c)) for c in range(2)]
            await _until(
                lambda: all(len(_committed(database_rounds(url), c)) > counts[c] for c in range(2)),
                180,
                "a round committed in each cohort after the restart",
            )
            stop.set()
            await task
            for inst in instances:
                inst.stop()
            rounds = _assert_consistent(url, record, 50.0)
        # Rounds that ended while the database was down had their end written once it answered.
        assert all(r["status"] != "open" for r in rounds), [r for r in rounds if r["status"] == "open"]
        after = {r["version"]: r["sum_sha256"] for r in _committed(rounds)}
        assert all(after.get(v) == digest for v, digest in before.items())  # nothing committed was lost
        assert len(after) > len(before)
        for inst in instances:
            assert "reconnected to the database" in inst.log_tail(200_000)
    finally:
        stop.set()
        for inst in instances:
            inst.kill()


def _hold_lock(url: str, table: str, seconds: float, held: threading.Event) -> None:
    import psycopg

    with psycopg.connect(url) as conn, conn.transaction():
        conn.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
        held.set()
        time.sleep(seconds)


@pytest.mark.asyncio
async def test_a_locked_table_leaves_the_event_loop_answering_and_the_instance_not_ready(
    pg_server: PostgresServer, tmp_path: Path
) -> None:
    from tests.multi_helpers import Instance
    from tests.server_helpers import BITS, N_ITEMS

    url = database_url(pg_server, f"o{next(_names)}")
    inst = Instance("a", tmp_path / "a", url, 1, 1, N_ITEMS, BITS, cohort_size=5, lease_seconds=15.0)
    inst.start()
    try:
        await _until(lambda: _get(inst.url + "/v1/ready")[0] == 200, 30, "the instance to be ready")
        held = threading.Event()
        locker = threading.Thread(target=_hold_lock, args=(url, "cohort_leases", 10.0, held))
        locker.start()
        assert held.wait(10)
        t_end = time.monotonic() + 9.0
        latencies: list[float] = []
        ready_codes: list[int] = []
        while time.monotonic() < t_end:
            t0 = time.perf_counter()
            status, body = _get(inst.url + "/v1/health")
            latencies.append(time.perf_counter() - t0)
            assert status == 200 and body["status"] == "ok"
            if len(latencies) % 10 == 0:
                ready_codes.append(_get(inst.url + "/v1/ready")[0])
            await asyncio.sleep(0.01)
        locker.join()
        latencies.sort()
        p99 = latencies[int(0.99 * (len(latencies) - 1))]
        n, worst = len(latencies), latencies[-1]
        print(f"/v1/health during a 10 s lock: p99 {p99 * 1000:.1f} ms, max {worst * 1000:.1f} ms, n={n}")
        assert len(latencies) >= 200, len(latencies)
        assert p99 <= 0.1, f"/v1/health p99 {p99 * 1000:.0f} ms over {len(latencies)} requests during the lock"
        assert 503 in ready_codes, ready_codes  # the lease could not be renewed, the database call hangs
        # Lock released: ready again without a restart.
        await _until(lambda: _get(inst.url + "/v1/ready")[0] == 200, 30, "the instance to be ready again")
    finally:
        inst.kill()
