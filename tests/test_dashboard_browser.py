"""The dashboard in a real headless Chromium: a real server on loopback runs two rounds with ten real
devices, an operator reports a quality figure, two failing requests are provoked (a 401 and a 404
whose message quotes a ``<script>`` path), and the page — after its JavaScript fetched and rendered
``/v1/dashboard`` — shows the round count, the committed model version with its quality, bars and
points in its SVG charts, ε against the budget and the error rows, with the hostile text as text.
A second test renders a round that is still open (phase steps, cohort, alive, awaiting) with DP off.

Chromium is driven over the DevTools protocol by the small client below (aiohttp websocket, no
Playwright, no downloaded browser).  Without ``/usr/bin/chromium`` the test is skipped, except under
``$CI`` where it fails (CI installs it: see ``.ci/run``).  ``benchmarks/dashboard_screenshot.py``
reuses `run_scenario` to refresh ``docs/img/dashboard.png``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import subprocess
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from yarl import URL

from agg_server.app import COORDINATOR, create_app
from agg_server.config import config_from_dict
from fedsim.fleets.local import FleetConfig, run_fleet
from protocol.codec import decode, encode
from protocol.messages import CheckIn, RegisterRequest
from tests.server_helpers import BITS, N_ITEMS, small_config, users
from tests.support.quality import report_quality

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
)
ADMIN_TOKEN = "dashboard-test-admin-token"
HOSTILE = "<script>document.title='pwned'</script>"
QUALITY_DATASET = "<img src=x onerror=alert(1)> holdout"

log = logging.getLogger(__name__)


# -- a minimal Chrome DevTools Protocol client ---------------------------------------------------------


class CdpError(RuntimeError):
    """A DevTools command failed or timed out."""


class Cdp:
    """One websocket to the browser; commands to a page go with its ``sessionId`` (flat mode)."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.ids = itertools.count(1)
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.events: list[dict[str, Any]] = []
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for msg in self.ws:
            if msg.type is not aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(msg.data)
            future = self.pending.pop(data.get("id", -1), None)
            if future is None:
                self.events.append(data)
            elif "error" in data:
                future.set_exception(CdpError(str(data["error"])))
            else:
                future.set_result(data.get("result", {}))
        for future in self.pending.values():
            future.set_exception(CdpError("the DevTools connection closed"))

    async def send(self, method: str, session: str | None = None, timeout: float = 20.0, **params: Any) -> Any:
        ident = next(self.ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.pending[ident] = future
        body: dict[str, Any] = {"id": ident, "method": method, "params": params}
        if session is not None:
            body["sessionId"] = session
        await self.ws.send_str(json.dumps(body))
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise CdpError(f"{method} timed out after {timeout} s") from None

    async def evaluate(self, session: str, expression: str) -> Any:
        result = await self.send(
            "Runtime.evaluate", session, expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise CdpError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, session: str, expression: str, timeout: float = 20.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not await self.evaluate(session, expression):
            if loop.time() > deadline:
                raise CdpError(f"timed out waiting for {expression}")
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def chromium(profile: Path) -> AsyncIterator[Cdp]:
    """Start headless Chromium with a fresh profile; yield a DevTools client; always stop it."""
    log_file = open(profile.parent / "chromium.log", "w")  # noqa: SIM115 - the child keeps its own descriptor
    try:
        proc = subprocess.Popen(
            [str(CHROMIUM), *CHROMIUM_FLAGS, "--remote-debugging-port=0", f"--user-data-dir={profile}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=log_file,
        )
    finally:
        log_file.close()
    session: aiohttp.ClientSession | None = None
    try:
        active = profile / "DevToolsActivePort"
        for _ in range(400):  # chromium writes "<port>\n<browser path>" once it listens
            lines = active.read_text().split() if active.exists() else []
            if len(lines) == 2:
                break
            if proc.poll() is not None:
                raise CdpError(f"chromium exited with {proc.returncode}; see {profile.parent / 'chromium.log'}")
            await asyncio.sleep(0.05)
        else:
            raise CdpError("chromium did not open its DevTools port within 20 s")
        session = aiohttp.ClientSession()
        ws = await session.ws_connect(f"ws://127.0.0.1:{lines[0]}{lines[1]}", max_msg_size=0)
        cdp = Cdp(ws)
        try:
            yield cdp
        finally:
            await ws.close()
            cdp.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await cdp.reader
    finally:
        if session is not None:
            await session.close()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- the scenario ---------------------------------------------------------------------------------------

# What the test reads from the rendered page (after its JavaScript ran).
_FACTS = """(() => {
  const text = (id) => (document.getElementById(id) || {}).textContent || null;
  const rows = (id) => [...document.querySelectorAll('#' + id + ' tbody tr')].map((tr) => tr.textContent);
  return {
    title: document.title,
    scripts: document.querySelectorAll('script').length,
    images: document.querySelectorAll('img').length,
    updates: Number(document.body.dataset.updates || 0),
    connection: text('connection'),
    modelVersion: text('model-version'),
    roundsCommitted: text('rounds-committed'),
    registered: text('registered-devices'),
    epsilonText: text('epsilon-text'),
    epsilonBarWidth: Number((document.getElementById('epsilon-spent-bar') || {getAttribute: () => -1})
      .getAttribute('width')),
    durationBars: [...document.querySelectorAll('#duration-chart rect.bar')].map((r) => ({
      round: Number(r.dataset.round), height: Number(r.getAttribute('height'))})),
    phaseRects: document.querySelectorAll('#duration-chart rect.phase').length,
    epsilonPoints: [...document.querySelectorAll('#epsilon-chart circle.point')].map((c) => Number(c.dataset.round)),
    budgetLine: document.querySelectorAll('#epsilon-chart line.budget').length,
    versionRow: (document.querySelector('#versions-table tr[data-version="3"]') || {}).textContent || null,
    roundRows: rows('rounds-table'),
    errorRows: rows('errors-table'),
  };
})()"""


@dataclasses.dataclass
class ScenarioResult:
    facts: dict[str, Any]
    status: dict[str, Any]
    png: bytes
    request_id_401: str
    page_errors: list[dict[str, Any]]


def scenario_config(data_dir: Path, rounds: int = 2) -> Any:
    return config_from_dict(
        {
            "server": {
                "data_dir": str(data_dir),
                "host": "127.0.0.1",
                "port": 0,
                "admin_token_sha256": hashlib.sha256(ADMIN_TOKEN.encode()).hexdigest(),
            },
            "model": {"n_items": N_ITEMS, "bits": BITS},
            "rounds": {
                "cohort_size": 10,
                "min_cohort": 10,
                "max_rounds": rounds,
                "seed": 7,
                "clip_norm": 64.0,
                "scale_bits": 12,
                "advertise_timeout": 5.0,
                "share_keys_timeout": 5.0,
                "masked_input_timeout": 5.0,
                "unmask_timeout": 5.0,
                "round_interval": 0.05,
            },
            "privacy": {"enabled": True, "epsilon": 50.0, "delta": 1e-5, "planned_rounds": 10},
        },
        base_dir=data_dir,
    )


async def render(
    url: str, profile: Path, *, width: int = 1280, height: int = 1500, facts: str = _FACTS
) -> tuple[dict[str, Any], bytes, list[dict[str, Any]]]:
    """Open ``url``/ in headless Chromium, wait for the first render of the dashboard's data, and
    return (what ``facts`` evaluates to, a PNG screenshot, script errors / failed loads / console errors)."""
    profile.mkdir()
    async with chromium(profile) as cdp:
        target = await cdp.send("Target.createTarget", url="about:blank")
        attached = await cdp.send("Target.attachToTarget", targetId=target["targetId"], flatten=True)
        page = attached["sessionId"]
        await cdp.send("Runtime.enable", page)
        await cdp.send("Log.enable", page)
        await cdp.send("Page.enable", page)
        await cdp.send(
            "Emulation.setDeviceMetricsOverride", page, width=width, height=height, deviceScaleFactor=1, mobile=False
        )
        await cdp.send("Page.navigate", page, url=f"{url}/")
        await cdp.wait_for(page, "document.body && Number(document.body.dataset.updates || 0) >= 1")
        values = await cdp.evaluate(page, facts)
        shot = await cdp.send("Page.captureScreenshot", page, format="png", captureBeyondViewport=False)
        page_errors = [
            e
            for e in cdp.events
            if e.get("method") == "Runtime.exceptionThrown"
            or (e.get("method") == "Log.entryAdded" and e["params"]["entry"].get("level") == "error")
            or (e.get("method") == "Runtime.consoleAPICalled" and e["params"].get("type") in ("error", "assert"))
        ]
    return values, base64.b64decode(shot["data"]), page_errors


async def run_scenario(
    workdir: Path, *, rounds: int = 2, dropout: float = 0.0, width: int = 1280, height: int = 1500
) -> ScenarioResult:
    """Serve, train ``rounds`` rounds with ten devices (dropping with probability ``dropout``, announced),
    report quality for the last version, provoke two errors, render the dashboard in Chromium."""
    app = create_app(scenario_config(workdir / "server-data", rounds))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = int(runner.addresses[0][1])
        url = f"http://127.0.0.1:{port}"
        fleet = FleetConfig(
            url=url,
            store_root=workdir / "devices",
            n_items=N_ITEMS,
            bits=BITS,
            rounds=rounds,
            seed=3,
            time_limit=60.0 * rounds,
            dropout=dropout,
            announce_drops=True,
            drop_pause=0.2,
        )
        report, _ = await run_fleet(fleet, list(users(10, seed=4).values()))
        if report.rounds_finished != rounds or report.errors:
            raise RuntimeError(f"the fleet did not finish {rounds} rounds cleanly: {report.to_dict()}")
        version = app[COORDINATOR].model_version
        await report_quality(url, ADMIN_TOKEN, version, "hr@10", 0.4321, QUALITY_DATASET)
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/checkin", data=b"", headers={"X-Request-Id": "browser-401"}) as resp:
                assert resp.status == 401
                request_id_401 = resp.headers["X-Request-Id"]
            hostile = URL(f"{url}/v1/x/{HOSTILE.replace('<', '%3C').replace('>', '%3E')}", encoded=True)
            async with http.get(hostile) as resp:
                assert resp.status == 404
            async with http.get(f"{url}/v1/status") as resp:
                status = await resp.json()

        facts, png, page_errors = await render(url, workdir / "chromium-profile", width=width, height=height)
        return ScenarioResult(facts, status, png, request_id_401, page_errors)
    finally:
        await runner.cleanup()


# -- the test -------------------------------------------------------------------------------------------


def _require_chromium() -> None:
    if not (CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK)):
        reason = f"{CHROMIUM} is not installed (apt-get install chromium); the browser test cannot run"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}, and CI must run it")
        pytest.skip(reason)


@pytest.mark.asyncio
async def test_dashboard_renders_a_real_run_in_headless_chromium(tmp_path: Path) -> None:
    _require_chromium()
    result = await run_scenario(tmp_path)
    facts, status = result.facts, result.status
    shot = tmp_path / "dashboard.png"
    shot.write_bytes(result.png)
    log.warning("dashboard screenshot: %s", shot)

    assert not result.page_errors, result.page_errors  # no script error, no CSP violation, no failed load
    assert facts["updates"] >= 1 and facts["connection"] == "live"
    # Two committed rounds; model version 1 + 2.
    assert status["rounds"]["committed"] == 2 and status["model"]["version"] == 3
    assert facts["roundsCommitted"] == "2" and facts["modelVersion"] == "3"
    assert facts["registered"] == str(status["registered_devices"])
    # Round durations: one bar per round, with a height, and the per-phase stack inside.
    assert sorted(b["round"] for b in facts["durationBars"]) == [1, 2]
    assert all(b["height"] > 0 for b in facts["durationBars"])
    assert facts["phaseRects"] == 2 * 4
    # ε against the budget, from the ledger.
    privacy = status["privacy"]
    assert facts["epsilonText"] == f"{privacy['epsilon_spent']:.3f} / {privacy['epsilon_budget']:.2f}"
    assert 0 < privacy["epsilon_spent"] < privacy["epsilon_budget"]
    assert facts["epsilonBarWidth"] == pytest.approx(200 * privacy["epsilon_spent"] / privacy["epsilon_budget"], 0.01)
    assert sorted(facts["epsilonPoints"]) == [1, 2] and facts["budgetLine"] == 1
    # The quality figure beside its version, the hostile dataset name as text.
    assert facts["versionRow"] is not None
    assert f"hr@10 = 0.4321 ({QUALITY_DATASET})" in facts["versionRow"]
    # The error rows: the provoked 401 with its request id, and the hostile path as text.
    auth_rows = [r for r in facts["errorRows"] if "auth_error" in r]
    assert auth_rows and "401" in auth_rows[0] and result.request_id_401 in auth_rows[0]
    assert result.request_id_401 == "browser-401"
    assert any(HOSTILE in r for r in facts["errorRows"])
    assert facts["title"] == "fedrec server" and facts["scripts"] == 1 and facts["images"] == 0
    # A real PNG of the whole page.
    assert result.png[:8] == b"\x89PNG\r\n\x1a\n" and len(result.png) > 20_000


_OPEN_ROUND_FACTS = """(() => {
  const text = (id) => (document.getElementById(id) || {}).textContent || null;
  return {
    openHidden: document.getElementById('round-open').hidden,
    noneHidden: document.getElementById('round-none').hidden,
    roundId: text('round-id'), phase: text('round-phase'), cohort: text('round-cohort'),
    alive: text('round-alive'), awaiting: text('round-awaiting'), dropouts: text('round-dropouts'),
    steps: [...document.querySelectorAll('#phase-steps li')].map((li) => [li.textContent, li.className]),
    durationText: text('duration-chart'), epsilonText: text('epsilon-text'), epsilonChart: text('epsilon-chart'),
    errorRows: [...document.querySelectorAll('#errors-table tbody tr')].map((tr) => tr.textContent),
  };
})()"""


@pytest.mark.asyncio
async def test_dashboard_shows_an_open_round(tmp_path: Path) -> None:
    """Mid-round (three devices invited, none has sent its keys yet), with DP off and no error so far."""
    _require_chromium()
    cfg = small_config(tmp_path / "server", cohort=3, timeout=60.0, min_cohort=3)
    app = create_app(cfg)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        url = f"http://127.0.0.1:{int(runner.addresses[0][1])}"
        async with aiohttp.ClientSession() as http:
            devices = []
            for _ in range(3):
                async with http.post(f"{url}/v1/devices", data=encode(RegisterRequest(platform="t"))) as resp:
                    devices.append(decode(await resp.read()))
            for _ in range(100):  # check in until the ticker opened the round
                for dev in devices:
                    headers = {"Authorization": f"Bearer {dev.token}", "Content-Type": "application/msgpack"}
                    body = encode(CheckIn(device_id=dev.device_id))
                    async with http.post(f"{url}/v1/checkin", data=body, headers=headers) as resp:
                        assert resp.status == 200
                if app[COORDINATOR].open_round is not None:
                    break
                await asyncio.sleep(0.1)
        assert app[COORDINATOR].open_round is not None
        facts, png, errors = await render(url, tmp_path / "profile", facts=_OPEN_ROUND_FACTS)
    finally:
        await runner.cleanup()
    (tmp_path / "open-round.png").write_bytes(png)
    assert not errors, errors
    assert facts["openHidden"] is False and facts["noneHidden"] is True
    assert (facts["roundId"], facts["phase"], facts["cohort"]) == ("1", "advertise_keys", "3")
    assert (facts["alive"], facts["awaiting"]) == ("3", "3")
    assert facts["dropouts"] == "keys 0 · shares 0 · masked 0 · unmask 0"
    assert facts["steps"] == [["keys", "now"], ["shares", ""], ["masked", ""], ["unmask", ""]]
    assert facts["durationText"] == "no finished round yet"
    assert facts["epsilonText"] == "off" and "DP is off" in facts["epsilonChart"]
    assert facts["errorRows"] == ["no errors since the server started"]


def _main() -> None:  # pragma: no cover - manual use: python -m tests.test_dashboard_browser
    with tempfile.TemporaryDirectory() as tmp:
        result = asyncio.run(run_scenario(Path(tmp)))
        print(json.dumps(result.facts, indent=2))


if __name__ == "__main__":  # pragma: no cover
    _main()
