"""HttpTransport against tiny aiohttp servers on loopback (pytest-aiohttp's ``aiohttp_server``).

Back-off sleeps go through an injected recorder, so retry schedules are checked without waiting.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from device_sdk.client import ClientConfig, DeviceClient, RoundStatus, insecure_seeded_rngs
from device_sdk.http import HttpTransport
from device_sdk.transport import MSGPACK_CONTENT_TYPE, TransportError, raise_for_error
from fedsim.fleets.faults import DropoutAt, FaultyTransport
from protocol.codec import decode, encode
from protocol.errors import (
    AuthError,
    ConfigError,
    DecodeError,
    FedRecError,
    PayloadTooLarge,
    RemoteProtocolError,
    RoundClosed,
)
from protocol.messages import CheckIn, ErrorMessage, Message, Wait
from protocol.policy import PrivacyPolicy
from tests.test_device_client import BITS, N_ITEMS, SEED, FakeServer, RecordingSession, _data, expected_sum
from tests.test_device_client import recording as recording  # noqa: F401  (fixture)

ServerFactory = Callable[..., Awaitable[TestServer]]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def packed(message: Message, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=encode(message), status=status, content_type=MSGPACK_CONTENT_TYPE, headers=headers or {})


class Sleeps:
    """Injected sleep: records the delays and yields once, never waits."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)
        await asyncio.sleep(0)


async def serve(aiohttp_server: ServerFactory, routes: dict[tuple[str, str], Handler]) -> TestServer:
    app = web.Application()
    for (method, path), handler in routes.items():
        app.router.add_route(method, path, handler)
    return await aiohttp_server(app)


def url_of(server: TestServer) -> str:
    return str(server.make_url(""))


WAIT = Wait(retry_after=2.0, reason="no round")
CHECKIN = CheckIn(device_id=5, model_version=1)


@pytest.mark.asyncio
async def test_request_headers_and_body(aiohttp_server: ServerFactory) -> None:
    seen: dict[str, Any] = {}

    async def checkin(request: web.Request) -> web.Response:
        seen.update(request.headers)
        seen["body"] = decode(await request.read())
        return packed(WAIT, headers={"Retry-After": "2"})

    server = await serve(aiohttp_server, {("POST", "/v1/checkin"): checkin})
    async with HttpTransport(url_of(server)) as transport:
        response = await transport.request("POST", "/v1/checkin", CHECKIN, token="tok-123")
    assert response.status == 200 and response.message == WAIT and response.retry_after == 2.0
    assert seen["body"] == CHECKIN
    assert seen["Authorization"] == "Bearer tok-123"
    assert seen["Content-Type"] == MSGPACK_CONTENT_TYPE and seen["Accept"] == MSGPACK_CONTENT_TYPE
    assert response.bytes_up == len(encode(CHECKIN)) and response.bytes_down == len(encode(WAIT))


@pytest.mark.asyncio
@pytest.mark.parametrize("status", [503, 429, 502, 504])
async def test_retries_honour_retry_after(aiohttp_server: ServerFactory, status: int) -> None:
    calls = 0

    async def busy(request: web.Request) -> web.Response:
        nonlocal calls
        calls += 1
        if calls <= 2:
            return packed(ErrorMessage(code="round_error", message="busy"), status, {"Retry-After": "0.05"})
        return packed(WAIT)

    server = await serve(aiohttp_server, {("POST", "/v1/checkin"): busy})
    sleeps = Sleeps()
    async with HttpTransport(url_of(server), sleep=sleeps) as transport:
        response = await transport.request("POST", "/v1/checkin", CHECKIN)
    assert calls == 3 and sleeps.delays == [0.05, 0.05]
    assert response.status == 200 and response.message == WAIT
    assert response.bytes_up == 3 * len(encode(CHECKIN))


