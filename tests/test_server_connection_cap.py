"""The listening socket's cap on connections per source (docs/threat-model.md §3.5): a real fedrec app behind
the `fedrec-server` site on loopback, an attacker connecting from 127.0.0.2 and a health checker from
127.0.0.1.  Assertions are on the site's counters and on the order of events, not on wall time; the latency
figure is benchmarks/bench_health_flood.py."""

from __future__ import annotations

import asyncio
import ipaddress
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp import web

from agg_server.app import create_app
from agg_server.config import ServerConfig, config_from_dict
from agg_server.listener import CappedTCPSite
from protocol.errors import ConfigError
from tests.server_helpers import small_config

pytestmark = pytest.mark.integration

ATTACKER = "127.0.0.2"
PARTIAL = (
    b"POST /v1/devices HTTP/1.1\r\nHost: x\r\nContent-Type: application/msgpack\r\n"
    b"Content-Length: 60000\r\n\r\n" + b"\x91" * 100
)


@pytest_asyncio.fixture
async def site(tmp_path: Path) -> AsyncIterator[CappedTCPSite]:
    runner = web.AppRunner(create_app(small_config(tmp_path, cohort=3)), handle_signals=False, access_log=None)
    await runner.setup()
    site = CappedTCPSite(runner, "127.0.0.1", 0, per_source=64, exempt=[ipaddress.ip_network("127.0.0.1/32")])
    await site.start()
    try:
        yield site
    finally:
        await runner.cleanup()


def _port(site: CappedTCPSite) -> int:
    return int(site._runner.addresses[0][1])


async def _partial(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(ATTACKER, 0))
    writer.write(PARTIAL)
    await writer.drain()
    return reader, writer


async def _health(port: int) -> dict[str, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /v1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    raw = await reader.read()
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    return dict(json.loads(body))


async def _until(condition: object, what: str) -> None:
    for _ in range(2000):
        if condition():  # type: ignore[operator]
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never reached: {what}")


@pytest.mark.asyncio
async def test_300_partial_bodies_from_one_source_hold_64_connections_and_health_answers(site: CappedTCPSite) -> None:
    port = _port(site)
    attackers = [await _partial(port) for _ in range(300)]
    await _until(lambda: site.accepted + site.refused >= 300, "every attacker connection accepted or closed")
    assert (site.accepted, site.refused) == (64, 236)
    assert site.open_connections(ATTACKER) == 64
    # the connections beyond the cap were closed without a byte of HTTP: the server read none of their bodies
    closed = [r for r, _ in attackers[64:]]
    for reader in closed:
        try:
            assert await reader.read(64) == b""
        except ConnectionResetError:
            pass
    # health, from a source outside the cap, answers every time while the 64 partial bodies are held
    for _ in range(20):
        assert (await _health(port))["status"] == "ok"
    assert site.accepted == 64 + 20 and site.refused == 236
    held = [r for r, _ in attackers[:64]]
    assert not any(r.at_eof() for r in held)  # still waiting for their bodies: nothing answered them yet
    # once the attacker lets go, its address may connect again
    for _, writer in attackers:
        writer.transport.abort()
    await _until(lambda: site.open_connections(ATTACKER) == 0, "the attacker's connections closed on the server")
    _, writer = await _partial(port)
    await _until(lambda: site.accepted == 64 + 20 + 1, "a new connection from the attacker's address accepted")
    writer.transport.abort()


@pytest.mark.asyncio
async def test_an_uncapped_source_is_never_refused(tmp_path: Path) -> None:
    runner = web.AppRunner(create_app(small_config(tmp_path, cohort=3)), handle_signals=False, access_log=None)
    await runner.setup()
    site = CappedTCPSite(runner, "127.0.0.1", 0, per_source=4, exempt=[ipaddress.ip_network("127.0.0.0/8")])
    await site.start()
    try:
        port = _port(site)
        conns = [await _partial(port) for _ in range(12)]
        await _until(lambda: site.accepted == 12, "all 12 accepted")
        assert site.refused == 0 and site.open_connections(ATTACKER) == 0  # not even tracked
        for _, writer in conns:
            writer.transport.abort()
    finally:
        await runner.cleanup()


def test_the_cap_settings_are_validated(tmp_path: Path) -> None:
    def build(**server: object) -> ServerConfig:
        return config_from_dict(
            {"server": {"data_dir": str(tmp_path), **server}, "model": {"n_items": 10}}, base_dir=tmp_path
        )

    cfg = build()
    assert cfg.listen.max_connections_per_source == 64
    assert cfg.listen.uncapped_networks == (
        ipaddress.ip_network("127.0.0.1/32"),
        ipaddress.ip_network("::1/128"),
    )
    assert build(max_connections_per_source=0, uncapped_sources=["10.0.0.0/8"]).listen.uncapped_sources == (
        "10.0.0.0/8",
    )
    with pytest.raises(ConfigError, match=r"^server\.max_connections_per_source"):
        build(max_connections_per_source=-1)
    with pytest.raises(ConfigError, match=r"^server\.uncapped_sources"):
        build(uncapped_sources=["10.0.0.0/33"])
    with pytest.raises(ConfigError, match=r"^server\.uncapped_sources"):
        build(uncapped_sources="127.0.0.1")
