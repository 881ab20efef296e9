"""Issue 15's attack table, row by row: each attack re-run against the device session or a live server on
loopback, with its new outcome."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgpack
import pytest

from agg_server.app import create_app
from protocol.codec import MAX_OBJECTS, check_shape, decode, encode
from protocol.errors import DecodeError, RemoteProtocolError
from protocol.messages import CheckIn, ErrorMessage, RegisterRequest, RegisterResponse, ShareKeysBroadcast
from tests.server_helpers import small_config

MSGPACK = {"Content-Type": "application/msgpack"}


async def _post(client: Any, path: str, body: bytes, token: str | None = None) -> tuple[int, Any]:
    headers = dict(MSGPACK)
    if token:
        headers["Authorization"] = f"Bearer {token}"
    resp = await client.post(path, data=body, headers=headers)
    return resp.status, decode(await resp.read())


# -- strict inputs (item 7) ------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("raw", ["²", "①", "٣", "１", "1²", "", "-1", "+1", " 1", "0x1", "1" * 19])
async def test_round_ids_are_ascii_digits_only(aiohttp_client: Any, tmp_path: Path, raw: str) -> None:
    client = await aiohttp_client(create_app(small_config(tmp_path, cohort=3)))
    status, reg = await _post(client, "/v1/devices", encode(RegisterRequest(platform="pytest")))
    assert status == 201 and isinstance(reg, RegisterResponse)
    resp = await client.post(
        f"/v1/rounds/{raw}/keys", data=b"", headers={**MSGPACK, "Authorization": f"Bearer {reg.token}"}
    )
    body = decode(await resp.read()) if resp.headers.get("Content-Type", "").startswith("application/msgpack") else None
    # never a 500, and never read as another round: '٣' and '１' used to be rounds 3 and 1
    assert resp.status in (400, 404), (raw, resp.status)
    if resp.status == 400:
        assert isinstance(body, ErrorMessage) and "ASCII digits" in body.message


def test_codec_caps_object_count_and_depth() -> None:
    nested = b"\x91" * 100_000 + b"\xc0"  # [[[[...]]]]
    empties = msgpack.packb([[]] * (1 << 20))  # one array of a million empty arrays (6 MB -> 4.8 GB of lists before)
    maps = msgpack.packb({"v": [1, 2], "t": 1, "b": {"r": [{}] * 100_000}})
    for body, what in ((nested, "deeper"), (empties, "objects"), (maps, "objects")):
        start = time.perf_counter()
        with pytest.raises(DecodeError, match=what):
            decode(body)
        assert time.perf_counter() - start < 0.5
    with pytest.raises(DecodeError, match="type byte"):
        check_shape(b"\x92\xc1\xc0")


def test_codec_still_decodes_the_largest_legitimate_messages() -> None:
    n = 4096  # a neighbourhood far above any parameter the finder returns
    ids = tuple(range(n))
    big = ShareKeysBroadcast(
        round_id=1,
        device_id=0,
        session_id=b"\x11" * 32,
        neighbour_ids=ids,
        c_public_keys=tuple(i.to_bytes(32, "big") for i in ids),
        s_public_keys=tuple((i + n).to_bytes(32, "big") for i in ids),
    )
    assert decode(encode(big)) == big
    assert 3 * n + 20 < MAX_OBJECTS


@pytest.mark.asyncio
async def test_a_deeply_nested_registration_is_refused_quickly(aiohttp_client: Any, tmp_path: Path) -> None:
    client = await aiohttp_client(create_app(small_config(tmp_path, cohort=3)))
    start = time.perf_counter()
    status, msg = await _post(client, "/v1/devices", msgpack.packb([[]] * 500_000))
    assert status == 400 and isinstance(msg, ErrorMessage) and "objects" in msg.message
    assert time.perf_counter() - start < 2.0
    status, msg = await _post(client, "/v1/checkin", encode(CheckIn(device_id=0)), "x" * 40)
    assert status == 401  # the server is still answering
    assert issubclass(DecodeError, RemoteProtocolError)
