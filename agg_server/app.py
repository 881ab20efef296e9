"""The aiohttp application: routes, the error middleware, long-polls and the round ticker.

Invariants:
- `create_app(config)` is the only factory; state lives under typed `web.AppKey`s; the storage and
  coordinator are created in `cleanup_ctx` (on start-up, not at import or construction time) and
  closed there on shutdown, after the ticker has stopped.
- Handlers stay short: read bytes, decode, call the coordinator, encode, respond.  All decisions are
  the coordinator's.
- Every error leaves as an encoded `ErrorMessage` with the status the one middleware assigns
  (`agg_server.http_errors`).
- Long-polls wake only when what they wait for moved: the round's phase, the round itself or the model
  version (`_fingerprint`); an upload that leaves the phase open wakes no one.
- The end of a round (mask removal, aggregation, encoding) runs in a worker thread while the event
  loop keeps answering; status and health report the round as "finishing" meanwhile.  Threads suffice
  (measured in docs/architecture.md): the work is numpy and OpenSSL calls plus short Python loops,
  so the loop gets the interpreter at every switch interval, and one round finishes at a time.
- A check-in that cannot join the open round is held until that round ends (at most `_CHECKIN_HOLD`
  seconds), so waiting devices do not poll while a round runs.
- A phase request whose connection closes before its answer (its body still arriving, or waiting) tells
  the coordinator, which drops that device after ``rounds.disconnect_grace`` seconds (the server runs
  with ``handler_cancellation``, so a closed connection cancels its handler; without it a waiter notices
  within `_PRESENCE_CHECK` seconds).
- The enrollment authority's revocation list is kept current by a background task
  (`_revocation_refresher`, every `agg_server.enrollment.REFRESH_PERIOD` s) that reads and verifies a new
  list in a worker thread; requests only read the list in force (no filesystem I/O, no signature check).
- Nothing blocks the event loop on the database: every call into the coordinators, the lease keeper,
  the enrollment state and the storage runs on one "state" thread (`_STATE`, `_on_state`, `_act`), one
  call at a time, as they ran on the loop before; the loop only moves bytes and answers `/v1/health`
  from memory.  `/v1/ready` (readiness) answers 503 while the database is unreachable, a call to it
  has been in flight longer than `READY_STALL` seconds, or a held cohort lease could not be renewed.
- The instance runs ``storage.cohorts_per_instance`` coordinators, one per cohort lease it holds
  (`agg_server.cluster`); a device's requests go to the coordinator of its cohort, or are forwarded to
  the instance that leads it.  ``app[COORDINATOR]`` is the first one (the dashboard's).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import hashlib
import json
import logging
import math
import random
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from agg_server import dashboard
from agg_server.cluster import FORWARDED_HEADER, LeaseKeeper
from agg_server.commit import FinishJob
from agg_server.config import ServerConfig
from agg_server.coordinator import RoundCoordinator
from agg_server.enrollment import REFRESH_PERIOD
from agg_server.http_errors import MSGPACK, BodyTimeout, error_middleware
from agg_server.logs import current_request_id
from agg_server.storage import Storage, Timeouts
from agg_server.strategy.base import Strategy
from protocol.codec import MAX_OBJECTS, decode_versioned, encode
from protocol.errors import (
    FedRecError,
    PayloadTooLarge,
    RemoteProtocolError,
    RoundError,
    VersionMismatch,
)
from protocol.messages import (
    Abort,
    CheckIn,
    ConsistencySignature,
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
from protocol.spec import DP_COLLUDERS_SINCE

__all__ = ["create_app", "CONFIG", "COORDINATOR", "MSGPACK"]

log = logging.getLogger("agg_server.app")

TICK_SECONDS = 0.05
_CHECKIN_HOLD = 15.0  # seconds a check-in that cannot join the open round is held (devices wait 30 s)
_CHECKIN_SPREAD = 1.0  # seconds over which the check-ins held until a round's end are answered
_PRESENCE_CHECK = 5.0  # seconds between a waiting long-poll's checks that its connection is still open
_FINISH_WAIT = 300.0  # seconds a graceful shutdown waits for a finishing round to commit
READY_STALL = 2.0
"""Seconds a database call may be in flight before `/v1/ready` answers 503 (a lock or a stalled server)."""
_T = TypeVar("_T")


class _Changes:
    """Wakes every waiter when the coordinator's state moved (an asyncio 'broadcast'); callers notify
    only when `_fingerprint` changed."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout)


