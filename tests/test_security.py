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


# -- the device-side privacy floor (item 3) ---------------------------------------------------------------


def _invite(**changes: Any) -> Any:
    import dataclasses

    from protocol.messages import RoundInvite

    base = RoundInvite(
        round_id=4,
        device_id=10,
        vector_length=1000,
        graph_k=29,
        graph_t=16,
        clip_norm=1.0,
        scale_bits=8,
        dp_mu=(3 * (256 + 1000**0.5)) ** 2,  # noise multiplier 3
        dp_t_min=67,
        advertise_deadline=1.0,
        share_keys_deadline=2.0,
        masked_input_deadline=3.0,
        unmask_deadline=4.0,
        cohort_size=100,
    )
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"graph_t": 1}, "threshold"),
        ({"graph_k": 1, "graph_t": 1}, "threshold|k="),
        ({"graph_k": 28 + 1, "graph_t": 2}, "unsafe|adversary"),  # the cohort's safe t is 6 at gamma = 5%
        ({"cohort_size": 0}, "cohort size"),
        ({"graph_k": 101, "graph_t": 60}, "exceeds the stated cohort"),
        ({"dp_mu": 0.0, "dp_t_min": 0}, "no DP noise"),
        ({"dp_mu": 1e-300}, "noise multiplier"),
        ({"dp_t_min": 2**62}, "t_min"),
        ({"dp_t_min": 1}, "t_min"),
        ({"dp_mu": (0.3 * 287.6) ** 2}, "noise multiplier"),
        ({"dp_mu": (0.6 * 287.6) ** 2}, "per round"),
    ],
)
def test_invites_below_the_floor_are_refused_before_anything_is_generated(changes: dict[str, Any], why: str) -> None:
    from protocol.device_session import DeviceSecAggSession
    from protocol.errors import PrivacyFloorViolation
    from protocol.policy import PrivacyPolicy

    with pytest.raises(PrivacyFloorViolation, match=why):
        DeviceSecAggSession(_invite(**changes), policy=PrivacyPolicy())


def test_a_sound_invite_passes_and_the_device_keeps_its_own_ledger() -> None:
    from protocol.device_session import DeviceSecAggSession
    from protocol.errors import PrivacyFloorViolation
    from protocol.policy import DeviceLedger, PrivacyPolicy, check_invite

    policy = PrivacyPolicy()
    invite = _invite()
    session = DeviceSecAggSession(invite, policy=policy)
    assert 0.0 < session.round_epsilon <= policy.max_epsilon_per_round
    ledger = DeviceLedger()
    rounds = 0
    with pytest.raises(PrivacyFloorViolation, match="budget"):
        while True:
            check_invite(invite, policy, ledger)
            ledger.charge(invite)
            rounds += 1
    assert rounds >= 1 and ledger.epsilon(policy.delta) <= policy.max_epsilon_total
    assert DeviceLedger.from_dict(ledger.to_dict()).rounds == rounds
    # without DP the default floor refuses; a deployment that runs without DP must say so
    assert check_invite(_invite(dp_mu=0.0, dp_t_min=0), PrivacyPolicy(require_noise=False)) == 0.0


def test_the_device_ledger_agrees_with_the_servers_accountant() -> None:
    import numpy as np

    from protocol.accounting import composed_rdp, epsilon_from_rdp
    from protocol.rdp import rdp_to_epsilon

    for mu in (1e3, 1e5, 1e7):
        curve = composed_rdp([(mu, 3000.0, 300.0)] * 7)
        assert rdp_to_epsilon(curve, 1e-6) == pytest.approx(epsilon_from_rdp(curve, 1e-6), rel=1e-12)
    assert rdp_to_epsilon(np.zeros_like(curve), 1e-6) == 0.0


def test_an_overstated_survivor_count_is_refused() -> None:
    from protocol.errors import RemoteProtocolError
    from protocol.phases import check_survivor_quorum

    invite = _invite()
    check_survivor_quorum(20, 100, invite)
    for factor in (2, 10, 1000):  # issue 15: 2x, 10x, 1000x the real 70 survivors
        with pytest.raises(RemoteProtocolError, match="exceeds the invited cohort"):
            check_survivor_quorum(20, 70 * factor, invite)
