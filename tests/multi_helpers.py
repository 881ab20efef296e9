"""Several real `fedrec-server` processes on one PostgreSQL, real devices over HTTP, and the in-process
reference of every committed sum (used by tests/test_server_multi.py and benchmarks/multi_instance.py).

The reference: every device records, as it runs, its quantized update q(x_u) and the DP noise it kept
after its unmask reply (`RecordingSession`, a `DeviceSecAggSession` that runs unchanged and keeps a
copy).  A committed round's sum must then equal, bit for bit, Σ over its survivors of
q(x_u) + noise_u mod 2^32; the server stores the SHA-256 of the sum it unmasked (``rounds.sum_sha256``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import device_sdk.participation as participation_module
from protocol.device_session import DeviceSecAggSession
from protocol.messages import UnmaskResponse
from protocol.noise import to_ring

__all__ = [
    "Instance",
    "recording",
    "run_devices",
    "database_rounds",
    "check_sums",
    "free_port",
    "ledger_charges",
]

#: (round_id, device_id) -> {"x": q(x_u), "noise": kept noise}; filled while `recording` is active.
Record = dict[tuple[int, int], dict[str, np.ndarray]]


def _recording_session(record: Record) -> type[DeviceSecAggSession]:
    class RecordingSession(DeviceSecAggSession):
        """The device session, unchanged, keeping a copy of the plaintext update and the kept noise."""

        def provide_input(self, x: np.ndarray) -> None:
            super().provide_input(x)
            record.setdefault((self.invite.round_id, self.device_id), {})["x"] = np.array(x, dtype=np.uint32)

        def send(self) -> Any:
            message = super().send()
            if isinstance(message, UnmaskResponse):  # the noise it keeps is final once this reply leaves
                record[(self.invite.round_id, self.device_id)]["noise"] = self.kept_noise().copy()
            return message

    return RecordingSession


@contextlib.contextmanager
def recording() -> Iterator[Record]:
    """Record every device session created by `device_sdk.participation` (the client's round driver) in this process."""
    record: Record = {}
    original = participation_module.DeviceSecAggSession
    participation_module.DeviceSecAggSession = _recording_session(record)  # type: ignore[misc]
    try:
        yield record
    finally:
        participation_module.DeviceSecAggSession = original  # type: ignore[misc]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Instance:
    """One `python -m agg_server` process with its own data directory and port."""

    name: str
    root: Path
    database: str
    cohorts: int
    per_instance: int
    n_items: int
    bits: int
    cohort_size: int
    min_cohort: int = 0  # 0: the full cohort
    lease_seconds: float = 4.0
    timeout: float = 20.0
    privacy: dict[str, Any] = field(default_factory=dict)
    rounds: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_config(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        rounds = {
            "cohort_size": self.cohort_size,
            "min_cohort": self.min_cohort or self.cohort_size,
            "clip_norm": 64.0,
            "scale_bits": 12,
            "advertise_timeout": self.timeout,
            "share_keys_timeout": self.timeout,
            "masked_input_timeout": self.timeout,
            "unmask_timeout": self.timeout,
            "round_interval": 0.05,
            **self.rounds,
        }
        tables = {
            "server": {"data_dir": str(self.root / "data"), "host": "127.0.0.1", "port": self.port},
            "model": {"n_items": self.n_items, "bits": self.bits, **self.model},
            "rounds": rounds,
            "privacy": self.privacy,
            "log": {"level": "info"},
            "storage": {
                "url": self.database,
                "cohorts": self.cohorts,
                "cohorts_per_instance": self.per_instance,
                "lease_seconds": self.lease_seconds,
                "instance_id": self.name,
            },
        }
        lines = []
        for table, values in tables.items():
            lines.append(f"[{table}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
        path = self.root / "server.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def start(self, wait: float = 60.0) -> None:
        config = self.write_config()
        log = open(self.root / "server.log", "ab")  # noqa: SIM115 - the child holds it
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agg_server", "--config", str(config)], stdout=log, stderr=log, env=env
        )
        log.close()
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"instance {self.name} exited ({self.proc.returncode}): {self.log_tail()}")
            with contextlib.suppress(OSError):
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            time.sleep(0.1)
        raise RuntimeError(f"instance {self.name} did not listen within {wait} s: {self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL: no shutdown handler runs."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)

    def log_tail(self, n: int = 3000) -> str:
        path = self.root / "server.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""

    def status(self) -> dict[str, Any]:
        import urllib.request

        with urllib.request.urlopen(self.url + "/v1/status", timeout=10) as r:  # noqa: S310 - loopback
            return dict(json.loads(r.read()))


@dataclass
class DeviceRun:
    outcomes: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)


