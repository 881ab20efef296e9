"""Certificates that expire and can be revoked (docs/threat-model.md §3.11): certificate
format 2 carries a validity period the server checks at registration and devices check on every
neighbour's certificate in signed rounds; the enrollment authority's signed revocation list is enforced
at registration and in cohort draws.  Real aiohttp servers on loopback, real `DeviceClient`s, real
Ed25519.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest

from agg_server.app import COORDINATOR, create_app
from agg_server.enrollment import REFRESH_PERIOD
from device_sdk.client import RoundOutcome, RoundStatus
from protocol.enrollment import EnrollmentAuthority, read_revocation_list, write_revocation_list
from protocol.errors import (
    CertificateExpired,
    CertificateNotYetValid,
    CertificateRevoked,
    ConfigError,
    CryptoError,
    EnrollmentRefused,
    RevocationListInvalid,
)
from protocol.identity import (
    CERTIFICATE_BYTES,
    CERTIFICATE_CLOCK_SKEW,
    CERTIFICATE_V2_BYTES,
    SIGNATURE_BYTES,
    SigningKey,
    issue_certificate,
    issue_revocation_list,
    read_certificate,
    registration_payload,
    verify_certificate,
    verify_revocation_list,
)
from protocol.messages import ErrorMessage, RegisterRequest, RegisterResponse, ShareKeysBroadcast
from protocol.phases import Phase
from tests.test_enrollment_http import _clients, _config, _join, _post

DAY = 86400
SIG = SIGNATURE_BYTES


def _cert(ca: EnrollmentAuthority, key: bytes, start: float, end: float) -> bytes:
    """A certificate of ``ca`` for ``key`` valid over [start, end] (any period, also past or future)."""
    return issue_certificate(ca.key, key, not_before=int(start), not_after=int(end))


def _register(cert: bytes, key: SigningKey) -> RegisterRequest:
    return RegisterRequest(platform="p", certificate=cert, proof=key.sign(registration_payload(cert)))


def _authority_with_a_list(tmp_path: Path) -> tuple[EnrollmentAuthority, Path, dict[str, str]]:
    """An enrollment authority, its revocation list #1 (empty) in ``tmp_path / "ca.crl"``, and the server's
    ``enrollment`` config that pins the one and enforces the other."""
    ca = EnrollmentAuthority.generate()
    crl_path = tmp_path / "ca.crl"
    write_revocation_list(crl_path, ca.revoke(None, []))
    return ca, crl_path, {"authority_key": ca.public_key.hex(), "revocation_list": str(crl_path)}


async def _until(condition: Any, what: str, timeout: float = 5 * REFRESH_PERIOD) -> float:
    """Wait for the server's background revocation refresher (it runs every `REFRESH_PERIOD` s); the
    seconds it took."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, f"not within {timeout} s: {what}"
        await asyncio.sleep(0.02)
    return time.monotonic() - start


def _in_force(app: Any, number: int) -> Any:
    return lambda: app[COORDINATOR].enrollment.revocation_list.number == number


def _refused(status: int, msg: Any, what: str) -> None:
    assert status == 403 and isinstance(msg, ErrorMessage), (status, msg)
    assert isinstance(msg.to_exception(), EnrollmentRefused), msg
    assert what in msg.message, msg.message


# -- the formats -----------------------------------------------------------------------------------------------


