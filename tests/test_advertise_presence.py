"""ADVERTISE_KEYS closes once every device still taking part has sent its keys: a device that vanished after
its invitation and checks in again is dropped at once, not waited for until the deadline; a device that is
merely slow is waited for; and every closed phase says how it ended (all answered, drops detected, deadline).

Real aiohttp servers on loopback and real devices (`fedsim.fleets.local`).  Deadlines are long (60 s) on
purpose: the assertions compare the server's own phase durations with them, not with a wall clock.
"""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path
from typing import Any

import pytest

from agg_server.app import COORDINATOR, create_app
from agg_server.coordinator import RoundCoordinator
from agg_server.storage import Storage
from fedsim.fleets import faults
from fedsim.fleets.faults import DropoutAt
from fedsim.fleets.loadtest_report import format_loadtest, loadtest_record
from fedsim.fleets.local import FleetConfig, run_fleet
from protocol.device_session import DeviceSecAggSession
from protocol.messages import PublicKeys, RoundInvite, Wait
from protocol.phases import Phase
from protocol.samplers import insecure_test_noise_stream
from tests.server_helpers import BITS, N_ITEMS, small_config, users

DEADLINE = 60.0


def _fleet(server: Any, tmp_path: Path, **kw: Any) -> FleetConfig:
    return FleetConfig(
        url=str(server.make_url("")).rstrip("/"),
        store_root=tmp_path / "devices",
        n_items=N_ITEMS,
        bits=BITS,
        rounds=1,
        time_limit=4 * DEADLINE,
        **kw,
    )


@pytest.mark.asyncio
async def test_silent_drops_in_advertise_keys_are_detected_and_a_slow_device_is_waited_for(
    aiohttp_server: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, logger="agg_server.coordinator")
    cfg = small_config(tmp_path / "srv", cohort=8, min_cohort=8, timeout=DEADLINE, disconnect_grace=3.0)
    app = create_app(cfg)
    server = await aiohttp_server(app)
    events: list[tuple[str, dict[str, Any]]] = []
    app[COORDINATOR].listeners.append(lambda event, fields: events.append((event, dict(fields))))
    silent = {2, 5}  # device ids that vanish after training, before their keys (the fleet's silent drop)
    slow = 7  # sends its keys only after a pause longer than the grace, with no connection open meanwhile
    pause = cfg.rounds.disconnect_grace + 2.0
    keys_sent: list[int] = []
    inner_request = faults.FaultyTransport.request

    async def request(self: faults.FaultyTransport, method: str, path: str, message: Any = None, **kw: Any) -> Any:
        if isinstance(message, PublicKeys):
            if message.device_id == slow:
                await asyncio.sleep(pause)  # a slow phone: at least this long, however loaded the machine
            if message.device_id not in silent:
                keys_sent.append(message.device_id)
        return await inner_request(self, method, path, message, **kw)

    monkeypatch.setattr(faults.FaultyTransport, "request", request)
    fleet = _fleet(server, tmp_path, schedule=lambda r, d: DropoutAt.BEFORE_KEYS if d in silent else DropoutAt.NONE)
    report, _ = await run_fleet(fleet, list(users(8).values()))

    assert report.rounds_finished == 1 and report.outcomes["committed"] == 6 and not report.errors
    # Each silent device dropped once: it was not handed the invitation again and again (it used to be,
    # once per check-in, until the deadline).
    assert report.outcomes["dropped"] == 2 and report.drops == {"before_keys": 2}
    rec = report.server_rounds[0]
    assert rec["status"] == "committed" and rec["survivors"] == 6
    advertise = next(p for p in rec["phases"] if p["phase"] == "advertise_keys")
    assert advertise["dropped"] == 2 and advertise["ended"] == "drops_detected"
    # Closed by the server's detection, well before its 60 s deadline; and only after the slow device's
    # keys (it was waited for although it had held no connection for longer than the grace).
    assert pause <= advertise["seconds"] < DEADLINE / 2, advertise
    assert slow in keys_sent and set(keys_sent) == set(range(1, 9)) - silent
    for d in silent:
        assert caplog.text.count(f"device {d} dropped from advertise_keys: checked in again") == 1, caplog.text
    assert not re.search(rf"device {slow} dropped", caplog.text)
    # Event order: the phase event came after every surviving device's keys and says how it ended.
    phases = [f for e, f in events if e == "phase"]
    assert [f["phase"] for f in phases] == ["advertise_keys", "share_keys", "masked_input", "unmask"]
    assert [f["ended"] for f in phases] == ["drops_detected", "all_answered", "all_answered", "all_answered"]
    # The load test's report says it too, in its text and its JSON.
    record = loadtest_record(report, 1, None)
    assert record["server_rounds"][0]["phase_ends"] == {
        "advertise_keys": "drops_detected",
        "share_keys": "all_answered",
        "masked_input": "all_answered",
        "unmask": "all_answered",
    }
    text = _text(report)
    assert re.search(r"advertise_keys [0-9.]+ \(drops detected\), share_keys [0-9.]+ \(all answered\)", text), text


