"""Server logs: ``fedrec-server --log-format json`` as a real subprocess writes one JSON object per
stderr line, every record written while a request is handled carries that request's id (the one the
client sent if it is sane, else a fresh one, echoed in ``X-Request-Id``), and each request gets one
access line with method, route template, status, bytes and milliseconds.  Plus the formatters and
the request-id rule on their own."""

from __future__ import annotations

import io
import json
import logging
import re
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from agg_server.logs import (
    REQUEST_ID,
    JsonFormatter,
    RequestIdFilter,
    TextFormatter,
    configure_logging,
    request_id_from_header,
)
from tests.server_helpers import BITS, N_ITEMS

_HEX16 = re.compile(r"[0-9a-f]{16}")


def test_request_id_rule() -> None:
    assert request_id_from_header("abc-DEF_0.9") == "abc-DEF_0.9"
    assert request_id_from_header("x" * 64) == "x" * 64
    for bad in (None, "", "x" * 65, "has space", "a<b>", "newline\n", "ünï"):
        assert _HEX16.fullmatch(request_id_from_header(bad)), bad
    assert request_id_from_header(None) != request_id_from_header(None)


def _record(msg: str, **extra: object) -> logging.LogRecord:
    logger = logging.getLogger("fedrec.test")
    record = logger.makeRecord("fedrec.test", logging.WARNING, __file__, 1, msg, (), None, extra=extra)
    RequestIdFilter().filter(record)
    return record


def test_formatters_carry_the_request_id_and_extras() -> None:
    token = REQUEST_ID.set("req-7")
    try:
        record = _record("hello %s", route="/v1/checkin", status=401)
    finally:
        REQUEST_ID.reset(token)
    line = JsonFormatter().format(record)
    body = json.loads(line)
    assert body["message"] == "hello %s" and body["level"] == "warning" and body["logger"] == "fedrec.test"
    assert body["request_id"] == "req-7" and body["route"] == "/v1/checkin" and body["status"] == 401
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", body["time"])
    text = TextFormatter().format(record)
    assert "WARNING fedrec.test [req-7]: hello %s route=/v1/checkin status=401" in text
    # Outside a request: no request id at all.
    outside = json.loads(JsonFormatter().format(_record("quiet")))
    assert "request_id" not in outside
    assert "[" not in TextFormatter().format(_record("quiet"))
    # A traceback stays inside the one JSON line.
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        rec = logging.getLogger("fedrec.test").makeRecord(
            "fedrec.test", logging.ERROR, __file__, 1, "failed", (), sys.exc_info()
        )
    line = JsonFormatter().format(rec)
    assert "\n" not in line and "ValueError: boom" in json.loads(line)["exc"]


def test_configure_logging_installs_one_filtered_handler() -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    stream = io.StringIO()
    try:
        handler = configure_logging("json", "debug", stream=stream)
        assert root.handlers == [handler] and root.level == logging.DEBUG
        token = REQUEST_ID.set("abc")
        try:
            logging.getLogger("agg_server.x").info("inside")
        finally:
            REQUEST_ID.reset(token)
        assert json.loads(stream.getvalue())["request_id"] == "abc"
        with pytest.raises(ValueError, match="log format"):
            configure_logging("xml", "info")
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])


def _write_config(path: Path) -> None:
    path.write_text(
        f"""
[server]
host = "127.0.0.1"
port = 0
data_dir = "{path.parent / "data"}"

[model]
n_items = {N_ITEMS}
bits = {BITS}

[rounds]
cohort_size = 3
min_cohort = 3

[log]
format = "text"
level = "info"
"""
    )


@pytest.mark.asyncio
@pytest.mark.integration
async def test_json_logs_of_a_real_server_process(tmp_path: Path) -> None:
    config = tmp_path / "server.toml"
    _write_config(config)  # the file says text; the flag must win
    stderr = tmp_path / "server.log"
    with open(stderr, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agg_server", "--config", str(config), "--log-format", "json"],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on http://" in line, stderr.read_text()
        url = line.strip().rsplit(" ", 1)[-1]
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/v1/health", headers={"X-Request-Id": "health-1"}) as resp:
                assert resp.status == 200 and resp.headers["X-Request-Id"] == "health-1"
            headers = {"X-Request-Id": "fail-42", "Authorization": "Bearer not-a-device-token"}
            async with http.post(f"{url}/v1/checkin", data=b"\x80", headers=headers) as resp:
                assert resp.status == 401 and resp.headers["X-Request-Id"] == "fail-42"
            async with http.post(f"{url}/v1/checkin", data=b"", headers={"X-Request-Id": "bad id <x>"}) as resp:
                assert resp.status == 401
                replaced = resp.headers["X-Request-Id"]
            async with http.get(f"{url}/v1/rounds/12/keys") as resp:  # GET on a POST route
                assert resp.status == 405
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()

    lines = stderr.read_text().splitlines()
    records = [json.loads(text) for text in lines]  # every line is one JSON object
    assert len(records) >= 6
    for rec in records:
        assert {"time", "level", "logger", "message"} <= set(rec)

    failing = [r for r in records if r.get("request_id") == "fail-42"]
    loggers = {r["logger"] for r in failing}
    assert {"agg_server.app", "agg_server.access"} <= loggers
    [why] = [r for r in failing if r["logger"] == "agg_server.app"]
    assert "401 auth_error: unknown bearer token" in why["message"]
    [access] = [r for r in failing if r["logger"] == "agg_server.access"]
    assert access["method"] == "POST" and access["route"] == "/v1/checkin" and access["status"] == 401
    assert access["bytes"] > 0 and access["request_bytes"] == 1 and access["ms"] >= 0
    assert "not-a-device-token" not in stderr.read_text()  # tokens never reach the logs

    assert _HEX16.fullmatch(replaced)
    assert any(r.get("request_id") == replaced and r["status"] == 401 for r in records if "status" in r)
    assert "bad id <x>" not in stderr.read_text()
    [health] = [r for r in records if r.get("request_id") == "health-1"]
    assert health["route"] == "/v1/health" and health["status"] == 200
    [not_allowed] = [r for r in records if r.get("status") == 405]
    assert not_allowed["route"] == "unmatched" and not_allowed["path"] == "/v1/rounds/12/keys"
    # One access line per request, and start-up/shutdown lines without a request id.
    assert sum(r["logger"] == "agg_server.access" for r in records) == 4
    assert any(r["message"] == "shutting down" and "request_id" not in r for r in records)
