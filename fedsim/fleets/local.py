"""Fleets of simulated devices against a real server over HTTP: the engine of ``fedrec demo`` and
``fedrec loadtest``.

Invariants:
- Every simulated device is a real `device_sdk.client.DeviceClient` over a real
  `device_sdk.http.HttpTransport`, with its own store folder; only the ratings are simulated.
- Traffic goes only to the URL given (the demo and the tests use loopback).  Loops are bounded:
  the fleet stops after the requested number of finished rounds or at its time limit.
- Dropouts are injected at every phase (including a disconnect in the middle of the masked-input
  request) with the given probability, decided per device and round from the fleet's seeded
  generator.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from device_sdk.client import ClientConfig, DeviceClient, RoundOutcome, RoundStatus, insecure_seeded_rngs
from device_sdk.transport import Transport
from fedsim.fleets.faults import DropoutAt, FaultyTransport
from fedsim.threads import one_blas_thread
from protocol.enrollment import EnrollmentAuthority
from protocol.errors import FedRecError
from protocol.policy import PrivacyPolicy
from protocol.samplers import INSECURE_NOISE_NOTICE, NoiseStream

__all__ = ["FleetConfig", "FleetReport", "run_fleet", "fetch_status", "get_status", "rounds_so_far", "PHASE_STEPS"]

TIME_LIMIT = "fleet time limit reached"
# Seconds between the monitor's reads of /v1/status (each shard reads it: at 4 reads a second it was
# about 5% of a 1,000-device server's CPU, for round counts that change once a minute).
_MONITOR_EVERY = 1.0
_FINISH_GRACE = 30.0  # seconds a stopping fleet waits for devices reading a counted round's result
_FINISHED = (RoundStatus.COMMITTED, RoundStatus.ABORTED)
PHASE_STEPS = ("checkin", "model", "train", "keys", "shares", "masked", "unmask")
_DROPS = (
    DropoutAt.BEFORE_KEYS,
    DropoutAt.BEFORE_SHARES,
    DropoutAt.BEFORE_MASKED,
    DropoutAt.DISCONNECT_MASKED,
    DropoutAt.BEFORE_UNMASK,
)


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """How the fleet behaves.

    Attributes
    ----------
    url : server root, e.g. ``http://127.0.0.1:8080``.
    failover_urls : the roots of the server's other instances (several instances on one database): device
        i talks first to root ``i mod n`` of ``urls`` and goes on with the next one at once when its
        instance cannot be reached (`device_sdk.http.HttpTransport`); the fleet reads the server's status
        from whichever root answers.
    store_root : folder holding one store folder per device.
    n_items, bits : the model shape the server trains.
    rounds : stop after this many rounds have finished (committed or aborted) on the server.
    dropout : probability that a device taking part in a round drops, at a phase chosen uniformly.
    seed : seed of the dropout choices and, when ``reproducible``, of the devices' generators.
    privacy : the devices' privacy floor; default `PrivacyPolicy.no_floor()`, because simulated and
        load-test cohorts are far smaller than any real floor allows (pass ``PrivacyPolicy()`` to see what
        real devices would refuse).
    insecure_reproducible : TEST HOOK: seed the devices' training generators and DP-noise streams with
        `insecure_seeded_rngs` (bit-identical re-runs); the fleet then prints that its ε is not a
        privacy guarantee.  Default False: every device keys its noise from `secrets`, as a real one does.
    seed_training : seed only the devices' training generators (first-round user code, θ and negative
        sampling: child 0 of ``SeedSequence([seed, round_id, device_id])``, as `insecure_seeded_rngs`
        draws it) while their DP noise stays keyed from `secrets`: a simulation reproduces its
        cohorts, dropouts and training, and its ε stays a guarantee.  In a round without DP noise
        (the invitation's ``dp_mu`` is 0) the noise stream supplies only the stochastic-rounding coins
        of the update, so it is seeded too (`insecure_seeded_rngs`' stream): such a run repeats
        exactly.  Keys and masks never come from these generators.
    rating_range, binary_positives : how devices normalise their ratings.
    time_limit : seconds after which the fleet stops regardless.
    long_poll_timeout : seconds a device waits on one phase request.
    schedule : a fixed dropout schedule ``schedule(round_id, device_id)`` used instead of
        ``dropout``.
    announce_drops : dropped devices tell the server they leave (the phase closes without them at once);
        by default they vanish silently, and the server notices them when they check in again (after
        ``drop_pause``) or their long-poll connection stays closed past ``rounds.disconnect_grace``.
    drop_pause : seconds a dropped device stays away before checking in again (the server then drops it
        from its round and holds the check-in until the round ends).
    cohort : when set, the fleet picks each round's cohort itself: for its k-th round it draws this many
        devices from ``SeedSequence([seed, 11, k])`` and only those check in, so the server's pool (and
        with a seeded server, the round) is the same in every run with the same seed, however the
        event loop schedules the devices.  The server's ``cohort_size`` must equal it.  Unset: every
        device checks in whenever it is free (a load test).  A fleet split over several processes or
        Ray actors draws the same cohorts: each shard runs the same gate over ``fleet_size`` devices.
    fleet_size : devices in the whole fleet when this process runs one shard of it (default: the
        devices given to `run_fleet`).
    rounds_before : rounds with an id up to this one are not the fleet's (set by the process that
        splits a fleet, so that every shard counts the same rounds; default: what the shard's monitor
        sees open or finished when it starts).
    registered_before : devices the server held before the fleet started.  When set, the shards
        register in fleet order (a shard waits until the server holds ``registered_before +
        first_index`` devices), so device ids follow the fleet's order however it is split: the
        devices' seeded generators, keyed by device id, are then the same on every back-end.
    ca_file : PEM file of the CA (or self-signed certificate) that signs an ``https`` server's
        certificate; None uses the system's trusted roots.
    authority_key_file : the operator's enrollment authority key (``fedrec enroll-ca init``; protocol
        1.4).  The fleet then acts as the operator's enrollment service: each device creates its identity
        key, gets a certificate for it (batch ``fleet-<i mod credential_sources>``), pins the authority's
        public key and registers with the certificate; rounds run signed, with the consistency check.
    admin_token : the server's admin token: the fleet asks ``POST /v1/admin/enrollment-tokens`` for one
        one-time enrollment token per device (source ``fleet-<i mod credential_sources>``) and each device
        registers with its token.  Neither set: open registration (a development server on loopback).
    credential_sources : how many credential sources (certificate batches or token batches) the devices
        are spread over, round-robin by fleet index.
    """

    url: str
    store_root: Path
    n_items: int
    bits: int = 64
    rounds: int = 3
    dropout: float = 0.0
    seed: int = 0
    insecure_reproducible: bool = False
    seed_training: bool = False
    privacy: PrivacyPolicy = field(default_factory=PrivacyPolicy.no_floor)
    rating_range: tuple[float, float] | None = (1.0, 5.0)
    binary_positives: bool = True
    time_limit: float = 3600.0
    long_poll_timeout: float = 600.0
    schedule: Callable[[int, int], DropoutAt] | None = None
    announce_drops: bool = False
    drop_pause: float = 1.0
    ca_file: Path | None = None
    cohort: int | None = None
    fleet_size: int | None = None
    rounds_before: int | None = None
    registered_before: int | None = None
    authority_key_file: Path | None = None
    admin_token: str | None = None
    credential_sources: int = 1
    failover_urls: tuple[str, ...] = ()

    @property
    def urls(self) -> tuple[str, ...]:
        """Every server root: ``url`` first, then ``failover_urls``."""
        return (self.url, *self.failover_urls)

    def device_urls(self, index: int) -> list[str]:
        """The roots device ``index`` tries, in order (spread over the instances by index)."""
        urls = self.urls
        first = index % len(urls)
        return [*urls[first:], *urls[:first]]

    def __post_init__(self) -> None:
        if self.authority_key_file is not None and self.admin_token is not None:
            raise ValueError("enroll the fleet by certificate (authority_key_file) or by token (admin_token), not both")
        if self.credential_sources < 1:
            raise ValueError(f"credential_sources must be >= 1, got {self.credential_sources}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")


@dataclass
class FleetReport:
    """What the fleet saw."""

    devices: int
    rounds_finished: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    drops: Counter[str] = field(default_factory=Counter)
    latencies: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in PHASE_STEPS})
    bytes_up: list[int] = field(default_factory=list)
    bytes_down: list[int] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    #: The first message seen for each error type (what a one-line failure report quotes).
    error_examples: dict[str, str] = field(default_factory=dict)
    server_rounds: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    #: Server CPU seconds when the fleet started (so the first round's CPU can be told too).
    cpu_start: float | None = None
    #: (seconds since the fleet started, step, latency seconds) of every phase a device finished.
    latency_series: list[tuple[float, str, float]] = field(default_factory=list)
    #: (unix time, seconds, ok, body) of each ``GET /v1/health`` probe (`fedsim.fleets.server_process.HealthProbe`).
    health: list[tuple[float, float, bool, str]] = field(default_factory=list)
    #: The server's ``/v1/status`` once the fleet stopped (model digest, ledger, process figures).
    final_status: dict[str, Any] | None = None

    def merge(self, other: FleetReport) -> None:
        self.devices += other.devices
        self.outcomes.update(other.outcomes)
        self.drops.update(other.drops)
        for k, v in other.latencies.items():
            self.latencies.setdefault(k, []).extend(v)
        self.bytes_up.extend(other.bytes_up)
        self.bytes_down.extend(other.bytes_down)
        self.errors.update(other.errors)
        for kind, example in other.error_examples.items():
            self.error_examples.setdefault(kind, example)
        self.latency_series.extend(other.latency_series)

    def to_dict(self) -> dict[str, Any]:
        return {
            "devices": self.devices,
            "rounds_finished": self.rounds_finished,
            "outcomes": dict(self.outcomes),
            "drops": dict(self.drops),
            "latencies": self.latencies,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "errors": dict(self.errors),
            "error_examples": self.error_examples,
            "server_rounds": self.server_rounds,
            "seconds": self.seconds,
            "cpu_start": self.cpu_start,
            "latency_series": self.latency_series,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FleetReport:
        rep = cls(devices=int(d["devices"]), rounds_finished=int(d["rounds_finished"]))
        rep.outcomes.update(d["outcomes"])
        rep.drops.update(d["drops"])
        rep.latencies = {k: list(v) for k, v in d["latencies"].items()}
        rep.bytes_up, rep.bytes_down = list(d["bytes_up"]), list(d["bytes_down"])
        rep.errors.update(d["errors"])
        rep.error_examples = dict(d.get("error_examples", {}))
        rep.server_rounds = list(d["server_rounds"])
        rep.seconds = float(d["seconds"])
        rep.cpu_start = d.get("cpu_start")
        rep.latency_series = [(float(t), str(step), float(v)) for t, step, v in d.get("latency_series", [])]
        return rep

    @property
    def committed(self) -> int:
        """Rounds the fleet took part in that the server committed."""
        return sum(1 for r in self.server_rounds if r.get("status") == "committed")

    @property
    def device_errors(self) -> dict[str, int]:
        """Errors the devices hit, by type: everything but the monitor's status reads and the time limit
        (injected drops are outcomes, never errors)."""
        return {k: v for k, v in self.errors.items() if not k.startswith("status:") and k != TIME_LIMIT}

    def failure(self, wanted: int) -> str | None:
        """One line saying why the run failed: fewer than ``wanted`` rounds committed, or devices failed for
        a reason other than an injected drop (None when neither happened)."""
        device_errors = self.device_errors
        if self.committed >= wanted and not device_errors:
            return None
        parts = [f"{self.committed} of {wanted} rounds committed"]
        aborted = [r for r in self.server_rounds if r.get("status") != "committed"]
        if aborted:
            reasons = Counter(str(r.get("reason") or r.get("status")) for r in aborted)
            parts.append("aborted: " + "; ".join(f"{why} ×{n}" for why, n in reasons.most_common(3)))
        if device_errors:
            kind, n = Counter(device_errors).most_common(1)[0]
            example = self.error_examples.get(kind, "")
            parts.append(f"devices failed {n}× with {kind}" + (f" ({example})" if example else ""))
        stopped = (self.final_status or {}).get("stopped")
        if stopped:  # e.g. its privacy budget is spent: it opens no more rounds
            parts.append(f"the server opens no more rounds: {stopped}")
        if TIME_LIMIT in self.errors:
            parts.append(f"the fleet's time limit was reached after {self.seconds:.0f} s")
        return "; ".join(parts)


class _CohortGate:
    """Which devices may check in now (`FleetConfig.cohort`): the seeded cohort of the fleet's next round."""

    def __init__(self, seed: int, cohort: int, n_devices: int) -> None:
        self.seed, self.size, self.n = seed, min(cohort, n_devices), n_devices
        self.finished: set[int] = set()
        self._chosen: tuple[int, frozenset[int]] | None = None
        self._event = asyncio.Event()

    def chosen(self) -> frozenset[int]:
        k = len(self.finished)
        if self._chosen is None or self._chosen[0] != k:
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, 11, k]))
            self._chosen = (k, frozenset(int(i) for i in rng.choice(self.n, size=self.size, replace=False)))
        return self._chosen[1]

    def finish(self, round_id: int) -> None:
        if round_id not in self.finished:
            self.finished.add(round_id)
            self._event.set()
            self._event = asyncio.Event()

    async def wait_turn(self, index: int, stop: asyncio.Event, after: int | None) -> None:
        """Until device ``index`` is in the next round's cohort and round ``after`` (the one it last
        left, if any) has finished: a check-in in flight across a round's end would otherwise land
        in the server's pool for the next round."""
        while not stop.is_set() and (index not in self.chosen() or (after is not None and after not in self.finished)):
            event = self._event
            try:
                await asyncio.wait_for(event.wait(), timeout=1.0)
            except TimeoutError:
                pass