@pytest.mark.asyncio
async def test_real_retry_after_sleep_is_waited(aiohttp_server: ServerFactory) -> None:
    calls: list[float] = []

    async def busy(request: web.Request) -> web.Response:
        calls.append(asyncio.get_running_loop().time())
        if len(calls) == 1:
            return web.Response(status=503, text="overloaded", headers={"Retry-After": "0.05"})
        return packed(WAIT)

    server = await serve(aiohttp_server, {("POST", "/v1/checkin"): busy})
    async with HttpTransport(url_of(server)) as transport:
        response = await transport.request("POST", "/v1/checkin", CHECKIN)
    assert response.message == WAIT
    assert calls[1] - calls[0] >= 0.045


@pytest.mark.asyncio
async def test_full_jitter_backoff_and_retry_after_cap(aiohttp_server: ServerFactory) -> None:
    calls = 0

    async def busy(request: web.Request) -> web.Response:
        nonlocal calls
        calls += 1
        headers = {"Retry-After": "99999"} if calls == 4 else {}
        return packed(ErrorMessage(code="round_error", message="busy"), 503, headers)

    server = await serve(aiohttp_server, {("POST", "/v1/checkin"): busy})
    sleeps = Sleeps()
    transport = HttpTransport(
        url_of(server), retries=4, backoff_base=0.1, backoff_max=0.3, rng=random.Random(1), sleep=sleeps
    )
    async with transport:
        response = await transport.request("POST", "/v1/checkin", CHECKIN)
    # Retries exhausted: the last answer comes back and maps to the server's error.
    assert calls == 5 and response.status == 503
    with pytest.raises(FedRecError, match="busy"):
        raise_for_error(response)
    ceilings = [0.1, 0.2, 0.3]
    assert len(sleeps.delays) == 4
    for delay, ceiling in zip(sleeps.delays[:3], ceilings, strict=True):
        assert 0.0 <= delay <= ceiling
    assert sleeps.delays[3] == pytest.approx(3.0)  # Retry-After capped at 10 * backoff_max
    assert len(set(sleeps.delays[:3])) == 3  # jittered, not fixed


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("status", "error", "cls"),
    [
        (400, DecodeError("bad bytes"), DecodeError),
        (401, AuthError("unknown token"), AuthError),
        (409, RoundClosed("SHARE_KEYS closed"), RoundClosed),
        (413, PayloadTooLarge("too big"), PayloadTooLarge),
    ],
)
async def test_errors_map_back_and_4xx_is_not_retried(
    aiohttp_server: ServerFactory, status: int, error: FedRecError, cls: type[FedRecError]
) -> None:
    calls = 0

    async def refuse(request: web.Request) -> web.Response:
        nonlocal calls
        calls += 1
        return packed(ErrorMessage.from_exception(error), status)

    server = await serve(aiohttp_server, {("POST", "/v1/checkin"): refuse})
    sleeps = Sleeps()
    async with HttpTransport(url_of(server), sleep=sleeps) as transport:
        response = await transport.request("POST", "/v1/checkin", CHECKIN)
    assert calls == 1 and sleeps.delays == []
    assert response.status == status
    with pytest.raises(cls, match=str(error)) as info:
        raise_for_error(response)
    assert type(info.value) is cls


@pytest.mark.asyncio
async def test_etag_and_not_modified(aiohttp_server: ServerFactory) -> None:
    tag = '"4-0123456789abcdef"'

    async def model(request: web.Request) -> web.Response:
        if request.headers.get("If-None-Match") == tag:
            return web.Response(status=304, headers={"ETag": tag})
        return packed(WAIT, headers={"ETag": tag})

    server = await serve(aiohttp_server, {("GET", "/v1/model"): model})
    async with HttpTransport(url_of(server)) as transport:
        first = await transport.request("GET", "/v1/model", token="t")
        second = await transport.request("GET", "/v1/model", token="t", if_none_match=first.etag)
    assert first.status == 200 and first.etag == tag and first.message == WAIT
    assert second.status == 304 and second.message is None and second.etag == tag
    assert raise_for_error(second) is second


