"""``fedrec-server`` (and ``python -m agg_server``): run the aggregation server from a TOML config.

This is the edge: it reads the command line and environment, sets up logging, and turns SIGTERM /
SIGINT into a graceful shutdown (stop accepting, let the cleanup close the database).  Once the
server listens it prints one line ``fedrec-server listening on http://HOST:PORT`` on stdout, which
tools that start it (``fedrec demo``, tests) read to learn a port chosen by the OS, then a second line
with the dashboard, ``/metrics`` and ``/v1/status`` URLs.  One server at a time owns a ``data_dir``:
it holds an exclusive lock on ``DATA_DIR/server.lock`` while it runs, and a second server started on
the same folder exits with status 2 and one line naming the folder and the owner's pid.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import ssl
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from aiohttp import web

from agg_server.app import create_app
from agg_server.config import LOG_LEVELS, ServerConfig, load_config
from agg_server.listener import CappedTCPSite
from agg_server.logs import configure_logging
from protocol.errors import ConfigError, FedRecError

__all__ = ["main", "build_parser", "configure_logging"]


def build_parser() -> argparse.ArgumentParser:
    """The ``fedrec-server`` argument parser."""
    p = argparse.ArgumentParser(
        prog="fedrec-server",
        description="fedrec aggregation server: federated LightFR rounds with SecAgg+ and distributed DP.",
    )
    p.add_argument("--config", type=Path, required=True, help="server TOML file (see examples/server.toml)")
    p.add_argument("--host", default=None, help="override [server] host")
    p.add_argument("--port", type=int, default=None, help="override [server] port (0 = any free port)")
    p.add_argument("--data-dir", type=Path, default=None, help="override [server] data_dir")
    p.add_argument(
        "--log-format",
        choices=["text", "json"],
        default=None,
        help="override [log] format: text, or json (one object per line with time, level, logger, message, "
        "request_id inside a request, and extra fields)",
    )
    p.add_argument("--log-level", choices=list(LOG_LEVELS), default=None, help="override [log] level")
    return p


def _override(config: ServerConfig, args: argparse.Namespace) -> ServerConfig:
    listen = config.listen
    if args.host is not None:
        listen = dataclasses.replace(listen, host=args.host)
    if args.port is not None:
        listen = dataclasses.replace(listen, port=args.port)
    out = dataclasses.replace(config, listen=listen)
    if args.data_dir is not None:
        out = dataclasses.replace(out, data_dir=args.data_dir)
    if args.log_format is not None:
        out = dataclasses.replace(out, log=dataclasses.replace(out.log, format=args.log_format))
    if args.log_level is not None:
        out = dataclasses.replace(out, log=dataclasses.replace(out.log, level=args.log_level))
    return out


async def _serve(config: ServerConfig) -> None:
    app = create_app(config, clock=time.time)
    # handler_cancellation: a long-poll whose device closed its connection is cancelled at once, which
    # tells the coordinator the device is gone (agg_server.app).
    runner = web.AppRunner(app, handle_signals=False, access_log=None, handler_cancellation=True)
    await runner.setup()
    context = None
    if config.listen.tls_cert is not None and config.listen.tls_key is not None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(config.listen.tls_cert, config.listen.tls_key)
    # A deep accept queue (the kernel caps it at net.core.somaxconn): a fleet's first check-ins, and the
    # requests another instance forwards, arrive as bursts of new connections; with aiohttp's default of
    # 128 the overflow was dropped and connects timed out (measured with 2,000 devices on two instances).
    # One address holding more than server.max_connections_per_source open connections has the next ones
    # closed at accept (agg_server.listener).
    site = CappedTCPSite(
        runner,
        config.listen.host,
        config.listen.port,
        per_source=config.listen.max_connections_per_source,
        exempt=config.listen.uncapped_networks,
        ssl_context=context,
        backlog=4096,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await site.start()
        port = config.listen.port
        for address in runner.addresses:  # the bound (host, port), which tells a port chosen by the OS
            port = int(address[1])
            break
        scheme = "https" if context else "http"
        root = f"{scheme}://{config.listen.host}:{port}"
        print(f"fedrec-server listening on {root}", flush=True)
        print(f"dashboard {root}/  metrics {root}/metrics  status {root}/v1/status", flush=True)
        await stop.wait()
        logging.getLogger("agg_server").info("shutting down")
    finally:
        await runner.cleanup()


LOCK_NAME = "server.lock"


def lock_data_dir(data_dir: Path) -> IO[str]:
    """Take the exclusive lock that makes one server at a time own ``data_dir``; keep the returned file
    open for as long as the server runs (the lock goes with the process).

    Raises
    ------
    ConfigError
        Another process holds the lock (the message names its pid).
    """
    import fcntl

    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        handle = open(data_dir / LOCK_NAME, "a+")  # noqa: SIM115 - held open for the server's lifetime
    except OSError as exc:
        what = "is not a folder" if data_dir.exists() and not data_dir.is_dir() else "cannot be created or written"
        raise ConfigError(f"data_dir {data_dir} {what}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip() or "pid unknown"
        handle.close()
        raise ConfigError(
            f"data_dir {data_dir} is in use by another fedrec-server ({owner}); stop it or choose another data_dir"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}\n")
    handle.flush()
    return handle


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``fedrec-server``; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        config = _override(load_config(args.config), args)
    except (FedRecError, OSError) as exc:
        print(f"fedrec-server: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log.format, config.log.level)
    try:
        lock = lock_data_dir(config.data_dir)
    except (FedRecError, OSError) as exc:
        print(f"fedrec-server: error: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(config))
    except FedRecError as exc:
        print(f"fedrec-server: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(
            f"fedrec-server: error: cannot listen on {config.listen.host}:{config.listen.port}: {exc}",
            file=sys.stderr,
        )
        return 2
    finally:
        lock.close()
    return 0