def rounds_so_far(status: dict[str, Any]) -> int:
    """The highest round id a ``/v1/status`` snapshot shows open or finished (0 for none): the rounds a
    fleet starting now does not count as its own."""
    ids = [int(r["round_id"]) for r in status.get("recent_rounds", [])]
    if status.get("round"):
        ids.append(int(status["round"]["round_id"]))
    return max(ids, default=0)


#: Environment variable holding the operator's admin token, sent with the fleet's ``/v1/status`` reads: a
#: server bound to a non-loopback address protects that endpoint by default
#: (``server.protect_operator_endpoints``).
ADMIN_TOKEN_ENV = "FEDREC_ADMIN_TOKEN"


def _operator_headers(admin_token: str | None) -> dict[str, str]:
    token = admin_token if admin_token is not None else os.environ.get(ADMIN_TOKEN_ENV)
    return {"Authorization": f"Bearer {token}"} if token else {}


async def fetch_status(session: Any, url: str | Sequence[str], admin_token: str | None = None) -> dict[str, Any]:
    """GET ``/v1/status`` as JSON (``session`` is an aiohttp ClientSession); with ``admin_token`` (default:
    the ``FEDREC_ADMIN_TOKEN`` environment variable) as the bearer token when one is given.  Several roots
    (instances of one server): the first that answers."""
    import aiohttp

    roots = [url] if isinstance(url, str) else list(url)
    for i, root in enumerate(roots):
        try:
            async with session.get(f"{root}/v1/status", headers=_operator_headers(admin_token)) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise RuntimeError(f"status endpoint answered {resp.status}")
                data: dict[str, Any] = json.loads(text)
                return data
        except (OSError, RuntimeError, aiohttp.ClientError):
            if i == len(roots) - 1:
                raise
    raise ValueError("fetch_status: no server URL given")


