"""Protocol 1.11: a server that picks which honest devices count as dropped cannot split a sparse round's sum.

In a sparse SecAgg+ graph a server that reports as dropped the two runs of (k - 1) / 2 ring positions around a
block B of devices, and keeps B and the rest R as survivors, could unmask Σ_B and Σ_R separately: B's pairwise
masks reach only B and the "dropped" walls, whose mask keys the survivors help reconstruct.  With DP, Σ_B
carries only B's share of the noise.  Since 1.11 the graph is the ring over the signed roster, which every
device recomputes, and a device signs no survivor set that leaves two runs with at most ⌊γ n⌋ survivors
(`protocol.graph.survivor_cut`).  The attack runs here with the real sessions: refused with a typed error before
any share leaves; and, as the control, with that check switched off, where the server's arithmetic recovers Σ_B
exactly.  The same attack over HTTP is in tests/test_server_lies_http.py.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import crypto
from protocol.device_session import DeviceSecAggSession
from protocol.errors import RemoteProtocolError, SurvivorSetSplit
from protocol.graph import find_parameters, ring_graph, ring_neighbourhood, roster_ring, survivor_cut
from protocol.identity import SigningKey, issue_certificate, roster_digest
from protocol.masking import MaskedSumAccumulator, pair_mask_keys
from protocol.messages import ConsistencyRequest, ConsistencySignature, UnmaskRequest
from protocol.phases import Phase, consistency_deadline
from protocol.policy import PrivacyPolicy
from protocol.round_params import RoundParameters
from protocol.samplers import insecure_test_noise_stream
from protocol.server_session import ServerSecAggSession
from protocol.shamir import Share, reconstruct

LENGTH = 8
N, GAMMA, OMEGA = 100, 0.05, 0.33


def _walled_round(*, block: int, check: bool, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A signed round of N devices with the finder's sparse (k, t).  The server keeps the masked inputs of a
    block B of ``block`` consecutive ring positions and of the rest R, and "loses" those of the two walls of
    (k - 1) / 2 positions around B.  Returns the outcome: who refused, and what the server could compute."""
    if not check:  # the control: a device of protocol 1.10, which signed any consistent set
        monkeypatch.setattr(DeviceSecAggSession, "_check_survivor_cut", lambda self, members: None)
    server, devices, ring = _signed_cohort(list(range(1000, 1000 + N)), round_id=5, noise_seed=7)
    params, ids = server.params, list(devices)
    half = (params.k - 1) // 2
    inside = list(ring[:block])
    walls = set(ring[block : block + half]) | set(ring[N - half :])
    rng = np.random.default_rng(3)
    inputs = {u: rng.integers(0, 2**32, size=LENGTH, dtype=np.uint32) for u in ids}
    masked: dict[int, np.ndarray] = {}
    for index in range(3):
        for u, dev in devices.items():
            if index > 0:
                dev.receive(server.outbox(u))
            if index == 2:
                dev.provide_input(inputs[u])
            message = dev.send()
            if index == 2:
                masked[u] = message.masked
                if u in walls:
                    continue  # the lie: these masked inputs "never arrived"
            server.receive(u, message)
        server.advance(params.deadlines[index])
    survivors = sorted(set(ids) - walls)
    out: dict[str, Any] = {"refused": {}, "ring": ring, "inside": inside, "walls": walls, "k": params.k, "t": params.t}
    signed = []
    for u in survivors:
        request = server.outbox(u)
        assert isinstance(request, ConsistencyRequest) and request.survivor_set == tuple(survivors)
        try:
            devices[u].receive(request)
        except RemoteProtocolError as exc:
            out["refused"][u] = exc
            assert devices[u].phase is Phase.ERROR
            continue
        reply = devices[u].send()
        assert isinstance(reply, ConsistencySignature)
        server.receive(u, reply)
        signed.append(u)
    if len(signed) < len(survivors):
        return out
    server.advance(consistency_deadline(params.deadlines))
    b_shares: dict[int, list[Share]] = {}
    s_shares: dict[int, list[Share]] = {}
    for u in survivors:
        request = server.outbox(u)
        assert isinstance(request, UnmaskRequest)
        devices[u].receive(request)
        response = devices[u].send()
        for owner, blob in zip(response.b_share_ids, response.b_shares, strict=True):
            b_shares.setdefault(owner, []).append(Share.from_bytes(blob))
        for owner, blob in zip(response.s_share_ids, response.s_shares, strict=True):
            s_shares.setdefault(owner, []).append(Share.from_bytes(blob))
    # The server's arithmetic on what it now holds: B's masked inputs, B's self masks, and the pairwise
    # masks between B and the walls (from the walls' reconstructed mask keys).
    session = server.session_id
    acc = MaskedSumAccumulator(LENGTH)
    for b in inside:
        acc.add(masked[b])
        acc.remove_self_mask(reconstruct(b_shares[b], params.t), session, b)
    graph = ring_graph(ring, params.k, ids)
    for w in sorted(walls):
        peers = {b: devices[b]._s.public_key for b in inside if b in graph[w]}
        if not peers:
            continue
        pair = crypto.key_pair_from_private_bytes(reconstruct(s_shares[w], params.t))
        for u, key in pair_mask_keys(pair.private_key, peers, session, w).items():
            acc.remove_pair_mask(u, w, key)
    expected = np.zeros(LENGTH, dtype=np.uint32)
    for b in inside:
        expected += inputs[b]
    out["partial"], out["expected"] = acc.total(), expected
    return out