def test_certificates_carry_a_validity_period_and_format_1_stays_readable() -> None:
    ca = EnrollmentAuthority.generate()
    key = SigningKey.generate().public_key
    now = time.time()
    cert = ca.issue(key, "b", valid_days=30)
    assert len(cert) == CERTIFICATE_V2_BYTES and cert.startswith(b"FRC2")
    parsed = read_certificate(cert, ca.public_key)
    assert parsed.subject == key and parsed.not_after is not None and parsed.not_before is not None
    assert abs(parsed.not_before - now) < 5 and parsed.not_after - parsed.not_before == 30 * DAY
    # the clock check, with the allowed skew on both ends
    skew = CERTIFICATE_CLOCK_SKEW
    assert verify_certificate(cert, ca.public_key, now=parsed.not_before - skew + 1) == key
    with pytest.raises(CertificateNotYetValid, match="not yet valid"):
        verify_certificate(cert, ca.public_key, now=parsed.not_before - skew - 1)
    assert verify_certificate(cert, ca.public_key, now=parsed.not_after + skew - 1) == key
    with pytest.raises(CertificateExpired, match="expired"):
        verify_certificate(cert, ca.public_key, now=parsed.not_after + skew + 1)
    with pytest.raises(CertificateRevoked, match="revoked"):
        verify_certificate(cert, ca.public_key, revoked=frozenset({key}))
    # a forged period is a forgery, not an expiry: the signature is checked first
    tampered = bytearray(cert)
    tampered[-SIG - 1] ^= 1
    with pytest.raises(CryptoError, match="not signed by the pinned authority"):
        verify_certificate(bytes(tampered), ca.public_key)
    # protocol-1.4 (format 1) certificates still verify: no period, only revocation ends them
    old = issue_certificate(ca.key, key)
    assert len(old) == CERTIFICATE_BYTES
    assert read_certificate(old, ca.public_key, now=1e12).not_after is None
    with pytest.raises(CertificateRevoked):
        verify_certificate(old, ca.public_key, revoked=frozenset({key}))
    for bad in (0, -1, 4000, float("nan"), True):
        with pytest.raises(ConfigError, match="valid_days"):
            ca.issue(key, valid_days=bad)
    with pytest.raises(CryptoError, match="not_after"):
        issue_certificate(ca.key, key, not_before=10, not_after=10)


def test_revocation_lists_are_signed_numbered_and_cumulative(tmp_path: Path) -> None:
    ca = EnrollmentAuthority.generate()
    a, b = bytes([1]) * 32, bytes([2]) * 32
    first = ca.revoke(None, [a])
    second = ca.revoke(first, [b])
    crl = verify_revocation_list(second, ca.public_key)
    assert crl.number == 2 and crl.device_keys == {a, b}
    path = tmp_path / "ca.crl"
    write_revocation_list(path, second)
    assert read_revocation_list(path, ca.public_key) == crl
    # tampered: a flipped bit, a key dropped, a foreign authority, truncation, another file
    flipped = bytearray(second)
    flipped[30] ^= 1
    dropped = second[: 24 - 4] + (1).to_bytes(4, "big") + second[24 : 24 + 32] + second[-SIG:]
    cases = {
        bytes(flipped): "not signed by the enrollment authority",
        dropped: "not signed by the enrollment authority",
        EnrollmentAuthority.generate().revoke(None, [a]): "not signed by the enrollment authority",
        second[:-1]: "malformed revocation list",
        b"FRC2" + bytes(200): "malformed revocation list",
    }
    for data, why in cases.items():
        with pytest.raises(RevocationListInvalid, match=why):
            verify_revocation_list(data, ca.public_key)
    with pytest.raises(RevocationListInvalid, match="not signed"):
        ca.revoke(bytes(flipped), [b])  # the authority never builds on a list it did not sign