def _tls_context(ca_file: Path | None) -> ssl.SSLContext | None:
    """A TLS context trusting ``ca_file`` (None: the system's defaults); an unreadable or non-PEM file
    is a `FedRecError` naming it."""
    if ca_file is None:
        return None
    try:
        return ssl.create_default_context(cafile=str(ca_file))
    except (OSError, ssl.SSLError) as exc:
        raise FedRecError(f"cannot load CA certificates from {ca_file}: {exc.strerror or exc}") from None


def get_status(
    url: str, ca_file: Path | None = None, timeout: float = 10.0, admin_token: str | None = None
) -> dict[str, Any]:
    """GET ``/v1/status`` without an event loop (before a fleet starts, or from a parent process); the
    admin token as in `fetch_status`.

    Raises
    ------
    FedRecError
        The server cannot be reached or does not answer JSON (the message names the URL).
    """
    import urllib.error
    import urllib.request

    context = _tls_context(ca_file)
    target = f"{url.rstrip('/')}/v1/status"
    try:
        request = urllib.request.Request(target, headers=_operator_headers(admin_token))
        with urllib.request.urlopen(request, timeout=timeout, context=context) as resp:  # noqa: S310 - operator URL
            data: dict[str, Any] = json.loads(resp.read())
            return data
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            raise FedRecError(
                f"{target} answered HTTP {exc.code}: the server protects its operator endpoints; set "
                f"{ADMIN_TOKEN_ENV} to the admin token"
            ) from None
        raise FedRecError(f"{target} answered HTTP {exc.code}; is this a fedrec-server?") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise FedRecError(f"cannot reach the server at {url}: {reason}") from None
    except ValueError:
        raise FedRecError(f"{target} did not answer JSON; is this a fedrec-server?") from None


