"""Several instances on one database (docs/operations.md "Several instances"): cohort leases and their
fencing tokens, the ε reservation that concurrent cohorts cannot overspend, compare-and-set commits —
first on the storage (SQLite and PostgreSQL), then with real `fedrec-server` processes on one real
PostgreSQL and real devices over HTTP (bit-exact sums against the in-process reference, a SIGKILLed
instance, cohorts racing for the last ε).

The PostgreSQL cases carry the ``postgres`` marker; .ci/run runs them as their own step.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agg_server.storage import HeadMoved, LeaseLost, Storage
from protocol.accounting import PrivacyLedger, calibrate_mu
from protocol.errors import PrivacyBudgetExceeded
from tests.pg_helpers import database_url, running_postgres

_names = itertools.count()


@pytest.fixture(scope="module")
def pg_server() -> Iterator[str]:
    with running_postgres() as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def backend(request: pytest.FixtureRequest) -> str | None:
    if request.param == "sqlite":
        return None
    return database_url(request.getfixturevalue("pg_server"), f"m{next(_names)}")


def test_a_lease_fences_the_writes_of_a_deposed_leader(backend: str | None, tmp_path: Path) -> None:
    # Lease expiry goes by the database's clock: the callers' `now` (their hosts' clocks, which may be
    # hours apart) decides nothing, so a lease is made to expire by renewing it for 0.2 s and waiting.
    skewed = time.time() + 3600.0
    with Storage(tmp_path / "a", url=backend) as a, Storage(tmp_path / "a", url=backend) as b:
        d = a.add_device(bytes(32), "x", 0.0)
        got = a.acquire_lease(0, "A", "http://a", 100.0, 30.0)
        assert got == (1, [])
        assert b.acquire_lease(0, "B", "http://b", skewed, 30.0) is None  # A's lease is live, whatever B's clock
        (lease,) = a.leases()
        assert 25.0 < lease.expires_in <= 30.0
        a.start_round(1, 1, [d], {}, 101.0, fence=(0, 1))
        assert a.renew_lease(0, 1, 0.0, 0.2)
        time.sleep(0.3)
        assert b.acquire_lease(0, "B", "http://b", 0.0, 30.0) == (2, [1])  # expired: taken over, round 1 abandoned
        with pytest.raises(LeaseLost, match="token 2"):
            a.record_phase(1, "advertise_keys", [d], [], 1.0, 112.0, fence=(0, 1))
        with pytest.raises(LeaseLost):
            a.start_round(2, 1, [d], {}, 112.0, fence=(0, 1))
        assert not a.renew_lease(0, 1, 112.0, 10.0) and b.renew_lease(0, 2, 112.0, 10.0)
        assert a.acquire_lease(0, "A", "http://a", skewed, 10.0) is None
        b.release_lease(0, 2)
        assert a.acquire_lease(0, "A", "http://a", 113.0, 10.0) == (3, [])
        (lease,) = a.leases()
        assert (lease.holder, lease.url, lease.token) == ("A", "http://a", 3)
        (rec,) = a.recent_rounds()
        assert rec.status.value == "abandoned" and "taken over" in rec.reason


def test_commits_compare_and_set_the_model_version(backend: str | None, tmp_path: Path) -> None:
    b_dir = tmp_path / ("a" if backend is None else "b")  # one SQLite file; two folders on PostgreSQL
    with Storage(tmp_path / "a", url=backend) as a, Storage(b_dir, url=backend) as b:
        a.commit_model(1, None, b"one", 1.0)
        a.commit_model(2, None, b"two", 2.0, base_version=1)
        with pytest.raises(HeadMoved) as moved:
            b.commit_model(2, None, b"two-again", 3.0, base_version=1)
        assert moved.value.head == 2
        b.commit_model(3, None, b"three", 4.0, base_version=2)
        assert a.head_version() == 3
        if backend is not None:  # every instance reads every version from the database
            assert a.load_model(3) == b"three" and b.load_model(2) == b"two"


def test_checkpoint_files_whose_rows_another_instance_pruned_are_removed(backend: str | None, tmp_path: Path) -> None:
    shared = backend or f"sqlite://{tmp_path / 'shared.sqlite3'}"  # one database, two data directories
    with (
        Storage(tmp_path / "a", url=shared, keep_checkpoints=3) as a,
        Storage(tmp_path / "b", url=shared, keep_checkpoints=3) as b,
    ):
        a.commit_model(1, None, b"v1", 1.0)
        for version in range(2, 13):  # the instances take turns
            (a if version % 2 else b).commit_model(
                version, None, b"v%d" % version, float(version), base_version=version - 1
            )
        a.prune_checkpoint_files()  # as a's next round does when it follows the head b committed
        for folder in ("a", "b"):
            files = sorted(p.name for p in (tmp_path / folder / "checkpoints").glob("model-*.msgpack"))
            kept = {f"model-{v}.msgpack" for v in (10, 11, 12)}
            assert set(files) <= kept, (folder, files)
        assert a.head_version() == 12


def _race_takeover_and_reveal(
    leader: Storage, fence: tuple[int, int], rid: int, other: Storage, name: str
) -> dict[str, object]:
    """The deposed leader reveals round ``rid`` while ``other`` takes the cohort over, released together."""
    barrier = threading.Barrier(2)
    results: dict[str, object] = {}

    def reveal() -> None:
        barrier.wait()
        try:
            leader.mark_revealed(rid, fence=fence)
            results["reveal"] = "revealed"
        except LeaseLost:
            results["reveal"] = "lease lost"
        except Exception as exc:  # reported by the caller
            results["reveal"] = exc

    def take() -> None:
        barrier.wait()
        try:
            results["take"] = other.acquire_lease(fence[0], name, "", 0.0, 30.0)
        except Exception as exc:  # reported by the caller
            results["take"] = exc

    threads = [threading.Thread(target=reveal), threading.Thread(target=take)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


@pytest.mark.postgres
def test_a_takeover_racing_a_reveal_never_deadlocks(pg_server: str, tmp_path: Path) -> None:
    # mark_revealed and acquire_lease take the rounds lock and the lease row in one order: 100 races of a
    # take-over against the deposed leader's reveal end with one of them first, never "deadlock detected".
    url = database_url(pg_server, f"m{next(_names)}")
    with Storage(tmp_path / "a", url=url) as a, Storage(tmp_path / "b", url=url) as b:
        d = a.add_device(bytes(32), "x", 0.0)
        leader, other = (a, "A"), (b, "B")
        got = a.acquire_lease(0, "A", "", 0.0, 30.0)
        assert got is not None
        token = got[0]
        outcomes: dict[str, int] = {}
        for rid in range(1, 101):
            leader[0].start_round(rid, 1, [d], {}, 0.0, fence=(0, token))
            assert leader[0].renew_lease(0, token, 0.0, 0.0)  # expired at once: the other may take over
            results = _race_takeover_and_reveal(leader[0], (0, token), rid, other[0], other[1])
            assert results["reveal"] in ("revealed", "lease lost"), results
            taken = results["take"]
            assert isinstance(taken, tuple) and taken[1] == [rid], results  # the round was abandoned
            outcome = str(results["reveal"])
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            token = taken[0]
            leader, other = other, leader
        assert sum(outcomes.values()) == 100
        revealed = {r.round_id for r in a.recent_rounds(200) if r.status.value == "abandoned"}
        assert len(revealed) == 100


def test_a_second_live_process_with_the_same_instance_id_is_refused(backend: str | None, tmp_path: Path) -> None:
    from protocol.errors import StorageError

    shared = backend or f"sqlite://{tmp_path / 'shared.sqlite3'}"
    with Storage(tmp_path / "a", url=shared) as a, Storage(tmp_path / "b", url=shared) as b:
        a.claim_instance("srv-a")
        with pytest.raises(StorageError, match="instance_id 'srv-a' is in use by another running instance"):
            b.claim_instance("srv-a")
        b.claim_instance("srv-b")
    with Storage(tmp_path / "c", url=shared) as c:
        c.claim_instance("srv-a")  # its holder stopped: free again


def _reserve(budget: PrivacyLedger, mu: float, l1: float, l2: float, rid: int):  # type: ignore[no-untyped-def]
    def reserve(stored):  # type: ignore[no-untyped-def]
        ledger = PrivacyLedger.from_dict(stored) if stored is not None else budget
        ledger.record_round(mu, l1, l2, round_id=rid)
        return ledger.to_dict()

    return reserve


def test_racing_reservations_never_overspend_and_unrevealed_rounds_give_back(
    backend: str | None, tmp_path: Path
) -> None:
    l1, l2 = 3000.0, 200.0
    mu = calibrate_mu(4.0, 1e-5, 3, l1, l2)  # exactly 3 rounds fit the budget
    stores = [Storage(tmp_path / "a", url=backend) for _ in range(2)]
    try:
        devices = [stores[0].add_device(bytes([i]) * 32, "x", 0.0) for i in range(1, 3)]
        ids = iter(range(1, 1000))
        lock = threading.Lock()
        opened: list[int] = []
        refused: list[int] = []

        def racer() -> None:
            with Storage(tmp_path / "a", url=backend) as s:  # one connection per racer, as per instance
                for _ in range(4):
                    with lock:
                        rid = next(ids)
                    try:
                        s.start_round(
                            rid, 1, devices, {}, 1.0, reserve=_reserve(PrivacyLedger(4.0, 1e-5), mu, l1, l2, rid)
                        )
                        opened.append(rid)
                    except PrivacyBudgetExceeded:
                        refused.append(rid)

        threads = [threading.Thread(target=racer) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(opened) == 3 and len(refused) == 13
        ledger = PrivacyLedger.from_dict(stores[0].load_ledger() or {})
        assert sorted(c.round_id for c in ledger.rounds) == sorted(opened)  # type: ignore[type-var]
        assert ledger.spent() <= 4.0
        first, second, third = sorted(opened)
        stores[0].finish_round(first, "aborted", reason="never revealed", now=2.0)  # gives its ε back
        stores[1].mark_revealed(second)
        stores[1].finish_round(second, "abandoned", reason="crashed while unmasking", now=2.0)  # stays charged
        charged = [c.round_id for c in PrivacyLedger.from_dict(stores[0].load_ledger() or {}).rounds]
        assert sorted(charged) == [second, third]  # type: ignore[type-var]
        assert stores[0].integrity_check() == "ok"
    finally:
        for s in stores:
            s.close()


# -- real instances -----------------------------------------------------------------------------------


async def _until(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.5)


def _committed(rounds: list[dict], cohort: int | None = None) -> list[dict]:  # type: ignore[type-arg]
    return [r for r in rounds if r["status"] == "committed" and (cohort is None or r["cohort"] == cohort)]


def _assert_consistent(url: str, record: dict, epsilon: float) -> list[dict]:  # type: ignore[type-arg]
    from tests.multi_helpers import check_sums, database_rounds, ledger_charges

    rounds = database_rounds(url)
    committed = _committed(rounds)
    versions = [r["version"] for r in committed]
    assert len(set(versions)) == len(versions), f"a model version was committed twice: {versions}"
    assert sorted(versions) == list(range(2, 2 + len(versions))), versions  # contiguous after version 1
    assert check_sums(rounds, record) == len(committed)
    charged, ledger = ledger_charges(url)
    released = {r["round_id"] for r in rounds if r["status"] == "committed" or r["revealed"]}
    assert sorted(charged) == sorted(released), (charged, released)  # the ledger is the sum of the releases
    assert PrivacyLedger.from_dict(ledger).spent() <= epsilon
    with Storage(Path("/nonexistent-unused"), url=url) as s:
        assert s.integrity_check() == "ok"
    return rounds


def _users(n: int):  # type: ignore[no-untyped-def]
    from tests.server_helpers import users

    return list(users(n, seed=7).values())


@pytest.mark.postgres
@pytest.mark.asyncio
async def test_two_instances_run_four_cohorts_in_parallel(pg_server: str, tmp_path: Path) -> None:
    from tests.multi_helpers import Instance, recording, run_devices
    from tests.server_helpers import BITS, N_ITEMS

    url = database_url(pg_server, f"m{next(_names)}")
    privacy = {"enabled": True, "epsilon": 50.0, "planned_rounds": 40}
    instances = [
        Instance(name, tmp_path / name, url, 4, 2, N_ITEMS, BITS, cohort_size=5, privacy=privacy) for name in "ab"
    ]
    for inst in instances:
        inst.start()
    stop = asyncio.Event()
    try:
        with recording() as record:
            task = asyncio.create_task(
                run_devices(
                    [i.url for i in instances],
                    _users(20),
                    tmp_path / "devices",
                    n_items=N_ITEMS,
                    bits=BITS,
                    stop=stop,
                    cohorts=4,
                )
            )
            from tests.multi_helpers import database_rounds

            await _until(
                lambda: all(len(_committed(database_rounds(url), c)) >= 3 for c in range(4)),
                240,
                "3 committed rounds in each of 4 cohorts",
            )
            stop.set()
            run = await task
            # The cluster view: every instance reports the cluster's newest model and every cohort's leader.
            # (a round still finishing may commit meanwhile: the view is the head between the two reads)
            with Storage(tmp_path / "view", url=url) as s:
                before = s.head_version()
                views = [(await asyncio.to_thread(inst.status))["cluster"] for inst in instances]
                after = s.head_version()
            assert before is not None and after is not None
            for inst, view in zip(instances, views, strict=True):
                assert before <= view["model_version"] <= after and before > 1, view
                assert sorted(lead["leader"] for lead in view["leaders"]) == ["a", "a", "b", "b"], view
                assert sum(lead["here"] for lead in view["leaders"]) == 2 and view["instance"] == inst.name
            for inst in instances:
                inst.stop()
            rounds = _assert_consistent(url, record, 50.0)
        # Devices saw their rounds commit (the last results may still be in flight when the run stops).
        assert not run.errors and run.outcomes["committed"] > 0, run
        # Each instance led two of the four cohorts.
        import psycopg

        with psycopg.connect(url) as conn:
            holders = sorted(h for (h,) in conn.execute("SELECT holder FROM cohort_leases"))
        assert holders == ["a", "a", "b", "b"]
        assert {r["cohort"] for r in rounds} == {0, 1, 2, 3}
    finally:
        stop.set()
        for inst in instances:
            inst.kill()


@pytest.mark.postgres
def test_a_server_with_a_duplicate_instance_id_refuses_to_start(pg_server: str, tmp_path: Path) -> None:
    from tests.multi_helpers import Instance
    from tests.server_helpers import BITS, N_ITEMS

    url = database_url(pg_server, f"m{next(_names)}")
    first = Instance("same", tmp_path / "one", url, 2, 1, N_ITEMS, BITS, cohort_size=5)
    second = Instance("same", tmp_path / "two", url, 2, 1, N_ITEMS, BITS, cohort_size=5)
    first.start()
    try:
        with pytest.raises(RuntimeError, match="exited") as refused:
            second.start()
        assert "storage.instance_id 'same' is in use by another running instance" in str(refused.value)
        assert second.proc is not None and second.proc.returncode == 2
    finally:
        first.kill()
        second.kill()


def _lease_holders(url: str) -> dict[str, int]:
    import psycopg

    with psycopg.connect(url) as conn:
        return {str(h): int(c) for c, h in conn.execute("SELECT cohort, holder FROM cohort_leases")}


@pytest.mark.postgres
@pytest.mark.asyncio
async def test_a_sigkilled_instance_loses_its_round_and_resumes_while_the_other_commits(
    pg_server: str, tmp_path: Path
) -> None:
    from tests.multi_helpers import Instance, database_rounds, recording, run_devices
    from tests.server_helpers import BITS, N_ITEMS

    url = database_url(pg_server, f"m{next(_names)}")
    privacy = {"enabled": True, "epsilon": 50.0, "planned_rounds": 40}
    a, b = (
        Instance(name, tmp_path / name, url, 2, 1, N_ITEMS, BITS, cohort_size=5, privacy=privacy, lease_seconds=3.0)
        for name in "ab"
    )
    a.start()
    b.start()
    stop = asyncio.Event()
    try:
        with recording() as record:
            task = asyncio.create_task(
                run_devices(
                    [a.url, b.url], _users(10), tmp_path / "devices", n_items=N_ITEMS, bits=BITS, stop=stop, cohorts=2
                )
            )
            await _until(lambda: len(_lease_holders(url)) == 2, 30, "both instances to lead a cohort")
            ca, cb = _lease_holders(url)["a"], _lease_holders(url)["b"]

            def a_mid_round() -> bool:
                rounds = database_rounds(url)
                return len(_committed(rounds, ca)) >= 1 and any(
                    r["status"] == "open" and r["cohort"] == ca for r in rounds
                )

            await _until(a_mid_round, 120, "a committed round of a's cohort and then an open one")
            a.kill()
            (killed,) = [r["round_id"] for r in database_rounds(url) if r["status"] == "open" and r["cohort"] == ca]
            before_a = len(_committed(database_rounds(url), ca))
            before_b = len(_committed(database_rounds(url), cb))
            await _until(
                lambda: len(_committed(database_rounds(url), cb)) >= before_b + 2,
                120,
                "the other instance to commit two more rounds",
            )
            assert len(_committed(database_rounds(url), ca)) == before_a  # nobody ran the dead instance's cohort
            # The survivor's cohort lost no round for want of devices: the devices pointed at the dead
            # instance went on with the survivor (every device has both URLs).
            starved = [
                r
                for r in database_rounds(url)
                if r["cohort"] == cb and r["round_id"] > killed and r["status"] == "aborted" and "below" in r["reason"]
            ]
            assert not starved, starved
            a.start()  # the same instance id: it takes its cohort back at once and abandons the killed round
            await _until(
                lambda: len(_committed(database_rounds(url), ca)) >= before_a + 1,
                120,
                "the restarted instance to commit again",
            )
            stop.set()
            await task
            a.stop()
            b.stop()
            rounds = _assert_consistent(url, record, 50.0)
        (dead,) = [r for r in rounds if r["round_id"] == killed]
        assert dead["status"] == "abandoned" and dead["version"] is None
        assert all(r["status"] != "open" for r in rounds)
        with Storage(tmp_path / "check", url=url) as s:
            head = s.head_version()
            assert head == 1 + len(_committed(rounds)) and s.load_model(head)  # nothing committed was lost
    finally:
        stop.set()
        a.kill()
        b.kill()


@pytest.mark.postgres
@pytest.mark.asyncio
async def test_cohorts_racing_on_two_instances_cannot_overspend_the_budget(pg_server: str, tmp_path: Path) -> None:
    from tests.multi_helpers import Instance, database_rounds, ledger_charges, recording, run_devices
    from tests.server_helpers import BITS, N_ITEMS

    url = database_url(pg_server, f"m{next(_names)}")
    privacy = {"enabled": True, "epsilon": 4.0, "planned_rounds": 3}  # μ calibrated: exactly 3 rounds fit
    instances = [
        Instance(name, tmp_path / name, url, 4, 2, N_ITEMS, BITS, cohort_size=4, privacy=privacy) for name in "ab"
    ]
    for inst in instances:
        inst.start()
    stop = asyncio.Event()
    try:
        with recording() as record:
            task = asyncio.create_task(
                run_devices(
                    [i.url for i in instances],
                    _users(16),
                    tmp_path / "devices",
                    n_items=N_ITEMS,
                    bits=BITS,
                    stop=stop,
                    cohorts=4,
                )
            )

            def spent_and_settled() -> bool:
                rounds = database_rounds(url)
                return len(ledger_charges(url)[0]) >= 3 and not any(r["status"] == "open" for r in rounds)

            await _until(spent_and_settled, 120, "the budget to be spent")
            await asyncio.sleep(3.0)  # every cohort keeps trying to open rounds meanwhile
            stop.set()
            await task
            for inst in instances:
                inst.stop()
            rounds = _assert_consistent(url, record, 4.0)
        charged, ledger = ledger_charges(url)
        assert len(charged) == 3 and len(_committed(rounds)) <= 3
        assert PrivacyLedger.from_dict(ledger).spent() <= 4.0
        refused = [i.name for i in instances if "privacy budget exhausted" in i.log_tail(10**7)]
        assert refused == ["a", "b"]  # both instances tried to open a fourth round and were refused
    finally:
        stop.set()
        for inst in instances:
            inst.kill()
