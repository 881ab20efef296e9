"""Prometheus metrics of the aggregation server, on ``prometheus_client``.

Invariants:
- No module-level state: every `Metrics` owns its own ``CollectorRegistry`` (never the library's
  global one), so two apps in one process — as in the tests — never share a sample.
- Counters and histograms are fed by the coordinator's round events (`Metrics.on_round_event`,
  registered in ``RoundCoordinator.listeners``) and by the request middleware
  (`Metrics.observe_request`).  Gauges are a custom collector that reads the coordinator's status at
  scrape time, so they cannot drift from ``/v1/status``.
- One error counter: ``fedrec_http_errors_total{code, status}`` counts each error answer once, from the
  `ErrorMessage` the server built for it (never by decoding a response body).  The dashboard's counts
  by code and ``/v1/status``'s ``errors_by_status`` are sums over it (`errors_by_code`,
  `errors_by_status`).
- Label cardinality is bounded: ``route`` is the route's canonical template (``/v1/rounds/{round_id}/keys``)
  or "unmatched", never the raw path; ``status`` is an HTTP status; ``code`` is a `protocol.errors`
  code or ``http_<status>``; ``phase`` and ``outcome`` come from fixed lists.
- ``fedrec_rounds_total`` starts from the rounds stored in the database (a restarted server keeps
  counting where it stopped), so it always equals ``/v1/status``'s ``rounds``.  Histograms and the
  other counters start at zero with the process, as Prometheus counters do.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from protocol.session import ACTIVE_PHASES

__all__ = [
    "CONTENT_TYPE",
    "PHASES",
    "OUTCOMES",
    "PHASE_BUCKETS",
    "ROUND_BUCKETS",
    "Metrics",
]

#: Content type of the exposition (text format 0.0.4, which `generate_latest` writes).
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

StatusSource = Callable[[], Mapping[str, Any]]


class _StatusGauges(Collector):
    """Gauges read from ``RoundCoordinator.status`` at scrape time, plus the open round's devices."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        devices = GaugeMetricFamily(
            "fedrec_devices",
            "Devices of the open round still alive in each phase (0 for phases not reached and when no round is open).",
            labels=["phase"],
        )
        for phase in PHASES:
            devices.add_metric([phase], self._metrics.devices[phase])
        yield devices
        source = self._metrics.status_source
        if source is None:
            return
        status = source()
        privacy = status.get("privacy")
        if privacy is not None:
            yield GaugeMetricFamily(
                "fedrec_privacy_epsilon_spent",
                "Privacy loss epsilon spent so far (at delta).",
                value=float(privacy["epsilon_spent"]),
            )
            yield GaugeMetricFamily(
                "fedrec_privacy_epsilon_budget",
                "Privacy budget epsilon of the whole run.",
                value=float(privacy["epsilon_budget"]),
            )
        yield GaugeMetricFamily(
            "fedrec_model_version", "Version of the current global model.", value=int(status["model"]["version"])
        )
        cluster = status.get("cluster") or {}
        if cluster.get("instance"):
            info = GaugeMetricFamily(
                "fedrec_instance_info",
                "1, labelled with this instance's id (storage.instance_id) and advertised URL, to join on.",
                labels=["instance", "url"],
            )
            info.add_metric([str(cluster["instance"]), str(cluster.get("url") or "")], 1.0)
            yield info
        if cluster.get("model_version") is not None:
            yield GaugeMetricFamily(
                "fedrec_cluster_model_version",
                "Newest model version any instance on the shared database committed.",
                value=int(cluster["model_version"]),
            )
        if cluster.get("leaders"):
            leaders = GaugeMetricFamily(
                "fedrec_cohort_led_here",
                "1 for each cohort this instance leads, 0 for the others (instance: this instance's id).",
                labels=["cohort", "instance"],
            )
            instance = str(cluster.get("instance", ""))
            for lead in cluster["leaders"]:
                leaders.add_metric([str(lead["cohort"]), instance], 1.0 if lead["here"] else 0.0)
            yield leaders
        yield GaugeMetricFamily(
            "fedrec_registered_devices", "Devices registered with this server.", value=int(status["registered_devices"])
        )
        yield GaugeMetricFamily(
            "fedrec_waiting_devices",
            "Devices checked in and waiting for a round.",
            value=int(status["waiting_devices"]),
        )