def _record(report: FleetReport, outcome: RoundOutcome, elapsed: float) -> None:
    report.outcomes[str(outcome.status)] += 1
    if outcome.status is RoundStatus.WAITED:
        return
    for step in PHASE_STEPS:
        if step in outcome.timings:
            report.latencies[step].append(outcome.timings[step])
            report.latency_series.append((round(elapsed, 3), step, outcome.timings[step]))
    if outcome.status is RoundStatus.COMMITTED:  # a full round's traffic (model download included)
        report.bytes_up.append(outcome.bytes_up)
        report.bytes_down.append(outcome.bytes_down)


async def run_fleet(
    config: FleetConfig,
    users: Sequence[tuple[NDArray[np.int64], NDArray[np.float64] | None]],
    *,
    first_index: int = 0,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    on_status: Callable[[dict[str, Any]], None] | None = None,
    monitor: bool = True,
) -> tuple[FleetReport, list[DeviceClient]]:
    """Run one device per entry of ``users`` until ``config.rounds`` rounds have finished.

    Parameters
    ----------
    config : fleet behaviour.
    users : each device's (item ids, raw ratings or None).
    first_index : index of ``users[0]`` in the whole fleet (store folder names, dropout choices).
    on_round : called with the server's record of each round that finishes (from ``/v1/status``).
    on_status : called with every ``/v1/status`` snapshot the monitor reads (about once a second), for
        in-round progress.
    monitor : watch ``/v1/status`` and stop when enough rounds finished (one process per fleet
        should monitor; worker shards of a load test may be stopped by a shared deadline instead).

    Returns
    -------
    (report, clients): the clients stay usable offline (their models are on disk) but are closed.
    """
    if config.insecure_reproducible:
        print(INSECURE_NOISE_NOTICE, file=sys.stderr, flush=True)
    with one_blas_thread():  # the devices train in worker threads: one BLAS thread each
        return await _run_fleet(config, users, first_index, on_round, on_status, monitor)


