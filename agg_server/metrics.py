"""Prometheus metrics of the aggregation server, written by hand in text exposition format 0.0.4.

Invariants:
- No dependency on ``prometheus_client``: counters and histograms are plain numbers in one `Metrics`
  object per app (no module-level registry), fed by the coordinator's round events
  (`Metrics.on_round_event`, registered in ``RoundCoordinator.listeners``) and by the request
  middleware (`Metrics.observe_request`).  Gauges are read from the coordinator's status at scrape
  time, so they cannot drift from ``/v1/status``.
- Label cardinality is bounded: ``route`` is the route's canonical template (``/v1/rounds/{round_id}/keys``)
  or "unmatched", never the raw path; ``status`` is an HTTP status; ``code`` is a `protocol.errors`
  code; ``phase`` and ``outcome`` come from fixed lists.
- ``fedrec_rounds_total`` starts from the rounds stored in the database (a restarted server keeps
  counting where it stopped), so it always equals ``/v1/status``'s ``rounds``.  Histograms and the
  other counters start at zero with the process, as Prometheus counters do.
- Every label value is escaped (backslash, double quote, newline); every family has HELP and TYPE.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from protocol.session import ACTIVE_PHASES

__all__ = [
    "CONTENT_TYPE",
    "PHASES",
    "OUTCOMES",
    "PHASE_BUCKETS",
    "ROUND_BUCKETS",
    "Histogram",
    "Metrics",
    "escape_label_value",
    "format_value",
]

#: Content type of the exposition (text format 0.0.4).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: SecAgg phases, in protocol order (the ``phase`` label values).
PHASES: tuple[str, ...] = tuple(p.value for p in ACTIVE_PHASES)

#: Round outcomes (the ``outcome`` label values).
OUTCOMES: tuple[str, ...] = ("committed", "aborted", "abandoned")

#: Upper bounds (seconds) of the per-phase histogram: phases close in milliseconds on loopback and
#: at their deadline (tens of seconds to minutes) when devices vanish.
PHASE_BUCKETS: tuple[float, ...] = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

#: Upper bounds (seconds) of the whole-round histogram.
ROUND_BUCKETS: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


def escape_label_value(value: str) -> str:
    """Escape a label value for the text format: backslash, double quote and line feed."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def format_value(value: float) -> str:
    """A sample value as the text format writes it (``+Inf``, ``-Inf``, ``NaN``, integers without ``.0``)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def _labels(pairs: Sequence[tuple[str, str]]) -> str:
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{escape_label_value(v)}"' for k, v in pairs) + "}"


class Histogram:
    """Cumulative-bucket histogram of non-negative observations.

    Parameters
    ----------
    buckets : Sequence[float]
        Finite, strictly increasing upper bounds; ``+Inf`` is implied.

    Raises
    ------
    ValueError
        Bounds that are empty, not finite or not strictly increasing.
    """

    def __init__(self, buckets: Sequence[float]) -> None:
        bounds = tuple(float(b) for b in buckets)
        if not bounds or any(not math.isfinite(b) for b in bounds):
            raise ValueError(f"histogram buckets must be finite and non-empty, got {buckets!r}")
        if any(a >= b for a, b in zip(bounds, bounds[1:], strict=False)):
            raise ValueError(f"histogram buckets must be strictly increasing, got {buckets!r}")
        self.bounds = bounds
        self.counts = [0] * len(bounds)  # per bucket, not cumulative
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        """Count one observation (NaN is ignored: it has no bucket)."""
        if math.isnan(value):
            return
        i = bisect.bisect_left(self.bounds, value)  # first bound >= value: "le" is inclusive
        if i < len(self.counts):
            self.counts[i] += 1
        self.sum += value
        self.count += 1

    def samples(self, name: str, labels: Sequence[tuple[str, str]] = ()) -> Iterable[str]:
        """The ``_bucket`` (cumulative), ``_sum`` and ``_count`` lines."""
        running = 0
        for bound, n in zip(self.bounds, self.counts, strict=True):
            running += n
            yield f"{name}_bucket{_labels([*labels, ('le', format_value(bound))])} {running}"
        yield f"{name}_bucket{_labels([*labels, ('le', '+Inf')])} {self.count}"
        yield f"{name}_sum{_labels(labels)} {format_value(self.sum)}"
        yield f"{name}_count{_labels(labels)} {self.count}"


class Metrics:
    """Every metric of one server.

    Parameters
    ----------
    round_counts : Mapping[str, int], optional
        Rounds already in the database by status (``Storage.round_counts()``); seeds
        ``fedrec_rounds_total`` so that it survives restarts.
    """

    def __init__(self, round_counts: Mapping[str, int] | None = None) -> None:
        self.rounds: Counter[str] = Counter({o: 0 for o in OUTCOMES})
        for outcome, n in (round_counts or {}).items():
            if outcome in OUTCOMES:
                self.rounds[outcome] = int(n)
        self.phase_seconds = {p: Histogram(PHASE_BUCKETS) for p in PHASES}
        self.round_seconds = Histogram(ROUND_BUCKETS)
        self.phase_dropouts: Counter[str] = Counter({p: 0 for p in PHASES})
        self.devices: dict[str, int] = {p: 0 for p in PHASES}
        self.http_requests: Counter[tuple[str, str]] = Counter()
        self.http_errors: Counter[str] = Counter()
        self.request_bytes = 0
        self.response_bytes = 0

    # -- inputs -----------------------------------------------------------------------------------

    def on_round_event(self, event: str, fields: Mapping[str, Any]) -> None:
        """A `RoundCoordinator` listener: count rounds, time phases, follow the open round's devices."""
        if event == "round_opened":
            self.devices = {p: 0 for p in PHASES}
            self.devices[PHASES[0]] = int(fields["cohort"])
        elif event == "phase":
            phase = str(fields["phase"])
            if phase not in self.phase_seconds:
                return
            self.phase_seconds[phase].observe(float(fields["seconds"]))
            self.phase_dropouts[phase] += int(fields["dropped"])
            alive = int(fields["alive"])
            self.devices[phase] = alive
            i = PHASES.index(phase)
            if i + 1 < len(PHASES):
                self.devices[PHASES[i + 1]] = alive  # who enters the next phase
        elif event == "round_finished":
            outcome = str(fields["outcome"])
            if outcome in OUTCOMES:
                self.rounds[outcome] += 1
            if outcome != "abandoned":  # a shutdown cuts a round short: its length says nothing
                self.round_seconds.observe(float(fields["seconds"]))
            self.devices = {p: 0 for p in PHASES}

    def observe_request(
        self, route: str, status: int, request_bytes: int, response_bytes: int, error_code: str | None
    ) -> None:
        """Count one finished HTTP request (``route`` must be a template, never a raw path)."""
        self.http_requests[(route, str(status))] += 1
        self.request_bytes += max(0, int(request_bytes))
        self.response_bytes += max(0, int(response_bytes))
        if error_code is not None:
            self.http_errors[error_code] += 1

    # -- output -----------------------------------------------------------------------------------

    def render(self, status: Mapping[str, Any]) -> str:
        """The exposition text; ``status`` is ``RoundCoordinator.status(now)`` (read for the gauges)."""
        out: list[str] = []

        def family(name: str, kind: str, help_text: str) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")

        def sample(name: str, value: float, labels: Sequence[tuple[str, str]] = ()) -> None:
            out.append(f"{name}{_labels(labels)} {format_value(value)}")

        family("fedrec_rounds_total", "counter", "Rounds finished, by outcome (committed, aborted, abandoned).")
        for outcome in OUTCOMES:
            sample("fedrec_rounds_total", self.rounds[outcome], [("outcome", outcome)])

        family("fedrec_phase_seconds", "histogram", "How long each SecAgg phase of a round was open, in seconds.")
        for phase in PHASES:
            out.extend(self.phase_seconds[phase].samples("fedrec_phase_seconds", [("phase", phase)]))

        family("fedrec_round_seconds", "histogram", "Length of committed and aborted rounds, from opening to the end.")
        out.extend(self.round_seconds.samples("fedrec_round_seconds"))

        family(
            "fedrec_devices",
            "gauge",
            "Devices of the open round still alive in each phase (0 for phases not reached and when no round is open).",
        )
        for phase in PHASES:
            sample("fedrec_devices", self.devices[phase], [("phase", phase)])

        family("fedrec_phase_dropouts_total", "counter", "Devices dropped from a round, by the phase they missed.")
        for phase in PHASES:
            sample("fedrec_phase_dropouts_total", self.phase_dropouts[phase], [("phase", phase)])

        family("fedrec_http_requests_total", "counter", "HTTP requests answered, by route template and status.")
        for (route, code), n in sorted(self.http_requests.items()):
            sample("fedrec_http_requests_total", n, [("route", route), ("status", code)])

        family("fedrec_http_errors_total", "counter", "HTTP error answers, by fedrec error code.")
        for code, n in sorted(self.http_errors.items()):
            sample("fedrec_http_errors_total", n, [("code", code)])

        family("fedrec_http_request_bytes_total", "counter", "Request body bytes received.")
        sample("fedrec_http_request_bytes_total", self.request_bytes)
        family("fedrec_http_response_bytes_total", "counter", "Response body bytes sent.")
        sample("fedrec_http_response_bytes_total", self.response_bytes)

        privacy = status.get("privacy")
        if privacy is not None:
            family("fedrec_privacy_epsilon_spent", "gauge", "Privacy loss epsilon spent so far (at delta).")
            sample("fedrec_privacy_epsilon_spent", float(privacy["epsilon_spent"]))
            family("fedrec_privacy_epsilon_budget", "gauge", "Privacy budget epsilon of the whole run.")
            sample("fedrec_privacy_epsilon_budget", float(privacy["epsilon_budget"]))

        family("fedrec_model_version", "gauge", "Version of the current global model.")
        sample("fedrec_model_version", int(status["model"]["version"]))
        family("fedrec_registered_devices", "gauge", "Devices registered with this server.")
        sample("fedrec_registered_devices", int(status["registered_devices"]))
        family("fedrec_waiting_devices", "gauge", "Devices checked in and waiting for a round.")
        sample("fedrec_waiting_devices", int(status["waiting_devices"]))
        return "\n".join(out) + "\n"
