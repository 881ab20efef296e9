"""One schema, one migration path, two back-ends: the same storage behaviour on SQLite and on a real
PostgreSQL started by the test (`tests.pg_helpers`), and what several instances sharing one database
rely on (migrations run once; a model version is committed once).

The PostgreSQL cases carry the ``postgres`` marker; .ci/run runs them as their own step.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agg_server.storage import SCHEMA_VERSION, RoundStatus, Storage, redact_url
from protocol.errors import StorageError
from tests.pg_helpers import database_url, running_postgres

_names = itertools.count()


@pytest.fixture(scope="module")
def pg_server() -> Iterator[str]:
    with running_postgres() as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def backend(request: pytest.FixtureRequest) -> str | None:
    """None for SQLite in the data directory, else a fresh PostgreSQL database's URL."""
    if request.param == "sqlite":
        return None
    server = request.getfixturevalue("pg_server")
    return database_url(server, f"t{next(_names)}")


def test_a_device_registers_under_the_id_its_certificate_names_and_later_ids_do_not_collide(
    backend: str | None, tmp_path: Path
) -> None:
    # Protocol 1.8: a format-3 certificate names the device id; PostgreSQL's id sequence must skip past it.
    from protocol.errors import EnrollmentRefused

    with Storage(tmp_path / "a", url=backend) as s:
        assert s.add_device(bytes([1] * 32), "x", 1.0) == 1
        assert s.add_device(bytes([2] * 32), "x", 2.0, identity_key=bytes([9] * 32), device_id=3) == 3
        with pytest.raises(EnrollmentRefused, match="device id 3 named by the certificate is already registered"):
            s.add_device(bytes([3] * 32), "x", 3.0, device_id=3)
        assert [s.add_device(bytes([4 + i] * 32), "x", 4.0 + i) for i in range(2)] == [4, 5]
        assert s.identity_keys([1, 3, 4]) == {3: bytes([9] * 32)}


def test_every_table_round_trips_and_survives_reopening(backend: str | None, tmp_path: Path) -> None:
    digest = bytes(range(32))
    with Storage(tmp_path / "a", url=backend) as s:
        assert s.dialect == ("sqlite" if backend is None else "postgresql")
        d1 = s.add_device(digest, "android", 1.0)
        d2 = s.add_device(bytes(32), "ios", 2.0)
        assert (d1, d2) == (1, 2) and s.device_for_token(digest) == d1 and s.device_count() == 2
        with pytest.raises(StorageError, match="already registered"):
            s.add_device(digest, "x", 3.0)
        rid = s.next_round_id()
        s.start_round(rid, 1, [d1, d2], {"k": 2, "deadlines": [1.5, 2.5]}, 10.0)
        s.record_phase(rid, "advertise_keys", [d1, d2], [], 0.5, 11.0)
        s.record_phase(rid, "share_keys", [d1], [d2], 0.25, 12.0)
        s.save_ledger({"rounds": [1, 2], "epsilon_budget": 8.0})
        s.save_ledger({"rounds": [1, 2, 3], "epsilon_budget": 8.0})  # replaces
        s.commit_model(1, None, b"initial", 9.0)
        s.commit_model(2, rid, b"second", 13.0, ledger={"rounds": [4]}, round_update={"survivors": 1})
        s.record_quality(2, "hr@10", "ml-100k", 0.25, 14.0)
        s.record_quality(2, "hr@10", "ml-100k", 0.5, 15.0)  # replaces
        with pytest.raises(StorageError, match="not newer"):
            s.commit_model(2, None, b"again", 16.0)
        assert s.integrity_check() == "ok"
    with Storage(tmp_path / "a", url=backend) as s:
        assert s.device_ids() == [1, 2]
        (rec,) = s.recent_rounds()
        assert rec.status is RoundStatus.COMMITTED and rec.new_model_version == 2 and rec.survivors == 1
        assert rec.params == {"k": 2, "deadlines": [1.5, 2.5]} and rec.started_at == 10.0
        assert [p.phase for p in s.phase_stats(rid)] == ["advertise_keys", "share_keys"]
        assert s.phase_devices(rid, "share_keys") == ([d1], [d2])
        assert s.load_ledger() == {"rounds": [4]}
        assert s.load_latest_model() == (2, b"second")
        assert [(q.metric, q.value) for q in s.model_quality()] == [("hr@10", 0.5)]
        assert s.round_counts()["committed"] == 1
        assert s.next_round_id() == rid + 1


