"""A device given several server URLs (the instances of one server on a shared database): when the one it
talks to dies it goes on with the next at once, and stays there.  Real aiohttp servers on loopback."""

from __future__ import annotations

import socket
from typing import Any

import pytest
from aiohttp import web

from device_sdk.http import HttpTransport
from device_sdk.transport import TransportError
from protocol.codec import encode
from protocol.errors import ConfigError
from protocol.messages import Wait


class _Sleeps:
    def __init__(self) -> None:
        self.calls: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)


def _dead_url() -> str:
    with socket.socket() as s:  # a port nobody listens on: bound, never listening, then closed
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


async def _live(aiohttp_server: Any, status: int = 200) -> tuple[str, list[str]]:
    seen: list[str] = []

    async def checkin(request: web.Request) -> web.Response:
        seen.append(request.path)
        return web.Response(
            body=encode(Wait(retry_after=1.0, reason="x")), status=status, content_type="application/msgpack"
        )

    app = web.Application()
    app.router.add_post("/v1/checkin", checkin)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/"), seen


@pytest.mark.asyncio
async def test_a_dead_instance_is_left_for_the_next_at_once_and_for_good(aiohttp_server: Any) -> None:
    live, seen = await _live(aiohttp_server)
    dead = _dead_url()
    sleeps = _Sleeps()
    transport = HttpTransport([dead, live], retries=3, sleep=sleeps)
    try:
        response = await transport.request("POST", "/v1/checkin", timeout=5.0)
        assert isinstance(response.message, Wait) and seen == ["/v1/checkin"]
        assert sleeps.calls == []  # no pause: the next instance was tried at once
        assert transport.base_url == live
        await transport.request("POST", "/v1/checkin", timeout=5.0)  # stays with the live one
        assert len(seen) == 2 and sleeps.calls == []
    finally:
        await transport.close()


@pytest.mark.asyncio
async def test_a_gateway_error_moves_on_and_a_fleet_without_a_live_instance_pauses(aiohttp_server: Any) -> None:
    bad_gateway, _ = await _live(aiohttp_server, status=502)
    live, seen = await _live(aiohttp_server)
    sleeps = _Sleeps()
    transport = HttpTransport([bad_gateway, live], retries=2, sleep=sleeps)
    try:
        await transport.request("POST", "/v1/checkin", timeout=5.0)
        assert seen and sleeps.calls == [] and transport.base_url == live
    finally:
        await transport.close()
    # Every root dead: one pause per full pass, then TransportError naming the last root tried.
    dead = [_dead_url(), _dead_url()]
    sleeps = _Sleeps()
    transport = HttpTransport(dead, retries=3, sleep=sleeps)
    try:
        with pytest.raises(TransportError, match="failed after 4 attempts"):
            await transport.request("POST", "/v1/checkin", timeout=5.0)
        assert len(sleeps.calls) == 1  # attempts: a, b (no pause), pause, a, b
    finally:
        await transport.close()


def test_every_root_is_checked() -> None:
    with pytest.raises(ConfigError, match="at least one"):
        HttpTransport([])
    with pytest.raises(ConfigError, match="absolute http"):
        HttpTransport(["http://127.0.0.1:1", "ftp://x"])