def test_walls_of_dropouts_around_a_block_are_refused_before_any_share(monkeypatch: pytest.MonkeyPatch) -> None:
    out = _walled_round(block=20, check=True, monkeypatch=monkeypatch)
    assert (out["k"], out["t"]) == (29, 7)
    survivors = set(out["ring"]) - out["walls"]
    assert set(out["refused"]) == survivors  # every survivor, inside B or not, refuses to sign
    assert all(isinstance(e, SurvivorSetSplit) for e in out["refused"].values())
    assert "with 0 survivors, no more than the 5 colluders" in str(next(iter(out["refused"].values())))
    assert "partial" not in out


def test_the_same_walls_give_the_block_sum_to_a_server_without_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    # The control: devices that sign any consistent survivor set (protocol 1.10) hand the server Σ_B, the sum
    # of 20 of the 72 survivors, next to the round's own sum.
    out = _walled_round(block=20, check=False, monkeypatch=monkeypatch)
    assert out["refused"] == {}
    assert np.array_equal(out["partial"], out["expected"])


def test_an_honest_round_of_random_dropouts_passes_the_check() -> None:
    # The same cohort with the walls' share of dropouts (28 of 100) spread at random: far above the cut.
    g = find_parameters(N, OMEGA, GAMMA)
    ids = list(range(N))
    rng = np.random.default_rng(0)
    ring = roster_ring(tuple(ids), b"\x01" * 32)
    for _ in range(200):
        dropped = set(rng.choice(ids, size=int(OMEGA * N), replace=False).tolist())
        assert survivor_cut(ring, set(ids) - dropped, g.k) > int(GAMMA * N)


def _brute_cut(ring: list[int], alive: set[int], k: int) -> int:
    n, half = len(ring), (k - 1) // 2
    runs = [{(i + o) % n for o in range(half)} for i in range(n)]
    return min(sum(ring[p] in alive for p in a | b) for a, b in itertools.product(runs, runs) if not a & b)


def _components(graph: dict[int, tuple[int, ...]], alive: set[int]) -> int:
    seen: set[int] = set()
    count = 0
    for start in alive:
        if start in seen:
            continue
        count += 1
        stack = [start]
        seen.add(start)
        while stack:
            v = stack.pop()
            for w in graph[v]:
                if w in alive and w not in seen:
                    seen.add(w)
                    stack.append(w)
    return count


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_the_cut_is_exact_and_above_it_no_colluders_split_the_survivors(data: st.DataObject) -> None:
    # `survivor_cut` equals a brute force over every pair of disjoint runs; and when it exceeds f, removing
    # any f survivors (the colluders) leaves the other survivors' mask graph connected, so the server can
    # unmask only their whole sum.  Proof: an edge spans at most (k-1)/2 positions, so a cut needs two runs
    # of (k-1)/2 positions without a remaining survivor; the cut says any two such runs hold more than f.
    n = data.draw(st.integers(5, 30), label="n")
    k = data.draw(st.sampled_from([v for v in range(3, n) if v % 2 == 1]), label="k")
    ring = data.draw(st.permutations(list(range(n))), label="ring")
    alive = set(data.draw(st.sets(st.sampled_from(ring), min_size=1), label="alive"))
    cut = survivor_cut(ring, alive, k)
    assert cut == _brute_cut(ring, alive, k)
    graph = ring_graph(ring, k, ring)
    if cut > 0:
        f = data.draw(st.integers(0, cut - 1), label="f")
        colluders = set(data.draw(st.lists(st.sampled_from(sorted(alive)), max_size=f, unique=True), label="c"))
        rest = alive - colluders
        if rest:
            assert _components(graph, rest) == 1
    for v in ring:
        assert set(graph[v]) == ring_neighbourhood(ring, v, k)


def test_the_ring_is_the_roster_s_and_the_server_builds_it() -> None:
    ids = list(range(10, 60))
    keys = [bytes([i]) * 32 for i in range(len(ids))]
    digest = roster_digest(ids, keys)
    ring = roster_ring(tuple(ids), digest)
    assert sorted(ring) == ids and list(ring) != ids
    assert roster_ring(tuple(ids), roster_digest(ids, keys[::-1])) != ring  # another roster, another ring
    with pytest.raises(ValueError, match="each device once"):
        roster_ring((1, 1), digest)
    graph = ring_graph(ring, 9, set(ids) - {ring[3]})  # a roster device that never advertised leaves a hole
    assert ring[3] not in graph and all(ring[3] not in row for row in graph.values())
    assert len(graph[ring[0]]) == 8 and len(graph[ring[10]]) == 9
    assert all(v in graph[w] for v, row in graph.items() for w in row)  # symmetric


