"""DeviceClient against an in-memory server: a real `ServerSecAggSession` behind a fake `Transport`.

The client's rounds against the real coordinator (the exact secure sum and each update against the
in-process reference, every dropout, the ETag of the next download) are in
test_device_client_coordinator.py; what stays here needs a server that
misbehaves on purpose (failing routes, wrong invites, stale models) or controls the session directly.

The fake speaks the HTTP API's semantics (docs/http-api.md) through the real codec, without sockets.
Its phase "deadline" passes when every device still expected in a phase has either answered or
finished its `run_round` call (`FakeServer.mark_gone`), so dropouts are deterministic and no test sleeps.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

import device_sdk.participation as participation_module
from device_sdk.client import (
    MODEL_FILE,
    ClientConfig,
    DeviceClient,
    RoundOutcome,
    RoundStatus,
    insecure_seeded_rngs,
)
from device_sdk.models import LightFRModel
from device_sdk.transport import Response
from fedsim.fleets.faults import DropoutAt, FaultyTransport
from protocol.codec import decode, encode
from protocol.codes import pack_signs, random_signs, to_bytes
from protocol.errors import (
    AuthError,
    FedRecError,
    RemoteProtocolError,
    RoundClosed,
    RoundError,
    StorageError,
)
from protocol.messages import (
    Abort,
    CheckIn,
    EncryptedShares,
    ErrorMessage,
    MaskedInput,
    Message,
    ModelPayload,
    PublicKeys,
    RegisterRequest,
    RegisterResponse,
    RoundInvite,
    RoundResult,
    UnmaskResponse,
    Wait,
)
from protocol.noise import to_ring
from protocol.plan import LightFRParams
from protocol.policy import PrivacyPolicy
from protocol.samplers import NoiseStream
from protocol.session import ACTIVE_PHASES, DeviceSecAggSession, Phase, RoundParameters, ServerSecAggSession

N_ITEMS = 24
BITS = 8
SEED = 7
_PHASE_OF = {"keys": Phase.ADVERTISE_KEYS, "shares": Phase.SHARE_KEYS, "masked": Phase.MASKED_INPUT}
_PHASE_OF["unmask"] = Phase.UNMASK
_MESSAGE_OF: dict[str, type[Message]] = {
    "keys": PublicKeys,
    "shares": EncryptedShares,
    "masked": MaskedInput,
    "unmask": UnmaskResponse,
}


def _status(exc: FedRecError) -> int:
    if isinstance(exc, AuthError):
        return 401
    if isinstance(exc, RoundError):
        return 409
    return 400


@dataclass
class FakeServer:
    """Registration, check-in, model download and the four SecAgg+ long-polls, in memory."""

    k: int = 5
    t: int = 3
    dp_mu: float = 50.0
    dp_t_min: int = 3
    waits_before_invite: int = 0
    wait_seconds: float = 0.01
    model_version: int = 3
    fail: dict[str, FedRecError] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    registrations: int = 0
    model_requests: list[str | None] = field(default_factory=list)
    checkins: list[CheckIn] = field(default_factory=list)
    gone: set[int] = field(default_factory=set)
    session: ServerSecAggSession | None = None
    invites: dict[int, RoundInvite] = field(default_factory=dict)
    result_total: NDArray[np.uint32] | None = None
    result_survivors: frozenset[int] = frozenset()
    round_id: int = 0
    _checkins_seen: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(99)
        self.codes = random_signs(N_ITEMS, BITS, self.rng)
        self.cond = asyncio.Condition()

    # -- test controls --------------------------------------------------------------------------------

    @property
    def etag(self) -> str:
        digest = hashlib.sha256(to_bytes(pack_signs(self.codes))).hexdigest()[:16]
        return f'"{self.model_version}-{digest}"'

    def open_round(self, ids: Sequence[int]) -> None:
        self.round_id += 1
        params = RoundParameters(
            round_id=self.round_id,
            vector_length=N_ITEMS * BITS,
            k=self.k,
            t=self.t,
            clip_norm=4.0,
            scale_bits=12,
            dp_mu=self.dp_mu,
            dp_t_min=self.dp_t_min,
            deadlines=(1.0, 2.0, 3.0, 4.0),
        )
        self.session = ServerSecAggSession(params, ids, rng=np.random.default_rng(self.round_id))
        self.invites = {
            u: replace(
                params.invite(u),
                model_version=self.model_version,
                bits=BITS,
                n_items=N_ITEMS,
                params=LightFRParams(negatives=2, max_sweeps=5, unobserved_weight=0.0),
            )
            for u in ids
        }
        self.gone = set()
        self.result_total = None

    async def mark_gone(self, device_id: int) -> None:
        """The device's run_round returned: whatever it did not send, it will never send."""
        async with self.cond:
            self.gone.add(device_id)
            self._advance()
            self.cond.notify_all()

    def _advance(self) -> None:
        sess = self.session
        while sess is not None and sess.phase in ACTIVE_PHASES:
            if sess.expected() - self.gone:
                break
            sess.advance(sess.params.deadlines[ACTIVE_PHASES.index(sess.phase)])
        if sess is not None and sess.phase is Phase.DONE and self.result_total is None:
            result = sess.result()
            self.result_total, self.result_survivors = result.total, result.survivors
            self.model_version += 1
            self.codes = random_signs(N_ITEMS, BITS, self.rng)

    # -- request handling -----------------------------------------------------------------------------

    async def handle(
        self, method: str, path: str, message: Message | None, token: str | None, if_none_match: str | None
    ) -> tuple[int, Message | None, dict[str, str]]:
        try:
            return await self._route(method, path, message, token, if_none_match)
        except FedRecError as exc:
            return _status(exc), ErrorMessage.from_exception(exc), {}

    async def _route(
        self, method: str, path: str, message: Message | None, token: str | None, if_none_match: str | None
    ) -> tuple[int, Message | None, dict[str, str]]:
        if (method, path) == ("POST", "/v1/devices"):
            if not isinstance(message, RegisterRequest):
                raise RemoteProtocolError("expected RegisterRequest")
            device_id = 100 + self.registrations
            self.registrations += 1
            tok = f"token-{device_id:04d}-abcdefghijkl"
            self.tokens[tok] = device_id
            return 201, RegisterResponse(device_id=device_id, token=tok), {}
        if token not in self.tokens:
            raise AuthError("unknown token")
        device = self.tokens[token]
        if (method, path) == ("POST", "/v1/checkin"):
            if not isinstance(message, CheckIn) or message.device_id != device:
                raise RemoteProtocolError("bad check-in")
            self.checkins.append(message)
            seen = self._checkins_seen.get(device, 0)
            self._checkins_seen[device] = seen + 1
            sess = self.session
            if seen < self.waits_before_invite or sess is None or sess.phase is not Phase.ADVERTISE_KEYS:
                wait = Wait(retry_after=self.wait_seconds, reason="no round open")
                return 200, wait, {"Retry-After": "1"}
            return 200, self.invites[device], {}
        if (method, path) == ("GET", "/v1/model"):
            self.model_requests.append(if_none_match)
            if "model" in self.fail:
                raise self.fail["model"]
            if if_none_match == self.etag:
                return 304, None, {"ETag": self.etag}
            payload = ModelPayload(
                model_version=self.model_version,
                bits=BITS,
                n_items=N_ITEMS,
                words=to_bytes(pack_signs(self.codes)),
            )
            return 200, payload, {"ETag": self.etag}
        parts = path.split("/")
        if method == "POST" and len(parts) == 5 and parts[:3] == ["", "v1", "rounds"]:
            return await self._phase(device, int(parts[3]), parts[4], message)
        raise RemoteProtocolError(f"no route {method} {path}")

    async def _phase(
        self, device: int, round_id: int, name: str, message: Message | None
    ) -> tuple[int, Message | None, dict[str, str]]:
        sess = self.session
        if sess is None or round_id != self.round_id:
            raise RoundClosed(f"round {round_id} is not open")
        if name in self.fail:
            raise self.fail[name]
        async with self.cond:
            if name == "abort":
                if not isinstance(message, Abort):
                    raise RemoteProtocolError("expected Abort")
                if sess.phase in ACTIVE_PHASES:
                    sess.receive(device, message)
                self._advance()
                self.cond.notify_all()
                return (
                    200,
                    RoundResult(round_id=round_id, committed=False, model_version=self.model_version),
                    {},
                )
            if not isinstance(message, _MESSAGE_OF[name]):
                raise RemoteProtocolError(f"{name} expects {_MESSAGE_OF[name].__name__}")
            phase = _PHASE_OF[name]
            sess.receive(device, message)
            self._advance()
            self.cond.notify_all()
            await self.cond.wait_for(lambda: sess.phase is not phase)
            if sess.phase is Phase.ABORTED:
                reason = str(sess.abort_error)
                return (
                    200,
                    RoundResult(round_id=round_id, committed=False, model_version=self.model_version, reason=reason),
                    {},
                )
            if sess.phase is Phase.DONE:
                return (
                    200,
                    RoundResult(round_id=round_id, committed=True, model_version=self.model_version),
                    {},
                )
            out = sess.outbox(device)
            if out is None or isinstance(out, Abort):
                raise RoundClosed(f"device {device} was dropped from round {round_id}")
            return 200, out, {}