async def _run_fleet(
    config: FleetConfig,
    users: Sequence[tuple[NDArray[np.int64], NDArray[np.float64] | None]],
    first_index: int,
    on_round: Callable[[dict[str, Any]], None] | None,
    on_status: Callable[[dict[str, Any]], None] | None,
    monitor: bool,
) -> tuple[FleetReport, list[DeviceClient]]:
    import aiohttp

    from device_sdk.http import HttpTransport

    report = FleetReport(devices=len(users))
    stop = asyncio.Event()
    start = time.perf_counter()
    tls = _tls_context(config.ca_file)
    connector = aiohttp.TCPConnector(limit=0, force_close=False, ssl=tls if tls is not None else True)
    # Read the authority key before opening the session: a missing or malformed file is then an error
    # with nothing to close.
    authority = EnrollmentAuthority.load(config.authority_key_file) if config.authority_key_file else None
    session = aiohttp.ClientSession(connector=connector)
    clients: list[DeviceClient] = []
    faults: list[FaultyTransport] = []
    joined: dict[int, int] = {}  # device index -> the round it is taking part in
    try:
        for offset, (items, ratings) in enumerate(users):
            client, transport = _new_device(
                config,
                first_index + offset,
                items,
                ratings,
                HttpTransport(config.device_urls(first_index + offset), session=session),
                authority,
                joined,
            )
            faults.append(transport)
            clients.append(client)
        # Register one after the other: device ids then follow the order of ``users``, which makes a
        # seeded run reproducible (the in-process reference registers in the same order); a shard first
        # waits for the shards before it (`FleetConfig.registered_before`).
        if config.registered_before is not None:
            await _wait_registered(session, config, config.registered_before + first_index, stop)
        await _enroll(clients, config, session, authority, first_index)
        gate = None
        if config.cohort is not None:
            if not monitor:
                raise ValueError("a fleet that picks its cohorts (cohort=...) must monitor the server's rounds")
            gate = _CohortGate(config.seed, config.cohort, config.fleet_size or len(clients))
        round_over = asyncio.Event()  # a device saw a round end: the monitor reads the status now
        devices = [
            asyncio.create_task(
                _device_loop(c, faults[i], first_index + i, config, report, stop, start, gate, joined, round_over)
            )
            for i, c in enumerate(clients)
        ]
        monitor_task = (
            asyncio.create_task(_monitor(session, config, report, stop, on_round, on_status, gate, round_over))
            if monitor
            else None
        )
        await _until_done(config, report, stop, devices, monitor_task, first_index, joined)
    finally:
        for c in clients:
            await c.close()
        await session.close()
    report.seconds = time.perf_counter() - start
    return report, clients


