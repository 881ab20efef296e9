"""The dashboard's server side: the page and its assets are served with a strict CSP, the JSON feed
carries a real round's history, the bounded error ring holds failures (hostile text verbatim, never a
token), the admin quality endpoint refuses every bad request with the right status and a clear
message, quality lives in SQLite (and an old database gains the table on open), and a restarted
server shows the rounds it ran before.  The page itself, rendered in Chromium, is
``tests/test_dashboard_browser.py``."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from agg_server.app import create_app
from agg_server.dashboard import ERROR_RING, STATIC_FILES, parse_quality_report
from agg_server.storage import DATABASE_NAME, SCHEMA_VERSION, Storage
from fedsim.fleets.local import FleetConfig, run_fleet
from protocol.codec import decode
from protocol.errors import AuthError, DecodeError, PermissionDenied, RemoteProtocolError
from protocol.messages import ErrorMessage
from tests.server_helpers import BITS, N_ITEMS, small_config, users
from tests.support.quality import report_quality

TOKEN = "operator-admin-token"
STATIC = Path(__file__).resolve().parents[1] / "agg_server" / "static"


def _config(tmp_path: Path, *, admin: bool = True, **rounds: Any) -> Any:
    cfg = small_config(tmp_path / "server", cohort=rounds.pop("cohort", 3), **rounds)
    digest = hashlib.sha256(TOKEN.encode()).hexdigest() if admin else None
    return dataclasses.replace(cfg, listen=dataclasses.replace(cfg.listen, admin_token_sha256=digest))


async def _error(resp: Any) -> ErrorMessage:
    assert resp.headers["Content-Type"].startswith("application/msgpack")
    msg = decode(await resp.read())
    assert isinstance(msg, ErrorMessage)
    return msg


def test_page_script_never_parses_server_text_as_html() -> None:
    script = (STATIC / "dashboard.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in script, sink
    assert "textContent" in script and "createElementNS" in script
    page = (STATIC / "index.html").read_text()
    # No external resource: every src/href is relative to the server (or an empty data: icon).
    for ref in re.findall(r'(?:src|href)="([^"]*)"', page):
        assert ref.startswith("static/") or ref == "data:,", ref
    assert "<script>" not in page and "style=" not in page  # nothing inline for the CSP to allow


@pytest.mark.asyncio
async def test_page_and_assets_are_served_with_a_strict_policy(aiohttp_client: Any, tmp_path: Path) -> None:
    client = await aiohttp_client(create_app(_config(tmp_path)))
    resp = await client.get("/")
    assert resp.status == 200 and resp.content_type == "text/html"
    csp = resp.headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp and "unsafe-inline" not in csp
    assert resp.headers["X-Content-Type-Options"] == "nosniff"
    assert re.fullmatch(r"[0-9a-f]{16}", resp.headers["X-Request-Id"])
    html = await resp.text()
    assert 'id="duration-chart"' in html and 'src="static/dashboard.js"' in html
    for name, content_type in STATIC_FILES.items():
        if name == "index.html":
            continue
        resp = await client.get(f"/static/{name}")
        assert resp.status == 200 and resp.content_type == content_type
        assert await resp.read() == (STATIC / name).read_bytes()
    resp = await client.get("/static/../app.py")
    assert resp.status == 404


@pytest.mark.asyncio
async def test_dashboard_json_after_a_real_round(aiohttp_server: Any, aiohttp_client: Any, tmp_path: Path) -> None:
    cfg = _config(tmp_path, cohort=4, min_cohort=4, max_rounds=1, timeout=4.0)
    app = create_app(cfg)
    server = await aiohttp_server(app)
    client = await aiohttp_client(server)
    url = str(server.make_url("")).rstrip("/")
    fleet = FleetConfig(url=url, store_root=tmp_path / "devices", n_items=N_ITEMS, bits=BITS, rounds=1, time_limit=60)
    report, _ = await run_fleet(fleet, list(users(4).values()))
    assert report.rounds_finished == 1 and not report.errors

    # Failures land in the ring: a hostile path (verbatim, as text) and a bogus token (never stored).
    resp = await client.get("/v1/<script>alert(1)</script>")
    assert resp.status == 404
    bogus = "bogus-device-token-0123456789"
    resp = await client.post("/v1/checkin", data=b"", headers={"Authorization": f"Bearer {bogus}"})
    assert resp.status == 401
    failing_id = resp.headers["X-Request-Id"]

    stored = await report_quality(url, TOKEN, 2, "hr@10", 0.375, "synthetic holdout")
    assert stored == {"model_version": 2, "metric": "hr@10", "value": 0.375, "dataset": "synthetic holdout"}
    # The same (version, metric, dataset) again replaces the figure.
    await report_quality(url, TOKEN, 2, "hr@10", 0.5, "synthetic holdout")
    await report_quality(url, TOKEN, 1, "ndcg@10", 0.125, "synthetic holdout")

    resp = await client.get("/v1/dashboard")
    assert resp.status == 200 and resp.headers["Cache-Control"] == "no-store"
    raw = await resp.text()
    body = json.loads(raw)
    assert body["status"]["model"]["version"] == 2 and body["status"]["rounds"]["committed"] == 1
    assert body["server"]["admin_enabled"] is True and body["server"]["tls"] is False
    [round_one] = body["history"]
    assert round_one["round_id"] == 1 and round_one["outcome"] == "committed"
    assert round_one["cohort"] == 4 and round_one["survivors"] == 4 and round_one["model_version"] == 2
    assert [p["phase"] for p in round_one["phases"]] == ["advertise_keys", "share_keys", "masked_input", "unmask"]
    assert all(p["alive"] == 4 and p["dropped"] == 0 and p["seconds"] >= 0 for p in round_one["phases"])
    assert round_one["seconds"] >= sum(p["seconds"] for p in round_one["phases"]) - 1e-6
    assert [(q["model_version"], q["metric"], q["value"]) for q in body["quality"]] == [
        (2, "hr@10", 0.5),
        (1, "ndcg@10", 0.125),
    ]
    newest, older = body["errors"][:2]
    assert newest["status"] == 401 and newest["code"] == "auth_error" and newest["request_id"] == failing_id
    assert newest["route"] == "/v1/checkin" and newest["method"] == "POST"
    assert older["status"] == 404 and "<script>alert(1)</script>" in older["message"]
    assert older["route"] == "unmatched"
    assert bogus not in raw and TOKEN not in raw
    assert body["error_counts"]["auth_error"] == 1


@pytest.mark.asyncio
async def test_error_ring_is_bounded_newest_first(aiohttp_client: Any, tmp_path: Path) -> None:
    client = await aiohttp_client(create_app(_config(tmp_path)))
    for i in range(ERROR_RING + 10):
        resp = await client.get(f"/missing/{i}", headers={"X-Request-Id": f"miss-{i}"})
        assert resp.status == 404
    errors = (await (await client.get("/v1/dashboard")).json())["errors"]
    assert len(errors) == ERROR_RING
    assert [e["request_id"] for e in errors[:2]] == [f"miss-{ERROR_RING + 9}", f"miss-{ERROR_RING + 8}"]
    assert errors[-1]["request_id"] == "miss-10"


@pytest.mark.asyncio
async def test_admin_quality_refusals(aiohttp_client: Any, tmp_path: Path) -> None:
    client = await aiohttp_client(create_app(_config(tmp_path)))
    good = {"model_version": 1, "metric": "hr@10", "value": 0.5, "dataset": "holdout"}
    auth = {"Authorization": f"Bearer {TOKEN}"}

    resp = await client.post("/v1/admin/quality", json=good)
    assert resp.status == 401 and "missing admin bearer token" in (await _error(resp)).message
    resp = await client.post("/v1/admin/quality", json=good, headers={"Authorization": "Bearer not-the-token"})
    assert resp.status == 403 and (await _error(resp)).code == "permission_denied"

    cases: list[tuple[Any, str]] = [
        ({**good, "model_version": True}, "model_version: must be an integer"),
        ({**good, "model_version": 0}, "no model version 0"),
        ({**good, "model_version": 2}, "no model version 2 (versions are 1 to 1)"),
        ({**good, "metric": ""}, "metric: must be 1 to 64 characters"),
        ({**good, "metric": "m" * 65}, "metric: must be 1 to 64 characters"),
        ({**good, "metric": "hr\n10"}, "metric: must be printable"),
        ({**good, "dataset": 7}, "dataset: must be a string"),
        ({**good, "value": "0.5"}, "value: must be a number"),
        ({**good, "value": 1e300}, "value: must be finite"),
        ({**good, "extra": 1}, "unknown keys ['extra']"),
        ({k: v for k, v in good.items() if k != "dataset"}, "missing keys ['dataset']"),
        ([good], "body must be a JSON object"),
    ]
    for body, expected in cases:
        resp = await client.post("/v1/admin/quality", json=body, headers=auth)
        msg = await _error(resp)
        assert resp.status == 400 and expected in msg.message, (body, msg.message)
    for raw in (b"{not json", b'{"model_version": 1, "metric": "m", "value": NaN, "dataset": "d"}', b"\xff"):
        resp = await client.post("/v1/admin/quality", data=raw, headers=auth)
        msg = await _error(resp)
        assert resp.status == 400 and msg.code == "decode_error" and "not JSON" in msg.message
    resp = await client.post("/v1/admin/quality", data=b"x" * 20_000, headers=auth)
    assert resp.status == 400

    resp = await client.post("/v1/admin/quality", json=good, headers=auth)
    assert resp.status == 201 and await resp.json() == good


@pytest.mark.asyncio
async def test_admin_endpoints_off_without_a_digest_and_client_errors(aiohttp_server: Any, tmp_path: Path) -> None:
    server = await aiohttp_server(create_app(_config(tmp_path, admin=False)))
    url = str(server.make_url("")).rstrip("/")
    with pytest.raises(PermissionDenied, match="admin endpoints are disabled"):
        await report_quality(url, TOKEN, 1, "hr@10", 0.5, "holdout")
    with pytest.raises(ValueError, match="finite"):
        await report_quality(url, TOKEN, 1, "hr@10", float("nan"), "holdout")
    server2 = await aiohttp_server(create_app(_config(tmp_path / "b")))
    url2 = str(server2.make_url("")).rstrip("/")
    with pytest.raises(AuthError):
        await report_quality(url2, "", 1, "hr@10", 0.5, "holdout")
    with pytest.raises(RemoteProtocolError, match="no model version 9"):
        await report_quality(url2, TOKEN, 9, "hr@10", 0.5, "holdout")
    assert not issubclass(RemoteProtocolError, DecodeError)


def test_parse_quality_report_normalises() -> None:
    out = parse_quality_report({"model_version": 3, "metric": "auc", "value": 1, "dataset": "d"}, latest_version=3)
    assert out == {"model_version": 3, "metric": "auc", "value": 1.0, "dataset": "d"}
    assert isinstance(out["value"], float)


def test_quality_table_and_migration_from_schema_1(tmp_path: Path) -> None:
    with Storage(tmp_path) as storage:
        storage.add_device(b"\x01" * 32, "p", 1.0)
        storage.record_quality(1, "hr@10", "a", 0.25, 2.0)
        storage.record_quality(1, "hr@10", "a", 0.5, 3.0)
        storage.record_quality(2, "hr@10", "a", 0.75, 4.0)
        records = storage.model_quality()
        assert [(r.model_version, r.value, r.reported_at) for r in records] == [(2, 0.75, 4.0), (1, 0.5, 3.0)]
        with pytest.raises(ValueError):
            storage.record_quality(1, "", "a", 0.5, 1.0)
        with pytest.raises(ValueError):
            storage.record_quality(1, "m", "a", float("inf"), 1.0)
    # Turn it into a version-1 database (as the previous release left it), then open it again.
    db = sqlite3.connect(tmp_path / DATABASE_NAME)
    db.execute("DROP TABLE model_quality")
    db.execute("DROP TABLE cohort_leases")  # and version 3's additions
    db.execute("DROP TABLE enrollment_tokens")  # and version 4's
    db.execute("DROP INDEX devices_by_identity")
    db.execute("DROP TABLE revocation_lists")  # and version 5's
    for table, column in (
        ("devices", "source"),
        ("devices", "identity_key"),
        ("rounds", "cohort"),
        ("rounds", "lease_token"),
        ("rounds", "revealed"),
        ("rounds", "sum_sha256"),
        ("checkpoints", "payload"),
    ):
        db.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    db.execute("PRAGMA user_version = 1")
    db.commit()
    db.close()
    with Storage(tmp_path) as storage:
        assert storage.device_count() == 1  # existing data kept
        assert storage.model_quality() == []
        storage.record_quality(1, "hr@10", "a", 0.5, 5.0)
    db = sqlite3.connect(tmp_path / DATABASE_NAME)
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 5
    db.close()


@pytest.mark.asyncio
async def test_a_restarted_server_shows_its_earlier_rounds(
    aiohttp_server: Any, aiohttp_client: Any, tmp_path: Path
) -> None:
    cfg = _config(tmp_path, cohort=3, min_cohort=3, max_rounds=1, timeout=4.0)
    app = create_app(cfg)
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    fleet = FleetConfig(url=url, store_root=tmp_path / "devices", n_items=N_ITEMS, bits=BITS, rounds=1, time_limit=60)
    report, _ = await run_fleet(fleet, list(users(3).values()))
    assert report.rounds_finished == 1
    await server.close()

    client = await aiohttp_client(create_app(cfg))
    body = await (await client.get("/v1/dashboard")).json()
    [seeded] = body["history"]
    assert seeded["round_id"] == 1 and seeded["outcome"] == "committed" and seeded["model_version"] == 2
    assert [p["phase"] for p in seeded["phases"]] == ["advertise_keys", "share_keys", "masked_input", "unmask"]
    metrics = await (await client.get("/metrics")).text()
    assert 'fedrec_rounds_total{outcome="committed"} 1' in metrics
    assert body["errors"] == []