CONFIG = web.AppKey("config", ServerConfig)
COORDINATOR = web.AppKey("coordinator", RoundCoordinator)
_STORAGE = web.AppKey("storage", Storage)
_CHANGES = web.AppKey("changes", _Changes)
Clock = Callable[[], float]
_CLOCK: web.AppKey[Clock] = web.AppKey("clock")
_STRATEGY: web.AppKey[Strategy | None] = web.AppKey("strategy")
_EXECUTOR = web.AppKey("finish_executor", ThreadPoolExecutor)
_FINISHING: web.AppKey[dict[int, asyncio.Task[None]]] = web.AppKey("finishing")
_SLOTS: web.AppKey[list[RoundCoordinator]] = web.AppKey("slots")
#: The encoded `RevocationListPayload` of the list in force, under its ETag (encoded once per list).
_CRL_BODY: web.AppKey[dict[str, bytes]] = web.AppKey("crl_body")
_KEEPER = web.AppKey("lease_keeper", LeaseKeeper)
#: One worker thread that reads and verifies revocation lists (`_revocation_refresher`, uploads).
_CRL_EXECUTOR = web.AppKey("crl_executor", ThreadPoolExecutor)
_PROXY = web.AppKey("proxy_session", aiohttp.ClientSession)
#: The one thread every coordinator, lease keeper, enrollment and storage call runs on.
_STATE = web.AppKey("state_executor", ThreadPoolExecutor)


async def _on_state(app: web.Application, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``fn(*args, **kwargs)`` on the state thread (off the event loop), in a copy of the caller's context
    (its log records keep the request id)."""
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(app[_STATE], call)


async def _act(app: web.Application, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """`_on_state` for a call that may move what long-polls wait for: they are woken when it did (also
    when the awaiting handler was cancelled meanwhile)."""
    loop = asyncio.get_running_loop()

    def run() -> _T:
        before = _fingerprint(app)
        try:
            return fn(*args, **kwargs)
        finally:
            if _fingerprint(app) != before:
                loop.call_soon_threadsafe(app[_CHANGES].notify)

    return await loop.run_in_executor(app[_STATE], contextvars.copy_context().run, run)


# -- helpers --------------------------------------------------------------------------------------


#: Body limit of every route that carries no vector (register, check-in, keys, abort): a few kB suffice.
SMALL_BODY_BYTES = 64 * 1024


def body_limit(
    request: web.Request, expected: type[Message] | None = None, coordinator: RoundCoordinator | None = None
) -> int:
    """The largest body a route accepts (docs/threat-model.md §3.5): sized from the open round for the routes
    that carry a ring vector or k ciphertexts, `SMALL_BODY_BYTES` for every other route, and never more
    than ``listen.max_body_bytes``."""
    cap = request.app[CONFIG].listen.max_body_bytes
    if expected not in (EncryptedShares, MaskedInput, UnmaskResponse):
        return min(cap, SMALL_BODY_BYTES)
    r = (coordinator if coordinator is not None else request.app[COORDINATOR]).open_round
    if r is None:
        return min(cap, SMALL_BODY_BYTES)
    p = r.session.params
    vector = 4 * p.vector_length if expected is not EncryptedShares else 0
    return min(cap, SMALL_BODY_BYTES + vector + 512 * p.k)


def body_objects(
    request: web.Request, expected: type[Message] | None = None, coordinator: RoundCoordinator | None = None
) -> int:
    """The most msgpack objects a route's body may hold, sized like `body_limit`: the largest legitimate
    message of a vector route has about 4·k objects (ids and shares of k neighbours), every other route a
    few dozen.  msgpack's C parser holds the interpreter while it builds them (measured: 65,536 empty
    arrays took 25–300 ms on this machine, depending on load), so the cap keeps that time negligible."""
    if expected not in (EncryptedShares, MaskedInput, UnmaskResponse):
        return SMALL_ROUTE_OBJECTS
    r = (coordinator if coordinator is not None else request.app[COORDINATOR]).open_round
    if r is None:
        return SMALL_ROUTE_OBJECTS
    return min(MAX_OBJECTS, SMALL_ROUTE_OBJECTS + 4 * r.session.params.k)


#: Bodies above this size are decoded (and hashed) in a worker thread (docs/threat-model.md §3.5): a body this small
#: holds at most a few thousand msgpack objects, a few milliseconds of parsing; above it, the codec's
#: header walk (Python, which yields the interpreter to the loop), SHA-256 and the message's copy of the
#: vector (both release it) run off the loop; msgpack parses only the envelope around the vector, which
#: the codec hands over as a view of the body (`protocol.codec.SPLICE_BIN_BYTES`: msgpack's own copy of a
#: 64 MiB vector held the interpreter 32-133 ms).  Figures in docs/threat-model.md §3.5.
THREAD_DECODE_BYTES = 4 * 1024
#: Object cap of the routes without a vector (register, check-in, keys, abort): their messages have a
#: few dozen objects; the cap bounds the C parser's uninterruptible time on a hostile 64 KiB body.
SMALL_ROUTE_OBJECTS = 1024


async def _read(request: web.Request) -> tuple[Message, tuple[int, int]]:
    """A small route's message and the (major, minor) its sender wrote in the envelope."""
    limit = body_limit(request)
    message, _, version = await _decode(await _read_body(request, limit), limit, SMALL_ROUTE_OBJECTS)
    return message, version