@dataclass
class FakeTransport:
    """One device's connection to the fake server, through the real codec (bytes counted)."""

    server: FakeServer
    closed: bool = False

    async def request(
        self,
        method: str,
        path: str,
        message: Message | None = None,
        *,
        token: str | None = None,
        if_none_match: str | None = None,
        timeout: float = 30.0,
    ) -> Response:
        up = encode(message) if message is not None else b""
        incoming = decode(up) if message is not None else None
        status, answer, headers = await self.server.handle(method, path, incoming, token, if_none_match)
        down = encode(answer) if answer is not None else b""
        retry_after = float(headers["Retry-After"]) if "Retry-After" in headers else None
        return Response(
            status=status,
            message=decode(down) if answer is not None else None,
            etag=headers.get("ETag"),
            retry_after=retry_after,
            bytes_up=len(up),
            bytes_down=len(down),
        )

    async def close(self) -> None:
        self.closed = True


# -- helpers ------------------------------------------------------------------------------------------


@dataclass
class Device:
    client: DeviceClient
    items: NDArray[np.int64]
    ratings: NDArray[np.float64]
    #: where the device leaves its next round (fault injection by `fedsim.fleets.faults.FaultyTransport`)
    leaves: list[DropoutAt] = field(default_factory=lambda: [DropoutAt.NONE])


