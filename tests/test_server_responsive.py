"""A responsive single instance: targeted long-poll wake-ups, the round's end off the event loop, and
phases that close as soon as every device still there has answered.

Real aiohttp servers on loopback and real devices (`fedsim.fleets.local`); deadlines are long on purpose where
a test shows that a phase closed *before* its deadline.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agg_server import app as app_module
from agg_server.app import COORDINATOR, create_app
from agg_server.strategy import build_strategy
from fedsim.fleets.faults import DropoutAt
from fedsim.fleets.local import FleetConfig, run_fleet
from protocol import crypto
from protocol.codec import encode
from protocol.crypto import generate_key_pair
from protocol.errors import RemoteProtocolError, RoundClosed
from protocol.masking import pair_mask_keys
from protocol.messages import PublicKeys
from protocol.session import Phase, RoundParameters, ServerSecAggSession
from tests.server_helpers import BITS, N_ITEMS, small_config, users


def _fleet(server: Any, tmp_path: Path, **kw: Any) -> FleetConfig:
    base: dict[str, Any] = {
        "url": str(server.make_url("")).rstrip("/"),
        "store_root": tmp_path / "devices",
        "n_items": N_ITEMS,
        "bits": BITS,
        "rounds": 1,
        "time_limit": 60.0,
    }
    base.update(kw)
    return FleetConfig(**base)


class _GatedStrategy:
    """The configured strategy whose `aggregate` (a big model's end of round) does not return before
    ``release`` is set, or ``guard`` seconds have passed; ``released`` records which it was."""

    def __init__(self, inner: Any, guard: float) -> None:
        self._inner = inner
        self._guard = guard
        self.release = threading.Event()
        self.released: list[bool] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def aggregate(self, *args: Any, **kwargs: Any) -> Any:
        # In the finishing thread, never on the event loop: there, this wait would hold the loop, nothing
        # could set ``release``, and it would end by the guard.
        self.released.append(self.release.wait(self._guard))
        return self._inner.aggregate(*args, **kwargs)


@pytest.mark.asyncio
async def test_uploads_that_leave_the_phase_open_wake_no_long_poll(aiohttp_server: Any, tmp_path: Path) -> None:
    cfg = small_config(tmp_path / "srv", cohort=8, min_cohort=8, timeout=20.0)
    app = create_app(cfg)
    server = await aiohttp_server(app)
    changes = app[app_module._CHANGES]
    woken = {"notify": 0}
    original = changes.notify

    def counting() -> None:
        woken["notify"] += 1
        original()

    changes.notify = counting  # type: ignore[method-assign]
    report, _ = await run_fleet(_fleet(server, tmp_path), list(users(8).values()))
    assert report.rounds_finished == 1 and report.outcomes["committed"] == 8 and not report.errors
    # 8 devices x 4 uploads = 32 uploads; the waiters were woken once per phase change (4 phases,
    # finishing, the commit) and per round opened, not once per upload.
    assert woken["notify"] <= 8, woken


@pytest.mark.asyncio
async def test_health_and_status_answer_while_a_round_finishes(aiohttp_server: Any, tmp_path: Path) -> None:
    cfg = small_config(tmp_path / "srv", cohort=5, min_cohort=5, timeout=20.0)
    strategy = _GatedStrategy(build_strategy(cfg), guard=20.0)
    app = create_app(cfg, strategy=strategy)  # type: ignore[arg-type]
    server = await aiohttp_server(app)
    import aiohttp

    seen: list[str] = []
    stop = asyncio.Event()

    async def probe() -> None:
        async with aiohttp.ClientSession() as http:
            while not stop.is_set():
                async with http.get(str(server.make_url("/v1/health"))) as resp:
                    body = await resp.json()
                seen.append(body["state"])
                if body["state"] == "finishing":
                    async with http.get(str(server.make_url("/v1/status"))) as resp:
                        status = await resp.json()
                    assert status["round"]["phase"] == "finishing"
                    if seen.count("finishing") >= 3:
                        strategy.release.set()  # the aggregation may end now
                await asyncio.sleep(0.02)

    prober = asyncio.create_task(probe())
    report, _ = await run_fleet(_fleet(server, tmp_path), list(users(5).values()))
    stop.set()
    await prober
    assert report.outcomes["committed"] == 5 and not report.errors
    # The aggregation ran in the worker thread and did not end before health and status had answered
    # three times meanwhile (on the event loop it would have held every request until its guard).
    assert strategy.released == [True]
    assert seen.count("finishing") >= 3
    assert app[COORDINATOR].model_version == 2


@pytest.mark.asyncio
async def test_a_device_that_checks_in_again_has_left_its_round(
    aiohttp_server: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Deadlines of 30 s: the round would last about a minute if the silent drop were noticed only there.
    caplog.set_level(logging.INFO, logger="agg_server.coordinator")
    cfg = small_config(tmp_path / "srv", cohort=6, min_cohort=6, timeout=30.0)
    app = create_app(cfg)
    server = await aiohttp_server(app)
    fleet = _fleet(
        server,
        tmp_path,
        schedule=lambda r, d: DropoutAt.BEFORE_SHARES if d == 3 else DropoutAt.NONE,
        drop_pause=0.2,
    )
    report, _ = await run_fleet(fleet, list(users(6).values()))
    assert report.rounds_finished == 1 and report.outcomes["committed"] == 5 and not report.errors
    rec = report.server_rounds[0]
    assert rec["status"] == "committed" and rec["survivors"] == 5
    assert {p["phase"]: p["dropped"] for p in rec["phases"]}["share_keys"] == 1
    # dropped because it checked in again (at once), not by the phase's 30 s deadline
    assert caplog.text.count("dropped from share_keys: checked in again while in the round") == 1, caplog.text


@pytest.mark.asyncio
async def test_a_device_whose_long_poll_breaks_is_dropped_after_the_grace(
    aiohttp_client: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import aiohttp

    from protocol.codec import decode
    from protocol.messages import CheckIn, RegisterRequest, RoundInvite, ShareKeysBroadcast

    cfg = small_config(tmp_path / "srv", cohort=3, min_cohort=3, timeout=30.0, disconnect_grace=0.5)
    app = create_app(cfg)
    client = await aiohttp_client(app)
    headers = {"Content-Type": "application/msgpack"}

    async def post(path: str, message: Any, token: str | None = None, timeout: float = 10.0) -> Any:
        h = dict(headers, Authorization=f"Bearer {token}") if token else headers
        resp = await client.post(path, data=encode(message), headers=h, timeout=aiohttp.ClientTimeout(total=timeout))
        return decode(await resp.read())

    tokens = {}
    for _ in range(3):
        reg = await post("/v1/devices", RegisterRequest(platform="test"))
        tokens[reg.device_id] = reg.token
    invites: dict[int, RoundInvite] = {}
    while len(invites) < 3:
        for d, tok in tokens.items():
            if d not in invites:
                msg = await post("/v1/checkin", CheckIn(device_id=d), tok)
                if isinstance(msg, RoundInvite):
                    invites[d] = msg
        await asyncio.sleep(0.05)

    def keys(d: int) -> PublicKeys:
        return PublicKeys(
            round_id=invites[d].round_id,
            device_id=d,
            c_public_key=generate_key_pair().public_key,
            s_public_key=generate_key_pair().public_key,
        )

    a, b, c = sorted(tokens)
    rid = invites[a].round_id
    caplog.set_level(logging.INFO, logger="agg_server.coordinator")
    # Device a uploads its keys and its connection closes while it waits (a phone losing the network).
    with pytest.raises(TimeoutError):
        await post(f"/v1/rounds/{rid}/keys", keys(a), tokens[a], timeout=0.3)
    t0 = time.monotonic()
    replies = await asyncio.gather(*(post(f"/v1/rounds/{rid}/keys", keys(d), tokens[d]) for d in (b, c)))
    assert all(isinstance(m, ShareKeysBroadcast) for m in replies)
    coordinator = app[COORDINATOR]
    r = coordinator.open_round
    assert r is not None and r.session.phase is Phase.SHARE_KEYS
    while a not in r.session._left and time.monotonic() - t0 < 20.0:  # a guard: the deadline is 30 s
        await asyncio.sleep(0.05)
    # Dropped by the grace after SHARE_KEYS began awaiting it (its connection gone for at least 0.5 s),
    # not at the 30 s deadline.
    assert a in r.session._left
    gone = re.findall(rf"device {a} dropped from share_keys: connection gone for ([0-9.]+) s", caplog.text)
    assert len(gone) == 1 and float(gone[0]) >= 0.5, caplog.text


def test_a_connection_that_comes_back_within_the_grace_keeps_its_device(tmp_path: Path) -> None:
    from agg_server.coordinator import RoundCoordinator
    from agg_server.storage import Storage

    cfg = small_config(tmp_path / "srv", cohort=3, min_cohort=3, timeout=30.0, disconnect_grace=5.0)
    with Storage(cfg.data_dir) as storage:
        coordinator = RoundCoordinator(cfg, storage, now=0.0)
        devices = [coordinator.register("test", 0.0).device_id for _ in range(3)]
        for d in devices:
            coordinator.check_in(d, 99.5)
        coordinator.tick(100.0)
        r = coordinator.open_round
        assert r is not None
        d = devices[0]
        coordinator.poll_started(d, r.round_id)
        coordinator.poll_ended(d, r.round_id, 100.0, answered=False)
        coordinator.tick(102.0)
        assert d in r.gone  # within the grace
        coordinator.poll_started(d, r.round_id)  # it came back
        coordinator.tick(110.0)
        assert not r.gone and d not in r.session._left
        coordinator.poll_ended(d, r.round_id, 110.0, answered=True)  # answered: busy, not gone
        coordinator.tick(120.0)
        assert d not in r.session._left
        coordinator.poll_started(d, r.round_id)
        coordinator.poll_ended(d, r.round_id, 120.0, answered=False)
        coordinator.tick(126.0)  # gone for 6 s > 5 s: dropped from the phase
        assert d in r.session._left and d not in r.gone


def test_a_lost_invitation_is_handed_out_again_until_the_device_sends_its_keys(tmp_path: Path) -> None:
    """A check-in whose answer was lost (a timeout, a failover) is repeated: the device gets the same
    invitation while it has sent no keys, and only a device that did send keys and checks in again
    leaves the round."""
    from agg_server.coordinator import RoundCoordinator
    from agg_server.storage import Storage
    from protocol.device_session import DeviceSecAggSession
    from protocol.messages import RoundInvite
    from protocol.samplers import insecure_test_noise_stream

    cfg = small_config(tmp_path / "srv", cohort=3, min_cohort=3, timeout=30.0)
    with Storage(cfg.data_dir) as storage:
        coordinator = RoundCoordinator(cfg, storage, now=0.0)
        devices = [coordinator.register("test", 0.0).device_id for _ in range(3)]
        for d in devices:
            coordinator.check_in(d, 99.5)
        coordinator.tick(100.0)
        r = coordinator.open_round
        assert r is not None
        d = devices[0]
        first = coordinator.check_in(d, 100.1)
        again = coordinator.check_in(d, 100.2)  # the first answer never arrived
        assert isinstance(first, RoundInvite) and again == first
        assert d in r.session.expected() and d not in r.session._left
        keys = DeviceSecAggSession(again, rng=insecure_test_noise_stream(0, d)).send()
        coordinator.submit(d, r.round_id, keys, 100.3)
        late = coordinator.check_in(d, 100.4)  # keys sent, then a check-in: no second invitation
        assert not isinstance(late, RoundInvite) and "already invited" in late.reason
        other = devices[1]
        assert isinstance(coordinator.check_in(other, 100.5), RoundInvite)
        for e in devices[1:]:  # the others send keys: the phase moves on and awaits d's shares
            keys = DeviceSecAggSession(coordinator.check_in(e, 100.6), rng=insecure_test_noise_stream(0, e)).send()
            coordinator.submit(e, r.round_id, keys, 100.7)
        assert r.session.phase is not Phase.ADVERTISE_KEYS and d in r.session.expected()
        coordinator.check_in(d, 100.8)  # a device in the round checks in again: it left
        assert d in r.session._left


def _session(n: int = 4, **kw: Any) -> ServerSecAggSession:
    params = RoundParameters(
        round_id=1, vector_length=8, k=n, t=2, clip_norm=1.0, scale_bits=8, deadlines=(10.0, 20.0, 30.0, 40.0)
    )
    return ServerSecAggSession(params, list(range(1, n + 1)), rng=np.random.default_rng(0), **kw)


def test_a_retransmission_is_recognised_by_the_digest_without_encoding(monkeypatch: pytest.MonkeyPatch) -> None:
    import protocol.server_session as session_module

    def no_encode(message: Any) -> bytes:
        raise AssertionError("the session encoded a message to hash it")

    s = _session()
    msg = PublicKeys(
        round_id=1,
        device_id=1,
        c_public_key=generate_key_pair().public_key,
        s_public_key=generate_key_pair().public_key,
    )
    body = encode(msg)
    monkeypatch.setattr(session_module, "encode", no_encode)
    s.receive(1, msg, digest=hashlib.sha256(body).digest())
    s.receive(1, msg, digest=hashlib.sha256(body).digest())  # idempotent retry
    with pytest.raises(RemoteProtocolError, match="second, different"):
        s.receive(1, msg, digest=hashlib.sha256(body + b"x").digest())


def test_a_deferred_session_finishes_only_when_asked() -> None:
    s = _session(defer_finish=True)
    assert not s.finishing
    with pytest.raises(Exception, match="nothing to finish"):
        s.finish()
    s.abort("test")
    assert s.phase is Phase.ABORTED


def test_a_reconstructed_key_is_parsed_once_for_all_its_peers(monkeypatch: pytest.MonkeyPatch) -> None:
    import protocol.masking as masking_module

    private = generate_key_pair()
    raw = private.private_key.private_bytes_raw()
    peers = {v: generate_key_pair().public_key for v in range(2, 40)}
    calls = {"parse": 0}
    original = masking_module.key_pair_from_private_bytes

    def counting(data: bytes) -> Any:
        calls["parse"] += 1
        return original(data)

    monkeypatch.setattr(masking_module, "key_pair_from_private_bytes", counting)
    monkeypatch.setattr(crypto, "key_pair_from_private_bytes", counting)  # x25519 would re-parse bytes
    keys = pair_mask_keys(raw, peers, b"s" * 32, 1)
    assert calls["parse"] == 1 and len(keys) == len(peers)
    assert keys == pair_mask_keys(private.private_key, peers, b"s" * 32, 1)


def test_a_finishing_session_refuses_uploads() -> None:
    s = _session(defer_finish=True)
    s._finishing = True  # the state UNMASK's close leaves a deferred session in
    with pytest.raises(RoundClosed, match="finishing"):
        s.receive(1, PublicKeys(round_id=1, device_id=1, c_public_key=b"a" * 32, s_public_key=b"b" * 32))
    assert s.outbox(1) is None
    assert s.advance(1e9) is Phase.ADVERTISE_KEYS


@pytest.mark.asyncio
async def test_a_check_in_that_cannot_join_the_open_round_is_held_until_it_ends(
    aiohttp_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import aiohttp

    from protocol.codec import decode
    from protocol.messages import Abort, CheckIn, RegisterRequest, RoundInvite, Wait

    # A held check-in also ends at the hold's limit, and re-checks at each presence check: put both far
    # beyond this test, so that only the round's end can answer it (whatever the machine's load).
    monkeypatch.setattr(app_module, "_CHECKIN_HOLD", 3600.0)
    monkeypatch.setattr(app_module, "_PRESENCE_CHECK", 3600.0)
    cfg = small_config(tmp_path / "srv", cohort=3, min_cohort=3, timeout=30.0)
    app = create_app(cfg)
    client = await aiohttp_client(app)
    headers = {"Content-Type": "application/msgpack"}

    async def post(path: str, message: Any, token: str) -> Any:
        h = dict(headers, Authorization=f"Bearer {token}")
        resp = await client.post(path, data=encode(message), headers=h, timeout=aiohttp.ClientTimeout(total=30))
        return decode(await resp.read())

    tokens = {}
    for _ in range(4):
        resp = await client.post("/v1/devices", data=encode(RegisterRequest(platform="test")), headers=headers)
        reg = decode(await resp.read())
        tokens[reg.device_id] = reg.token
    *cohort, late = sorted(tokens)
    invites: dict[int, RoundInvite] = {}
    while len(invites) < 3:
        for d in cohort:
            if d not in invites:
                msg = await post("/v1/checkin", CheckIn(device_id=d), tokens[d])
                if isinstance(msg, RoundInvite):
                    invites[d] = msg
        await asyncio.sleep(0.05)
    rid = invites[cohort[0]].round_id
    # The fourth device is in no cohort: its check-in stays open while the round runs (no polling) ...
    held = asyncio.create_task(post("/v1/checkin", CheckIn(device_id=late), tokens[late]))
    await asyncio.sleep(1.0)
    assert not held.done()
    # ... and is answered once the round has ended (its devices all leave): woken by the round's end,
    # the only thing left that can answer it (10 s: a guard against hanging; the spread is 1 s).
    for d in cohort:
        await post(f"/v1/rounds/{rid}/abort", Abort(round_id=rid, device_id=d, reason="test"), tokens[d])
    reply = await asyncio.wait_for(held, timeout=10.0)
    assert isinstance(reply, Wait) and app[COORDINATOR].open_round is None
    assert late in app[COORDINATOR]._pool  # checked in again at the round's end: ready for the next one
