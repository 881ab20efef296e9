"""The aggregation server over real HTTP on loopback: hostile inputs get the right status and an
encoded error, a misbehaving device cannot stop a round, and a run through the server ends with the
same model, bit for bit, as the in-process reference with the same seeds and dropout schedule."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from agg_server.app import COORDINATOR, create_app
from device_sdk.client import MODEL_FILE, SYNC_FILE, ClientConfig, DeviceClient, RoundStatus
from device_sdk.models import LightFRConfig, LightFRModel
from fedsim.fleets.faults import DropoutAt
from fedsim.fleets.local import FleetConfig, run_fleet
from fedsim.private.coordinator_rounds import run_private_lightfr
from protocol.codec import decode, encode
from protocol.crypto import generate_key_pair
from protocol.errors import (
    AuthError,
    ConfigError,
    DecodeError,
    PayloadTooLarge,
    PermissionDenied,
    StaleRound,
    VersionMismatch,
)
from protocol.messages import (
    CheckIn,
    ErrorMessage,
    MaskedInput,
    ModelPayload,
    PublicKeys,
    RegisterRequest,
    RegisterResponse,
    RoundInvite,
    RoundResult,
    Wait,
)
from protocol.policy import PrivacyPolicy
from tests.server_helpers import BITS, N_ITEMS, small_config, users

MSGPACK = {"Content-Type": "application/msgpack"}


async def _post(client: Any, path: str, body: bytes, token: str | None = None) -> tuple[int, Any]:
    headers = dict(MSGPACK)
    if token:
        headers["Authorization"] = f"Bearer {token}"
    resp = await client.post(path, data=body, headers=headers)
    raw = await resp.read()
    assert resp.headers["Content-Type"].startswith("application/msgpack")
    return resp.status, decode(raw)


async def _register(client: Any) -> RegisterResponse:
    status, msg = await _post(client, "/v1/devices", encode(RegisterRequest(platform="pytest")))
    assert status == 201 and isinstance(msg, RegisterResponse)
    return msg


def _error(msg: Any, cls: type[Exception]) -> None:
    assert isinstance(msg, ErrorMessage), msg
    assert isinstance(msg.to_exception(), cls), (msg.code, msg.message)


def _with_version(message: Any, minor: int) -> bytes:
    """``message`` encoded as a peer of protocol 1.``minor`` would send it (same body)."""
    envelope = msgpack.unpackb(encode(message), raw=False)
    envelope["v"] = [1, minor]
    return msgpack.packb(envelope, use_bin_type=True)


@pytest.mark.asyncio
@pytest.mark.parametrize("dp", [True, False])
async def test_a_dp_server_refuses_devices_older_than_its_noise_rule(
    aiohttp_client: Any, tmp_path: Path, dp: bool
) -> None:
    # Protocol 1.12: a 1.11 device ignores the invite's dp_colluders and adds noise its colluding peers could thin
    # below μ, so a server with DP refuses its check-in (426, naming both versions); without DP it takes part.
    cfg = small_config(tmp_path, cohort=3)
    cfg = dataclasses.replace(cfg, privacy=dataclasses.replace(cfg.privacy, enabled=dp, epsilon=8.0))
    client = await aiohttp_client(create_app(cfg))
    dev = await _register(client)
    status, msg = await _post(client, "/v1/checkin", _with_version(CheckIn(device_id=dev.device_id), 11), dev.token)
    if dp:
        assert status == 426, msg
        _error(msg, VersionMismatch)
        assert "protocol 1.12 or later; upgrade (1.11)" in msg.message
    else:
        assert status == 200 and isinstance(msg, Wait), msg
    status, msg = await _post(client, "/v1/checkin", _with_version(CheckIn(device_id=dev.device_id), 12), dev.token)
    assert status == 200 and isinstance(msg, Wait), msg


@pytest.mark.asyncio
async def test_hostile_inputs_get_the_right_status(aiohttp_client: Any, tmp_path: Path) -> None:
    cfg = small_config(tmp_path, cohort=3)
    cfg = dataclasses.replace(cfg, listen=dataclasses.replace(cfg.listen, max_body_bytes=256 * 1024))
    client = await aiohttp_client(create_app(cfg))
    dev = await _register(client)
    token = dev.token

    status, msg = await _post(client, "/v1/checkin", b"\xc1\xc1 not msgpack", token)
    assert status == 400
    _error(msg, DecodeError)

    status, msg = await _post(client, "/v1/checkin", msgpack.packb({"v": [1, 1], "t": 99, "b": {}}), token)
    assert status == 400 and "unknown message type" in msg.message

    status, msg = await _post(client, "/v1/checkin", msgpack.packb({"v": [2, 0], "t": 13, "b": {"d": 1}}), token)
    assert status == 426
    _error(msg, VersionMismatch)

    status, msg = await _post(client, "/v1/checkin", b"\x00" * (300 * 1024), token)
    assert status == 413
    _error(msg, PayloadTooLarge)

    status, msg = await _post(client, "/v1/checkin", encode(CheckIn(device_id=dev.device_id)))
    assert status == 401
    _error(msg, AuthError)
    status, msg = await _post(client, "/v1/checkin", encode(CheckIn(device_id=dev.device_id)), "x" * 40)
    assert status == 401

    other = await _register(client)
    status, msg = await _post(client, "/v1/checkin", encode(CheckIn(device_id=other.device_id)), token)
    assert status == 403
    _error(msg, PermissionDenied)

    status, msg = await _post(client, "/v1/checkin", encode(RegisterRequest()), token)
    assert status == 400 and "expected CheckIn" in msg.message

    keys = PublicKeys(round_id=7, device_id=dev.device_id, c_public_key=b"\x01" * 32, s_public_key=b"\x02" * 32)
    status, msg = await _post(client, "/v1/rounds/7/keys", encode(keys), token)
    assert status == 409
    _error(msg, StaleRound)
    status, msg = await _post(client, "/v1/rounds/x/keys", encode(keys), token)
    assert status == 400
    # A late masked input (its round is gone) is bigger than any route's limit without an open round:
    # the answer says the round is stale, not that the body is too large.
    late = MaskedInput(round_id=7, device_id=dev.device_id, session_id=b"\x00" * 32, masked=np.zeros(20_000, np.uint32))
    status, msg = await _post(client, "/v1/rounds/7/masked", encode(late), token)
    assert status == 409
    _error(msg, StaleRound)

    resp = await client.get("/v1/nowhere")
    assert resp.status == 404 and isinstance(decode(await resp.read()), ErrorMessage)
    # A client that asks for JSON (curl -H 'Accept: application/json', a browser's fetch) gets JSON.
    resp = await client.get("/v1/nowhere", headers={"Accept": "application/json"})
    assert resp.status == 404 and resp.content_type == "application/json"
    assert (await resp.json())["message"] == "no route GET /v1/nowhere"
    resp = await client.delete("/v1/status", headers={"Accept": "application/json"})
    assert resp.status == 405 and (await resp.json())["error"] == "remote_protocol_error"

    status, msg = await _post(client, "/v1/checkin", encode(CheckIn(device_id=dev.device_id)), token)
    assert status == 200 and isinstance(msg, Wait)

    resp = await client.get("/v1/model", headers={"Authorization": f"Bearer {token}"})
    assert resp.status == 200
    model = decode(await resp.read())
    assert isinstance(model, ModelPayload) and (model.bits, model.n_items) == (BITS, N_ITEMS)
    resp = await client.get(
        "/v1/model", headers={"Authorization": f"Bearer {token}", "If-None-Match": resp.headers["ETag"]}
    )
    assert resp.status == 304

    status_json = await (await client.get("/v1/status")).json()
    assert status_json["model"]["version"] == 1 and status_json["registered_devices"] == 2
    assert status_json["errors_by_status"]["401"] == 2
    assert (await (await client.get("/v1/health")).json()) == {"status": "ok", "state": "idle"}


@pytest.mark.asyncio
async def test_a_misbehaving_device_cannot_stop_the_round(
    aiohttp_server: Any, aiohttp_client: Any, tmp_path: Path
) -> None:
    """A replayed, duplicated and out-of-phase device is refused; the honest devices' round commits."""
    honest = users(6)
    cfg = small_config(tmp_path / "server", cohort=7, timeout=4.0, min_cohort=7)
    app = create_app(cfg)
    server = await aiohttp_server(app)
    client = await aiohttp_client(server)
    attacker = await _register(client)
    tok = attacker.token

    async def attack() -> list[tuple[int, Any]]:
        results: list[tuple[int, Any]] = []
        invite = None
        while invite is None:
            _, msg = await _post(client, "/v1/checkin", encode(CheckIn(device_id=attacker.device_id)), tok)
            if isinstance(msg, RoundInvite):
                invite = msg
            else:
                await asyncio.sleep(0.1)
        rid, did = invite.round_id, invite.device_id

        def keys() -> PublicKeys:
            return PublicKeys(
                round_id=rid,
                device_id=did,
                c_public_key=generate_key_pair().public_key,
                s_public_key=generate_key_pair().public_key,
            )

        first = keys()
        # The same upload twice is accepted once; a different second upload is refused (400).
        t1 = asyncio.create_task(_post(client, f"/v1/rounds/{rid}/keys", encode(first), tok))
        t2 = asyncio.create_task(_post(client, f"/v1/rounds/{rid}/keys", encode(first), tok))
        await asyncio.sleep(0.2)
        results.append(await _post(client, f"/v1/rounds/{rid}/keys", encode(keys()), tok))
        # A message of a later phase, while keys are still being collected: the device is excluded.
        masked = MaskedInput(
            round_id=rid, device_id=did, session_id=b"\x00" * 32, masked=np.zeros(N_ITEMS * BITS, np.uint32)
        )
        results.append(await _post(client, f"/v1/rounds/{rid}/masked", encode(masked), tok))
        results.append(await t1)
        results.append(await t2)
        # A replay into the next round id, before it exists: stale.
        results.append(await _post(client, f"/v1/rounds/{rid + 1}/keys", encode(first), tok))
        return results

    fleet_cfg = FleetConfig(
        url=str(server.make_url("")).rstrip("/"),
        store_root=tmp_path / "devices",
        n_items=N_ITEMS,
        bits=BITS,
        rounds=1,
        time_limit=60.0,
        # One honest device goes silent before its keys, so the first phase stays open until its
        # deadline and the attacker's second upload meets an open phase.
        schedule=lambda r, d: DropoutAt.BEFORE_KEYS if d == 2 else DropoutAt.NONE,
    )
    attack_task = asyncio.create_task(attack())
    report, _ = await run_fleet(fleet_cfg, list(honest.values()))
    results = await attack_task
    statuses = [s for s, _ in results]
    assert statuses[0] == 400 and "second, different" in results[0][1].message
    assert statuses[1] == 400
    # Both copies of the first upload were answered alike: the device was excluded before the phase
    # closed, so each long-poll ends with a round result that is not "committed" for it.
    (s1, m1), (s2, m2) = results[2], results[3]
    assert s1 == s2 == 200 and isinstance(m1, RoundResult) and isinstance(m2, RoundResult)
    assert not m1.committed and m1 == m2
    assert statuses[4] == 409
    coordinator = app[COORDINATOR]
    assert coordinator.model_version == 2
    rec = coordinator.status(0.0)["recent_rounds"][0]
    assert rec["status"] == "committed" and rec["survivors"] == 5
    assert report.outcomes["committed"] == 5 and report.outcomes["dropped"] >= 1 and not report.errors
    assert set(report.drops) == {"before_keys"}