def _signed_cohort(
    ids: list[int], *, round_id: int, noise_seed: int
) -> tuple[ServerSecAggSession, dict[int, DeviceSecAggSession], tuple[int, ...]]:
    """A signed round over ``ids`` with the finder's (k, t) at γ = 0.05, ω = 0.33, devices pinning the authority
    with that γ, and the roster ring they all recompute."""
    g = find_parameters(len(ids), OMEGA, GAMMA)
    authority = SigningKey.generate()
    keys = {u: SigningKey.generate() for u in ids}
    params = RoundParameters(
        round_id=round_id, vector_length=LENGTH, k=g.k, t=g.t, clip_norm=1.0, scale_bits=16,
        deadlines=(1.0, 2.0, 3.0, 4.0), authority_key=authority.public_key,
    )  # fmt: skip
    server = ServerSecAggSession(
        params, ids, rng=np.random.default_rng(0), identities={u: keys[u].public_key for u in ids}
    )
    policy = PrivacyPolicy(adversary_rate=GAMMA, require_noise=False)
    devices = {
        u: DeviceSecAggSession(
            server.outbox(u),
            rng=insecure_test_noise_stream(noise_seed, u),
            identity=keys[u],
            certificate=issue_certificate(authority, keys[u].public_key),
            authority_key=authority.public_key,
            policy=policy,
        )  # fmt: skip
        for u in ids
    }
    return server, devices, roster_ring(tuple(ids), roster_digest(ids, [keys[u].public_key for u in ids]))


def _cohort(n: int = 40) -> tuple[ServerSecAggSession, dict[int, DeviceSecAggSession], tuple[int, ...]]:
    """`_signed_cohort` of n devices with the key advertisement done."""
    server, devices, ring = _signed_cohort(list(range(n)), round_id=9, noise_seed=1)
    for u, dev in devices.items():
        server.receive(u, dev.send())
    server.advance(1.0)
    return server, devices, ring


def _without(broadcast: Any, drop: int, add: tuple[Any, ...] | None = None) -> Any:
    fields = ("neighbour_ids", "c_public_keys", "s_public_keys", "certificates", "signatures")
    rows = [row for row in zip(*(getattr(broadcast, f) for f in fields), strict=True) if row[0] != drop]
    if add is not None:
        rows.append(add)
    return dataclasses.replace(
        broadcast, **{f: tuple(col) for f, col in zip(fields, zip(*rows, strict=True), strict=True)}
    )


def test_a_neighbour_off_the_roster_ring_is_refused_before_any_share() -> None:
    server, devices, ring = _cohort()
    x = ring[0]
    far = ring[len(ring) // 2]  # opposite X on the ring: the server's choice, not the roster's
    source = server.outbox(far)
    row = next(
        r
        for r in zip(
            source.neighbour_ids,
            source.c_public_keys,
            source.s_public_keys,
            source.certificates,
            source.signatures,
            strict=True,
        )
        if r[0] == far
    )  # noqa: E501
    mine = server.outbox(x)
    assert set(mine.neighbour_ids) == ring_neighbourhood(ring, x, server.params.k)
    lie = _without(mine, ring[1], add=row)
    with pytest.raises(RemoteProtocolError, match="not within .* positions of this device on the signed roster's ring"):
        devices[x].receive(lie)
    assert devices[x].phase is Phase.ERROR and not devices[x]._held_b


def test_an_edge_the_server_hides_from_both_ends_is_refused_at_the_survivor_set() -> None:
    # The server leaves A out of B's key broadcast and B out of A's: neither masks with the other, both
    # survive.  Cutting edges this way could split the survivors without a single dropout; A (and B) see a
    # ring neighbour in the survivor set they never masked with and sign nothing.
    server, devices, ring = _cohort()
    a, b = ring[0], ring[1]
    rng = np.random.default_rng(2)
    graph = server._graph  # the lying server's own graph, from which it builds the broadcasts
    graph[a] = tuple(v for v in graph[a] if v != b)
    graph[b] = tuple(v for v in graph[b] if v != a)
    for u, dev in devices.items():
        dev.receive(server.outbox(u))
        server.receive(u, dev.send())
    server.advance(2.0)
    for u, dev in devices.items():
        dev.receive(server.outbox(u))
        dev.provide_input(rng.integers(0, 2**32, size=LENGTH, dtype=np.uint32))
        server.receive(u, dev.send())
    server.advance(3.0)
    refused = {}
    for u, dev in devices.items():
        request = server.outbox(u)
        if not isinstance(request, ConsistencyRequest):
            continue
        try:
            dev.receive(request)
        except SurvivorSetSplit as exc:
            refused[u] = str(exc)
    assert set(refused) == {a, b}
    assert f"ring neighbours [{b}] this device never masked with" in refused[a]