@pytest.mark.asyncio
async def test_a_device_that_leaves_after_its_upload_is_dropped_when_the_next_phase_awaits_it(
    aiohttp_server: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device that uploads its masked input, closes the connection and checks in again while MASKED_INPUT
    is still open is not awaited in UNMASK: neither until a held check-in comes back nor until the deadline."""
    from agg_server import app as app_module
    from protocol.messages import MaskedInput

    monkeypatch.setattr(app_module, "_CHECKIN_HOLD", 3600.0)  # only the round's end answers a held check-in
    caplog.set_level(logging.INFO, logger="agg_server.coordinator")
    cfg = small_config(tmp_path / "srv", cohort=6, min_cohort=6, timeout=DEADLINE, disconnect_grace=3.0)
    app = create_app(cfg)
    server = await aiohttp_server(app)
    leaving, slow = 2, 6
    inner_request = faults.FaultyTransport.request

    async def request(self: faults.FaultyTransport, method: str, path: str, message: Any = None, **kw: Any) -> Any:
        if isinstance(message, MaskedInput) and message.device_id == slow:
            await asyncio.sleep(4.0)  # keeps MASKED_INPUT open while the leaving device checks in again
        return await inner_request(self, method, path, message, **kw)

    monkeypatch.setattr(faults.FaultyTransport, "request", request)
    schedule = lambda r, d: DropoutAt.DISCONNECT_MASKED if d == leaving else DropoutAt.NONE  # noqa: E731
    report, _ = await run_fleet(_fleet(server, tmp_path, schedule=schedule), list(users(6).values()))
    assert report.rounds_finished == 1 and report.outcomes["committed"] == 5 and not report.errors
    rec = report.server_rounds[0]
    assert rec["status"] == "committed"
    ended = {p["phase"]: (p["ended"], p["seconds"], p["dropped"]) for p in rec["phases"]}
    # Its masked input arrived (it is in the sum) or it did not (a MASKED_INPUT dropout): either way no
    # phase waited for it until its deadline, nor until its check-in gave up (the devices' 30 s request
    # timeout; UNMASK took 28 s when a check-in in MASKED_INPUT made the server forget the device left).
    assert all(how != "deadline" and seconds < DEADLINE / 4 for how, seconds, _ in ended.values()), ended
    assert sum(dropped for *_, dropped in ended.values()) == 1, ended
    assert re.search(rf"device {leaving} dropped from (masked_input|unmask)", caplog.text), caplog.text


@pytest.mark.asyncio
async def test_a_keys_upload_whose_connection_breaks_is_dropped_after_the_grace(
    aiohttp_client: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A device whose connection closes while its keys are still arriving is gone: ADVERTISE_KEYS drops it
    after ``rounds.disconnect_grace`` instead of waiting for it until the deadline."""
    import aiohttp

    from protocol.codec import decode, encode
    from protocol.messages import CheckIn, RegisterRequest, ShareKeysBroadcast

    caplog.set_level(logging.INFO, logger="agg_server.coordinator")
    cfg = small_config(tmp_path / "srv", cohort=4, min_cohort=4, timeout=DEADLINE, disconnect_grace=0.5, k=4, t=2)
    app = create_app(cfg)
    client = await aiohttp_client(app)
    headers = {"Content-Type": "application/msgpack"}

    async def post(path: str, message: Any, token: str | None = None) -> Any:
        h = dict(headers, Authorization=f"Bearer {token}") if token else headers
        resp = await client.post(path, data=encode(message), headers=h, timeout=aiohttp.ClientTimeout(total=30))
        return decode(await resp.read())

    tokens = {}
    for _ in range(4):
        reg = await post("/v1/devices", RegisterRequest(platform="test"))
        tokens[reg.device_id] = reg.token
    invites: dict[int, RoundInvite] = {}
    while len(invites) < 4:
        for d, tok in tokens.items():
            if d not in invites:
                msg = await post("/v1/checkin", CheckIn(device_id=d), tok)
                if isinstance(msg, RoundInvite):
                    invites[d] = msg
        await asyncio.sleep(0.05)
    a, *others = sorted(tokens)
    rid = invites[a].round_id
    body = encode(DeviceSecAggSession(invites[a], rng=insecure_test_noise_stream(0, a)).send())
    sent_half = asyncio.Event()

    async def stalled() -> Any:
        yield body[: len(body) // 2]
        sent_half.set()
        await asyncio.sleep(3600)  # the rest never comes: the phone lost the network mid-upload

    h = dict(headers, Authorization=f"Bearer {tokens[a]}", **{"Content-Length": str(len(body))})
    upload = asyncio.create_task(client.post(f"/v1/rounds/{rid}/keys", data=stalled(), headers=h))
    await sent_half.wait()
    await asyncio.sleep(0.2)
    upload.cancel()  # closes its connection
    await asyncio.gather(upload, return_exceptions=True)
    coordinator = app[COORDINATOR]
    r = coordinator.open_round
    assert r is not None and r.session.phase is Phase.ADVERTISE_KEYS
    keys = {d: DeviceSecAggSession(invites[d], rng=insecure_test_noise_stream(0, d)).send() for d in others}
    replies = await asyncio.gather(*(post(f"/v1/rounds/{rid}/keys", keys[d], tokens[d]) for d in others))
    # The others' long-polls were answered by the phase's close: a was dropped by the grace, not the deadline.
    assert all(isinstance(m, ShareKeysBroadcast) for m in replies)
    assert re.search(rf"device {a} dropped from advertise_keys: connection gone for [0-9.]+ s", caplog.text)
    assert r.ended[Phase.ADVERTISE_KEYS] == "drops_detected"


def _text(report: Any) -> str:
    import io

    out = io.StringIO()
    format_loadtest(report, out)
    return out.getvalue()


def _coordinator(tmp_path: Path, storage: Storage, **rounds: Any) -> tuple[RoundCoordinator, list[int]]:
    cfg = small_config(tmp_path / "srv", cohort=4, min_cohort=4, timeout=30.0, k=4, t=2, **rounds)
    coordinator = RoundCoordinator(cfg, storage, now=0.0)
    devices = [coordinator.register("test", 0.0).device_id for _ in range(4)]
    for d in devices:
        coordinator.check_in(d, 99.5)
    coordinator.tick(100.0)
    return coordinator, devices


def _keys(coordinator: RoundCoordinator, d: int, invite: Any, now: float) -> None:
    keys = DeviceSecAggSession(invite, rng=insecure_test_noise_stream(0, d)).send()
    coordinator.submit(d, invite.round_id, keys, now)


def test_a_device_that_got_its_invitation_and_checks_in_again_has_left(tmp_path: Path) -> None:
    with Storage(tmp_path / "db") as storage:
        coordinator, (a, b, c, e) = _coordinator(tmp_path, storage)
        r = coordinator.open_round
        assert r is not None
        events: list[dict[str, Any]] = []
        coordinator.listeners.append(lambda e, f: events.append(f) if e == "phase" else None)
        invites = {d: coordinator.check_in(d, 100.1) for d in (a, b, c, e)}
        assert all(isinstance(i, RoundInvite) for i in invites.values())
        coordinator.invitation_delivered(a, r.round_id)  # a's answer left on an open connection
        # b's answer was lost (never marked): b gets the same invitation again and stays awaited.
        assert coordinator.check_in(b, 100.2) == invites[b] and b in r.session.expected()
        again = coordinator.check_in(a, 100.3)  # a checks in again: it is in no round, so it left ours
        assert isinstance(again, Wait) and a in r.session._left
        for d in (b, c, e):
            _keys(coordinator, d, invites[d], 100.4)
        assert r.session.phase is Phase.SHARE_KEYS
        assert events[0]["phase"] == "advertise_keys" and events[0]["ended"] == "drops_detected"
        assert events[0]["dropped"] == 1 and events[0]["seconds"] == pytest.approx(0.4)


def test_phase_endings_all_answered_and_deadline(tmp_path: Path) -> None:
    with Storage(tmp_path / "db") as storage:
        coordinator, devices = _coordinator(tmp_path, storage)
        r = coordinator.open_round
        assert r is not None
        events: list[dict[str, Any]] = []
        coordinator.listeners.append(lambda e, f: events.append(f) if e == "phase" else None)
        invites = {d: coordinator.check_in(d, 100.1) for d in devices}
        for d in devices:
            _keys(coordinator, d, invites[d], 100.2)
        assert [(f["phase"], f["ended"]) for f in events] == [("advertise_keys", "all_answered")]
        coordinator.tick(100.0 + 2 * 30.0 + 0.1)  # nobody sends shares: SHARE_KEYS ends at its deadline
        assert [(f["phase"], f["ended"]) for f in events][1] == ("share_keys", "deadline")
        assert r.session.phase is not Phase.SHARE_KEYS
        # /v1/status carries it with the recorded phases (the round aborted: fewer than t shares).
        recent = coordinator.status(200.0)["recent_rounds"][0]
        ends = {p["phase"]: p["ended"] for p in recent["phases"]}
        assert ends["advertise_keys"] == "all_answered" and ends["share_keys"] == "deadline"


def test_the_load_test_report_says_how_each_phase_ended() -> None:
    from fedsim.fleets.local import FleetReport

    report = FleetReport(devices=3)
    phases = [
        {"phase": "advertise_keys", "seconds": 60.0, "arrived": 3, "dropped": 1, "ended": "deadline"},
        {"phase": "share_keys", "seconds": 1.5, "arrived": 2, "dropped": 1, "ended": "drops_detected"},
        {"phase": "masked_input", "seconds": 0.0, "arrived": 0, "dropped": 0, "ended": "aborted"},
    ]
    base = {"status": "aborted", "cohort_size": 3, "survivors": 0, "started_at": 10.0, "finished_at": 71.5}
    report.server_rounds.append({"round_id": 1, **base, "phases": phases})
    # A round the server did not time itself (another instance, an older server): no "ended".
    report.server_rounds.append({"round_id": 2, **base, "phases": [{"phase": "advertise_keys", "seconds": 2.0}]})
    rows = loadtest_record(report, 2, None)["server_rounds"]
    ends = {"advertise_keys": "deadline", "share_keys": "drops_detected", "masked_input": "aborted"}
    assert rows[0]["phase_ends"] == ends
    assert rows[1]["phase_ends"] == {"advertise_keys": None}
    text = _text(report)
    assert "phases (s): advertise_keys 60.0 (DEADLINE), share_keys 1.5 (drops detected)\n" in text, text
    assert "phases (s): advertise_keys 2.0\n" in text, text
    assert "phases ended: drops detected 1, DEADLINE 1, aborted 1\n" in text, text
