"""A server that lies about what it alone decides (the session, the cohort), over HTTP: a real aiohttp
`fedrec` server on loopback whose coordinator is wrapped to lie, and real `DeviceClient`s pinning the
enrollment authority.  Each attack must end every lied-to device's round with a typed error and the
server must receive nothing that would unmask an input."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from agg_server.app import COORDINATOR, create_app
from device_sdk.client import RoundOutcome, RoundStatus
from protocol.enrollment import EnrollmentAuthority
from protocol.errors import SessionReplayed
from tests.test_enrollment_http import _clients, _config, _join


def _forget_round(coordinator: Any, round_id: int) -> None:
    """The liar's storage forgets ``round_id``, so the next round it opens gets that id again."""
    with coordinator.storage._transaction("forget") as conn:
        conn.execute(f"UPDATE checkpoints SET round_id = NULL WHERE round_id = {round_id}")
        for table in ("phase_timings", "participation", "rounds"):
            conn.execute(f"DELETE FROM {table} WHERE round_id = {round_id}")


@pytest.mark.asyncio
async def test_a_second_session_of_a_round_id_is_refused_over_http(aiohttp_server: Any, tmp_path: Path) -> None:
    # The server runs round 1 honestly, then opens a new session under round id 1 (to replay the first
    # session's survivor signatures).  Every device remembers round 1 and refuses before it sends a key.
    ca = EnrollmentAuthority.generate()
    n = 6
    app = create_app(_config(tmp_path / "srv", cohort=n, enrollment={"authority_key": ca.public_key.hex()}))
    server = await aiohttp_server(app)
    coordinator = app[COORDINATOR]
    clients = _clients(str(server.make_url("")).rstrip("/"), tmp_path / "dev", n, ca.public_key)
    for i, c in enumerate(clients):
        await c.register(certificate=ca.issue(c.identity_public_key, f"b{i % 2}"))
    first = await asyncio.gather(*(_join(c) for c in clients))
    assert all(r.status is RoundStatus.COMMITTED and r.round_id == 1 for r in first), first
    _forget_round(coordinator, 1)
    honest_submit, uploads = coordinator.submit, []

    def recording_submit(device_id: int, round_id: int, message: Any, now: float, **kw: Any) -> Any:
        uploads.append(type(message).__name__)
        return honest_submit(device_id, round_id, message, now, **kw)

    coordinator.submit = recording_submit  # type: ignore[method-assign]
    second = await asyncio.gather(*(_join(c) for c in clients), return_exceptions=True)
    assert all(isinstance(r, SessionReplayed) and "round 1" in str(r) for r in second), second
    assert not any(isinstance(r, RoundOutcome) and r.status is RoundStatus.COMMITTED for r in second)
    # nothing of the new session left a device: no key advertisement reached the server
    assert set(uploads) == {"Abort"}, uploads  # each device said it leaves, and nothing else
    recent = coordinator.status(0.0)["recent_rounds"][0]
    assert recent["round_id"] == 1 and recent["status"] == "aborted", recent
    for c in clients:
        await c.close()
