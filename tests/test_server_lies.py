"""A server that lies about what it alone decides (the session, the cohort), run in process: a scripted
lying server around the real `ServerSecAggSession` and `DeviceSecAggSession`.  Each attack must be refused
with a typed error before this device releases anything about its input.  The same attacks over HTTP
with real `DeviceClient`s are in tests/test_server_lies_http.py."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from device_sdk.persistence import load_ledger, save_ledger
from protocol.device_session import DeviceSecAggSession
from protocol.errors import (
    CertificateExpired,
    ConfigError,
    CryptoError,
    NotEnoughParticipants,
    PrivacyFloorViolation,
    RemoteProtocolError,
    SessionReplayed,
)
from protocol.graph import find_parameters
from protocol.identity import (
    CERTIFICATE_V3_BYTES,
    SigningKey,
    issue_certificate,
    key_advertisement_payload,
    read_certificate,
    roster_digest,
    survivor_set_payload,
    verify_certificate,
    verify_signature,
)
from protocol.messages import (
    ConsistencyRequest,
    ConsistencySignature,
    PublicKeys,
    RoundInvite,
    ShareKeysBroadcast,
    UnmaskRequest,
)
from protocol.phases import Phase, required_signatures
from protocol.policy import SESSION_HISTORY, DeviceLedger, PrivacyPolicy, check_invite
from protocol.round_params import RoundParameters
from protocol.samplers import insecure_test_noise_stream
from protocol.server_session import ServerSecAggSession
from protocol.shamir import Share, reconstruct

LENGTH = 8
#: An invite with the smallest threshold (t = 1), so that the majority term is what the property test sees.
_TEMPLATE = RoundInvite(
    round_id=3,
    device_id=0,
    vector_length=LENGTH,
    graph_k=1,
    graph_t=1,
    clip_norm=1.0,
    scale_bits=16,
    advertise_deadline=1.0,
    share_keys_deadline=2.0,
    masked_input_deadline=3.0,
    unmask_deadline=4.0,
)


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
    again.admit_round(8)  # the same invitation again: no session id yet, no share, no signature
    again.record_session(8, b"\x02" * 32)
    with pytest.raises(SessionReplayed):
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


# -- a cohort size the server cannot shrink ----------------------------------------------------------------------


def _keys_of(devices: dict[int, DeviceSecAggSession]) -> dict[int, PublicKeys]:
    out = {}
    for u, dev in devices.items():
        msg = dev.send()
        assert isinstance(msg, PublicKeys)
        out[u] = msg
    return out


def _broadcast(u: int, keys: dict[int, PublicKeys], neighbours: list[int], sid: bytes) -> ShareKeysBroadcast:
    """What a lying server builds by hand: device ``u``'s ShareKeys broadcast over ``neighbours``."""
    ns = sorted(neighbours)
    return ShareKeysBroadcast(
        round_id=3,
        device_id=u,
        session_id=sid,
        neighbour_ids=tuple(ns),
        c_public_keys=tuple(keys[v].c_public_key for v in ns),
        s_public_keys=tuple(keys[v].s_public_key for v in ns),
        certificates=tuple(keys[v].certificate for v in ns),
        signatures=tuple(keys[v].signature for v in ns),
    )


def _lied_invite(honest: RoundInvite, roster: list[int], enrolled: dict[int, tuple[SigningKey, bytes]]) -> RoundInvite:
    ids = tuple(sorted(roster))
    return dataclasses.replace(
        honest, cohort_size=len(ids), roster_ids=ids, roster_keys=tuple(enrolled[v][0].public_key for v in ids)
    )


