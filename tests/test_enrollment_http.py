"""docs/threat-model.md §3.7 and §3.10 over HTTP: certified identities, signed key advertisements and the consistency
check between real `DeviceClient`s and a real aiohttp `fedrec` server on loopback; enrollment credentials,
the per-source registration rate and the per-source cohort share.

The lying servers are the real coordinator with its `reply`/`submit` wrapped: they forward what the
honest code computes except for the lie under test.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agg_server.app import COORDINATOR, create_app
from agg_server.config import config_from_dict
from agg_server.enrollment import capped_cohort
from device_sdk.client import ClientConfig, DeviceClient, RoundOutcome, RoundStatus
from fedsim.fleets.faults import DropoutAt
from fedsim.fleets.local import FleetConfig, run_fleet
from protocol import crypto
from protocol.codec import decode, encode
from protocol.enrollment import EnrollmentAuthority, batch_id
from protocol.errors import ConfigError, CryptoError, EnrollmentRefused, RateLimited, RemoteProtocolError
from protocol.identity import SigningKey, registration_payload
from protocol.messages import (
    ConsistencyRequest,
    ConsistencySignature,
    ErrorMessage,
    RegisterRequest,
    RegisterResponse,
    ShareKeysBroadcast,
    UnmaskRequest,
)
from protocol.phases import Phase
from protocol.policy import PrivacyPolicy
from tests.server_helpers import BITS, N_ITEMS, users

MSGPACK = {"Content-Type": "application/msgpack"}
ADMIN = "admin-token-for-tests-0123456789"


def _config(data_dir: Path, *, cohort: int, enrollment: dict[str, Any], timeout: float = 20.0, **rounds: Any) -> Any:
    import hashlib

    base = {
        "cohort_size": cohort,
        "min_cohort": cohort,
        "seed": 5,
        "clip_norm": 64.0,
        "scale_bits": 12,
        "advertise_timeout": timeout,
        "share_keys_timeout": timeout,
        "masked_input_timeout": timeout,
        "unmask_timeout": timeout,
        "round_interval": 0.05,
    }
    base.update(rounds)
    return config_from_dict(
        {
            "server": {
                "data_dir": str(data_dir),
                "port": 0,
                "admin_token_sha256": hashlib.sha256(ADMIN.encode()).hexdigest(),
            },
            "model": {"n_items": N_ITEMS, "bits": BITS},
            "rounds": base,
            "enrollment": enrollment,
        },
        base_dir=data_dir,
    )


async def _post(client: Any, path: str, message: Any) -> tuple[int, Any, Any]:
    resp = await client.post(path, data=encode(message), headers=MSGPACK)
    return resp.status, decode(await resp.read()), resp.headers


def _clients(
    url: str, root: Path, n: int, authority: bytes | None, floor: PrivacyPolicy | None = None
) -> list[DeviceClient]:
    """``n`` devices pinning ``authority`` with the privacy ``floor`` (None: none, `PrivacyPolicy.no_floor`)."""
    data = users(n)
    policy = PrivacyPolicy.no_floor() if floor is None else floor
    return [
        DeviceClient.connect(
            url,
            ClientConfig(store_dir=root / f"d{u}", privacy=policy, authority_key=authority),
            items=data[u][0],
            ratings=data[u][1],
            n_items=N_ITEMS,
            bits=BITS,
            retries=0,
        )
        for u in range(n)
    ]


async def _join(client: DeviceClient) -> RoundOutcome:
    """Check in until invited, then run the round (exceptions propagate)."""
    while True:
        outcome = await client.run_round()
        if outcome.status is not RoundStatus.WAITED:
            return outcome
        await asyncio.sleep(0.05)


# -- registration needs a credential (§3.10) -------------------------------------------------------------


@pytest.mark.asyncio
async def test_certificate_registration_refuses_missing_forged_reused_and_unproven_credentials(
    aiohttp_client: Any, tmp_path: Path
) -> None:
    ca = EnrollmentAuthority.generate()
    app = create_app(_config(tmp_path, cohort=3, enrollment={"authority_key": ca.public_key.hex()}))
    client = await aiohttp_client(app)
    device = SigningKey.generate()
    cert = ca.issue(device.public_key, "batch-a")
    proof = device.sign(registration_payload(cert))

    def refused(status: int, msg: Any, what: str) -> None:
        assert status == 403 and isinstance(msg, ErrorMessage), (status, msg)
        assert isinstance(msg.to_exception(), EnrollmentRefused) and msg.code == "enrollment_refused"
        assert what in msg.message, msg.message

    status, msg, _ = await _post(client, "/v1/devices", RegisterRequest(platform="p"))
    refused(status, msg, "requires an enrollment credential")
    rogue = EnrollmentAuthority.generate()  # a server-made (or attacker-made) authority
    forged = rogue.issue(device.public_key, "batch-a")
    status, msg, _ = await _post(
        client,
        "/v1/devices",
        RegisterRequest(certificate=forged, proof=device.sign(registration_payload(forged))),
    )
    refused(status, msg, "not signed by the pinned authority")
    thief = SigningKey.generate()  # someone who saw the certificate in a key broadcast
    status, msg, _ = await _post(
        client, "/v1/devices", RegisterRequest(certificate=cert, proof=thief.sign(registration_payload(cert)))
    )
    refused(status, msg, "certificate refused")
    status, msg, _ = await _post(client, "/v1/devices", RegisterRequest(enrollment_token="x" * 43))
    refused(status, msg, "enrolls devices by certificate")
    status, msg, _ = await _post(client, "/v1/devices", RegisterRequest(certificate=cert, proof=proof))
    assert status == 201 and isinstance(msg, RegisterResponse)
    status, msg, _ = await _post(client, "/v1/devices", RegisterRequest(certificate=cert, proof=proof))
    refused(status, msg, "already registered")
    assert app[COORDINATOR].storage.device_count() == 1
    # the device SDK checks its certificate before sending it, and surfaces the server's typed refusal
    sdk = _clients(str(client.make_url("")).rstrip("/"), tmp_path / "sdk", 2, ca.public_key)
    with pytest.raises(ConfigError, match="does not certify this device"):
        await sdk[0].register(certificate=cert)
    with pytest.raises(ConfigError, match="register it with a certificate"):
        await sdk[0].register()
    with pytest.raises(CryptoError, match="pinned authority"):
        await sdk[0].register(certificate=rogue.issue(sdk[0].identity_public_key))
    assert await sdk[1].register(certificate=ca.issue(sdk[1].identity_public_key, "batch-b")) == 2
    for c in sdk:
        await c.close()


@pytest.mark.asyncio
async def test_one_time_tokens_are_issued_by_the_admin_route_and_used_once(aiohttp_client: Any, tmp_path: Path) -> None:
    app = create_app(_config(tmp_path, cohort=3, enrollment={"open_registration": False}))
    client = await aiohttp_client(app)
    resp = await client.post("/v1/admin/enrollment-tokens", json={"count": 3, "source": "lab"})
    assert resp.status == 401  # the admin token is needed
    resp = await client.post(
        "/v1/admin/enrollment-tokens",
        json={"count": 3, "source": "lab"},
        headers={"Authorization": f"Bearer {ADMIN}"},
    )
    assert resp.status == 201
    doc = await resp.json()
    assert doc["source"] == "token:lab" and len(set(doc["tokens"])) == 3
    bad = await client.post(
        "/v1/admin/enrollment-tokens", json={"count": 0, "source": "lab"}, headers={"Authorization": f"Bearer {ADMIN}"}
    )
    assert bad.status == 400
    storage = app[COORDINATOR].storage
    import hashlib

    assert storage.enrollment_token_source(hashlib.sha256(doc["tokens"][0].encode()).digest()) == ("token:lab", False)
    status, msg, _ = await _post(client, "/v1/devices", RegisterRequest(platform="p"))
    assert status == 403 and isinstance(msg.to_exception(), EnrollmentRefused)
    status, msg, _ = await _post(client, "/v1/devices", RegisterRequest(enrollment_token=doc["tokens"][0]))
    assert status == 201 and isinstance(msg, RegisterResponse)
    status, msg, _ = await _post(client, "/v1/devices", RegisterRequest(enrollment_token=doc["tokens"][0]))
    assert status == 403 and "used before" in msg.message
    status, msg, _ = await _post(client, "/v1/devices", RegisterRequest(enrollment_token="y" * 43))
    assert status == 403 and "unknown enrollment token" in msg.message
    ca = EnrollmentAuthority.generate()
    key = SigningKey.generate()
    cert = ca.issue(key.public_key)
    status, msg, _ = await _post(
        client, "/v1/devices", RegisterRequest(certificate=cert, proof=key.sign(registration_payload(cert)))
    )
    assert status == 403 and "no enrollment authority" in msg.message
    sdk = _clients(str(client.make_url("")).rstrip("/"), tmp_path / "sdk", 1, None)
    with pytest.raises(EnrollmentRefused, match="used before"):
        await sdk[0].register(enrollment_token=doc["tokens"][0])
    assert sdk[0].device_id is None
    assert await sdk[0].register(enrollment_token=doc["tokens"][1]) == 2
    await sdk[0].close()
    assert storage.device_sources([1, 2]) == {1: "token:lab", 2: "token:lab"}


@pytest.mark.asyncio
async def test_registrations_are_rate_limited_per_credential_source(aiohttp_client: Any, tmp_path: Path) -> None:
    now = [1000.0]
    cfg = _config(
        tmp_path,
        cohort=3,
        enrollment={"open_registration": False, "registrations_per_second": 2, "registration_burst": 3},
    )
    app = create_app(cfg, clock=lambda: now[0])
    client = await aiohttp_client(app)
    tokens = app[COORDINATOR].enrollment.issue_tokens(5, "a", now[0]) + app[COORDINATOR].enrollment.issue_tokens(
        1, "b", now[0]
    )
    for token in tokens[:3]:  # the burst
        status, _, _ = await _post(client, "/v1/devices", RegisterRequest(enrollment_token=token))
        assert status == 201
    status, msg, headers = await _post(client, "/v1/devices", RegisterRequest(enrollment_token=tokens[3]))
    assert status == 429 and isinstance(msg.to_exception(), RateLimited) and "token:a" in msg.message
    assert headers["Retry-After"] == "1"
    status, _, _ = await _post(client, "/v1/devices", RegisterRequest(enrollment_token=tokens[5]))
    assert status == 201  # another source is not held up
    now[0] += 0.5  # one more registration of source a is due after 1 / (2 per second)
    status, _, _ = await _post(client, "/v1/devices", RegisterRequest(enrollment_token=tokens[3]))
    assert status == 201  # the refused token was not consumed
    status, _, _ = await _post(client, "/v1/devices", RegisterRequest(enrollment_token=tokens[4]))
    assert status == 429


def test_config_validates_the_enrollment_section(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="enrollment.max_source_share"):
        _config(tmp_path, cohort=3, enrollment={"max_source_share": 0})
    with pytest.raises(ConfigError, match="enrollment.max_source_share"):
        _config(tmp_path, cohort=3, enrollment={"max_source_share": 1.5})
    with pytest.raises(ConfigError, match="enrollment.authority_key"):
        _config(tmp_path, cohort=3, enrollment={"authority_key": "00"})
    with pytest.raises(ConfigError, match="enrollment.open_registration"):
        _config(tmp_path, cohort=3, enrollment={"authority_key": "ab" * 32, "open_registration": True})
    with pytest.raises(ConfigError, match="enrollment.registration_burst"):
        _config(tmp_path, cohort=3, enrollment={"registration_burst": 0})
    with pytest.raises(ConfigError, match="enrollment.registrations_pr_second: unknown key"):
        _config(tmp_path, cohort=3, enrollment={"registrations_pr_second": 1})
    # open registration is the loopback default only
    assert _config(tmp_path, cohort=3, enrollment={}).enrollment.registration_is_open("127.0.0.1")
    assert not _config(tmp_path, cohort=3, enrollment={}).enrollment.registration_is_open("0.0.0.0")
    assert not _config(tmp_path, cohort=3, enrollment={"authority_key": "ab" * 32}).enrollment.registration_is_open(
        "127.0.0.1"
    )


# -- the per-source cohort share (§3.10) ------------------------------------------------------------------


def test_capped_cohort_never_exceeds_the_share() -> None:
    rng = np.random.default_rng(0)
    for trial in range(200):
        n_pool = int(rng.integers(3, 60))
        n_sources = int(rng.integers(1, 8))
        sources = {d: f"s{int(rng.integers(0, n_sources))}" for d in range(n_pool)}
        share = float(rng.choice([0.1, 0.25, 0.34, 0.5, 0.9]))
        want = int(rng.integers(1, n_pool + 1))
        cohort = capped_cohort(list(range(n_pool)), want, sources, share, rng)
        assert len(cohort) <= want and len(set(cohort)) == len(cohort)
        if cohort:
            counts = np.unique([sources[d] for d in cohort], return_counts=True)[1]
            assert counts.max() <= share * len(cohort) + 1e-9, (trial, cohort)
    # A Sybil attack: 120 Sybils of one credential source beside 4 honest devices of their own sources
    sources = {d: "token:sybil" for d in range(120)} | {120 + i: f"cert:{i}" for i in range(4)}
    for _ in range(6):
        cohort = capped_cohort(list(sources), 50, sources, 0.25, rng)
        sybils = sum(sources[d] == "token:sybil" for d in cohort)
        assert set(range(120, 124)) <= set(cohort) and sybils <= 0.25 * len(cohort)


@pytest.mark.asyncio
async def test_the_sampler_caps_each_credential_source_share_of_a_round(aiohttp_client: Any, tmp_path: Path) -> None:
    cfg = _config(tmp_path, cohort=8, enrollment={"open_registration": False, "max_source_share": 0.5}, min_cohort=3)
    app = create_app(cfg, clock=lambda: 1000.0)
    client = await aiohttp_client(app)
    coord = app[COORDINATOR]
    tokens = coord.enrollment.issue_tokens(6, "many", 0.0) + coord.enrollment.issue_tokens(2, "few", 0.0)
    ids = []
    for token in tokens:
        status, msg, _ = await _post(client, "/v1/devices", RegisterRequest(enrollment_token=token))
        assert status == 201
        ids.append(msg.device_id)
    for d in ids:
        coord.check_in(d, 1000.0)
    coord.tick(1001.0)
    r = coord.open_round
    assert r is not None
    sources = coord.enrollment.sources(list(r.cohort))
    counts = {s: sum(1 for d in r.cohort if sources[d] == s) for s in set(sources.values())}
    assert counts == {"token:many": 2, "token:few": 2}  # 8 waiting, but "many" may fill at most half


# -- signed rounds over HTTP (§3.7) ------------------------------------------------------------------------


def _fleet(url: str, root: Path, **kw: Any) -> FleetConfig:
    return FleetConfig(
        url=url,
        store_root=root,
        n_items=N_ITEMS,
        bits=BITS,
        rounds=2,
        seed=11,
        insecure_reproducible=True,  # the test hook: both runs must draw the same training and noise
        announce_drops=True,
        time_limit=240.0,
        **kw,
    )


def _drops(signed: bool) -> Any:
    # drops at every phase in each round; in the signed run one device drops before signing the survivor
    # set, in the unsigned run the same device drops at the same point (before unmask): both keep its
    # masked input in the sum
    def schedule(round_id: int, device_id: int) -> DropoutAt:
        plan = {
            2: DropoutAt.BEFORE_KEYS,
            5: DropoutAt.BEFORE_SHARES,
            7: DropoutAt.BEFORE_MASKED,
            9: DropoutAt.BEFORE_CONSISTENCY if signed else DropoutAt.BEFORE_UNMASK,
            11: DropoutAt.BEFORE_UNMASK,
        }
        return plan.get((device_id + 3 * round_id) % 14, DropoutAt.NONE)

    return schedule


@pytest.mark.asyncio
async def test_signed_http_rounds_with_dropouts_at_every_phase_are_bit_exact(
    aiohttp_server: Any, tmp_path: Path
) -> None:
    data = list(users(14, seed=3).values())
    ca = EnrollmentAuthority.generate()
    ca_file = tmp_path / "ca.key"
    ca.save(ca_file)
    signed_app = create_app(_config(tmp_path / "signed", cohort=14, enrollment={"authority_key": ca.public_key.hex()}))
    server = await aiohttp_server(signed_app)
    seen: list[Any] = []
    coordinator = signed_app[COORDINATOR]
    honest_reply = coordinator.reply

    def spy(device_id: int, round_id: int, after: Phase, **kw: Any) -> Any:
        out = honest_reply(device_id, round_id, after, **kw)
        if out is not None:
            seen.append(out)
        return out

    coordinator.reply = spy  # type: ignore[method-assign]
    url = str(server.make_url("")).rstrip("/")
    report, clients = await run_fleet(
        _fleet(
            url, tmp_path / "signed-devices", authority_key_file=ca_file, schedule=_drops(True), credential_sources=3
        ),
        data,
    )
    assert report.rounds_finished == 2 and not report.errors, (report.errors, report.error_examples)
    assert [r["status"] for r in report.server_rounds] == ["committed"] * 2
    assert report.drops["before_consistency"] >= 1 and report.drops["before_keys"] >= 1
    # the rounds really were signed: certified keys in every broadcast, a consistency request, and unmask
    # requests carrying the signatures the devices checked
    assert all(m.certificates for m in seen if isinstance(m, ShareKeysBroadcast))
    assert any(isinstance(m, ConsistencyRequest) for m in seen)
    unmasks = [m for m in seen if isinstance(m, UnmaskRequest)]
    assert unmasks and all(len(m.signatures) == m.n_survivors == len(m.signer_ids) for m in unmasks)
    sources = coordinator.enrollment.sources(sorted(coordinator.storage.device_ids()))
    assert set(sources.values()) == {"cert:" + batch_id(f"fleet-{i}").hex() for i in range(3)}

    # the same fleet, seed and drops against an unsigned server (token enrollment): the same model, bit for bit
    plain_app = create_app(_config(tmp_path / "plain", cohort=14, enrollment={"open_registration": False}))
    plain = await aiohttp_server(plain_app)
    plain_url = str(plain.make_url("")).rstrip("/")
    report2, _ = await run_fleet(
        _fleet(plain_url, tmp_path / "plain-devices", admin_token=ADMIN, schedule=_drops(False), credential_sources=3),
        data,
    )
    assert report2.rounds_finished == 2 and not report2.errors
    survivors = [r["survivors"] for r in report.server_rounds]
    assert survivors == [r["survivors"] for r in report2.server_rounds] and min(survivors) < 14
    assert coordinator.model_bytes == plain_app[COORDINATOR].model_bytes
    assert coordinator.model_version == 3
    # ... and the in-process reference (no HTTP, no signatures) agrees with both
    from fedsim.private.coordinator_rounds import run_private_lightfr

    ref_cfg = _config(tmp_path / "ref", cohort=14, enrollment={})
    reference = run_private_lightfr(ref_cfg, users(14, seed=3), rounds=2, seed=11, dropout=_drops(False))
    try:
        assert reference.coordinator.model_bytes == coordinator.model_bytes
    finally:
        reference.coordinator.storage.close()


@pytest.mark.asyncio
async def test_substituted_keys_are_refused_over_http(aiohttp_server: Any, tmp_path: Path) -> None:
    # Key substitution over HTTP: the server puts its own keys in X's slot of its neighbours' broadcasts.
    ca = EnrollmentAuthority.generate()
    app = create_app(_config(tmp_path / "srv", cohort=6, enrollment={"authority_key": ca.public_key.hex()}))
    server = await aiohttp_server(app)
    coordinator = app[COORDINATOR]
    honest_reply = coordinator.reply
    fake = crypto.generate_key_pair(), crypto.generate_key_pair()
    lied_to: set[int] = set()

    def lying(device_id: int, round_id: int, after: Phase, **kw: Any) -> Any:
        out = honest_reply(device_id, round_id, after, **kw)
        if isinstance(out, ShareKeysBroadcast) and device_id != x and x in out.neighbour_ids:
            i = list(out.neighbour_ids).index(x)
            c, s = list(out.c_public_keys), list(out.s_public_keys)
            c[i], s[i] = fake[0].public_key, fake[1].public_key
            lied_to.add(device_id)
            return dataclasses.replace(out, c_public_keys=tuple(c), s_public_keys=tuple(s))
        return out

    coordinator.reply = lying  # type: ignore[method-assign]
    clients = _clients(str(server.make_url("")).rstrip("/"), tmp_path / "dev", 6, ca.public_key)
    for i, c in enumerate(clients):
        await c.register(certificate=ca.issue(c.identity_public_key, f"b{i % 2}"))
    x = clients[0].device_id
    results = await asyncio.gather(*(_join(c) for c in clients), return_exceptions=True)
    refused = [r for c, r in zip(clients, results, strict=True) if c.device_id in lied_to]
    assert lied_to and all(isinstance(r, CryptoError) and "not signed by its certified key" in str(r) for r in refused)
    assert not any(isinstance(r, RoundOutcome) and r.status is RoundStatus.COMMITTED for r in results)
    # nobody encrypted a share to the substituted keys: every neighbour left before SHARE_KEYS closed
    assert coordinator.status(0.0)["recent_rounds"][0]["status"] == "aborted"
    for c in clients:
        await c.close()


@pytest.mark.asyncio
async def test_split_view_is_refused_by_every_device_over_http(aiohttp_server: Any, tmp_path: Path) -> None:
    # A split view over HTTP: the server shows half of the survivors U3 and the other half U3 without X,
    # collects each half's signatures on what it showed them and forwards them in the unmask requests.
    ca = EnrollmentAuthority.generate()
    n = 20
    app = create_app(_config(tmp_path / "srv", cohort=n, enrollment={"authority_key": ca.public_key.hex()}))
    server = await aiohttp_server(app)
    coordinator = app[COORDINATOR]
    honest_reply, honest_submit = coordinator.reply, coordinator.submit
    sigs: dict[int, bytes] = {}
    shown: dict[int, tuple[int, ...]] = {}

    def group_b(device_id: int) -> bool:
        return device_id % 2 == 0

    def lying_submit(device_id: int, round_id: int, message: Any, now: float, **kw: Any) -> Any:
        if isinstance(message, ConsistencySignature):
            sigs[device_id] = message.signature  # kept by the liar, not handed to the honest session
            return Phase.UNMASK
        return honest_submit(device_id, round_id, message, now, **kw)

    def lying_reply(device_id: int, round_id: int, after: Phase, **kw: Any) -> Any:
        session = coordinator.open_round.session if coordinator.open_round else None
        if kw.get("consistency") and session is not None:
            group = [u for u in shown if group_b(u) == group_b(device_id)]
            if not all(u in sigs for u in group):
                return None
            u3 = shown[device_id]
            neighbours = session._graph[device_id]
            signers = tuple(sorted(group))
            return UnmaskRequest(
                round_id=round_id,
                device_id=device_id,
                session_id=session.session_id,
                survivors=tuple(v for v in neighbours if v in u3),
                dropped=tuple(v for v in neighbours if v not in u3),
                n_survivors=len(signers),
                survivor_set=u3,
                signer_ids=signers,
                signer_certificates=tuple(session._certs[v][0] for v in signers),
                signatures=tuple(sigs[v] for v in signers),
            )
        out = honest_reply(device_id, round_id, after, **kw)
        if isinstance(out, ConsistencyRequest):
            x = min(out.survivor_set)
            view = out.survivor_set if not group_b(device_id) else tuple(v for v in out.survivor_set if v != x)
            shown[device_id] = view
            return dataclasses.replace(out, survivor_set=view)
        return out

    coordinator.reply = lying_reply  # type: ignore[method-assign]
    coordinator.submit = lying_submit  # type: ignore[method-assign]
    clients = _clients(str(server.make_url("")).rstrip("/"), tmp_path / "dev", n, ca.public_key)
    for i, c in enumerate(clients):
        await c.register(certificate=ca.issue(c.identity_public_key, f"b{i % 4}"))
    results = await asyncio.gather(*(_join(c) for c in clients), return_exceptions=True)
    assert len(shown) == n and len(sigs) == n  # every device signed what it was shown
    assert all(isinstance(r, RemoteProtocolError) and "valid survivor signatures" in str(r) for r in results), results
    # and not one share was released: the honest session never received an unmask response
    session = coordinator._round.session if coordinator._round is not None else None
    assert session is None or not session._responded
    for c in clients:
        await c.close()


# -- keys at rest ---------------------------------------------------------------------------------------------


def test_device_identity_key_is_persisted_and_never_silently_replaced(tmp_path: Path) -> None:
    import os

    from device_sdk.persistence import SIGNING_KEY_FILE
    from protocol.errors import StorageError

    def client() -> DeviceClient:
        return DeviceClient.connect(
            "http://127.0.0.1:9",
            ClientConfig(store_dir=tmp_path / "dev"),
            items=[1, 2],
            ratings=None,
            n_items=N_ITEMS,
            bits=BITS,
        )

    first = client().identity_public_key
    assert len(first) == 32 and client().identity_public_key == first  # a restart keeps the identity
    assert not [p for p in os.listdir(tmp_path / "dev") if ".tmp-" in p]  # written atomically, no leftovers
    path = tmp_path / "dev" / SIGNING_KEY_FILE
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(StorageError):
        _ = client().identity_public_key  # a corrupt key is an error: a new key would not match the certificate


def test_the_authority_key_file_is_private_and_never_overwritten(tmp_path: Path) -> None:
    ca = EnrollmentAuthority.generate()
    path = tmp_path / "ca.key"
    ca.save(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert EnrollmentAuthority.load(path).public_key == ca.public_key
    with pytest.raises(ConfigError, match="never overwritten"):
        EnrollmentAuthority.generate().save(path)
    path.write_text("not a key\n")
    with pytest.raises(ConfigError, match="not a fedrec enrollment authority key"):
        EnrollmentAuthority.load(path)
    with pytest.raises(ConfigError, match="batch name"):
        ca.issue(bytes(32), "no spaces allowed")
