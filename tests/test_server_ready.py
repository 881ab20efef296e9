"""Liveness and readiness (`/v1/health`, `/v1/ready`) on the embedded SQLite back-end, the database
timeouts of ``[storage]`` and the masking of secrets in every form of connection string.  The same on a
real PostgreSQL (restart, 10 s table lock): tests/test_server_outages.py."""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from agg_server.app import create_app
from agg_server.config import StorageSection
from agg_server.storage import DATABASE_NAME, Storage, Timeouts, mask_secrets, redact_url
from protocol.errors import ConfigError, StorageError
from tests.server_helpers import small_config


async def _ready(client: Any) -> tuple[int, dict[str, Any]]:
    response = await client.get("/v1/ready")
    return response.status, await response.json()


@pytest.mark.asyncio
async def test_a_locked_database_makes_the_server_not_ready_but_alive(aiohttp_client: Any, tmp_path: Path) -> None:
    cfg = small_config(tmp_path, cohort=3)
    cfg = dataclasses.replace(cfg, storage=StorageSection(lock_timeout=0.3, lease_seconds=1.5))
    client = await aiohttp_client(create_app(cfg))
    assert await _ready(client) == (200, {"status": "ready"})
    blocker = sqlite3.connect(tmp_path / DATABASE_NAME, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")  # every write of the server now waits, then times out
    try:
        reasons: list[str] = []
        for _ in range(200):
            status, body = await _ready(client)
            health = await client.get("/v1/health")
            assert health.status == 200  # liveness: the process is fine, do not restart it
            if status == 503:
                reasons = body["reasons"]
                break
            await asyncio.sleep(0.05)
        assert any("database" in r or "lease" in r for r in reasons), reasons
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    for _ in range(200):  # released: ready again by itself
        if (await _ready(client))[0] == 200:
            break
        await asyncio.sleep(0.05)
    assert await _ready(client) == (200, {"status": "ready"})


def test_a_locked_sqlite_database_gives_up_after_the_lock_timeout(tmp_path: Path) -> None:
    with Storage(tmp_path, timeouts=Timeouts(lock=0.2)) as storage:
        blocker = sqlite3.connect(tmp_path / DATABASE_NAME, isolation_level=None)
        blocker.execute("BEGIN EXCLUSIVE")
        try:
            with pytest.raises(StorageError, match="locked"):
                storage.add_enrollment_tokens([bytes(32)], "token:a", 0.0)
            assert "locked" in storage.health.failure and storage.health.busy_since is None
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        storage.add_enrollment_tokens([bytes(32)], "token:a", 0.0)
        assert storage.health.failure == ""


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"connect_timeout": 0.5}, "storage.connect_timeout"),
        ({"statement_timeout": "10"}, "storage.statement_timeout"),
        ({"lock_timeout": 0.0}, "storage.lock_timeout"),
        ({"lock_timeout": 30.0, "statement_timeout": 10.0}, "at most storage.statement_timeout"),
    ],
)
def test_database_timeouts_are_validated(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        StorageSection(**values)


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("postgresql://fedrec:s3cr3t@db:5432/fedrec", "s3cr3t"),
        ("postgresql://fedrec:p@ss@db/fedrec?sslmode=require", "p@ss"),
        ("postgresql://fedrec@db/fedrec?password=s3cr3t&sslmode=require", "s3cr3t"),
        ("host=db user=fedrec password=s3cr3t dbname=fedrec", "s3cr3t"),
        ("host=db password='two words' dbname=fedrec", "two words"),
        ('connection to server failed: FATAL: "PASSWORD = s3cr3t"', "s3cr3t"),
    ],
)
def test_secrets_are_masked_in_every_form_of_connection_string(text: str, secret: str) -> None:
    for masked in (mask_secrets(text), redact_url(text)):
        assert secret not in masked and "***" in masked, masked
    assert "db" in mask_secrets(text) or "server" in mask_secrets(text)  # the rest stays readable


@pytest.mark.asyncio
async def test_status_and_metrics_show_the_cluster_view(aiohttp_client: Any, tmp_path: Path) -> None:
    cfg = dataclasses.replace(small_config(tmp_path, cohort=3), storage=StorageSection(cohorts=2, instance_id="srv-a"))
    client = await aiohttp_client(create_app(cfg))
    cluster = (await (await client.get("/v1/status")).json())["cluster"]
    assert cluster["model_version"] == 1 and cluster["instance"] == "srv-a"
    assert cluster["leaders"] == [
        {"cohort": 0, "leader": "srv-a", "url": None, "here": True},
        {"cohort": 1, "leader": None, "url": None, "here": False},  # one slot: cohort 1 waits for an instance
    ]
    text = await (await client.get("/metrics")).text()
    assert "fedrec_cluster_model_version 1.0" in text
    assert 'fedrec_cohort_led_here{cohort="0",instance="srv-a"} 1.0' in text
    assert 'fedrec_cohort_led_here{cohort="1",instance="srv-a"} 0.0' in text
    assert 'fedrec_instance_info{instance="srv-a",url=""} 1.0' in text


@pytest.mark.asyncio
async def test_a_device_request_while_the_database_is_unavailable_gets_503_with_retry_after(
    aiohttp_client: Any, tmp_path: Path
) -> None:
    from protocol.codec import decode, encode
    from protocol.messages import ErrorMessage, RegisterRequest

    cfg = dataclasses.replace(small_config(tmp_path, cohort=3), storage=StorageSection(lock_timeout=0.2))
    client = await aiohttp_client(create_app(cfg))
    blocker = sqlite3.connect(tmp_path / DATABASE_NAME, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")  # a registration (a write) now times out on the lock
    try:
        headers = {"Content-Type": "application/msgpack"}
        response = await client.post("/v1/devices", data=encode(RegisterRequest(platform="t")), headers=headers)
        body = decode(await response.read())
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert response.status == 503 and response.headers["Retry-After"] == "2"
    assert isinstance(body, ErrorMessage) and body.code == "storage_error"
    assert "database is unavailable" in body.message and str(tmp_path) not in body.message  # no internals
    response = await client.post("/v1/devices", data=encode(RegisterRequest(platform="t")), headers=headers)
    assert response.status == 201  # the lock is gone: served again, no restart