def _new_device(
    config: FleetConfig,
    index: int,
    items: NDArray[np.int64],
    ratings: NDArray[np.float64] | None,
    http: Transport,
    authority: EnrollmentAuthority | None,
    joined: dict[int, int],
) -> tuple[DeviceClient, FaultyTransport]:
    """Device ``index`` of the fleet: an unchanged `DeviceClient` whose transport injects the dropouts."""
    holder: dict[str, DeviceClient] = {}
    transport = FaultyTransport(http, _dropout_schedule(config, index, holder, joined), announce=config.announce_drops)

    def rngs(round_id: int, _h: dict[str, DeviceClient] = holder) -> tuple[np.random.Generator, NoiseStream]:
        device_id = int(_h["c"].device_id or 0)
        invite = transport.last_invite
        if config.insecure_reproducible or (invite is not None and invite.round_id == round_id and invite.dp_mu == 0):
            # A round without DP noise reads only its stochastic-rounding coins from the noise stream: a
            # simulation choice, seeded like the training generator (keys and masks never come from it).
            return insecure_seeded_rngs(config.seed, round_id, device_id)
        training, _ = np.random.SeedSequence([config.seed, round_id, device_id]).spawn(2)
        return np.random.default_rng(training), NoiseStream.from_os()

    client = DeviceClient(
        transport,
        ClientConfig(
            store_dir=config.store_root / f"device-{index:06d}",
            long_poll_timeout=config.long_poll_timeout,
            privacy=config.privacy,
            authority_key=authority.public_key if authority is not None else None,
        ),
        items=items,
        ratings=ratings,
        n_items=config.n_items,
        bits=config.bits,
        rating_range=config.rating_range,
        binary_positives=config.binary_positives,
        rng_for_round=rngs if config.insecure_reproducible or config.seed_training else None,
    )
    holder["c"] = client
    return client, transport