# -- the server: registration ----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_registration_refuses_expired_not_yet_valid_and_revoked_certificates(
    aiohttp_client: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ca = EnrollmentAuthority.generate()
    keys = [SigningKey.generate() for _ in range(6)]
    crl_path = tmp_path / "ca.crl"
    write_revocation_list(crl_path, ca.revoke(None, [keys[2].public_key]))
    cfg = _config(
        tmp_path, cohort=3, enrollment={"authority_key": ca.public_key.hex(), "revocation_list": str(crl_path)}
    )
    app = create_app(cfg)
    client = await aiohttp_client(app)
    now = time.time()
    expired = _cert(ca, keys[0].public_key, now - 10 * DAY, now - DAY)
    status, msg, _ = await _post(client, "/v1/devices", _register(expired, keys[0]))
    _refused(status, msg, "certificate refused: enrollment certificate expired")
    future = _cert(ca, keys[1].public_key, now + DAY, now + 10 * DAY)
    status, msg, _ = await _post(client, "/v1/devices", _register(future, keys[1]))
    _refused(status, msg, "certificate refused: enrollment certificate not yet valid")
    revoked = ca.issue(keys[2].public_key)
    status, msg, _ = await _post(client, "/v1/devices", _register(revoked, keys[2]))
    _refused(status, msg, "revocation list #1 names device key")
    status, msg, _ = await _post(client, "/v1/devices", _register(ca.issue(keys[3].public_key), keys[3]))
    assert status == 201 and isinstance(msg, RegisterResponse)
    # the operator revokes keys[4]: the server's refresher re-reads the changed file within its period
    write_revocation_list(crl_path, ca.revoke(crl_path.read_bytes(), [keys[4].public_key]))
    await _until(_in_force(app, 2), "list #2 in force")
    status, msg, _ = await _post(client, "/v1/devices", _register(ca.issue(keys[4].public_key), keys[4]))
    _refused(status, msg, "revocation list #2 names device key")
    # a tampered replacement (keys[2] taken off the list) is refused by name and list #2 stays in force
    good = crl_path.read_bytes()
    tampered = issue_revocation_list(EnrollmentAuthority.generate().key, 3, int(now), [keys[4].public_key])
    with caplog.at_level(logging.ERROR, logger="agg_server.enrollment"):
        write_revocation_list(crl_path, tampered)
        await _until(lambda: "revocation list refused" in caplog.text, "the tampered list refused")
        status, msg, _ = await _post(client, "/v1/devices", _register(revoked, keys[2]))
    _refused(status, msg, "revocation list #2 names device key")
    assert "revocation list refused" in caplog.text and "not signed by the enrollment authority" in caplog.text
    # and so is a rollback to list #1 (which did not name keys[4])
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="agg_server.enrollment"):
        write_revocation_list(crl_path, ca.revoke(None, [keys[2].public_key]))
        os.utime(crl_path, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
        await _until(lambda: "revocation list refused" in caplog.text, "the rollback refused")
        status, msg, _ = await _post(client, "/v1/devices", _register(ca.issue(keys[4].public_key), keys[4]))
    _refused(status, msg, "revocation list #2 names device key")
    assert "older than #2 in force (a rollback)" in caplog.text
    assert app[COORDINATOR].enrollment.revocation_list.number == 2
    write_revocation_list(crl_path, good)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="agg_server.enrollment"):
        await _until(lambda: "revocation list #2 (file) in force" in caplog.text, "list #2 read again")
    status, msg, _ = await _post(client, "/v1/devices", _register(ca.issue(keys[5].public_key), keys[5]))
    assert status == 201
    assert app[COORDINATOR].storage.device_count() == 2


@pytest.mark.asyncio
async def test_a_server_will_not_start_on_a_tampered_missing_or_foreign_revocation_list(
    aiohttp_server: Any, tmp_path: Path
) -> None:
    ca = EnrollmentAuthority.generate()
    path = tmp_path / "ca.crl"

    async def start() -> Any:
        enrollment = {"authority_key": ca.public_key.hex(), "revocation_list": str(path)}
        app = create_app(_config(tmp_path / "srv", cohort=3, enrollment=enrollment))
        await aiohttp_server(app)
        return app

    with pytest.raises(RevocationListInvalid, match="cannot read the revocation list"):
        await start()
    data = bytearray(ca.revoke(None, [bytes(32)]))
    data[-1] ^= 0x40
    write_revocation_list(path, bytes(data))
    with pytest.raises(RevocationListInvalid, match="not signed by the enrollment authority"):
        await start()
    write_revocation_list(path, EnrollmentAuthority.generate().revoke(None, []))
    with pytest.raises(RevocationListInvalid, match="not signed by the enrollment authority"):
        await start()
    write_revocation_list(path, ca.revoke(None, []))
    assert (await start())[COORDINATOR].enrollment.revocation_list.number == 1
    with pytest.raises(ConfigError, match="needs enrollment.authority_key"):
        _config(tmp_path, cohort=3, enrollment={"revocation_list": str(path)})


# -- the server: cohort draws ----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_device_revoked_after_registering_is_never_drawn_again(aiohttp_server: Any, tmp_path: Path) -> None:
    ca, crl_path, enrollment = _authority_with_a_list(tmp_path)
    app = create_app(_config(tmp_path / "srv", cohort=4, enrollment=enrollment, min_cohort=3))
    server = await aiohttp_server(app)
    clients = _clients(str(server.make_url("")).rstrip("/"), tmp_path / "dev", 4, ca.public_key)
    for c in clients:
        await c.register(certificate=ca.issue(c.identity_public_key, "b"))
    gone = clients[3]
    write_revocation_list(crl_path, ca.revoke(crl_path.read_bytes(), [gone.identity_public_key]))
    await _until(_in_force(app, 2), "list #2 in force")

    async def revoked_device() -> list[str]:
        refusals = []
        for _ in range(20):  # it keeps trying while the others run their round
            with pytest.raises(EnrollmentRefused) as refused:
                await gone.run_round()
            refusals.append(str(refused.value))
            await asyncio.sleep(0.05)
        return refusals

    results = await asyncio.gather(*(_join(c) for c in clients[:3]), revoked_device())
    assert all(isinstance(r, RoundOutcome) and r.status is RoundStatus.COMMITTED for r in results[:3]), results
    assert all("revocation list #2" in why for why in results[3]), results[3]  # refused at every check-in
    coordinator = app[COORDINATOR]
    assert gone.device_id in coordinator.enrollment.revoked_devices()
    (last,) = coordinator.status(0.0)["recent_rounds"][:1]
    assert last["status"] == "committed"
    for c in clients:
        await c.close()