def _data(index: int) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
    rng = np.random.default_rng(1000 + index)
    items = np.sort(rng.choice(N_ITEMS, 7, replace=False)).astype(np.int64)
    return items, rng.integers(1, 6, size=7).astype(np.float64)


def make_device(server: FakeServer, store: Path, index: int) -> Device:
    items, ratings = _data(index)
    box: list[DeviceClient] = []

    def rngs(round_id: int) -> tuple[np.random.Generator, np.random.Generator]:
        device_id = box[0].device_id
        assert device_id is not None
        return insecure_seeded_rngs(SEED, round_id, device_id)

    leaves = [DropoutAt.NONE]
    client = DeviceClient(
        FaultyTransport(FakeTransport(server), lambda _round_id: leaves[0], disconnect_after=0.02),
        ClientConfig(store_dir=store, privacy=PrivacyPolicy.no_floor()),
        items=items,
        ratings=ratings,
        n_items=N_ITEMS,
        bits=BITS,
        rng_for_round=rngs,
    )
    box.append(client)
    return Device(client, items, ratings, leaves)


class RecordingSession(DeviceSecAggSession):
    """The real device session, remembering the quantized input it was given."""

    created: list[RecordingSession] = []

    def __init__(self, invite: RoundInvite, *, rng: NoiseStream, **kwargs: Any) -> None:
        super().__init__(invite, rng=rng, **kwargs)
        self.recorded: NDArray[np.uint32] | None = None
        RecordingSession.created.append(self)

    def provide_input(self, x: NDArray[np.uint32]) -> None:
        self.recorded = x.copy()
        super().provide_input(x)


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> list[RecordingSession]:
    created: list[RecordingSession] = []
    monkeypatch.setattr(RecordingSession, "created", created)
    monkeypatch.setattr(participation_module, "DeviceSecAggSession", RecordingSession)
    return created