def _decode_and_hash(body: bytes | bytearray, limit: int, max_objects: int) -> tuple[Message, bytes, tuple[int, int]]:
    message, version = decode_versioned(body, max_size=limit, max_objects=max_objects)
    return message, hashlib.sha256(body).digest(), version


async def _decode(body: bytes | bytearray, limit: int, max_objects: int) -> tuple[Message, bytes, tuple[int, int]]:
    """Decode a body and hash it (the digest identifies a retransmission); off the event loop when the
    body is larger than `THREAD_DECODE_BYTES`."""
    if len(body) <= THREAD_DECODE_BYTES:
        return _decode_and_hash(body, limit, max_objects)
    return await asyncio.get_running_loop().run_in_executor(None, _decode_and_hash, body, limit, max_objects)


async def _read_body(request: web.Request, limit: int | None = None) -> bytearray:
    # Read the body ourselves instead of `request.read()`, which caches the bytes on the request for
    # its whole life: a long-poll handler would then pin every device's upload (1000 devices ×
    # 1 MB masked inputs) until the phase closes.  A body that has not fully arrived after
    # ``server.body_timeout`` seconds is cut (slow or partial bodies used to hold sockets forever).
    listen = request.app[CONFIG].listen
    limit = listen.max_body_bytes if limit is None else limit
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"request body of {request.content_length} bytes exceeds the limit of {limit}")
    body = bytearray()
    try:
        async with asyncio.timeout(listen.body_timeout):
            async for chunk in request.content.iter_chunked(1 << 16):
                body += chunk
                if len(body) > limit:
                    raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
    except TimeoutError:
        raise BodyTimeout(
            f"request body not received within {listen.body_timeout:g} s (server.body_timeout); "
            f"{len(body)} bytes arrived"
        ) from None
    return body


def _send(message: Message, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=encode(message), status=status, content_type=MSGPACK, headers=headers)


async def _device(request: web.Request) -> int:
    header = request.headers.get("Authorization", "")
    token = header[7:].strip() if header.lower().startswith("bearer ") else None
    return await _on_state(request.app, request.app[COORDINATOR].authenticate, token)


def _round_id(request: web.Request) -> int:
    raw = request.match_info["round_id"]
    # ASCII digits only: str.isdigit() also accepts '²', '①', '٣' and '１' (int() refuses the first two
    # with a ValueError, a 500, and reads the others as 3 and 1).
    if not (0 < len(raw) <= 18 and raw.isascii() and raw.isdigit()):
        raise RemoteProtocolError(f"round id must be a non-negative integer of ASCII digits, got {raw!r}")
    return int(raw)


def _leader(request: web.Request, device: int) -> RoundCoordinator | str:
    """The local coordinator of the device's cohort, or the URL of the instance leading it, or "" when
    there is none (or the request was forwarded here already)."""
    route = request.app[_KEEPER].route(device, request.app[_CLOCK]())
    if route.local is not None:
        return route.local
    if route.url and FORWARDED_HEADER not in request.headers:
        return route.url
    return ""


async def _elsewhere(request: web.Request, device: int, url: str, body: bytes | bytearray | None) -> web.StreamResponse:
    """Forward a device's request to the leader of its cohort at ``url`` and relay the answer; with no
    leader, a check-in waits and anything else gets 503 + Retry-After (device transports retry those)."""
    if not url:
        route = request.app[_KEEPER].route(device, request.app[_CLOCK]())
        reason = route.reason or "this request was forwarded already"
        if request.path == "/v1/checkin":
            return _send(Wait(retry_after=2.0, reason=reason), headers={"Retry-After": "2"})
        return _send(ErrorMessage.from_exception(RoundError(reason)), status=503, headers={"Retry-After": "2"})
    headers = {h: request.headers.get(h, "") for h in ("Authorization", "Content-Type", "Accept", "If-None-Match")}
    headers[FORWARDED_HEADER] = request.app[_KEEPER].instance
    rid = current_request_id()
    if rid:
        headers["X-Request-Id"] = rid
    cfg = request.app[CONFIG].rounds
    limit = cfg.advertise_timeout + cfg.share_keys_timeout + cfg.masked_input_timeout + cfg.unmask_timeout + 60.0
    try:
        async with request.app[_PROXY].request(
            request.method,
            url + request.path_qs,
            data=body,
            headers={k: v for k, v in headers.items() if v},
            timeout=aiohttp.ClientTimeout(total=limit, sock_connect=30.0),
            allow_redirects=False,
        ) as upstream:
            data = await upstream.read()
            relay = {h: upstream.headers[h] for h in ("Retry-After", "ETag", "Content-Type") if h in upstream.headers}
            return web.Response(status=upstream.status, body=data, headers=relay)
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("could not forward %s %s to %s: %s", request.method, request.path, url, exc)
        error = RoundError(f"the instance leading this device's cohort ({url}) is unreachable")
        return _send(ErrorMessage.from_exception(error), status=503, headers={"Retry-After": "2"})


