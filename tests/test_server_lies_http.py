"""A server that lies about what it alone decides (the session, the cohort), over HTTP: a real aiohttp
`fedrec` server on loopback whose coordinator is wrapped to lie, and real `DeviceClient`s pinning the
enrollment authority.  Each attack must end every lied-to device's round with a typed error and the
server must receive nothing that would unmask an input."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from agg_server.app import COORDINATOR, create_app
from device_sdk.client import DeviceClient, RoundOutcome, RoundStatus
from protocol.enrollment import EnrollmentAuthority
from protocol.errors import CryptoError, EnrollmentRefused, RemoteProtocolError, SessionReplayed, SurvivorSetSplit
from protocol.graph import GraphParams, find_parameters, roster_ring
from protocol.identity import roster_digest
from protocol.messages import Abort, MaskedInput, RoundInvite
from protocol.phases import required_signatures
from protocol.policy import PrivacyPolicy
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
    n = 6
    coordinator, clients = await _enrolled_fleet(aiohttp_server, tmp_path, n, None)
    first = await asyncio.gather(*(_join(c) for c in clients))
    assert all(r.status is RoundStatus.COMMITTED and r.round_id == 1 for r in first), first
    _forget_round(coordinator, 1)
    uploads = _record_uploads(coordinator)
    second = await asyncio.gather(*(_join(c) for c in clients), return_exceptions=True)
    assert all(isinstance(r, SessionReplayed) and "round 1" in str(r) for r in second), second
    assert not any(isinstance(r, RoundOutcome) and r.status is RoundStatus.COMMITTED for r in second)
    # nothing of the new session left a device: no key advertisement reached the server
    assert set(uploads) == {"Abort"}, uploads  # each device said it leaves, and nothing else
    recent = coordinator.status(0.0)["recent_rounds"][0]
    assert recent["round_id"] == 1 and recent["status"] == "aborted", recent
    for c in clients:
        await c.close()


def _lie_about_the_roster(coordinator: Any, roster_for: Any) -> dict[int, tuple[int, ...]]:
    """Wrap the coordinator's check-in: each invite shows the roster ``roster_for(device, honest_roster)``
    (ids; the keys are the honest ones of those ids).  Returns what each device was shown."""
    honest_check_in, shown = coordinator.check_in, {}

    def lying_check_in(device_id: int, now: float) -> Any:
        out = honest_check_in(device_id, now)
        if isinstance(out, RoundInvite):
            keys = dict(zip(out.roster_ids, out.roster_keys, strict=True))
            ids = tuple(sorted(roster_for(device_id, out.roster_ids)))
            shown[device_id] = ids
            out = dataclasses.replace(
                out, cohort_size=len(ids), roster_ids=ids, roster_keys=tuple(keys[v] for v in ids)
            )
        return out

    coordinator.check_in = lying_check_in  # type: ignore[method-assign]
    return shown


def _record_uploads(coordinator: Any) -> list[str]:
    honest_submit, uploads = coordinator.submit, []

    def recording_submit(device_id: int, round_id: int, message: Any, now: float, **kw: Any) -> Any:
        uploads.append(type(message).__name__)
        return honest_submit(device_id, round_id, message, now, **kw)

    coordinator.submit = recording_submit  # type: ignore[method-assign]
    return uploads


@pytest.mark.asyncio
@pytest.mark.parametrize("lie", ["shrunken roster", "two rosters"])
async def test_an_understated_cohort_is_refused_over_http(
    aiohttp_server: Any, tmp_path: Path, lie: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The server states a smaller cohort than it invited: one roster of the first half for everybody (the
    # others are left off it), or each half its own roster plus X (two disjoint groups of X's neighbours
    # that would each reach a threshold of the smaller n).  Every device refuses before sending a share.
    ca = EnrollmentAuthority.generate()
    n = 8
    app = create_app(_config(tmp_path / "srv", cohort=n, enrollment={"authority_key": ca.public_key.hex()}))
    server = await aiohttp_server(app)
    coordinator = app[COORDINATOR]

    def roster_for(device: int, honest: tuple[int, ...]) -> tuple[int, ...]:
        x, half = honest[0], len(honest) // 2
        if lie == "shrunken roster":
            return honest[:half]
        group = honest[:half] if device in honest[:half] else honest[half:]
        return tuple({x, *group})

    shown = _lie_about_the_roster(coordinator, roster_for)
    # the liar does not check the key advertisements against the cohort it really invited
    monkeypatch.setattr("protocol.server_session.verify_signature", lambda *args: None)
    uploads = _record_uploads(coordinator)
    clients = _clients(str(server.make_url("")).rstrip("/"), tmp_path / "dev", n, ca.public_key)
    for i, c in enumerate(clients):
        await c.register(certificate=ca.issue(c.identity_public_key, f"b{i % 2}"))
    results = await asyncio.gather(*(_join(c) for c in clients), return_exceptions=True)
    assert len(shown) == n and all(len(ids) < n for ids in shown.values())
    refused = [r for r in results if isinstance(r, RemoteProtocolError | CryptoError)]
    # the others were told the round aborted (too few devices left) before they had anything to release
    assert all(isinstance(r, RoundOutcome) and r.status is RoundStatus.ABORTED for r in results if r not in refused)
    if lie == "shrunken roster":
        # every device left off the roster refuses; those on it are the whole round, all shown one roster,
        # so the threshold counts a majority of everyone taking part (a smaller n is no longer a lie)
        off = [c for c in clients if c.device_id not in next(iter(shown.values()))]
        assert len(off) == n // 2 and len(set(shown.values())) == 1
        for c, r in zip(clients, results, strict=True):
            if c in off:
                assert isinstance(r, RemoteProtocolError) and "roster does not list this device" in str(r), r
    else:
        # X's advertisement names one roster: every neighbour shown the other refuses it before making a
        # share, and then too few are left for anybody to go on
        assert any("for this round's cohort" in str(r) for r in refused), results
        assert "EncryptedShares" not in uploads and "MaskedInput" not in uploads, uploads
    assert coordinator.status(0.0)["recent_rounds"][0]["status"] == "aborted"
    for c in clients:
        await c.close()


@pytest.mark.asyncio
async def test_certificates_naming_device_ids_register_under_them_and_a_relabelling_server_is_refused(
    aiohttp_server: Any, tmp_path: Path
) -> None:
    # Certificates issued for device ids 50.. register under those ids and run an honest round to a commit;
    # a certificate for an id already taken is refused; a server that registers a device under another id
    # than its certificate names is refused by the device.
    ca = EnrollmentAuthority.generate()
    n = 4
    app = create_app(_config(tmp_path / "srv", cohort=n, enrollment={"authority_key": ca.public_key.hex()}))
    server = await aiohttp_server(app)
    coordinator = app[COORDINATOR]
    url = str(server.make_url("")).rstrip("/")
    clients = _clients(url, tmp_path / "dev", n + 2, ca.public_key)
    for i, c in enumerate(clients[:n]):
        await c.register(certificate=ca.issue(c.identity_public_key, "b0", device_id=50 + i))
    assert [c.device_id for c in clients[:n]] == [50, 51, 52, 53]
    results = await asyncio.gather(*(_join(c) for c in clients[:n]))
    assert all(r.status is RoundStatus.COMMITTED for r in results), results
    taken = clients[n]
    with pytest.raises(EnrollmentRefused, match="device id 51 named by the certificate is already registered"):
        await taken.register(certificate=ca.issue(taken.identity_public_key, "b0", device_id=51))
    honest_register = coordinator.register

    def relabelling_register(*args: Any, **kw: Any) -> Any:
        out = honest_register(*args, **kw)
        return dataclasses.replace(out, device_id=out.device_id + 1000)

    coordinator.register = relabelling_register  # type: ignore[method-assign]
    victim = clients[n + 1]
    with pytest.raises(
        RemoteProtocolError, match="registered as device 1060, but the certificate was issued for device 60"
    ):
        await victim.register(certificate=ca.issue(victim.identity_public_key, "b0", device_id=60))
    for c in clients:
        await c.close()


#: The shipped privacy floor of a device talking to a server without DP.
NO_DP_FLOOR = PrivacyPolicy(require_noise=False)


async def _enrolled_fleet(
    aiohttp_server: Any,
    tmp_path: Path,
    n: int,
    floor: PrivacyPolicy | None,
    privacy: dict[str, Any] | None = None,
) -> tuple[Any, list[DeviceClient]]:
    """(coordinator, devices): a server whose rounds a fresh enrollment authority signs (DP set by ``privacy``'s
    fields of `[privacy]`, if given) and ``n`` devices pinning that authority with ``floor`` (`_clients`),
    registered from two credential sources."""
    ca = EnrollmentAuthority.generate()
    cfg = _config(tmp_path / "srv", cohort=n, enrollment={"authority_key": ca.public_key.hex()})
    if privacy is not None:
        cfg = dataclasses.replace(cfg, privacy=dataclasses.replace(cfg.privacy, **privacy))
    app = create_app(cfg)
    server = await aiohttp_server(app)
    clients = _clients(str(server.make_url("")).rstrip("/"), tmp_path / "dev", n, ca.public_key, floor)
    for i, c in enumerate(clients):
        await c.register(certificate=ca.issue(c.identity_public_key, f"b{i % 2}"))
    return app[COORDINATOR], clients


@pytest.mark.asyncio
async def test_a_placement_a_server_could_exploit_is_refused_over_http(aiohttp_server: Any, tmp_path: Path) -> None:
    # Real devices with the default floor (protocol 1.9: t >= ⌊γ n⌋ + 2 for a sparse round).  Round 1 runs
    # with the server's own (k, t) = (11, 3) for 20 devices and commits; then the server invites with the
    # semi-honest figures (k = 9, t = 2 = ⌊γ n⌋ + 1), under which its colluder placed next to X plus X's own
    # share would reach t.  Every device refuses before it generates a key; only their leave notices arrive.
    n = 20
    coordinator, clients = await _enrolled_fleet(aiohttp_server, tmp_path, n, NO_DP_FLOOR)
    honest = await asyncio.gather(*(_join(c) for c in clients))
    assert all(r.status is RoundStatus.COMMITTED for r in honest), honest
    semi = find_parameters(n, 0.33, 0.05, adversarial_placement=False)
    assert (semi.k, semi.t) == (9, 2) and find_parameters(n, 0.33, 0.05) == GraphParams(k=11, t=3)
    honest_check_in = coordinator.check_in

    def lying_check_in(device_id: int, now: float) -> Any:
        out = honest_check_in(device_id, now)
        if isinstance(out, RoundInvite):
            out = dataclasses.replace(out, graph_k=semi.k, graph_t=semi.t)
        return out

    coordinator.check_in = lying_check_in  # type: ignore[method-assign]
    uploads = _record_uploads(coordinator)
    lied = await asyncio.gather(*(_join(c) for c in clients))
    assert all(r.status is RoundStatus.REFUSED and "places its 1 colluder " in (r.reason or "") for r in lied), lied
    assert set(uploads) == {"Abort"}, uploads  # no key advertisement, share or masked input left a device
    for c in clients:
        await c.close()


def _lose_the_walls(coordinator: Any, block: int) -> dict[str, Any]:
    """Wrap the coordinator for the next round: from the roster in its invites (what every device signs) the
    liar computes the roster ring, and it "loses" the masked inputs of the two walls of (k - 1) / 2 ring
    positions around the block B = ring[:block], keeping B and the rest as survivors.  Returns the invite,
    the ring and the walls once the round is open."""
    honest_check_in, honest_submit, plan = coordinator.check_in, coordinator.submit, {}

    def lying_check_in(device_id: int, now: float) -> Any:
        out = honest_check_in(device_id, now)
        if isinstance(out, RoundInvite) and "ring" not in plan:
            ring = roster_ring(out.roster_ids, roster_digest(out.roster_ids, out.roster_keys))
            half = (out.graph_k - 1) // 2
            plan.update(invite=out, ring=ring, walls=frozenset(ring[block : block + half] + ring[len(ring) - half :]))
        return out

    def lying_submit(device_id: int, round_id: int, message: Any, now: float, **kw: Any) -> Any:
        if isinstance(message, MaskedInput) and device_id in plan["walls"]:
            # The lie: this masked input never arrived.  The sender counts as dropped at once rather than at
            # the phase's deadline (the survivors are shown the same survivor set either way).
            message, kw = Abort(round_id=round_id, device_id=device_id, reason="masked input not received"), {}
        return honest_submit(device_id, round_id, message, now, **kw)

    coordinator.check_in = lying_check_in  # type: ignore[method-assign]
    coordinator.submit = lying_submit  # type: ignore[method-assign]
    return plan


@pytest.mark.asyncio
async def test_walls_of_dropouts_around_a_block_are_refused_over_http(aiohttp_server: Any, tmp_path: Path) -> None:
    # Protocol 1.11, the attack of tests/test_partial_sums.py with real devices: 30 of them, (k, t) = (13, 3).
    # Round 1 commits.  In round 2 the server drops the masked inputs of the two walls of 6 ring positions
    # around a block B of 6 and keeps B and the other 12 as survivors: 18 survivors, more than the 16
    # signatures a device needs, so only the survivor cut check stands between the server and the sum of B.
    # Every survivor refuses to sign the set: no signature and no unmask share reaches the server.
    n, block = 30, 6
    coordinator, clients = await _enrolled_fleet(aiohttp_server, tmp_path, n, NO_DP_FLOOR)
    honest = await asyncio.gather(*(_join(c) for c in clients))
    assert all(r.status is RoundStatus.COMMITTED and r.round_id == 1 for r in honest), honest
    plan = _lose_the_walls(coordinator, block)
    uploads = _record_uploads(coordinator)
    lied = await asyncio.gather(*(_join(c) for c in clients), return_exceptions=True)
    invite, ring, walls = plan["invite"], plan["ring"], plan["walls"]
    assert (invite.round_id, invite.graph_k, invite.graph_t) == (2, 13, 3) and sorted(ring) == sorted(invite.roster_ids)
    survivors = set(ring) - walls
    assert len(walls) == 12 and len(survivors) == 18 >= required_signatures(invite, 0.05) == 16
    outcomes = {c.device_id: r for c, r in zip(clients, lied, strict=True)}
    for u in survivors:  # inside B or not, every survivor refuses before it signs
        assert isinstance(outcomes[u], SurvivorSetSplit), outcomes[u]
        assert "leaves two runs of 6 ring positions with 0 survivors, no more than the 1 colluders" in str(outcomes[u])
    assert all(isinstance(outcomes[w], RoundOutcome) and outcomes[w].status is RoundStatus.ABORTED for w in walls)
    # every device masked its input; the survivors then only said they leave
    assert uploads.count("MaskedInput") == n and uploads.count("Abort") == len(survivors), uploads
    assert "ConsistencySignature" not in uploads and "UnmaskResponse" not in uploads, uploads
    recent = coordinator.status(0.0)["recent_rounds"][0]
    assert recent["round_id"] == 2 and recent["status"] == "aborted", recent
    for c in clients:
        await c.close()


@pytest.mark.asyncio
async def test_noise_sized_for_fewer_colluders_is_refused_over_http(aiohttp_server: Any, tmp_path: Path) -> None:
    # Protocol 1.12: with DP the invite states f, the colluding devices the noise is sized against.  Round 1 of
    # 20 real devices with the default floor runs with the server's f = ⌊0.05·20⌋ = 1 and commits; in round 2 the
    # server states f = 0 (noise its colluder could thin below μ by adding none).  Every device refuses before
    # it generates a key, and says why.
    n = 20
    dp = {"enabled": True, "epsilon": 8.0, "planned_rounds": 2}
    coordinator, clients = await _enrolled_fleet(aiohttp_server, tmp_path, n, PrivacyPolicy(), dp)  # device default
    seen: list[RoundInvite] = []
    honest_check_in = coordinator.check_in

    def watching_check_in(device_id: int, now: float) -> Any:
        out = honest_check_in(device_id, now)
        if isinstance(out, RoundInvite):
            seen.append(out)
        return out

    coordinator.check_in = watching_check_in  # type: ignore[method-assign]
    honest = await asyncio.gather(*(_join(c) for c in clients))
    assert all(r.status is RoundStatus.COMMITTED for r in honest), honest
    assert seen and all(i.dp_mu > 0 and i.dp_colluders == 1 and i.cohort_size == n for i in seen)
    assert all(c.privacy_spent > 0 for c in clients)

    def lying_check_in(device_id: int, now: float) -> Any:
        out = honest_check_in(device_id, now)
        if isinstance(out, RoundInvite):
            out = dataclasses.replace(out, dp_colluders=0)
        return out

    coordinator.check_in = lying_check_in  # type: ignore[method-assign]
    spent = [c.privacy_spent for c in clients]
    uploads = _record_uploads(coordinator)
    lied = await asyncio.gather(*(_join(c) for c in clients))
    want = "calibrated against 0 colluding devices, fewer than the 1 this device assumes"
    assert all(r.status is RoundStatus.REFUSED and want in (r.reason or "") for r in lied), lied
    assert set(uploads) == {"Abort"}, uploads  # no key advertisement, share or masked input left a device
    assert [c.privacy_spent for c in clients] == spent  # nothing charged
    for c in clients:
        await c.close()