def test_an_understated_cohort_shown_as_two_rosters_is_refused_before_any_share() -> None:
    # The attack: the cohort is 40; the server tells two disjoint groups of X's neighbours that the cohort
    # is 17 (a roster of their group and X each), so that each group's signatures pass a 17-device
    # threshold on a different survivor set.  X signs the one roster it was shown; the neighbours shown the
    # other roster find X's advertisement signed for another cohort and refuse before making any share.
    ids = list(range(100, 140))
    authority, enrolled = _enrolled(ids)
    server = _server(ids, enrolled, authority, t=4)
    x, group_a, group_b = ids[0], ids[1:17], ids[17:33]
    devices = {}
    for group in (group_a, group_b):
        for u in [*group, x] if group is group_a else group:
            invite = _lied_invite(server.outbox(u), [x, *group], enrolled)
            assert invite.cohort_size == 17
            devices[u] = DeviceSecAggSession(
                invite, identity=enrolled[u][0], certificate=enrolled[u][1], authority_key=authority.public_key
            )
    keys = _keys_of(devices)
    sid = bytes(32)
    for u in group_a:  # same roster as X: the broadcast of their own group and X is accepted
        devices[u].receive(_broadcast(u, keys, [x, *group_a], sid))
    for u in group_b:
        with pytest.raises(CryptoError, match="not signed by its certified key for this round's cohort"):
            devices[u].receive(_broadcast(u, keys, [x, *group_b], sid))
        assert devices[u].phase is Phase.ERROR  # nothing sent: the reply was never built


def test_a_shrunken_roster_leaves_devices_off_it_and_they_refuse() -> None:
    # One roster of 17 for everybody: the 23 devices left off it refuse the invite; the 17 on it can only
    # ever count signatures of those 17, a majority of everyone who takes part.
    ids = list(range(100, 140))
    authority, enrolled = _enrolled(ids)
    server = _server(ids, enrolled, authority, t=4)
    small = ids[:17]
    for u in ids:
        invite = _lied_invite(server.outbox(u), small, enrolled)
        if u in small:
            DeviceSecAggSession(
                invite, identity=enrolled[u][0], certificate=enrolled[u][1], authority_key=authority.public_key
            )
            continue
        with pytest.raises(RemoteProtocolError, match="roster does not list this device"):
            DeviceSecAggSession(
                invite, identity=enrolled[u][0], certificate=enrolled[u][1], authority_key=authority.public_key
            )


@pytest.mark.parametrize(
    "lie, error, match",
    [
        ("no roster", RemoteProtocolError, "shows no roster"),
        ("ids only", RemoteProtocolError, "shows no roster"),
        ("forged own key", RemoteProtocolError, "under its own key"),
        ("below the pinned minimum", PrivacyFloorViolation, "pinned minimum cohort size"),
    ],
)
def test_an_invite_whose_roster_cannot_be_signed_is_refused(lie: str, error: type, match: str) -> None:
    ids = list(range(100, 112))
    authority, enrolled = _enrolled(ids)
    honest = _server(ids, enrolled, authority).outbox(100)
    invite = {
        "no roster": dataclasses.replace(honest, roster_ids=(), roster_keys=()),
        "ids only": dataclasses.replace(honest, roster_keys=()),
        "forged own key": dataclasses.replace(
            honest, roster_keys=(SigningKey.generate().public_key, *honest.roster_keys[1:])
        ),
        "below the pinned minimum": honest,
    }[lie]
    policy = PrivacyPolicy(min_cohort_size=20, enforce=True, require_noise=False, adversary_rate=0.0)
    with pytest.raises(error, match=match):
        DeviceSecAggSession(
            invite,
            identity=enrolled[100][0],
            certificate=enrolled[100][1],
            authority_key=authority.public_key,
            policy=policy if lie == "below the pinned minimum" else None,
        )


def test_a_neighbour_off_the_roster_or_with_a_foreign_identity_is_refused() -> None:
    ids = list(range(100, 112))
    authority, enrolled = _enrolled(ids)
    outsider_key = SigningKey.generate()
    enrolled_out = {**enrolled, 200: (outsider_key, issue_certificate(authority, outsider_key.public_key))}
    server = _server(ids, enrolled, authority)
    devices = _devices(server, enrolled, authority, {u: DeviceLedger() for u in ids})
    keys = _keys_of(devices)
    # a certified device of the same authority, not invited: the server slips it in as a neighbour
    stranger = DeviceSecAggSession(
        dataclasses.replace(_lied_invite(server.outbox(100), [*ids, 200], enrolled_out), device_id=200),
        identity=outsider_key,
        certificate=enrolled_out[200][1],
        authority_key=authority.public_key,
    )
    keys[200] = stranger.send()
    with pytest.raises(RemoteProtocolError, match="not on the round's roster"):
        devices[101].receive(_broadcast(101, keys, [101, 102, 103, 104, 200], bytes(32)))


