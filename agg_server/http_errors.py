"""HTTP errors of the aggregation server: the status of each error of the fedrec tree (`status_for`) and
the one middleware (`error_middleware`) that turns every error a handler raises into an encoded
`ErrorMessage` with that status.

Invariants:
- Every error leaves as an encoded `ErrorMessage`; a 5xx never hands internals (paths, state) to a
  device: its message names only the request id, and the error is logged with it.
- The database being unreachable or timing out (`DatabaseUnavailable`) is 503 with ``Retry-After``: a
  transient state devices retry, named without internals.
- 404 and 405 are answered as readable JSON to a client that accepts JSON (curl, browsers' fetch).
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Awaitable, Callable

from aiohttp import web

from agg_server import dashboard
from agg_server.logs import current_request_id
from agg_server.storage import DatabaseUnavailable
from protocol.codec import encode
from protocol.errors import (
    AuthError,
    ConfigError,
    CryptoError,
    DatasetError,
    FedRecError,
    LocalProtocolError,
    PayloadTooLarge,
    PermissionDenied,
    PrivacyBudgetExceeded,
    ProtocolError,
    RateLimited,
    RemoteProtocolError,
    RoundError,
    StorageError,
    VersionMismatch,
)
from protocol.messages import ErrorMessage

__all__ = ["BodyTimeout", "status_for", "error_middleware", "MSGPACK"]

log = logging.getLogger("agg_server.app")

MSGPACK = "application/msgpack"
DATABASE_RETRY_AFTER = 2
"""Seconds a device is told to wait (``Retry-After``) when the server's database is unavailable (503)."""


class BodyTimeout(RemoteProtocolError):
    """A request body did not arrive within ``server.body_timeout`` (408; the connection is closed)."""


_STATUS: list[tuple[type[FedRecError], int]] = [
    (BodyTimeout, 408),
    (PermissionDenied, 403),
    (AuthError, 401),
    (PayloadTooLarge, 413),
    (VersionMismatch, 426),
    (LocalProtocolError, 500),  # our own state machine refused: a server fault, not the device's
    (ProtocolError, 400),
    (CryptoError, 400),  # a device's share or key material that does not verify
    (ConfigError, 400),
    (DatasetError, 400),
    (RoundError, 409),
    (PrivacyBudgetExceeded, 409),
    (RateLimited, 429),
]


def status_for(exc: FedRecError) -> int:
    """The HTTP status of an error of the fedrec tree (500 for anything unlisted)."""
    for cls, status in _STATUS:
        if isinstance(exc, cls):
            return status
    return 500


def _error_response(request: web.Request, exc: FedRecError, status: int, request_id: str) -> web.Response:
    message = ErrorMessage.from_exception(exc)
    request[dashboard.ERROR] = message  # for the metrics and the error ring, without decoding the body
    headers = {"X-Request-Id": request_id}
    if isinstance(exc, RateLimited):
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    return web.Response(body=encode(message), status=status, content_type=MSGPACK, headers=headers)


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    # Set (from a sane X-Request-Id or fresh) by the outer `dashboard.observe_requests` middleware.
    request_id = current_request_id() or secrets.token_hex(8)
    try:
        response = await handler(request)
    except DatabaseUnavailable as exc:
        # Transient (the server reconnects by itself): 503 + Retry-After, which device transports retry.
        log.warning("request %s %s %s: %s", request_id, request.method, request.path, exc)
        error = StorageError(f"the server's database is unavailable; retry shortly (request id {request_id})")
        response = _error_response(request, error, 503, request_id)
        response.headers["Retry-After"] = str(DATABASE_RETRY_AFTER)
        return response
    except FedRecError as exc:
        status = status_for(exc)
        if status >= 500:
            log.error("request %s %s %s failed: %s", request_id, request.method, request.path, exc)
            # Do not hand internals (paths, state) to a device.
            exc = FedRecError(f"internal error (request id {request_id})")
        else:
            log.info(
                "request %s %s %s -> %d %s: %s",
                request_id,
                request.method,
                request.path,
                status,
                exc.code,
                exc,
            )
        response = _error_response(request, exc, status, request_id)
        if isinstance(exc, BodyTimeout):
            # A stalled body: answer, then close at once instead of aiohttp's lingering read of the
            # rest (up to 10 s more per connection); a 413 keeps the lingering so its sender reads it.
            response.force_close()
            await response.prepare(request)
            await response.write_eof()
            if request.transport is not None:
                request.transport.close()
        return response
    except web.HTTPRequestEntityTooLarge as exc:
        return _error_response(request, PayloadTooLarge(exc.text or "request body too large"), 413, request_id)
    except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as exc:
        what = "no route" if exc.status == 404 else "method not allowed:"
        error = RemoteProtocolError(f"{what} {request.method} {request.path}")
        if "application/json" in request.headers.get("Accept", ""):  # curl, browsers' fetch: readable JSON
            request[dashboard.ERROR] = ErrorMessage.from_exception(error)
            body = {"error": error.code, "message": str(error), "request_id": request_id}
            return web.json_response(body, status=exc.status, headers={"X-Request-Id": request_id})
        return _error_response(request, error, exc.status, request_id)
    except web.HTTPException:
        raise
    except Exception:
        log.exception("request %s %s %s crashed", request_id, request.method, request.path)
        return _error_response(request, FedRecError(f"internal error (request id {request_id})"), 500, request_id)
    response.headers.setdefault("X-Request-Id", request_id)
    return response
