"""The real server process, killed with SIGKILL in the middle of a round and restarted on the same
data folder: no committed round is lost, training continues from the last committed model, the open
round is abandoned, and the SQLite database passes its integrity check.  Also: SIGTERM shuts down
cleanly and `fedrec-server` names a bad config key."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fedsim.fleets.local import FleetConfig, fetch_status, run_fleet
from tests.server_helpers import BITS, N_ITEMS, users


def _write_config(path: Path, data_dir: Path) -> None:
    path.write_text(
        f"""
[server]
host = "127.0.0.1"
port = 0
data_dir = "{data_dir}"

[model]
n_items = {N_ITEMS}
bits = {BITS}

[rounds]
cohort_size = 5
min_cohort = 5
seed = 3
clip_norm = 64.0
scale_bits = 12
advertise_timeout = 3.0
share_keys_timeout = 3.0
masked_input_timeout = 3.0
unmask_timeout = 3.0
round_interval = 0.05
"""
    )


def _start(config: Path) -> tuple[subprocess.Popen[str], str]:
    log = open(config.with_suffix(".log"), "a")  # noqa: SIM115 - closed by _reap
    proc = subprocess.Popen(
        [sys.executable, "-m", "agg_server", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    log.close()  # the child holds its own descriptor
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        _reap(proc, kill=True)
        raise AssertionError(f"server did not start: {line!r}; see {config.with_suffix('.log')}")
    return proc, line.strip().rsplit(" ", 1)[-1]


def _reap(proc: subprocess.Popen[str], *, kill: bool = False) -> int:
    if kill and proc.poll() is None:
        proc.kill()
    code = proc.wait(timeout=30)
    if proc.stdout is not None:
        proc.stdout.close()
    return code


async def _fleet(url: str, store: Path, rounds: int) -> Any:
    cfg = FleetConfig(url=url, store_root=store, n_items=N_ITEMS, bits=BITS, rounds=rounds, time_limit=60.0)
    report, _ = await run_fleet(cfg, list(users(5).values()))
    return report


@pytest.mark.asyncio
async def test_sigkill_mid_round_then_restart(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    config = tmp_path / "server.toml"
    _write_config(config, data_dir)
    proc, url = _start(config)
    try:
        report = await _fleet(url, tmp_path / "devices", rounds=1)
        assert report.rounds_finished == 1 and report.server_rounds[0]["status"] == "committed"
        # Second round: kill the server as soon as the round is past its first phase.
        fleet = asyncio.create_task(_fleet(url, tmp_path / "devices", rounds=1))
        async with aiohttp.ClientSession() as session:
            for _ in range(400):
                status = await fetch_status(session, url)
                current = status.get("round")
                if current and current["phase"] in ("share_keys", "masked_input", "unmask"):
                    killed = int(current["round_id"])  # 2, or later when round 2 aborted on the way
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("round 2 never started")
        proc.send_signal(signal.SIGKILL)
        _reap(proc)
        fleet.cancel()
        await asyncio.gather(fleet, return_exceptions=True)
    finally:
        _reap(proc, kill=True)

    proc, url = _start(config)
    try:
        async with aiohttp.ClientSession() as session:
            status = await fetch_status(session, url)
        assert status["model"]["version"] == 2  # the committed round survived
        assert status["abandoned_at_start"] == [killed]
        states = {r["round_id"]: r["status"] for r in status["recent_rounds"]}
        # Rounds between 1 and the killed one can only have aborted (none committed: the version is 2).
        assert states == {1: "committed", killed: "abandoned", **dict.fromkeys(range(2, killed), "aborted")}
        report = await _fleet(url, tmp_path / "devices", rounds=1)
        assert report.server_rounds[0]["status"] == "committed"
        assert report.server_rounds[0]["new_model_version"] == 3
        proc.send_signal(signal.SIGTERM)
        assert _reap(proc) == 0
    finally:
        _reap(proc, kill=True)
    with sqlite3.connect(data_dir / "fedrec.sqlite3") as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        rows = db.execute("SELECT round_id, status FROM rounds ORDER BY round_id").fetchall()
    db.close()
    statuses = dict(rows)
    committed = [r for r, st in rows if st == "committed"]
    assert committed[0] == 1 and len(committed) == 2 and statuses[killed] == "abandoned"
    assert all(statuses[r] == "aborted" for r in range(2, killed))
    # A round the devices opened before SIGTERM is closed as abandoned, never left open.
    assert all(st == "abandoned" for r, st in rows if r > committed[1])


def test_bad_config_key_is_named(tmp_path: Path) -> None:
    config = tmp_path / "server.toml"
    config.write_text('[server]\ndata_dir = "d"\n[model]\nn_items = 10\nbitz = 64\n')
    out = subprocess.run(
        [sys.executable, "-m", "agg_server", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "model.bitz" in out.stderr and "bits" in out.stderr


def test_sigterm_closes_cleanly(tmp_path: Path) -> None:
    config = tmp_path / "server.toml"
    _write_config(config, tmp_path / "data")
    proc, _ = _start(config)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    assert _reap(proc) == 0
    # A clean close checkpoints the WAL: nothing is left to replay.
    wal = tmp_path / "data" / "fedrec.sqlite3-wal"
    assert not wal.exists() or os.path.getsize(wal) == 0
