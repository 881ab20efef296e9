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
from collections.abc import Mapping
from typing import Any, Protocol

from agg_server.storage import Storage
from protocol.phases import ACTIVE_PHASES, Phase
from protocol.session import ServerSecAggSession

__all__ = ["PHASE_ENDINGS", "closed_phase_endings", "open_round_status", "recent_rounds", "process_stats"]

#: How a phase ended (the coordinator's "phase" event, ``/v1/status``, the load test's report):
#: "all_answered": every device still taking part answered; "drops_detected": it closed before its deadline
#: once everyone left had answered, some devices having been dropped (connection gone past
#: ``rounds.disconnect_grace``, checked in again, an announced leave, a protocol error); "deadline": its
#: deadline closed it (a silent device was waited for); "aborted": the round aborted in or before it.
PHASE_ENDINGS = ("all_answered", "drops_detected", "deadline", "aborted")


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


def closed_phase_endings(first: Phase, session: ServerSecAggSession, cause: str) -> dict[Phase, str]:
    """How each phase from ``first`` up to the session's current one ended (`PHASE_ENDINGS`), when
    ``cause`` closed them: "deadline" (the clock), "drops_detected" (the server dropped a device) or
    "all_answered" (an upload); the phases an abort skipped are "aborted"."""
    order = list(ACTIVE_PHASES)
    if first not in order:
        return {}
    at = session.phase
    stop = order.index(at) if at in order and not session.finishing else len(order)
    aborted = at in (Phase.ABORTED, Phase.ERROR)
    out = {}
    for i, p in enumerate(order[order.index(first) : stop]):
        if cause == "deadline" and (i == 0 or not aborted):
            out[p] = "deadline"
        elif aborted:
            out[p] = "aborted"
        else:
            out[p] = "drops_detected" if session.dropouts.get(p) else "all_answered"
    return out


def recent_rounds(
    storage: Storage, limit: int, phase_ends: Mapping[int, Mapping[str, str]] | None = None
) -> list[dict[str, Any]]:
    """The ``limit`` newest rounds, newest first, each with its recorded phases; each phase's ``ended``
    is how it closed (``phase_ends[round_id][phase]``, the coordinator's memory of its recent rounds),
    or None for a round this process did not run."""
    ends = phase_ends or {}
    out = []
    for rec in _records(storage.recent_rounds(limit)):
        known = ends.get(rec["round_id"], {})
        phases = [{**ph, "ended": known.get(ph["phase"])} for ph in _records(storage.phase_stats(rec["round_id"]))]
        out.append({**rec, "phases": phases})
    return out


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