# -- handlers -------------------------------------------------------------------------------------


async def register(request: web.Request) -> web.Response:
    msg, _ = await _read(request)
    if not isinstance(msg, RegisterRequest):
        raise RemoteProtocolError(f"expected RegisterRequest, got {type(msg).__name__}")
    reply = await _on_state(
        request.app,
        request.app[COORDINATOR].register,
        msg.platform,
        request.app[_CLOCK](),
        certificate=msg.certificate,
        proof=msg.proof,
        enrollment_token=msg.enrollment_token,
        peer=request.remote or "",
    )
    return _send(reply, status=201)


async def admin_enrollment_tokens(request: web.Request) -> web.Response:
    """``POST /v1/admin/enrollment-tokens`` (admin token): JSON ``{"count": n, "source": "label"}`` →
    ``{"source": "token:label", "tokens": [...]}``, one-time enrollment tokens shown once."""
    request.app[dashboard.OPERATOR].check_admin(request.headers.get("Authorization"))
    try:
        doc = json.loads(await _read_body(request, SMALL_BODY_BYTES))
    except (ValueError, UnicodeDecodeError) as exc:
        raise RemoteProtocolError(f"enrollment-tokens: the body is not JSON: {exc}") from None
    if not isinstance(doc, dict) or set(doc) - {"count", "source"}:
        raise RemoteProtocolError('enrollment-tokens: expected {"count": <int>, "source": "<label>"}')
    try:
        tokens = await _on_state(
            request.app,
            request.app[COORDINATOR].enrollment.issue_tokens,
            doc.get("count", 1),
            doc.get("source", ""),
            request.app[_CLOCK](),
        )
    except ValueError as exc:
        raise RemoteProtocolError(f"enrollment-tokens: {exc}") from None
    log.info("issued %d enrollment tokens under source token:%s", len(tokens), doc.get("source"))
    return web.json_response({"source": f"token:{doc.get('source')}", "tokens": tokens}, status=201)


async def admin_revocation_list(request: web.Request) -> web.Response:
    """``POST /v1/admin/revocation-list`` (admin token; protocol 1.5): the body is the enrollment
    authority's signed revocation list (raw bytes, as ``fedrec enroll-ca revoke`` writes it).  Stored in the
    shared database so that every instance enforces it (each looks every
    `agg_server.enrollment.DATABASE_POLL` = 1 s), and in force here at once.  → 201 JSON
    ``{"number": n, "revoked_keys": k, "stored": true}`` (200 and ``"stored": false`` for the list already
    stored); 400 ``revocation_list_invalid`` for a forged, foreign,
    malformed or rolled-back list (nothing is stored)."""
    request.app[dashboard.OPERATOR].check_admin(request.headers.get("Authorization"))
    data = bytes(await _read_body(request))
    slots = request.app[_SLOTS]
    executor = request.app[_CRL_EXECUTOR]  # the signature checks run off the loop; this request awaits them
    crl, stored = await slots[0].enrollment.upload_revocation_list_async(data, request.app[_CLOCK](), executor)
    for coordinator in slots[1:]:
        await coordinator.enrollment.refresh(executor, force_database=True)
    log.info("revocation list #%d uploaded (%d device keys, stored: %s)", crl.number, len(crl.device_keys), stored)
    body = {"number": crl.number, "revoked_keys": len(crl.device_keys), "stored": stored}
    return web.json_response(body, status=201 if stored else 200)