def _split_attack(n: int, corrupt: int, gamma: float, seed: int) -> dict[str, int]:
    """The split-view attack on a signed round of ``n`` devices with ``corrupt`` colluders (whose keys the
    server holds, and which sign both sets): X's honest neighbours are split at random in two groups, one
    shown U3 with X and one without.  Returns how many honest devices of each group released shares."""
    rng = np.random.default_rng(seed)
    ids = list(range(100, 100 + n))
    authority, enrolled = _enrolled(ids)
    server = _server(ids, enrolled, authority, t=2, seed=seed)
    policy = PrivacyPolicy(adversary_rate=gamma, enforce=False, require_noise=False)
    devices = {
        u: DeviceSecAggSession(
            server.outbox(u),
            rng=insecure_test_noise_stream(seed, u),
            identity=enrolled[u][0],
            certificate=enrolled[u][1],
            authority_key=authority.public_key,
            policy=policy,
        )
        for u in ids
    }
    _to_consistency(server, devices)
    order = [int(v) for v in rng.permutation(ids)]
    x, bad, honest = order[0], order[1 : 1 + corrupt], order[1 + corrupt :]
    cut = int(rng.integers(0, len(honest) + 1))
    groups = {"with X": (honest[:cut], tuple(ids)), "without X": (honest[cut:], tuple(v for v in ids if v != x))}
    cohort = (n, roster_digest(ids, [enrolled[u][0].public_key for u in ids]))
    sid = server.session_id
    released = {}
    for name, (group, shown) in groups.items():
        sigs = {v: enrolled[v][0].sign(survivor_set_payload(3, sid, shown, cohort)) for v in bad}
        for u in group:
            devices[u].receive(ConsistencyRequest(round_id=3, device_id=u, session_id=sid, survivor_set=shown))
            sigs[u] = devices[u].send().signature
        signers = tuple(sorted(sigs))
        released[name] = 0
        for u in group:
            u2 = tuple(ids)
            request = UnmaskRequest(
                round_id=3,
                device_id=u,
                session_id=sid,
                survivors=tuple(v for v in u2 if v in shown),
                dropped=tuple(v for v in u2 if v not in shown),
                n_survivors=len(signers),
                survivor_set=shown,
                signer_ids=signers,
                signer_certificates=tuple(enrolled[v][1] for v in signers),
                signatures=tuple(sigs[v] for v in signers),
            )
            try:
                devices[u].receive(request)
            except RemoteProtocolError:
                continue
            released[name] += 1
    return released


@pytest.mark.parametrize("seed", range(6))
def test_two_disjoint_honest_groups_never_both_release_whatever_the_split(seed: int) -> None:
    # Real sessions, random cohorts, random splits, the most colluders the device's gamma allows: at most
    # one of the two groups ever gets enough signatures, so X's b-shares and s-shares never both leave.
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(8, 19))
    gamma = float(rng.choice([0.0, 0.05, 0.1, 0.2]))
    released = _split_attack(n, int(gamma * n), gamma, seed)
    assert min(released.values()) == 0, released


@settings(max_examples=400, deadline=None)
@given(n=st.integers(2, 5000), gamma=st.floats(0.0, 0.49), data=st.data())
def test_no_two_disjoint_honest_sets_reach_the_threshold(n: int, gamma: float, data: st.DataObject) -> None:
    # The property behind `required_signatures`: with f <= floor(gamma n) dishonest identities on an n-device
    # roster, each honest identity signing one set, two disjoint honest groups H1, H2 (|H1| + |H2| <= n - f)
    # can never both reach the threshold with the f dishonest signatures added to each.
    # Proof: need = floor((n + f) / 2) + 1 > (n + f) / 2, so |H1| + f >= need and |H2| + f >= need would give
    # |H1| + |H2| >= 2 need - 2 f > n - f, more honest identities than the roster holds.
    f = data.draw(st.integers(0, int(gamma * n)), label="f")
    h1 = data.draw(st.integers(0, n - f), label="h1")
    h2 = data.draw(st.integers(0, n - f - h1), label="h2")
    need = required_signatures(dataclasses.replace(_TEMPLATE, cohort_size=n), gamma)
    assert not (h1 + f >= need and h2 + f >= need)