def test_open_rounds_are_abandoned_and_times_keep_their_precision(backend: str | None, tmp_path: Path) -> None:
    now = 1_763_900_000.123456  # a wall-clock time: 4-byte floats would lose the fraction
    with Storage(tmp_path / "a", url=backend) as s:
        d = s.add_device(bytes(32), "x", now)
        s.start_round(1, 1, [d], {}, now)
    with Storage(tmp_path / "a", url=backend) as s:
        assert s.abandon_open_rounds(now + 1) == [1]
        (rec,) = s.recent_rounds()
        assert rec.status is RoundStatus.ABANDONED and rec.started_at == now


@pytest.mark.postgres
def test_instances_starting_together_migrate_once(pg_server: str, tmp_path: Path) -> None:
    url = database_url(pg_server, f"t{next(_names)}")
    errors: list[BaseException] = []
    opened: list[Storage] = []

    def start(i: int) -> None:
        try:
            opened.append(Storage(tmp_path / f"i{i}", url=url))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors and len(opened) == 4
        import psycopg

        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT version FROM fedrec_schema").fetchall() == [(SCHEMA_VERSION,)]
    finally:
        for s in opened:
            s.close()


@pytest.mark.postgres
def test_two_instances_never_commit_the_same_model_version(pg_server: str, tmp_path: Path) -> None:
    url = database_url(pg_server, f"t{next(_names)}")
    with Storage(tmp_path / "a", url=url) as a, Storage(tmp_path / "b", url=url) as b:
        a.commit_model(1, None, b"one", 1.0)
        a.commit_model(2, None, b"two-from-a", 2.0)
        with pytest.raises(StorageError, match="not newer"):
            b.commit_model(2, None, b"two-from-b", 2.5)
        b.commit_model(3, None, b"three-from-b", 3.0)
        assert [c.model_version for c in a.checkpoints()] == [3, 2, 1]
        assert a.integrity_check() == "ok"


@pytest.mark.postgres
def test_a_newer_or_foreign_schema_is_refused(pg_server: str, tmp_path: Path) -> None:
    import psycopg

    url = database_url(pg_server, f"t{next(_names)}")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE unrelated (x int)")
    with pytest.raises(StorageError, match="not a fedrec database"):
        Storage(tmp_path / "a", url=url)
    url = database_url(pg_server, f"t{next(_names)}")
    Storage(tmp_path / "b", url=url).close()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE fedrec_schema SET version = 99")
    with pytest.raises(StorageError, match="newer than this server"):
        Storage(tmp_path / "b", url=url)


def test_an_unreachable_database_is_named_without_its_password(tmp_path: Path) -> None:
    url = f"postgresql://fedrec:s3cret-pw@/fedrec?host={tmp_path}/nowhere&connect_timeout=1"
    with pytest.raises(StorageError) as info:
        Storage(tmp_path / "a", url=url)
    assert "s3cret-pw" not in str(info.value) and "fedrec:***@" in str(info.value)
    assert redact_url("postgresql://u:p@h:5/db") == "postgresql://u:***@h:5/db"


@pytest.mark.parametrize(
    "form",
    [
        "postgresql://fedrec@/fedrec?host={d}/nowhere&password=s3cret-pw&connect_timeout=1",
        "host={d}/nowhere dbname=fedrec user=fedrec password=s3cret-pw connect_timeout=1",
        "host={d}/nowhere dbname=fedrec user=fedrec password='s3cret-pw' connect_timeout=1",
    ],
)
def test_a_password_is_masked_in_every_form_of_connection_string(form: str, tmp_path: Path) -> None:
    with pytest.raises(StorageError) as info:
        Storage(tmp_path / "a", url=form.format(d=tmp_path))
    assert "s3cret-pw" not in str(info.value) and "password=***" in str(info.value), str(info.value)


@pytest.mark.postgres
def test_a_keyword_style_connection_string_reaches_postgresql(pg_server: str, tmp_path: Path) -> None:
    url = database_url(pg_server, "keywords")
    host = url.split("host=", 1)[1]
    with Storage(tmp_path / "a", url=f"host={host} dbname=keywords user=fedrec") as s:
        assert s.dialect == "postgresql" and s.head_version() is None
        assert s.where == f"host={host} dbname=keywords user=fedrec"