async def check_in(request: web.Request) -> web.StreamResponse:
    device = await _device(request)
    leader = _leader(request, device)
    if not isinstance(leader, RoundCoordinator):
        return await _elsewhere(request, device, leader, await _read_body(request, body_limit(request)))
    msg, version = await _read(request)
    if not isinstance(msg, CheckIn):
        raise RemoteProtocolError(f"expected CheckIn, got {type(msg).__name__}")
    if leader.mu > 0 and version < DP_COLLUDERS_SINCE:  # it would size its noise for no colluders
        have, need = (".".join(map(str, v)) for v in (version, DP_COLLUDERS_SINCE))
        raise VersionMismatch(f"this server's DP noise needs devices of protocol {need} or later; upgrade ({have})")
    coordinator = leader
    coordinator.check_sender(device, msg)
    # may drop a device that left its round
    reply = await _act(request.app, coordinator.check_in, device, request.app[_CLOCK]())
    if isinstance(reply, Wait) and coordinator.open_round is not None and not coordinator.stopped_reason:
        reply = await _hold_check_in(request, coordinator, device, coordinator.open_round.round_id)
    if isinstance(reply, Wait):
        return _send(reply, headers={"Retry-After": str(max(1, math.ceil(reply.retry_after)))})
    if FORWARDED_HEADER in request.headers:  # relayed: whether it arrived is the relaying instance's to see
        return _send(reply)
    # Written here: once it left on an open connection, a second check-in before the keys means that the
    # device left the round (`agg_server.presence`); an answer the device gave up on is handed out again.
    response = _send(reply, headers={"X-Request-Id": current_request_id() or secrets.token_hex(8)})
    with contextlib.suppress(ConnectionResetError):  # gone first: not delivered
        await response.prepare(request)
        await response.write_eof()
        if request.transport is not None and not request.transport.is_closing():
            # On the state thread, in order after the check-in (not awaited: the answer is out already).
            request.app[_STATE].submit(coordinator.invitation_delivered, device, reply.round_id)
    return response


async def _hold_check_in(
    request: web.Request, coordinator: RoundCoordinator, device: int, round_id: int
) -> RoundInvite | Wait:
    """A device that cannot join the open round (not in its cohort, or it left it) has nothing to do
    before that round ends: hold its check-in until then (at most `_CHECKIN_HOLD` seconds) instead of
    letting it poll, then check it in again, so it is in the pool when the next round opens.  The held
    answers leave spread over `_CHECKIN_SPREAD` seconds: a round's end does not answer every waiting
    device in one turn of the event loop."""
    app, clock = request.app, request.app[_CLOCK]
    give_up = clock() + _CHECKIN_HOLD
    changes = app[_CHANGES]
    while True:
        r = coordinator.open_round
        remaining = give_up - clock()
        if r is None or r.round_id != round_id or remaining <= 0:
            break
        await changes.wait(min(remaining, _PRESENCE_CHECK))
    if coordinator.open_round is None or coordinator.open_round.round_id != round_id:
        await asyncio.sleep(random.uniform(0.0, _CHECKIN_SPREAD))  # not a secret: load spreading only
    return await _act(app, coordinator.check_in, device, clock())


async def model(request: web.Request) -> web.StreamResponse:
    device = await _device(request)
    leader = _leader(request, device)
    if not isinstance(leader, RoundCoordinator):
        return await _elsewhere(request, device, leader, None)
    coordinator = leader  # the version its cohort's round trains
    etag, body = await _on_state(request.app, lambda: (coordinator.model_etag, coordinator.model_bytes))
    if request.headers.get("If-None-Match") == etag:
        return web.Response(status=304, headers={"ETag": etag})
    return web.Response(body=body, content_type=MSGPACK, headers={"ETag": etag})


async def revocations(request: web.Request) -> web.StreamResponse:
    """``GET /v1/enrollment/revocations`` (protocol 1.5, no login: the list is signed and public): the
    enrollment authority's revocation list this server enforces, as a `RevocationListPayload` with an
    ETag (``If-None-Match`` → 304).  Without ``enrollment.revocation_list`` the payload is empty (and
    has no ETag): the server enforces no list, and a device keeps enforcing the newest it holds."""
    data, etag = await _on_state(request.app, request.app[COORDINATOR].enrollment.signed_revocation_list)
    if not etag:
        return _send(RevocationListPayload())
    if request.headers.get("If-None-Match") == etag:
        return web.Response(status=304, headers={"ETag": etag})
    cache = request.app[_CRL_BODY]
    body = cache.get(etag)
    if body is None:  # encoded once per list, in the worker thread (32 MB for 10^6 keys)
        payload = RevocationListPayload(data=data)
        body = await asyncio.get_running_loop().run_in_executor(request.app[_CRL_EXECUTOR], encode, payload)
        cache.clear()
        cache[etag] = body
    return web.Response(body=body, content_type=MSGPACK, headers={"ETag": etag})


