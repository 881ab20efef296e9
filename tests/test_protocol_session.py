"""SecAgg+ sessions: secure sum properties, dropouts, DP correction, malicious-server checks, transitions."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.errors import (
    LocalProtocolError,
    NotEnoughParticipants,
    RemoteProtocolError,
    RoundClosed,
    StaleRound,
)
from protocol.messages import Abort, ErrorMessage, MaskedInput, UnmaskRequest
from protocol.noise import colluding_devices, released_variance, to_ring
from protocol.quantization import QuantizationConfig
from protocol.session import ACTIVE_PHASES, TRANSITIONS, Direction, Phase, Role
from tests.support.secagg_harness import run_secagg_round

from .secagg_helpers import Round, sample_messages


def _inputs(n: int, length: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 2**32, size=length, dtype=np.uint32) for _ in range(n)]


def _assert_no_individual_leak(result: object, t: int) -> None:
    shares = result.shares_received  # type: ignore[attr-defined]
    owners = {owner for _, owner in shares}
    for owner in owners:
        assert not (shares[("b", owner)] and shares[("s", owner)]), f"both share kinds of {owner} released"


# ------------------------------------------------------------------------------------ secure sum


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_secure_sum_is_bit_exact_for_any_cohort_and_dropouts(data: st.DataObject) -> None:
    n = data.draw(st.integers(3, 60), label="n")
    complete = data.draw(st.booleans(), label="complete graph") or n < 8
    if complete:
        k, t = n, data.draw(st.integers(2, max(2, n // 2)), label="t")
    else:
        k, t = None, None
    ids = list(range(n))
    drops = {
        p: set(data.draw(st.lists(st.sampled_from(ids), max_size=max(1, n // 6)), label=p.name)) for p in ACTIVE_PHASES
    }
    result = run_secagg_round(_inputs(n, 16, n), k=k, t=t, dropouts=drops, seed=n)
    lost = set().union(*drops.values())
    t_used = result.params.t
    if result.error is None:
        assert result.total is not None
        assert np.array_equal(result.total, result.expected)
        assert (
            result.survivors
            == frozenset(ids) - drops[Phase.ADVERTISE_KEYS] - drops[Phase.SHARE_KEYS] - drops[Phase.MASKED_INPUT]
        )
    else:
        assert isinstance(result.error, NotEnoughParticipants)
        _assert_no_individual_leak(result, t_used)
        # With the complete graph a round fails only when fewer than t devices answer the unmask request.
        if complete:
            assert n - len(lost) < t_used
    if complete and n - len(lost) >= t_used:
        assert result.error is None


def test_same_seed_and_schedule_give_identical_sums() -> None:
    xs = [np.random.default_rng(i).normal(size=64) for i in range(20)]
    cfg = QuantizationConfig(clip_norm=5.0, scale_bits=12)
    drops = {Phase.MASKED_INPUT: {3, 4}, Phase.UNMASK: {9}}
    a = run_secagg_round(xs, quantization=cfg, dp_mu=50.0, dropouts=drops, seed=11, dropout_rate=0.3)
    b = run_secagg_round(xs, quantization=cfg, dp_mu=50.0, dropouts=drops, seed=11, dropout_rate=0.3)
    c = run_secagg_round(xs, quantization=cfg, dp_mu=50.0, dropouts=drops, seed=12, dropout_rate=0.3)
    assert a.total is not None and b.total is not None and c.total is not None
    assert np.array_equal(a.total, b.total) and np.array_equal(a.total, a.expected)
    assert not np.array_equal(a.total, c.total)


@pytest.mark.parametrize("phase", ACTIVE_PHASES)
def test_drop_at_every_phase_completes_with_t_left(phase: Phase) -> None:
    n, t = 9, 4
    drops = {phase: {0, 5, 8}}
    result = run_secagg_round(_inputs(n, 32, 1), k=n, t=t, dropouts=drops)
    assert result.error is None and result.total is not None
    assert np.array_equal(result.total, result.expected)
    assert result.dropouts[phase] == frozenset({0, 5, 8})
    expected_survivors = set(range(n)) - ({0, 5, 8} if phase is not Phase.UNMASK else set())
    assert result.survivors == expected_survivors


def test_drops_in_every_phase_sparse_graph() -> None:
    n = 40
    drops = {Phase.ADVERTISE_KEYS: {1}, Phase.SHARE_KEYS: {2}, Phase.MASKED_INPUT: {3, 4}, Phase.UNMASK: {5}}
    result = run_secagg_round(_inputs(n, 32, 2), dropouts=drops, dropout_rate=0.33, adversary_rate=0.05)
    assert result.params.k < n  # really SecAgg+ (sparse)
    assert result.error is None and result.total is not None
    assert np.array_equal(result.total, result.expected)


@pytest.mark.parametrize("phase", ACTIVE_PHASES)
def test_fewer_than_t_aborts_and_reveals_nothing(phase: Phase) -> None:
    n, t = 6, 4
    result = run_secagg_round(_inputs(n, 8, 3), k=n, t=t, dropouts={phase: {0, 1, 2}})
    assert isinstance(result.error, NotEnoughParticipants)
    assert result.total is None
    _assert_no_individual_leak(result, t)
    if phase is not Phase.UNMASK:
        assert not result.shares_received  # aborted before any share was requested
    else:
        # Three responders: fewer than t shares of any secret reached the server.
        assert all(count < t for count in result.shares_received.values())


def test_exactly_t_survivors_completes() -> None:
    result = run_secagg_round(_inputs(6, 8, 4), k=6, t=4, dropouts={Phase.MASKED_INPUT: {0, 1}})
    assert result.error is None and result.total is not None
    assert np.array_equal(result.total, result.expected)


def test_float_inputs_are_quantized_and_summed() -> None:
    xs = [np.full(10, 0.25), np.full(10, -0.5), np.full(10, 1.0)]
    cfg = QuantizationConfig(clip_norm=10.0, scale_bits=10)
    result = run_secagg_round(xs, quantization=cfg, k=3, t=2)
    assert result.total is not None
    assert np.array_equal(result.total.view(np.int32), np.full(10, int(0.75 * 2**10), dtype=np.int32))


# ------------------------------------------------------------------------------------ DP correction


@pytest.mark.parametrize(("masked_drops", "unmask_drops"), [(0, 0), (6, 0), (12, 0), (6, 6)])
def test_dp_correction_keeps_variance_mu(masked_drops: int, unmask_drops: int) -> None:
    # 40,000 coordinates: the variance is measured to about 0.7%, so the 1.11 law (5% lower here) fails.
    n, mu, omega, length = 40, 400.0, 0.33, 40_000
    zeros = [np.zeros(length, dtype=np.uint32)] * n
    drops = {
        Phase.MASKED_INPUT: set(range(masked_drops)),
        Phase.UNMASK: set(range(masked_drops, masked_drops + unmask_drops)),
    }
    result = run_secagg_round(zeros, k=n, t=10, dp_mu=mu, dropout_rate=omega, dropouts=drops, seed=5)
    assert result.total is not None
    assert np.array_equal(result.total, to_ring(result.kept_noise))
    s = n - masked_drops
    noise = result.total.view(np.int32).astype(np.float64)
    t_min, f = result.dp_t_min, colluding_devices(n, 0.05)  # the harness's γ
    assert f == 2
    # Responders keep mu/(s - f) each; survivors that never answered keep their full mu/(t_min - f).
    want = released_variance(mu, t_min, s, s - unmask_drops, colluders=f)
    assert want == pytest.approx((s - unmask_drops) * mu / (s - f) + unmask_drops * mu / (t_min - f)) and want >= mu
    assert abs(noise.var() / want - 1.0) < 0.025, (noise.var(), want)
    assert abs(noise.mean()) < 4 * np.sqrt(want / length)


def test_dp_round_aborts_below_t_min() -> None:
    n = 20
    result = run_secagg_round(
        [np.zeros(8, dtype=np.uint32)] * n,
        k=n,
        t=4,
        dp_mu=10.0,
        dropout_rate=0.2,
        dropouts={Phase.MASKED_INPUT: set(range(6))},
    )
    assert isinstance(result.error, NotEnoughParticipants)


# ------------------------------------------------------------------------------------ malicious server


def _unmask_round() -> tuple[Round, int, UnmaskRequest]:
    rnd = Round(n=6, t=3)
    rnd.to_unmask(drop_masked={15})
    me = 10
    request = rnd.server.outbox(me)
    assert isinstance(request, UnmaskRequest)
    assert request.dropped == (15,)
    return rnd, me, request


def _refused(rnd: Round, me: int, bad: UnmaskRequest, error: type[Exception], match: str) -> None:
    dev = rnd.devices[me]
    with pytest.raises(error, match=match):
        dev.receive(bad)
    assert dev.phase is Phase.ERROR
    with pytest.raises(LocalProtocolError):  # nothing can be released afterwards
        dev.send()
    with pytest.raises(LocalProtocolError):
        dev.receive(rnd.server.outbox(me))  # type: ignore[arg-type]


def test_honest_unmask_request_is_answered() -> None:
    rnd, me, request = _unmask_round()
    dev = rnd.devices[me]
    dev.receive(request)
    reply = dev.send()
    assert reply.b_share_ids == request.survivors and reply.s_share_ids == (15,)  # type: ignore[attr-defined]
    assert dev.phase is Phase.DONE


def test_device_refuses_being_listed_as_dropped() -> None:
    rnd, me, req = _unmask_round()
    bad = dataclasses.replace(req, survivors=tuple(v for v in req.survivors if v != me), dropped=(*req.dropped, me))
    _refused(rnd, me, bad, RemoteProtocolError, "as dropped")


def test_device_refuses_an_id_twice() -> None:
    rnd, me, req = _unmask_round()
    _refused(
        rnd,
        me,
        dataclasses.replace(req, survivors=(*req.survivors, req.survivors[-1])),
        RemoteProtocolError,
        "twice",
    )


def test_device_refuses_an_id_in_both_lists() -> None:
    rnd, me, req = _unmask_round()
    other = next(v for v in req.survivors if v != me)
    _refused(rnd, me, dataclasses.replace(req, dropped=(*req.dropped, other)), RemoteProtocolError, "both")


def test_device_refuses_unknown_ids() -> None:
    rnd, me, req = _unmask_round()
    _refused(rnd, me, dataclasses.replace(req, dropped=(*req.dropped, 999)), RemoteProtocolError, "not neighbours")


def test_device_refuses_too_few_survivors() -> None:
    rnd, me, req = _unmask_round()
    others = [v for v in req.survivors if v != me]
    bad = dataclasses.replace(req, survivors=(me, others[0]), dropped=(*req.dropped, *others[1:]))
    _refused(rnd, me, bad, RemoteProtocolError, "below the threshold")


def test_device_refuses_replay_from_another_session() -> None:
    rnd, me, req = _unmask_round()
    _refused(rnd, me, dataclasses.replace(req, session_id=b"\x00" * 32), StaleRound, "session")


def test_device_refuses_message_from_another_round() -> None:
    rnd, me, req = _unmask_round()
    _refused(rnd, me, dataclasses.replace(req, round_id=req.round_id + 1), StaleRound, "round")


def test_device_checks_its_own_keys_and_distinct_keys_in_broadcast() -> None:
    for mutate, match in (
        (
            lambda b, i: dataclasses.replace(
                b, s_public_keys=tuple(b"\x09" * 32 if j == i else k for j, k in enumerate(b.s_public_keys))
            ),
            "own public keys",
        ),
        (
            lambda b, i: dataclasses.replace(b, c_public_keys=(b.c_public_keys[1],) * len(b.c_public_keys)),
            "own public keys|repeated",
        ),
        (lambda b, i: dataclasses.replace(b, neighbour_ids=tuple(v + 100 for v in b.neighbour_ids)), "omits"),
    ):
        rnd = Round(n=4, t=2)
        rnd.step(Phase.ADVERTISE_KEYS)
        me = rnd.ids[0]
        broadcast = rnd.server.outbox(me)
        bad = mutate(broadcast, broadcast.neighbour_ids.index(me))  # type: ignore[union-attr]
        with pytest.raises(RemoteProtocolError, match=match):
            rnd.devices[me].receive(bad)
        assert rnd.devices[me].phase is Phase.ERROR


def test_device_sets_aside_tampered_or_misaddressed_share_ciphertexts() -> None:
    # An unusable ciphertext no longer fails the session; its sender is treated as dropped
    # (no share held, left out of the masks) and reported in the masked input.
    from protocol.errors import RemoteProtocolError

    rnd = Round(n=4, t=2)
    rnd.step(Phase.ADVERTISE_KEYS)
    rnd.step(Phase.SHARE_KEYS)
    me = rnd.ids[0]
    request = rnd.server.outbox(me)
    blobs = list(request.ciphertexts)  # type: ignore[union-attr]
    blobs[0] = blobs[0][:-1] + bytes([blobs[0][-1] ^ 1])
    rnd.devices[me].receive(dataclasses.replace(request, ciphertexts=tuple(blobs)))  # type: ignore[type-var]
    rnd.devices[me].provide_input(np.zeros(rnd.params.vector_length, dtype=np.uint32))
    sent = rnd.devices[me].send()
    assert isinstance(sent, MaskedInput) and sent.bad_share_senders == (request.sender_ids[0],)  # type: ignore[union-attr]
    # Swapping two senders' ciphertexts fails authentication too (src/dst are in the associated data).
    me2 = rnd.ids[1]
    req2 = rnd.server.outbox(me2)
    swapped = dataclasses.replace(req2, ciphertexts=tuple(reversed(req2.ciphertexts)))  # type: ignore[type-var]
    rnd.devices[me2].receive(swapped)
    rnd.devices[me2].provide_input(np.zeros(rnd.params.vector_length, dtype=np.uint32))
    ends = (req2.sender_ids[0], req2.sender_ids[-1])  # type: ignore[union-attr]
    assert rnd.devices[me2].send().bad_share_senders == tuple(sorted(ends))  # type: ignore[union-attr]
    # ... but a device left with fewer than t usable neighbours refuses to mask
    me3 = rnd.ids[2]
    req3 = rnd.server.outbox(me3)
    garbage = tuple(b"\x00" * len(blob) for blob in req3.ciphertexts)  # type: ignore[union-attr]
    with pytest.raises(RemoteProtocolError, match="unusable share ciphertexts"):
        rnd.devices[me3].receive(dataclasses.replace(req3, ciphertexts=garbage))  # type: ignore[type-var]
    assert rnd.devices[me3].phase is Phase.ERROR


# ------------------------------------------------------------------------------------ transitions


def _device_at(state: str) -> tuple[Round, int]:
    """A device in one of the reachable sub-states (phase, whether the server's message arrived)."""
    rnd = Round(n=3, t=2)
    me = rnd.ids[0]
    steps = [
        "advertise",
        "share_wait",
        "share_ready",
        "masked_wait",
        "masked_ready",
        "unmask_wait",
        "unmask_ready",
        "done",
    ]
    target = steps.index(state)
    dev = rnd.devices[me]
    phases = [Phase.ADVERTISE_KEYS, Phase.SHARE_KEYS, Phase.MASKED_INPUT, Phase.UNMASK]
    pos = 0
    for phase in phases:
        if pos == target:
            return rnd, me
        # wait state reached after the previous send; ready after receiving
        for u in rnd.ids:
            d = rnd.devices[u]
            if phase is not Phase.ADVERTISE_KEYS:
                d.receive(rnd.server.outbox(u))  # type: ignore[arg-type]
        if phase is not Phase.ADVERTISE_KEYS:
            pos += 1
            if pos == target:
                return rnd, me
        for u in rnd.ids:
            if phase is Phase.MASKED_INPUT:
                rnd.devices[u].provide_input(rnd.inputs[u])
            rnd.server.receive(u, rnd.devices[u].send())
        pos += 1
    assert dev.phase is Phase.DONE
    return rnd, me


_STATES = [
    "advertise",
    "share_wait",
    "share_ready",
    "masked_wait",
    "masked_ready",
    "unmask_wait",
    "unmask_ready",
    "done",
]
_LEGAL_RECEIVE = {
    "share_wait": "ShareKeysBroadcast",
    "masked_wait": "MaskedInputRequest",
    "unmask_wait": "UnmaskRequest",
}


def test_transition_table_is_complete_for_devices() -> None:
    device_keys = {(p, d, m.__name__) for (r, p, d, m) in TRANSITIONS if r is Role.DEVICE}
    for phase in ACTIVE_PHASES:
        assert (phase, Direction.RECEIVE, "Abort") in device_keys
        assert (phase, Direction.SEND, "Abort") in device_keys
    assert (
        len([k for k in device_keys if k[1] is Direction.SEND and k[2] != "Abort"]) == 5
    )  # the four phase replies and, protocol 1.3, the survivor-set signature


@pytest.mark.parametrize("state", _STATES)
def test_every_illegal_receive_fails_and_poisons_the_device(state: str) -> None:
    for message in sample_messages(round_id=7):
        name = type(message).__name__
        legal = _LEGAL_RECEIVE.get(state) == name or (name in ("Abort", "ErrorMessage") and state != "done")
        if legal:
            continue
        rnd, me = _device_at(state)
        dev = rnd.devices[me]
        with pytest.raises((RemoteProtocolError, LocalProtocolError)):
            dev.receive(message)
        assert dev.phase is Phase.ERROR
        with pytest.raises(LocalProtocolError):
            dev.send()
        with pytest.raises(LocalProtocolError):
            dev.receive(message)


@pytest.mark.parametrize("state", ["share_wait", "masked_wait", "unmask_wait", "done"])
def test_send_without_the_servers_message_is_a_local_error(state: str) -> None:
    rnd, me = _device_at(state)
    dev = rnd.devices[me]
    with pytest.raises(LocalProtocolError):
        dev.send()
    assert dev.phase is Phase.ERROR
    with pytest.raises(LocalProtocolError):
        dev.abort("late")


def test_masked_input_without_input_is_a_local_error() -> None:
    rnd, me = _device_at("masked_ready")
    with pytest.raises(LocalProtocolError, match="provide_input"):
        rnd.devices[me].send()
    assert rnd.devices[me].phase is Phase.ERROR


@pytest.mark.parametrize("state", ["advertise", "share_wait", "share_ready", "masked_ready", "unmask_ready"])
def test_abort_and_error_messages_end_the_device_session(state: str) -> None:
    for message in (
        Abort(round_id=7, device_id=10, reason="server gave up"),
        ErrorMessage(code="round_closed"),
    ):
        rnd, me = _device_at(state)
        dev = rnd.devices[me]
        dev.receive(message)
        assert dev.phase is Phase.ABORTED
        with pytest.raises(LocalProtocolError):
            dev.send()
    rnd, me = _device_at(state)
    assert isinstance(rnd.devices[me].abort("bye"), Abort)
    assert rnd.devices[me].phase is Phase.ABORTED


def test_server_isolates_a_misbehaving_device_and_continues() -> None:
    rnd = Round(n=5, t=3)
    bad = rnd.ids[0]
    # A message of a later phase: the device is excluded, the round goes on.
    with pytest.raises(RemoteProtocolError):
        rnd.server.receive(bad, sample_messages(7, bad)[5])
    with pytest.raises(RemoteProtocolError):  # fails fast afterwards
        rnd.server.receive(bad, rnd.devices[bad].send())
    assert isinstance(rnd.server.outbox(bad), Abort)
    with pytest.raises(RemoteProtocolError):  # unknown device
        rnd.server.receive(999, sample_messages(7, 999)[1])
    with pytest.raises(RemoteProtocolError):  # sender mismatch: the sender is excluded too
        rnd.server.receive(rnd.ids[1], sample_messages(7, rnd.ids[2])[1])
    for u in rnd.ids[2:]:
        msg = rnd.devices[u].send()
        rnd.server.receive(u, msg)
        if u == rnd.ids[2]:
            rnd.server.receive(u, msg)  # an identical retry (before the phase closed) is ignored
    assert rnd.server.phase is Phase.SHARE_KEYS  # quorum of the non-excluded devices closed the phase
    assert rnd.server.dropouts[Phase.ADVERTISE_KEYS] == {bad, rnd.ids[1]}
    # A late message of a closed phase is RoundClosed.
    with pytest.raises(RoundClosed):
        rnd.server.receive(rnd.ids[2], sample_messages(7, rnd.ids[2])[1])


def test_server_result_and_fail_fast() -> None:
    rnd = Round(n=3, t=2)
    with pytest.raises(LocalProtocolError):
        rnd.server.result()
    rnd.to_unmask()
    rnd.step(Phase.UNMASK)
    assert rnd.server.phase is Phase.DONE
    result = rnd.server.result()
    want = np.zeros(rnd.params.vector_length, dtype=np.uint32)
    for x in rnd.inputs.values():
        want += x
    assert np.array_equal(result.total, want)
    assert rnd.server.outbox(rnd.ids[0]) is None
    with pytest.raises(RoundClosed):
        rnd.server.receive(rnd.ids[0], sample_messages(7, rnd.ids[0])[7])
    # An internal failure poisons the server session.
    rnd.server._phase = Phase.ERROR  # noqa: SLF001 - simulate the state the session enters on a bug
    for call in (lambda: rnd.server.advance(10.0), lambda: rnd.server.outbox(rnd.ids[0]), rnd.server.result):
        with pytest.raises(LocalProtocolError):
            call()


def test_server_deadlines_close_phases_and_abort_below_t() -> None:
    rnd = Round(n=4, t=3)
    for u in rnd.ids[:2]:
        rnd.server.receive(u, rnd.devices[u].send())
    assert rnd.server.advance(0.5) is Phase.ADVERTISE_KEYS  # before the deadline nothing happens
    assert rnd.server.advance(1.0) is Phase.ABORTED
    assert isinstance(rnd.server.abort_error, NotEnoughParticipants)
    with pytest.raises(NotEnoughParticipants):
        rnd.server.result()
    assert isinstance(rnd.server.outbox(rnd.ids[0]), Abort)


# -- the rules module (protocol.phases) -------------------------------------------------------------------


def test_server_phases_close_along_the_close_table() -> None:
    from protocol.phases import CLOSE_TRANSITIONS

    assert tuple(CLOSE_TRANSITIONS) == ACTIVE_PHASES
    rnd = Round(n=4, t=2)
    for phase in ACTIVE_PHASES:
        assert rnd.server.phase is phase
        rnd.step(phase)
        assert rnd.server.phase is CLOSE_TRANSITIONS[phase]
    assert rnd.server.phase is Phase.DONE


def test_prune_unmaskable_repeats_to_a_fixed_point() -> None:
    from protocol.phases import prune_unmaskable

    # a path 1-2-3-4: with t = 2 every end keeps 2 (itself and one neighbour) until 4 has not shared
    graph = {1: (1, 2), 2: (1, 2, 3), 3: (2, 3, 4), 4: (3, 4)}
    assert prune_unmaskable({1, 2, 3, 4}, graph, 2) == frozenset({1, 2, 3, 4})
    assert prune_unmaskable({1, 2, 3}, graph, 2) == frozenset({1, 2, 3})
    assert prune_unmaskable({1, 2, 3}, graph, 3) == frozenset()  # 1 loses, then 2, then 3


def test_quorum_and_survivor_rules_name_the_violated_threshold() -> None:
    from protocol.errors import NotEnoughParticipants, RemoteProtocolError
    from protocol.phases import check_survivor_quorum, require_quorum

    with pytest.raises(NotEnoughParticipants, match="t=3"):
        require_quorum(2, "devices", t=3, dp_mu=0.0, dp_t_min=0)
    with pytest.raises(NotEnoughParticipants, match="t_min=5"):
        require_quorum(4, "devices", t=3, dp_mu=1.0, dp_t_min=5)
    require_quorum(4, "devices", t=3, dp_mu=0.0, dp_t_min=5)  # t_min binds only with DP
    invite = dataclasses.replace(sample_messages()[0], graph_k=5, graph_t=3, dp_mu=10.0, dp_t_min=5)
    with pytest.raises(RemoteProtocolError, match="t=3"):
        check_survivor_quorum(2, 10, invite)
    with pytest.raises(RemoteProtocolError, match="smaller than the survivor list"):
        check_survivor_quorum(4, 3, invite)
    with pytest.raises(RemoteProtocolError, match="t_min=5"):
        check_survivor_quorum(3, 4, invite)
    check_survivor_quorum(3, 5, invite)
