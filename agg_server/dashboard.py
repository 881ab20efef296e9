"""The operator's view of a running server: the HTML dashboard, its JSON feed, ``/metrics``, the admin
endpoint for model quality, and the middleware that observes every request.

Routes added by `install`:

* ``GET /`` — the dashboard page (``agg_server/static/``: hand-written HTML, CSS, JS and inline SVG; no
  external resource, so it works offline).  It polls ``GET /v1/dashboard``.
* ``GET /v1/dashboard`` — JSON: the coordinator's status, the round history, quality figures and the
  recent errors.
* ``GET /metrics`` — Prometheus text format (`agg_server.metrics`).
* ``POST /v1/admin/quality`` — an operator's evaluation job reports a model version's quality
  (bearer admin token, checked against ``server.admin_token_sha256``).

Invariants:
- One `Operator` per app, under the `OPERATOR` key; no module-level state.  It learns about rounds
  only through ``RoundCoordinator.listeners`` and the database (history seeded at start-up).
- `observe_requests` is the outermost middleware: it fixes the request id (see `agg_server.logs`)
  before anything logs, and sees every answer exactly as the client does.  A failure's error code and
  message come from the `ErrorMessage` the error middleware put under `ERROR` on the request (the
  body is never decoded again); each error answer is counted once (`Metrics.observe_request`).
- The error ring keeps time, method, route template, status, code, a truncated message and the
  request id of the last `ERROR_RING` failures: never a token, header or body.
- The page inserts every server-provided value as text (``textContent`` / SVG attributes), never as
  HTML, and is served with a Content-Security-Policy that allows only its own script and style.
- The admin token is compared as SHA-256 hex digests with `hmac.compare_digest`; with no digest
  configured the admin endpoints answer 403.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import dataclasses
import hashlib
import hmac
import importlib.resources
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, TypeVar

from aiohttp import web

from agg_server.config import ServerConfig
from agg_server.coordinator import RoundCoordinator
from agg_server.logs import ACCESS_LOGGER, REQUEST_ID, request_id_from_header
from agg_server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from agg_server.metrics import Metrics
from agg_server.storage import Storage
from protocol.errors import AuthError, DecodeError, FedRecError, PermissionDenied, RemoteProtocolError
from protocol.messages import ErrorMessage

__all__ = [
    "ERROR",
    "OPERATOR",
    "Operator",
    "install",
    "observe_requests",
    "parse_quality_report",
    "ERROR_RING",
    "HISTORY",
    "STATIC_FILES",
]

log = logging.getLogger("agg_server.dashboard")
_T = TypeVar("_T")
access_log = logging.getLogger(ACCESS_LOGGER)

ERROR_RING = 50
"""Failed requests remembered for the dashboard."""

HISTORY = 100
"""Finished rounds remembered for the dashboard's charts."""

STATIC_FILES = {
    "index.html": "text/html",
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
}

_MAX_ERROR_TEXT = 300
_MAX_ADMIN_BODY = 16 * 1024
_QUALITY_KEYS = ("model_version", "metric", "value", "dataset")
_MAX_METRIC = 64
_MAX_DATASET = 128
_MAX_QUALITY = 1e12

