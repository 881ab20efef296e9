"""The parts of `RoundCoordinator.status` (GET /v1/status, the dashboard, the /metrics gauges) that are
read from the open round, the storage and the process: plain JSON values only.

Invariants:
- Every value is JSON-able: records become dicts, and a non-finite float becomes None (the status page
  is served as strict JSON).
- Nothing here changes state: the storage is only read.
"""

from __future__ import annotations

import dataclasses
import math
import resource
from typing import Any, Protocol

from agg_server.storage import Storage
from protocol.phases import ACTIVE_PHASES
from protocol.session import ServerSecAggSession

__all__ = ["open_round_status", "recent_rounds", "process_stats"]


class OpenRoundView(Protocol):
    """What the snapshot reads of the coordinator's open round."""

    round_id: int
    session: ServerSecAggSession
    cohort: tuple[int, ...]
    alive: set[int]
    started: float
    finishing: bool


def open_round_status(r: OpenRoundView, now: float) -> dict[str, Any]:
    """The open round: its phase ("finishing" once UNMASK closed), sizes, age and dropouts per phase."""
    return {
        "round_id": r.round_id,
        "phase": "finishing" if r.finishing else r.session.phase.value,
        "cohort": len(r.cohort),
        "alive": len(r.alive),
        "awaiting": len(r.session.expected()) if r.session.phase in ACTIVE_PHASES and not r.finishing else 0,
        "seconds": round(now - r.started, 3),
        "dropouts": {p.value: len(v) for p, v in r.session.dropouts.items()},
    }


def recent_rounds(storage: Storage, limit: int) -> list[dict[str, Any]]:
    """The ``limit`` newest rounds, newest first, each with its recorded phases."""
    return [
        {**rec, "phases": _records(storage.phase_stats(rec["round_id"]))}
        for rec in _records(storage.recent_rounds(limit))
    ]


def process_stats() -> dict[str, float]:
    """CPU seconds and peak resident memory of this process."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    # ru_maxrss is in kilobytes on Linux.
    return {"cpu_seconds": usage.ru_utime + usage.ru_stime, "max_rss_mb": usage.ru_maxrss / 1024.0}


def _records(records: Any) -> list[dict[str, Any]]:
    out = []
    for rec in records:
        d = dataclasses.asdict(rec) if dataclasses.is_dataclass(rec) and not isinstance(rec, type) else dict(rec)
        out.append({k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in d.items()})
    return out
