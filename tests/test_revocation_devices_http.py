"""Devices enforce the enrollment authority's revocation list themselves (protocol 1.5): the
server serves the signed list it enforces (``GET /v1/enrollment/revocations``, ETag), a device checks
it against its pinned authority, keeps the newest in its store, refuses rollbacks and forgeries, and
refuses a signed round whose ShareKeys broadcast names a revoked neighbour before it makes a share.  A
revoked device's bearer token is refused on every authenticated route.  Real aiohttp servers on
loopback, real `DeviceClient`s, real Ed25519.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agg_server.app import COORDINATOR, create_app
from device_sdk.client import RoundOutcome, RoundStatus
from device_sdk.persistence import REVOCATIONS_FILE, load_revocations
from protocol.codec import decode, encode
from protocol.enrollment import EnrollmentAuthority, write_revocation_list
from protocol.errors import CertificateRevoked, EnrollmentRefused, RevocationListInvalid, StorageError
from protocol.identity import (
    RevocationList,
    SigningKey,
    issue_revocation_list,
    registration_payload,
    verify_revocation_list,
)
from protocol.messages import (
    CheckIn,
    EncryptedShares,
    ErrorMessage,
    MaskedInput,
    RegisterRequest,
    RevocationListPayload,
    UnmaskResponse,
)
from protocol.noise import to_ring
from tests.multi_helpers import recording
from tests.test_certificates_http import _authority_with_a_list, _in_force, _until
from tests.test_enrollment_http import _clients, _config, _join, _post

ROUTE = "/v1/enrollment/revocations"
MSGPACK = {"Accept": "application/msgpack"}


async def _get(client: Any, path: str, **headers: str) -> tuple[int, Any, Any]:
    resp = await client.get(path, headers={**MSGPACK, **headers})
    body = await resp.read()
    return resp.status, (decode(body) if body else None), resp.headers


# -- the server ------------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_server_serves_the_list_it_enforces_with_an_etag(
    aiohttp_client: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ca = EnrollmentAuthority.generate()
    # Without a list: an empty payload and no ETag (the server enforces none).
    bare = await aiohttp_client(create_app(_config(tmp_path / "a", cohort=3, enrollment={})))
    status, msg, headers = await _get(bare, ROUTE)
    assert status == 200 and msg == RevocationListPayload() and "ETag" not in headers
    # With one: exactly the signed bytes of the file, under an ETag; If-None-Match gives 304.
    crl_path = tmp_path / "ca.crl"
    first = ca.revoke(None, [bytes([7]) * 32])
    write_revocation_list(crl_path, first)
    enrollment = {"authority_key": ca.public_key.hex(), "revocation_list": str(crl_path)}
    app = create_app(_config(tmp_path / "b", cohort=3, enrollment=enrollment))
    client = await aiohttp_client(app)
    status, msg, headers = await _get(client, ROUTE)
    assert status == 200 and isinstance(msg, RevocationListPayload) and msg.data == first
    etag = headers["ETag"]
    assert etag.startswith('"crl-1-')
    status, msg, headers = await _get(client, ROUTE, **{"If-None-Match": etag})
    assert status == 304 and msg is None and headers["ETag"] == etag
    # A new list on disk: a new body and ETag; the old ETag no longer matches.
    second = ca.revoke(first, [bytes([8]) * 32])
    write_revocation_list(crl_path, second)
    await _until(_in_force(app, 2), "list #2 in force")  # the server's refresher reads it
    status, msg, headers = await _get(client, ROUTE, **{"If-None-Match": etag})
    assert status == 200 and msg.data == second and headers["ETag"].startswith('"crl-2-')
    # A rollback on disk is refused by the server: it keeps serving (and enforcing) #2.
    with caplog.at_level(logging.ERROR, logger="agg_server.enrollment"):
        write_revocation_list(crl_path, first)
        await _until(lambda: "a rollback" in caplog.text, "the rollback refused")
    status, msg, _ = await _get(client, ROUTE)
    assert msg.data == second


@pytest.mark.asyncio
async def test_a_revoked_devices_bearer_token_is_refused_on_every_authenticated_route(
    aiohttp_client: Any, tmp_path: Path
) -> None:
    ca, crl_path, enrollment = _authority_with_a_list(tmp_path)
    app = create_app(_config(tmp_path / "srv", cohort=3, enrollment=enrollment))
    client = await aiohttp_client(app)
    key, other = SigningKey.generate(), SigningKey.generate()
    tokens = {}
    for k in (key, other):
        cert = ca.issue(k.public_key)
        register = RegisterRequest(platform="p", certificate=cert, proof=k.sign(registration_payload(cert)))
        status, msg, _ = await _post(client, "/v1/devices", register)
        assert status == 201
        tokens[k.public_key] = (msg.device_id, msg.token)
    device, token = tokens[key.public_key]
    auth = {"Authorization": f"Bearer {token}"}
    resp = await client.get("/v1/model", headers={**MSGPACK, **auth})
    assert resp.status == 200  # before revocation the token downloads the model
    write_revocation_list(crl_path, ca.revoke(crl_path.read_bytes(), [key.public_key]))
    await _until(_in_force(app, 2), "list #2 in force")
    calls = [
        ("GET", "/v1/model", None),
        ("POST", "/v1/checkin", CheckIn(device_id=device)),
        ("POST", "/v1/rounds/1/keys", CheckIn(device_id=device)),
        ("POST", "/v1/rounds/1/abort", CheckIn(device_id=device)),
    ]
    for method, path, message in calls:
        body = encode(message) if message is not None else None
        resp = await client.request(
            method, path, data=body, headers={**MSGPACK, **auth, "Content-Type": "application/msgpack"}
        )
        msg = decode(await resp.read())
        assert resp.status == 403 and isinstance(msg, ErrorMessage), (path, resp.status, msg)
        assert isinstance(msg.to_exception(), EnrollmentRefused), msg
        assert "revocation check" in msg.message and f"device {device}" in msg.message and "#2" in msg.message
    # Another device's token still works.
    _, other_token = tokens[other.public_key]
    resp = await client.get("/v1/model", headers={**MSGPACK, "Authorization": f"Bearer {other_token}"})
    assert resp.status == 200


# -- devices ---------------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_device_refuses_rolled_back_tampered_and_foreign_lists_and_keeps_the_newest(
    aiohttp_server: Any, tmp_path: Path
) -> None:
    ca = EnrollmentAuthority.generate()
    crl_path = tmp_path / "ca.crl"
    first = ca.revoke(None, [bytes([1]) * 32])
    second = ca.revoke(first, [bytes([2]) * 32])
    write_revocation_list(crl_path, second)
    enrollment = {"authority_key": ca.public_key.hex(), "revocation_list": str(crl_path)}
    app = create_app(_config(tmp_path / "srv", cohort=3, enrollment=enrollment))
    server = await aiohttp_server(app)
    (device,) = _clients(str(server.make_url("")).rstrip("/"), tmp_path / "dev", 1, ca.public_key)
    crl = await device.refresh_revocations()
    assert crl is not None and crl.number == 2 and device.revocation_list == crl
    stored = load_revocations(tmp_path / "dev" / "d0", ca.public_key)
    assert stored is not None and stored.data == second and stored.etag is not None
    # The server (lying, or a stale instance) now serves something else; the device refuses each.
    enrollment_state = app[COORDINATOR].enrollment
    flipped = bytearray(second)
    flipped[40] ^= 1
    served: dict[str, tuple[bytes, str]] = {
        "older than #2": (first, '"x1"'),
        "not signed by the enrollment authority": (bytes(flipped), '"x2"'),
        "differs from the list #2": (ca.revoke(first, [bytes([3]) * 32]), '"x3"'),
    }
    foreign = EnrollmentAuthority.generate()
    served["is refused: revocation list is not signed"] = (foreign.revoke(foreign.revoke(None, []), []), '"x4"')
    for why, answer in served.items():
        enrollment_state.signed_revocation_list = lambda answer=answer: answer  # type: ignore[method-assign,misc]
        with pytest.raises(RevocationListInvalid, match=why):
            await device.refresh_revocations()
        held = load_revocations(tmp_path / "dev" / "d0", ca.public_key)
        assert held is not None and held.data == second, why  # nothing stored was lost or replaced
    # A server that serves no list does not make the device forget the one it holds.
    enrollment_state.signed_revocation_list = lambda: (b"", "")  # type: ignore[method-assign]
    assert (await device.refresh_revocations()) == crl
    # The store survives a restart; a corrupted store is refused, never silently reset.
    (restarted,) = _clients(str(server.make_url("")).rstrip("/"), tmp_path / "dev", 1, ca.public_key)
    assert restarted.revocation_list == crl
    path = tmp_path / "dev" / "d0" / REVOCATIONS_FILE
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(StorageError):
        _clients(str(server.make_url("")).rstrip("/"), tmp_path / "dev", 1, ca.public_key)
    await device.close()
    await restarted.close()


@pytest.mark.asyncio
async def test_devices_refuse_a_revoked_neighbour_before_releasing_anything(
    aiohttp_server: Any, tmp_path: Path
) -> None:
    # A malicious server: it holds the authority's list #2 revoking X, but lets X in (does not enforce it),
    # draws X into the cohort and, once devices hold the list, serves an empty one.  Every device whose
    # broadcast carries X refuses the round with CertificateRevoked naming X, and uploads no share.
    ca, crl_path, enrollment = _authority_with_a_list(tmp_path)
    app = create_app(_config(tmp_path / "srv", cohort=5, enrollment=enrollment))
    server = await aiohttp_server(app)
    clients = _clients(str(server.make_url("")).rstrip("/"), tmp_path / "dev", 5, ca.public_key)
    for c in clients:
        await c.register(certificate=ca.issue(c.identity_public_key, "b"))
    x = clients[0]
    write_revocation_list(crl_path, ca.revoke(crl_path.read_bytes(), [x.identity_public_key]))
    await _until(_in_force(app, 2), "list #2 in force")
    coordinator = app[COORDINATOR]
    for c in clients[1:]:
        assert (await c.refresh_revocations()).number == 2  # type: ignore[union-attr]
    coordinator.enrollment.revoked_devices = lambda: frozenset()  # type: ignore[method-assign]
    coordinator.enrollment.signed_revocation_list = lambda: (b"", "")  # type: ignore[method-assign]
    released: list[tuple[int, str]] = []
    honest_submit = coordinator.submit

    def recording_submit(device: int, round_id: int, msg: Any, *args: Any, **kw: Any) -> Any:
        if isinstance(msg, EncryptedShares | MaskedInput | UnmaskResponse):
            released.append((device, type(msg).__name__))
        return honest_submit(device, round_id, msg, *args, **kw)

    coordinator.submit = recording_submit  # type: ignore[method-assign,assignment]
    results = await asyncio.gather(*(_join(c) for c in clients), return_exceptions=True)
    for c, r in zip(clients[1:], results[1:], strict=True):
        assert isinstance(r, CertificateRevoked), (c.device_id, r)
        assert f"neighbour device {x.device_id}" in str(r) and "revocation list #2" in str(r), r
    honest = {c.device_id for c in clients[1:]}
    assert not [d for d, _ in released if d in honest], released  # not one share, masked input or unmask reply
    assert not any(isinstance(r, RoundOutcome) and r.status is RoundStatus.COMMITTED for r in results), results
    for c in clients:
        await c.close()


@pytest.mark.asyncio
async def test_an_honest_round_under_a_non_empty_list_commits_bit_exact(aiohttp_server: Any, tmp_path: Path) -> None:
    ca, crl_path, enrollment = _authority_with_a_list(tmp_path)
    app = create_app(_config(tmp_path / "srv", cohort=4, enrollment=enrollment))
    server = await aiohttp_server(app)
    clients = _clients(str(server.make_url("")).rstrip("/"), tmp_path / "dev", 5, ca.public_key)
    for c in clients:
        await c.register(certificate=ca.issue(c.identity_public_key, "b"))
    gone = clients[4]
    # Revokes a registered device and a key never seen: the other four run a round under list #2.
    write_revocation_list(crl_path, ca.revoke(crl_path.read_bytes(), [gone.identity_public_key, bytes([9]) * 32]))
    await _until(_in_force(app, 2), "list #2 in force")
    with recording() as record:
        results = await asyncio.gather(*(_join(c) for c in clients[:4]))
    assert all(r.status is RoundStatus.COMMITTED for r in results), results
    assert all(c.revocation_list is not None and c.revocation_list.number == 2 for c in clients[:4])
    with pytest.raises(EnrollmentRefused, match="revocation check"):
        await gone.run_round()
    sums = app[COORDINATOR].storage.round_sums()
    assert len(sums) == 1
    ((rid, (_, digest)),) = sums.items()
    parts = [v for (r, _), v in record.items() if r == rid and "noise" in v]
    assert len(parts) == 4
    total = np.zeros_like(parts[0]["x"])
    for p in parts:
        total += p["x"] + to_ring(p["noise"])
    assert digest == hashlib.sha256(total.astype("<u4").tobytes()).digest()
    for c in clients:
        await c.close()


@pytest.mark.asyncio
async def test_an_operator_uploads_a_list_that_devices_fetch_and_a_restart_keeps(
    aiohttp_client: Any, aiohttp_server: Any, tmp_path: Path
) -> None:
    from tests.test_enrollment_http import ADMIN

    ca = EnrollmentAuthority.generate()
    enrollment = {"authority_key": ca.public_key.hex()}  # no file: the list comes through the admin route
    app = create_app(_config(tmp_path / "srv", cohort=3, enrollment=enrollment))
    client = await aiohttp_client(app)
    first = ca.revoke(None, [bytes([1]) * 32])
    second = ca.revoke(first, [bytes([2]) * 32])
    admin = {"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/octet-stream"}
    path = "/v1/admin/revocation-list"
    resp = await client.post(path, data=second, headers={"Content-Type": "application/octet-stream"})
    assert resp.status == 401  # the admin token is required
    resp = await client.post(path, data=second, headers=admin)
    assert resp.status == 201 and await resp.json() == {"number": 2, "revoked_keys": 2, "stored": True}
    resp = await client.post(path, data=second, headers=admin)
    assert resp.status == 200 and (await resp.json())["stored"] is False
    flipped = bytearray(second)
    flipped[50] ^= 1
    for body, why in ((first, "older than #2"), (bytes(flipped), "not signed"), (b"junk", "malformed")):
        resp = await client.post(path, data=body, headers=admin)
        msg = decode(await resp.read())
        assert resp.status == 400 and isinstance(msg, ErrorMessage) and msg.code == "revocation_list_invalid"
        assert why in msg.message, msg.message
    status, msg, _ = await _get(client, ROUTE)
    assert status == 200 and msg.data == second  # devices fetch it
    # A new server on the same database (no file configured) enforces and serves it from the start.
    await client.close()
    restarted = create_app(_config(tmp_path / "srv", cohort=3, enrollment=enrollment))
    server = await aiohttp_server(restarted)
    (device,) = _clients(str(server.make_url("")).rstrip("/"), tmp_path / "dev", 1, ca.public_key)
    crl = await device.refresh_revocations()
    assert crl is not None and crl.number == 2 and crl.device_keys == {bytes([1]) * 32, bytes([2]) * 32}
    await device.close()


# -- the session: survivor signatures of revoked members ---------------------------------------------------------


def test_a_revoked_members_survivor_signature_does_not_count() -> None:
    # Sparse graph (n = 12, k = 5): a device's broadcast names only its neighbours, but the consistency check
    # counts signatures of every survivor (7 needed: a strict majority of 12).  With the other seven members'
    # keys on its revocation list, device u has only its 5 neighbourhood signatures left and unmasks nothing.

    from protocol.device_session import DeviceSecAggSession
    from protocol.errors import RemoteProtocolError
    from protocol.messages import UnmaskRequest
    from tests.test_security import _enrolled, _signed_round, _to_unmask

    ids = list(range(100, 112))
    authority, enrolled = _enrolled(ids)  # one authority and one set of identities for both runs

    def run(revoked: RevocationList | None) -> tuple[DeviceSecAggSession, Any, set[int]]:
        """One round to the unmask request of device ids[0], which holds ``revoked`` from the start."""
        server, devices, inputs, _, _ = _signed_round(  # seed 0: the same graph every run
            n=12, t=3, k=5, length=8, revoked={ids[0]: revoked}, enrollment=(authority, enrolled)
        )
        _to_unmask(server, devices, inputs)
        request = server.outbox(ids[0])
        assert isinstance(request, UnmaskRequest) and len(request.signer_ids) == 12
        return devices[ids[0]], request, set(devices[ids[0]]._neighbours)

    # Without a list the device unmasks; with the seven members outside its neighbourhood revoked (keys the
    # ShareKeys check never sees) it holds 5 valid signatures of the 7 required and releases nothing.
    device, request, neighbours = run(None)
    device.receive(request)
    assert isinstance(device.send(), UnmaskResponse)
    outsiders = [enrolled[v][0].public_key for v in ids if v not in neighbours]
    assert len(neighbours) == 5 and len(outsiders) == 7
    revoked = verify_revocation_list(issue_revocation_list(authority, 1, 0, outsiders), authority.public_key)
    device, request, again = run(revoked)
    assert again == neighbours
    with pytest.raises(RemoteProtocolError, match="only 5 valid survivor signatures on the signed set, 7 required"):
        device.receive(request)