_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_PAGE_HEADERS = {
    "Content-Security-Policy": _CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


class Operator:
    """Dashboard and metrics state of one app.

    Parameters
    ----------
    config : the server configuration.
    clock : the app's wall clock (seconds).
    """

    def __init__(self, config: ServerConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        self.started_at = clock()
        self.metrics = Metrics()
        self.errors: collections.deque[dict[str, Any]] = collections.deque(maxlen=ERROR_RING)
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=HISTORY)
        self.coordinator: RoundCoordinator | None = None
        self.storage: Storage | None = None
        self._open: dict[str, Any] | None = None  # the open round's cohort and phases, from events
        self.static = {name: _load_static(name) for name in STATIC_FILES}
        #: The thread every coordinator and storage call runs on (the server's state thread); None: here.
        self.executor: Executor | None = None
        #: The status document of the page and the metrics' gauges (set by the server: its `/v1/status`
        #: body with the cluster's view); None: the coordinator's own status.
        self.status_source: Callable[[], dict[str, Any]] | None = None

    async def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` on `executor` (off the event loop), or here without one."""
        if self.executor is None:
            return fn(*args)
        call = contextvars.copy_context().run  # its log records keep the request id
        return await asyncio.get_running_loop().run_in_executor(self.executor, call, fn, *args)

    # -- wiring -----------------------------------------------------------------------------------

    def attach(self, coordinator: RoundCoordinator, storage: Storage) -> None:
        """Start observing ``coordinator``: seed counters and history from ``storage``, then listen."""
        self.coordinator = coordinator
        self.storage = storage
        self.metrics = Metrics(storage.round_counts(), status_source=self._status)
        for rec in reversed(storage.recent_rounds(HISTORY)):
            if rec.finished_at is None:
                continue
            phases = [
                {"phase": p.phase, "seconds": p.seconds, "alive": p.arrived, "dropped": p.dropped}
                for p in storage.phase_stats(rec.round_id)
            ]
            self.history.append(
                {
                    "round_id": rec.round_id,
                    "outcome": str(rec.status),
                    "cohort": rec.cohort_size,
                    "survivors": rec.survivors,
                    "seconds": rec.finished_at - rec.started_at,
                    "finished_at": rec.finished_at,
                    "epsilon_spent": rec.epsilon_spent,
                    "model_version": rec.new_model_version,
                    "reason": rec.reason,
                    "phases": phases,
                }
            )
        coordinator.listeners.append(self.on_round_event)

    def _status(self) -> dict[str, Any]:
        if self.status_source is not None:
            return self.status_source()
        coordinator, _ = self._parts()
        return coordinator.status(self.clock())

    def detach(self) -> None:
        """Stop listening to the coordinator (on shutdown)."""
        if self.coordinator is not None and self.on_round_event in self.coordinator.listeners:
            self.coordinator.listeners.remove(self.on_round_event)

    def on_round_event(self, event: str, fields: Mapping[str, Any]) -> None:
        """The coordinator's listener: feed the metrics and the round history."""
        self.metrics.on_round_event(event, fields)
        if event == "round_opened":
            self._open = {"round_id": fields["round_id"], "cohort": int(fields["cohort"]), "phases": []}
        elif event == "phase" and self._open is not None and self._open["round_id"] == fields["round_id"]:
            self._open["phases"].append(
                {
                    "phase": str(fields["phase"]),
                    "seconds": float(fields["seconds"]),
                    "alive": int(fields["alive"]),
                    "dropped": int(fields["dropped"]),
                }
            )
        elif event == "round_finished":
            opened = self._open if self._open is not None and self._open["round_id"] == fields["round_id"] else None
            committed = fields["outcome"] == "committed"
            self.history.append(
                {
                    "round_id": int(fields["round_id"]),
                    "outcome": str(fields["outcome"]),
                    "cohort": opened["cohort"] if opened else None,
                    "survivors": int(fields["survivors"]) if committed else None,
                    "seconds": float(fields["seconds"]),
                    "finished_at": self.clock(),
                    "epsilon_spent": _finite(fields.get("epsilon_spent")),
                    "model_version": int(fields["model_version"]) if committed else None,
                    "reason": str(fields.get("reason") or ""),
                    "phases": opened["phases"] if opened else [],
                }
            )
            self._open = None

    # -- requests ---------------------------------------------------------------------------------

    def record_request(
        self,
        *,
        method: str,
        route: str,
        path: str,
        status: int,
        request_bytes: int,
        response_bytes: int,
        error: ErrorMessage | None,
        request_id: str,
        seconds: float,
    ) -> None:
        """Count a finished request, remember it if it failed, and write its access line."""
        code = None
        if status >= 400:
            code = error.code if error is not None else f"http_{status}"
            message = error.message if error is not None else ""
            self.errors.append(
                {
                    "time": self.clock(),
                    "method": method,
                    "route": route,
                    "status": status,
                    "code": code,
                    "message": message[:_MAX_ERROR_TEXT],
                    "request_id": request_id,
                }
            )
        self.metrics.observe_request(route, status, request_bytes, response_bytes, code)
        ms = round(seconds * 1000.0, 3)
        access_log.info(
            "%s %s %d %d B %.1f ms",
            method,
            route,
            status,
            response_bytes,
            ms,
            extra={
                "method": method,
                "route": route,
                "path": path,
                "status": status,
                "bytes": response_bytes,
                "request_bytes": request_bytes,
                "ms": ms,
            },
        )

    # -- views ------------------------------------------------------------------------------------

    def _parts(self) -> tuple[RoundCoordinator, Storage]:
        if self.coordinator is None or self.storage is None:
            raise FedRecError("the server is not running yet")
        return self.coordinator, self.storage

    def snapshot(self) -> dict[str, Any]:
        """The ``/v1/dashboard`` document."""
        coordinator, storage = self._parts()
        now = self.clock()
        return {
            "generated_at": now,
            "server": {
                "started_at": self.started_at,
                "uptime_seconds": now - self.started_at,
                "tls": self.config.listen.tls_cert is not None,
                "admin_enabled": self.config.listen.admin_token_sha256 is not None,
                "planned_rounds": self.config.privacy.planned_rounds if self.config.privacy.enabled else None,
                "max_rounds": self.config.rounds.max_rounds or None,
            },
            "status": self._status(),
            "history": list(self.history),
            "quality": [dataclasses.asdict(q) for q in storage.model_quality(200)],
            "errors": list(reversed(self.errors)),
            "error_counts": self.metrics.errors_by_code(),
        }

    def metrics_text(self) -> bytes:
        """The ``/metrics`` exposition."""
        self._parts()
        return self.metrics.render()

    def check_operator(self, authorization: str | None) -> None:
        """With ``server.protect_operator_endpoints`` in effect (by default on non-loopback binds), refuse
        a request for ``/metrics``, ``/v1/status`` or the dashboard's data without the admin token.

        Raises
        ------
        AuthError, PermissionDenied
            As `check_admin`.
        """
        if not self.config.listen.operator_endpoints_protected:
            return
        if self.config.listen.admin_token_sha256 is None:
            raise PermissionDenied(
                "operator endpoints are protected (server.protect_operator_endpoints, on by default for "
                "non-loopback binds) and no server.admin_token_sha256 is set"
            )
        self.check_admin(authorization)

    def check_admin(self, authorization: str | None) -> None:
        """Refuse a request that does not carry the operator's admin token.

        Raises
        ------
        PermissionDenied
            The admin endpoints are off, or the token is not the admin token.
        AuthError
            No bearer token.
        """
        expected = self.config.listen.admin_token_sha256
        if expected is None:
            raise PermissionDenied("admin endpoints are disabled: set server.admin_token_sha256 to enable them")
        header = authorization or ""
        token = header[7:].strip() if header[:7].lower() == "bearer " else ""
        if not token:
            raise AuthError("missing admin bearer token (Authorization: Bearer <admin token>)")
        digest = hashlib.sha256(token.encode("utf-8")).hexdigest()
        if not hmac.compare_digest(digest, expected):
            raise PermissionDenied("the bearer token is not the admin token")

    def report_quality(self, body: object) -> dict[str, Any]:
        """Validate and store one quality report; returns what was stored."""
        coordinator, storage = self._parts()
        report = parse_quality_report(body, latest_version=coordinator.model_version)
        storage.record_quality(
            report["model_version"], report["metric"], report["dataset"], report["value"], self.clock()
        )
        log.info("quality of model version %d reported", report["model_version"], extra={"quality": report})
        return report


OPERATOR = web.AppKey("operator", Operator)
#: The `ErrorMessage` an error answer carries, set by the server's error middleware on the request.
ERROR = web.RequestKey("error", ErrorMessage)


def _finite(value: object) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _load_static(name: str) -> bytes:
    return (importlib.resources.files("agg_server") / "static" / name).read_bytes()


def _text_field(body: Mapping[str, Any], key: str, limit: int) -> str:
    value = body[key]
    if not isinstance(value, str):
        raise RemoteProtocolError(f"{key}: must be a string, got {type(value).__name__}")
    if not value or len(value) > limit:
        raise RemoteProtocolError(f"{key}: must be 1 to {limit} characters, got {len(value)}")
    if not value.isprintable() or value != value.strip():
        raise RemoteProtocolError(f"{key}: must be printable text without leading or trailing spaces")
    return value


def parse_quality_report(body: object, *, latest_version: int) -> dict[str, Any]:
    """Check a ``POST /v1/admin/quality`` document.

    Parameters
    ----------
    body : object
        The parsed JSON: ``{"model_version": int, "metric": str, "value": float, "dataset": str}``.
    latest_version : int
        The server's current model version; older versions may be reported, newer ones may not.

    Returns
    -------
    dict
        The four fields, normalised (``value`` as float).

    Raises
    ------
    RemoteProtocolError
        Naming the field: not an object, a missing or unknown key, a wrong type, an empty or too long
        text, a version that does not exist, a value that is not finite.
    """
    if not isinstance(body, dict):
        raise RemoteProtocolError(f"body must be a JSON object with keys {', '.join(_QUALITY_KEYS)}")
    unknown = sorted(str(k) for k in body if k not in _QUALITY_KEYS)
    if unknown:
        raise RemoteProtocolError(f"unknown keys {unknown}; expected {', '.join(_QUALITY_KEYS)}")
    missing = [k for k in _QUALITY_KEYS if k not in body]
    if missing:
        raise RemoteProtocolError(f"missing keys {missing}")
    version = body["model_version"]
    if isinstance(version, bool) or not isinstance(version, int):
        raise RemoteProtocolError(f"model_version: must be an integer, got {type(version).__name__}")
    if not 1 <= version <= latest_version:
        raise RemoteProtocolError(f"model_version: no model version {version} (versions are 1 to {latest_version})")
    value = body["value"]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RemoteProtocolError(f"value: must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or abs(value) > _MAX_QUALITY:
        raise RemoteProtocolError(f"value: must be finite and at most {_MAX_QUALITY:g} in size, got {value!r}")
    return {
        "model_version": version,
        "metric": _text_field(body, "metric", _MAX_METRIC),
        "value": float(value),
        "dataset": _text_field(body, "dataset", _MAX_DATASET),
    }


# -- middleware ---------------------------------------------------------------------------------------


def _route_of(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def observe_requests(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Outermost middleware: request id in a context variable and the response header, metrics, the
    error ring and one access-log line per request."""
    operator = request.app[OPERATOR]
    request_id = request_id_from_header(request.headers.get("X-Request-Id"))
    token = REQUEST_ID.set(request_id)
    start = time.perf_counter()
    status = 500
    response: web.StreamResponse | None = None
    try:
        response = await handler(request)
        status = response.status
        response.headers["X-Request-Id"] = request_id
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    except asyncio.CancelledError:
        status = 499  # the client went away (nginx's convention)
        raise
    finally:
        content_length = response.content_length if isinstance(response, web.Response) else None
        operator.record_request(
            method=request.method,
            route=_route_of(request),
            path=request.path,
            status=status,
            request_bytes=getattr(request.content, "total_bytes", 0),
            response_bytes=content_length or 0,
            error=request.get(ERROR),
            request_id=request_id,
            seconds=time.perf_counter() - start,
        )
        REQUEST_ID.reset(token)


# -- handlers -----------------------------------------------------------------------------------------


async def page(request: web.Request) -> web.Response:
    return web.Response(
        body=request.app[OPERATOR].static["index.html"],
        content_type="text/html",
        charset="utf-8",
        headers=_PAGE_HEADERS,
    )


def _asset(name: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(
            body=request.app[OPERATOR].static[name],
            content_type=STATIC_FILES[name],
            charset="utf-8",
            headers=_PAGE_HEADERS,
        )

    handler.__name__ = f"static_{name.replace('.', '_')}"
    return handler


async def dashboard_json(request: web.Request) -> web.Response:
    operator = request.app[OPERATOR]
    operator.check_operator(request.headers.get("Authorization"))
    return web.json_response(await operator.run(operator.snapshot), headers={"Cache-Control": "no-store"})


async def metrics(request: web.Request) -> web.Response:
    operator = request.app[OPERATOR]
    operator.check_operator(request.headers.get("Authorization"))
    return web.Response(body=await operator.run(operator.metrics_text), headers={"Content-Type": METRICS_CONTENT_TYPE})


async def admin_quality(request: web.Request) -> web.Response:
    operator = request.app[OPERATOR]
    operator.check_admin(request.headers.get("Authorization"))
    raw = await request.content.read(_MAX_ADMIN_BODY + 1)
    if len(raw) > _MAX_ADMIN_BODY:
        raise RemoteProtocolError(f"body must be at most {_MAX_ADMIN_BODY} bytes")
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise DecodeError(f"body is not JSON: {exc}") from None
    return web.json_response(await operator.run(operator.report_quality, body), status=201)


def _refuse_constant(name: str) -> object:
    raise ValueError(f"{name} is not a number")


# -- installation -------------------------------------------------------------------------------------


def install(
    app: web.Application,
    *,
    config: ServerConfig,
    clock: Callable[[], float],
    coordinator: web.AppKey[RoundCoordinator],
    storage: web.AppKey[Storage],
    executor: web.AppKey[ThreadPoolExecutor] | None = None,
) -> None:
    """Add the operator routes and state to ``app``.

    Call after the cleanup context that creates the coordinator and storage (under the keys given), and
    put `observe_requests` first in the app's middlewares.

    Parameters
    ----------
    app : the application being built by ``create_app``.
    config : its configuration.
    clock : its wall clock.
    coordinator, storage : the app keys under which the lifecycle stores them.
    executor : the app key of the thread that every coordinator and storage call must run on (None: the
        event loop's).
    """
    app[OPERATOR] = Operator(config, clock)

    async def observe(app: web.Application) -> AsyncIterator[None]:
        operator = app[OPERATOR]
        operator.executor = None if executor is None else app[executor]
        await operator.run(operator.attach, app[coordinator], app[storage])
        try:
            yield
        finally:
            operator.detach()

    app.cleanup_ctx.append(observe)
    app.router.add_get("/", page)
    for name in STATIC_FILES:
        if name != "index.html":
            app.router.add_get(f"/static/{name}", _asset(name))
    app.router.add_get("/v1/dashboard", dashboard_json)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/admin/quality", admin_quality)
