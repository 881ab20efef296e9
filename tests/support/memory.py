"""The real `RoundCoordinator` behind the routes of the HTTP API, in memory: device clients talk to it
through `InMemoryTransport` (every message crosses the real codec) without sockets, on a virtual clock.

What the aiohttp app (`agg_server.app`) does per route is done here the same way — register,
authenticate the bearer token, check in, serve the model with its ETag (304 when unchanged), accept an
upload and hold the long-poll until the coordinator has the device's next message — so tests of
`device_sdk.client.DeviceClient` run against the server's own round logic instead of a fake.

Invariants:
- Time is virtual and moves only forward, in two places: `open_round` (past the pool's grace period,
  so the coordinator opens a round with the devices waiting) and a phase whose every expected device
  is `gone` (to that phase's deadline).  A dropout is therefore decided by the devices, never by how
  loaded the machine is, and no test sleeps.
- Errors become the status and `ErrorMessage` the HTTP app would answer with (`agg_server.http_errors.status_for`).
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from dataclasses import dataclass, field

from agg_server.coordinator import RoundCoordinator
from agg_server.http_errors import status_for
from device_sdk.transport import Response
from protocol.codec import decode, encode
from protocol.errors import FedRecError, RemoteProtocolError
from protocol.messages import (
    Abort,
    CheckIn,
    EncryptedShares,
    ErrorMessage,
    MaskedInput,
    Message,
    PublicKeys,
    RegisterRequest,
    RevocationListPayload,
    RoundInvite,
    RoundResult,
    UnmaskResponse,
    Wait,
)
from protocol.session import ACTIVE_PHASES, Phase

__all__ = ["InMemoryServer", "InMemoryTransport"]

_PHASE_ROUTE = re.compile(r"^/v1/rounds/(\d+)/(keys|shares|masked|unmask|abort)$")
_EXPECTED: dict[str, type[Message]] = {
    "keys": PublicKeys,
    "shares": EncryptedShares,
    "masked": MaskedInput,
    "unmask": UnmaskResponse,
    "abort": Abort,
}


@dataclass
class InMemoryServer:
    """One coordinator and its virtual clock, shared by the `InMemoryTransport` of every device.

    Attributes
    ----------
    coordinator : the server's round logic (built with ``defer_finish=False``: a round commits inside the
        call that closed UNMASK).
    now : the virtual clock, in seconds on the coordinator's time line.
    gone : devices whose `DeviceClient.run_round` returned: whatever they did not send, they never will.
    model_requests : the ``If-None-Match`` of every model download, in order.
    checkins : every check-in received, in order.
    invites : the last invitation each device received.
    registrations : how many devices registered.
    """

    coordinator: RoundCoordinator
    now: float = 0.0
    gone: set[int] = field(default_factory=set)
    model_requests: list[str | None] = field(default_factory=list)
    checkins: list[CheckIn] = field(default_factory=list)
    invites: dict[int, RoundInvite] = field(default_factory=dict)
    registrations: int = 0

    def __post_init__(self) -> None:
        self._changed = asyncio.Condition()

    def transport(self) -> InMemoryTransport:
        """A new device connection."""
        return InMemoryTransport(self)

    async def open_round(self) -> int:
        """Move the clock past the pool's grace period and let the coordinator open a round with the
        devices waiting (they checked in once and got `Wait`); returns its id."""
        cfg = self.coordinator.config.rounds
        self.now += cfg.round_interval  # past the next opening time (a full cohort opens at once)
        self.gone = set()
        async with self._changed:
            self.coordinator.tick(self.now)
            self._changed.notify_all()
        r = self.coordinator.open_round
        if r is None:
            raise RuntimeError("no round opened: not enough devices are waiting")
        return r.round_id

    async def mark_gone(self, device_id: int) -> None:
        """``device_id``'s run_round returned; a phase that now waits only for gone devices closes (the
        clock moves to its deadline)."""
        async with self._changed:
            self.gone.add(device_id)
            self._settle()
            self._changed.notify_all()

    def _settle(self) -> None:
        while (r := self.coordinator.open_round) is not None and r.session.phase in ACTIVE_PHASES:
            if r.session.expected() - self.gone:
                return
            deadline = r.session.params.deadlines[ACTIVE_PHASES.index(r.session.phase)]
            self.now = max(self.now, deadline)
            self.coordinator.tick(self.now)

    async def handle(
        self, method: str, path: str, message: Message | None, token: str | None, if_none_match: str | None
    ) -> tuple[int, Message | None, dict[str, str]]:
        """One request, answered as `agg_server.app` answers it: (status, message or None, headers)."""
        try:
            return await self._route(method, path, message, token, if_none_match)
        except FedRecError as exc:
            return status_for(exc), ErrorMessage.from_exception(exc), {}

    async def _route(
        self, method: str, path: str, message: Message | None, token: str | None, if_none_match: str | None
    ) -> tuple[int, Message | None, dict[str, str]]:
        coordinator = self.coordinator
        if (method, path) == ("POST", "/v1/devices"):
            if not isinstance(message, RegisterRequest):
                raise RemoteProtocolError(f"expected RegisterRequest, got {type(message).__name__}")
            self.registrations += 1
            return 201, coordinator.register(message.platform, self.now), {}
        if (method, path) == ("GET", "/v1/enrollment/revocations"):
            data, etag = coordinator.enrollment.signed_revocation_list()
            if etag and if_none_match == etag:
                return 304, None, {"ETag": etag}
            return 200, RevocationListPayload(data=data), ({"ETag": etag} if etag else {})
        device = coordinator.authenticate(token)
        if (method, path) == ("POST", "/v1/checkin"):
            if not isinstance(message, CheckIn):
                raise RemoteProtocolError(f"expected CheckIn, got {type(message).__name__}")
            coordinator.check_sender(device, message)
            self.checkins.append(message)
            async with self._changed:
                reply = coordinator.check_in(device, self.now)
                self._changed.notify_all()
            if isinstance(reply, RoundInvite):
                self.invites[device] = reply
            headers = {"Retry-After": str(max(1, round(reply.retry_after)))} if isinstance(reply, Wait) else {}
            return 200, reply, headers
        if (method, path) == ("GET", "/v1/model"):
            self.model_requests.append(if_none_match)
            etag = coordinator.model_etag
            if if_none_match == etag:
                return 304, None, {"ETag": etag}
            return 200, decode(coordinator.model_bytes), {"ETag": etag}
        route = _PHASE_ROUTE.match(path)
        if method != "POST" or route is None:
            raise RemoteProtocolError(f"no route {method} {path}")
        round_id, name = int(route.group(1)), route.group(2)
        if not isinstance(message, _EXPECTED[name]):
            raise RemoteProtocolError(
                f"expected {_EXPECTED[name].__name__} on this route, got {type(message).__name__}"
            )
        return 200, await self._upload(device, round_id, message), {}

    async def _upload(self, device: int, round_id: int, message: Message) -> Message:
        coordinator = self.coordinator
        async with self._changed:
            try:
                after: Phase = coordinator.submit(
                    device, round_id, message, self.now, digest=hashlib.sha256(encode(message)).digest()
                )
            finally:
                self._settle()
                self._changed.notify_all()
            if isinstance(message, Abort):
                return RoundResult(
                    round_id=round_id, committed=False, model_version=coordinator.model_version, reason="left the round"
                )
            answered = False
            coordinator.poll_started(device, round_id)
            try:
                while (reply := coordinator.reply(device, round_id, after)) is None:
                    await self._changed.wait()
                answered = True
                return reply
            finally:
                coordinator.poll_ended(device, round_id, self.now, answered=answered)


@dataclass
class InMemoryTransport:
    """One device's connection to an `InMemoryServer` (a `device_sdk.transport.Transport`); every
    message is encoded and decoded by the real codec, and its bytes are counted."""

    server: InMemoryServer
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
        if self.closed:
            raise RuntimeError("the transport is closed")
        up = encode(message) if message is not None else b""
        status, answer, headers = await self.server.handle(
            method, path, decode(up) if message is not None else None, token, if_none_match
        )
        down = encode(answer) if answer is not None else b""
        return Response(
            status=status,
            message=decode(down) if answer is not None else None,
            etag=headers.get("ETag"),
            retry_after=float(headers["Retry-After"]) if "Retry-After" in headers else None,
            bytes_up=len(up),
            bytes_down=len(down),
        )

    async def close(self) -> None:
        self.closed = True
