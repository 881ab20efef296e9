# Invariants: the only SDK module that imports aiohttp, and no aiohttp exception leaves it: connection
# errors and timeouts are retried and then become `TransportError`; bodies are decoded by `protocol.codec`
# (so `DecodeError` / `VersionMismatch` / `PayloadTooLarge`), non-msgpack answers become
# `RemoteProtocolError`.  A request is retried only when resending it is safe: every fedrec endpoint
# accepts the same message twice (idempotent), and a 4xx other than 429 is never retried.  Back-off is
# "full jitter" from the injected random source; waiting goes through the injected `sleep`.
"""aiohttp implementation of `device_sdk.transport.Transport`."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import secrets
import ssl as ssl_module
from collections.abc import Awaitable, Callable, Mapping, Sequence

import aiohttp
from yarl import URL

from device_sdk.transport import MSGPACK_CONTENT_TYPE, AsyncClosing, Response, TransportError
from protocol.codec import DEFAULT_MAX_MESSAGE_BYTES, decode, encode
from protocol.errors import ConfigError, LocalProtocolError, PayloadTooLarge, RemoteProtocolError
from protocol.messages import Message

__all__ = ["HttpTransport", "RETRY_STATUSES"]

#: Statuses that mean "try again later": rate limited, or a gateway/overload answer.
RETRY_STATUSES = frozenset({429, 502, 503, 504})
_GATEWAY_FAILURES = frozenset({502, 504})  # a proxy in front of a root cannot reach it: try the next root

_log = logging.getLogger(__name__)

Sleep = Callable[[float], Awaitable[None]]


class HttpTransport(AsyncClosing):
    """Talk to the aggregation server over HTTP with msgpack bodies.

    Parameters
    ----------
    base_url : str or sequence of str
        Server root, e.g. ``http://127.0.0.1:8080``; request paths (``/v1/...``) are appended to it.  Several
        roots (the instances of one server sharing a database, in the order to try them): a request that
        cannot reach the current one (a refused or broken connection, a timeout, 502 or 504) is sent to the
        next one at once, without a pause, and the transport stays there; it pauses (``backoff``) only once
        every root failed since the last pause.
    retries : int
        Extra attempts after the first for connection errors, timeouts, 429, 502, 503 and 504.
    backoff_base, backoff_max : float
        Attempt ``a`` (0-based) sleeps ``uniform(0, min(backoff_max, backoff_base * 2**a))`` seconds
        ("full jitter").  A ``Retry-After`` header replaces that draw, capped at ``10 * backoff_max``.
    connect_timeout : float
        Seconds to establish a connection (the caller's ``timeout`` bounds the whole attempt).
    rng : random.Random, optional
        Source of the jitter; ``secrets.SystemRandom()`` by default.
    session : aiohttp.ClientSession, optional
        A session to use; it stays the caller's to close.  By default the transport creates its own on
        first use and closes it in `close`.
    sleep : callable, optional
        ``await sleep(seconds)`` between attempts (``asyncio.sleep`` by default; tests inject a recorder).
    max_message_bytes : int
        Refuse (with `PayloadTooLarge`) answers larger than this.
    ssl : ssl.SSLContext, optional
        TLS settings for an ``https`` server when the transport creates its own session, e.g.
        ``ssl.create_default_context(cafile="server-ca.pem")`` for a private certificate.  By default
        the system's trusted roots verify the server.

    Raises
    ------
    ConfigError
        ``base_url`` is not an absolute http(s) URL, or a number is out of range.
    """

    def __init__(
        self,
        base_url: str | Sequence[str],
        *,
        retries: int = 5,
        backoff_base: float = 0.2,
        backoff_max: float = 10.0,
        connect_timeout: float = 10.0,
        rng: random.Random | None = None,
        session: aiohttp.ClientSession | None = None,
        sleep: Sleep | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        ssl: ssl_module.SSLContext | None = None,
    ) -> None:
        roots = [base_url] if isinstance(base_url, str) else list(base_url)
        if not roots:
            raise ConfigError("base_url: give at least one server URL")
        self.base_urls = tuple(_server_root(u) for u in roots)
        self._current = 0
        if retries < 0:
            raise ConfigError(f"retries must be >= 0, got {retries}")
        for name, value in (
            ("backoff_base", backoff_base),
            ("backoff_max", backoff_max),
            ("connect_timeout", connect_timeout),
        ):
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a positive number, got {value}")
        if max_message_bytes <= 0:
            raise ConfigError(f"max_message_bytes must be positive, got {max_message_bytes}")
        if ssl is not None and session is not None:
            raise ConfigError("pass ssl or session, not both (a session carries its own TLS settings)")
        self._ssl = ssl
        self.retries = retries
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.connect_timeout = connect_timeout
        self.max_message_bytes = max_message_bytes
        self._rng: random.Random = rng if rng is not None else secrets.SystemRandom()
        self._sleep: Sleep = sleep if sleep is not None else asyncio.sleep
        self._session = session
        self._owns_session = session is None
        self._closed = False

    @property
    def base_url(self) -> str:
        """The server root requests go to now (the first of ``base_urls`` until a failover)."""
        return self.base_urls[self._current]

    def _fail_over(self, tried: set[int]) -> bool:
        """Move to the next root; False when it was tried since the last pause (then pause first)."""
        if len(self.base_urls) == 1:
            return False
        self._current = (self._current + 1) % len(self.base_urls)
        if self._current in tried:
            return False
        tried.add(self._current)
        _log.info("server %s unreachable; going on with %s", self.base_urls[self._current - 1], self.base_url)
        return True

    async def close(self) -> None:
        """Close the session if this transport created it (idempotent)."""
        self._closed = True
        if self._owns_session and self._session is not None:
            session, self._session = self._session, None
            await session.close()

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt + 1`` (full jitter).

        Parameters
        ----------
        attempt : int
            0-based index of the attempt that just failed.

        Returns
        -------
        float
            A draw from ``uniform(0, min(backoff_max, backoff_base * 2**attempt))``.
        """
        ceiling = min(self.backoff_max, self.backoff_base * 2.0 ** min(attempt, 62))
        return self._rng.uniform(0.0, ceiling)

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
        """Send one request, retrying transient failures; see `device_sdk.transport.Transport.request`.

        Parameters
        ----------
        method, path, message, token, if_none_match, timeout
            As in `Transport.request`; ``timeout`` bounds each attempt.

        Returns
        -------
        Response
            The answer (304 gives ``message=None``).  After the retries, a retryable status is returned
            like any other answer.

        Raises
        ------
        TransportError
            Connection errors or timeouts on every attempt.
        RemoteProtocolError
            The answer is not ``application/msgpack`` (the message names status and content type).
        DecodeError, VersionMismatch, PayloadTooLarge
            The body does not decode into a valid, compatible message within the size limit.
        LocalProtocolError
            The transport was closed.
        """
        if self._closed:
            raise LocalProtocolError("the transport is closed")
        if not path.startswith("/"):
            raise ValueError(f"path must start with '/', got {path!r}")
        body = encode(message) if message is not None else None
        headers = {"Accept": MSGPACK_CONTENT_TYPE}
        if body is not None:
            headers["Content-Type"] = MSGPACK_CONTENT_TYPE
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        if if_none_match is not None:
            headers["If-None-Match"] = if_none_match
        client_timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=self.connect_timeout)
        session = self._get_session()
        bytes_up = bytes_down = 0
        failure = ""
        tried = {self._current}
        url = self.base_url + path
        for attempt in range(self.retries + 1):
            url = self.base_url + path
            try:
                async with session.request(method, url, data=body, headers=headers, timeout=client_timeout) as resp:
                    bytes_up += len(body) if body is not None else 0
                    raw = await self._read(resp)
                    bytes_down += len(raw)
                    status = resp.status
                    resp_headers: Mapping[str, str] = resp.headers
            except aiohttp.InvalidURL as exc:
                raise ConfigError(f"invalid URL {url!r}: {exc}") from exc
            except (aiohttp.ClientError, TimeoutError) as exc:
                # ServerTimeoutError is both; asyncio.TimeoutError is TimeoutError on 3.11.
                failure = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                if attempt == self.retries:
                    break
                if self._fail_over(tried):
                    continue
                tried = {self._current}
                delay = self.backoff(attempt)
                _log.debug("%s %s failed (%s); retry %d in %.3fs", method, path, failure, attempt + 1, delay)
                await self._sleep(delay)
                continue
            retry_after = _parse_retry_after(resp_headers.get("Retry-After"))
            if status in _GATEWAY_FAILURES and attempt < self.retries and self._fail_over(tried):
                continue  # a proxy in front of this root cannot reach it
            if status in RETRY_STATUSES and attempt < self.retries:
                tried = {self._current}
                if retry_after is not None:
                    delay = min(retry_after, 10.0 * self.backoff_max)
                else:
                    delay = self.backoff(attempt)
                _log.debug("%s %s answered %d; retry %d in %.3fs", method, path, status, attempt + 1, delay)
                await self._sleep(delay)
                continue
            return self._response(status, resp_headers, raw, retry_after, bytes_up, bytes_down)
        raise TransportError(f"{method} {url} failed after {self.retries + 1} attempts: {failure}")

    # -- internals ------------------------------------------------------------------------------------

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # Created lazily, inside the running loop that will use it.
            connector = aiohttp.TCPConnector(ssl=self._ssl) if self._ssl is not None else None
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def _read(self, resp: aiohttp.ClientResponse) -> bytes:
        declared = resp.content_length
        if declared is not None and declared > self.max_message_bytes:
            raise PayloadTooLarge(f"answer of {declared} bytes exceeds the {self.max_message_bytes} limit")
        chunks: list[bytes] = []
        size = 0
        async for chunk in resp.content.iter_chunked(1 << 16):
            size += len(chunk)
            if size > self.max_message_bytes:
                raise PayloadTooLarge(f"answer exceeds the {self.max_message_bytes} byte limit")
            chunks.append(chunk)
        return b"".join(chunks)

    def _response(
        self,
        status: int,
        headers: Mapping[str, str],
        raw: bytes,
        retry_after: float | None,
        bytes_up: int,
        bytes_down: int,
    ) -> Response:
        etag = headers.get("ETag")
        if status == 304:
            return Response(304, None, etag, retry_after, bytes_up, bytes_down)
        content_type = headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
        if content_type != MSGPACK_CONTENT_TYPE:
            raise RemoteProtocolError(
                f"HTTP {status} answered with content type {content_type or 'none'!r}, expected {MSGPACK_CONTENT_TYPE}"
            )
        message = decode(raw, max_size=self.max_message_bytes)
        return Response(status, message, etag, retry_after, bytes_up, bytes_down)


def _server_root(base_url: str) -> str:
    try:
        url = URL(base_url)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid base_url {base_url!r}: {exc}") from exc
    if url.scheme not in ("http", "https") or not url.host:
        raise ConfigError(f"base_url must be an absolute http(s) URL, got {base_url!r}")
    return str(url).rstrip("/")


def _parse_retry_after(value: str | None) -> float | None:
    # Only the delta-seconds form: an HTTP-date would need a clock, and the fedrec server sends seconds.
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    if not math.isfinite(seconds) or seconds < 0:
        return None
    return seconds