def _phase_handler(expected: type[Message]) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        device = await _device(request)
        round_id = _round_id(request)
        app = request.app
        leader = _leader(request, device)
        if not isinstance(leader, RoundCoordinator):
            return await _elsewhere(request, device, leader, await _read_body(request))
        if expected in (EncryptedShares, MaskedInput, UnmaskResponse):
            leader.check_open(round_id)  # a late upload: StaleRound, not a 413 against the small-route limit
        limit = body_limit(request, expected, leader)
        coordinator, changes, clock = leader, app[_CHANGES], app[_CLOCK]
        answered = False
        # Its connection is its presence from here, body included.  Submitted, not awaited: the state thread
        # runs it before anything this handler asks later, and a cancelled handler still reaches `finally`.
        app[_STATE].submit(coordinator.poll_started, device, round_id)
        try:
            body = await _read_body(request, limit)
            # the digest identifies a retransmission without encoding msg again
            msg, digest, _ = await _decode(body, limit, body_objects(request, expected, leader))
            del body
            if not isinstance(msg, expected):
                raise RemoteProtocolError(f"expected {expected.__name__} on this route, got {type(msg).__name__}")
            after = await _act(app, coordinator.submit, device, round_id, msg, clock(), digest=digest)
            consistency = isinstance(msg, ConsistencySignature)
            leaving = answered = isinstance(msg, Abort)
            del msg  # the masked input is in the session's running sum now; do not pin it while polling
            if leaving:
                version, reason = coordinator.model_version, "left the round"
                return _send(RoundResult(round_id=round_id, committed=False, model_version=version, reason=reason))
            cfg = app[CONFIG].rounds
            give_up = clock() + cfg.advertise_timeout + cfg.share_keys_timeout + cfg.masked_input_timeout
            give_up += cfg.unmask_timeout + 30.0
            while True:
                reply = await _on_state(app, coordinator.reply, device, round_id, after, consistency=consistency)
                if reply is not None:
                    answered = True
                    return _send(reply)
                remaining = give_up - clock()
                if remaining <= 0:
                    raise RoundError(f"round {round_id} did not move on in time")
                transport = request.transport
                if transport is None or transport.is_closing():
                    raise ConnectionResetError("the device closed its long-poll connection")
                await changes.wait(min(remaining, _PRESENCE_CHECK))
        finally:
            # Cancelled (the connection closed, maybe before the body arrived) or given up: unanswered.  Not
            # awaited: a cancelled handler cannot await, and the state thread runs it in order all the same.
            with contextlib.suppress(RuntimeError):  # the state thread is gone (shut down): nothing to record
                app[_STATE].submit(coordinator.poll_ended, device, round_id, clock(), answered=answered)

    handler.__name__ = f"upload_{expected.__name__}"
    return handler


async def health(request: web.Request) -> web.Response:
    """Liveness: answered from memory, also while a round is finishing (``state``: of any cohort this
    instance leads, "finishing" before "round" before "idle")."""
    rounds = [s.open_round for s in request.app[_SLOTS] if s.open_round is not None]
    state = "idle" if not rounds else ("finishing" if any(r.finishing for r in rounds) else "round")
    return web.json_response({"status": "ok", "state": state})


async def ready(request: web.Request) -> web.Response:
    """Readiness: 200 ``{"status": "ready"}``, or 503 ``{"status": "not ready", "reasons": [...]}`` while
    the database is unreachable, a database call has been in flight longer than `READY_STALL` seconds,
    or a cohort lease this instance holds could not be renewed.  Answered from memory."""
    app = request.app
    reasons = []
    health = app[_STORAGE].health
    busy = health.busy_since
    if busy is not None and time.monotonic() - busy > READY_STALL:
        reasons.append(f"a database call has been waiting for {time.monotonic() - busy:.1f} s")
    if health.failure:
        reasons.append(f"database: {health.failure}")
    reasons += app[_KEEPER].unrenewed()
    if reasons:
        return web.json_response({"status": "not ready", "reasons": reasons}, status=503)
    return web.json_response({"status": "ready"})


def _status_body(app: web.Application) -> dict[str, Any]:
    """On the state thread: the first coordinator's status plus the cluster's view (the newest model any
    instance committed, every cohort's leader); also the dashboard's and the metrics' status source."""
    now = app[_CLOCK]()
    body = app[COORDINATOR].status(now)
    try:
        head = app[_STORAGE].head_version()
    except FedRecError as exc:  # the database is down: the rest of the page still answers
        log.warning("status: the cluster's model version is unknown: %s", exc)
        head = None
    body["cluster"] = app[_KEEPER].describe(now, head)
    body["errors_by_status"] = app[dashboard.OPERATOR].metrics.errors_by_status()
    return body


