"""agg_server.storage: every table round-trips and survives reopening; checkpoints survive crashes,
corruption and truncation; sqlite errors surface as StorageError."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import random
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agg_server.storage import (
    COHORT_PHASE,
    DATABASE_NAME,
    SCHEMA_VERSION,
    CheckpointStatus,
    RoundStatus,
    Storage,
)
from protocol.accounting import PrivacyLedger, RoundCharge
from protocol.codec import decode, encode
from protocol.errors import StorageError
from protocol.messages import ModelPayload

REPO = Path(__file__).resolve().parent.parent


def _token(n: int) -> bytes:
    return hashlib.sha256(f"token-{n}".encode()).digest()


def _model(version: int, n_items: int = 5, bits: int = 64) -> bytes:
    words = hashlib.sha256(str(version).encode()).digest() * n_items
    return encode(ModelPayload(model_version=version, bits=bits, n_items=n_items, words=words[: 8 * n_items]))


def _sqlite(path: Path) -> contextlib.closing[sqlite3.Connection]:
    return contextlib.closing(sqlite3.connect(path))


@pytest.fixture
def storage(tmp_path: Path) -> Iterator[Storage]:
    with Storage(tmp_path / "data") as s:
        yield s


@pytest.fixture
def devices(storage: Storage) -> list[int]:
    return [storage.add_device(_token(i), "android", 10.0 + i) for i in range(5)]


# -- opening ---------------------------------------------------------------------------------------


def test_creates_the_data_dir_in_wal_mode(tmp_path: Path) -> None:
    data_dir = tmp_path / "a" / "b"
    with Storage(data_dir) as s:
        assert s.db_path == data_dir / DATABASE_NAME
        assert (data_dir / "checkpoints").is_dir()
        with _sqlite(s.db_path) as conn:
            assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert s.integrity_check() == "ok"


def test_foreign_keys_are_enforced(storage: Storage) -> None:
    with pytest.raises(StorageError, match=r"start_round failed on database .*FOREIGN KEY"):
        storage.start_round(1, 0, [42], {}, 1.0)
    assert storage.next_round_id() == 1  # the failed transaction left nothing behind


def test_refuses_a_newer_schema(tmp_path: Path) -> None:
    Storage(tmp_path).close()
    with _sqlite(tmp_path / DATABASE_NAME) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(StorageError, match=rf"schema version {SCHEMA_VERSION + 1}, newer than"):
        Storage(tmp_path)


def test_refuses_a_corrupt_database_file(tmp_path: Path) -> None:
    (tmp_path / DATABASE_NAME).write_bytes(b"this is not an sqlite database" * 100)
    with pytest.raises(StorageError, match=re.escape(str(tmp_path / DATABASE_NAME))):
        Storage(tmp_path)


def test_refuses_a_foreign_database(tmp_path: Path) -> None:
    with _sqlite(tmp_path / DATABASE_NAME) as conn:
        conn.execute("CREATE TABLE something (x)")
        conn.commit()
    with pytest.raises(StorageError, match="is not a fedrec database"):
        Storage(tmp_path)


def test_close_is_idempotent_and_checkpoints_the_wal(tmp_path: Path) -> None:
    s = Storage(tmp_path)
    s.add_device(_token(1), "ios", 1.0)
    s.close()
    s.close()
    wal = tmp_path / f"{DATABASE_NAME}-wal"
    assert not wal.exists() or wal.stat().st_size == 0
    with pytest.raises(StorageError, match="is closed"):
        s.device_count()


def test_keep_checkpoints_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_checkpoints"):
        Storage(tmp_path, keep_checkpoints=0)


# -- devices, rounds, participation, ledger -------------------------------------------------------


def test_devices_round_trip(storage: Storage, devices: list[int]) -> None:
    assert devices == [1, 2, 3, 4, 5]
    assert storage.device_for_token(_token(3)) == devices[3]
    assert storage.device_for_token(_token(99)) is None
    assert storage.device_count() == 5
    assert storage.device_ids() == devices
    with pytest.raises(StorageError, match="already registered"):
        storage.add_device(_token(0), "android", 20.0)
    with pytest.raises(ValueError, match="32 bytes"):
        storage.add_device(b"short", "android", 20.0)


def test_rounds_round_trip(storage: Storage, devices: list[int]) -> None:
    assert storage.next_round_id() == 1
    params = {"k": 3, "t": 2, "deadlines": [1.0, 2.0, 3.0, 4.0], "aggregation": "grad"}
    storage.start_round(1, 7, devices[:3], params, 100.0)
    storage.start_round(2, 7, devices, {}, 200.0)
    assert storage.next_round_id() == 3
    assert storage.phase_devices(1, COHORT_PHASE) == (devices[:3], [])
    storage.finish_round(1, "aborted", reason="too few survivors", survivors=2, now=150.0)
    storage.finish_round(2, RoundStatus.COMMITTED, new_model_version=8, survivors=5, epsilon_spent=0.5, now=250.0)

    newest, oldest = storage.recent_rounds()
    assert oldest.round_id == 1 and oldest.status is RoundStatus.ABORTED
    assert (oldest.started_at, oldest.finished_at, oldest.reason) == (100.0, 150.0, "too few survivors")
    assert (oldest.base_model_version, oldest.new_model_version, oldest.cohort_size) == (7, None, 3)
    assert oldest.params == params and oldest.epsilon_spent is None
    assert (newest.status, newest.new_model_version, newest.survivors, newest.epsilon_spent) == (
        "committed",
        8,
        5,
        0.5,
    )
    assert [r.round_id for r in storage.recent_rounds(limit=1)] == [2]
    assert storage.round_counts() == {"open": 0, "committed": 1, "aborted": 1, "abandoned": 0}


def test_round_misuse(storage: Storage, devices: list[int]) -> None:
    storage.start_round(1, 0, devices, {}, 1.0)
    with pytest.raises(StorageError, match="round 1 already exists"):
        storage.start_round(1, 0, devices, {}, 1.0)
    with pytest.raises(ValueError, match="more than once"):
        storage.start_round(2, 0, [1, 1], {}, 1.0)
    with pytest.raises(ValueError, match="params cannot be stored as JSON"):
        storage.start_round(2, 0, [1], {"x": object()}, 1.0)
    with pytest.raises(ValueError, match="round status must be one of"):
        storage.finish_round(1, "done", now=2.0)
    with pytest.raises(ValueError, match="status must be 'committed'"):
        storage.finish_round(1, "open", now=2.0)
    with pytest.raises(StorageError, match="round 9 does not exist"):
        storage.finish_round(9, "aborted", now=2.0)
    storage.finish_round(1, "aborted", now=2.0)
    with pytest.raises(StorageError, match="round 1 is already aborted"):
        storage.finish_round(1, "committed", now=3.0)


def test_abandon_open_rounds(storage: Storage, devices: list[int]) -> None:
    for rid in (1, 2, 3):
        storage.start_round(rid, 0, devices, {}, float(rid))
    storage.finish_round(2, "committed", new_model_version=1, now=5.0)
    assert storage.abandon_open_rounds(now=9.0) == [1, 3]
    assert storage.abandon_open_rounds(now=10.0) == []
    by_id = {r.round_id: r for r in storage.recent_rounds()}
    for rid in (1, 3):
        assert by_id[rid].status is RoundStatus.ABANDONED
        assert (by_id[rid].reason, by_id[rid].finished_at) == ("server restarted", 9.0)
    assert by_id[2].status is RoundStatus.COMMITTED
    assert storage.round_counts()["abandoned"] == 2


def test_phases_round_trip(storage: Storage, devices: list[int]) -> None:
    storage.start_round(1, 0, devices, {}, 1.0)
    storage.record_phase(1, "advertise_keys", devices[:4], devices[4:], 1.5, 2.5)
    storage.record_phase(1, "share_keys", devices[1:4], devices[:1], 0.25, 2.75)
    stats = storage.phase_stats(1)
    assert [(p.phase, p.seconds, p.arrived, p.dropped) for p in stats] == [
        ("advertise_keys", 1.5, 4, 1),
        ("share_keys", 0.25, 3, 1),
    ]
    assert storage.phase_devices(1, "share_keys") == (devices[1:4], devices[:1])
    assert storage.phase_stats(2) == []
    with pytest.raises(StorageError, match="record_phase failed.*UNIQUE"):
        storage.record_phase(1, "share_keys", [], [], 0.1, 3.0)
    with pytest.raises(ValueError, match="both arrived and dropped"):
        storage.record_phase(1, "unmask", [1, 2], [2], 0.1, 3.0)
    with pytest.raises(StorageError, match="FOREIGN KEY"):
        storage.record_phase(7, "unmask", [1], [], 0.1, 3.0)


def _ledger() -> PrivacyLedger:
    return PrivacyLedger(
        epsilon_budget=8.0,
        delta=1e-5,
        rounds=[RoundCharge(mu=5e4, l1=300.0, l2=40.0, round_id=1), RoundCharge(mu=6e4, l1=300.0, l2=40.0)],
    )


def test_ledger_round_trip(storage: Storage) -> None:
    assert storage.load_ledger() is None
    ledger = _ledger()
    storage.save_ledger(ledger.to_dict())
    loaded = storage.load_ledger()
    assert loaded == ledger.to_dict()
    assert loaded is not None and PrivacyLedger.from_dict(loaded).spent() == pytest.approx(ledger.spent())
    storage.save_ledger({**ledger.to_dict(), "rounds": []})
    assert storage.load_ledger() == {**ledger.to_dict(), "rounds": []}
    with pytest.raises(ValueError, match="not JSON-serialisable|cannot be stored as JSON"):
        storage.save_ledger({"x": float("nan")})


def test_reopen_keeps_everything(tmp_path: Path) -> None:
    ledger = _ledger().to_dict()
    with Storage(tmp_path) as s:
        ids = [s.add_device(_token(i), "linux", float(i)) for i in range(4)]
        s.commit_model(1, None, _model(1), 1.0)
        s.start_round(1, 1, ids, {"k": 3}, 2.0)
        s.record_phase(1, "advertise_keys", ids[:3], ids[3:], 0.5, 2.5)
        s.commit_model(2, 1, _model(2), 3.0, ledger=ledger, round_update={"survivors": 3, "epsilon_spent": 1.5})
        s.start_round(2, 2, ids, {}, 4.0)
        before = (s.recent_rounds(), s.phase_stats(1), s.phase_devices(1, "advertise_keys"), s.checkpoints())
    with Storage(tmp_path) as s:
        assert s.device_ids() == ids and s.device_for_token(_token(2)) == ids[2]
        assert (
            s.recent_rounds(),
            s.phase_stats(1),
            s.phase_devices(1, "advertise_keys"),
            s.checkpoints(),
        ) == before
        assert s.load_ledger() == ledger
        assert s.load_latest_model() == (2, _model(2))
        assert s.abandon_open_rounds(5.0) == [2]
        assert s.integrity_check() == "ok"


# -- model checkpoints -----------------------------------------------------------------------------


def test_commit_and_load_model(storage: Storage) -> None:
    assert storage.load_latest_model() is None
    storage.commit_model(1, None, _model(1), 1.0)
    version, data = storage.load_latest_model() or (0, b"")
    assert version == 1 and decode(data) == decode(_model(1))
    (record,) = storage.checkpoints()
    assert record.path == storage.data_dir / "checkpoints" / "model-1.msgpack"
    assert record.sha256 == hashlib.sha256(_model(1)).digest() and record.size == len(_model(1))
    assert record.status is CheckpointStatus.GOOD and record.round_id is None


def test_commit_model_is_one_transaction_with_ledger_and_round(storage: Storage, devices: list[int]) -> None:
    storage.commit_model(1, None, _model(1), 1.0)
    storage.start_round(1, 1, devices, {}, 2.0)
    storage.commit_model(
        2, 1, _model(2), 3.0, ledger=_ledger().to_dict(), round_update={"survivors": 4, "epsilon_spent": 2.0}
    )
    (rec,) = storage.recent_rounds()
    assert (rec.status, rec.new_model_version, rec.survivors, rec.epsilon_spent, rec.finished_at) == (
        RoundStatus.COMMITTED,
        2,
        4,
        2.0,
        3.0,
    )
    assert storage.load_ledger() == _ledger().to_dict()
    assert storage.checkpoints()[0].round_id == 1


def test_strategy_state_is_stored_with_the_model_of_its_round(tmp_path: Path) -> None:
    with Storage(tmp_path) as s:
        devices = [s.add_device(_token(i), "linux", float(i)) for i in range(3)]
        s.commit_model(1, None, _model(1), 1.0)
        s.start_round(1, 1, devices, {"k": 3}, 2.0)
        with pytest.raises(ValueError, match="strategy_state cannot be stored as JSON"):
            s.commit_model(2, 1, _model(2), 3.0, round_update={"survivors": 4, "strategy_state": {"w": float("nan")}})
        assert not (s.data_dir / "checkpoints" / "model-2.msgpack").exists()  # refused before the write
        s.commit_model(2, 1, _model(2), 3.0, round_update={"survivors": 4, "strategy_state": {"w": 0.25}})
        s.start_round(2, 2, devices, {}, 4.0)
        s.commit_model(3, 2, _model(3), 5.0, round_update={"survivors": 4})
    with Storage(tmp_path) as s:  # a restart reads it back; the round's other params are kept
        assert s.strategy_state(2) == {"w": 0.25}
        assert s.strategy_state(1) == {} and s.strategy_state(3) == {} and s.strategy_state(9) == {}
        params = s.recent_rounds()[-1].params
        assert params["k"] == 3 and params["strategy_state"] == {"w": 0.25}


def test_commit_model_misuse(storage: Storage) -> None:
    storage.commit_model(3, None, _model(3), 1.0)
    with pytest.raises(StorageError, match="model version 3 is not newer than the committed 3"):
        storage.commit_model(3, None, _model(3), 2.0)
    with pytest.raises(StorageError, match="not newer"):
        storage.commit_model(2, None, _model(2), 2.0)
    with pytest.raises(ValueError, match="round_update needs a round_id"):
        storage.commit_model(4, None, _model(4), 2.0, round_update={})
    with pytest.raises(ValueError, match="unknown keys"):
        storage.commit_model(4, 1, _model(4), 2.0, round_update={"survivor": 3})
    with pytest.raises(ValueError, match="payload must be bytes"):
        storage.commit_model(4, None, "text", 2.0)  # type: ignore[arg-type]
    assert [c.model_version for c in storage.checkpoints()] == [3]
    assert not (storage.data_dir / "checkpoints" / "model-4.msgpack").exists()


@pytest.mark.parametrize("failure", [sqlite3.OperationalError("disk I/O error"), RuntimeError("killed")])
def test_crash_between_file_and_commit_keeps_previous_state(
    storage: Storage, devices: list[int], monkeypatch: pytest.MonkeyPatch, failure: Exception
) -> None:
    storage.commit_model(1, None, _model(1), 1.0, ledger={"format": 1, "rounds": []})
    storage.start_round(1, 1, devices, {}, 2.0)
    original = Storage._record_checkpoint

    def record_then_fail(self: Storage, *args: Any) -> None:
        original(self, *args)  # the row is written inside the transaction...
        raise failure  # ...which then dies before COMMIT

    monkeypatch.setattr(Storage, "_record_checkpoint", record_then_fail)
    expected = StorageError if isinstance(failure, sqlite3.Error) else type(failure)
    with pytest.raises(expected):
        storage.commit_model(2, 1, _model(2), 3.0, ledger=_ledger().to_dict(), round_update={"survivors": 5})
    monkeypatch.undo()

    assert (storage.data_dir / "checkpoints" / "model-2.msgpack").exists()  # the orphan file
    assert storage.load_latest_model() == (1, _model(1))
    assert [c.model_version for c in storage.checkpoints()] == [1]
    assert storage.load_ledger() == {"format": 1, "rounds": []}
    assert storage.recent_rounds()[0].status is RoundStatus.OPEN
    assert storage.integrity_check() == "ok"
    # The retry overwrites the orphan and commits normally.
    storage.commit_model(2, 1, _model(2), 4.0, round_update={"survivors": 5})
    assert storage.load_latest_model() == (2, _model(2))


def test_commit_into_a_closed_round_commits_nothing(storage: Storage, devices: list[int]) -> None:
    storage.commit_model(1, None, _model(1), 1.0)
    storage.start_round(1, 1, devices, {}, 2.0)
    storage.finish_round(1, "aborted", now=2.5)
    with pytest.raises(StorageError, match="round 1 is already aborted"):
        storage.commit_model(2, 1, _model(2), 3.0, ledger={"format": 1}, round_update={})
    assert storage.load_latest_model() == (1, _model(1))
    assert storage.load_ledger() is None


def test_file_write_failure_names_the_path(storage: Storage) -> None:
    storage.commit_model(1, None, _model(1), 1.0)
    target = storage.data_dir / "checkpoints" / "model-2.msgpack"
    target.mkdir()  # os.replace onto a directory fails, even as root
    with pytest.raises(StorageError, match=re.escape(f"cannot write checkpoint {target}")):
        storage.commit_model(2, None, _model(2), 2.0)
    assert list(target.parent.glob("*.tmp")) == []
    assert storage.load_latest_model() == (1, _model(1))


def _corrupt_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _corrupt_truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


def _corrupt_delete(path: Path) -> None:
    path.unlink()


@pytest.mark.parametrize(
    ("damage", "found"),
    [
        (_corrupt_flip, "found sha256 "),
        (_corrupt_truncate, "found sha256 "),
        (_corrupt_delete, "found no file"),
    ],
)
def test_damaged_checkpoint_falls_back_and_logs_loudly(
    storage: Storage, caplog: pytest.LogCaptureFixture, damage: Any, found: str
) -> None:
    for v in (1, 2, 3):
        storage.commit_model(v, None, _model(v), float(v))
    path = storage.data_dir / "checkpoints" / "model-3.msgpack"
    damage(path)
    with caplog.at_level(logging.ERROR, logger="agg_server.storage"):
        assert storage.load_latest_model() == (2, _model(2))
    (record,) = [r for r in caplog.records if r.name == "agg_server.storage"]
    assert record.levelno == logging.ERROR
    message = record.getMessage()
    assert str(path) in message and hashlib.sha256(_model(3)).hexdigest() in message and found in message
    if path.exists():
        assert hashlib.sha256(path.read_bytes()).hexdigest() in message
    assert [(c.model_version, c.status) for c in storage.checkpoints()] == [
        (3, CheckpointStatus.CORRUPT),
        (2, CheckpointStatus.GOOD),
        (1, CheckpointStatus.GOOD),
    ]
    caplog.clear()
    assert storage.load_latest_model() == (2, _model(2))  # not tried (or logged) again
    assert caplog.records == []
    storage.commit_model(3, None, _model(3), 9.0)  # the server goes on from version 2
    assert storage.load_latest_model() == (3, _model(3))


def test_no_intact_checkpoint_is_an_error(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with Storage(tmp_path) as s:
        s.commit_model(1, None, _model(1), 1.0)
        _corrupt_flip(tmp_path / "checkpoints" / "model-1.msgpack")
        with caplog.at_level(logging.ERROR), pytest.raises(StorageError, match="none of the 1 recorded"):
            s.load_latest_model()
    with Storage(tmp_path) as s, pytest.raises(StorageError, match="restore the files"):
        s.load_latest_model()


def test_keeps_five_checkpoints(storage: Storage) -> None:
    for v in range(1, 9):
        storage.commit_model(v, None, _model(v), float(v))
    assert [c.model_version for c in storage.checkpoints()] == [8, 7, 6, 5, 4]
    files = sorted(p.name for p in (storage.data_dir / "checkpoints").iterdir())
    assert files == [f"model-{v}.msgpack" for v in (4, 5, 6, 7, 8)]
    assert storage.load_latest_model() == (8, _model(8))


def test_retention_counts_good_checkpoints_only(tmp_path: Path) -> None:
    with Storage(tmp_path, keep_checkpoints=2) as s:
        for v in (1, 2, 3):
            s.commit_model(v, None, _model(v), float(v))
        _corrupt_delete(tmp_path / "checkpoints" / "model-3.msgpack")
        assert s.load_latest_model() == (2, _model(2))
        s.commit_model(4, None, _model(4), 4.0)
        # Two good ones (4, 2) survive; the corrupt 3 stays on record between them.
        assert [(c.model_version, c.status.value) for c in s.checkpoints()] == [
            (4, "good"),
            (3, "corrupt"),
            (2, "good"),
        ]


def test_stale_temp_files_are_removed_and_orphans_ignored(tmp_path: Path) -> None:
    with Storage(tmp_path) as s:
        s.commit_model(1, None, _model(1), 1.0)
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / ".model-2.msgpack.abc123.tmp").write_bytes(b"half a file")
    (checkpoints / "model-2.msgpack").write_bytes(b"orphan: written, never recorded")
    with Storage(tmp_path) as s:
        assert list(checkpoints.glob("*.tmp")) == []
        assert s.load_latest_model() == (1, _model(1))
        s.commit_model(2, None, _model(2), 2.0)
        assert s.load_latest_model() == (2, _model(2))


def test_files_of_pruned_rows_are_removed_on_open(tmp_path: Path) -> None:
    with Storage(tmp_path) as s:
        for v in range(3, 9):
            s.commit_model(v, None, _model(v), float(v))
    checkpoints = tmp_path / "checkpoints"
    # A commit that died between pruning its rows and unlinking their files leaves old files behind.
    (checkpoints / "model-2.msgpack").write_bytes(_model(2))
    (checkpoints / "model-9.msgpack").write_bytes(_model(9))  # a newer orphan is left alone
    with Storage(tmp_path) as s:
        names = sorted(p.name for p in checkpoints.iterdir())
        assert names == [f"model-{v}.msgpack" for v in (4, 5, 6, 7, 8, 9)]
        assert s.load_latest_model() == (8, _model(8))


# -- a real crash ----------------------------------------------------------------------------------

_CHILD = """
import hashlib, sys
from pathlib import Path
from agg_server.storage import Storage