async def run_cohort(
    server: FakeServer, devices: Sequence[Device], dropouts: dict[int, DropoutAt] | None = None
) -> list[RoundOutcome]:
    dropouts = dropouts or {}

    async def drive(index: int, device: Device) -> RoundOutcome:
        try:
            device.leaves[0] = dropouts.get(index, DropoutAt.NONE)
            return await device.client.run_round()
        finally:
            device_id = device.client.device_id
            if device_id is not None:
                await server.mark_gone(device_id)

    return list(await asyncio.gather(*(drive(i, d) for i, d in enumerate(devices))))


async def cohort(server: FakeServer, tmp_path: Path, n: int) -> list[Device]:
    devices = [make_device(server, tmp_path / f"device{i}", i) for i in range(n)]
    for d in devices:
        await d.client.register()
    server.open_round([d.client.device_id for d in devices if d.client.device_id is not None])
    return devices


def expected_sum(sessions: Sequence[RecordingSession], survivors: frozenset[int]) -> NDArray[np.uint32]:
    total = np.zeros(N_ITEMS * BITS, dtype=np.uint64)
    for s in sessions:
        if s.device_id in survivors:
            assert s.recorded is not None
            total += s.recorded.astype(np.uint64) + to_ring(s.kept_noise()).astype(np.uint64)
    return (total % (1 << 32)).astype(np.uint32)


# -- tests --------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_too_few_survivors_aborts_with_the_reason(tmp_path: Path) -> None:
    server = FakeServer(k=3, t=3, dp_mu=0.0, dp_t_min=0)
    devices = await cohort(server, tmp_path, 3)
    outcomes = await run_cohort(server, devices, {0: DropoutAt.BEFORE_KEYS})
    assert outcomes[0].status is RoundStatus.DROPPED
    for o in outcomes[1:]:
        assert o.status is RoundStatus.ABORTED and o.round_id == 1
        assert "threshold" in o.reason
        assert o.model_version == 3


@pytest.mark.asyncio
async def test_round_closed_error_is_an_aborted_outcome(tmp_path: Path) -> None:
    server = FakeServer(k=3, t=2, dp_mu=0.0, dp_t_min=0, fail={"shares": RoundClosed("SHARE_KEYS closed")})
    devices = await cohort(server, tmp_path, 3)
    outcomes = await run_cohort(server, devices)
    assert [o.status for o in outcomes] == [RoundStatus.ABORTED] * 3
    assert all("SHARE_KEYS closed" in o.reason for o in outcomes)


@pytest.mark.asyncio
async def test_wait_and_run_loop(tmp_path: Path) -> None:
    server = FakeServer(k=3, t=2, waits_before_invite=1, wait_seconds=0.01)
    devices = await cohort(server, tmp_path, 3)
    results = await asyncio.gather(*(d.client.run(rounds=1) for d in devices))
    for outcomes in results:
        assert [o.status for o in outcomes] == [RoundStatus.WAITED, RoundStatus.COMMITTED]
        assert outcomes[0].retry_after == pytest.approx(0.01) and outcomes[0].round_id is None


@pytest.mark.asyncio
async def test_model_download_uses_the_stored_etag(tmp_path: Path) -> None:
    server = FakeServer(k=3, t=2, dp_mu=0.0, dp_t_min=0)
    devices = await cohort(server, tmp_path, 3)
    first_etag = server.etag
    await run_cohort(server, devices)
    assert server.model_requests == [None] * 3
    # The first contact fetched version 3 before the first check-in; the round of version 3 fetched nothing.
    assert [c.model_version for c in server.checkins] == [3, 3, 3]
    v4_codes, v4_etag = server.codes.copy(), server.etag

    # Round 2 trains the newly committed version 4: each device asks for it with its stored tag.
    server.open_round([d.client.device_id for d in devices if d.client.device_id is not None])
    outcomes = await run_cohort(server, devices)
    assert [o.status for o in outcomes] == [RoundStatus.COMMITTED] * 3
    assert server.model_requests[3:] == [first_etag] * 3
    assert [c.model_version for c in server.checkins[3:]] == [3, 3, 3]
    assert all(d.client.model.model_version == 4 for d in devices)

    # Round 3 claims to train version 9 while the server serves what the device holds (304): stale.
    server.model_version, server.codes = 4, v4_codes
    server.open_round([d.client.device_id for d in devices if d.client.device_id is not None])
    for u in server.invites:
        server.invites[u] = replace(server.invites[u], model_version=9)
    outcome = await devices[0].client.run_round()
    assert outcome.status is RoundStatus.ABORTED and "model 9" in outcome.reason
    assert server.model_requests[-1] == v4_etag
    assert server.session is not None and devices[0].client.device_id is not None
    assert isinstance(server.session.outbox(devices[0].client.device_id), Abort)  # it told the server