@pytest.mark.asyncio
async def test_a_device_revoked_while_waiting_in_the_pool_is_not_drawn(aiohttp_client: Any, tmp_path: Path) -> None:
    ca, crl_path, enrollment = _authority_with_a_list(tmp_path)
    # a cohort of 5: the four in the pool wait for a full one (the ticker opens nothing at the frozen clock)
    app = create_app(_config(tmp_path / "srv", cohort=5, enrollment=enrollment, min_cohort=3), clock=lambda: 1000.0)
    client = await aiohttp_client(app)
    keys = [SigningKey.generate() for _ in range(4)]
    ids = []
    for key in keys:
        status, msg, _ = await _post(client, "/v1/devices", _register(ca.issue(key.public_key), key))
        assert status == 201
        ids.append(msg.device_id)
    coord = app[COORDINATOR]
    for d in ids:
        coord.check_in(d, 1000.0)  # all four wait in the pool
    write_revocation_list(crl_path, ca.revoke(crl_path.read_bytes(), [keys[0].public_key]))
    await _until(_in_force(app, 2), "list #2 in force")
    coord.tick(1001.5)  # past the pool's short wait for a full cohort, before it forgets quiet devices
    r = coord.open_round
    assert r is not None and set(r.cohort) == set(ids[1:]), r.cohort


# -- devices: a neighbour's certificate in a signed round ----------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("period", ["expired", "not yet valid"])
async def test_devices_refuse_a_neighbours_certificate_outside_its_validity_period(
    aiohttp_server: Any, tmp_path: Path, period: str
) -> None:
    # A server that does not check (or lies) forwards X's certificate of another period: it is a genuine
    # certificate of the authority for X's key, and X's signature on its keys verifies under it, but it
    # is outside its validity period; every neighbour that receives it refuses the round with the typed
    # error naming the check.
    ca = EnrollmentAuthority.generate()
    app = create_app(_config(tmp_path / "srv", cohort=5, enrollment={"authority_key": ca.public_key.hex()}))
    server = await aiohttp_server(app)
    coordinator = app[COORDINATOR]
    honest_reply = coordinator.reply
    lied_to: set[int] = set()
    now = time.time()
    window = (now - 10 * DAY, now - DAY) if period == "expired" else (now + DAY, now + 10 * DAY)

    def lying(device_id: int, round_id: int, after: Phase, **kw: Any) -> Any:
        out = honest_reply(device_id, round_id, after, **kw)
        if isinstance(out, ShareKeysBroadcast) and device_id != x and x in out.neighbour_ids:
            i = list(out.neighbour_ids).index(x)
            certs = list(out.certificates)
            certs[i] = _cert(ca, clients[0].identity_public_key, *window)
            lied_to.add(device_id)
            return dataclasses.replace(out, certificates=tuple(certs))
        return out

    coordinator.reply = lying  # type: ignore[method-assign]
    clients = _clients(str(server.make_url("")).rstrip("/"), tmp_path / "dev", 5, ca.public_key)
    for c in clients:
        await c.register(certificate=ca.issue(c.identity_public_key, "b"))
    x = clients[0].device_id
    results = await asyncio.gather(*(_join(c) for c in clients), return_exceptions=True)
    refused = [r for c, r in zip(clients, results, strict=True) if c.device_id in lied_to]
    error = CertificateExpired if period == "expired" else CertificateNotYetValid
    assert lied_to and all(isinstance(r, error) and period in str(r) for r in refused), results
    assert not any(isinstance(r, RoundOutcome) and r.status is RoundStatus.COMMITTED for r in results)
    for c in clients:
        await c.close()