async def run_devices(
    urls: Sequence[str],
    users: Sequence[tuple[np.ndarray, np.ndarray]],
    store_root: Path,
    *,
    n_items: int,
    bits: int,
    stop: asyncio.Event,
    cohorts: int,
    long_poll_timeout: float = 300.0,
    request_timeout: float = 30.0,
) -> DeviceRun:
    """One `DeviceClient` per user until ``stop`` is set.  Device d (ids follow ``users``' order) talks
    to ``urls[((d - 1) // cohorts) % len(urls)]`` first: every cohort has devices on every instance, so
    many requests are forwarded to the cohort's leader.  A device whose instance is unreachable moves to
    the next URL (`device_sdk.http.HttpTransport` given every URL)."""
    import aiohttp

    from device_sdk.client import ClientConfig, DeviceClient, RoundStatus
    from device_sdk.http import HttpTransport
    from protocol.policy import PrivacyPolicy

    run = DeviceRun()
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    clients: list[DeviceClient] = []
    try:
        for i, (items, ratings) in enumerate(users):
            first = (i // cohorts) % len(urls)
            order = [urls[(first + j) % len(urls)] for j in range(len(urls))]
            # Every instance's URL, its own first: the SDK's failover moves on at once when one dies.
            transport = HttpTransport(order, session=session, retries=2, backoff_max=1.0)
            clients.append(
                DeviceClient(
                    transport,  # type: ignore[arg-type]
                    ClientConfig(
                        store_dir=store_root / f"device-{i:05d}",
                        request_timeout=request_timeout,  # a check-in retried after a lost answer is a
                        # device that left its round: keep it above the fleet's own event-loop delays
                        long_poll_timeout=long_poll_timeout,  # at least a phase: a device that gives up
                        # on a long-poll checks in again and is dropped from its round
                        privacy=PrivacyPolicy.no_floor(),
                    ),
                    items=items,
                    ratings=ratings,
                    n_items=n_items,
                    bits=bits,
                )
            )
        for c in clients:  # one after the other: device ids follow the order of ``users``
            await c.register()

        async def loop(c: DeviceClient) -> None:
            while not stop.is_set():
                try:
                    outcome = await c.run_round()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # a dead instance: count it, retry shortly
                    run.errors[type(exc).__name__] += 1
                    run.examples.setdefault(type(exc).__name__, str(exc)[:200])
                    await asyncio.sleep(0.5)
                    continue
                run.outcomes[outcome.status.value] += 1
                if outcome.status is RoundStatus.WAITED:
                    await asyncio.sleep(min(outcome.retry_after or 1.0, 1.0))

        tasks = [asyncio.create_task(loop(c)) for c in clients]
        await stop.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for c in clients:
            await c.close()
        await session.close()
    return run


def database_rounds(url: str) -> list[dict[str, Any]]:
    """Every round row (psycopg)."""
    import psycopg

    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT round_id, cohort, status, reason, base_model_version, new_model_version, survivors, "
            "sum_sha256, revealed, lease_token FROM rounds ORDER BY round_id"
        ).fetchall()
    keys = ("round_id", "cohort", "status", "reason", "base", "version", "survivors", "sum_sha256", "revealed", "token")
    return [dict(zip(keys, row, strict=True)) for row in rows]


def ledger_charges(url: str) -> tuple[list[int], dict[str, Any]]:
    """The round ids charged in the shared privacy ledger, and the ledger."""
    import psycopg

    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT ledger FROM privacy_ledger WHERE id = 1").fetchone()
    ledger = json.loads(row[0]) if row else {"rounds": []}
    return [int(c["round_id"]) for c in ledger["rounds"]], ledger


def check_sums(rounds: list[dict[str, Any]], record: Record) -> int:
    """Compare every committed round's stored sum digest with the in-process reference; returns how many
    rounds were compared (raises AssertionError on the first mismatch)."""
    compared = 0
    for r in rounds:
        if r["status"] != "committed":
            continue
        rid = r["round_id"]
        parts = [v for (round_id, _), v in record.items() if round_id == rid and "noise" in v]
        assert len(parts) == r["survivors"], f"round {rid}: {len(parts)} recorded survivors, server {r['survivors']}"
        total = np.zeros_like(parts[0]["x"])
        for p in parts:
            total += p["x"] + to_ring(p["noise"])  # uint32 arithmetic wraps mod 2^32
        digest = hashlib.sha256(total.astype("<u4").tobytes()).digest()
        assert r["sum_sha256"] is not None and bytes(r["sum_sha256"]) == digest, f"round {rid}: sum differs"
        compared += 1
    return compared
