"""Several server instances on one database: who leads which device cohort, and how a device's request
reaches the leader of its cohort whichever instance it talked to (docs/operations.md "Several
instances").

Invariants:
- Devices are split into ``storage.cohorts`` cohorts by id: device d is in cohort ``(d - 1) mod cohorts``.
  Each cohort runs its own rounds; one instance leads it at a time, under a lease in the database
  (`Storage.acquire_lease`) whose fencing token every write of its rounds carries.
- An instance hosts ``storage.cohorts_per_instance`` round coordinators ("slots"); `LeaseKeeper` renews
  the held leases every third of ``storage.lease_seconds`` and gives free slots the cohorts whose lease
  expired (a dead instance's cohorts) or that this very instance held before a restart.  A slot whose
  renewal fails for a whole lease period, or whose token was superseded, drops its round unwritten.
- A device's every request (check-in, model download, round uploads) is served by the leader of its
  cohort.  Any other instance forwards the request there unchanged (the leader authenticates it again)
  and relays the answer: a device may be pointed at any instance.  A forwarded request is never
  forwarded again (``X-Fedrec-Forwarded``); without a live leader a check-in is told to wait and any other
  request gets 503 with Retry-After, which device transports retry.
- Nothing here decides a round: the coordinators do.  Every call into `LeaseKeeper` and every database
  call runs on the server's state thread, like the coordinators' own (`agg_server.app`); `route` and
  `unrenewed` only read attributes and may be called from the event loop.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agg_server.config import ServerConfig
from agg_server.coordinator import RoundCoordinator
from agg_server.storage import LeaseRecord, Storage
from protocol.errors import StorageError

__all__ = ["LeaseKeeper", "cohort_of", "FORWARDED_HEADER", "instance_name", "advertised_url"]

log = logging.getLogger("agg_server.cluster")

FORWARDED_HEADER = "X-Fedrec-Forwarded"
_LEASE_REFRESH = 1.0  # seconds between reads of the lease table (routing) and tries to fill free slots


def cohort_of(device_id: int, cohorts: int) -> int:
    """The cohort of a device (device ids start at 1)."""
    return (int(device_id) - 1) % cohorts


def instance_name(config: ServerConfig) -> str:
    """``storage.instance_id``, or the host name and data directory (unique per machine and folder)."""
    if config.storage.instance_id:
        return config.storage.instance_id
    return f"{socket.gethostname()}:{config.data_dir.resolve()}"


def advertised_url(config: ServerConfig) -> str:
    """``storage.advertise_url``, or ``http(s)://host:port`` from ``[server]`` ("" for port 0)."""
    if config.storage.advertise_url:
        return config.storage.advertise_url.rstrip("/")
    listen = config.listen
    if not listen.port:
        return ""
    scheme = "https" if listen.tls_cert is not None else "http"
    host = listen.host if ":" not in listen.host else f"[{listen.host}]"
    return f"{scheme}://{host}:{listen.port}"


@dataclass(frozen=True, slots=True)
class Route:
    """Where a device's requests go: a local coordinator, or another instance's URL (``url``), or
    nowhere yet (``reason`` says why)."""

    local: RoundCoordinator | None = None
    url: str = ""
    reason: str = ""