def payload(v):
    return hashlib.sha256(str(v).encode()).digest() * (64 + 997 * (v % 7))

s = Storage(Path(sys.argv[1]))
s.abandon_open_rounds(0.0)
latest = s.load_latest_model()
v = latest[0] if latest else 0
ready = False
while True:
    v += 1
    rid = s.next_round_id()
    s.start_round(rid, v - 1, [], {"version": v}, float(v))
    s.commit_model(v, rid, payload(v), float(v), ledger={"format": 1, "version": v},
                   round_update={"survivors": v % 5})
    if not ready:
        print("ready", flush=True)
        ready = True
"""


def _child_payload(v: int) -> bytes:
    return hashlib.sha256(str(v).encode()).digest() * (64 + 997 * (v % 7))


def _kill_mid_commit(dirs: list[Path], rng: random.Random) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(d)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for d in dirs
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line == b"ready\n", proc.stderr.read().decode() if proc.stderr else line
        for proc in procs:
            time.sleep(rng.uniform(0.0, 0.15))
            proc.send_signal(signal.SIGKILL)
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate()
    assert all(proc.returncode == -signal.SIGKILL for proc in procs)


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
@pytest.mark.integration
def test_sigkill_during_commits_leaves_a_consistent_store(tmp_path: Path) -> None:
    rng = random.Random(20240611)
    # Two stores in parallel (each child spends ~1 s importing), each killed twice.
    dirs = [tmp_path / f"server-{i}" for i in range(2)]
    last: dict[Path, int] = {}
    for _ in range(2):  # two crashes per store: the second resumes from the first's leftovers
        _kill_mid_commit(dirs, rng)
        for d in dirs:
            with Storage(d) as s:
                assert s.integrity_check() == "ok"
                loaded = s.load_latest_model()
                assert loaded is not None
                version, data = loaded
                assert data == _child_payload(version)
                assert version > last.get(d, 0)
                last[d] = version
                # Checkpoint, ledger and round were committed together, or not at all.
                assert s.load_ledger() == {"format": 1, "version": version}
                committed = [r for r in s.recent_rounds(limit=1000) if r.status is RoundStatus.COMMITTED]
                assert max(r.new_model_version or 0 for r in committed) == version
                assert all(c.status is CheckpointStatus.GOOD for c in s.checkpoints())
                assert len(s.checkpoints()) <= 5
