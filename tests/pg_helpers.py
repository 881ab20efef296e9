"""A throw-away PostgreSQL server for the tests: initdb + pg_ctl in a temporary folder, listening only
on a Unix socket in that folder, stopped and deleted afterwards.

Debian keeps the server binaries in /usr/lib/postgresql/<version>/bin (not on PATH).  PostgreSQL refuses
to run as root, so when the tests run as root the server runs as the ``postgres`` user (``runuser``).
Without the binaries the tests skip with the reason, except under ``CI``, where they fail: CI installs
the ``postgresql`` package (.ci/run).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

__all__ = ["postgres_bin", "running_postgres", "PostgresServer"]


class PostgresServer(str):
    """The base URL `running_postgres` yields (a ``str``), which can also stop and start its server."""

    stop: Callable[[], None]
    start: Callable[[], None]



def postgres_bin() -> Path | None:
    """The newest installed server binary folder, or None."""
    env = os.environ.get("FEDREC_PG_BIN")
    if env:
        return Path(env)
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if found:
        return Path(found[-1]).parent
    which = shutil.which("initdb")
    return Path(which).parent if which else None


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"CI: {reason}; .ci/run installs the postgresql package")
    pytest.skip(reason)


@contextlib.contextmanager
def running_postgres() -> Iterator[str]:
    """Start a server; yields the base URL (append a database name: ``f"{base}/name?host=..."``
    is built by `database_url`)."""
    bindir = postgres_bin()
    if bindir is None or not (bindir / "pg_ctl").exists():
        _skip_or_fail("PostgreSQL server binaries not found (/usr/lib/postgresql/*/bin)")
    assert bindir is not None
    as_user: list[str] = []
    owner = None
    if os.geteuid() == 0:
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            _skip_or_fail("running as root and there is no 'postgres' user to run PostgreSQL as")
        runuser = shutil.which("runuser")
        if runuser is None:
            _skip_or_fail("running as root and runuser is missing")
        as_user = [str(runuser), "-u", "postgres", "--"]
    root = Path(tempfile.mkdtemp(prefix="fedrec-pg-"))
    data = root / "data"
    if owner is not None:
        os.chown(root, owner.pw_uid, owner.pw_gid)
    root.chmod(0o755)

    def run(*cmd: str) -> None:
        done = subprocess.run([*as_user, *cmd], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")

    started = False
    options = f"-k {root} -c listen_addresses='' -c fsync=off -c max_connections=50"

    def start() -> None:
        nonlocal started
        run(str(bindir / "pg_ctl"), "-D", str(data), "-o", options, "-l", str(root / "log"), "-w", "start")
        started = True

    def stop() -> None:
        # "fast": every session is disconnected at once, as a database restart by an operator does.
        run(str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop")

    try:
        run(str(bindir / "initdb"), "-D", str(data), "-U", "fedrec", "--auth=trust", "-E", "UTF8", "--no-sync")
        start()
        server = PostgresServer(f"postgresql://fedrec@/postgres?host={root}")
        server.stop, server.start = stop, start
        yield server
    finally:
        if started:
            with contextlib.suppress(Exception):
                run(str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


def database_url(server_url: str, name: str) -> str:
    """The URL of database ``name`` on the server of `running_postgres` (created if missing)."""
    import psycopg

    with psycopg.connect(server_url, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{name}"')
    return server_url.replace("/postgres?", f"/{name}?")