def test_the_cli_issues_certificates_with_a_period_and_revokes_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fedsim.cli import main as cli_main

    key_file, crl = tmp_path / "ca.key", tmp_path / "ca.crl"
    assert cli_main(["enroll-ca", "init", "--key", str(key_file)]) == 0
    ca = EnrollmentAuthority.load(key_file)
    device = SigningKey.generate().public_key
    capsys.readouterr()
    args = ["enroll-ca", "issue", "--key", str(key_file), "--device-key", device.hex(), "--valid-days", "2"]
    assert cli_main(args) == 0
    parsed = read_certificate(bytes.fromhex(capsys.readouterr().out.strip()), ca.public_key)
    assert parsed.not_before is not None and parsed.not_after is not None
    assert parsed.not_after - parsed.not_before == 2 * DAY
    assert cli_main([*args[:-1], "0"]) == 2 and "--valid-days must be" in capsys.readouterr().err
    args = ["enroll-ca", "revoke", "--key", str(key_file), "--crl", str(crl), "--device-key", device.hex()]
    assert cli_main(args) == 0 and "revocation list #1" in capsys.readouterr().out
    other = SigningKey.generate().public_key
    expired = _cert(ca, other, 0, 10)  # an expired certificate can still be revoked
    args = ["enroll-ca", "revoke", "--key", str(key_file), "--crl", str(crl), "--certificate", expired.hex()]
    assert cli_main(args) == 0 and "revocation list #2" in capsys.readouterr().out
    assert read_revocation_list(crl, ca.public_key).device_keys == {device, other}
    crl.write_bytes(crl.read_bytes()[:-1] + bytes([crl.read_bytes()[-1] ^ 1]))
    assert cli_main(args) == 2 and "not signed by the enrollment authority" in capsys.readouterr().err


@pytest.mark.parametrize("period", ["expired", "not yet valid"])
def test_the_server_excludes_a_key_advertisement_under_a_certificate_outside_its_period(period: str) -> None:
    # The server checks the period at `keys` too (a device registered before its certificate expired):
    # the advertisement is refused with the typed error, and the round goes on without the device.
    import numpy as np

    from protocol.messages import PublicKeys
    from tests.test_security import _drive, _signed_round

    server, devices, inputs, authority, enrolled = _signed_round(n=8, t=3)
    bad = 100
    honest = devices[bad].send()
    now = time.time()
    window = (now - 10 * DAY, now - DAY) if period == "expired" else (now + DAY, now + 10 * DAY)
    stale = issue_certificate(
        authority, enrolled[bad][0].public_key, not_before=int(window[0]), not_after=int(window[1])
    )
    assert isinstance(honest, PublicKeys)
    error = CertificateExpired if period == "expired" else CertificateNotYetValid
    with pytest.raises(error, match=period):
        server.receive(bad, dataclasses.replace(honest, certificate=stale))
    del devices[bad]
    masked = _drive(server, devices, inputs, {})
    assert bad not in masked and server.result().survivors == frozenset(masked)
    expected = np.zeros(16, dtype=np.uint32)
    for u in masked:
        expected += inputs[u]
    assert np.array_equal(server.result().total, expected)


@pytest.mark.asyncio
async def test_the_device_sdk_refuses_its_own_certificate_outside_its_period(
    aiohttp_client: Any, tmp_path: Path
) -> None:
    ca = EnrollmentAuthority.generate()
    app = create_app(_config(tmp_path / "srv", cohort=3, enrollment={"authority_key": ca.public_key.hex()}))
    client = await aiohttp_client(app)
    (sdk,) = _clients(str(client.make_url("")).rstrip("/"), tmp_path / "dev", 1, ca.public_key)
    now = time.time()
    with pytest.raises(CertificateExpired, match="expired"):
        await sdk.register(certificate=_cert(ca, sdk.identity_public_key, now - 10 * DAY, now - DAY))
    with pytest.raises(CertificateNotYetValid, match="not yet valid"):
        await sdk.register(certificate=_cert(ca, sdk.identity_public_key, now + DAY, now + 10 * DAY))
    assert app[COORDINATOR].storage.device_count() == 0  # nothing was sent
    assert await sdk.register(certificate=ca.issue(sdk.identity_public_key, valid_days=1)) == 1
    await sdk.close()