class Metrics:
    """Every metric of one server, in its own registry.

    Parameters
    ----------
    round_counts : Mapping[str, int], optional
        Rounds already in the database by status (``Storage.round_counts()``); seeds
        ``fedrec_rounds_total`` so that it survives restarts.
    status_source : callable, optional
        Returns ``RoundCoordinator.status(now)`` at scrape time (the gauges); without it only the
        counters, histograms and the device gauge are exposed.
    """

    def __init__(
        self, round_counts: Mapping[str, int] | None = None, status_source: StatusSource | None = None
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.status_source = status_source
        reg = self.registry
        self.rounds = Counter(
            "fedrec_rounds", "Rounds finished, by outcome (committed, aborted, abandoned).", ["outcome"], registry=reg
        )
        for outcome in OUTCOMES:
            self.rounds.labels(outcome).inc(max(0, int((round_counts or {}).get(outcome, 0))))
        self.phase_seconds = Histogram(
            "fedrec_phase_seconds",
            "How long each SecAgg phase of a round was open, in seconds.",
            ["phase"],
            buckets=PHASE_BUCKETS,
            registry=reg,
        )
        self.round_seconds = Histogram(
            "fedrec_round_seconds",
            "Length of committed and aborted rounds, from opening to the end.",
            buckets=ROUND_BUCKETS,
            registry=reg,
        )
        self.phase_dropouts = Counter(
            "fedrec_phase_dropouts", "Devices dropped from a round, by the phase they missed.", ["phase"], registry=reg
        )
        for phase in PHASES:
            self.phase_seconds.labels(phase)
            self.phase_dropouts.labels(phase)
        self.http_requests = Counter(
            "fedrec_http_requests",
            "HTTP requests answered, by route template and status.",
            ["route", "status"],
            registry=reg,
        )
        self.http_errors = Counter(
            "fedrec_http_errors",
            "HTTP error answers, by fedrec error code and status.",
            ["code", "status"],
            registry=reg,
        )
        self.request_bytes = Counter("fedrec_http_request_bytes", "Request body bytes received.", registry=reg)
        self.response_bytes = Counter("fedrec_http_response_bytes", "Response body bytes sent.", registry=reg)
        self.devices: dict[str, int] = {p: 0 for p in PHASES}
        # The error counter's values, kept beside it for the dashboard and /v1/status (the client library
        # exposes no public read-back).
        self._errors: Tally[tuple[str, int]] = Tally()
        reg.register(_StatusGauges(self))

    # -- inputs -----------------------------------------------------------------------------------

    def on_round_event(self, event: str, fields: Mapping[str, Any]) -> None:
        """A `RoundCoordinator` listener: count rounds, time phases, follow the open round's devices."""
        if event == "round_opened":
            self.devices = {p: 0 for p in PHASES}
            self.devices[PHASES[0]] = int(fields["cohort"])
        elif event == "phase":
            phase = str(fields["phase"])
            if phase not in self.devices:
                return
            self.phase_seconds.labels(phase).observe(float(fields["seconds"]))
            self.phase_dropouts.labels(phase).inc(int(fields["dropped"]))
            alive = int(fields["alive"])
            self.devices[phase] = alive
            i = PHASES.index(phase)
            if i + 1 < len(PHASES):
                self.devices[PHASES[i + 1]] = alive  # who enters the next phase
        elif event == "round_finished":
            outcome = str(fields["outcome"])
            if outcome in OUTCOMES:
                self.rounds.labels(outcome).inc()
            if outcome != "abandoned":  # a shutdown cuts a round short: its length says nothing
                self.round_seconds.observe(float(fields["seconds"]))
            self.devices = {p: 0 for p in PHASES}

    def observe_request(
        self, route: str, status: int, request_bytes: int, response_bytes: int, error_code: str | None
    ) -> None:
        """Count one finished HTTP request (``route`` must be a template, never a raw path) and, for an
        error answer, its code once."""
        self.http_requests.labels(route, str(status)).inc()
        self.request_bytes.inc(max(0, int(request_bytes)))
        self.response_bytes.inc(max(0, int(response_bytes)))
        if error_code is not None:
            self.http_errors.labels(error_code, str(status)).inc()
            self._errors[(error_code, int(status))] += 1

    # -- outputs ----------------------------------------------------------------------------------

    def errors_by_code(self) -> dict[str, int]:
        """Error answers so far, by fedrec error code."""
        out: Tally[str] = Tally()
        for (code, _), n in list(self._errors.items()):  # a copy: requests count on the event loop's thread
            out[code] += n
        return dict(sorted(out.items()))

    def errors_by_status(self) -> dict[str, int]:
        """Error answers so far, by HTTP status (as text)."""
        out: Tally[int] = Tally()
        for (_, status), n in list(self._errors.items()):  # (the status is read on the state thread)
            out[status] += n
        return {str(k): v for k, v in sorted(out.items())}

    def render(self) -> bytes:
        """The exposition (text format 0.0.4, UTF-8)."""
        return generate_latest(self.registry)