@pytest.mark.asyncio
async def test_a_round_error_at_the_first_model_fetch_ends_the_call_as_a_check_in_error_would(tmp_path: Path) -> None:
    # The answer of a server none of whose instances leads the device's cohort now (503 round_error, after
    # the transport's retries): the call ends "aborted" before any check-in, and the next call fetches again.
    server = FakeServer(k=3, t=2, fail={"model": RoundError("no instance leads cohort 0 now")})
    device = make_device(server, tmp_path / "d", 0)
    outcome = await device.client.run_round()
    assert outcome.status is RoundStatus.ABORTED and outcome.round_id is None
    assert "no instance leads cohort 0" in outcome.reason and server.checkins == []
    assert not (tmp_path / "d" / MODEL_FILE).exists()
    del server.fail["model"]
    assert (await device.client.run_round()).status is RoundStatus.WAITED
    assert server.model_requests == [None, None] and len(server.checkins) == 1
    assert device.client.model.model_version == server.model_version


def test_corrupt_model_store_starts_fresh(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = tmp_path / "d"
    store.mkdir()
    (store / MODEL_FILE).write_bytes(b"\x93not a store file")
    with caplog.at_level(logging.WARNING, logger="device_sdk.client"):
        device = make_device(FakeServer(), store, 0)
    assert "corrupt" in caplog.text
    assert (store / f"{MODEL_FILE}.corrupt-1").is_file()
    assert not (store / MODEL_FILE).exists()
    assert device.client.model.model_version == 0 and device.client.model.n_items == N_ITEMS


def test_store_of_another_shape_is_refused(tmp_path: Path) -> None:
    store = tmp_path / "d"
    store.mkdir()
    LightFRModel(N_ITEMS + 1).save(store / MODEL_FILE)
    with pytest.raises(FedRecError, match="configured for"):
        make_device(FakeServer(), store, 0)


@pytest.mark.asyncio
async def test_restart_between_training_and_masked_input(tmp_path: Path) -> None:
    server = FakeServer(k=3, t=2, dp_mu=0.0, dp_t_min=0)
    devices = await cohort(server, tmp_path, 3)
    outcomes = await run_cohort(server, devices, {0: DropoutAt.BEFORE_MASKED})
    assert outcomes[0].status is RoundStatus.DROPPED
    assert [o.status for o in outcomes[1:]] == [RoundStatus.COMMITTED] * 2

    # "Restart the app": a new client on the same store finds the trained model and its identity.
    old = devices[0].client
    restarted = make_device(server, tmp_path / "device0", 0).client
    assert restarted.device_id == old.device_id
    assert restarted.model.model_version == 3
    np.testing.assert_array_equal(restarted.model.user_codes, old.model.user_codes)
    np.testing.assert_array_equal(restarted.model.item_codes, old.model.item_codes)
    assert restarted.model.user_trained.all()


@pytest.mark.asyncio
async def test_failed_save_after_training_keeps_the_old_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = FakeServer(k=3, t=2, dp_mu=0.0, dp_t_min=0)
    devices = await cohort(server, tmp_path, 3)
    await run_cohort(server, devices)
    store = tmp_path / "device0"
    saved = (store / MODEL_FILE).read_bytes()

    def disk_full(fh: object, chunk: bytes) -> None:
        raise OSError(28, "No space left on device")

    server.open_round([d.client.device_id for d in devices if d.client.device_id is not None])
    monkeypatch.setattr("device_sdk.store._write_chunk", disk_full)
    with pytest.raises(StorageError, match="No space left"):
        await devices[0].client.run_round()
    monkeypatch.undo()
    # The device told the server it left; the old file is intact and loadable.
    assert server.session is not None and server.session.phase is Phase.ADVERTISE_KEYS
    assert (store / MODEL_FILE).read_bytes() == saved
    assert sorted(p.name for p in store.iterdir() if p.name.startswith(".")) == []
    restarted = make_device(server, store, 0).client
    assert restarted.model.model_version == 3


def test_seeded_rngs_are_reproducible_and_distinct() -> None:
    a_train, a_noise = insecure_seeded_rngs(1, 2, 3)
    b_train, b_noise = insecure_seeded_rngs(1, 2, 3)
    assert a_train.integers(0, 2**63) == b_train.integers(0, 2**63)
    assert np.array_equal(a_noise.uint64(4), b_noise.uint64(4))
    c_train, c_noise = insecure_seeded_rngs(1, 2, 3)
    assert isinstance(c_noise, NoiseStream)  # DP noise always from a keystream, never a numpy generator
    assert not np.array_equal(insecure_seeded_rngs(1, 2, 4)[1].uint64(4), c_noise.uint64(4))
    assert insecure_seeded_rngs(1, 3, 3)[0].integers(0, 2**63) != insecure_seeded_rngs(1, 2, 3)[0].integers(0, 2**63)
    with pytest.raises(ValueError):
        insecure_seeded_rngs(-1, 0, 0)


def test_client_config_validates(tmp_path: Path) -> None:
    with pytest.raises(FedRecError):
        ClientConfig(store_dir=tmp_path, long_poll_timeout=0.0)
    assert isinstance(ClientConfig(store_dir=str(tmp_path)).store_dir, Path)  # type: ignore[arg-type]


def test_import_device_sdk_does_not_import_aiohttp() -> None:
    code = (
        "import sys, device_sdk, device_sdk.client, device_sdk.transport\n"
        "assert 'aiohttp' not in sys.modules, sorted(m for m in sys.modules if 'aiohttp' in m)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


@pytest.mark.asyncio
async def test_cancelled_round_drops_the_session_secrets(tmp_path: Path, recording: list[RecordingSession]) -> None:
    server = FakeServer(k=3, t=2, dp_mu=0.0, dp_t_min=0)
    devices = await cohort(server, tmp_path, 3)
    task = asyncio.ensure_future(devices[0].client.run_round())  # the others never answer: it long-polls
    while not recording or recording[0].phase is Phase.ADVERTISE_KEYS:
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert recording[0].phase is Phase.ABORTED


@pytest.mark.asyncio
async def test_a_device_below_its_privacy_floor_sits_the_round_out(tmp_path: Path) -> None:
    import dataclasses

    server = FakeServer()
    devices = await cohort(server, tmp_path, 4)
    strict = devices[0].client
    strict.config = dataclasses.replace(strict.config, privacy=PrivacyPolicy())  # the default of a real device
    before = strict.model.user_codes.copy()
    outcomes = await run_cohort(server, devices)
    assert outcomes[0].status is RoundStatus.REFUSED and outcomes[0].status == "refused"
    # this fake server states no cohort size: the floor fails closed
    assert "cohort size" in outcomes[0].reason or "floor" in outcomes[0].reason
    np.testing.assert_array_equal(strict.model.user_codes, before)  # it did not even train
    assert strict.privacy_spent == 0.0
    assert all(o.status is not RoundStatus.REFUSED for o in outcomes[1:])


def test_a_corrupt_privacy_ledger_is_never_reset(tmp_path: Path) -> None:
    from device_sdk.persistence import LEDGER_FILE, load_ledger, save_ledger
    from protocol.errors import StorageError
    from protocol.policy import DeviceLedger

    ledger = DeviceLedger()
    save_ledger(tmp_path, ledger)
    assert load_ledger(tmp_path).rounds == 0
    path = tmp_path / LEDGER_FILE
    path.write_bytes(path.read_bytes()[:-3])  # truncated: the checksum fails
    with pytest.raises(StorageError):
        load_ledger(tmp_path)  # never an empty ledger (that would hand the device a fresh ε budget)
    assert any(p.name.startswith(LEDGER_FILE) for p in tmp_path.iterdir())  # moved aside, not deleted
