"""Server logging: JSON or text lines on stderr, request ids carried into every record of a request.

Invariants:
- One request id per HTTP request: a sane incoming ``X-Request-Id`` (1–64 characters of
  ``[A-Za-z0-9._-]``) is kept so that ids can be followed across proxies; anything else is replaced by
  a fresh random id, so a client cannot inject text into the logs through that header.
- The id lives in a `contextvars.ContextVar` set for the duration of the request; `RequestIdFilter`
  (attached to the handler, so it sees records from every logger) copies it onto each record.  Work
  outside a request (the round ticker) has no request id.
- A JSON line is one object: ``time`` (UTC, ISO 8601 with milliseconds), ``level``, ``logger``,
  ``message``, ``request_id`` when inside a request, every ``extra=`` field, and ``exc`` for a
  traceback.  Values that are not JSON become their ``str``; a line never spans two lines.
- Nothing here configures logging at import time; `configure_logging` is called by the CLI only.
"""

from __future__ import annotations

import contextvars
import datetime
import json
import logging
import re
import secrets
import sys
from typing import Any, TextIO

__all__ = [
    "REQUEST_ID",
    "ACCESS_LOGGER",
    "RequestIdFilter",
    "JsonFormatter",
    "TextFormatter",
    "configure_logging",
    "request_id_from_header",
    "current_request_id",
]

#: The id of the request being handled, None outside a request.
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("fedrec_request_id", default=None)

#: Logger of the one access line per request.
ACCESS_LOGGER = "agg_server.access"

_SANE_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


def request_id_from_header(value: str | None) -> str:
    """The request id to use for a request that sent ``X-Request-Id: value`` (None: no header).

    Parameters
    ----------
    value : str or None
        The incoming header.

    Returns
    -------
    str
        ``value`` when it is 1–64 characters of ``[A-Za-z0-9._-]``, else 16 fresh random hex digits.
    """
    if value is not None and _SANE_ID.fullmatch(value):
        return value
    return secrets.token_hex(8)


def current_request_id() -> str | None:
    """The id of the request being handled in this context, or None."""
    return REQUEST_ID.get()


class RequestIdFilter(logging.Filter):
    """Adds ``record.request_id`` (None outside a request); never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = REQUEST_ID.get()
        return True


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD and k != "request_id"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module invariants for the keys)."""

    def format(self, record: logging.LogRecord) -> str:
        moment = datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC)
        body: dict[str, Any] = {
            "time": moment.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            body["request_id"] = request_id
        for key, value in _extras(record).items():
            body.setdefault(key, value)
        if record.exc_info:
            body["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            body["exc"] = record.exc_text
        return json.dumps(body, ensure_ascii=False, default=str, allow_nan=False)


class TextFormatter(logging.Formatter):
    """``time level logger [request id]: message key=value ...``, for people reading a terminal."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s%(rid)s: %(message)s%(fields)s")

    def format(self, record: logging.LogRecord) -> str:
        request_id = getattr(record, "request_id", None)
        extras = _extras(record)
        # Formatting fields set on the record for this call only (another handler may format it too).
        record.__dict__["rid"] = f" [{request_id}]" if request_id else ""
        record.__dict__["fields"] = "".join(f" {k}={v}" for k, v in extras.items() if k not in ("rid", "fields"))
        try:
            return super().format(record)
        finally:
            record.__dict__.pop("rid", None)
            record.__dict__.pop("fields", None)


def configure_logging(fmt: str, level: str, *, stream: TextIO | None = None) -> logging.Handler:
    """Send every log record to ``stream`` (stderr by default) as text or one JSON object per line.

    Parameters
    ----------
    fmt : str
        "json" or "text".
    level : str
        Root level name ("debug" … "critical", any case).
    stream : TextIO, optional
        Where to write; ``sys.stderr`` when None.

    Returns
    -------
    logging.Handler
        The installed handler (it replaces the root logger's handlers).

    Raises
    ------
    ValueError
        ``fmt`` is not "json" or "text".
    """
    if fmt not in ("json", "text"):
        raise ValueError(f"log format must be 'json' or 'text', got {fmt!r}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiohttp's own access log is off (the server writes its own access line with the route template).
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    return handler