# -- certificates that bind the device id, expiry checked on the device -------------------------------------------


def _issued(authority: SigningKey, key: SigningKey, device_id: int | None, *, expired: bool = False) -> bytes:
    now = int(time.time())
    start, end = (now - 10 * 86400, now - 86400) if expired else (now - 60, now + 86400)
    return issue_certificate(authority, key.public_key, not_before=start, not_after=end, device_id=device_id)


def test_a_certificate_names_its_device_id_and_is_refused_for_another() -> None:
    authority, key = SigningKey.generate(), SigningKey.generate()
    cert = _issued(authority, key, 7)
    assert len(cert) == CERTIFICATE_V3_BYTES
    assert read_certificate(cert, authority.public_key).device_id == 7
    assert verify_certificate(cert, authority.public_key, device_id=7) == key.public_key
    with pytest.raises(CryptoError, match="issued for device 7 is presented for device 8"):
        verify_certificate(cert, authority.public_key, device_id=8)
    with pytest.raises(CryptoError, match="needs a validity period"):
        issue_certificate(authority, key.public_key, device_id=7)
    forged = cert[:-72] + (8).to_bytes(8, "big") + cert[-64:]  # the id is under the authority's signature
    with pytest.raises(CryptoError, match="not signed by the pinned authority"):
        read_certificate(forged, authority.public_key)


def test_a_device_refuses_its_own_certificate_for_another_id_or_expired() -> None:
    ids = list(range(100, 104))
    authority, enrolled = _enrolled(ids)
    invite = _server(ids, enrolled, authority).outbox(100)
    key = enrolled[100][0]
    for cert, error, match in (
        (_issued(authority, key, 101), CryptoError, "issued for device 101"),
        (_issued(authority, key, 100, expired=True), CertificateExpired, "expired"),
    ):
        with pytest.raises(error, match=match):
            DeviceSecAggSession(invite, identity=key, certificate=cert, authority_key=authority.public_key)
    DeviceSecAggSession(
        invite, identity=key, certificate=_issued(authority, key, 100), authority_key=authority.public_key
    )


@pytest.mark.parametrize("lie", ["issued for another id", "expired"])
def test_a_neighbour_whose_certificate_names_another_id_or_expired_is_refused(lie: str) -> None:
    # The server relabels a certified device (its certificate was issued for id 200) as neighbour 103, or
    # forwards a neighbour certificate that has expired: each device checks it before making a share.
    ids = list(range(100, 104))
    authority = SigningKey.generate()
    keys = {u: SigningKey.generate() for u in ids}
    certs = {u: _issued(authority, keys[u], u) for u in ids}
    certs[103] = _issued(authority, keys[103], 200 if lie == "issued for another id" else 103, expired=lie == "expired")
    enrolled = {u: (keys[u], certs[u]) for u in ids}
    server = _server(ids, enrolled, authority)
    devices = {
        u: DeviceSecAggSession(
            server.outbox(u), identity=keys[u], certificate=certs[u], authority_key=authority.public_key
        )
        for u in ids
        if u != 103
    }
    published = _keys_of(devices)
    liar = PublicKeys(  # what device 103 would advertise: signed by its key over this round's roster
        round_id=3,
        device_id=103,
        c_public_key=SigningKey.generate().public_key,
        s_public_key=SigningKey.generate().public_key,
        certificate=certs[103],
    )
    cohort = (len(ids), roster_digest(ids, [keys[u].public_key for u in ids]))
    payload = key_advertisement_payload(3, 103, liar.c_public_key, liar.s_public_key, cohort)
    published[103] = dataclasses.replace(liar, signature=keys[103].sign(payload))
    error = CryptoError if lie == "issued for another id" else CertificateExpired
    with pytest.raises(error, match="issued for device 200" if lie == "issued for another id" else "expired"):
        devices[100].receive(_broadcast(100, published, ids, bytes(32)))
    assert devices[100].phase is Phase.ERROR


