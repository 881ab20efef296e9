"""``GET /metrics``: the exposition (``prometheus_client``, one registry per app) parses with the library's
own parser, and after a real round over HTTP (five devices, one announced dropout, DP on) every figure
agrees with ``/v1/status`` and with what the devices did; route labels are templates, never raw paths.
Plus the pieces: hostile labels, one error counter, per-app registries, round events."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agg_server.app import COORDINATOR, create_app
from agg_server.metrics import PHASES, Metrics
from fedsim.fleets.faults import DropoutAt
from fedsim.fleets.local import FleetConfig, run_fleet
from tests.server_helpers import BITS, N_ITEMS, small_config, users

_STATUS = {
    "model": {"version": 4},
    "registered_devices": 9,
    "waiting_devices": 2,
    "privacy": {"epsilon_spent": 1.25, "epsilon_budget": 8.0},
}


def _parse(text: str) -> dict[str, Any]:
    """{family name: family} as prometheus_client reads the exposition."""
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(families: dict[str, Any], sample: str, **labels: str) -> float:
    name = sample
    for suffix in ("_bucket", "_sum", "_count", "_total"):
        if sample.endswith(suffix) and sample[: -len(suffix)] in families:
            name = sample[: -len(suffix)]
    hits = [s.value for s in families[name].samples if s.name == sample and s.labels == labels]
    assert len(hits) == 1, (sample, labels, families[name].samples)
    return float(hits[0])


def _render(metrics: Metrics) -> dict[str, Any]:
    return _parse(metrics.render().decode("utf-8"))


def test_hostile_labels_round_trip_and_errors_are_counted_once() -> None:
    metrics = Metrics(status_source=lambda: _STATUS)
    hostile = 'route "with" \\ and\nnewline'
    metrics.observe_request(hostile, 404, 10, 20, "remote_protocol_error")
    metrics.observe_request("/v1/checkin", 401, 0, 20, "auth_error")
    metrics.observe_request("/v1/checkin", 401, 0, 20, "auth_error")
    metrics.observe_request("/v1/checkin", 200, 0, 20, None)
    families = _render(metrics)
    assert _value(families, "fedrec_http_requests_total", route=hostile, status="404") == 1
    assert _value(families, "fedrec_http_errors_total", code="remote_protocol_error", status="404") == 1
    assert _value(families, "fedrec_http_errors_total", code="auth_error", status="401") == 2
    assert metrics.errors_by_code() == {"auth_error": 2, "remote_protocol_error": 1}
    assert metrics.errors_by_status() == {"401": 2, "404": 1}
    assert _value(families, "fedrec_http_request_bytes_total") == 10
    assert _value(families, "fedrec_waiting_devices") == 2


def test_each_app_has_its_own_registry() -> None:
    a, b = Metrics(), Metrics()
    a.observe_request("/v1/checkin", 200, 1, 1, None)
    assert _value(_render(a), "fedrec_http_requests_total", route="/v1/checkin", status="200") == 1
    assert "fedrec_http_requests" not in _render(b) or not [
        s for s in _render(b)["fedrec_http_requests"].samples if s.name == "fedrec_http_requests_total"
    ]
    assert "fedrec_model_version" not in _render(a)  # no status source: only what the metrics count


def test_round_events_drive_counters_and_the_device_gauge() -> None:
    status: dict[str, Any] = dict(_STATUS)
    metrics = Metrics({"committed": 3, "aborted": 1, "open": 1}, status_source=lambda: status)
    metrics.on_round_event("round_opened", {"round_id": 6, "cohort": 10})
    assert metrics.devices == {"advertise_keys": 10, "share_keys": 0, "masked_input": 0, "unmask": 0}
    metrics.on_round_event(
        "phase", {"round_id": 6, "phase": "advertise_keys", "seconds": 0.2, "alive": 9, "dropped": 1}
    )
    metrics.on_round_event("phase", {"round_id": 6, "phase": "share_keys", "seconds": 0.3, "alive": 7, "dropped": 2})
    assert metrics.devices == {"advertise_keys": 9, "share_keys": 7, "masked_input": 7, "unmask": 0}
    families = _render(metrics)
    assert _value(families, "fedrec_devices", phase="masked_input") == 7
    assert _value(families, "fedrec_phase_dropouts_total", phase="share_keys") == 2
    assert _value(families, "fedrec_phase_seconds_count", phase="advertise_keys") == 1
    assert _value(families, "fedrec_phase_seconds_bucket", phase="share_keys", le="0.25") == 0
    assert _value(families, "fedrec_phase_seconds_bucket", phase="share_keys", le="0.5") == 1
    metrics.on_round_event(
        "round_finished",
        {"round_id": 6, "outcome": "aborted", "seconds": 3.0, "survivors": 7, "epsilon_spent": None},
    )
    metrics.on_round_event("round_finished", {"round_id": 7, "outcome": "abandoned", "seconds": 1.0, "survivors": 0})
    status["privacy"] = None
    families = _render(metrics)
    assert _value(families, "fedrec_rounds_total", outcome="committed") == 3  # seeded from the database
    assert _value(families, "fedrec_rounds_total", outcome="aborted") == 2
    assert _value(families, "fedrec_rounds_total", outcome="abandoned") == 1
    assert _value(families, "fedrec_round_seconds_count") == 1  # an abandoned round's length is not a duration
    assert all(_value(families, "fedrec_devices", phase=p) == 0 for p in PHASES)
    assert "fedrec_privacy_epsilon_spent" not in families  # DP off: no privacy gauges
    assert _value(families, "fedrec_model_version") == 4


@pytest.mark.asyncio
async def test_metrics_after_a_real_round_agree_with_status(
    aiohttp_server: Any, aiohttp_client: Any, tmp_path: Path
) -> None:
    cfg = small_config(tmp_path / "server", cohort=5, timeout=4.0, min_cohort=5, max_rounds=1)
    cfg = dataclasses.replace(cfg, privacy=dataclasses.replace(cfg.privacy, enabled=True, epsilon=50.0))
    app = create_app(cfg)
    server = await aiohttp_server(app)
    client = await aiohttp_client(server)
    fleet_cfg = FleetConfig(
        url=str(server.make_url("")).rstrip("/"),
        store_root=tmp_path / "devices",
        n_items=N_ITEMS,
        bits=BITS,
        rounds=1,
        time_limit=60.0,
        announce_drops=True,
        schedule=lambda r, d: DropoutAt.BEFORE_SHARES if d == 2 else DropoutAt.NONE,
    )
    report, _ = await run_fleet(fleet_cfg, list(users(5).values()))
    assert report.rounds_finished == 1 and not report.errors
    resp = await client.post("/v1/checkin", data=b"")  # one provoked 401
    assert resp.status == 401

    resp = await client.get("/metrics")
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    text = await resp.text()
    status = await (await client.get("/v1/status")).json()
    families = _parse(text)

    # Every family carries HELP and TYPE.
    for name in ("fedrec_rounds_total", "fedrec_phase_seconds", "fedrec_devices", "fedrec_http_requests_total"):
        assert f"# HELP {name} " in text and f"# TYPE {name} " in text
    assert families["fedrec_phase_seconds"].type == "histogram"
    assert families["fedrec_devices"].type == "gauge"

    rec = status["recent_rounds"][0]
    assert rec["status"] == "committed" and rec["survivors"] == 4
    for outcome in ("committed", "aborted", "abandoned"):
        assert _value(families, "fedrec_rounds_total", outcome=outcome) == status["rounds"][outcome]
    assert _value(families, "fedrec_model_version") == status["model"]["version"] == 2
    assert _value(families, "fedrec_registered_devices") == status["registered_devices"] == 5
    assert _value(families, "fedrec_waiting_devices") == status["waiting_devices"]
    assert _value(families, "fedrec_privacy_epsilon_spent") == pytest.approx(status["privacy"]["epsilon_spent"])
    assert _value(families, "fedrec_privacy_epsilon_budget") == status["privacy"]["epsilon_budget"] == 50.0

    # Phases: one observation each, dropouts as the server recorded them, durations within the round's.
    phases = {p["phase"]: p for p in rec["phases"]}
    assert set(phases) == set(PHASES)
    for phase in PHASES:
        assert _value(families, "fedrec_phase_seconds_count", phase=phase) == 1
        assert _value(families, "fedrec_phase_seconds_sum", phase=phase) == pytest.approx(phases[phase]["seconds"])
        assert _value(families, "fedrec_phase_dropouts_total", phase=phase) == phases[phase]["dropped"]
        assert _value(families, "fedrec_phase_seconds_bucket", phase=phase, le="+Inf") == 1
    assert sum(p["dropped"] for p in phases.values()) == 1 == phases["share_keys"]["dropped"]
    round_seconds = rec["finished_at"] - rec["started_at"]
    assert _value(families, "fedrec_round_seconds_count") == 1
    assert _value(families, "fedrec_round_seconds_sum") == pytest.approx(round_seconds, abs=1e-6)
    assert sum(p["seconds"] for p in phases.values()) <= round_seconds + 1e-6
    # No round open now (max_rounds reached): the device gauge is zero everywhere, as status says.
    assert status["round"] is None
    assert all(_value(families, "fedrec_devices", phase=p) == 0 for p in PHASES)

    # HTTP: route templates only; five devices registered, four sent shares (one dropped before).
    requests = {(s.labels["route"], s.labels["status"]): s.value for s in families["fedrec_http_requests"].samples}
    templates = {r.canonical for r in app.router.resources()}
    assert {route for route, _ in requests} <= templates and "/v1/rounds/{round_id}/keys" in templates
    assert requests[("/v1/devices", "201")] == 5
    assert requests[("/v1/rounds/{round_id}/keys", "200")] == 5
    assert requests[("/v1/rounds/{round_id}/shares", "200")] == 4
    assert requests[("/v1/rounds/{round_id}/unmask", "200")] == 4
    assert requests[("/v1/checkin", "401")] == 1
    assert _value(families, "fedrec_http_errors_total", code="auth_error", status="401") == 1
    # Bytes: at least the masked uploads (4 survivors × L ring elements of 4 bytes) came in.
    assert _value(families, "fedrec_http_request_bytes_total") > 4 * N_ITEMS * BITS * 4
    assert _value(families, "fedrec_http_response_bytes_total") > 0
    assert app[COORDINATOR].model_version == 2