@pytest.mark.integration  # starts a fedrec-server process
def test_the_server_refuses_to_start_when_the_database_is_unreachable(tmp_path: Path) -> None:
    config = tmp_path / "server.toml"
    config.write_text(
        f'[server]\ndata_dir = "{tmp_path / "data"}"\nport = 0\n[model]\nn_items = 20\nbits = 8\n'
        f'[storage]\nurl = "postgresql://op:hunter2@/fedrec?host={tmp_path}/nowhere"\n'
    )
    done = subprocess.run(
        [sys.executable, "-m", "agg_server", "--config", str(config)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert "cannot connect to the database postgresql://op:***@" in done.stderr
    assert "hunter2" not in done.stderr + done.stdout


@pytest.mark.postgres
@pytest.mark.asyncio
async def test_a_server_on_postgresql_runs_and_commits_rounds(
    pg_server: str, aiohttp_server: Any, tmp_path: Path
) -> None:
    import dataclasses

    from agg_server.app import COORDINATOR, create_app
    from agg_server.config import StorageSection
    from fedsim.fleets.local import FleetConfig, run_fleet
    from fedsim.private.coordinator_rounds import run_private_lightfr
    from tests.server_helpers import BITS, N_ITEMS, small_config, users

    url = database_url(pg_server, f"t{next(_names)}")
    data = users(8, seed=4)
    cfg = dataclasses.replace(
        small_config(tmp_path / "srv", cohort=8, min_cohort=8, timeout=20.0), storage=StorageSection(url=url)
    )
    app = create_app(cfg)
    server = await aiohttp_server(app)
    fleet = FleetConfig(
        url=str(server.make_url("")).rstrip("/"),
        store_root=tmp_path / "devices",
        n_items=N_ITEMS,
        bits=BITS,
        rounds=2,
        seed=3,
        insecure_reproducible=True,  # seeded device generators: comparable with the reference
        time_limit=120.0,
    )
    report, _ = await run_fleet(fleet, list(data.values()))
    assert report.rounds_finished == 2 and not report.errors
    coordinator = app[COORDINATOR]
    assert coordinator.storage.dialect == "postgresql" and coordinator.model_version == 3
    # Bit-exact with the in-process reference on SQLite.
    reference = run_private_lightfr(small_config(tmp_path / "ref", cohort=8, min_cohort=8), data, rounds=2, seed=3)
    try:
        assert reference.coordinator.model_bytes == coordinator.model_bytes
    finally:
        reference.coordinator.storage.close()


def test_devices_are_found_by_their_certified_identity_key(backend: str | None, tmp_path: Path) -> None:
    # what the revocation list is enforced with (agg_server.enrollment.Enrollment.revoked_devices)
    keys = [bytes([i]) * 32 for i in range(1, 5)]
    with Storage(tmp_path / "a", url=backend) as s:
        ids = [s.add_device(bytes([i]) * 32, "p", 1.0, source="cert:ab", identity_key=k) for i, k in enumerate(keys)]
        s.add_device(bytes([9]) * 32, "p", 1.0)  # no identity (token or open registration)
        assert s.devices_with_identity([keys[3], keys[1], bytes(32)]) == [ids[1], ids[3]]
        assert s.devices_with_identity([]) == []
        assert s.devices_with_identity(keys * 300) == sorted(ids)  # chunked queries
        with pytest.raises(ValueError, match="32 bytes"):
            s.devices_with_identity([b"short"])
        # the two plans of `revoked_devices`: key lookups (3 keys, 4 certified devices) and one scan (12 keys)
        assert s.certified_device_count() == 4
        assert s.revoked_devices(frozenset({keys[3], keys[1], bytes(32)})) == [ids[1], ids[3]]
        many = frozenset({keys[1], keys[2], *(bytes([200 + i]) * 32 for i in range(10))})
        assert s.revoked_devices(many) == [ids[1], ids[2]]


def test_uploaded_revocation_lists_are_shared_by_every_instance_and_only_move_forward(
    backend: str | None, tmp_path: Path
) -> None:
    # protocol 1.5: POST /v1/admin/revocation-list stores the list in the database; every instance on it
    # (here two `Enrollment`s over two connections) enforces the newest, and nothing goes back.
    from agg_server.enrollment import Enrollment
    from protocol.enrollment import EnrollmentAuthority
    from protocol.errors import RevocationListInvalid
    from tests.test_enrollment_http import _config

    ca = EnrollmentAuthority.generate()
    config = _config(tmp_path / "cfg", cohort=3, enrollment={"authority_key": ca.public_key.hex()})
    first = ca.revoke(None, [bytes([1]) * 32])
    second = ca.revoke(first, [bytes([2]) * 32])
    with Storage(tmp_path / "a", url=backend) as s1, Storage(tmp_path / "a", url=backend) as s2:
        revoked_key = bytes([2]) * 32
        device = s1.add_device(bytes([7]) * 32, "p", 1.0, source="cert:ab", identity_key=revoked_key)
        a, b = Enrollment(config, s1), Enrollment(config, s2)
        assert a.revocation_list is None and b.revocation_list is None
        assert a.upload_revocation_list(second, 5.0)[1] is True
        assert a.revocation_list is not None and a.revocation_list.number == 2
        assert a.revoked_devices() == {device}
        b.refresh_revocations(force_database=True)  # the other instance, at its next look (≤ 1 s)
        assert b.revocation_list is not None and b.revocation_list.number == 2 and b.revoked_devices() == {device}
        assert b.signed_revocation_list()[0] == second
        # the same list again: accepted, not stored twice; a rollback, a forgery or a different #2: refused
        assert b.upload_revocation_list(second, 6.0)[1] is False
        with pytest.raises(RevocationListInvalid, match="older than #2"):
            b.upload_revocation_list(first, 7.0)
        flipped = bytearray(second)
        flipped[50] ^= 1
        with pytest.raises(RevocationListInvalid, match="not signed"):
            b.upload_revocation_list(bytes(flipped), 7.0)
        other_two = ca.revoke(first, [bytes([3]) * 32])
        with pytest.raises(RevocationListInvalid, match="different revocation list #2"):
            Enrollment(config, s2).upload_revocation_list(other_two, 7.0)
        assert s1.newest_revocation_number() == 2 and s1.revocation_list(2) == second
        assert s1.revocation_list(1) is None
        # a lower number stored by a racing instance is refused inside the transaction too
        assert s2.store_revocation_list(1, first, 8.0) == (2, second)
    with Storage(tmp_path / "a", url=backend) as s3:  # survives a restart
        restarted = Enrollment(config, s3)
        assert restarted.revocation_list is not None and restarted.revocation_list.number == 2


@pytest.mark.postgres
@pytest.mark.asyncio
async def test_the_dp_flag_of_the_model_survives_a_restart_on_postgresql(
    pg_server: str, aiohttp_server: Any, tmp_path: Path
) -> None:
    """Protocol 1.7's sticky `ModelPayload.dp_trained` is part of the stored checkpoint: a server restarted
    on the same PostgreSQL database serves it again, and so does a second instance that follows the head."""
    import dataclasses

    from agg_server.app import COORDINATOR, create_app
    from agg_server.config import StorageSection
    from agg_server.coordinator import RoundCoordinator
    from agg_server.storage import Storage
    from fedsim.fleets.local import FleetConfig, run_fleet
    from protocol.codec import decode
    from protocol.messages import ModelPayload
    from tests.server_helpers import BITS, N_ITEMS, small_config, users

    url = database_url(pg_server, f"t{next(_names)}")

    def config(dp: bool) -> Any:
        cfg = small_config(tmp_path / "srv", cohort=5, min_cohort=5, timeout=20.0)
        cfg = dataclasses.replace(cfg, storage=StorageSection(url=url))
        if not dp:
            return cfg
        return dataclasses.replace(cfg, privacy=dataclasses.replace(cfg.privacy, enabled=True, epsilon=50.0))

    app = create_app(config(True))
    server = await aiohttp_server(app)
    fleet = FleetConfig(
        url=str(server.make_url("")).rstrip("/"),
        store_root=tmp_path / "devices",
        n_items=N_ITEMS,
        bits=BITS,
        rounds=1,
        seed=3,
        time_limit=120.0,
    )
    report, _ = await run_fleet(fleet, list(users(5, seed=4).values()))
    assert report.rounds_finished == 1 and not report.errors
    assert app[COORDINATOR].model_version == 2 and app[COORDINATOR].model_dp_trained
    await server.close()

    cfg = config(False)
    again = RoundCoordinator(cfg, Storage(cfg.data_dir, url=url), now=0.0)
    try:
        served = decode(again.model_bytes)
        assert again.model_version == 2 and again.model_dp_trained
        assert isinstance(served, ModelPayload) and served.dp_trained and served.unobserved_weight > 0
    finally:
        again.storage.close()
