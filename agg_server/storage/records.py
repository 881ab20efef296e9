"""Row types of the server's database (what `agg_server.storage.Storage` returns)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

__all__ = [
    "COHORT_PHASE",
    "RoundStatus",
    "CheckpointStatus",
    "ParticipationStatus",
    "RoundRecord",
    "PhaseRecord",
    "CheckpointRecord",
    "QualityRecord",
    "LeaseRecord",
]

COHORT_PHASE = "cohort"
"""Participation phase under which `Storage.start_round` records the invited cohort."""


class RoundStatus(StrEnum):
    """Lifecycle of a round row."""

    OPEN = "open"
    COMMITTED = "committed"
    ABORTED = "aborted"
    ABANDONED = "abandoned"  # open when the server stopped; see `Storage.abandon_open_rounds`


class CheckpointStatus(StrEnum):
    """Whether a checkpoint file can still be trusted."""

    GOOD = "good"
    CORRUPT = "corrupt"


class ParticipationStatus(StrEnum):
    """What one device did in one phase of a round."""

    OK = "ok"
    DROPPED = "dropped"


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundRecord:
    """One stored round.

    Attributes
    ----------
    round_id : int
    started_at, finished_at : float, float or None
        Coordinator clock in seconds; ``finished_at`` is None while the round is open.
    status : RoundStatus
    reason : str
        Why the round aborted or was abandoned ("" otherwise).
    base_model_version : int
        Model version the cohort trained.
    new_model_version : int or None
        Version committed by the round, if it committed.
    cohort_size : int
        Devices invited.
    survivors : int or None
        Devices whose input made it into the sum.
    epsilon_spent : float or None
        Privacy ledger's ε after the round, if DP is on.
    params : dict[str, Any]
        The round's parameters as given to `Storage.start_round`.
    cohort : int
        The cohort the round belongs to (0 on a single instance).
    revealed : bool
        The UNMASK phase was opened: the sum could be learned, so the round stays charged.
    """

    round_id: int
    started_at: float
    finished_at: float | None
    status: RoundStatus
    reason: str
    base_model_version: int
    new_model_version: int | None
    cohort_size: int
    survivors: int | None
    epsilon_spent: float | None
    params: dict[str, Any]
    cohort: int = 0
    revealed: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseRecord:
    """Timing and head-count of one closed phase of a round.

    Attributes
    ----------
    round_id : int
    phase : str
        Phase name (a `protocol.session.Phase` value).
    seconds : float
        How long the phase was open.
    arrived, dropped : int
        Devices that answered in time, devices dropped in this phase.
    """

    round_id: int
    phase: str
    seconds: float
    arrived: int
    dropped: int


@dataclass(frozen=True, slots=True, kw_only=True)
class QualityRecord:
    """A quality figure an operator's evaluation job reported for one model version.

    Attributes
    ----------
    model_version : int
    metric : str
        e.g. "hr@10".
    dataset : str
        What it was measured on, e.g. "ml-100k holdout".
    value : float
    reported_at : float
        Coordinator clock at the report, in seconds.
    """

    model_version: int
    metric: str
    dataset: str
    value: float
    reported_at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointRecord:
    """One stored model checkpoint.

    Attributes
    ----------
    model_version : int
    round_id : int or None
        Round that produced it (None for the initial model).
    path : Path
        Absolute path of the file.
    sha256 : bytes
        Digest of the file's bytes at commit time (32 bytes).
    size : int
        File size in bytes at commit time.
    created_at : float
    status : CheckpointStatus
    """

    model_version: int
    round_id: int | None
    path: Path
    sha256: bytes
    size: int
    created_at: float
    status: CheckpointStatus


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseRecord:
    """Which instance leads a cohort (`Storage.acquire_lease`).

    Attributes
    ----------
    cohort : int
    holder : str
        The leading instance's id (``storage.instance_id``).
    url : str
        Where the other instances forward the cohort's device requests (``storage.advertise_url``).
    token : int
        Fencing token: grows by one at every acquisition; writes of a round carry the token of its leader.
    expires_at : float
        Time after which another instance may take the cohort over, by the database's clock.
    expires_in : float
        Seconds left until then, by the database's clock when the row was read (negative: expired);
        the one figure an instance compares with its own clock (hosts' clocks may differ).
    """

    cohort: int
    holder: str
    url: str
    token: int
    expires_at: float
    expires_in: float = 0.0