@pytest.mark.asyncio
async def test_html_500_is_a_remote_protocol_error(aiohttp_server: ServerFactory) -> None:
    calls = 0

    async def broken(request: web.Request) -> web.Response:
        nonlocal calls
        calls += 1
        return web.Response(status=500, text="<html>Internal Server Error</html>", content_type="text/html")

    server = await serve(aiohttp_server, {("POST", "/v1/checkin"): broken})
    async with HttpTransport(url_of(server), sleep=Sleeps()) as transport:
        with pytest.raises(RemoteProtocolError, match=r"HTTP 500 .*text/html") as info:
            await transport.request("POST", "/v1/checkin", CHECKIN)
    assert type(info.value) is RemoteProtocolError and calls == 1


@pytest.mark.asyncio
async def test_undecodable_body_is_a_decode_error(aiohttp_server: ServerFactory) -> None:
    async def garbage(request: web.Request) -> web.Response:
        return web.Response(body=b"\xc1\xc1\xc1", content_type=MSGPACK_CONTENT_TYPE)

    server = await serve(aiohttp_server, {("POST", "/v1/checkin"): garbage})
    async with HttpTransport(url_of(server)) as transport:
        with pytest.raises(DecodeError):
            await transport.request("POST", "/v1/checkin", CHECKIN)


@pytest.mark.asyncio
async def test_oversized_answer_is_refused(aiohttp_server: ServerFactory) -> None:
    async def big(request: web.Request) -> web.Response:
        return packed(Wait(retry_after=1.0, reason="x" * 2000))

    server = await serve(aiohttp_server, {("POST", "/v1/checkin"): big})
    async with HttpTransport(url_of(server), max_message_bytes=1000) as transport:
        with pytest.raises(PayloadTooLarge):
            await transport.request("POST", "/v1/checkin", CHECKIN)


@pytest.mark.asyncio
async def test_connection_refused_is_retried_then_a_clear_error(
    unused_tcp_port: int,
) -> None:
    port = unused_tcp_port
    sleeps = Sleeps()
    async with HttpTransport(f"http://127.0.0.1:{port}", retries=3, sleep=sleeps) as transport:
        with pytest.raises(TransportError, match=r"after 4 attempts: .*Connect") as info:
            await transport.request("POST", "/v1/checkin", CHECKIN)
    assert len(sleeps.delays) == 3
    assert isinstance(info.value, RemoteProtocolError)


@pytest.mark.asyncio
async def test_timeout_is_retried(aiohttp_server: ServerFactory) -> None:
    calls = 0
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        nonlocal calls
        calls += 1
        if calls == 1:
            try:
                await asyncio.wait_for(release.wait(), timeout=30.0)  # held until the test is done with it
            except TimeoutError:
                pass
        return packed(WAIT)

    server = await serve(aiohttp_server, {("POST", "/v1/checkin"): slow})
    sleeps = Sleeps()
    async with HttpTransport(url_of(server), sleep=sleeps) as transport:
        # 0.5 s per attempt: the held first one times out; the second, answered at once, needs a few ms
        # (at 50 ms, a loaded machine could time it out too and make a third attempt)
        response = await transport.request("POST", "/v1/checkin", CHECKIN, timeout=0.5)
    release.set()
    assert response.message == WAIT and calls == 2 and len(sleeps.delays) == 1


@pytest.mark.asyncio
async def test_session_ownership(aiohttp_server: ServerFactory) -> None:
    async def ok(request: web.Request) -> web.Response:
        return packed(WAIT)

    server = await serve(aiohttp_server, {("POST", "/v1/checkin"): ok})
    async with aiohttp.ClientSession() as session:
        transport = HttpTransport(url_of(server), session=session)
        await transport.request("POST", "/v1/checkin", CHECKIN)
        await transport.close()
        assert not session.closed  # the caller's session stays open
        with pytest.raises(FedRecError, match="closed"):
            await transport.request("POST", "/v1/checkin", CHECKIN)