async def status(request: web.Request) -> web.Response:
    request.app[dashboard.OPERATOR].check_operator(request.headers.get("Authorization"))
    return web.json_response(await _on_state(request.app, _status_body, request.app))


# -- lifecycle ------------------------------------------------------------------------------------


def _tick(app: web.Application) -> list[tuple[RoundCoordinator, FinishJob]]:
    """One tick on the state thread: the leases, then every coordinator; the finishing jobs it produced."""
    clock, keeper = app[_CLOCK], app[_KEEPER]
    try:
        keeper.step(clock())
    except Exception:
        log.exception("lease keeper failed on one tick")
    jobs = []
    for coordinator in app[_SLOTS]:
        try:
            coordinator.tick(clock())
        except FedRecError:
            log.exception("round ticker: a round could not be advanced")
        except Exception:  # keep the server alive; the error is logged with its traceback
            log.exception("round ticker crashed on one tick")
        job = coordinator.take_finish_job()
        if job is not None:
            jobs.append((coordinator, job))
    return jobs


async def _ticker(app: web.Application) -> None:
    while True:
        for coordinator, job in await _act(app, _tick, app):
            app[_FINISHING][job.round_id] = asyncio.create_task(
                _finish(app, coordinator, job), name=f"fedrec-finish-{job.round_id}"
            )
        await asyncio.sleep(TICK_SECONDS)


async def _revocation_refresher(app: web.Application) -> None:
    """Every `REFRESH_PERIOD` seconds, each coordinator's `Enrollment.refresh`: a changed list file or a
    newer uploaded list is read and verified in the worker thread and then swapped in, while requests keep
    enforcing the list in force (they do no refresh and no filesystem I/O themselves)."""
    while True:
        await asyncio.sleep(REFRESH_PERIOD)
        for coordinator in app[_SLOTS]:
            try:
                await coordinator.enrollment.refresh(app[_CRL_EXECUTOR], force_database=True)
            except Exception:  # a storage error: logged, the list in force stays, the next pass tries again
                log.exception("revocation list refresh failed; the list in force stays")


async def _finish(app: web.Application, coordinator: RoundCoordinator, job: FinishJob) -> None:
    """Run a round's finishing job in the worker thread, then commit it on the loop."""
    clock = app[_CLOCK]
    try:
        await asyncio.get_running_loop().run_in_executor(app[_EXECUTOR], job.run)
        await _act(app, coordinator.complete_finish, job, clock())
    except Exception:
        log.exception("round %d could not be finished", job.round_id)
    finally:
        app[_FINISHING].pop(job.round_id, None)


def _fingerprint(app: web.Application) -> tuple[Any, ...]:
    """What long-polls wait for, per coordinator: the model version, the open round, its phase, and
    whether it finishes."""
    out = []
    for coordinator in app[_SLOTS]:
        r = coordinator.open_round
        state = None if r is None else (r.round_id, r.session.phase, r.session.consistency_open, r.finishing)
        out.append((coordinator.model_version, state))
    return tuple(out)


async def _wait_finishing(app: web.Application) -> None:
    tasks = list(app[_FINISHING].values())
    if tasks:
        log.info("waiting for %d finishing round(s) to commit before shutting down", len(tasks))
        await asyncio.wait(tasks, timeout=_FINISH_WAIT)


def _open_state(app: web.Application) -> tuple[Storage, list[RoundCoordinator], LeaseKeeper]:
    """On the state thread: open the storage, build the coordinators and take the free cohorts."""
    config = app[CONFIG]
    s = config.storage
    timeouts = Timeouts(connect=s.connect_timeout, statement=s.statement_timeout, lock=s.lock_timeout)
    storage = Storage(config.data_dir, url=s.url, timeouts=timeouts)
    try:
        coordinators = [
            RoundCoordinator(
                config, storage, now=app[_CLOCK](), strategy=app[_STRATEGY], defer_finish=True, leased=True
            )
            for _ in range(s.cohorts_per_instance)
        ]
        for c in coordinators[1:]:
            c.listeners = coordinators[0].listeners  # one set of observers (metrics, dashboard) for all
        keeper = LeaseKeeper(config, storage, coordinators)
        keeper.claim_instance_id()  # a second live process with this instance_id: refuse to start
        keeper.step(app[_CLOCK](), force=True)  # lead the free cohorts (a restart: its own) at once
    except BaseException:
        storage.close()
        raise
    return storage, coordinators, keeper