# -- graph placement: the server's, so a device may ask for (k, t) that hold wherever colluders sit ----------------


def test_a_device_refuses_a_sparse_round_whose_t_a_placing_server_reaches() -> None:
    # Protocol 1.9: the default floor asks t >= ⌊γ n⌋ + 2 of a sparse round, the finder always gives it.
    default, trusting = PrivacyPolicy(require_noise=False), PrivacyPolicy(require_noise=False, placement_safe=False)
    assert default.placement_safe
    for n in (100, 1000):
        g = find_parameters(n, 0.33, 0.05)
        check_invite(dataclasses.replace(_TEMPLATE, cohort_size=n, graph_k=g.k, graph_t=g.t), default)
        semi = find_parameters(n, 0.33, 0.05, adversarial_placement=False)  # n = 1,000: k = 73, t = 24
        invite = dataclasses.replace(_TEMPLATE, cohort_size=n, graph_k=semi.k, graph_t=semi.t)
        with pytest.raises(PrivacyFloorViolation, match=f"places its {int(0.05 * n)} colluders"):
            check_invite(invite, default)
        check_invite(invite, trusting)  # a device that trusts the server's placement
    with pytest.raises(PrivacyFloorViolation, match="need t >= 52"):  # 50 colluders + its own share
        check_invite(dataclasses.replace(_TEMPLATE, cohort_size=1000, graph_k=123, graph_t=51), default)
    # the complete graph never depends on placement
    check_invite(dataclasses.replace(_TEMPLATE, cohort_size=40, graph_k=40, graph_t=21), default)
    # ... and the device refuses the semi-honest invite before it generates any key
    semi = find_parameters(1000, 0.33, 0.05, adversarial_placement=False)
    invite = dataclasses.replace(_TEMPLATE, cohort_size=1000, graph_k=semi.k, graph_t=semi.t)
    ledger = DeviceLedger()
    with pytest.raises(PrivacyFloorViolation):
        DeviceSecAggSession(invite, policy=default, ledger=ledger)
    assert ledger.sessions == {}


def _ring_graph(ring: list[int], k: int) -> dict[int, tuple[int, ...]]:
    """The Harary ring `protocol.graph.harary_graph` builds, over a ring order the server chose."""
    half, n = (k - 1) // 2, len(ring)
    return {ring[i]: tuple(sorted(ring[(i + o) % n] for o in range(-half, half + 1))) for i in range(n)}