async def _until_done(
    config: FleetConfig,
    report: FleetReport,
    stop: asyncio.Event,
    devices: list[asyncio.Task[None]],
    monitor_task: asyncio.Task[None] | None,
    first_index: int,
    joined: dict[int, int],
) -> None:
    """Wait for the fleet to stop (its last round, or the time limit), then wind the device tasks down."""
    tasks = [*devices, *([monitor_task] if monitor_task is not None else [])]
    try:
        await asyncio.wait_for(stop.wait(), timeout=config.time_limit)
    except TimeoutError:
        report.errors[TIME_LIMIT] += 1
    stop.set()
    # Devices still reading the result of a round the fleet counted finish it (their outcome is
    # recorded); devices in any later round are cancelled.
    counted = {r.get("round_id") for r in report.server_rounds}
    finishing = [t for i, t in enumerate(devices) if joined.get(first_index + i) in counted]
    if finishing:
        await asyncio.wait(finishing, timeout=_FINISH_GRACE)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _dropout_schedule(
    config: FleetConfig, index: int, holder: dict[str, DeviceClient], joined: dict[int, int]
) -> Callable[[int], DropoutAt]:
    """Where device ``index`` leaves each round: ``config.schedule`` by (round, device id), or a seeded
    draw of ``config.dropout`` over the phases.  `FaultyTransport` asks once per round, when the
    invitation arrives: the device is in that round from then on (``joined``)."""

    def plan(round_id: int) -> DropoutAt:
        joined[index] = round_id
        if config.schedule is not None:
            return config.schedule(round_id, int(holder["c"].device_id or 0))
        rng = np.random.default_rng(np.random.SeedSequence([config.seed, 7, index, round_id]))
        if config.dropout and rng.random() < config.dropout:
            # An announced drop cannot be a broken connection, which says nothing.
            kinds = _DROPS if not config.announce_drops else _DROPS[:3] + _DROPS[4:]
            return kinds[int(rng.integers(len(kinds)))]
        return DropoutAt.NONE

    return plan


def _source(config: FleetConfig, index: int) -> str:
    return f"fleet-{index % config.credential_sources}"


async def _enroll(
    clients: list[DeviceClient],
    config: FleetConfig,
    session: Any,
    authority: EnrollmentAuthority | None,
    first_index: int,
) -> None:
    """Register every device with a credential obtained as a real fleet would: a certificate of the
    operator's enrollment authority, or a one-time token the operator issued (the fleet plays the
    operator with the admin token); open registration only when neither is configured."""
    if config.admin_token is None:
        for i, c in enumerate(clients):
            cert = authority.issue(c.identity_public_key, _source(config, first_index + i)) if authority else None
            await c.register(certificate=cert)
        return
    todo = [c for c in clients if c.device_id is None]
    by_source: dict[str, list[DeviceClient]] = {}
    for i, c in enumerate(clients):
        if c.device_id is None:
            by_source.setdefault(_source(config, first_index + i), []).append(c)
    tokens: dict[int, str] = {}
    for label, members in by_source.items():
        for start in range(0, len(members), 10_000):
            chunk = members[start : start + 10_000]
            async with session.post(
                f"{config.url.rstrip('/')}/v1/admin/enrollment-tokens",
                json={"count": len(chunk), "source": label},
                headers={"Authorization": f"Bearer {config.admin_token}", "Accept": "application/json"},
            ) as resp:
                if resp.status != 201:
                    raise FedRecError(f"the server refused to issue enrollment tokens: HTTP {resp.status}")
                issued = (await resp.json())["tokens"]
            tokens.update({id(c): t for c, t in zip(chunk, issued, strict=True)})
    for c in clients:  # one after the other, in fleet order: device ids follow ``users``
        await c.register(enrollment_token=tokens.get(id(c)) if c in todo else None)


