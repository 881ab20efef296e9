"""A server that lies about what it alone decides (the session, the cohort), run in process: a scripted
lying server around the real `ServerSecAggSession` and `DeviceSecAggSession`.  Each attack must be refused
with a typed error before this device releases anything about its input.  The same attacks over HTTP
with real `DeviceClient`s are in tests/test_server_lies_http.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from device_sdk.persistence import load_ledger, save_ledger
from protocol.device_session import DeviceSecAggSession
from protocol.errors import ConfigError, SessionReplayed
from protocol.identity import (
    SigningKey,
    issue_certificate,
    roster_digest,
    survivor_set_payload,
    verify_signature,
)
from protocol.messages import ConsistencyRequest, ConsistencySignature, PublicKeys
from protocol.phases import Phase
from protocol.policy import SESSION_HISTORY, DeviceLedger
from protocol.round_params import RoundParameters
from protocol.samplers import insecure_test_noise_stream
from protocol.server_session import ServerSecAggSession

LENGTH = 8


def _enrolled(ids: list[int]) -> tuple[SigningKey, dict[int, tuple[SigningKey, bytes]]]:
    authority = SigningKey.generate()
    keys = {u: SigningKey.generate() for u in ids}
    return authority, {u: (key, issue_certificate(authority, key.public_key)) for u, key in keys.items()}


def _server(
    ids: list[int],
    enrolled: dict[int, tuple[SigningKey, bytes]],
    authority: SigningKey,
    *,
    round_id: int = 3,
    t: int = 4,
    seed: int = 0,
) -> Any:
    params = RoundParameters(
        round_id=round_id,
        vector_length=LENGTH,
        k=len(ids),
        t=t,
        clip_norm=1.0,
        scale_bits=16,
        deadlines=(1.0, 2.0, 3.0, 4.0),
        authority_key=authority.public_key,
    )
    identities = {u: enrolled[u][0].public_key for u in ids}
    return ServerSecAggSession(params, ids, rng=np.random.default_rng(seed), identities=identities)


def _devices(
    server: Any, enrolled: dict[int, tuple[SigningKey, bytes]], authority: SigningKey, ledgers: dict[int, DeviceLedger]
) -> dict[int, DeviceSecAggSession]:
    return {
        u: DeviceSecAggSession(
            server.outbox(u),
            rng=insecure_test_noise_stream(0, u),
            identity=key,
            certificate=cert,
            authority_key=authority.public_key,
            ledger=ledgers[u],
        )
        for u, (key, cert) in enrolled.items()
    }


def _to_consistency(server: Any, devices: dict[int, DeviceSecAggSession]) -> None:
    d = server.params.deadlines
    rng = np.random.default_rng(1)
    for index, name in enumerate(("keys", "shares", "masked")):
        for u, dev in devices.items():
            if index > 0:
                dev.receive(server.outbox(u))
            if name == "masked":
                dev.provide_input(rng.integers(0, 2**32, size=LENGTH, dtype=np.uint32))
            server.receive(u, dev.send())
        server.advance(d[index])


# -- sessions that cannot be replayed ----------------------------------------------------------------------------


def test_a_second_session_of_a_round_is_refused_before_any_key_exists() -> None:
    # The replay attack: in session 1 of round 3 the server collects survivor signatures on a set without X;
    # it opens session 2 of round 3 with the same devices, to replay them under the same (round, session)
    # ids.  Every device remembers round 3 and refuses session 2 outright: no key, no share, no signature.
    ids = list(range(100, 112))
    authority, enrolled = _enrolled(ids)
    ledgers = {u: DeviceLedger() for u in ids}
    first = _server(ids, enrolled, authority)
    devices = _devices(first, enrolled, authority, ledgers)
    _to_consistency(first, devices)
    x = ids[0]
    without_x = tuple(v for v in ids if v != x)
    sigs = {}
    for u in without_x:
        devices[u].receive(
            ConsistencyRequest(round_id=3, device_id=u, session_id=first.session_id, survivor_set=without_x)
        )
        out = devices[u].send()
        assert isinstance(out, ConsistencySignature)
        sigs[u] = out.signature
    assert all(ledgers[u].sessions[3] == first.session_id for u in ids)
    second = _server(ids, enrolled, authority, seed=1)
    for u in ids:
        invite = second.outbox(u)
        with pytest.raises(SessionReplayed, match="already took part in a session of round 3"):
            DeviceSecAggSession(
                invite,
                identity=enrolled[u][0],
                certificate=enrolled[u][1],
                authority_key=authority.public_key,
                ledger=ledgers[u],
            )
    # the replay material is genuine: 11 valid signatures on (round 3, session 1, the set without X) ...
    cohort = (len(ids), roster_digest(ids, [enrolled[u][0].public_key for u in ids]))
    payload = survivor_set_payload(3, first.session_id, without_x, cohort)
    for u, sig in sigs.items():
        verify_signature(enrolled[u][0].public_key, sig, payload)
    # ... but no device of the round ever joins a session it could be replayed into
    assert second.phase is Phase.ADVERTISE_KEYS and not second.dropouts.get(Phase.ADVERTISE_KEYS)


def test_the_session_history_survives_a_restart_and_stays_bounded(tmp_path: Any) -> None:
    ledger = DeviceLedger()
    ledger.admit_round(7)
    ledger.record_session(7, b"\x01" * 32)
    save_ledger(tmp_path, ledger)
    again = load_ledger(tmp_path)  # a restarted device
    assert again.sessions == {7: b"\x01" * 32}
    with pytest.raises(SessionReplayed):
        again.admit_round(7)
    again.admit_round(8)
    # bounded: the oldest pair leaves the history and raises the floor, which still refuses its round id
    for rid in range(9, 9 + SESSION_HISTORY):
        again.admit_round(rid)
    assert len(again.sessions) == SESSION_HISTORY and again.round_floor == 8
    for old in (7, 8, 3):
        with pytest.raises(SessionReplayed):
            again.admit_round(old)
    save_ledger(tmp_path, again)
    assert load_ledger(tmp_path).round_floor == 8


def test_a_ledger_written_before_the_session_history_loads_and_a_malformed_history_is_refused() -> None:
    old = DeviceLedger().to_dict()
    del old["sessions"], old["round_floor"]
    assert DeviceLedger.from_dict(old).sessions == {}
    for bad in ([[1]], [[1, "zz"]], [["1", "00"]], "x"):
        with pytest.raises(ConfigError, match="session history"):
            DeviceLedger.from_dict({**old, "sessions": bad})


def test_a_refused_invite_does_not_use_up_its_round_id() -> None:
    # The floor is checked first: a round below the device's privacy floor does not enter the history.
    from protocol.errors import PrivacyFloorViolation
    from protocol.policy import PrivacyPolicy

    ids = list(range(100, 104))
    authority, enrolled = _enrolled(ids)
    ledger = DeviceLedger()
    invite = _server(ids, enrolled, authority, t=2).outbox(100)
    with pytest.raises(PrivacyFloorViolation):
        DeviceSecAggSession(invite, policy=PrivacyPolicy(), ledger=ledger)
    assert ledger.sessions == {}
    session = DeviceSecAggSession(invite, ledger=ledger)
    assert isinstance(session.send(), PublicKeys) and 3 in ledger.sessions
