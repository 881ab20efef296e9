"""The server's listening socket, with a cap on the connections one source address may hold open.

Invariants:
- A connection from a source that already holds ``per_source`` open connections is closed right after
  ``accept``, before asyncio builds a transport or aiohttp parses a byte: a flood of partial bodies from one
  address costs the event loop one accept and one close per connection beyond the cap, not a request
  handler, its body read and its cancellation.  Every other connection is handed to aiohttp as
  `aiohttp.web.TCPSite` would hand it (``connect_accepted_socket`` with the runner's protocol factory).
- Sources inside an ``exempt`` network are never capped (the health checker, a reverse proxy, the other
  instances of a cluster) and not tracked.
- A source's count is of its sockets still open (asyncio closes the socket when the transport closes); it is
  pruned whenever the source connects again, and every source is swept every `_SWEEP_EVERY` accepts.
- Like asyncio's own accept loop, one readiness event accepts at most ``backlog`` connections, and running out
  of file descriptors pauses accepting for `_EMFILE_PAUSE` seconds instead of spinning.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import socket
import ssl
import time
from collections.abc import Iterable

from aiohttp import web

__all__ = ["CappedTCPSite"]

_log = logging.getLogger("agg_server.listener")

_SWEEP_EVERY = 4096
_EMFILE_PAUSE = 1.0
_WARN_EVERY = 10.0  # seconds between two warnings about refused connections

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class CappedTCPSite(web.BaseSite):
    """A TCP site for an `aiohttp.web.AppRunner` that caps open connections per source address.

    Parameters
    ----------
    runner : web.AppRunner
        The runner, set up.
    host : str
        Address to bind (the first address ``getaddrinfo`` gives for it).
    port : int
        Port to bind; 0 lets the OS choose (see ``runner.addresses``).
    per_source : int
        Most connections one source address may hold open; 0 disables the cap.
    exempt : iterable of networks
        Sources never capped.
    ssl_context : ssl.SSLContext, optional
        TLS for every accepted connection.
    backlog : int
        The listen queue, and the most connections accepted per readiness event.
    """

    __slots__ = (
        "_host",
        "_port",
        "_per_source",
        "_exempt",
        "_open",
        "_tasks",
        "_sock",
        "_accepts",
        "_last_warning",
        "accepted",
        "refused",
    )

    def __init__(
        self,
        runner: web.AppRunner,
        host: str,
        port: int,
        *,
        per_source: int,
        exempt: Iterable[Network] = (),
        ssl_context: ssl.SSLContext | None = None,
        backlog: int = 4096,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context, backlog=backlog)
        self._host, self._port, self._per_source = host, port, per_source
        self._exempt = tuple(exempt)
        self._open: dict[str, list[socket.socket]] = {}
        self._tasks: set[asyncio.Task[object]] = set()
        self._sock: socket.socket | None = None
        self._accepts = 0
        self._last_warning = 0.0
        #: Connections handed to aiohttp, and connections closed at accept because their source was at the cap.
        self.accepted = 0
        self.refused = 0

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context else "http"
        return f"{scheme}://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, address = infos[0]
        sock = socket.create_server(address, family=family, backlog=self._backlog)
        sock.setblocking(False)
        self._sock = sock
        self._server = _Listening(sock, loop)  # what BaseSite.stop closes and runner.addresses reads
        loop.add_reader(sock.fileno(), self._on_readable)

    def _on_readable(self) -> None:
        sock = self._sock
        if sock is None or sock.fileno() == -1:
            return
        for _ in range(self._backlog):
            try:
                conn, address = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    _log.error("accept failed (%s); pausing new connections for %g s", exc, _EMFILE_PAUSE)
                    loop = asyncio.get_running_loop()
                    loop.remove_reader(sock.fileno())
                    loop.call_later(_EMFILE_PAUSE, self._resume)
                    return
                continue  # the peer went away between the readiness event and the accept
            self._accept(conn, str(address[0]))

    def _resume(self) -> None:
        if self._sock is not None and self._sock.fileno() != -1:
            asyncio.get_running_loop().add_reader(self._sock.fileno(), self._on_readable)

    def _accept(self, conn: socket.socket, source: str) -> None:
        self._accepts += 1
        if self._accepts % _SWEEP_EVERY == 0:
            self._sweep()
        held = None if self._per_source <= 0 or self._is_exempt(source) else self._live(source)
        if held is not None and len(held) >= self._per_source:
            conn.close()
            self.refused += 1
            now = time.monotonic()
            if now - self._last_warning >= _WARN_EVERY:
                self._last_warning = now
                _log.warning(
                    "closing new connections from %s: it holds %d open (server.max_connections_per_source); "
                    "%d refused so far",
                    source,
                    len(held),
                    self.refused,
                )
            return
        if held is not None:
            held.append(conn)
        conn.setblocking(False)
        self.accepted += 1
        server = self._runner.server
        assert server is not None  # checked by BaseSite at construction
        task = asyncio.get_running_loop().create_task(
            asyncio.get_running_loop().connect_accepted_socket(server, conn, ssl=self._ssl_context)
        )
        self._tasks.add(task)
        task.add_done_callback(self._connected)

    def _connected(self, task: asyncio.Task[object]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            _log.debug("connection setup failed: %s", task.exception())

    def _live(self, source: str) -> list[socket.socket]:
        held = [s for s in self._open.get(source, ()) if s.fileno() != -1]
        self._open[source] = held
        return held

    def _sweep(self) -> None:
        for source in list(self._open):
            if not self._live(source):
                del self._open[source]

    def _is_exempt(self, source: str) -> bool:
        try:
            address = ipaddress.ip_address(source.split("%", 1)[0])
        except ValueError:
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return any(address.version == net.version and address in net for net in self._exempt)

    def open_connections(self, source: str) -> int:
        """Connections ``source`` holds open now (0 for an exempt or untracked source)."""
        return len(self._live(source)) if source in self._open else 0


class _Listening(asyncio.AbstractServer):
    """The part of `asyncio.Server` that `aiohttp.web.BaseSite.stop` and ``runner.addresses`` use."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        self._sock, self._loop = sock, loop
        self._closed = asyncio.Event()

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def is_serving(self) -> bool:
        return self._sock.fileno() != -1

    async def wait_closed(self) -> None:
        await self._closed.wait()

    async def start_serving(self) -> None:
        return None  # serving since `CappedTCPSite.start`

    async def serve_forever(self) -> None:
        await self._closed.wait()

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return () if self._sock.fileno() == -1 else (self._sock,)

    def close(self) -> None:
        if self._sock.fileno() != -1:
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
        self._closed.set()