async def _wait_registered(session: Any, config: FleetConfig, count: int, stop: asyncio.Event) -> None:
    """Until the server holds ``count`` registered devices (the shards before this one registered)."""
    deadline = time.monotonic() + config.time_limit
    while True:
        status = await fetch_status(session, config.urls)
        if int(status.get("registered_devices") or 0) >= count:
            return
        if time.monotonic() > deadline:
            raise FedRecError(f"the fleet's earlier shards did not register {count} devices in time")
        await _sleep(stop, 0.1)


async def _device_loop(
    client: DeviceClient,
    faults: FaultyTransport,
    index: int,
    config: FleetConfig,
    report: FleetReport,
    stop: asyncio.Event,
    start: float,
    gate: _CohortGate | None = None,
    joined: dict[int, int] | None = None,
    round_over: asyncio.Event | None = None,
) -> None:
    backoff = 0.5
    left: int | None = None  # the round this device dropped out of (gated fleets wait for its end)
    while not stop.is_set():
        if gate is not None:
            await gate.wait_turn(index, stop, left)
            if stop.is_set():
                return
        try:
            outcome = await client.run_round()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a load test counts every error type and keeps going
            if joined is not None:
                joined.pop(index, None)
            report.errors[type(exc).__name__] += 1
            report.error_examples.setdefault(type(exc).__name__, " ".join(str(exc).split())[:200])
            await _sleep(stop, backoff)
            backoff = min(backoff * 2, 10.0)
            continue
        if joined is not None:
            joined.pop(index, None)
        backoff = 0.5
        _record(report, outcome, time.perf_counter() - start)
        if round_over is not None and outcome.status in _FINISHED:
            round_over.set()
        if gate is not None and outcome.round_id is not None:
            if outcome.status in _FINISHED:
                gate.finish(outcome.round_id)
            elif outcome.status in (RoundStatus.DROPPED, RoundStatus.REFUSED):
                left = outcome.round_id
        if outcome.status is RoundStatus.DROPPED and outcome.round_id is not None:
            report.drops[faults.dropout_of(outcome.round_id).value] += 1
            await _sleep(stop, config.drop_pause)
        if outcome.status is RoundStatus.WAITED:
            await _sleep(stop, outcome.retry_after or 1.0)


async def _sleep(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except TimeoutError:
        pass


async def _monitor(
    session: Any,
    config: FleetConfig,
    report: FleetReport,
    stop: asyncio.Event,
    on_round: Callable[[dict[str, Any]], None] | None,
    on_status: Callable[[dict[str, Any]], None] | None = None,
    gate: _CohortGate | None = None,
    round_over: asyncio.Event | None = None,
) -> None:
    seen: set[int] = set()
    # Rounds that finished or were already open when the fleet started belong to someone else (an
    # earlier fleet's leftover invitations): they are neither counted nor reported.
    last_foreign: int | None = config.rounds_before
    while not stop.is_set():
        try:
            status = await fetch_status(session, config.urls)
        except Exception as exc:  # the server may be busy unmasking; try again shortly
            report.errors[f"status: {type(exc).__name__}"] += 1
            await _sleep(stop, 1.0)
            continue
        finished = [r for r in status.get("recent_rounds", []) if r.get("status") in ("committed", "aborted")]
        if last_foreign is None:
            last_foreign = rounds_so_far(status)
        if report.cpu_start is None:
            report.cpu_start = (status.get("process") or {}).get("cpu_seconds")
        if on_status is not None:
            on_status(status)
        for rec in sorted(finished, key=lambda r: r["round_id"]):
            rid = rec["round_id"]
            if rid in seen or rid <= last_foreign:
                continue
            seen.add(rid)
            if gate is not None:
                gate.finish(rid)
            rec = {**rec, "process": status.get("process"), "privacy": status.get("privacy")}
            report.server_rounds.append(rec)
            report.rounds_finished += 1
            if on_round is not None:
                on_round(rec)
        if report.rounds_finished >= config.rounds or status.get("stopped"):
            stop.set()
            return
        # Once a second, or at once when a device saw a round end (a fast round is then not overrun).
        if round_over is None:
            await _sleep(stop, _MONITOR_EVERY)
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(round_over.wait(), timeout=_MONITOR_EVERY)
            round_over.clear()