class LeaseKeeper:
    """The leases of one instance and the routing of device requests to their cohort's leader.

    Parameters
    ----------
    config : the server configuration (``storage.*`` keys).
    storage : the instance's storage.
    slots : the instance's round coordinators (created with ``leased=True``).
    """

    def __init__(self, config: ServerConfig, storage: Storage, slots: Sequence[RoundCoordinator]) -> None:
        self.storage = storage
        self.slots = list(slots)
        self.cohorts = config.storage.cohorts
        self.ttl = config.storage.lease_seconds
        self.instance = instance_name(config)
        self.url = advertised_url(config)
        self._until: dict[int, float] = {}  # slot index -> local expiry of its lease
        self._renewed = float("-inf")
        self._looked = float("-inf")
        self._leases: dict[int, LeaseRecord] = {}
        self._unrenewed: dict[int, str] = {}  # cohort -> why its last renewal failed (readiness)

    def claim_instance_id(self) -> None:
        """Refuse to run (`StorageError`) while another live process uses this instance's id: the two would
        take each other's leases every second."""
        self.storage.claim_instance(self.instance)

    def step(self, now: float, *, force: bool = False) -> None:
        """Renew held leases (every third of their length), drop lost ones, fill free slots."""
        if force or now - self._renewed >= self.ttl / 3:
            self._renewed = now
            for i, slot in enumerate(self.slots):
                if slot.fence is None:
                    continue
                cohort, token = slot.fence
                try:
                    kept = self.storage.renew_lease(cohort, token, now, self.ttl)
                except StorageError as exc:
                    log.warning("could not renew the lease of cohort %d: %s", cohort, exc)
                    self._unrenewed[cohort] = f"the lease of cohort {cohort} could not be renewed: {exc}"
                    kept = now < self._until.get(i, now)
                    if not kept:
                        slot.lose_lease(now, f"the lease of cohort {cohort} expired (database unreachable)")
                    continue
                self._unrenewed.pop(cohort, None)
                if kept:
                    self._until[i] = now + self.ttl
                else:
                    slot.lose_lease(now, f"cohort {cohort} is led by another instance now")
        if force or now - self._looked >= _LEASE_REFRESH:
            self._looked = now
            try:
                # Expiry rebased on this host's clock from the seconds left by the database's clock: hosts'
                # clocks may differ, the durations agree.
                self._leases = {
                    lease.cohort: dataclasses.replace(lease, expires_at=now + lease.expires_in)
                    for lease in self.storage.leases()
                }
                self._fill(now)
            except StorageError as exc:
                log.warning("could not read the cohort leases: %s", exc)

    def _fill(self, now: float) -> None:
        free = [i for i, s in enumerate(self.slots) if s.fence is None and not s.stopped_reason]
        if not free:
            return
        held = {s.cohort for s in self.slots if s.cohort is not None}
        # Own leases first (a restart takes its cohorts back at once), then unled or expired ones.
        order = sorted(range(self.cohorts), key=lambda c: (self._owner(c) != self.instance, c))
        for cohort in order:
            if not free:
                return
            lease = self._leases.get(cohort)
            if cohort in held:
                continue
            if lease is not None and lease.holder not in ("", self.instance) and lease.expires_at > now:
                continue
            got = self.storage.acquire_lease(cohort, self.instance, self.url, now, self.ttl)
            if got is None:
                continue
            token, abandoned = got
            self._leases[cohort] = LeaseRecord(
                cohort=cohort, holder=self.instance, url=self.url, token=token, expires_at=now + self.ttl
            )
            i = free.pop(0)
            self.slots[i].take_lease(cohort, token, abandoned)
            self._until[i] = now + self.ttl
            held.add(cohort)
        if any(c >= self.cohorts for c in self._leases):
            log.error(
                "the database has leases for cohorts up to %d but storage.cohorts = %d on this instance: every "
                "instance must use the same storage.cohorts",
                max(self._leases),
                self.cohorts,
            )

    def _owner(self, cohort: int) -> str:
        lease = self._leases.get(cohort)
        return "" if lease is None else lease.holder

    def route(self, device_id: int, now: float) -> Route:
        """Where the requests of ``device_id`` are served."""
        cohort = cohort_of(device_id, self.cohorts)
        for slot in self.slots:
            if slot.cohort == cohort:
                return Route(local=slot)
        lease = self._leases.get(cohort)
        if lease is None or lease.expires_at <= now or not lease.holder:
            return Route(reason=f"cohort {cohort} has no leader yet")
        if lease.holder == self.instance:
            return Route(reason=f"cohort {cohort} is changing hands")
        if not lease.url:
            return Route(reason=f"the leader of cohort {cohort} ({lease.holder}) advertises no URL")
        return Route(url=lease.url)

    def unrenewed(self) -> list[str]:
        """Why held leases could not be renewed at their last try (empty: all renewed); for `/v1/ready`."""
        held = {s.cohort for s in self.slots}
        return [why for cohort, why in list(self._unrenewed.items()) if cohort in held]

    def release_all(self) -> None:
        """Give every held lease up (graceful shutdown): other instances take the cohorts at once."""
        for slot in self.slots:
            if slot.fence is None:
                continue
            cohort, token = slot.fence
            try:
                self.storage.release_lease(cohort, token)
            except StorageError as exc:
                log.warning("could not release the lease of cohort %d: %s", cohort, exc)
            slot.fence = None

    def describe(self, now: float, head: int | None = None) -> dict[str, Any]:
        """The ``cluster`` part of `/v1/status`: this instance and its slots, and the cluster's view —
        ``model_version`` (``head``: the newest model any instance committed) and ``leaders`` (every
        cohort's leader by the lease table as last read, None while a cohort has no live leader)."""
        leaders = []
        for cohort in range(self.cohorts):
            lease = self._leases.get(cohort)
            live = lease is not None and bool(lease.holder) and lease.expires_at > now
            leaders.append(
                {
                    "cohort": cohort,
                    "leader": lease.holder if live and lease is not None else None,
                    "url": (lease.url or None) if live and lease is not None else None,
                    "here": any(s.cohort == cohort for s in self.slots),
                }
            )
        return {
            "instance": self.instance,
            "url": self.url,
            "model_version": head,
            "leaders": leaders,
            "cohorts": self.cohorts,
            "slots": [
                {
                    "cohort": s.cohort,
                    "token": None if s.fence is None else s.fence[1],
                    "model_version": s.model_version,
                    "round": None if s.open_round is None else s.open_round.round_id,
                    "stopped": s.stopped_reason or None,
                }
                for s in self.slots
            ],
            "leases": [
                {
                    "cohort": lease.cohort,
                    "holder": lease.holder,
                    "token": lease.token,
                    "expires_in": round(lease.expires_at - now, 3),
                }
                for lease in self._leases.values()
            ],
        }