@pytest.mark.parametrize("url", ["ftp://example.org", "not a url", "/v1/relative", "http://"])
def test_bad_base_url_is_a_config_error(url: str) -> None:
    with pytest.raises(ConfigError):
        HttpTransport(url)


def test_bad_numbers_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        HttpTransport("http://127.0.0.1:1", retries=-1)
    with pytest.raises(ConfigError):
        HttpTransport("http://127.0.0.1:1", backoff_base=0.0)


# -- end to end: DeviceClient.connect over loopback HTTP against the in-memory SecAgg server ----------


def fake_app(fake: FakeServer) -> web.Application:
    async def handle(request: web.Request) -> web.Response:
        raw = await request.read()
        message = None
        if raw:
            try:
                message = decode(raw)
            except DecodeError as exc:
                return packed(ErrorMessage.from_exception(exc), 400)
        auth = request.headers.get("Authorization", "")
        token = auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None
        status, answer, headers = await fake.handle(
            request.method, request.path, message, token, request.headers.get("If-None-Match")
        )
        if answer is None:
            return web.Response(status=status, headers=headers)
        return packed(answer, status, headers)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


@pytest.mark.asyncio
@pytest.mark.parametrize("dropout", [DropoutAt.NONE, DropoutAt.DISCONNECT_MASKED, DropoutAt.BEFORE_SHARES])
async def test_device_clients_over_http(
    aiohttp_server: ServerFactory, tmp_path: Path, recording: list[RecordingSession], dropout: DropoutAt
) -> None:
    fake = FakeServer()
    server = await aiohttp_server(fake_app(fake))
    clients: list[DeviceClient] = []

    def make(i: int) -> DeviceClient:
        items, ratings = _data(i)

        def rngs(round_id: int) -> tuple[np.random.Generator, np.random.Generator]:
            device_id = clients[i].device_id
            assert device_id is not None
            return insecure_seeded_rngs(SEED, round_id, device_id)

        client = DeviceClient(
            # Device 2 leaves as ``dropout`` says (fault injection wraps its real HTTP transport).
            # 0.3 s for the masked input to leave before the connection is cut: on a loaded machine the
            # default 50 ms sometimes cut it before the body left (then it is a MASKED_INPUT dropout).
            FaultyTransport(HttpTransport(url_of(server)), dropout if i == 2 else DropoutAt.NONE, disconnect_after=0.3),
            ClientConfig(store_dir=tmp_path / f"d{i}", long_poll_timeout=10.0, privacy=PrivacyPolicy.no_floor()),
            items=items,
            ratings=ratings,
            n_items=N_ITEMS,
            bits=BITS,
            rng_for_round=rngs,
        )
        client._owns_transport = True  # close() closes it, as `DeviceClient.connect` arranges
        return client

    for i in range(5):
        clients.append(make(i))
    try:
        ids = [await c.register() for c in clients]
        fake.open_round(ids)

        async def drive(c: DeviceClient) -> RoundStatus:
            try:
                return (await c.run_round()).status
            finally:
                assert c.device_id is not None
                await fake.mark_gone(c.device_id)

        statuses = await asyncio.gather(*(drive(c) for c in clients))
    finally:
        for c in clients:
            await c.close()
    dropped = dropout is not DropoutAt.NONE
    assert (
        statuses
        == [RoundStatus.COMMITTED] * 2
        + [RoundStatus.DROPPED if dropped else RoundStatus.COMMITTED]
        + [RoundStatus.COMMITTED] * 2
    )
    assert (ids[2] in fake.result_survivors) is (dropout is not DropoutAt.BEFORE_SHARES)
    assert fake.result_total is not None
    np.testing.assert_array_equal(fake.result_total, expected_sum(recording, fake.result_survivors))
