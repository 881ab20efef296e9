"""The aggregation server's durable state, split along its seams:

* `agg_server.storage.database` — the back-ends (SQLite, the embedded default; PostgreSQL for several
  instances), the one schema and its migrations;
* `agg_server.storage.checkpoints` — the model checkpoint files (written with `protocol.atomic`, the
  helper the device store shares);
* `agg_server.storage.repository` — `Storage`, the facade over every query the server makes, one base
  class per table family: `agg_server.storage.devices` (devices, enrollment tokens),
  `agg_server.storage.revocation` (revocation lists), `agg_server.storage.rounds` (rounds, cohort
  leases, participation), `agg_server.storage.ledger` (the privacy ledger) and
  `agg_server.storage.models` (checkpoints, strategy state, quality), over `agg_server.storage.base`
  (the connection plumbing and argument checks they share);
* `agg_server.storage.records` — the row types it returns.

``from agg_server.storage import Storage`` (and the names below) is the public import.
"""

from __future__ import annotations

from agg_server.storage.database import (
    DATABASE_NAME,
    SCHEMA_VERSION,
    DatabaseHealth,
    DatabaseUnavailable,
    Timeouts,
    mask_secrets,
    redact_url,
)
from agg_server.storage.records import (
    COHORT_PHASE,
    CheckpointRecord,
    CheckpointStatus,
    LeaseRecord,
    ParticipationStatus,
    PhaseRecord,
    QualityRecord,
    RoundRecord,
    RoundStatus,
)
from agg_server.storage.repository import HeadMoved, LeaseLost, Storage

__all__ = [
    "SCHEMA_VERSION",
    "DATABASE_NAME",
    "COHORT_PHASE",
    "RoundStatus",
    "CheckpointStatus",
    "ParticipationStatus",
    "RoundRecord",
    "PhaseRecord",
    "CheckpointRecord",
    "QualityRecord",
    "Storage",
    "LeaseRecord",
    "LeaseLost",
    "HeadMoved",
    "redact_url",
    "mask_secrets",
    "Timeouts",
    "DatabaseHealth",
    "DatabaseUnavailable",
]