def _placed_attack(k: int, t: int, policy: PrivacyPolicy, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """40 devices, γ = 0.1: the server puts its 4 colluders right around X (ring positions ±1, ±2), runs the
    round with the real sessions, then says X's 16 honest neighbours dropped before their masked inputs (it
    would reconstruct their pairwise masks from their other neighbours) and asks X to unmask.  Returns what
    the server then holds of X's self-mask seed: the colluders' shares, plus X's own if X answered.

    A survivor set of the other 24 devices would also pass the consistency check (⌊(40 + 4)/2⌋ + 1 = 23
    signatures), so this runs unsigned: what stops it is t, not the signatures.
    """
    n, x, colluders = 40, 0, [1, 2, 3, 4]
    honest = list(range(5, n))
    ring = [honest[-1], honest[-2], 3, 1, x, 2, 4, *honest[:-2]]
    graph = _ring_graph(ring, k)
    monkeypatch.setattr("protocol.server_session.harary_graph", lambda ids, k_, rng: graph)
    params = RoundParameters(
        round_id=3, vector_length=LENGTH, k=k, t=t, clip_norm=1.0, scale_bits=16, deadlines=(1.0, 2.0, 3.0, 4.0)
    )
    server = ServerSecAggSession(params, list(range(n)), rng=np.random.default_rng(0))
    devices = {
        u: DeviceSecAggSession(server.outbox(u), rng=insecure_test_noise_stream(0, u), policy=policy) for u in range(n)
    }
    dropped = [v for v in graph[x] if v != x and v not in colluders]
    assert len(dropped) == k - 1 - len(colluders)
    rng = np.random.default_rng(1)
    for index in range(3):
        for u, dev in devices.items():
            if index > 0:
                dev.receive(server.outbox(u))
            if index == 2:
                dev.provide_input(rng.integers(0, 2**32, size=LENGTH, dtype=np.uint32))
            message = dev.send()
            if not (index == 2 and u in dropped):  # the lie: their masked inputs "never arrived"
                server.receive(u, message)
        server.advance(params.deadlines[index])
    seed = devices[x]._seed  # X's secret, to compare with what the adversary reconstructs
    held = [devices[c]._held_b[x] for c in colluders]  # the colluders' memory: one share of b_X each
    survivors = tuple(sorted((x, *colluders)))
    request = UnmaskRequest(
        round_id=3,
        device_id=x,
        session_id=server.session_id,
        survivors=survivors,
        dropped=tuple(sorted(dropped)),
        n_survivors=n - len(dropped),
    )
    outcome: dict[str, Any] = {"seed": seed, "held": held, "refused": None}
    try:
        devices[x].receive(request)
    except RemoteProtocolError as exc:
        outcome["refused"] = exc
        outcome["phase"] = devices[x].phase
        return outcome
    response = devices[x].send()
    held.append(Share.from_bytes(response.b_shares[response.b_share_ids.index(x)]))  # X's own share
    return outcome


def test_colluders_placed_around_a_device_hold_fewer_than_t_of_its_shares(monkeypatch: pytest.MonkeyPatch) -> None:
    # The finder's (k, t) at n = 40, γ = 0.1: k = 21, t = 6 = ⌊γ n⌋ + 2.  The 4 colluders hold 4 shares of
    # b_X; X refuses the unmask request (5 surviving neighbours, itself included, < t) and releases nothing.
    g = find_parameters(40, 0.33, 0.1)
    assert (g.k, g.t) == (21, 6)
    out = _placed_attack(g.k, g.t, PrivacyPolicy(adversary_rate=0.1, require_noise=False), monkeypatch)
    assert isinstance(out["refused"], RemoteProtocolError) and "below the threshold t=6" in str(out["refused"])
    assert out["phase"] is Phase.ERROR
    assert len(out["held"]) == 4 < g.t
    with pytest.raises(NotEnoughParticipants):
        reconstruct(out["held"], g.t)


def test_the_placement_attack_recovers_the_self_mask_under_semi_honest_parameters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The control: the semi-honest finder's (k, t) = (19, 5) = ⌊γ n⌋ + 1, on a device that trusts the
    # server's placement.  X answers, and its own share plus the colluders' 4 reconstruct its self-mask seed.
    g = find_parameters(40, 0.33, 0.1, adversarial_placement=False)
    assert (g.k, g.t) == (19, 5)
    trusting = PrivacyPolicy(adversary_rate=0.1, require_noise=False, placement_safe=False)
    out = _placed_attack(g.k, g.t, trusting, monkeypatch)
    assert out["refused"] is None
    assert reconstruct(out["held"], g.t) == out["seed"]
    # the default device refuses the same invite before it makes a key
    with pytest.raises(PrivacyFloorViolation, match="places its 4 colluders"):
        _placed_attack(g.k, g.t, PrivacyPolicy(adversary_rate=0.1, require_noise=False), monkeypatch)


def test_the_server_checks_one_roster_once_not_once_per_invite(monkeypatch: pytest.MonkeyPatch) -> None:
    # n invites around the same roster: checking it per invite would cost O(n²) on the server's loop.
    import protocol.messages as messages

    calls = []
    real = messages.check_bytes_tuple

    def counting(owner: str, name: str, values: object, length: int | None = None) -> None:
        calls.append(name)
        real(owner, name, values, length)

    monkeypatch.setattr(messages, "check_bytes_tuple", counting)
    ids = list(range(100, 300))
    authority, enrolled = _enrolled(ids)
    server = _server(ids, enrolled, authority)
    assert calls.count("roster_keys") == 1
    assert all(server.outbox(u).roster_keys == server.outbox(100).roster_keys for u in ids)
    with pytest.raises(ValueError, match="cohort_size"):  # the memo never skips the size check
        dataclasses.replace(server.outbox(100), cohort_size=5)