def _close_state(app: web.Application) -> None:
    """On the state thread: abandon open rounds, give the leases up, close the storage."""
    _shutdown_rounds(app)
    app[_KEEPER].release_all()
    app[_STORAGE].close()


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    state = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedrec-state")
    app[_STATE] = state
    executor = ThreadPoolExecutor(max_workers=config.storage.cohorts_per_instance, thread_name_prefix="fedrec-finish")
    app[_EXECUTOR] = executor
    crl_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedrec-crl")
    app[_CRL_EXECUTOR] = crl_executor
    app[_FINISHING] = {}
    try:
        storage, coordinators, keeper = await _on_state(app, _open_state, app)
    except BaseException:
        for pool in (state, executor, crl_executor):
            pool.shutdown(wait=False)
        raise
    app[_STORAGE] = storage
    app[COORDINATOR] = coordinators[0]
    app[_SLOTS] = coordinators
    app[_KEEPER] = keeper
    app[_CHANGES] = _Changes()
    app[dashboard.OPERATOR].status_source = functools.partial(_status_body, app)
    app[_PROXY] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    for c in coordinators:
        c.enrollment.in_background = True
        c.enrollment.storage_executor = state
    task = asyncio.create_task(_ticker(app), name="fedrec-round-ticker")
    refresher = None
    if config.enrollment.authority_public_key:
        refresher = asyncio.create_task(_revocation_refresher(app), name="fedrec-revocation-refresher")
    try:
        yield
    finally:
        for t in (task, refresher):
            if t is not None:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
        crl_executor.shutdown(wait=True)
        await _wait_finishing(app)
        executor.shutdown(wait=True)
        try:
            await _on_state(app, _close_state, app)
        finally:
            state.shutdown(wait=True)
            app[_CHANGES].notify()
            await app[_PROXY].close()
        log.info("storage closed")


async def _on_shutdown(app: web.Application) -> None:
    # Runs before aiohttp waits for in-flight requests: close the round first so that every
    # long-poll is answered (aborted) at once instead of holding the shutdown until it times out.
    # A round that is finishing commits first: its sum is unmasked already.
    await _wait_finishing(app)
    await _act(app, _shutdown_rounds, app)


def _shutdown_rounds(app: web.Application) -> None:
    for coordinator in app[_SLOTS]:
        try:
            coordinator.shutdown(app[_CLOCK]())
        except FedRecError:
            log.exception("could not close the open round at shutdown")


def create_app(
    config: ServerConfig, *, clock: Callable[[], float] = time.time, strategy: Strategy | None = None
) -> web.Application:
    """Build the fedrec aggregation server.

    Parameters
    ----------
    config : the validated server configuration.
    clock : wall-clock source (seconds); tests may pass their own.
    strategy : the aggregation strategy (`agg_server.strategy.base.Strategy`); default: the one
        ``config.model.kind`` names.  An operator's own rule plugs in here.
    """
    app = web.Application(
        client_max_size=config.listen.max_body_bytes, middlewares=[dashboard.observe_requests, error_middleware]
    )
    app[CONFIG] = config
    app[_STRATEGY] = strategy
    app[_CLOCK] = clock
    app[_CRL_BODY] = {}
    app.cleanup_ctx.append(_lifecycle)
    app.on_shutdown.append(_on_shutdown)
    app.router.add_post("/v1/devices", register)
    app.router.add_post("/v1/checkin", check_in)
    app.router.add_get("/v1/model", model)
    app.router.add_get("/v1/enrollment/revocations", revocations)
    app.router.add_post("/v1/rounds/{round_id}/keys", _phase_handler(PublicKeys))
    app.router.add_post("/v1/rounds/{round_id}/shares", _phase_handler(EncryptedShares))
    app.router.add_post("/v1/rounds/{round_id}/masked", _phase_handler(MaskedInput))
    app.router.add_post("/v1/rounds/{round_id}/consistency", _phase_handler(ConsistencySignature))
    app.router.add_post("/v1/rounds/{round_id}/unmask", _phase_handler(UnmaskResponse))
    app.router.add_post("/v1/rounds/{round_id}/abort", _phase_handler(Abort))
    app.router.add_get("/v1/health", health)
    app.router.add_get("/v1/ready", ready)
    app.router.add_get("/v1/status", status)
    app.router.add_post("/v1/admin/enrollment-tokens", admin_enrollment_tokens)
    app.router.add_post("/v1/admin/revocation-list", admin_revocation_list)
    # The dashboard (GET /), its JSON, /metrics and the admin quality endpoint; observes the coordinator.
    dashboard.install(app, config=config, clock=clock, coordinator=COORDINATOR, storage=_STORAGE, executor=_STATE)
    return app