def _schedule(round_number: int, device_id: int) -> DropoutAt:
    """Drops at every phase, different devices in different rounds."""
    phases = [
        DropoutAt.BEFORE_KEYS,
        DropoutAt.BEFORE_SHARES,
        DropoutAt.BEFORE_MASKED,
        DropoutAt.BEFORE_UNMASK,
    ]
    if (device_id + round_number) % 7 == 0:
        return phases[(device_id // 7 + round_number) % 4]
    return DropoutAt.NONE


@pytest.mark.asyncio
async def test_http_run_is_bit_identical_to_the_in_process_reference(aiohttp_server: Any, tmp_path: Path) -> None:
    data = users(50, seed=3)
    rounds = 2
    # Dropped devices announce it, so each phase closes at quorum; the deadlines only guard against a
    # hang, far above what honest devices need on a loaded machine (a silent drop that waits a deadline
    # out is `test_a_misbehaving_device_cannot_stop_the_round`).
    cfg = small_config(tmp_path / "http", cohort=50, timeout=60.0, min_cohort=50)
    app = create_app(cfg)
    server = await aiohttp_server(app)
    fleet_cfg = FleetConfig(
        url=str(server.make_url("")).rstrip("/"),
        store_root=tmp_path / "devices",
        n_items=N_ITEMS,
        bits=BITS,
        rounds=rounds,
        seed=11,
        insecure_reproducible=True,  # the test hook: the reference must draw the same noise
        schedule=_schedule,
        announce_drops=True,
        time_limit=300.0,
    )
    report, _ = await run_fleet(fleet_cfg, list(data.values()))
    http_coord = app[COORDINATOR]
    assert report.rounds_finished == rounds and not report.errors
    assert [r["status"] for r in report.server_rounds] == ["committed"] * rounds
    dropped = sum(r["cohort_size"] - r["survivors"] for r in report.server_rounds)
    assert dropped >= 8 and report.drops  # devices really dropped, at several phases
    phases_with_drops = {p["phase"] for r in report.server_rounds for p in r["phases"] if p["dropped"]}
    assert phases_with_drops == {"advertise_keys", "share_keys", "masked_input", "unmask"}

    ref_cfg = small_config(tmp_path / "ref", cohort=50, timeout=60.0, min_cohort=50)
    reference = run_private_lightfr(ref_cfg, data, rounds=rounds, seed=11, dropout=lambda r, d: _schedule(r, d))
    ref = reference.coordinator
    try:
        assert ref.model_version == http_coord.model_version == 1 + rounds
        assert np.array_equal(ref.item_codes, http_coord.item_codes)
        assert ref.model_bytes == http_coord.model_bytes
    finally:
        ref.storage.close()


@pytest.mark.asyncio
async def test_http_run_with_asymmetric_scoring_in_the_plan_matches_the_in_process_reference(
    aiohttp_server: Any, tmp_path: Path
) -> None:
    """Protocol 1.6: the server's model.query_planes / user_reg reach every device through the round plan;
    over HTTP the devices train bit-plane vectors and the committed model is bit-identical to the same
    rounds in-process (same seeds, same drops), and differs from the run without planes."""
    data = users(16, seed=4)
    rounds = 2

    def config(where: str, planes: int) -> Any:
        cfg = small_config(tmp_path / where, cohort=16, timeout=60.0, min_cohort=16)
        params = dataclasses.replace(cfg.lightfr.params, query_planes=planes, user_reg=10.0)
        return dataclasses.replace(cfg, lightfr=dataclasses.replace(cfg.lightfr, params=params))

    def schedule(r: int, d: int) -> DropoutAt:
        return DropoutAt.BEFORE_MASKED if (d + r) % 5 == 0 else DropoutAt.NONE

    app = create_app(config("http", 2))
    server = await aiohttp_server(app)
    fleet_cfg = FleetConfig(
        url=str(server.make_url("")).rstrip("/"),
        store_root=tmp_path / "devices",
        n_items=N_ITEMS,
        bits=BITS,
        rounds=rounds,
        seed=11,
        insecure_reproducible=True,
        schedule=schedule,
        announce_drops=True,
        time_limit=300.0,
    )
    report, clients = await run_fleet(fleet_cfg, list(data.values()))
    http_coord = app[COORDINATOR]
    assert report.rounds_finished == rounds and not report.errors
    assert [r["status"] for r in report.server_rounds] == ["committed"] * rounds
    trained = [c.model for c in clients if c.model.user_trained[0]]
    assert trained and all(m.config.query_planes == 2 and m.config.user_reg == 10.0 for m in trained)
    assert all(m.user_weight[0] > 0 for m in trained)  # bit-plane vectors, not ±1 codes

    reference = run_private_lightfr(config("ref", 2), data, rounds=rounds, seed=11, dropout=schedule)
    codes_only = run_private_lightfr(config("codes", 0), data, rounds=rounds, seed=11, dropout=schedule)
    try:
        ref = reference.coordinator
        assert ref.model_version == http_coord.model_version == 1 + rounds
        assert ref.model_bytes == http_coord.model_bytes
        assert codes_only.coordinator.model_bytes != ref.model_bytes
    finally:
        reference.coordinator.storage.close()
        codes_only.coordinator.storage.close()


@pytest.mark.asyncio
@pytest.mark.parametrize(("n_items", "bits"), [(N_ITEMS + 5, BITS), (N_ITEMS, 2 * BITS)])
async def test_a_device_built_for_another_model_finds_out_at_its_first_contact(
    aiohttp_server: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture, n_items: int, bits: int
) -> None:
    """A device whose catalogue size or code length is not the server's is told so at its first run_round
    (before it checks in, not when it is first invited, which may be never), in an error naming both shapes,
    and its store (identity, trained model) is left as it was.  A device that fits adopts the server's model
    there and then, and a restart that holds it gets a 304."""
    server = await aiohttp_server(create_app(small_config(tmp_path / "server", cohort=3)))
    url = str(server.make_url("")).rstrip("/")
    store = tmp_path / "device"
    items = np.array([1, 4, 9])

    def connect(n: int, f: int) -> DeviceClient:
        config = ClientConfig(store_dir=store, privacy=PrivacyPolicy(require_noise=False))
        return DeviceClient.connect(url, config, items=items, ratings=None, n_items=n, bits=f, retries=0)

    # The device's state: its identity from an earlier registration, and a model it trained (fold_in) and stored.
    async with connect(n_items, bits) as device:
        await device.register()
    trained = LightFRModel(n_items, LightFRConfig(bits=bits, rating_range=None))
    trained.fold_in(items)
    trained.save(store / MODEL_FILE)
    before = {p.name: p.read_bytes() for p in store.iterdir()}
    async with connect(n_items, bits) as device:
        with caplog.at_level("ERROR", logger="device_sdk.client"), pytest.raises(ConfigError) as info:
            # Before this check, it waited for an invitation that never comes (here: TimeoutError).
            await asyncio.wait_for(device.run(rounds=1), timeout=20.0)
    ours = f"'lightfr' with bits {bits} and n_items {n_items}"
    theirs = f"'lightfr' with bits {BITS} and n_items {N_ITEMS}"
    assert str(info.value).startswith(f"the server's model is {theirs}; this device runs {ours}"), str(info.value)
    assert str(info.value) in caplog.text
    assert {p.name: p.read_bytes() for p in store.iterdir()} == before  # nothing stored, nothing lost
    assert server.app[COORDINATOR].status(0.0)["waiting_devices"] == 0  # it never checked in

    # The same store, built for the server's model: the first contact adopts version 1 and stores it.
    for p in store.iterdir():
        if p.name == MODEL_FILE:
            p.unlink()
    async with connect(N_ITEMS, BITS) as device:
        first = await device.run_round()
        again = await device.run_round()
        assert device.model.model_version == 1 and (store / SYNC_FILE).is_file()
    assert first.status is again.status is RoundStatus.WAITED
    assert "model" in first.timings and "model" not in again.timings  # once per client
    assert first.bytes_down > N_ITEMS * BITS // 8 > again.bytes_down
    async with connect(N_ITEMS, BITS) as device:  # a restart that holds the current model: 304
        restarted = await device.run_round()
        assert device.model.model_version == 1
    assert restarted.status is RoundStatus.WAITED and restarted.bytes_down < N_ITEMS * BITS // 8


def test_failed_commit_releases_the_round_and_charges_privacy_once(tmp_path: Path) -> None:
    """A storage failure at commit must not retry the commit (and the privacy charge) on every tick."""
    from protocol.errors import StorageError

    cfg = small_config(tmp_path, cohort=5, min_cohort=5)
    cfg = dataclasses.replace(cfg, privacy=dataclasses.replace(cfg.privacy, enabled=True, epsilon=50.0))
    data = users(5)
    run = run_private_lightfr(cfg, data, rounds=1, seed=1)
    coord = run.coordinator
    charged = len(coord.ledger.rounds)
    assert charged == 1 and coord.model_version == 2

    def broken(*args: Any, **kwargs: Any) -> None:
        raise StorageError("disk full (simulated)")

    coord.storage.commit_model = broken  # type: ignore[method-assign]
    from fedsim.private.coordinator_rounds import _one_round

    clock = [5_000.0]
    for d in run.devices:
        coord.check_in(d, clock[0])
    clock[0] += 1.0
    coord.tick(clock[0])
    r = coord.open_round
    assert r is not None
    _one_round(coord, run.devices, r.round_id, lambda rr, dd: DropoutAt.NONE, 1, clock)
    for _ in range(5):
        clock[0] += 1.0
        coord.tick(clock[0])
    assert coord.open_round is None or coord.open_round.round_id != r.round_id
    assert len(coord.ledger.rounds) == charged + 1  # charged once: the sum was released
    assert coord.model_version == 2  # nothing committed
    assert coord.storage.load_ledger()["rounds"][-1]["round_id"] == r.round_id
    coord.storage.close()
